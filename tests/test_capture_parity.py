"""Train/serve parity: what the data pipeline captures is what the runtime feeds the head.

For the same tokens, the aux states stored by ``write_shards`` (and computed by online capture, which
training uses) equal the runtime's ``TargetModel.forward`` aux states at every aux layer id, in the same
dtype; and the target logits rebuilt from the stored final hidden state (``lm_head(final_hidden)``)
equal the target's own logits. Checked for a Llama and a Qwen3 (q/k norms) target, in float32 and
bfloat16, for a one-pass prefill (bit-identical) and for the runtime's chunked decoding (prefill then
one token per forward through the KV cache, equal to float rounding).
"""

import pytest
import torch

from draftsmith.core.target import TargetModel
from draftsmith.data_pipeline.capture import capture
from draftsmith.data_pipeline.shards import ShardError, ShardReader, write_shards

AUX = (0, 2, 3)  # a 4-layer target: the embedding output, and the inputs of layers 2 and 3
CONVERSATIONS = [
    {
        "messages": [
            {"role": "user", "content": "Add two numbers"},
            {"role": "assistant", "content": "def add(a, b):\n    return a + b"},
        ]
    },
    {
        "messages": [
            {"role": "system", "content": "Be brief."},
            {"role": "user", "content": "Hello there"},
            {"role": "assistant", "content": "how are you?"},
            {"role": "user", "content": "more"},
            {"role": "assistant", "content": "Hello"},
        ]
    },
    {"messages": [{"role": "user", "content": "x"}, {"role": "assistant", "content": "y"}]},
]


CASES = [("llama", torch.float32), ("qwen3", torch.float32), ("llama", torch.bfloat16)]


@pytest.fixture(scope="module", params=CASES, ids=[f"{a}-{str(d)[6:]}" for a, d in CASES])
def captured(request, tiny_llama, chatml, tmp_path_factory):
    """(target, reader, arch) for a capture of CONVERSATIONS through a tiny target of the given arch and dtype."""
    arch, dtype = request.param
    target = tiny_llama(seed=7, vocab_size=len(chatml), arch=arch).to(dtype)
    out = tmp_path_factory.mktemp(f"cap-{arch}-{dtype}")
    write_shards(
        target,
        chatml,
        CONVERSATIONS,
        out,
        AUX,
        max_length=64,
        shard_size=2,
        batch_size=1,
        target_name="tiny",
        progress=False,
    )
    return target, ShardReader(out), arch


def test_aux_states_equal_the_runtimes_at_each_layer_id(captured):
    target, reader, _ = captured
    hidden = target.config.hidden_size
    runtime = TargetModel(target, aux_layer_ids=AUX)
    assert len(reader) == len(CONVERSATIONS)
    for seq in reader:
        step = runtime.forward(seq.input_ids, runtime.new_cache())
        assert step.aux_hidden.dtype == seq.aux_hidden.dtype == reader.capture_dtype  # what the head is fed
        assert torch.equal(step.aux_hidden, seq.aux_hidden)  # [T, 3H]
        for k, layer in enumerate(AUX):  # and layer by layer
            alone = TargetModel(target, aux_layer_ids=(layer,)).forward(seq.input_ids, runtime.new_cache())
            assert torch.equal(alone.aux_hidden, seq.aux_hidden[:, k * hidden : (k + 1) * hidden]), f"layer {layer}"
        online = capture(target, seq.input_ids[None], AUX, attention_mask=torch.ones_like(seq.input_ids)[None])
        assert torch.equal(online.aux_hidden[0], step.aux_hidden)  # what training uses


def test_logits_rebuilt_from_captured_states_equal_the_targets(captured):
    target, reader, _ = captured
    runtime = TargetModel(target, aux_layer_ids=AUX)
    for seq in reader:
        rebuilt = ShardReader.target_logits(target.lm_head, seq.final_hidden).float()  # [T, V]
        own = runtime.forward(seq.input_ids, runtime.new_cache()).logits  # [T, V] float32
        assert torch.equal(rebuilt, own)
        with torch.no_grad():
            plain = target(input_ids=seq.input_ids[None]).logits[0].float()
        assert torch.equal(rebuilt, plain)


def test_runtime_decoding_through_the_cache_matches_the_capture(captured):
    """The runtime reads a prompt in one forward, then one token per forward: same states up to rounding."""
    target, reader, _ = captured
    tol = dict(atol=1e-5, rtol=1e-5) if reader.capture_dtype == torch.float32 else dict(atol=0.05, rtol=0.02)
    runtime = TargetModel(target, aux_layer_ids=AUX)
    for seq in reader:
        cache, split = runtime.new_cache(), seq.input_ids.numel() // 2
        steps = [runtime.forward(seq.input_ids[:split], cache)]
        steps += [runtime.forward(seq.input_ids[t : t + 1], cache) for t in range(split, seq.input_ids.numel())]
        aux = torch.cat([s.aux_hidden for s in steps])
        logits = torch.cat([s.logits for s in steps])
        torch.testing.assert_close(aux.float(), seq.aux_hidden.float(), **tol)
        torch.testing.assert_close(logits, ShardReader.target_logits(target.lm_head, seq.final_hidden).float(), **tol)


def test_the_serving_target_is_checked_against_the_capture(captured, tiny_llama, chatml):
    target, reader, arch = captured
    reader.check_target(TargetModel(target, aux_layer_ids=AUX), chatml)
    other = torch.bfloat16 if reader.capture_dtype == torch.float32 else torch.float32
    same_weights = tiny_llama(seed=7, vocab_size=len(chatml), arch=arch).to(other)
    with pytest.raises(ShardError, match=f"runs in {str(other)[6:]}"):
        reader.check_target(TargetModel(same_weights), chatml)
    assert reader.aux_layer_ids == AUX and reader.manifest["aux_layer_convention"] == "hf_hidden_states_index"


def test_the_runtimes_layer_hooks_equal_output_hidden_states(captured):
    """``TargetModel`` reads aux states with pre-hooks on the aux layers; a model without a decoder ``layers`` list
    falls back to ``output_hidden_states``: the two agree exactly, in a batch forward too, and no hook stays."""
    from draftsmith.core.batch_cache import BatchKVCache

    target, reader, _ = captured
    hooked = TargetModel(target, aux_layer_ids=AUX)
    fallback = TargetModel(target, aux_layer_ids=AUX)
    fallback._aux_layers = None  # as for a model whose decoder has no ``layers`` list
    assert hooked._aux_layers is not None
    seqs = list(reader)[:2]
    for runtime in (hooked, fallback):
        cache = BatchKVCache(target.config)
        for _ in seqs:
            cache.add_empty_row()
        runtime.step = runtime.forward_batch([s.input_ids for s in seqs], cache)
    assert torch.equal(hooked.step.aux_hidden, fallback.step.aux_hidden)
    layers = target.get_decoder().layers
    assert all(not layer._forward_pre_hooks for layer in layers)
