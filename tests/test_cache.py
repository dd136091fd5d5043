"""KV-cache rollback (``core/cache.py``) and the cached target forward (``core/target.py``)."""

from __future__ import annotations

import pytest
import torch
import transformers as tf

from draftsmith.core.cache import KVCache
from draftsmith.core.target import TargetModel


def _full_logits(model, ids: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        return model(input_ids=ids[None]).logits[0]  # [T, V]


@pytest.mark.parametrize("arch", ["llama", "qwen3"])
def test_crop_then_refeed_equals_fresh_forward(tiny_llama, arch):
    model = tiny_llama(arch=arch)
    target = TargetModel(model)
    ids = torch.randint(2, 96, (12,), generator=torch.Generator().manual_seed(0))
    cache = target.new_cache()
    target.forward(ids, cache)
    assert cache.length == 12
    cache.crop(7)
    assert cache.length == 7
    refed = target.forward(ids[7:], cache).logits  # positions 7..11 again
    torch.testing.assert_close(refed, _full_logits(model, ids)[7:], atol=1e-5, rtol=1e-5)
    # roll back and continue with DIFFERENT tokens: must equal a fresh forward of the new sequence
    cache.crop(4)
    other = torch.tensor([3, 4, 5, 6, 7])
    new_ids = torch.cat([ids[:4], other])
    logits = target.forward(other, cache).logits
    torch.testing.assert_close(logits, _full_logits(model, new_ids)[4:], atol=1e-5, rtol=1e-5)


def test_crop_past_a_sliding_window():
    config = tf.MistralConfig(
        vocab_size=64,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        sliding_window=5,
        max_position_embeddings=128,
        tie_word_embeddings=False,
    )
    torch.manual_seed(0)
    model = tf.MistralForCausalLM(config).eval()
    target = TargetModel(model)
    ids = torch.randint(0, 64, (14,), generator=torch.Generator().manual_seed(1))
    cache = target.new_cache()
    target.forward(ids[:9], cache)  # window already full
    target.forward(ids[9:12], cache)
    cache.crop(10)  # drop 2 tokens beyond the window
    logits = target.forward(ids[10:], cache).logits
    torch.testing.assert_close(logits, _full_logits(model, ids)[10:], atol=1e-5, rtol=1e-5)


def test_crop_bounds_and_noop():
    kv = KVCache()
    assert kv.length == 0
    kv.crop(0)
    with pytest.raises(ValueError, match="cannot crop"):
        kv.crop(1)
    with pytest.raises(ValueError, match="cannot crop"):
        kv.crop(-1)


def test_chunked_forward_positions_and_aux_hidden(tiny_llama):
    model = tiny_llama(num_hidden_layers=6)
    target = TargetModel(model, aux_layer_ids=(1, 3, 4))
    ids = torch.randint(2, 96, (10,), generator=torch.Generator().manual_seed(2))
    cache = target.new_cache()
    parts = [target.forward(chunk, cache) for chunk in (ids[:4], ids[4:5], ids[5:])]
    with torch.no_grad():
        full = model(input_ids=ids[None], output_hidden_states=True)
    logits = torch.cat([p.logits for p in parts])
    aux = torch.cat([p.aux_hidden for p in parts])
    assert logits.dtype == torch.float32 and logits.shape == (10, 96)
    assert aux.shape == (10, 3 * 32)
    torch.testing.assert_close(logits, full.logits[0], atol=1e-5, rtol=1e-5)
    expected = torch.cat([full.hidden_states[i][0] for i in (1, 3, 4)], dim=-1)  # low -> mid -> high
    torch.testing.assert_close(aux, expected, atol=1e-5, rtol=1e-5)
    assert TargetModel(model).forward(ids, TargetModel(model).new_cache()).aux_hidden is None


@pytest.mark.parametrize("bad", [(1, 1, 2), (0, 2, 6), (-1, 1, 2)])
def test_aux_layer_ids_validated(tiny_llama, bad):
    with pytest.raises(ValueError, match="aux_layer_ids"):
        TargetModel(tiny_llama(num_hidden_layers=6), aux_layer_ids=bad)


def test_forward_rejects_batched_input(tiny_llama):
    target = TargetModel(tiny_llama())
    with pytest.raises(ValueError, match="1-D"):
        target.forward(torch.ones(2, 3, dtype=torch.long), target.new_cache())
