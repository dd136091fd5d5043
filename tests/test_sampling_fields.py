"""vLLM's sampling extensions in the decode loop: min_tokens, ignore_eos, repetition / frequency / presence penalties,
min_p (``core/processors.py``, ``core/sampling.py``), applied to the target's p and to every drafter's q.

- the processors equal vLLM's formulas (``vllm/model_executor/layers/utils.py`` ``apply_penalties``,
  ``vllm/v1/sample/logits_processor/builtin.py``), row by row of a verify step whose context grows by the drafts;
- greedy decoding with each field through the engine, speculating with every registered drafter (their untrained
  examples), the reference draft and the target drafting for itself (every draft accepted: the drafter's processed
  argmax is the target's, row by row), equals plain greedy decoding with the same field;
- sampling with them stays lossless: chi-square against the law computed by enumeration (``lossless.
  processed_law``) and against plain sampling, for a draft model (q processed like p) and n-gram lookup (q None);
- drafters' q follow the processors: no stop id is drafted before min_tokens, penalties lower q of seen tokens.
"""

from __future__ import annotations

import pytest
import torch

import lossless
from draftsmith import drafters, reference
from draftsmith.core.generate import GenerationConfig, generate_plain
from draftsmith.core.processors import Penalties, SequenceProcessors
from draftsmith.core.proposer import PerSequence, Sampling
from draftsmith.core.sampling import logits_to_probs
from draftsmith.core.target import TargetModel
from draftsmith.drafters.draft_model.proposer import BatchDraftModelProposer
from draftsmith.drafters.ngram.proposer import NgramProposer
from draftsmith.drafters.speculative import SpeculativeConfig
from draftsmith.serve.engine import Engine


def vllm_penalized(logits, prompt, output, rep, freq, pres):
    """vLLM's ``apply_penalties`` for one row [V] (``apply_repetition_penalties_torch``, then the OpenAI terms)."""
    v = logits.shape[-1]
    prompt_mask = torch.bincount(torch.tensor(prompt, dtype=torch.long), minlength=v)[:v] > 0
    counts = torch.bincount(torch.tensor(output, dtype=torch.long), minlength=v)[:v].float()
    penalties = torch.where(prompt_mask | (counts > 0), rep, 1.0)
    logits = logits * torch.where(logits > 0, 1.0 / penalties, penalties)
    return logits - freq * counts - pres * (counts > 0).float()


def test_penalties_match_vllm_row_by_row():
    """Verify row r reads prompt + output + d_1..d_r; a drafter's draft i reads d_1..d_{i-1}; an EAGLE-3 head's
    columns map to target ids."""
    gen = torch.Generator().manual_seed(0)
    v, prompt, output, drafts = 50, [3, 4, 4, 9], [7, 3, 11], [11, 20, 7]
    logits = torch.randn(len(drafts) + 1, v, generator=gen) * 3
    procs = SequenceProcessors(Penalties(1.3, 0.4, 0.7), prompt, output)
    got = procs.apply(logits, drafts)
    for r in range(len(drafts) + 1):
        want = vllm_penalized(logits[r], prompt, output + drafts[:r], 1.3, 0.4, 0.7)
        torch.testing.assert_close(got[r], want)
    torch.testing.assert_close(procs.apply(logits[2], drafts[:2], first=2), got[2])  # one drafter row
    ids = torch.tensor([20, 3, 7, 40, 0])  # a draft vocabulary of 5 target ids
    torch.testing.assert_close(procs.apply(logits[1, ids], drafts[:1], first=1, ids=ids, vocab_size=v), got[1, ids])
    output.append(20)  # the live output list grew: counts follow it
    torch.testing.assert_close(procs.apply(logits[0]), vllm_penalized(logits[0], prompt, output, 1.3, 0.4, 0.7))


def test_min_tokens_masks_stop_ids_until_reached():
    v, output = 10, [1, 2]
    procs = SequenceProcessors(Penalties(min_tokens=4, min_tokens_ids=(0, 5)), [1], output)
    got = procs.apply(torch.zeros(4, v), [3, 3, 3])  # rows after 2, 3, 4, 5 generated tokens
    masked = torch.isinf(got)
    assert masked[:2, [0, 5]].all() and not masked[2:].any() and masked.sum() == 4
    ids = torch.tensor([5, 6, 0])
    assert torch.isinf(procs.apply(torch.zeros(3), ids=ids, vocab_size=v)).tolist() == [True, False, True]


def test_min_p_keeps_tokens_within_min_p_of_the_top():
    logits = torch.log(torch.tensor([[0.5, 0.3, 0.15, 0.05]]))
    probs = logits_to_probs(logits, 1.0, min_p=0.35)  # keeps p >= 0.175
    torch.testing.assert_close(probs, torch.tensor([[0.625, 0.375, 0.0, 0.0]]))
    assert torch.equal(logits_to_probs(logits, 2.0, min_p=0.0), logits_to_probs(logits, 2.0))
    with pytest.raises(ValueError, match="min_p"):
        logits_to_probs(logits, 1.0, min_p=1.5)


def test_generation_config_refuses_bad_fields():
    for bad, match in (
        (dict(min_tokens=5, max_new_tokens=4), "min_tokens"),
        (dict(repetition_penalty=0.0), "repetition_penalty"),
        (dict(repetition_penalty=float("inf")), "repetition_penalty"),
        (dict(min_p=-0.1), "min_p"),
        (dict(frequency_penalty=float("nan")), "frequency_penalty"),
    ):
        with pytest.raises(ValueError, match=match):
            GenerationConfig(**bad)


# ------------------------------------------------------------------------------- greedy through the engine


@pytest.fixture(scope="module")
def reference_served(tmp_path_factory):
    """The reference target, one held-out prompt, its plain greedy tokens, and each drafter's example config."""
    from draftsmith.data_pipeline.chat import prompt_ids

    model, tok = reference.target()
    records = reference.tasks(["code-complete"], limit=1)
    ids = prompt_ids(tok, next(iter(records.values()))[0]["messages"]).tolist()
    base = generate_plain(TargetModel(model, tok), ids, GenerationConfig(max_new_tokens=24)).tokens
    specs = {}

    def spec(name):
        if name not in specs:
            if name in DRAFT_MODELS:
                specs[name] = SpeculativeConfig("draft_model", DRAFT_MODELS[name], 3)
            else:
                specs[name] = drafters.get(name).example(model, tok, tmp_path_factory.mktemp(name)).with_k(3)
        return specs[name]

    return model, tok, ids, base, spec


def _field_settings(base: list[int]) -> dict[str, tuple[dict, dict | None]]:
    """Each field with a value that changes the reference target's greedy output on the prompt, and the settings
    without it that it changes (None: greedy ignores it). The stop token is one plain greedy emits early, so that
    min_tokens and ignore_eos matter."""
    early = base[2]
    return {
        "repetition_penalty": (dict(repetition_penalty=1.5), {}),
        "frequency_presence": (dict(frequency_penalty=0.8, presence_penalty=0.5), {}),
        "min_tokens": (dict(stop_token_ids=(early,), min_tokens=6), dict(stop_token_ids=(early,))),
        "ignore_eos": (dict(eos_token_ids=(early,), ignore_eos=True), dict(eos_token_ids=(early,))),
        "min_p_greedy": (dict(min_p=0.5), None),  # greedy ignores min_p (vLLM: an argmax-invariant processor)
    }


FIELDS = ["repetition_penalty", "frequency_presence", "min_tokens", "ignore_eos", "min_p_greedy"]
DRAFT_MODELS = {"reference_draft": "reference-draft", "self_draft": "reference"}  # drafts that get accepted


@pytest.mark.parametrize("field", FIELDS)
@pytest.mark.parametrize("name", list(drafters.names()) + list(DRAFT_MODELS))
def test_greedy_with_a_field_equals_plain_greedy_with_it(reference_served, name, field):
    model, tok, ids, base, spec = reference_served
    settings, without = _field_settings(base)[field]
    cfg = GenerationConfig(max_new_tokens=24, **settings)
    plain = generate_plain(TargetModel(model, tok), ids, cfg)
    engine = Engine(model, tok, spec(name))
    try:
        out = engine.generate(ids, cfg)
    finally:
        engine.close()
    assert out.tokens == plain.tokens, f"{name} with {field}: greedy output differs from plain greedy"
    assert out.stats.num_drafts > 0
    if name == "self_draft":  # the drafter's processed argmax is the target's, row by row: all accepted
        assert out.stats.acceptance_rate > 0.95, out.stats
    if without is not None:
        other = generate_plain(TargetModel(model, tok), ids, GenerationConfig(max_new_tokens=24, **without))
        assert plain.tokens != other.tokens, f"{field} should change the output (the test would be vacuous)"
    if field == "min_tokens":
        assert base[2] not in plain.tokens[:6]
    if field == "ignore_eos":
        assert plain.tokens == base and plain.finish_reason == "length"


@pytest.mark.parametrize("name", list(drafters.names()) + ["self_draft"])
def test_rows_with_different_fields_decode_together_as_alone(reference_served, name):
    """One batch: a row per field (and a plain one), joining at different steps: each equals plain greedy alone."""
    from draftsmith.core.batch import BatchDecoder, BatchSequence

    model, tok, ids, base, spec = reference_served
    cfgs = [GenerationConfig(max_new_tokens=16)]
    cfgs += [GenerationConfig(max_new_tokens=16, **_field_settings(base)[f][0]) for f in FIELDS]
    prompts = [ids[: len(ids) - i] for i in range(len(cfgs))]
    plain = [generate_plain(TargetModel(model, tok), p, c).tokens for p, c in zip(prompts, cfgs)]
    engine = Engine(model, tok, spec(name))
    decoder = BatchDecoder(engine.target, engine.drafter.new_batch_proposer(), 3, max_num_seqs=4)
    seqs = [BatchSequence(p, c) for p, c in zip(prompts, cfgs)]
    for seq in seqs[:3]:
        decoder.add(seq)
    decoder.step()
    for seq in seqs[3:]:
        decoder.add(seq)
    decoder.run()
    engine.close()
    for i, seq in enumerate(seqs):
        assert seq.error is None and seq.result.tokens == plain[i], f"{name}: row {i} differs from plain greedy"


# ------------------------------------------------------------------------------------------ lossless


SETTINGS = {
    "repetition_penalty": dict(temperature=1.0, repetition_penalty=1.6),
    "frequency_presence": dict(temperature=1.0, frequency_penalty=0.7, presence_penalty=0.4),
    "min_p": dict(temperature=1.0, min_p=0.15),
    "min_tokens": dict(temperature=1.0, min_tokens=lossless.NEW - 1, stop_token_ids=(3, 5)),
}


@pytest.fixture(scope="module")
def stub_target():
    return TargetModel(lossless.TrigramLM(lossless.TARGET_TABLE))


def test_processed_law_without_processing_is_the_exact_law():
    torch.testing.assert_close(lossless.processed_law({"temperature": 0.7}), lossless.exact_law({"temperature": 0.7}))


@pytest.mark.parametrize("setting", list(SETTINGS))
@pytest.mark.parametrize("method", ["draft_model", "ngram"])
def test_sampling_with_processors_is_lossless(stub_target, method, setting):
    """Batches of 16, continuous batching: every adjacent pair follows the processed law and plain sampling."""
    settings = SETTINGS[setting]
    law = lossless.processed_law(settings)
    if method == "draft_model":
        proposer = BatchDraftModelProposer(lossless.TrigramLM(lossless.DRAFT_TABLE), lossless.V)
    else:
        proposer = PerSequence(lambda sampling: NgramProposer(1, 3))
    plain, _ = lossless.run_trials_batched(stub_target, None, settings, 64)
    seqs, stats = lossless.run_trials_batched(stub_target, proposer, settings, 16)
    lossless.check_counters(stats)
    assert 0 < stats.num_accepted_tokens < stats.num_draft_tokens
    lossless.check_lossless(seqs, plain, settings, law)
    if setting == "min_tokens":
        assert not torch.isin(seqs[:, :-1], torch.tensor([3, 5])).any()


@pytest.mark.parametrize("name", drafters.names())
def test_every_drafter_samples_losslessly_with_processors(tmp_path, name):
    """Each registered drafter's batched proposer (its example export on the stub target) drafting with the
    request's processors (repetition penalty, min_p and min_tokens together): the processed law holds."""
    settings = dict(
        temperature=1.0, repetition_penalty=1.4, min_p=0.05, min_tokens=lossless.NEW - 1, stop_token_ids=(3,)
    )
    model, tok = lossless.TrigramLM(lossless.TARGET_TABLE), lossless.word_tokenizer()
    engine = Engine(model, tok, drafters.get(name).example(model, tok, tmp_path).with_k(lossless.K))
    try:
        plain, _ = lossless.run_trials_batched(engine.target, None, settings, 64)
        seqs, stats = lossless.run_trials_batched(engine.target, engine.drafter.new_batch_proposer(), settings, 16)
    finally:
        engine.close()
    lossless.check_counters(stats)
    assert stats.num_drafts >= lossless.TRIALS and stats.num_accepted_tokens > 0
    lossless.check_lossless(seqs, plain, settings, lossless.processed_law(settings))


def test_the_processed_law_has_power(stub_target):
    """Sampling with a repetition penalty is told apart from sampling without one by the same test."""
    settings = SETTINGS["repetition_penalty"]
    law = lossless.processed_law(settings)
    seqs, _ = lossless.run_trials_batched(stub_target, None, {"temperature": 1.0}, 64)
    pvalues = [
        lossless.pooled_pvalue(lossless.pair_counts(seqs, i), lossless.TRIALS * lossless.pair_law(law, i))
        for i in range(lossless.NEW - 1)
    ]
    assert min(pvalues) < lossless.ALPHA


def test_drafts_follow_the_processors():
    """A draft model's q is processed like p: q = softmax(vLLM-penalised draft logits), stop ids masked before
    min_tokens."""
    draft = lossless.TrigramLM(lossless.DRAFT_TABLE)
    prompt, first = torch.tensor(lossless.PROMPT), 2
    output = [first]  # what the decode loop has emitted when the drafter starts
    procs = SequenceProcessors(Penalties(repetition_penalty=3.0, min_tokens=3, min_tokens_ids=(3,)), prompt, output)
    proposer = BatchDraftModelProposer(draft, lossless.V)
    proposer.start(0, prompt, first, None, Sampling(1.0, seed=0, processors=procs))
    (proposal,) = proposer.propose([0], [3])
    assert proposal.q.shape == (3, lossless.V)
    assert (proposal.q[:2, 3] == 0).all() and proposal.q[2, 3] > 0  # drafts after 1, 2 tokens: masked; 3: free
    logits = lossless.DRAFT_TABLE[int(prompt[-1]), first].clone()
    logits[3] = float("-inf")
    want = torch.softmax(vllm_penalized(logits, prompt.tolist(), output, 3.0, 0.0, 0.0), -1)
    torch.testing.assert_close(proposal.q[0], want)
