"""The batched runtime's core (``core/batch_cache.py``, ``TargetModel.forward_batch``, ``core/batch.py``).

A batched forward over ragged rows with per-row rollback reads, for each row, what that row alone would read;
the decoder schedules within ``max_num_seqs`` and ``max_num_batched_tokens`` (chunked prefill) and its output
does not depend on how the prefill was chunked or on who else is in the batch. The drafter-level invariants
(every drafter, greedy and sampled) are the ``batch`` contract in ``test_contract.py``.
"""

from __future__ import annotations

import pytest
import torch
import transformers as tf

from draftsmith.core.batch import BatchDecoder, BatchSequence, generate_batch
from draftsmith.core.batch_cache import BatchKVCache
from draftsmith.core.generate import GenerationConfig, generate_plain
from draftsmith.core.target import TargetModel

V = 64


def _models():
    """A Llama, a Mistral whose every layer has a 5-token sliding window, and a Qwen2 mixing full and
    sliding-window layers (the mask then goes per layer type)."""
    common = dict(vocab_size=V, hidden_size=32, intermediate_size=64, num_attention_heads=4, num_key_value_heads=2)
    torch.manual_seed(0)
    return {
        "llama": tf.LlamaForCausalLM(tf.LlamaConfig(num_hidden_layers=2, max_position_embeddings=128, **common)),
        "mistral-sliding": tf.MistralForCausalLM(
            tf.MistralConfig(num_hidden_layers=2, sliding_window=5, max_position_embeddings=128, **common)
        ),
        "qwen2-mixed": tf.Qwen2ForCausalLM(
            tf.Qwen2Config(
                num_hidden_layers=4,
                use_sliding_window=True,
                sliding_window=5,
                max_window_layers=2,
                max_position_embeddings=128,
                **common,
            )
        ),
    }


MODELS = _models()


@pytest.mark.parametrize("name", list(MODELS))
def test_batched_forward_reads_what_each_row_reads_alone(name):
    """Three rows of different lengths, eight ragged steps each keeping a random prefix (rollback), well past
    the sliding window: each row's logits equal a one-sequence cache's, rolled back the same way."""
    model = MODELS[name].eval()
    target = TargetModel(model)
    g = torch.Generator().manual_seed(1)
    prompts = [torch.randint(0, V, (n,), generator=g) for n in (9, 3, 14)]
    alone, batch = [], BatchKVCache(model.config)
    for p in prompts:
        cache = target.new_cache()
        target.forward(p, cache)
        alone.append(cache)
        row = BatchKVCache(model.config)
        row.add_empty_row()
        target.forward_batch([p], row, last_only=True)
        row.commit([p.numel()])
        batch.merge(row)
    for _ in range(8):
        new = [torch.randint(0, V, (int(torch.randint(1, 5, (1,), generator=g)),), generator=g) for _ in prompts]
        kept = [int(torch.randint(1, x.numel() + 1, (1,), generator=g)) for x in new]
        step = target.forward_batch(new, batch)
        batch.commit(kept)
        for b, (x, cache) in enumerate(zip(new, alone)):
            length = cache.length
            want = target.forward(x, cache).logits
            cache.crop(length + kept[b])
            torch.testing.assert_close(step.row(b).logits, want, atol=1e-5, rtol=1e-5)
    assert batch.lengths == [c.length for c in alone] and max(batch.lengths) > 5 * 2


def test_rows_leave_and_the_cache_stays_small():
    """Rows keeping one token of six while another keeps all six leave holes: compaction bounds the slots; a row
    leaving keeps the others reading what they read alone."""
    model = MODELS["llama"].eval()
    target = TargetModel(model)
    batch, alone = BatchKVCache(model.config), []
    for n in (4, 7, 5):
        row = BatchKVCache(model.config)
        row.add_empty_row()
        target.forward_batch([torch.arange(n)], row, last_only=True)
        row.commit([n])
        batch.merge(row)
        cache = target.new_cache()
        target.forward(torch.arange(n), cache)
        alone.append(cache)
    kept = [1, 6, 1]
    for _ in range(40):
        target.forward_batch([torch.arange(6)] * 3, batch)
        batch.commit(kept)
        for cache, n in zip(alone, kept):
            length = cache.length
            target.forward(torch.arange(6), cache)
            cache.crop(length + n)
    assert batch.slots <= 2 * max(batch.lengths) + 16 and batch.has_holes()  # compacted, holes left
    batch.remove_rows([1])
    del alone[1]
    step = target.forward_batch([torch.tensor([3])] * 2, batch)
    for b, cache in enumerate(alone):
        torch.testing.assert_close(step.row(b).logits, target.forward(torch.tensor([3]), cache).logits)


def test_chunked_prefill_and_small_batches_decode_the_same_tokens():
    """A token budget smaller than the prompts (chunked prefill), max_num_seqs 2 (a queue), or everything at
    once: every sequence's greedy tokens equal plain decoding alone."""
    model = MODELS["qwen2-mixed"].eval()
    target = TargetModel(model)
    g = torch.Generator().manual_seed(2)
    prompts = [torch.randint(0, V, (n,), generator=g).tolist() for n in (30, 5, 17, 11)]
    cfg = GenerationConfig(max_new_tokens=12)
    want = [generate_plain(target, p, cfg).tokens for p in prompts]
    for max_num_seqs, budget in ((8, 2048), (2, 2048), (4, 7), (1, 3)):
        got = generate_batch(target, None, prompts, cfg, max_num_seqs=max_num_seqs, max_num_batched_tokens=budget)
        assert [r.tokens for r in got] == want, (max_num_seqs, budget)


def test_the_decoder_keeps_its_limits():
    """Never more than max_num_seqs rows running; a step's tokens stay within max_num_batched_tokens once rows
    run; a long prompt is prefilled in chunks while the others keep decoding."""
    model = MODELS["llama"].eval()
    target = TargetModel(model)
    reads = []
    forward_batch = target.forward_batch
    target.forward_batch = lambda ids, cache, **kw: (
        reads.append(sum(len(x) for x in ids)),
        forward_batch(ids, cache, **kw),
    )[1]
    decoder = BatchDecoder(target, None, max_num_seqs=2, max_num_batched_tokens=8)
    seqs = [decoder.add(BatchSequence(list(range(1, n + 1)), GenerationConfig(max_new_tokens=6))) for n in (3, 4, 20)]
    running = []
    while decoder.has_work:
        reads.append("step")
        decoder.step()
        running.append(len(decoder.running))
    assert max(running) <= 2 and all(s.result is not None and len(s.tokens) == 6 for s in seqs)
    steps, current = [], 0
    for r in reads:
        if r == "step":
            steps.append(current)
            current = 0
        else:
            current += r
    steps.append(current)
    assert max(steps) <= 8 + 2  # the budget, decode rows included (the first step may prefill alone)
    assert seqs[2].forwards > 6 + 1  # the 20-token prompt took several prefill chunks


def test_grouped_query_attention_gives_the_same_values(monkeypatch):
    """The masked forwards pass grouped K/V heads to torch's SDPA (``core.target._grouped_query_sdpa``): the
    logits are bit-identical to transformers' default, which first repeats each K/V head."""
    import contextlib

    from draftsmith.core import target as target_module

    model = tf.LlamaForCausalLM(
        tf.LlamaConfig(
            vocab_size=V,
            hidden_size=48,
            intermediate_size=64,
            num_hidden_layers=2,
            num_attention_heads=6,
            num_key_value_heads=2,
            max_position_embeddings=128,
        )
    ).eval()
    target = TargetModel(model)

    def run():
        cache = BatchKVCache(model.config)
        for n in (5, 9):
            row = BatchKVCache(model.config)
            row.add_empty_row()
            target.forward_batch([torch.arange(n)], row, last_only=True)
            row.commit([n])
            cache.merge(row)
        return target.forward_batch([torch.arange(3), torch.arange(6)], cache).logits  # ragged: masked

    grouped = run()
    monkeypatch.setattr(target_module, "_grouped_query_sdpa", contextlib.nullcontext)
    assert torch.equal(grouped, run())


def test_auto_reserves_its_last_choice_and_stays_within_the_budget():
    """With a policy the budget reserves, per running row, the depth it chose last step (not k): a plain-decoding
    batch leaves a waiting prompt the room plain decoding leaves it. A step's choice is then capped by what its
    prefill left, so a step never reads more than ``max_num_batched_tokens``; output equals plain greedy."""
    import lossless
    from draftsmith.core.proposer import PerSequence
    from draftsmith.drafters.ngram.proposer import NgramProposer

    target = TargetModel(MODELS["llama"].eval())
    cfg = GenerationConfig(max_new_tokens=10)
    prompts = [[1, 2, 3, 1, 2, 3, 1, 2], [4, 5, 6, 4, 5, 6, 4], list(range(7, 7 + 30))]
    want = [generate_plain(target, p, cfg).tokens for p in prompts]
    for ks, whole in (((0,), True), ((8,), False)):
        policy = lossless.ScriptedPolicy(ks)
        proposer = PerSequence.over(lambda _sampling: NgramProposer(1, 3))
        decoder = BatchDecoder(target, proposer, 8, max_num_batched_tokens=34, policy=policy)
        seqs = [decoder.add(BatchSequence(p, cfg)) for p in prompts[:2]]
        decoder.step()  # the two short prompts join and decode
        seqs.append(decoder.add(BatchSequence(prompts[2], cfg)))
        decoder.step()  # 30 prompt tokens: whole beside 2 plain rows (2 + 30 <= 34), chunked beside 2 rows of k = 8
        assert (seqs[2].prefilled == 30) == whole, ks
        decoder.run()
        assert [s.result.tokens for s in seqs] == want
        for rows in policy.rows:  # what each choice was offered: within what the step's prefill left
            assert sum(1 + row[1] for row in rows) <= 34
