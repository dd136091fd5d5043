"""``BatchDraftModelProposer``: the draft model drafting for a batch in one cache drafts, row by row, what
``DraftModelProposer`` drafts alone (rows joining and leaving, ragged contexts, rows idle in some forwards, greedy
and seeded sampling, a learned position table), and decodes through ``generate_batch`` as ``PerSequence`` does."""

from __future__ import annotations

import random

import pytest
import torch

from conftest import make_tiny_llama
from draftsmith import reference
from draftsmith.core.batch import generate_batch
from draftsmith.core.generate import GenerationConfig, generate_plain
from draftsmith.core.proposer import PerSequence, Sampling
from draftsmith.core.target import TargetModel
from draftsmith.data_pipeline.chat import prompt_ids
from draftsmith.drafters.draft_model.drafter import LoadedDraftModel
from draftsmith.drafters.draft_model.proposer import BatchDraftModelProposer, DraftModelProposer
from draftsmith.drafters.speculative import SpeculativeConfig
from draftsmith.models import load_causal_lm


@pytest.fixture(scope="module")
def ref():
    """(reference target, tokenizer, reference draft, V, five held-out prompts of 40..109 tokens)."""
    target, tok = load_causal_lm("reference", dtype="float32", role="target")
    draft, _ = load_causal_lm("reference-draft", dtype="float32", role="draft model")
    tasks = reference.tasks()
    picks = [("code-complete", 0), ("docstring", 0), ("code-foreign", 0), ("code-edit", 0), ("docstring", 1)]
    prompts = [prompt_ids(tok, tasks[task][i]["messages"]) for task, i in picks]
    assert len({p.numel() for p in prompts}) == len(prompts)
    return target, tok, draft, int(target.get_output_embeddings().weight.shape[0]), prompts


def alone(draft, vocab: int, s: Sampling) -> DraftModelProposer:
    """The per-sequence proposer a row must agree with (``LoadedDraftModel.new_proposer``'s)."""
    return DraftModelProposer(draft, vocab, temperature=s.temperature, top_k=s.top_k, top_p=s.top_p, seed=s.seed)


def drive(draft, vocab: int, prompts, samplings, rounds: int = 7, seed: int = 0) -> int:
    """Run a ``BatchDraftModelProposer`` and one ``DraftModelProposer`` per row through the same rounds and assert
    equal drafts every round; returns the drafts compared.

    Rows 0-2 start at round 0, row 3 joins at round 2 and row 4 at round 3, row 1 leaves at round 4. Each round
    asks each row for k in {0, 1, 2, 3, 5} (rows idle or done early in some forwards), then accepts a random n
    with a random correction token (sometimes the next draft itself: the cache keeps more than n drafts)."""
    rng = random.Random(seed)
    batch = BatchDraftModelProposer(draft, vocab)
    singles: dict[int, DraftModelProposer] = {}
    live: list[int] = []
    joins, leaves = {0: [0, 1, 2], 2: [3], 3: [4]}, {4: [1]}
    compared = 0
    for r in range(rounds):
        for b in joins.get(r, []):
            first = rng.randrange(vocab)
            batch.start(b, prompts[b], first, None, samplings[b])
            singles[b] = alone(draft, vocab, samplings[b])
            singles[b].start(prompts[b], first)
            live.append(b)
        for b in leaves.get(r, []):
            batch.stop(b)
            live.remove(b)
        ks = [rng.choice([0, 1, 2, 3, 5]) for _ in live]
        ks[rng.randrange(len(ks))] = 5  # some row drafts the most: the others idle in its last forwards
        got = batch.propose(live, ks)
        assert len(got) == len(live)
        ns, emitted = [], []
        for b, k, proposal in zip(live, ks, got):
            want = singles[b].propose(k)
            assert proposal.tokens.tolist() == want.tokens.tolist(), f"round {r}, row {b}: drafts differ"
            if want.q is None:
                assert proposal.q is None, f"round {r}, row {b}: greedy drafts carry no q"
            else:
                torch.testing.assert_close(proposal.q, want.q, atol=1e-5, rtol=0)
            compared += want.tokens.numel()
            drafts = want.tokens.tolist()
            n = rng.randint(0, len(drafts))
            correction = drafts[n] if n < len(drafts) and rng.random() < 0.3 else rng.randrange(vocab)
            ns.append(n)
            emitted.append(torch.tensor(drafts[:n] + [correction]))
        batch.accept(live, ns, emitted, None)
        for b, n, e in zip(live, ns, emitted):
            singles[b].accept(n, e)
            row, single = batch.rows[b], singles[b]
            held = batch.cache.lengths[batch.order.index(b)] if b in batch.order else 0
            assert held == len(row.cached), f"round {r}, row {b}: cache row and bookkeeping disagree"
            if b not in batch.order:  # given up (or never given) its row: it can never draft again
                assert not batch._fits(row) and not row.cached, f"round {r}, row {b}: dropped while it fits"
            elif single._cached:  # it has drafted (before, it holds nothing; the batch row holds the prompt)
                assert row.cached == single._cached and held == single.cache.length, f"round {r}, row {b}"
    assert set(batch.rows) == set(live) and set(batch.order) <= set(live)
    return compared


def test_greedy_drafts_equal_the_per_sequence_proposers(ref):
    _, _, draft, vocab, prompts = ref
    assert drive(draft, vocab, prompts, [Sampling()] * len(prompts)) > 40


def test_seeded_sampled_drafts_equal_the_per_sequence_proposers(ref):
    """Temperature 1 (plain, top-k, top-p), 0.7 and greedy rows together: same tokens, q within 1e-5."""
    _, _, draft, vocab, prompts = ref
    samplings = [
        Sampling(1.0, seed=11),
        Sampling(1.0, top_k=20, seed=12),
        Sampling(1.0, top_p=0.9, seed=13),
        Sampling(0.0),
        Sampling(0.7, seed=15),
    ]
    assert drive(draft, vocab, prompts, samplings, seed=1) > 40


def test_the_loaded_draft_model_serves_batches_natively(ref):
    target, _, draft, vocab, _ = ref
    loaded = LoadedDraftModel(SpeculativeConfig("draft_model", "reference-draft", 3), draft, vocab)
    assert isinstance(loaded.new_batch_proposer(), BatchDraftModelProposer)


def _per_sequence(draft, vocab: int) -> PerSequence:
    return PerSequence(lambda s: alone(draft, vocab, s))


def test_generate_batch_greedy_equals_plain_and_per_sequence_stats(ref):
    """k = 3, rows of different prompt lengths and max_new_tokens, at most 3 at once (rows join as others end)."""
    target_model, tok, draft, vocab, prompts = ref
    target = TargetModel(target_model, tok)
    cfgs = [GenerationConfig(max_new_tokens=n, eos_token_ids=[tok.eos_token_id]) for n in (24, 9, 31, 17, 20)]
    batched = generate_batch(target, BatchDraftModelProposer(draft, vocab), prompts, cfgs, k=3, max_num_seqs=3)
    per_row = generate_batch(target, _per_sequence(draft, vocab), prompts, cfgs, k=3, max_num_seqs=3)
    for prompt, cfg, got, want in zip(prompts, cfgs, batched, per_row):
        assert got.tokens == generate_plain(target, prompt, cfg).tokens
        assert got.stats == want.stats and got.num_target_forwards == want.num_target_forwards
    assert sum(r.stats.num_accepted_tokens for r in batched) > 0


def test_generate_batch_seeded_sampling_equals_per_sequence(ref):
    target_model, tok, draft, vocab, prompts = ref
    target = TargetModel(target_model, tok)
    cfgs = [
        GenerationConfig(max_new_tokens=n, temperature=1.0, seed=s, eos_token_ids=[tok.eos_token_id])
        for n, s in zip((20, 12, 16, 8, 14), range(5))
    ]
    samplings = [Sampling(1.0, seed=100 + i) for i in range(5)]
    runs = [
        generate_batch(target, proposer, prompts, cfgs, k=3, samplings=samplings)
        for proposer in (BatchDraftModelProposer(draft, vocab), _per_sequence(draft, vocab))
    ]
    for got, want in zip(*runs):
        assert got.tokens == want.tokens and got.stats == want.stats
    assert sum(r.stats.num_drafts for r in runs[0]) > 0


# ------------------------------------------------------------------------------------------ learned positions

SHORT = 24  # the GPT-2 draft's table


def _gpt2_draft(vocab: int = 96):
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(1)
    config = GPT2Config(
        vocab_size=vocab, n_positions=SHORT, n_embd=32, n_layer=2, n_head=2, bos_token_id=1, eos_token_id=1
    )
    return GPT2LMHeadModel(config).eval()


def test_a_learned_position_table_bounds_the_drafts_as_alone():
    """Prompts well inside, near the end of and past a 24-position table: drafts equal the per-sequence ones, no
    forward reads position 24 or beyond (a row outgrowing the table leaves the draft's cache), decoding is plain."""
    draft, g = _gpt2_draft(), torch.Generator().manual_seed(4)
    prompts = [torch.randint(2, 96, (n,), generator=g) for n in (6, 17, 26, 12, 21)]
    reads = []
    forward = torch.nn.Embedding.forward

    def spy(self, ids):
        if self is draft.transformer.wpe:
            reads.append(int(ids.max()))
        return forward(self, ids)

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(torch.nn.Embedding, "forward", spy)
        assert drive(draft, 96, prompts, [Sampling()] * 5, rounds=6, seed=2) > 10
    assert reads and max(reads) < SHORT
    target = TargetModel(make_tiny_llama(seed=11, num_hidden_layers=2))
    cfg = GenerationConfig(max_new_tokens=14)
    got = generate_batch(target, BatchDraftModelProposer(draft, 96), prompts, cfg, k=4)
    want = generate_batch(target, _per_sequence(draft, 96), prompts, cfg, k=4)
    for prompt, a, b in zip(prompts, got, want):
        assert a.tokens == generate_plain(target, prompt, cfg).tokens and a.stats == b.stats
