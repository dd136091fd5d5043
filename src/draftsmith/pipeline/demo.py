"""The main job end to end on one target (``draftsmith demo``, ``make demo``): prepare, capture, train, export,
check, eval, and one request served over HTTP; prints the eval table and the stage times with the machine.

    draftsmith demo                        # recipes/reference/eagle3.yaml on the embedded reference target
"""

from __future__ import annotations

import json
import threading
import time
from pathlib import Path

from draftsmith import reference
from draftsmith.drafters.directory import check_export, drafter_of
from draftsmith.evaluation.heldout import format_table
from draftsmith.export.metadata import read_metadata
from draftsmith.models import load_target
from draftsmith.pipeline.recipe import Recipe
from draftsmith.pipeline.stages import run_eval, run_train, timed
from draftsmith.precision import machine_record
from draftsmith.serve.engine import Engine
from draftsmith.serve.server import create_app


def serve_check(target, tokenizer, head_dir: Path, k: int, prompt: str, max_tokens: int = 48) -> dict:
    """Serve the exported drafter for real (uvicorn on 127.0.0.1, an ephemeral port), send one chat request, read
    ``/metrics``, stop the server. Returns the answer and the spec-decode counters it scraped."""
    import httpx  # the serve extra: optional dependencies
    import uvicorn

    engine = Engine(
        target, tokenizer, drafter_of(head_dir).speculative_config(str(head_dir), k), model_name="reference"
    )
    server = uvicorn.Server(uvicorn.Config(create_app(engine), host="127.0.0.1", port=0, log_level="warning"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    try:
        for _ in range(600):
            if server.started:
                break
            time.sleep(0.05)
        port = server.servers[0].sockets[0].getsockname()[1]
        base = f"http://127.0.0.1:{port}"
        reply = httpx.post(
            f"{base}/v1/chat/completions",
            timeout=300,
            json={
                "model": "reference",
                "messages": [{"role": "user", "content": prompt}],
                "max_tokens": max_tokens,
                "temperature": 0,
            },
        ).json()
        metrics = httpx.get(f"{base}/metrics", timeout=30).text
    finally:
        server.should_exit = True
        thread.join(timeout=30)
    counters = {
        line.split(" ")[0].removeprefix("draftsmith:spec_decode_"): float(line.split(" ")[1])
        for line in metrics.splitlines()
        if line.startswith("draftsmith:spec_decode_num_") and "{" not in line and "_created" not in line
    }
    return {
        "url": base,
        "answer": reply["choices"][0]["message"]["content"],
        "usage": reply["usage"],
        "metrics": counters,
    }


def reference_prompt(recipe: Recipe) -> str:
    """The first prompt of the first held-out task (what the demo sends to its server)."""
    return reference.tasks(recipe.eval.tasks[:1], limit=1)[recipe.eval.tasks[0]][0]["messages"][-1]["content"]


def demo(recipe: Recipe) -> dict:
    """The main job end to end on one target; prints the table and returns the report."""

    t0 = time.time()
    stages: dict[str, float] = {}
    with timed(stages, "load target"):
        target, tokenizer = load_target(recipe.target)
    head_dir = run_train(recipe, target, tokenizer, stages)
    with timed(stages, "check"):
        check = check_export(head_dir, target.config, tokenizer, recipe.target.name_or_path)
    print(check.summary())
    with timed(stages, "eval"):
        report = run_eval(recipe, head_dir, target, tokenizer)  # recorded in the head (``run_eval``)
    with timed(stages, "serve check"):
        served = serve_check(
            target, tokenizer, head_dir, recipe.drafter.num_speculative_tokens, reference_prompt(recipe)
        )
    print(
        f"served {head_dir} at {served['url']}: {served['usage']['completion_tokens']} tokens, "
        f"/metrics {served['metrics']}"
    )
    report["serve_check"] = served
    report["wall_clock_s"] = time.time() - t0
    report["stages_s"] = stages
    report["machine"] = {**machine_record(), "training_precision": read_metadata(head_dir).training.get("precision")}
    (recipe.run_dir / "eval" / "report.json").write_text(json.dumps(report, indent=1))
    print(format_table(report))
    print(format_stages(report))
    print(
        f"report: {recipe.run_dir / 'eval' / 'report.json'}  plot: {recipe.run_dir / 'eval' / 'acceptance.png'}  "
        f"head: {head_dir}  ({report['wall_clock_s'] / 60:.1f} min)"
    )
    return report


def format_stages(report: dict) -> str:
    """The demo's stage times (minutes) and the machine they were measured on, as printed at its end."""
    machine = report.get("machine") or {}
    precision = machine.get("training_precision") or {}
    lines = [
        f"stage times on {machine.get('cpu', 'an unknown CPU')}"
        + (f" + {machine['gpu']}" if machine.get("gpu") else "")
        + f", {machine.get('threads', '?')} torch threads; training precision {precision.get('value', '?')}"
        + (f" ({precision['requested']})" if precision.get("requested") == "auto" else "")
    ]
    for name, seconds in (report.get("stages_s") or {}).items():
        lines.append(f"  {name:<24}{seconds / 60:>7.1f} min")
    lines.append(f"  {'total':<24}{report.get('wall_clock_s', 0.0) / 60:>7.1f} min")
    return "\n".join(lines)
