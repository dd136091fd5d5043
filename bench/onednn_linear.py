"""MKL vs prepacked oneDNN linears (``core.onednn``) on the reference target: per GEMM shape and per forward.

    python bench/onednn_linear.py [--k 5] [--context 120] [--repeats 200] [--threads 1]

Prints, for each distinct linear shape of the target at M in (1, 1 + k, 32, 512) rows, the median us of
``F.linear`` (MKL) and of the packed oneDNN linear; then a target forward over 1 and over 1 + k new tokens after
``--context`` cached tokens, both ways, alternated call by call (medians, and the verify / one-token ratio that
decides what a speculative step costs). The CPU (``torch.backends.cpu.get_cpu_capability()``) heads the output.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
import torch.nn.functional as F


def median_us(fn, repeats: int) -> float:
    for _ in range(5):
        fn()
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times) * 1e6


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--k", type=int, default=5)
    ap.add_argument("--context", type=int, default=120)
    ap.add_argument("--repeats", type=int, default=200)
    ap.add_argument("--threads", type=int, default=1)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)

    from draftsmith.core.onednn import pack_linears
    from draftsmith.core.target import TargetModel
    from draftsmith.models import load_causal_lm

    cpu = torch.backends.cpu.get_cpu_capability()
    print(f"cpu capability {cpu}, torch {torch.__version__}, {args.threads} thread(s)")
    model, _ = load_causal_lm("reference", dtype="float32", role="target")
    shapes = sorted({tuple(m.weight.shape) for m in model.modules() if isinstance(m, torch.nn.Linear)})
    print(f"\n{'weight':>14} {'M':>5} {'MKL us':>10} {'oneDNN us':>10} {'MKL/oneDNN':>11}")
    for out_f, in_f in shapes:
        w = torch.randn(out_f, in_f)
        packed = torch.ops.mkldnn._reorder_linear_weight(w, 8)
        for m in (1, 1 + args.k, 32, 512):
            x = torch.randn(m, in_f)
            reps = max(10, args.repeats // (1 + m // 32))
            mkl = median_us(lambda: F.linear(x, w), reps)
            dnnl = median_us(lambda: torch.ops.mkldnn._linear_pointwise(x, packed, None, "none", [], ""), reps)
            print(f"{str((out_f, in_f)):>14} {m:>5} {mkl:>10.1f} {dnnl:>10.1f} {mkl / dnnl:>10.2f}x")

    packed_model, _ = load_causal_lm("reference", dtype="float32", role="target")
    pack_linears(packed_model)  # a second copy: packing in the loop would flush the caches before each timing
    targets = {"MKL": TargetModel(model), "oneDNN": TargetModel(packed_model)}
    g = torch.Generator().manual_seed(0)
    context = torch.randint(10, 8000, (args.context,), generator=g)
    caches = {}
    with torch.no_grad():
        for kernels, target in targets.items():
            caches[kernels] = target.new_cache()
            target.forward(context, caches[kernels])
    times: dict[tuple[str, int], list[float]] = {}
    ids = {n: torch.randint(10, 8000, (n,), generator=g) for n in (1, 1 + args.k)}
    for _ in range(args.repeats):
        for kernels, target in targets.items():
            for n, x in ids.items():
                t0 = time.perf_counter()
                target.forward(x, caches[kernels])
                times.setdefault((kernels, n), []).append(time.perf_counter() - t0)
                caches[kernels].crop(args.context)
    print(f"\nforward after {args.context} cached tokens (median ms of {args.repeats}, alternated)")
    print(f"{'kernels':>8} {'1 token':>9} {f'{1 + args.k} tokens':>10} {'ratio':>7}")
    for kernels in ("MKL", "oneDNN"):
        one, many = (statistics.median(times[(kernels, n)]) * 1e3 for n in ids)
        print(f"{kernels:>8} {one:>9.2f} {many:>10.2f} {many / one:>6.2f}x")


if __name__ == "__main__":
    main()
