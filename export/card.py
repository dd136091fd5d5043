"""Model card (``README.md``) of an exported head: what it drafts for, how well, how to serve it.

    write_model_card("runs/eagle3/head", report, "runs/eagle3/eval/acceptance.png")   # after `draftsmith eval`
    write_model_card("heads/eagle3")            # table from the held-out results in draftsmith.json

Sections: front matter (library, tags, base_model), serve commands for every format the directory
holds (draftsmith, vLLM and SGLang on the research layout, ``vllm serve`` on speculators/), the head's
geometry, the held-out acceptance table (τ, acceptance rate, accepted per draft position; tokens/s and
speedup when a full eval report is given), the acceptance-per-position plot, and the engines a
referee run verified the head with (``draftsmith.json`` ``referee``). An MLP speculator
(``head_type: mlp_speculator``) and a distilled draft model (``head_type: draft_model``) get their own
title, serve commands (draftsmith, vLLM) and geometry.
"""
from __future__ import annotations

import shutil
from pathlib import Path

from draftsmith.export.formats import SPECULATORS_DIR
from draftsmith.export.metadata import read_metadata

PLOT_FILE = "acceptance.png"


def _rows_from_report(report: dict) -> tuple[int, list[tuple[str, str, dict]]]:
    """(k, [(task, method, row)]) from an ``inference.eval`` report (plain rows included)."""
    rows = []
    for task, r in report["tasks"].items():
        rows.append((task, "plain", r["plain"]))
        rows += [(task, m, r[m]) for m in report["config"]["methods"] if m in r]
    return int(report["config"]["k"]), rows


def _rows_from_metadata(eval_record: dict) -> tuple[int | None, list[tuple[str, str, dict]]]:
    """(k, rows) from the compact record ``pipeline.demo`` stores in draftsmith.json ``eval``."""
    rows = [(task, m, r) for task, methods in (eval_record.get("tasks") or {}).items()
            for m, r in methods.items() if isinstance(r, dict) and "tau" in r]
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


def _serve_lines(head_dir: Path, target: str, k: int) -> list[str]:
    spec = f'{{"method": "eagle3", "model": "{head_dir}", "num_speculative_tokens": {k}}}'
    lines = ["```bash", "# draftsmith (checks this head against the target before serving)",
             f"draftsmith serve --target {target} --speculative-config '{spec}'",
             "# vLLM and SGLang read this directory's config.json (research layout)",
             f"vllm serve {target} --speculative-config '{spec}'",
             f"python -m sglang.launch_server --model {target} --speculative-algorithm EAGLE3 "
             f"--speculative-draft-model-path {head_dir} --speculative-num-steps {k} "
             f"--speculative-eagle-topk 1 --speculative-num-draft-tokens {k + 1}"]
    if (head_dir / SPECULATORS_DIR / "config.json").is_file():
        lines += ["# vLLM, speculators layout: the config names the target and k",
                  f"vllm serve {head_dir / SPECULATORS_DIR}"]
    return lines + ["```"]


def _referee_lines(referee: dict) -> list[str]:
    if not referee:
        return []
    lines = ["## Verified with", "", "Greedy outputs and accepted-per-position counters equal to draftsmith's "
             "own runtime on held-out prompts (`bench/vllm_referee.py`):", "",
             "| engine | version | format | k | prompts | match | checked |", "|---|---|---|---|---|---|---|"]
    for v in sorted(referee.values(), key=lambda v: (v.get("engine", ""), v.get("format", ""), v.get("k", 0))):
        lines.append(f"| {v.get('engine')} | {v.get('version')} | {v.get('format')} | {v.get('k')} | "
                     f"{v.get('prompts')} | {'yes' if v.get('match') else 'no'} | {v.get('checked_at', '')} |")
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


def write_model_card(head_dir: str | Path, report: dict | None = None, plot: str | Path | None = None, *,
                     serve_dir: str | Path | None = None) -> Path:
    """Write ``head_dir/README.md`` (and copy ``plot`` beside it as acceptance.png); returns the card's path.

    ``report``: an ``inference.eval`` report (the table then has tokens/s and speedup); without one the
    held-out results recorded in draftsmith.json ``eval`` are used. A plot already in the directory is
    kept and linked. ``serve_dir``: the directory a draft model's serve commands name (default
    ``head_dir``; an export writes its card in a temp directory before renaming it into place).
    Raises FileNotFoundError when ``head_dir`` is not a head directory."""
    head_dir = Path(head_dir)
    meta = read_metadata(head_dir)
    k, rows = _rows_from_report(report) if report else _rows_from_metadata(meta.eval or {})
    if meta.head_type == "mlp_speculator":
        lines = _mlp_speculator_lines(head_dir, meta, k)
    elif meta.head_type == "draft_model":
        lines = _draft_model_lines(Path(serve_dir or head_dir), meta, k)
    else:
        lines = _eagle3_lines(head_dir, meta, k)
    if rows:
        lines += [f"## Held-out acceptance (greedy{f', k = {k}' if k else ''})", "",
                  "τ = 1 + accepted / drafts; pos i = share of drafts whose i-th token was accepted.", "",
                  acceptance_table(rows, k), ""]
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


def _mlp_speculator_lines(head_dir: Path, meta, k: int | None) -> list[str]:
    """Front matter, serve commands and geometry of an MLP speculator (``export/mlp_speculator.py``)."""
    target, head = meta.target, meta.head_config
    name = target.get("name_or_path")
    k = int(k or head.get("n_predict"))
    spec = f'{{"method": "mlp_speculator", "model": "{head_dir}", "num_speculative_tokens": {k}}}'
    return [
        "---", "library_name: draftsmith", "tags: [speculative-decoding, mlp-speculator]",
        f"base_model: {name}", "---", "",
        f"# MLP speculator for `{name}`", "",
        "An MLP speculator (Wertheimer et al. 2024, arXiv:2404.19124: stage i mixes the previous state, "
        "starting from the target's final hidden state, with the embedding of the previous token and predicts "
        "one token) made with draftsmith. `draftsmith.json` records the target's identity, the training data "
        "and the sha256 of the weight file; `draftsmith check` refuses a mismatched target.", "",
        "## Serve", "", "```bash", "# draftsmith (checks this head against the target before serving)",
        f"draftsmith serve --target {name} --speculative-config '{spec}'",
        "# vLLM reads config.json (model_type mlp_speculator) in releases whose engine serves the method",
        f"vllm serve {name} --speculative-config '{spec}'", "```", "",
        "## Head", "",
        f"- target: `{name}` ({', '.join(target.get('architectures') or [])}, {target.get('num_hidden_layers')} "
        f"layers, hidden {target.get('hidden_size')}, vocab {target.get('vocab_size')})",
        f"- stages (n_predict): {head.get('n_predict')}; inner_dim {head.get('inner_dim')}; "
        f"scale_input {str(head.get('scale_input')).lower()}; drafts at most n_predict tokens per step", "",
    ]


def _draft_model_lines(head_dir: Path, meta, k: int | None) -> list[str]:
    """Front matter, serve commands and geometry of a distilled draft model (``export/draft_model.py``)."""
    target, head = meta.target, meta.head_config
    name = target.get("name_or_path")
    spec = f'{{"method": "draft_model", "model": "{head_dir}", "num_speculative_tokens": {int(k or 5)}}}'
    return [
        "---", "library_name: transformers", "tags: [speculative-decoding, draft-model, draftsmith]",
        f"base_model: {name}", "---", "",
        f"# Draft model for `{name}`", "",
        "A small causal LM over the target's tokenizer and vocabulary, distilled by draftsmith on the target's own "
        "answers with forward KL against the target's full next-token distribution (`train/draft_model.py`). "
        "The directory is an ordinary transformers model; `draftsmith.json` records the target's identity, the "
        "training data and the sha256 of every weight file, and draftsmith's runtime refuses another target.", "",
        "## Serve", "", "```bash", "# draftsmith (checks this draft against the target before serving)",
        f"draftsmith serve --target {name} --speculative-config '{spec}'",
        "# vLLM loads the directory as a normal causal LM",
        f"vllm serve {name} --speculative-config '{spec}'", "```", "",
        "## Draft", "",
        f"- target: `{name}` ({', '.join(target.get('architectures') or [])}, {target.get('num_hidden_layers')} "
        f"layers, hidden {target.get('hidden_size')}, vocab {target.get('vocab_size')})",
        f"- draft: {', '.join(head.get('architectures') or [])}, {head.get('num_hidden_layers')} layers, hidden "
        f"{head.get('hidden_size')}, {head.get('num_parameters')} parameters, vocab {head.get('vocab_size')}", "",
    ]


def _eagle3_lines(head_dir: Path, meta, k: int | None) -> list[str]:
    """Front matter, serve commands and geometry of an EAGLE-3 head."""
    target, head = meta.target, meta.head_config
    name = target.get("name_or_path")
    return [
        "---", "library_name: draftsmith", "tags: [speculative-decoding, eagle3]",
        f"base_model: {name}", "---", "",
        f"# EAGLE-3 draft head for `{name}`", "",
        "An EAGLE-3 head (one decoder layer over the target's low/mid/high hidden states, trained with "
        "training-time test) made with draftsmith. `draftsmith.json` records the target's identity, the "
        "training data and the sha256 of every weight file; `draftsmith check` refuses a mismatched target.", "",
        "## Serve", "", *_serve_lines(head_dir, name, int(k or meta.ttt_steps)), "",
        "## Head", "",
        f"- target: `{name}` ({', '.join(target.get('architectures') or [])}, {target.get('num_hidden_layers')} "
        f"layers, hidden {target.get('hidden_size')}, vocab {target.get('vocab_size')})",
        f"- aux layers (HF hidden_states index): {head.get('aux_layer_ids')}; SGLang numbering "
        f"{[int(i) - 1 for i in head.get('aux_layer_ids') or []]}",
        f"- draft vocab: {head.get('draft_vocab_size')} of {head.get('vocab_size')} target tokens",
        f"- ttt_steps: {head.get('ttt_steps')}", "",
    ]
