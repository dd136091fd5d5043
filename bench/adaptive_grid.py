"""Adaptive speculation against every fixed k: the grid of held-out tasks x drafters x concurrency.

    python bench/adaptive_grid.py --rounds 2 5 4 --out runs/adaptive-grid        # the reference target, ~50 min
    python bench/adaptive_grid.py --tasks code-edit --concurrency 1 --num-prompts 4 --out /tmp/grid   # a smoke run
    python bench/adaptive_grid.py --device cuda --threads 4 --out runs/adaptive-grid-cuda            # on a lent GPU
    python bench/adaptive_grid.py --from-reports --out runs/adaptive-grid-r3        # re-summarise a saved run
    python bench/adaptive_grid.py --ks 1 3 5 8 --confirm 6 --out runs/adaptive-grid  # re-measure the cells below

For each task, one ``draftsmith bench`` run (``evaluation.bench.run_bench``) serves plain decoding and every
drafter at each fixed k (default 1 3 5 8) and at ``auto``, at every concurrency (default 1 8 32), over that task's
first ``--num-prompts`` prompts, in ``--rounds`` rounds (default 1: one run per cell; the server order rotates per
round; one value per concurrency level repeats the short, noisy batches of high concurrency more often). The
measurement is paired (``--baseline-every``, default 1): a plain batch runs before the first batch of each round and
after every N batches, and speedup = the median over rounds of the method's output tokens/s ÷ the geometric mean of
the plain batches just before and after it, so the slow drift of a shared machine cancels. A k a
drafter cannot draft (8 past an MLP speculator's n_predict 5, or past a DFlash block) is left out of its cells
(``skipped``).

Printed and written to ``--out`` (``grid.json``, ``grid.md``, ``grid.png``, and each task's bench report under
``TASK/``):
  - speedup per cell (task, drafter, c) for each fixed k and ``auto``, with auto's mean chosen k and plain's own
    spread at that task and c: the median over consecutive plain batches of faster / slower (what a paired cell
    can resolve), and fastest / slowest of all its batches (what an unpaired one could);
  - the bar's two checks: cells where ``auto`` < 0.97x plain, and the geometric-mean speedup over the grid of
    ``auto`` against each single fixed k (over the cells that k ran in, and over the cells every k ran in);
  - the A/A control (``--control``, on by default: ``BenchConfig.control``): a second plain server measured like
    every method, once per (task, c). It is plain decoding, so the cells where IT reads < 0.97x show how often
    the bench fails the bar with no speculation at all, and the expected count of such cells among ``auto``'s
    if auto were exactly plain (the control's rate x auto's cells) is what ``auto``'s own count compares with;
  - with ``--rounds`` >= 2, the cells below 0.97x in EVERY round, for ``auto`` and for the control: a cell's
    median can fall below the bar on one slow batch, a reading in every round says more.

``--interleave``: each batch runs AT ONCE with a plain batch of the same requests, the two engines stepping in
turn, and each is timed by its own seconds (``BenchConfig.interleave``, ``evaluation/interleave.py``): a shared
machine's drift over seconds meets both, where bracketing batches meet it seconds apart.

``--confirm N``: a cell's first reading is a screen. Each cell where ``auto`` reads below the bar (and each
(task, c) where the control does) is measured again, paired, in N more rounds: one ``draftsmith bench`` run per such
(task, c), at that c alone, on fresh servers (plain, those drafters at ``auto``, and the control where it read below),
and its speedup becomes the median over ALL its rounds, first and confirming (pooled, not replaced: a cell is not
judged on its second reading alone). The control goes through the same screen, so its cells still below the bar
after confirmation are this procedure's false alarms on a method equal to plain. Cells that read above the bar at
first are not re-measured (a cell truly below that read above stays above: the screen errs towards passing).
The cost models ``auto`` uses are measured at the first engine start and cached (``serve/costs.py``).
"""

from __future__ import annotations

import argparse
import json
import logging
import statistics
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))

BAR = 0.97
DRAFTERS = ("eagle3", "ngram", "draft_model", "mlp_speculator", "dflash")


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--target", default="reference")
    p.add_argument(
        "--head",
        nargs="+",
        default=["runs/reference-eagle3/head", "runs/reference-mlp-speculator/head", "runs/reference-dflash/head"],
    )
    p.add_argument("--draft-model", default="reference-draft")
    p.add_argument("--methods", nargs="+", default=list(DRAFTERS))
    p.add_argument("--tasks", nargs="+", default=None)
    p.add_argument("--ks", nargs="+", type=int, default=[1, 3, 5, 8])
    p.add_argument("--concurrency", nargs="+", type=int, default=[1, 8, 32])
    p.add_argument("--num-prompts", type=int, default=8)
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--rounds", nargs="+", type=int, default=[1], help="one value, or one per --concurrency level")
    p.add_argument("--baseline-every", type=int, default=1, help="a plain batch after every N others (0: unpaired)")
    p.add_argument(
        "--interleave",
        action="store_true",
        help="each batch at once with a plain batch, the engines stepping in turn (module docstring)",
    )
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--device", default="cpu", help="of the target and the drafters (cuda: on a lent GPU)")
    p.add_argument(
        "--control", action=argparse.BooleanOptionalAction, default=True, help="the A/A control (module docstring)"
    )
    p.add_argument(
        "--confirm",
        type=int,
        default=0,
        metavar="N",
        help="N more paired rounds for each cell below the bar, pooled with its first (module docstring)",
    )
    p.add_argument("--out", default="runs/adaptive-grid")
    p.add_argument(
        "--from-reports",
        action="store_true",
        help="summarise the bench reports already under --out (OUT/TASK/report.json) instead of running them",
    )
    return p.parse_args(argv)


def cells(reports: dict, ks: list, methods: list) -> list[dict]:
    """One dict per (task, drafter, c): speedup per k label and auto, auto's mean chosen k."""
    from draftsmith.evaluation.bench import round_speedups
    from draftsmith.evaluation.bench_config import CONTROL

    out = []
    for task, report in reports.items():
        for method in methods:
            for i, c in enumerate(report["concurrency"]):
                cell = {"task": task, "drafter": method, "concurrency": c}
                plain = report["methods"].get("none", {}).get("per_concurrency", [])
                base = plain[i] if i < len(plain) else {}
                rounds = plain[i].get("output_tokens_per_s_rounds") or [] if i < len(plain) else []
                # the resolution of the cell: plain decoding's own spread at this c, over all its batches and
                # between consecutive ones (what pairing compares)
                cell["plain_spread"] = max(rounds) / min(rounds) if len(rounds) > 1 and min(rounds) > 0 else None
                pairs = [max(a, b) / min(a, b) for a, b in zip(rounds, rounds[1:]) if min(a, b) > 0]
                cell["plain_pair_spread"] = statistics.median(pairs) if pairs else None
                control = report["methods"].get(CONTROL, {}).get("per_concurrency", [])
                cell["control"] = control[i].get("speedup") if i < len(control) else None
                cell["control_rounds"] = round_speedups(control[i], base) if i < len(control) else []
                for k in [*ks, "auto"]:
                    name = f"{method}@{'auto' if k == 'auto' else f'k{k}'}"
                    rows = report["methods"].get(name, {}).get("per_concurrency", [])
                    row = rows[i] if i < len(rows) else {}
                    cell[str(k)] = row.get("speedup")
                    if k == "auto":
                        cell["auto_rounds"] = round_speedups(row, base) if row else []
                        cell["auto_mean_k"] = row.get("mean_chosen_k")
                        cell["auto_failed"] = row.get("failed")
                        cell["auto_greedy_mismatches"] = row.get("greedy_mismatches")
                out.append(cell)
    return out


def to_confirm(grid: list[dict]) -> dict[tuple[str, int], dict]:
    """What ``--confirm`` re-measures: ``{(task, c): {"drafters": [those whose auto reads below the bar], "control":
    whether the control does}}``, only the (task, c) with something below."""
    out: dict[tuple[str, int], dict] = {}
    for c in grid:
        key = (c["task"], c["concurrency"])
        entry = out.setdefault(key, {"drafters": [], "control": False})
        if c["auto"] is not None and c["auto"] < BAR:
            entry["drafters"].append(c["drafter"])
        entry["control"] = entry["control"] or (c.get("control") is not None and c["control"] < BAR)
    return {key: entry for key, entry in out.items() if entry["drafters"] or entry["control"]}


def pool(grid: list[dict], confirmations: dict[tuple[str, int], dict]) -> None:
    """Fold each confirmation report (``{(task, c): bench report at that c alone}``) into ``grid``: the confirmed
    cells' per-round speedups gain the new rounds and their speedup becomes the median over all of them (auto for the
    drafters it ran, the control for every drafter's cell at that (task, c) when it ran); ``confirm_rounds`` counts
    the rounds added."""
    from draftsmith.evaluation.bench import round_speedups
    from draftsmith.evaluation.bench_config import BASELINE, CONTROL

    for c in grid:
        report = confirmations.get((c["task"], c["concurrency"]))
        if report is None:
            continue
        methods = report["methods"]
        base = methods[BASELINE]["per_concurrency"][0]
        # served only for the drafters confirmed there; at k = auto alone (no sweep) the bench names each server
        # by its drafter (``bench_methods``)
        row = methods.get(c["drafter"], {}).get("per_concurrency", [None])[0]
        if row is not None:
            added = round_speedups(row, base)
            c["auto_rounds"] = [*(c.get("auto_rounds") or []), *added]
            c["auto"] = statistics.median(c["auto_rounds"])
            c["confirm_rounds"] = len(added)
        control = methods.get(CONTROL, {}).get("per_concurrency", [None])[0]
        if control is not None:  # served only where the control read below (``confirm``)
            c["control_rounds"] = [*(c.get("control_rounds") or []), *round_speedups(control, base)]
            c["control"] = statistics.median(c["control_rounds"])


def below_every_round(values: list[float]) -> bool:
    """Below the bar in each of two or more rounds: a reading one noisy batch cannot explain."""
    return len(values) > 1 and max(values) < BAR


def geometric_mean(values) -> float:
    """``statistics.geometric_mean`` of the values given (NaN when there are none)."""
    values = list(values)
    return statistics.geometric_mean(values) if values else float("nan")


def summary(grid: list[dict], ks: list) -> dict:
    """The bar's checks over ``grid`` (module docstring)."""
    labels = [str(k) for k in ks]
    below = [c for c in grid if c["auto"] is not None and c["auto"] < BAR]
    common = [c for c in grid if all(c[label] is not None for label in [*labels, "auto"])]
    per_k = {
        label: {
            "geomean": geometric_mean([c[label] for c in grid if c[label] is not None]),
            "cells": sum(c[label] is not None for c in grid),
            "geomean_common": geometric_mean([c[label] for c in common]),
        }
        for label in [*labels, "auto"]
    }
    best = max(labels, key=lambda label: per_k[label]["geomean_common"])
    controls = {(c["task"], c["concurrency"]): c["control"] for c in grid if c.get("control") is not None}
    control_below = sorted((task, conc, round(v, 3)) for (task, conc), v in controls.items() if v < BAR)
    auto_cells = sum(c["auto"] is not None for c in grid)
    spreads = [c["plain_spread"] for c in grid if c.get("plain_spread")]
    pair_spreads = [c["plain_pair_spread"] for c in grid if c.get("plain_pair_spread")]
    control_rounds = {(c["task"], c["concurrency"]): c.get("control_rounds") or [] for c in grid}
    return {
        "cells": len(grid),
        "auto_below_bar": [(c["task"], c["drafter"], c["concurrency"], round(c["auto"], 3)) for c in below],
        # below in every round (with >= 2 rounds): the cells the bench says are slower, not only read slower
        "auto_below_every_round": [
            (c["task"], c["drafter"], c["concurrency"], [round(r, 3) for r in c["auto_rounds"]])
            for c in below
            if below_every_round(c.get("auto_rounds") or [])
        ],
        "control_below_every_round": sorted(
            (task, conc, [round(r, 3) for r in rounds])
            for (task, conc), rounds in control_rounds.items()
            if below_every_round(rounds)
        ),
        # --confirm: the cells re-measured, and the rounds their pooled readings rest on
        "confirmed": [
            (c["task"], c["drafter"], c["concurrency"], len(c["auto_rounds"]), round(c["auto"], 3))
            for c in grid
            if c.get("confirm_rounds")
        ],
        "auto_min": min((c["auto"] for c in grid if c["auto"] is not None), default=None),
        "geomean": per_k,
        "best_fixed_k": best,
        "auto_vs_best_fixed_k_common": per_k["auto"]["geomean_common"] / per_k[best]["geomean_common"],
        "common_cells": len(common),
        "plain_spread_median": _rounded(statistics.median(spreads)) if spreads else None,
        "plain_spread_max": _rounded(max(spreads)) if spreads else None,
        "plain_pair_spread_median": _rounded(statistics.median(pair_spreads)) if pair_spreads else None,
        "plain_pair_spread_max": _rounded(max(pair_spreads)) if pair_spreads else None,
        "control_cells": len(controls),
        "control_below_bar": control_below,
        "control_range": [_rounded(min(controls.values())), _rounded(max(controls.values()))] if controls else None,
        # how many of auto's cells a method identical to plain would put below the bar, at the control's rate
        "expected_below_bar_if_plain": _rounded(auto_cells * len(control_below) / len(controls)) if controls else None,
    }


def _rounded(x: float) -> float:
    return round(x, 3)


def table(grid: list[dict], ks: list, result: dict) -> str:
    labels = [str(k) for k in ks]
    head = (
        "| task | drafter | c | "
        + " | ".join(f"k={label}" for label in labels)
        + " | auto | auto mean k | A/A control | plain's spread: consecutive / all |"
    )
    lines = [head, "|---|---|---:|" + "---:|" * (len(labels) + 4)]
    fmt = lambda v: "-" if v is None else f"{v:.2f}x"  # noqa: E731
    for c in grid:
        mark = " **<0.97**" if c["auto"] is not None and c["auto"] < BAR else ""
        mean_k = "-" if c["auto_mean_k"] is None else f"{c['auto_mean_k']:.2f}"
        lines.append(
            f"| {c['task']} | {c['drafter']} | {c['concurrency']} | "
            + " | ".join(fmt(c[label]) for label in labels)
            + f" | {fmt(c['auto'])}{mark} | {mean_k} | {fmt(c.get('control'))} "
            + f"| {fmt(c.get('plain_pair_spread'))} / {fmt(c.get('plain_spread'))} |"
        )
    g = result["geomean"]
    lines += [
        "",
        "| | " + " | ".join(f"k={label}" for label in labels) + " | auto |",
        "|---|" + "---:|" * (len(labels) + 1),
        "| geomean speedup (cells it ran) | " + " | ".join(f"{g[x]['geomean']:.3f}" for x in [*labels, "auto"]) + " |",
        "| cells | " + " | ".join(str(g[x]["cells"]) for x in [*labels, "auto"]) + " |",
        f"| geomean over the {result['common_cells']} cells every k ran | "
        + " | ".join(f"{g[x]['geomean_common']:.3f}" for x in [*labels, "auto"])
        + " |",
        "",
        f"auto below {BAR}x plain: {len(result['auto_below_bar'])} of {result['cells']} cells "
        f"{result['auto_below_bar'] or ''}; lowest {result['auto_min']:.3f}x",
        f"best single fixed k (common cells): k={result['best_fixed_k']}; auto / it = "
        f"{result['auto_vs_best_fixed_k_common']:.3f}",
        *(
            [
                f"A/A control (a second plain server, once per task and c) below {BAR}x: "
                f"{len(result['control_below_bar'])} of {result['control_cells']} {result['control_below_bar'] or ''}"
                f"; range {result['control_range'][0]:.3f}-{result['control_range'][1]:.3f}x; at its rate a method "
                f"identical to plain would read below {BAR}x in {result['expected_below_bar_if_plain']} of auto's "
                f"{g['auto']['cells']} cells",
            ]
            if result.get("control_cells")
            else []
        ),
        *(
            [
                f"below {BAR}x in every one of its rounds: auto in {len(result['auto_below_every_round'])} of "
                f"{result['cells']} cells {result['auto_below_every_round'] or ''}; the A/A control in "
                f"{len(result['control_below_every_round'])} of {result['control_cells']} "
                f"{result['control_below_every_round'] or ''}",
            ]
            if any(len(c.get("auto_rounds") or []) > 1 for c in grid)
            else []
        ),
        *(
            [
                f"confirmed (--confirm, pooled over every round of the cell): {len(result['confirmed'])} cells "
                f"{result['confirmed']} (task, drafter, c, rounds, speedup)"
            ]
            if result.get("confirmed")
            else []
        ),
        f"plain's own spread (the cells' resolution): between consecutive plain batches (faster / slower) median "
        f"{result['plain_pair_spread_median']}, largest {result['plain_pair_spread_max']}; fastest / slowest of all "
        f"its batches median {result['plain_spread_median']}, largest {result['plain_spread_max']}",
    ]
    return "\n".join(lines)


def plot(grid: list[dict], ks: list, methods: list, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    labels = [str(k) for k in ks] + ["auto"]
    fig, axes = plt.subplots(len(methods), 1, figsize=(12, 2.6 * len(methods)), sharey=True, squeeze=False)
    for ax, method in zip(axes[:, 0], methods):
        rows = [c for c in grid if c["drafter"] == method]
        xs = range(len(rows))
        for label in labels:
            ys = [c[label] if c[label] is not None else float("nan") for c in rows]
            style = {"color": "black", "linewidth": 2.5, "marker": "s"} if label == "auto" else {"marker": "o"}
            ax.plot(xs, ys, label="auto" if label == "auto" else f"k={label}", **style)
        controls = [c.get("control") for c in rows]
        if any(v is not None for v in controls):
            ys = [float("nan") if v is None else v for v in controls]
            ax.plot(xs, ys, color="grey", linestyle=":", marker=".", label="A/A control")
        ax.axhline(1.0, color="grey", linewidth=0.8)
        ax.axhline(BAR, color="red", linewidth=0.8, linestyle="--")
        ax.set_xticks(list(xs), [f"{c['task']}\nc={c['concurrency']}" for c in rows], fontsize=7)
        ax.set_ylabel(f"{method}\nspeedup vs plain")
    axes[0, 0].legend(ncol=len(labels), fontsize=8, loc="upper right")
    fig.tight_layout()
    tmp = path.with_name(path.stem + ".tmp.png")
    fig.savefig(tmp, dpi=110)
    tmp.replace(path)
    plt.close(fig)


def load_reports(args: argparse.Namespace, tasks: list[str], out: Path) -> dict | None:
    """The bench reports saved under ``out`` (``--from-reports``), one per task; ``args`` takes the run's own settings
    (what the header names), not this call's defaults. None (after saying so) when a task has none."""
    missing = [task for task in tasks if not (out / task / "report.json").is_file()]
    if missing:
        print(f"no bench report for {missing} under {out}: run the grid without --from-reports first")
        return None
    reports = {task: json.loads((out / task / "report.json").read_text()) for task in tasks}
    run = reports[tasks[0]]["config"]
    for key in ("num_prompts", "max_tokens", "concurrency", "rounds", "baseline_every", "threads", "device", "torch"):
        setattr(args, key, run.get(key))
    args.interleave = bool(run.get("interleave", False))
    args.ks = [k for k in run["k"] if k != "auto"]
    args.methods = [m for m in run["methods"] if m in DRAFTERS]
    return reports


def _bench_config(args: argparse.Namespace, task: str, out: Path, **overrides):
    from draftsmith.evaluation.bench_config import BenchConfig

    fields = dict(
        target=args.target,
        methods=["none", *args.methods],
        k=[*args.ks, "auto"],
        head=args.head,
        draft_model=args.draft_model,
        num_prompts=args.num_prompts,
        tasks=[task],
        max_tokens=args.max_tokens,
        concurrency=args.concurrency,
        rounds=args.rounds,
        baseline_every=args.baseline_every,
        threads=args.threads,
        device=args.device,
        control=args.control,
        interleave=args.interleave,
        out=str(out),
    )
    return BenchConfig(**(fields | overrides))


def run_reports(args: argparse.Namespace, tasks: list[str], out: Path, model, tokenizer) -> dict:
    """One ``draftsmith bench`` run per task (module docstring), each report written under ``out / task``."""
    from draftsmith.evaluation.bench import run_bench, write_report

    reports = {}
    for task in tasks:
        reports[task] = run_bench(_bench_config(args, task, out / task), model, tokenizer)
        write_report(reports[task], out / task)
    return reports


def confirm_dir(out: Path, task: str, concurrency: int) -> Path:
    """Where the confirmation of (task, c) writes its bench report."""
    return out / task / f"confirm-c{concurrency}"


def run_confirmations(args: argparse.Namespace, grid: list[dict], out: Path, model, tokenizer) -> dict:
    """``--confirm``: one paired bench run of ``args.confirm`` rounds per (task, c) with a cell below the bar: plain,
    the drafters whose auto read below at ``auto`` only, and the control where it read below (``to_confirm``)."""
    from draftsmith.evaluation.bench import run_bench, write_report

    reports = {}
    for (task, c), entry in to_confirm(grid).items():
        where = confirm_dir(out, task, c)
        cfg = _bench_config(
            args,
            task,
            where,
            methods=["none", *entry["drafters"]],
            k="auto",
            concurrency=[c],
            rounds=[args.confirm],
            baseline_every=args.baseline_every or 1,
            control=entry["control"],
        )
        reports[(task, c)] = run_bench(cfg, model, tokenizer)
        write_report(reports[(task, c)], where)
    return reports


def load_confirmations(grid: list[dict], out: Path) -> dict:
    """The confirmation reports saved under ``out`` for the (task, c) of ``grid`` (``--from-reports``)."""
    found = {}
    for task, c in {(cell["task"], cell["concurrency"]) for cell in grid}:
        path = confirm_dir(out, task, c) / "report.json"
        if path.is_file():
            found[(task, c)] = json.loads(path.read_text())
    return found


def main(argv=None) -> int:
    args = parse_args(argv)
    logging.basicConfig(level=logging.WARNING)
    import torch

    from draftsmith.reference import TASK_NAMES

    torch.set_num_threads(args.threads)
    tasks = args.tasks or list(TASK_NAMES)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    if args.from_reports:
        reports = load_reports(args, tasks, out)
        if reports is None:
            return 2
        grid = cells(reports, args.ks, args.methods)
        confirmations = load_confirmations(grid, out)
    else:
        from draftsmith.models import load_causal_lm

        model, tokenizer = load_causal_lm(args.target, dtype="float32", role="target")
        model.to(args.device)
        reports = run_reports(args, tasks, out, model, tokenizer)
        grid = cells(reports, args.ks, args.methods)
        confirmations = run_confirmations(args, grid, out, model, tokenizer) if args.confirm > 0 else {}
    pool(grid, confirmations)
    result = summary(grid, args.ks)
    text = table(grid, args.ks, result)
    if args.from_reports:
        where = f"device {args.device} (torch {args.torch}), summarised from the saved reports"
    elif args.device.startswith("cuda"):
        where = torch.cuda.get_device_name(args.device)
    else:
        where = f"CPU capability {torch.backends.cpu.get_cpu_capability()}"
    if args.interleave:
        paired = "the plain batch run at once with it, step by step, each over its own seconds"
    elif args.baseline_every:
        paired = f"the plain batches just before and after (one after every {args.baseline_every})"
    else:
        paired = "plain in the same round"
    header = (
        f"reference grid: tasks {', '.join(tasks)}; {args.num_prompts} prompts x {args.max_tokens} tokens per task; "
        f"concurrency {args.concurrency}; rounds {args.rounds} (per level) of one run per cell, speedup = median "
        f"over rounds of the ratio to {paired}; torch threads {args.threads}; {where}"
    )
    print(header + "\n\n" + text)
    (out / "grid.md").write_text(header + "\n\n" + text + "\n")
    skipped = {task: r.get("skipped", {}) for task, r in reports.items()}
    (out / "grid.json").write_text(json.dumps({"cells": grid, "summary": result, "skipped": skipped}, indent=1))
    plot(grid, args.ks, args.methods, out / "grid.png")
    print(f"wrote {out / 'grid.md'}, {out / 'grid.json'}, {out / 'grid.png'}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
