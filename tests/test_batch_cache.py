"""``BatchKVCache.truncate``: one row of a batch cache cropped to a prefix, as ``KVCache.crop`` crops one sequence."""

from __future__ import annotations

import pytest
import torch
import transformers as tf

from draftsmith.core.batch_cache import BatchKVCache
from draftsmith.core.target import TargetModel


def _alone(target: TargetModel, ids: list[int]) -> torch.Tensor:
    """Logits ``[T, V]`` of ``ids`` read as one sequence in a fresh cache."""
    return target.forward(torch.tensor(ids), target.new_cache()).logits


def _filled(target: TargetModel, rows: list[list[int]], extra: list[list[int]]) -> BatchKVCache:
    """A cache holding ``rows`` (one ragged prefill) then ``extra`` (one ragged forward, all kept)."""
    cache = BatchKVCache(target.model.config)
    for _ in rows:
        cache.add_empty_row()
    target.forward_batch([torch.tensor(r) for r in rows], cache, last_only=True)
    cache.commit([len(r) for r in rows])
    target.forward_batch([torch.tensor(e) for e in extra], cache)
    cache.commit([len(e) for e in extra])
    return cache


def _sliding_mistral():
    config = tf.MistralConfig(
        vocab_size=96,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        sliding_window=4,
        max_position_embeddings=512,
    )
    torch.manual_seed(3)
    return tf.MistralForCausalLM(config).eval()


@pytest.mark.parametrize("arch", ["llama", "sliding"])
def test_truncate_then_refeed_equals_each_row_alone(tiny_llama, arch):
    """Rows cut at different points (into the prefill, into the last forward, to nothing, not at all) then read
    new tokens in one batched forward: each row's logits equal its kept prefix + new tokens read alone."""
    target = TargetModel(tiny_llama(seed=5) if arch == "llama" else _sliding_mistral())
    g = torch.Generator().manual_seed(0)
    rows = [torch.randint(2, 96, (n,), generator=g).tolist() for n in (7, 4, 9, 5)]
    extra = [torch.randint(2, 96, (n,), generator=g).tolist() for n in (3, 1, 3, 2)]
    cache = _filled(target, rows, extra)
    assert cache.lengths == [10, 5, 12, 7]
    keep = [5, 5, 9, 0]  # into the prefill / untouched / the last forward's tokens / everything
    for row, n in enumerate(keep):
        cache.truncate(row, n)
    assert cache.lengths == keep
    assert cache.valid.sum(dim=1).tolist() == keep
    for row, n in enumerate(keep):  # the valid slots hold positions 0..n-1, in order
        assert cache.slot_pos[row][cache.valid[row]].tolist() == list(range(n))
    new = [torch.randint(2, 96, (n,), generator=g).tolist() for n in (2, 3, 1, 4)]
    step = target.forward_batch([torch.tensor(x) for x in new], cache)
    cache.commit([len(x) for x in new])
    for row, (n, x) in enumerate(zip(keep, new)):
        kept = (rows[row] + extra[row])[:n]
        expected = _alone(target, kept + x)[n:]
        torch.testing.assert_close(step.logits[row, : len(x)], expected, atol=1e-5, rtol=1e-5)
    assert cache.lengths == [n + len(x) for n, x in zip(keep, new)]


def test_truncate_trims_and_refuses(tiny_llama):
    target = TargetModel(tiny_llama(seed=5))
    cache = _filled(target, [[5, 6, 7, 8, 9, 10], [11, 12]], [[13, 14], [15]])
    assert cache.slots == 8 and cache.lengths == [8, 3]
    cache.truncate(1, 3)  # its own length: nothing to do
    assert cache.lengths == [8, 3] and int(cache.valid.sum()) == 11
    cache.truncate(0, 4)  # the longest row: slots invalid in every row are cut
    assert cache.lengths == [4, 3] and cache.slots == 7  # slot 7 (row 0's only) is cut; row 1 still uses slot 6
    cache.truncate(1, 2)
    assert cache.slots == 4 and cache.valid.sum(dim=1).tolist() == [4, 2]
    for bad_row, bad_length in ((2, 1), (-1, 1), (0, 5), (1, -1)):
        with pytest.raises(ValueError, match="row|truncate"):
            cache.truncate(bad_row, bad_length)
    cache.begin([1, 1])
    with pytest.raises(ValueError, match="pending forward"):
        cache.truncate(0, 1)


def test_truncate_compacts_when_holes_dominate(tiny_llama):
    """A long row cut short leaves the other row's last token far right: the cache compacts, tokens intact."""
    target = TargetModel(tiny_llama(seed=5))
    long, short = list(range(2, 42)), [50, 51]
    cache = _filled(target, [long, short], [[60], [61]])
    assert cache.slots == 41
    cache.truncate(0, 3)  # 41 slots > 2 * 3 + 16: compact
    assert cache.slots == 3 and bool(cache.valid.all()) and cache.lengths == [3, 3]
    step = target.forward_batch([torch.tensor([70]), torch.tensor([71])], cache)
    cache.commit([1, 1])
    torch.testing.assert_close(step.logits[0, :1], _alone(target, long[:3] + [70])[-1:], atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(step.logits[1, :1], _alone(target, short + [61, 71])[-1:], atol=1e-5, rtol=1e-5)
