"""Model card (``README.md``) of an exported head: what it drafts for, how well, how to serve it."""
from __future__ import annotations

import shutil
from pathlib import Path

from draftsmith.export.metadata import read_metadata


def _table(report: dict) -> str:
    methods = report["config"]["methods"]
    rows = ["| task | method | τ | acceptance rate | tokens/s | speedup |", "|---|---|---|---|---|---|"]
    for task, r in report["tasks"].items():
        rows.append(f"| {task} | plain | – | – | {r['plain']['tokens_per_s']:.1f} | 1.00x |")
        for m in methods:
            x = r[m]
            rows.append(f"| {task} | {m} | {x['tau']:.2f} | {x['acceptance_rate']:.1%} | {x['tokens_per_s']:.1f} "
                        f"| {x['speedup']:.2f}x |")
    return "\n".join(rows)


def write_model_card(head_dir: str | Path, report: dict | None = None, plot: str | Path | None = None) -> Path:
    """Write ``head_dir/README.md`` (and copy the acceptance plot beside it); returns the card's path."""
    head_dir = Path(head_dir)
    meta = read_metadata(head_dir)
    target, head = meta.target, meta.head_config
    lines = [
        "---", "library_name: draftsmith", "tags: [speculative-decoding, eagle3]",
        f"base_model: {target.get('name_or_path')}", "---", "",
        f"# EAGLE-3 draft head for `{target.get('name_or_path')}`", "",
        "An EAGLE-3 head (one decoder layer over the target's low/mid/high hidden states, trained with "
        "training-time test) made with draftsmith. `draftsmith.json` records the target's identity, the "
        "training data and the sha256 of every weight file; `draftsmith check` refuses a mismatched target.", "",
        "## Serve", "", "```bash",
        f"draftsmith serve --target {target.get('name_or_path')} --speculative-config "
        f"'{{\"method\": \"eagle3\", \"model\": \"{head_dir}\", \"num_speculative_tokens\": 5}}'",
        f"vllm serve {target.get('name_or_path')} --speculative-config "
        f"'{{\"method\": \"eagle3\", \"model\": \"<this repo>\", \"num_speculative_tokens\": 5}}'", "```", "",
        "## Head", "",
        f"- aux layers (HF hidden_states index): {head.get('aux_layer_ids')}",
        f"- draft vocab: {head.get('draft_vocab_size')} of {head.get('vocab_size')} target tokens",
        f"- ttt_steps: {head.get('ttt_steps')}", "",
    ]
    if report:
        lines += [f"## Held-out acceptance (greedy, k = {report['config']['k']})", "", _table(report), ""]
    if plot and Path(plot).exists():
        shutil.copyfile(plot, head_dir / "acceptance.png")
        lines += ["![acceptance per position](acceptance.png)", ""]
    path = head_dir / "README.md"
    tmp = path.with_name("README.md.tmp")
    tmp.write_text("\n".join(lines))
    tmp.replace(path)
    return path
