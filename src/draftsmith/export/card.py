"""Model card (``README.md``) of an exported head: what it drafts for, how well, how to serve it.

    write_model_card("runs/eagle3/head", drafter.card_lines, report, "runs/eagle3/eval/acceptance.png")
    write_model_card("heads/eagle3", drafter.card_lines)       # table from the held-out results in draftsmith.json
    drafters.directory.write_card("heads/eagle3")              # the same, the drafter found by its head_type

Sections: the drafter's own lines (front matter with library, tags and base_model, serve commands for every
format the directory holds, the geometry: ``Drafter.card_lines`` in its folder), then the held-out acceptance
table (τ, acceptance rate, accepted per draft position; tokens/s and speedup when a full eval report is given),
the acceptance-per-position plot, and the engines a referee run verified the head with (``draftsmith.json``
``referee``).
"""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Callable

from draftsmith.export.metadata import read_metadata

PLOT_FILE = "acceptance.png"


def _rows_from_report(report: dict) -> tuple[int, list[tuple[str, str, dict]]]:
    """(k, [(task, method, row)]) from an ``evaluation.heldout`` report (plain rows included)."""
    rows = []
    for task, r in report["tasks"].items():
        rows.append((task, "plain", r["plain"]))
        rows += [(task, m, r[m]) for m in report["config"]["methods"] if m in r]
    return int(report["config"]["k"]), rows


def _rows_from_metadata(eval_record: dict) -> tuple[int | None, list[tuple[str, str, dict]]]:
    """(k, rows) from the compact record ``pipeline.demo`` stores in draftsmith.json ``eval``."""
    rows = [
        (task, m, r)
        for task, methods in (eval_record.get("tasks") or {}).items()
        for m, r in methods.items()
        if isinstance(r, dict) and "tau" in r
    ]
    return eval_record.get("k"), rows


def acceptance_table(rows: list[tuple[str, str, dict]], k: int | None) -> str:
    """Markdown table: task, method, τ, acceptance rate, accepted at draft positions 1..k, and tokens/s
    and speedup when the rows carry them (a full eval report)."""
    timed = any("tokens_per_s" in r for _, m, r in rows if m != "plain")
    k = k or max((len(r.get("accepted_per_pos") or []) for _, _, r in rows), default=0)
    head = ["task", "method", "τ", "acceptance rate"] + [f"pos {i}" for i in range(1, k + 1)]
    head += ["tokens/s", "speedup"] if timed else []
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for task, method, r in rows:
        if method == "plain":
            if timed:
                cells = [task, "plain", "–", "–"] + ["–"] * k + [f"{r['tokens_per_s']:.1f}", "1.00x"]
                lines.append("| " + " | ".join(cells) + " |")
            continue
        per = list(r.get("accepted_per_pos") or []) + [None] * k
        cells = [task, method, f"{r['tau']:.2f}", f"{r['acceptance_rate']:.1%}"]
        cells += ["–" if p is None else f"{p:.0%}" for p in per[:k]]
        if timed:
            cells += [f"{r['tokens_per_s']:.1f}", f"{r['speedup']:.2f}x"]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def _referee_lines(referee: dict) -> list[str]:
    if not referee:
        return []
    lines = [
        "## Verified with",
        "",
        "Greedy outputs and accepted-per-position counters equal to draftsmith's "
        "own runtime on held-out prompts (`bench/vllm_referee.py`):",
        "",
        "| engine | version | format | k | prompts | match | checked |",
        "|---|---|---|---|---|---|---|",
    ]
    for v in sorted(referee.values(), key=lambda v: (v.get("engine", ""), v.get("format", ""), v.get("k", 0))):
        lines.append(
            f"| {v.get('engine')} | {v.get('version')} | {v.get('format')} | {v.get('k')} | "
            f"{v.get('prompts')} | {'yes' if v.get('match') else 'no'} | {v.get('checked_at', '')} |"
        )
    return lines + [""]


def refresh_verified_section(head_dir: str | Path) -> Path | None:
    """Rewrite only the card's "Verified with" section from draftsmith.json ``referee`` (after a referee
    run), keeping the rest of the card as written; returns the card's path, None when there is no card."""
    head_dir = Path(head_dir)
    path = head_dir / "README.md"
    if not path.is_file():
        return None
    text = path.read_text()
    start = text.find("## Verified with")
    body = (text[:start] if start >= 0 else text).rstrip("\n") + "\n\n"
    tmp = path.with_name("README.md.tmp")
    tmp.write_text(body + "\n".join(_referee_lines(read_metadata(head_dir).referee)))
    tmp.replace(path)
    return path


def write_model_card(
    head_dir: str | Path,
    header: Callable[[Path, object, int | None], list[str]],
    report: dict | None = None,
    plot: str | Path | None = None,
    *,
    serve_dir: str | Path | None = None,
) -> Path:
    """Write ``head_dir/README.md`` (and copy ``plot`` beside it as acceptance.png); returns the card's path.

    ``header(serve_dir, metadata, k)`` gives the drafter's own lines (front matter, serve commands, geometry:
    ``Drafter.card_lines``); this adds the held-out acceptance table, the plot and the engines that verified it.
    ``report``: an ``evaluation.heldout`` report (the table then has tokens/s and speedup); without one the
    held-out results recorded in draftsmith.json ``eval`` are used. A plot already in the directory is kept and
    linked. ``serve_dir``: the directory the serve commands name (default ``head_dir``; an export writes its
    card in a temp directory before renaming it into place).
    Raises FileNotFoundError when ``head_dir`` is not a head directory."""
    head_dir = Path(head_dir)
    meta = read_metadata(head_dir)
    k, rows = _rows_from_report(report) if report else _rows_from_metadata(meta.eval or {})
    lines = list(header(Path(serve_dir or head_dir), meta, k))
    if rows:
        lines += [
            f"## Held-out acceptance (greedy{f', k = {k}' if k else ''})",
            "",
            "τ = 1 + accepted / drafts; pos i = share of drafts whose i-th token was accepted.",
            "",
            acceptance_table(rows, k),
            "",
        ]
    if plot and Path(plot).is_file() and Path(plot).resolve() != (head_dir / PLOT_FILE).resolve():
        shutil.copyfile(plot, head_dir / PLOT_FILE)
    if (head_dir / PLOT_FILE).is_file():
        lines += [f"![acceptance per draft position]({PLOT_FILE})", ""]
    lines += _referee_lines(meta.referee)
    path = head_dir / "README.md"
    tmp = path.with_name("README.md.tmp")
    tmp.write_text("\n".join(lines))
    tmp.replace(path)
    return path
