"""Every strategy really runs on 2 CPU processes and gives the single-process loss curve.

Each test launches ``tests/distributed_job.py`` with ``accelerate launch`` and the shipped config
file of its strategy (recipes/accelerate/), 2 processes over gloo, and compares with the same job run
in this process. Micro-batches of 1 sequence, 4 per step: 1 process accumulates 4, each of the 2 ranks
accumulates 2 (so accumulation runs inside every strategy too). Checked:
  * the trainer's own launch check passed (strategy and world size as asked),
  * sharded strategies hold half of the trainable state per rank, DDP all of it,
  * the loss, accuracy and grad-norm curves and the final weights equal the single-process run's.
The FSDP run shards the target's layers too and leaves its step-2 checkpoint, which a single process
resumes (the checkpoint format does not depend on the strategy) to the same steps 3-4. Launching
``accelerate launch --cpu --num_processes 2`` starts one process: the trainer must refuse it.
"""

from __future__ import annotations

import importlib.util
import json
import os
import shutil
import socket
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
JOB = ROOT / "tests" / "distributed_job.py"
STEPS = 4
pytestmark = pytest.mark.slow
needs_deepspeed = pytest.mark.skipif(
    importlib.util.find_spec("deepspeed") is None,
    reason="DeepSpeed is not installed (pip install 'draftsmith[deepspeed]', built with DS_BUILD_OPS=0 on CPU)",
)


def _job_module():
    spec = importlib.util.spec_from_file_location("draftsmith_distributed_job", JOB)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    """The job on this one process: 4 accumulation steps of the micro-batches 2 ranks read 2 by 2."""
    out = tmp_path_factory.mktemp("single")
    result = _job_module().run(out, "single", 1, STEPS, micro_batch_size=1)
    checksum = {n: float(p.detach().double().sum()) for n, p in result.head.named_parameters()}
    return {"log": result.log, "checksum": checksum}


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def launch(
    config: str, out: Path, *job_args: str, cpu_flag: bool = False, processes: int = 2, use_cpu_env: bool = True
) -> subprocess.CompletedProcess:
    """``accelerate launch --config_file recipes/accelerate/CONFIG.yaml`` of the job, 10 minutes at most."""
    env = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"}
    env.pop("ACCELERATE_USE_CPU", None)
    if use_cpu_env:
        env["ACCELERATE_USE_CPU"] = "1"
    cmd = [
        sys.executable,
        "-m",
        "accelerate.commands.launch",
        "--config_file",
        str(ROOT / "recipes" / "accelerate" / f"{config}.yaml"),
        "--num_processes",
        str(processes),
        "--main_process_port",
        str(_free_port()),
    ]
    cmd += ["--cpu"] if cpu_flag else []
    cmd += [str(JOB), str(out), *job_args]
    return subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)


def check_equivalent(strategy: str, out: Path, reference: dict, local_fraction: float) -> list[dict]:
    """Both ranks ran ``strategy`` over 2 processes, held ``local_fraction`` of the state, matched the reference."""
    ranks = [json.loads((out / f"rank{r}.json").read_text()) for r in (0, 1)]
    for r, got in enumerate(ranks):
        assert got["sharding"]["strategy"] == strategy and got["sharding"]["world_size"] == 2
        assert got["sharding"]["rank"] == r
        assert got["sharding"]["local_fraction"] == pytest.approx(local_fraction, abs=0.02)
        assert [e["step"] for e in got["log"]] == list(range(1, STEPS + 1))
        for a, b in zip(got["log"], reference["log"]):
            for key in ("loss", "grad_norm", "lr", "acc_0", "acc_1", "acc_2"):
                assert a[key] == pytest.approx(b[key], rel=1e-5, abs=1e-7), (
                    f"{strategy} rank {r} step {a['step']} {key}"
                )
        for name, value in reference["checksum"].items():
            assert got["checksum"][name] == pytest.approx(value, rel=1e-5, abs=1e-6), f"{strategy} rank {r} {name}"
    return ranks


def run_strategy(strategy: str, tmp_path: Path, *extra: str, use_cpu_env: bool = True) -> Path:
    out = tmp_path / strategy
    proc = launch(
        strategy,
        out,
        "--strategy",
        strategy,
        "--num-processes",
        "2",
        "--steps",
        str(STEPS),
        "--micro-batch-size",
        "1",
        *extra,
        use_cpu_env=use_cpu_env,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-6000:]
    started = f"draftsmith train: {strategy} on 2 process(es), online mode, 2 accumulation step(s)"
    assert started in proc.stdout + proc.stderr
    return out


def test_ddp_matches_single_process(tmp_path, reference):
    check_equivalent("ddp", run_strategy("ddp", tmp_path), reference, local_fraction=1.0)


def test_fsdp2_matches_single_process_and_its_checkpoint_resumes_anywhere(tmp_path, reference):
    """Head and (train.target_sharding=fsdp) target layers sharded over the 2 ranks."""
    out = run_strategy("fsdp", tmp_path, "--ckpt-every", "2", "--snapshot-at", "2", "--target-sharding", "fsdp")
    ranks = check_equivalent("fsdp", out, reference, local_fraction=0.5)
    assert [r["sharding"]["target_layers_local_fraction"] for r in ranks] == [0.5, 0.5]
    state = json.loads((out / "checkpoint-step2" / "state.json").read_text())
    assert state["step"] == 2 and state["extra"]["strategy"] == "fsdp"
    resumed_dir = tmp_path / "resumed"
    resumed_dir.mkdir()
    shutil.copytree(out / "checkpoint-step2", resumed_dir / "checkpoint")
    resumed = _job_module().run(resumed_dir, "single", 1, STEPS, micro_batch_size=1)  # FSDP checkpoint, 1 process
    for a, b in zip(resumed.log[2:], reference["log"][2:]):
        assert a["step"] == b["step"] and a["loss"] == pytest.approx(b["loss"], rel=1e-5)


@needs_deepspeed
def test_zero2_matches_single_process(tmp_path, reference):
    out = run_strategy("zero2", tmp_path, use_cpu_env=False)
    check_equivalent("zero2", out, reference, local_fraction=0.5)
    assert (out / "checkpoint" / "deepspeed").is_dir()


@needs_deepspeed
def test_zero3_matches_single_process(tmp_path, reference):
    check_equivalent("zero3", run_strategy("zero3", tmp_path, use_cpu_env=False), reference, local_fraction=0.5)


def test_a_launcher_that_silently_runs_one_process_is_refused(tmp_path):
    proc = launch("ddp", tmp_path / "cpu", "--strategy", "ddp", "--num-processes", "2", cpu_flag=True)
    assert proc.returncode != 0
    assert "LaunchError" in proc.stderr and "expects 2 processes" in proc.stderr, proc.stderr[-3000:]
