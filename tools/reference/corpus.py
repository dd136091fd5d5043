"""Build the reference target's pretraining corpus and its held-out task files (see REPRODUCE.md).

The examples come from ``draftsmith.reference.corpus`` (CPython stdlib modules split by module, three task
families); this script writes them as the jsonl files pretraining reads and samples the held-out tasks
that ship in ``src/draftsmith/reference/tasks``.

Run: ``python tools/reference/corpus.py --out .cache/reference/corpus [--tasks-out DIR]``.
"""

from __future__ import annotations

import json
import random
from pathlib import Path

from draftsmith.arguments import ArgumentParser, run_guarded
from draftsmith.reference.corpus import (
    FAMILIES,
    HELDOUT_PERCENT,
    complete_example,
    distribution_sources,
    examples,
    is_heldout,
    stdlib_sources,
)


def _write_jsonl(path: Path, records: list[dict]) -> None:
    tmp = path.with_suffix(path.suffix + ".tmp")
    with tmp.open("w") as f:
        for r in records:
            f.write(json.dumps(r) + "\n")
    tmp.replace(path)


def build(out: Path, tasks_out: Path | None, seed: int = 0, prompts_per_task: int = 64) -> dict:
    """Write ``train_code.jsonl``, ``heldout_code.jsonl``, ``train_chat.jsonl``, ``heldout_chat.jsonl``
    and ``manifest.json`` under ``out``; with ``tasks_out``, also the held-out task files.

    Returns the manifest (file list with sizes and sha256, split, counts)."""
    out.mkdir(parents=True, exist_ok=True)
    std = stdlib_sources()
    train = [s for s in std if not is_heldout(s.module)]
    held = [s for s in std if is_heldout(s.module)]
    for name, srcs in (("train_code", train), ("heldout_code", held)):
        _write_jsonl(out / f"{name}.jsonl", [{"module": s.module, "text": s.text} for s in srcs])
    train_chat = examples(train, FAMILIES, seed)
    held_chat = examples(held, FAMILIES, seed + 1)
    _write_jsonl(out / "train_chat.jsonl", train_chat)
    _write_jsonl(out / "heldout_chat.jsonl", held_chat)
    manifest = {
        "seed": seed,
        "heldout_percent": HELDOUT_PERCENT,
        "files": [
            {
                "module": s.module,
                "path": s.relpath,
                "bytes": len(s.text.encode()),
                "sha256": s.sha256,
                "split": "heldout" if is_heldout(s.module) else "train",
            }
            for s in std
        ],
        "counts": {
            "train_modules": len(train),
            "heldout_modules": len(held),
            "train_chat": len(train_chat),
            "heldout_chat": len(held_chat),
        },
    }
    if tasks_out is not None:
        manifest["tasks"] = write_tasks(tasks_out, held_chat, seed, prompts_per_task)
    (out / "manifest.json").write_text(json.dumps(manifest, indent=1))
    return manifest


def write_tasks(tasks_out: Path, held_chat: list[dict], seed: int, n: int) -> dict:
    """Sample ``n`` prompts per held-out task and write ``<task>.jsonl`` (prompt messages + reference)."""
    tasks_out.mkdir(parents=True, exist_ok=True)
    foreign = examples(distribution_sources(), {"code-complete": complete_example}, seed + 2)
    pools = {t: [r for r in held_chat if r["task"] == t] for t in FAMILIES}
    pools["code-foreign"] = foreign
    counts = {}
    for task, pool in pools.items():
        rng = random.Random(f"{seed}-{task}")
        picked = rng.sample(pool, min(n, len(pool)))
        records = [
            {
                "id": f"{task}-{i:03d}",
                "task": task,
                "messages": r["messages"][:1],
                "reference": r["messages"][1]["content"],
                "provenance": r["provenance"],
            }
            for i, r in enumerate(picked)
        ]
        _write_jsonl(tasks_out / f"{task}.jsonl", records)
        counts[task] = len(records)
    return counts


def main(argv=None) -> None:
    p = ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", type=Path, required=True, help="folder for the corpus jsonl files")
    p.add_argument("--tasks-out", type=Path, default=None, help="folder for the held-out task files")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--prompts-per-task", type=int, default=64)
    args = p.parse_args(argv)
    m = build(args.out, args.tasks_out, args.seed, args.prompts_per_task)
    print(json.dumps(m["counts"]), json.dumps(m.get("tasks", {})))


if __name__ == "__main__":
    raise SystemExit(run_guarded("python tools/reference/corpus.py", main))  # one line per error
