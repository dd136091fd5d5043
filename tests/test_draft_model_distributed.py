"""Draft-model distillation on 2 CPU processes (DDP, FSDP2, ZeRO-3) equals the single-process run.

The generic trainer distributes a draft LM exactly as it does an EAGLE-3 head: same launch helpers as
tests/test_train_distributed.py (``tests/distributed_job.py --drafter draft_model``, shipped accelerate
configs, 2 processes over gloo, micro-batches of 1 sequence, 2 accumulation steps per rank); the HF
decoder layers are the FSDP2 units. Checked: the launched strategy, the share of the trainable state
each rank holds, the loss / grad-norm / accuracy curves and the final weights.
"""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow
_spec = importlib.util.spec_from_file_location(
    "draftsmith_distributed_tests", Path(__file__).resolve().parent / "test_train_distributed.py"
)
base = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(base)


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    """The draft-model job on this one process (the micro-batches the 2 ranks read 2 by 2)."""
    out = tmp_path_factory.mktemp("draft-single")
    result = base._job_module().run(out, "single", 1, base.STEPS, micro_batch_size=1, drafter="draft_model")
    return {
        "log": result.log,
        "checksum": {n: float(p.detach().double().sum()) for n, p in result.head.named_parameters()},
    }


@pytest.mark.parametrize(
    "strategy,fraction", [("ddp", 1.0), ("fsdp", 0.5), pytest.param("zero3", 0.5, marks=base.needs_deepspeed)]
)
def test_draft_model_strategies_match_single_process(tmp_path, reference, strategy, fraction):
    out = tmp_path / strategy
    proc = base.launch(
        strategy,
        out,
        "--strategy",
        strategy,
        "--num-processes",
        "2",
        "--steps",
        str(base.STEPS),
        "--micro-batch-size",
        "1",
        "--drafter",
        "draft_model",
        use_cpu_env=not strategy.startswith("zero"),
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-6000:]
    for r in (0, 1):
        got = json.loads((out / f"rank{r}.json").read_text())
        assert got["sharding"]["strategy"] == strategy and got["sharding"]["rank"] == r
        assert got["sharding"]["local_fraction"] == pytest.approx(fraction, abs=0.02)
        assert [e["step"] for e in got["log"]] == list(range(1, base.STEPS + 1))
        for a, b in zip(got["log"], reference["log"]):
            for key in ("loss", "grad_norm", "lr", "acc_0"):
                assert a[key] == pytest.approx(b[key], rel=1e-5, abs=1e-7), (
                    f"{strategy} rank {r} step {a['step']} {key}"
                )
        for name, value in reference["checksum"].items():
            assert got["checksum"][name] == pytest.approx(value, rel=1e-5, abs=1e-6), f"{strategy} rank {r} {name}"
