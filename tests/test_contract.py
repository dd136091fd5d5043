"""The contract every registered drafter meets (``drafters.base.Drafter``), with no test edit per drafter.

Each test is parametrised over ``drafters.names()``; a drafter is served from what its own ``example`` builds
(untrained weights, warm-started where that applies) and trained from its ``example_section``:

- ``greedy``: speculative greedy decoding equals plain greedy decoding, k in {1, 3, 5}, on the reference target
  and on a tiny random Llama, through the engine (``serve.engine.Engine``), as served;
- ``lossless``: sampled output follows the target's law, T in {0.5, 1.0} (chi-square against the stub target's
  exact law and against plain sampling, ``tests/lossless.py``; ``test_lossless_sampling`` shows the power);
- ``export``: an export re-exported (read, checked, written again) is bit-identical, tensor by tensor;
- ``refusal``: another target is refused, the error naming the field that differs;
- ``serve``: the HTTP server answers with the plain text and counts the drafts in /metrics;
- ``train``: one training step, and a run interrupted after its first checkpoint resumes to the same weights;
- ``auto``: adaptive speculation (``"num_speculative_tokens": "auto"``): under any schedule of k per step (0 for
  plain steps included, a function of nothing the drafts hold, as the policy's choice is) greedy equals plain greedy
  in batches with rows joining, and sampling in batches of 1 and 4 follows the target's law; through the engine
  (the cost model measured at startup, then cached) greedy equals plain and /metrics shows the chosen k;
- ``batch``: in the batched runtime (``core.batch``: rows joining and leaving, chunked prefill, a queue), each
  greedy sequence equals plain greedy alone and its counters equal the engine's for it alone; sampling in batches
  of 1, 4 and 16 follows the target's law; a row that stops, hits max_tokens or is cancelled mid-run leaves the
  other rows' outputs unchanged.

A drafter that cannot meet a contract says so in ``Drafter.opt_outs`` (contract name -> reason); the test is
then skipped with that reason, and ``test_opt_outs_name_contracts`` keeps those names honest.
"""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file

from conftest import make_tiny_llama, make_word_tokenizer
from draftsmith import drafters, reference
from draftsmith.core.batch import BatchDecoder, BatchSequence
from draftsmith.core.generate import GenerationConfig, generate_plain
from draftsmith.core.onednn import PackedLinear, pack_linears
from draftsmith.core.target import TargetModel
from draftsmith.drafters.speculative import SpeculativeConfig
from draftsmith.serve.engine import Engine

CONTRACTS = ("greedy", "lossless", "export", "refusal", "serve", "train", "batch", "auto")
NAMES = drafters.names()


def honour_opt_out(name: str, contract: str) -> None:
    """Skip with the drafter's stated reason when it opts out of ``contract``."""
    reason = drafters.get(name).opt_outs.get(contract)
    if reason:
        pytest.skip(f"{name} opts out of {contract}: {reason}")


def test_opt_outs_name_contracts():
    for drafter in drafters.all_drafters():
        for contract, reason in drafter.opt_outs.items():
            assert contract in CONTRACTS, f"{drafter.name}: opt-out of unknown contract {contract!r}"
            assert isinstance(reason, str) and len(reason) > 10, f"{drafter.name}: {contract} needs a reason"
        assert drafter.trainable == (drafter.example_section() is not None) or "train" in drafter.opt_outs


def test_cli_lists_every_registered_drafter(capsys):
    from draftsmith.cli import main

    assert main(["drafters"]) == 0
    listed = [line.split()[0] for line in capsys.readouterr().out.splitlines()]
    assert listed == list(NAMES)


# --------------------------------------------------------------------------------------------- targets


def tiny_target():
    """A random 8-layer Llama (hidden 32, V = 96) and a word tokenizer; the prompts repeat, so lookup accepts."""
    tok = make_word_tokenizer(96)
    return (
        make_tiny_llama(seed=11, num_hidden_layers=8),
        tok,
        [[5, 6, 7, 8, 9, 5, 6, 7, 10, 11, 5, 6], [20, 21, 22, 20, 21, 22, 23]],
    )


def reference_target():
    """The reference target and two held-out prompts."""
    from draftsmith.data_pipeline.chat import prompt_ids

    model, tok = reference.target()
    records = reference.tasks(["code-complete", "docstring"], limit=1)
    return model, tok, [prompt_ids(tok, r[0]["messages"]).tolist() for r in records.values()]


TARGETS = {"tiny": tiny_target, "reference": reference_target}


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    """``served(target, drafter)`` -> (model, tokenizer, prompts, example speculative config), built once."""
    cache: dict = {}

    def get(target: str, name: str):
        if target not in cache:
            cache[target] = TARGETS[target]()
        model, tok, prompts = cache[target]
        key = (target, name)
        if key not in cache:
            cache[key] = drafters.get(name).example(model, tok, tmp_path_factory.mktemp(f"{target}-{name}"))
        return model, tok, prompts, cache[key]

    return get


# ---------------------------------------------------------------------------------------------- greedy


@pytest.mark.parametrize("name", NAMES)
@pytest.mark.parametrize("target", list(TARGETS))
def test_greedy_equals_plain_greedy(served, target, name):
    honour_opt_out(name, "greedy")
    model, tok, prompts, spec = served(target, name)
    for k in (1, 3, 5):
        assert_greedy_equals_plain(model, tok, prompts, spec, k, f"{name} k={k} on {target}")


def assert_greedy_equals_plain(model, tok, prompts, spec, k: int, what: str, onednn: str = "off") -> Engine:
    """Every prompt's greedy output through an engine drafting up to ``k`` equals plain greedy, and something was
    drafted (else the check would be vacuous); returns the engine."""
    engine = Engine(model, tok, spec.with_k(k), onednn=onednn)
    drafts = 0
    for ids in prompts:
        cfg = GenerationConfig(max_new_tokens=24, temperature=0.0, eos_token_ids=engine.eos_token_ids)
        plain = generate_plain(TargetModel(model, tok), ids, cfg)
        spec_out = engine.generate(ids, cfg)
        assert spec_out.tokens == plain.tokens, f"{what}: greedy output differs"
        assert spec_out.stats.num_draft_tokens <= k * spec_out.stats.num_drafts
        drafts += spec_out.stats.num_drafts
    assert drafts > 0, f"{what}: nothing was drafted, the test would be vacuous"
    return engine


@pytest.fixture(scope="module")
def packed_reference():
    """The reference target with its linears packed for oneDNN (``core.onednn``, as ``draftsmith serve`` runs it
    on a CPU by default, with the drafter's): its own copy, so the other contracts keep MKL's kernels."""
    model, tok, prompts = reference_target()
    if not pack_linears(model):
        pytest.skip("torch has no oneDNN here")
    return model, tok, prompts


@pytest.mark.parametrize("name", NAMES)
def test_greedy_equals_plain_greedy_with_onednn_linears(packed_reference, tmp_path, name):
    honour_opt_out(name, "greedy")
    model, tok, prompts = packed_reference
    spec = drafters.get(name).example(model, tok, tmp_path)
    engine = assert_greedy_equals_plain(model, tok, prompts, spec, 3, f"{name} k=3 with oneDNN linears", "on")
    drafter_linears = [
        m for module in engine.drafter.modules for m in module.modules() if isinstance(m, torch.nn.Linear)
    ]
    assert all(type(m) is PackedLinear for m in drafter_linears), f"{name}: the drafter's linears were not packed"
    assert engine.packed_linears == len(drafter_linears)  # the target's were packed before the engine was built


# -------------------------------------------------------------------------------------------- lossless


@pytest.fixture(scope="module")
def stub(tmp_path_factory):
    """The stub target of ``tests/lossless.py``, its tokenizer, and plain-sampling runs per temperature."""
    import lossless

    model, tok = lossless.TrigramLM(lossless.TARGET_TABLE), lossless.word_tokenizer()
    plain = {t: lossless.run_trials(TargetModel(model), None, {"temperature": t})[0] for t in (0.5, 1.0)}
    return model, tok, plain, tmp_path_factory.mktemp("stub")


@pytest.mark.parametrize("name", NAMES)
@pytest.mark.parametrize("temperature", [0.5, 1.0])
def test_sampling_is_lossless(stub, name, temperature):
    """Every adjacent pair (t_i, t_i+1) matches the exact law and plain sampling (p > 1e-3), with drafts made,
    some accepted and some rejected (whole accepted chains, the bonus token's path, are required of the
    hand-built draft in ``test_lossless_sampling``: an untrained drafter need not make them)."""
    import lossless

    honour_opt_out(name, "lossless")
    model, tok, plain, workdir = stub
    spec = drafters.get(name).example(model, tok, workdir / name).with_k(lossless.K)
    engine = Engine(model, tok, spec)
    settings = {"temperature": temperature}
    seqs, stats = lossless.run_trials(
        engine.target, lambda seed: engine.new_proposer(GenerationConfig(seed=seed, **settings)), settings
    )
    lossless.check_counters(stats)
    assert stats.num_drafts >= lossless.TRIALS and 0 < stats.num_accepted_tokens < stats.num_draft_tokens
    lossless.check_lossless(seqs, plain[temperature], settings)


# --------------------------------------------------------------------------------------------- batched


def _varied(prompts: list[list[int]]) -> list[list[int]]:
    """The prompts and prefixes of them: six sequences of different lengths."""
    return [p[: max(2, len(p) * f // 4)] for f in (4, 2, 3) for p in prompts]


def _in_two_waves(decoder: BatchDecoder, seqs: list[BatchSequence]) -> list[BatchSequence]:
    """Run ``seqs`` through ``decoder``: the first three, two steps, then the others join; returns ``seqs``."""
    for seq in seqs[:3]:
        decoder.add(seq)
    decoder.step()
    decoder.step()
    for seq in seqs[3:]:
        decoder.add(seq)
    decoder.run()
    return seqs


def _row_stats(stats) -> tuple:
    return stats.num_drafts, stats.num_draft_tokens, stats.num_accepted_tokens, tuple(stats.accepted_per_pos)


@pytest.mark.parametrize("name", NAMES)
@pytest.mark.parametrize("target", list(TARGETS))
def test_batched_greedy_equals_each_sequence_alone(served, target, name):
    """Six sequences with different prompt lengths and max_tokens, at most 4 running, a token budget that chunks
    the prefill, half of them joining after two steps: each equals plain greedy alone, and its counters equal
    the engine's for it alone (the batched drafter drafts what the drafter drafts for one sequence)."""
    honour_opt_out(name, "batch")
    model, tok, prompts, spec = served(target, name)
    engine = Engine(model, tok, spec.with_k(3))
    prompts = _varied(prompts)
    cfgs = [GenerationConfig(max_new_tokens=n, eos_token_ids=engine.eos_token_ids) for n in (24, 8, 16, 24, 12, 20)]
    plain = [generate_plain(TargetModel(model, tok), p, c).tokens for p, c in zip(prompts, cfgs)]
    alone = [engine.generate(p, c).stats for p, c in zip(prompts, cfgs)]
    decoder = BatchDecoder(
        engine.target, engine.drafter.new_batch_proposer(), 3, max_num_seqs=4, max_num_batched_tokens=40
    )
    seqs = _in_two_waves(decoder, [BatchSequence(p, c) for p, c in zip(prompts, cfgs)])
    for i, seq in enumerate(seqs):
        assert seq.error is None and seq.result.tokens == plain[i], f"{name} on {target}: sequence {i} differs"
        assert _row_stats(seq.stats) == _row_stats(alone[i]), f"{name} on {target}: sequence {i} drafted otherwise"
    assert sum(s.stats.num_drafts for s in seqs) > 0


@pytest.mark.parametrize("name", NAMES)
@pytest.mark.parametrize("batch_size", [4, 16])
def test_batched_sampling_is_lossless(stub, name, batch_size):
    """Sampling at T = 1 in batches of 4 and 16 (each row its own seeds, rows joining as others finish) follows
    the exact law and plain sampling, pair by pair (``tests/lossless.py``), with drafts accepted and rejected.
    A batch of 1 is ``test_sampling_is_lossless`` (``generate_speculative`` is the batch decoder with one row)."""
    import lossless

    honour_opt_out(name, "batch")
    model, tok, plain, workdir = stub
    spec = drafters.get(name).example(model, tok, workdir / f"batch-{name}").with_k(lossless.K)
    engine = Engine(model, tok, spec)
    settings = {"temperature": 1.0}
    seqs, stats = lossless.run_trials_batched(engine.target, engine.drafter.new_batch_proposer(), settings, batch_size)
    lossless.check_counters(stats)
    assert stats.num_drafts >= lossless.TRIALS and 0 < stats.num_accepted_tokens < stats.num_draft_tokens
    lossless.check_lossless(seqs, plain[1.0], settings)


# ------------------------------------------------------------------------------------------------ auto


@pytest.mark.parametrize("name", NAMES)
@pytest.mark.parametrize("target", list(TARGETS))
def test_any_k_schedule_keeps_greedy_equal_to_plain(served, target, name):
    """k drawn at random per step in 0..5 (half the steps plain: the drafter then catches up in one accept), six
    sequences joining in two waves: each equals plain greedy alone."""
    import lossless

    honour_opt_out(name, "auto")
    model, tok, prompts, spec = served(target, name)
    engine = Engine(model, tok, spec.with_k(5 if name not in ("mlp_speculator", "dflash") else 3))
    prompts = _varied(prompts)
    cfgs = [GenerationConfig(max_new_tokens=n, eos_token_ids=engine.eos_token_ids) for n in (24, 8, 16, 24, 12, 20)]
    plain = [generate_plain(TargetModel(model, tok), p, c).tokens for p, c in zip(prompts, cfgs)]
    schedule = lossless.RandomSchedule(engine.k, seed=3)
    decoder = BatchDecoder(
        engine.target, engine.drafter.new_batch_proposer(), engine.k, max_num_seqs=4, policy=schedule
    )
    seqs = _in_two_waves(decoder, [BatchSequence(p, c) for p, c in zip(prompts, cfgs)])
    for i, seq in enumerate(seqs):
        assert seq.error is None and seq.result.tokens == plain[i], f"{name} on {target}: sequence {i} differs"
        assert sum(seq.stats.chosen_k.values()) == seq.forwards - 1  # every verify step recorded its choice
    assert 0 in schedule.chosen and max(schedule.chosen) > 1
    assert sum(s.stats.num_drafts for s in seqs) > 0


@pytest.mark.parametrize("name", NAMES)
@pytest.mark.parametrize("batch_size", [1, 4])
def test_any_k_schedule_keeps_sampling_lossless(stub, name, batch_size):
    """Sampling at T = 1 with k drawn at random per step (0 included), alone and in batches of 4: the pair law
    matches the exact law and plain sampling (``tests/lossless.py``), with drafts accepted and rejected."""
    import lossless

    honour_opt_out(name, "auto")
    model, tok, plain, workdir = stub
    spec = drafters.get(name).example(model, tok, workdir / f"auto-{name}").with_k(lossless.K)
    engine = Engine(model, tok, spec)
    settings = {"temperature": 1.0}
    schedule = lossless.RandomSchedule(lossless.K, seed=batch_size)
    if batch_size == 1:
        seqs, stats = lossless.run_trials(
            engine.target,
            lambda seed: engine.new_proposer(GenerationConfig(seed=seed, **settings)),
            settings,
            policy=schedule,
        )
    else:
        seqs, stats = lossless.run_trials_batched(
            engine.target, engine.drafter.new_batch_proposer(), settings, batch_size, policy=schedule
        )
    lossless.check_counters(stats)
    assert stats.chosen_k.get(0, 0) > 0 and 0 < stats.num_accepted_tokens < stats.num_draft_tokens
    lossless.check_lossless(seqs, plain[1.0], settings)


class _Logged:
    """A ``BatchProposer`` that records what ``inner`` proposes (tokens per row, per call) and which rows start."""

    def __init__(self, inner):
        self.inner, self.proposed, self.started = inner, [], []
        self.needs_aux_hidden, self.needs_final_hidden = inner.needs_aux_hidden, inner.needs_final_hidden
        self.free_catch_up, self.has_confidence = inner.free_catch_up, inner.has_confidence
        self.accept, self.stop, self.name = inner.accept, inner.stop, inner.name
        self.confidence = inner.confidence

    def start(self, key, *args):
        self.started.append(key)
        return self.inner.start(key, *args)

    def propose(self, keys, ks):
        out = self.inner.propose(keys, ks)
        self.proposed.append([p.tokens.tolist() for p in out])
        return out


@pytest.mark.parametrize("name", NAMES)
def test_deferred_accepts_draft_what_step_by_step_accepts_draft(served, monkeypatch, name):
    """Plain steps' positions reach the drafter as one accept before its next propose, and a row's drafter starts
    at its first draft over the whole context so far (``core.batch``): its drafts then equal those of a drafter
    started at prefill that accepted every step's positions at once (``START_LIMIT`` 0, ``PENDING_LIMIT`` 1); a
    row that never drafts never starts its drafter, unless its catch-up is free (``free_catch_up``)."""
    import lossless
    from draftsmith.core import batch

    honour_opt_out(name, "auto")
    model, tok, prompts, spec = served("tiny", name)
    engine = Engine(model, tok, spec.with_k(3))
    plan = [0, 0, 0, 3, 0, 0, 2, 3, 0, 0, 0, 0, 3, 1, 0, 3, 3, 3]

    def drafts():
        proposer = _Logged(engine.drafter.new_batch_proposer())
        decoder = BatchDecoder(engine.target, proposer, 3, max_num_seqs=2, policy=lossless.ScriptedPolicy(plan))
        for ids in prompts:
            decoder.add(BatchSequence(ids, GenerationConfig(max_new_tokens=len(plan) + 4)))
        decoder.run()
        return proposer

    deferred = drafts().proposed
    mixed, plan = plan, [0] * len(plan)
    never = drafts()
    if never.free_catch_up:  # kept current for its confidence, drafting or not (n-gram)
        assert len(never.started) == len(prompts), f"{name}: a free catch-up left a row behind"
    else:
        assert never.started == [], f"{name}: a row that never drafts started its drafter"
    plan = mixed
    monkeypatch.setattr(batch, "PENDING_LIMIT", 1)
    monkeypatch.setattr(batch, "START_LIMIT", 0)
    eager = drafts()
    assert len(eager.started) == len(prompts)
    assert eager.proposed == deferred, f"{name}: drafts after a deferred start or accept differ"
    assert sum(len(t) for call in deferred for t in call) > 0


@pytest.mark.parametrize("name", NAMES)
def test_a_run_of_plain_steps_costs_a_started_drafter_nothing(served, name):
    """Under a policy a started row's plain steps wait for its next draft (``START_LIMIT``, not ``PENDING_LIMIT``):
    a row that drafts once, then runs plain past ``PENDING_LIMIT`` positions, calls ``accept`` once if its drafter
    has a confidence (its drafting step's positions, before the next choice reads it) and never if not, not once
    more per ``PENDING_LIMIT`` (a free catch-up excepted: it is kept current for its confidence)."""
    import lossless
    from draftsmith.core import batch

    honour_opt_out(name, "auto")
    model, tok, prompts, spec = served("tiny", name)
    engine = Engine(model, tok, spec.with_k(3))
    proposer = _Logged(engine.drafter.new_batch_proposer())
    accepted = []
    proposer.accept = lambda keys, *args: (accepted.append(list(keys)), proposer.inner.accept(keys, *args))
    plan = [3] + [0] * (batch.PENDING_LIMIT + 8)
    decoder = BatchDecoder(engine.target, proposer, 3, max_num_seqs=1, policy=lossless.ScriptedPolicy(plan))
    decoder.add(BatchSequence(prompts[0], GenerationConfig(max_new_tokens=len(plan) + 1)))
    decoder.run()
    assert len(proposer.started) == 1
    expected = 1 if proposer.has_confidence else 0
    assert proposer.free_catch_up or len(accepted) == expected, f"{name}: plain steps flushed to a started drafter"


@pytest.mark.parametrize("name", NAMES)
def test_a_drafter_says_whether_it_has_a_confidence(served, name):
    """``has_confidence`` is True exactly when the drafter's ``confidence`` returns a value for a started, current
    row: the decoder keeps a drafting row current for its confidence only then (``core.batch``)."""
    model, tok, prompts, spec = served("tiny", name)
    engine = Engine(model, tok, spec.with_k(3))
    proposer = engine.drafter.new_batch_proposer()
    decoder = BatchDecoder(engine.target, proposer, 3, max_num_seqs=1)
    seq = decoder.add(BatchSequence(prompts[0], GenerationConfig(max_new_tokens=16)))
    while not seq.started:
        decoder.step()
    decoder._flush([seq])
    (confidence,) = proposer.confidence([seq.key])
    assert (confidence is not None) == proposer.has_confidence, f"{name}: has_confidence says otherwise"


@pytest.mark.parametrize("name", NAMES)
def test_auto_through_the_engine(served, name):
    """``"num_speculative_tokens": "auto"``: the engine measures its cost model, a drafter start's cost included
    (then a second engine reads the cached one), greedy equals plain, and /metrics shows the chosen k and the cost
    model."""
    from draftsmith.serve import costs

    honour_opt_out(name, "auto")
    model, tok, prompts, spec = served("tiny", name)
    engine = Engine(model, tok, spec.with_k("auto"), max_num_seqs=2)
    assert engine.policy is not None and engine.k == min(8, engine.drafter.max_k or 8)
    assert engine.spec.to_dict()["num_speculative_tokens"] == "auto"
    for ids in prompts:
        cfg = GenerationConfig(max_new_tokens=24, temperature=0.0, eos_token_ids=engine.eos_token_ids)
        assert engine.generate(ids, cfg).tokens == generate_plain(TargetModel(model, tok), ids, cfg).tokens
    metrics = engine.metrics.render().decode()
    counts = [line for line in metrics.splitlines() if line.startswith("draftsmith:spec_decode_chosen_k_count")]
    assert counts and float(counts[0].split()[-1]) > 0
    assert 'draftsmith:cost_model_verify_seconds{batch_size="2",tokens_per_row="1"}' in metrics
    # the profile's first drafting step started every row's drafter: the policy prices a start before any is served
    assert engine.policy.cost.start_s_per_position > 0
    assert "draftsmith:cost_model_start_seconds_per_position" in metrics
    emit = [line for line in metrics.splitlines() if line.startswith('draftsmith:adaptive_overhead_seconds{part="emit')]
    # measured live: the engine has emitted tokens. Either part alone may fit to 0 (both are clamped >= 0, and a
    # noisy step can put all of it on the other), so the invariant is that a chunk of one token costs something.
    assert len(emit) == 2 and sum(float(line.split()[-1]) for line in emit) > 0
    catch_up = [
        line for line in metrics.splitlines() if line.startswith('draftsmith:adaptive_overhead_seconds{part="catch')
    ]
    assert len(catch_up) == 2 and all(float(line.split()[-1]) >= 0 for line in catch_up)  # 0 until a row resumes
    measured = costs.profile_costs
    try:
        costs.profile_costs = None  # a second engine must read the cache, not measure
        again = Engine(model, tok, spec.with_k("auto"), max_num_seqs=2)
    finally:
        costs.profile_costs = measured
    assert again.policy.cost.to_dict() == engine.policy.cost.to_dict()


class _EndAt(Exception):
    pass


@pytest.mark.parametrize("name", NAMES)
@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_a_row_that_ends_leaves_the_others_unchanged(served, name, temperature):
    """In one batch: a row whose callback stops it at its second chunk (a stop string, a client gone), a row
    with max_tokens 3, a row cancelled after two steps; the two others decode exactly what they decode alone
    (sampling: seeded, the same draws)."""
    honour_opt_out(name, "batch")
    model, tok, prompts, spec = served("tiny", name)
    engine = Engine(model, tok, spec.with_k(3))
    prompts = _varied(prompts)[:5]

    def cfg(i, n=20):
        return GenerationConfig(max_new_tokens=n, temperature=temperature, seed=100 + i)

    def decode(rows):
        decoder = BatchDecoder(engine.target, engine.drafter.new_batch_proposer(), 3)
        for seq in rows:
            decoder.add(seq)
        return decoder

    alone = []
    for i in (3, 4):
        lone = BatchSequence(prompts[i], cfg(i))
        decode([lone]).run()
        alone.append(lone.result.tokens)
    calls = []

    def end_at_second(chunk):
        calls.append(chunk)
        if len(calls) == 2:
            raise _EndAt

    rows = [
        BatchSequence(prompts[0], cfg(0), on_tokens=end_at_second),
        BatchSequence(prompts[1], cfg(1, n=3)),
        BatchSequence(prompts[2], cfg(2)),
        BatchSequence(prompts[3], cfg(3)),
        BatchSequence(prompts[4], cfg(4)),
    ]
    decoder = decode(rows)
    decoder.step()
    decoder.step()
    decoder.cancel(rows[2])
    decoder.run()
    assert isinstance(rows[0].error, _EndAt) and rows[1].result.finish_reason == "length"
    assert len(rows[1].result.tokens) == 3 and rows[2].error is not None
    for row, want in zip(rows[3:], alone):
        assert row.result.tokens == want, f"{name} T={temperature}: a row that ended changed another's output"


# ------------------------------------------------------------------------------------ export / refusal


def _tensors(root) -> dict[str, torch.Tensor]:
    return {
        f"{p.relative_to(root)}:{k}": v for p in sorted(root.rglob("*.safetensors")) for k, v in load_file(p).items()
    }


@pytest.mark.parametrize("name", NAMES)
def test_export_reloads_bit_identically(served, tmp_path, name):
    from pathlib import Path

    from draftsmith.export.metadata import read_metadata

    honour_opt_out(name, "export")
    model, tok, _, spec = served("tiny", name)
    drafter, head_dir = drafters.get(name), Path(spec.model)
    assert drafter.check(head_dir, model, tok).checked_target
    again = drafter.reexport(head_dir, tmp_path / "again", ("all",))
    before, after = _tensors(head_dir), _tensors(again)
    assert before and set(before) <= set(after)
    for key, tensor in before.items():
        assert after[key].dtype == tensor.dtype and torch.equal(after[key], tensor), key
    assert read_metadata(again).weights == read_metadata(head_dir).weights
    assert read_metadata(again).head_type == name
    Engine(model, tok, SpeculativeConfig(name, str(again), 2))  # the copy serves too


@pytest.mark.parametrize("name", NAMES)
def test_another_target_is_refused_naming_the_field(served, name):
    from draftsmith.export.metadata import HeadMismatchError

    honour_opt_out(name, "refusal")
    _, tok, _, spec = served("tiny", name)
    other = make_tiny_llama(seed=11, num_hidden_layers=8, hidden_size=48)
    with pytest.raises(HeadMismatchError) as e:
        Engine(other, tok, spec)
    assert e.value.field and e.value.field in str(e.value)


# ----------------------------------------------------------------------------------------------- serve


@pytest.mark.parametrize("name", NAMES)
def test_http_server_serves_the_plain_text(served, name):
    from fastapi.testclient import TestClient

    from draftsmith.serve.server import create_app

    honour_opt_out(name, "serve")
    model, tok, prompts, spec = served("tiny", name)
    prompt = prompts[0]
    plain = Engine(model, tok).generate(prompt, GenerationConfig(max_new_tokens=16, temperature=0.0))
    with TestClient(create_app(Engine(model, tok, spec, model_name="tiny"))) as client:
        r = client.post("/v1/completions", json={"model": "tiny", "prompt": prompt, "max_tokens": 16, "temperature": 0})
        assert r.status_code == 200, r.text
        assert r.json()["choices"][0]["text"] == plain.text
        models = client.get("/v1/models").json()["data"][0]
        assert models["speculative_config"]["method"] == name
        metrics = client.get("/metrics").text
    drafts = [line for line in metrics.splitlines() if line.startswith("draftsmith:spec_decode_num_drafts_total")]
    assert drafts and float(drafts[0].split()[-1]) > 0


# ----------------------------------------------------------------------------------------------- train


def _training_inputs():
    from draftsmith.data_pipeline.dataset import render_dataset
    from draftsmith.data_pipeline.vocab import build_vocab_map, count_tokens

    tok = make_word_tokenizer(96)
    g = torch.Generator().manual_seed(0)
    convs = [
        {
            "messages": [
                {"role": "user", "content": " ".join(f"w{int(i)}" for i in torch.randint(3, 96, (4,), generator=g))},
                {
                    "role": "assistant",
                    "content": " ".join(f"w{int(i)}" for i in torch.randint(3, 96, (8,), generator=g)),
                },
            ]
        }
        for _ in range(8)
    ]
    data = render_dataset(tok, convs, 48)
    vocab_map = build_vocab_map(count_tokens(data.input_ids, data.loss_mask, 96), 48, always_include=[1])
    return make_tiny_llama(seed=11, num_hidden_layers=8), tok, data, vocab_map


@pytest.mark.parametrize("name", NAMES)
def test_trains_a_step_and_resumes_to_the_same_weights(tmp_path, monkeypatch, name):
    import draftsmith.train.trainer as trainer
    from draftsmith.pipeline.stages import train_drafter
    from draftsmith.train.config import TrainConfig

    honour_opt_out(name, "train")
    target, tok, data, vocab_map = _training_inputs()
    section = drafters.get(name).example_section()
    cfg = TrainConfig(
        mixed_precision="no", max_steps=2, batch_size=4, lr=3e-3, warmup_steps=1, log_every=1, ckpt_every=1, threads=1
    )

    def train(out):
        return train_drafter(section, target, data, cfg, out, pad_id=0, vocab_map=vocab_map, tokenizer=tok)

    full = train(tmp_path / "full")
    assert full.steps == 2 and all(torch.isfinite(torch.tensor(e["loss"])) for e in full.log)
    real_commit = trainer.commit_checkpoint

    def commit_then_die(path):
        real_commit(path)
        if json.loads((path / "state.json").read_text())["step"] == 1:
            raise KeyboardInterrupt("simulated preemption")

    monkeypatch.setattr(trainer, "commit_checkpoint", commit_then_die)
    with pytest.raises(KeyboardInterrupt):
        train(tmp_path / "cut")
    monkeypatch.setattr(trainer, "commit_checkpoint", real_commit)
    resumed = train(tmp_path / "cut")
    assert [e["step"] for e in resumed.log] == [e["step"] for e in full.log]
    for (key, p), q in zip(full.head.named_parameters(), resumed.head.parameters()):
        torch.testing.assert_close(p, q, rtol=1e-5, atol=1e-6, msg=f"{name}: {key} after resume")
