"""BatchEagle3Proposer: the batched EAGLE-3 drafter drafts, row by row, exactly what Eagle3Proposer drafts alone.

Rows have prefixes of different lengths (one slot pool, per-row positions and masks: ``head.RaggedHeadKV``), so
a wrong mask, position, padding or slot shows up as a draft, a q or a head logit that differs from the
per-sequence proposer's.
"""

from __future__ import annotations

import random

import pytest
import torch

from draftsmith.core.batch import generate_batch
from draftsmith.core.generate import GenerationConfig, generate_plain
from draftsmith.core.proposer import PerSequence, Sampling
from draftsmith.core.target import BatchTargetStep, TargetModel
from draftsmith.data_pipeline.vocab import build_vocab_map
from draftsmith.drafters.eagle3.drafter import LoadedEagle3
from draftsmith.drafters.eagle3.head import Eagle3Config, Eagle3Head
from draftsmith.drafters.eagle3.proposer import BatchEagle3Proposer, Eagle3Proposer
from draftsmith.drafters.speculative import SpeculativeConfig


def random_head(model, draft_vocab_size: int | None = None, seed: int = 0) -> Eagle3Head:
    """A random-weight head on ``model`` (lm_head / norm warm-started from it), optionally with a reduced draft
    vocabulary (d2t offsets that are not all zero)."""
    cfg = Eagle3Config.from_target(model.config, draft_vocab_size=draft_vocab_size, ttt_steps=4)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        head = Eagle3Head(cfg).eval()
        if draft_vocab_size:
            counts = torch.randint(1, 1000, (cfg.vocab_size,))
            vmap = build_vocab_map(counts, draft_vocab_size)
            head.set_vocab_map(vmap.d2t, vmap.t2d)
    head.bind_embedding(model.get_input_embeddings())
    head.init_from_target(model)
    return head


@pytest.fixture(scope="module")
def reference_setup():
    """The reference target, heads (full and reduced draft vocab) and held-out prompts of different lengths."""
    from draftsmith import reference
    from draftsmith.data_pipeline.chat import prompt_ids
    from draftsmith.models import load_causal_lm

    model, tok = load_causal_lm("reference", dtype="float32", role="target")
    heads = {vd: random_head(model, vd) for vd in (None, 2048)}
    records = [r for rs in reference.tasks(limit=2).values() for r in rs]
    prompts = [prompt_ids(tok, r["messages"]) for r in records]
    # different lengths, down to a handful of tokens
    prompts = [p[: max(3, len(p) - 13 * i)] for i, p in enumerate(prompts)][:6]
    assert len({len(p) for p in prompts}) == len(prompts)
    return model, tok, heads, prompts


def per_sequence(head: Eagle3Head) -> PerSequence:
    """The reference every batched proposer must agree with: one ``Eagle3Proposer`` per row."""
    return PerSequence(
        lambda s: Eagle3Proposer(head, temperature=s.temperature, top_k=s.top_k, top_p=s.top_p, seed=s.seed),
        needs_aux_hidden=True,
    )


def _padded_step(steps: list, fill: float = float("nan")) -> BatchTargetStep:
    """A BatchTargetStep from per-row TargetSteps, padded with ``fill`` (NaN: padding must never be read)."""
    counts = [s.logits.shape[0] for s in steps]
    t = max(counts)
    aux = torch.full((len(steps), t, steps[0].aux_hidden.shape[-1]), fill)
    logits = torch.full((len(steps), t, steps[0].logits.shape[-1]), fill)
    for b, s in enumerate(steps):
        aux[b, : counts[b]], logits[b, : counts[b]] = s.aux_hidden, s.logits
    return BatchTargetStep(logits=logits, aux_hidden=aux, final_hidden=None, counts=counts)


SAMPLINGS = {
    "greedy": lambda key: Sampling(),
    "t1": lambda key: Sampling(1.0, seed=100 + key),
    "t07-topk-topp": lambda key: Sampling(0.7, top_k=50, top_p=0.9, seed=200 + key),
    "mixed": lambda key: Sampling() if key % 2 else Sampling(1.0, seed=300 + key),
}


@pytest.mark.parametrize("sampling", list(SAMPLINGS))
@pytest.mark.parametrize("draft_vocab_size", [None, 2048])
def test_drafts_equal_per_sequence_proposer(reference_setup, sampling, draft_vocab_size):
    """Drive both proposers over several verify steps with ragged prefixes, keys in shuffled order, varying ks
    (0 included) and accepted counts, rows leaving and joining: drafts equal, q and head logits close."""
    model, _, heads, prompts = reference_setup
    head = heads[draft_vocab_size]
    tm = TargetModel(model, aux_layer_ids=head.config.aux_layer_ids)
    rng = random.Random(0)
    batch, singles, caches, last = BatchEagle3Proposer(head), {}, {}, {}

    def join(key: int, prompt: torch.Tensor) -> None:
        caches[key] = tm.new_cache()
        step = tm.forward(prompt, caches[key])
        last[key] = int(step.logits[-1].argmax())
        s = SAMPLINGS[sampling](key)
        singles[key] = Eagle3Proposer(head, temperature=s.temperature, top_k=s.top_k, top_p=s.top_p, seed=s.seed)
        singles[key].start(prompt, last[key], step)
        batch.start(key, prompt, last[key], step, s)

    for key, prompt in enumerate(prompts[:4]):
        join(key, prompt)
    drafted = accepted = 0
    for step_no in range(7):
        if step_no == 3:  # a row leaves, two join (the pool compacts, then grows)
            batch.stop(1)
            del singles[1], caches[1]
            join(4, prompts[4])
            join(5, prompts[5])
        keys = list(singles)
        rng.shuffle(keys)  # another order than the slots': the gathered path
        ks = [rng.choice([0, 1, 3, 5]) for _ in keys]
        ks[0] = 5
        got = batch.propose(keys, ks)
        want = [singles[key].propose(k) for key, k in zip(keys, ks)]
        verify_steps, ns, emitted = [], [], []
        for key, k, g, w in zip(keys, ks, got, want):
            assert g.tokens.tolist() == w.tokens.tolist(), f"step {step_no} row {key} k={k}"
            assert len(g.tokens) == k
            if w.q is None:
                assert g.q is None
            else:
                assert g.q.shape == w.q.shape
                torch.testing.assert_close(g.q, w.q, atol=1e-5, rtol=0)
            drafted += k
            # the target verifies [last, d1..dk]; keep a varying number of drafts
            before = caches[key].length
            vstep = tm.forward(torch.tensor([last[key]] + w.tokens.tolist()), caches[key])
            n = rng.randint(0, k)
            out = torch.cat([w.tokens[:n], vstep.logits[n].argmax()[None]])
            caches[key].crop(before + n + 1)
            verify_steps.append(vstep)
            ns.append(n)
            emitted.append(out)
            last[key] = int(out[-1])
            accepted += n
        bstep = _padded_step(verify_steps)
        batch.accept(keys, ns, emitted, bstep)
        for b, key in enumerate(keys):
            singles[key].accept(ns[b], emitted[b], bstep.row(b))
            row = batch.rows[key]
            assert row.length == singles[key].kv.length
            torch.testing.assert_close(row.logits, singles[key].last_logits, atol=1e-5, rtol=1e-5)
    assert drafted > 20 and accepted > 5


@pytest.mark.parametrize("k", [1, 3])
def test_generate_batch_greedy_equals_plain_and_per_sequence(reference_setup, k):
    model, tok, heads, prompts = reference_setup
    head = heads[2048]
    tm = TargetModel(model, tok, aux_layer_ids=head.config.aux_layer_ids)
    cfg = GenerationConfig(max_new_tokens=20)
    got = generate_batch(tm, BatchEagle3Proposer(head), prompts, cfg, k=k)
    want = generate_batch(tm, per_sequence(head), prompts, cfg, k=k)
    for prompt, g, w in zip(prompts, got, want):
        assert g.tokens == generate_plain(tm, prompt, cfg).tokens
        assert g.tokens == w.tokens
        assert g.stats == w.stats
        assert g.stats.num_draft_tokens > 0


@pytest.fixture(scope="module")
def fitted(tiny_llama):
    """A tiny Llama and a head fitted to it (drafts get accepted: the acceptance counters are not vacuous)."""
    from test_eagle3_proposer import fit_head, make_head

    target = tiny_llama(seed=3)
    return target, fit_head(target, make_head(target, 48))


def _tiny_prompts(n: int) -> list[torch.Tensor]:
    return [torch.randint(2, 96, (3 + 5 * i,), generator=torch.Generator().manual_seed(i)) for i in range(n)]


@pytest.mark.parametrize("max_num_seqs", [64, 2])
def test_generate_batch_greedy_same_acceptance_as_per_sequence(fitted, max_num_seqs):
    """Greedy: tokens equal plain decoding and SpecStats equal PerSequence's, with drafts accepted; at
    max_num_seqs 2 rows of different lengths leave and newcomers join while others run."""
    target, head = fitted
    tm = TargetModel(target, aux_layer_ids=head.config.aux_layer_ids)
    prompts = _tiny_prompts(5)
    cfgs = [GenerationConfig(max_new_tokens=8 + 7 * i) for i in range(5)]
    got = generate_batch(tm, BatchEagle3Proposer(head), prompts, cfgs, k=4, max_num_seqs=max_num_seqs)
    want = generate_batch(tm, per_sequence(head), prompts, cfgs, k=4, max_num_seqs=max_num_seqs)
    for prompt, cfg, g, w in zip(prompts, cfgs, got, want):
        assert g.tokens == generate_plain(tm, prompt, cfg).tokens
        assert g.tokens == w.tokens and g.stats == w.stats
    assert sum(g.stats.num_accepted_tokens for g in got) > 0


def test_generate_batch_sampled_equals_per_sequence(fitted):
    """Temperature 1 with seeds: each row's drafts, q and random draws are those of its own per-sequence
    proposer, so tokens and counters are identical (some drafts accepted, some rejected)."""
    target, head = fitted
    tm = TargetModel(target, aux_layer_ids=head.config.aux_layer_ids)
    prompts = _tiny_prompts(4)
    cfgs = [GenerationConfig(max_new_tokens=24, temperature=1.0, seed=10 + i) for i in range(4)]
    samplings = [Sampling(1.0, seed=20 + i) for i in range(4)]
    got = generate_batch(tm, BatchEagle3Proposer(head), prompts, cfgs, k=3, samplings=samplings)
    want = generate_batch(tm, per_sequence(head), prompts, cfgs, k=3, samplings=samplings)
    for g, w in zip(got, want):
        assert g.tokens == w.tokens and g.stats == w.stats
    accepted = sum(g.stats.num_accepted_tokens for g in got)
    assert 0 < accepted < sum(g.stats.num_draft_tokens for g in got)


def test_loaded_eagle3_batches_natively(fitted):
    _, head = fitted
    loaded = LoadedEagle3(SpeculativeConfig("eagle3", "unused", 3), head, 4)
    proposer = loaded.new_batch_proposer()
    assert isinstance(proposer, BatchEagle3Proposer) and proposer.needs_aux_hidden
