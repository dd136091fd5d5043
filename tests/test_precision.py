"""Precision follows what the device computes fast (draftsmith.precision): auto, explicit choices, warnings."""

import json
import os
import platform
import subprocess
import sys

import pytest
import torch

from draftsmith import precision
from draftsmith.precision import DtypeSpeed, SlowPrecisionWarning, dtype_speed, resolve_dtype, resolve_mixed_precision


def fake_speed(fast: bool, ratio: float):
    def speed(dtype, device=None):
        return DtypeSpeed("cpu", precision.dtype_name(dtype), fast, ratio, f"test CPU, ratio {ratio}")

    return speed


def test_auto_picks_bf16_only_where_it_is_native(monkeypatch):
    monkeypatch.setattr(precision, "dtype_speed", fake_speed(True, 0.4))
    native = resolve_mixed_precision("auto", "cpu")
    assert (native.requested, native.value) == ("auto", "bf16") and "test CPU" in native.reason
    monkeypatch.setattr(precision, "dtype_speed", fake_speed(False, 48.0))
    emulated = resolve_mixed_precision("auto", "cpu")
    assert emulated.value == "no" and "fp32" in emulated.reason and emulated.slowdown is None


def test_explicit_bf16_on_an_emulating_cpu_warns_with_the_slowdown_and_the_fix(monkeypatch, caplog):
    monkeypatch.setattr(precision, "dtype_speed", fake_speed(False, 48.0))
    with pytest.warns(SlowPrecisionWarning, match=r"~48x slower than float32.*Fix: set train.mixed_precision: auto"):
        choice = resolve_mixed_precision("bf16", "cpu")
    assert choice.value == "bf16" and choice.slowdown == 48.0  # kept as asked, but loudly
    assert any("emulates" in r.message for r in caplog.records)
    assert resolve_mixed_precision("no", "cpu").value == "no"
    with pytest.raises(ValueError, match="not one of auto, no, bf16, fp16"):
        resolve_mixed_precision("fp8", "cpu")


def test_model_dtype_auto_keeps_the_models_dtype_only_where_it_is_native(monkeypatch):
    monkeypatch.setattr(precision, "dtype_speed", fake_speed(True, 0.4))
    assert resolve_dtype("auto", "cpu", model_dtype=torch.bfloat16)[0] == torch.bfloat16
    assert resolve_dtype("auto", "cpu", model_dtype=None)[0] == torch.float32
    monkeypatch.setattr(precision, "dtype_speed", fake_speed(False, 30.0))
    dtype, reason = resolve_dtype("auto", "cpu", model_dtype=torch.bfloat16)
    assert dtype == torch.float32 and "emulated" in reason
    with pytest.warns(SlowPrecisionWarning, match="Fix: set target.dtype to auto"):
        assert resolve_dtype("bfloat16", "cpu", what="target.dtype")[0] == torch.bfloat16
    with pytest.raises(ValueError, match="float99"):
        resolve_dtype("float99", "cpu")


def test_the_cpu_probe_measures_once_and_its_verdict_follows_its_ratio():
    first = dtype_speed(torch.bfloat16, "cpu")
    assert dtype_speed("bfloat16", "cpu") is first  # once per process
    assert first.fast == (first.ratio <= precision.FAST_RATIO)
    assert "matmul took" in first.reason and "torch capability" in first.reason
    assert dtype_speed(torch.float32, "cpu").fast


@pytest.mark.skipif(platform.machine() not in ("x86_64", "AMD64"), reason="ATEN/oneDNN ISA caps are x86 names")
def test_on_a_cpu_capped_to_avx2_auto_trains_in_fp32():
    """With torch and oneDNN capped to AVX2 (no native bf16 kernels, as on a laptop or cloud CPU without
    avx512_bf16/AMX), the probe measures bf16 as emulated and auto chooses fp32."""
    env = {**os.environ, "ATEN_CPU_CAPABILITY": "avx2", "ONEDNN_MAX_CPU_ISA": "AVX2"}
    code = (
        "import json; from draftsmith.precision import dtype_speed, resolve_mixed_precision; "
        "s = dtype_speed('bfloat16', 'cpu'); c = resolve_mixed_precision('auto', 'cpu'); "
        "print(json.dumps({'fast': s.fast, 'ratio': s.ratio, 'value': c.value}))"
    )
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    result = json.loads(out.stdout.strip().splitlines()[-1])
    assert result == {**result, "fast": False, "value": "no"} and result["ratio"] > precision.FAST_RATIO
