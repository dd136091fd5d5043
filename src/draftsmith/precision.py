"""Which floating-point precision a device computes fast: one rule for every place that picks a dtype.

    choice = resolve_mixed_precision("auto", torch.device("cpu"))    # PrecisionChoice("bf16" | "no", reason)
    dtype, reason = resolve_dtype("auto", torch.device("cpu"), model_dtype=torch.bfloat16)

Half precision is fast only where the hardware has it: CUDA devices of compute capability 8.0+ for
bf16 (``torch.cuda.is_bf16_supported``), CPUs with AVX512-BF16 or AMX for bf16 and AVX512-FP16 or AMX
for fp16. Elsewhere torch emulates it: on an AVX2-only x86 CPU a bf16 matmul runs ~30-50x slower than
fp32 (a 512x384 @ 384x1152 product: 3.6 ms fp32, 195 ms bf16, issue 13). CPU flags do not tell the
whole story (oneDNN may or may not have a kernel for the ISA, and ARM has its own extensions), so on a
CPU the answer is **measured**: a short fp32 and half-precision matmul, once per process and dtype
(:func:`dtype_speed`, ~10 ms where half precision is native, ~0.2 s where it is emulated). A dtype is
"fast" when its matmul takes at most ``FAST_RATIO`` times fp32's; native bf16 measures 0.1-0.6x,
emulated 25-60x, so the threshold sits far from both.

Rules (``auto``):
  * training (``train.mixed_precision``, :func:`resolve_mixed_precision`): bf16 where bf16 is fast,
    else ``no`` (fp32). fp16 is never chosen automatically (it needs loss scaling).
  * model weights (``target.dtype`` / ``--dtype``, :func:`resolve_dtype`): the model's own dtype
    (its config's ``torch_dtype``) where that dtype is fast on the device, else float32.
An explicit half-precision request on a device that emulates it is kept (the user may want the exact
numerics) but warned about loudly, with the measured slowdown and the fix.
"""

from __future__ import annotations

import functools
import logging
import platform
import time
import warnings
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

logger = logging.getLogger(__name__)

FAST_RATIO = 2.0  #: a dtype is fast when its matmul takes <= this x fp32's
PROBE_SIZE = 384  #: the probe multiplies [n, n] @ [n, 3n] matrices (the demo head's shapes)
MIXED_PRECISION = ("auto", "no", "bf16", "fp16")  #: ``train.mixed_precision`` values (accelerate's + auto)
DTYPE_NAMES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
_HALF = {"bf16": torch.bfloat16, "fp16": torch.float16}


class SlowPrecisionWarning(UserWarning):
    """An explicit half-precision request on a device that emulates it (it runs, many times slower)."""


@dataclass(frozen=True)
class DtypeSpeed:
    """How fast ``dtype`` computes on ``device`` relative to float32.

    Attributes:
        device: ``cpu`` or ``cuda:N`` (the device type of the probe).
        dtype: ``bfloat16`` | ``float16`` | ``float32``.
        fast: True when the device computes it natively (see module docstring).
        ratio: measured matmul time of ``dtype`` / float32 (None where nothing was timed: CUDA, fp32).
        reason: one sentence saying how this was decided (CPU, flags, timings).
    """

    device: str
    dtype: str
    fast: bool
    ratio: float | None
    reason: str

    def as_dict(self) -> dict:
        return asdict(self)


@dataclass(frozen=True)
class PrecisionChoice:
    """A resolved ``train.mixed_precision``: ``value`` is what accelerate gets (no | bf16 | fp16).

    Attributes:
        requested: what the recipe said (auto | no | bf16 | fp16). value: the choice.
        reason: why (the device probe's sentence). slowdown: measured half/fp32 matmul ratio when the
            choice is an emulated half precision (warned), else None.
    """

    requested: str
    value: str
    reason: str
    slowdown: float | None = None

    def as_dict(self) -> dict:
        return asdict(self)


def cpu_description() -> str:
    """The CPU as one line: model name, architecture, torch's capability and the half-precision flags."""
    name = platform.processor() or platform.machine()
    flags: set[str] = set()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name") and ":" in line:
                name = line.split(":", 1)[1].strip()
            elif line.startswith(("flags", "Features")) and ":" in line:
                flags = set(line.split(":", 1)[1].split())
    except OSError:
        pass
    half = sorted(f for f in flags if f in ("avx512_bf16", "amx_bf16", "avx512_fp16", "amx_fp16", "bf16"))
    capability = torch.backends.cpu.get_cpu_capability()
    return (
        f"{name} ({platform.machine()}, torch capability {capability}, "
        f"{'flags ' + ' '.join(half) if half else 'no bf16/fp16 flags'})"
    )


def _time_matmuls(dtypes: tuple[torch.dtype, ...], n: int, repeats: int = 7) -> list[float]:
    """Fastest of ``repeats`` [n, n] @ [n, 3n] products in each of ``dtypes`` on the CPU (seconds), after two
    warm-ups each. The dtypes take turns within each repeat, so a neighbour's burst of load slows them alike: timed
    one after the other, a busy 2-core machine once read bf16 as 5.6x slower than fp32 on a CPU where it is 6x
    faster (AMX), and the demo trained in fp32."""
    g = torch.Generator().manual_seed(0)
    pairs = [(torch.randn(n, n, generator=g).to(d), torch.randn(n, 3 * n, generator=g).to(d)) for d in dtypes]
    for a, b in pairs * 2:
        a @ b
    best = [float("inf")] * len(dtypes)
    for _ in range(repeats):
        for i, (a, b) in enumerate(pairs):
            t0 = time.perf_counter()
            a @ b
            best[i] = min(best[i], time.perf_counter() - t0)
    return best


@functools.lru_cache(maxsize=None)
def _cpu_speed(dtype_name: str) -> DtypeSpeed:
    dtype = DTYPE_NAMES[dtype_name]
    if dtype == torch.float32:
        return DtypeSpeed("cpu", dtype_name, True, None, "float32 is every CPU's native precision")
    fp32, half = _time_matmuls((torch.float32, dtype), PROBE_SIZE)
    ratio = half / max(fp32, 1e-9)
    fast = ratio <= FAST_RATIO
    reason = (
        f"{cpu_description()}: a {PROBE_SIZE}x{PROBE_SIZE} @ {PROBE_SIZE}x{3 * PROBE_SIZE} matmul took "
        f"{half * 1e3:.2f} ms in {dtype_name} vs {fp32 * 1e3:.2f} ms in float32 ({ratio:.2f}x): "
        f"{dtype_name} is {'native' if fast else 'emulated'} here"
    )
    logger.info("precision probe: %s", reason)
    return DtypeSpeed("cpu", dtype_name, fast, round(ratio, 3), reason)


def dtype_speed(dtype: torch.dtype | str, device: torch.device | str | None = None) -> DtypeSpeed:
    """Whether ``device`` (default: cuda when available, else cpu) computes ``dtype`` natively.

    CUDA: bf16 on ``torch.cuda.is_bf16_supported()`` devices, fp16 always (tensor cores since Volta).
    CPU: measured once per process and dtype (module docstring). Other devices (mps, xpu): float32 only.

    Raises ValueError for a dtype other than float32 / bfloat16 / float16."""
    name = dtype_name(dtype)
    device = torch.device(device) if device is not None else default_device()
    if device.type == "cpu":
        return _cpu_speed(name)
    if name == "float32":
        return DtypeSpeed(str(device), name, True, None, "float32 is native everywhere")
    if device.type == "cuda":
        gpu = torch.cuda.get_device_name(device)
        fast = torch.cuda.is_bf16_supported() if name == "bfloat16" else True
        return DtypeSpeed(
            str(device),
            name,
            fast,
            None,
            f"{gpu}: {name} {'is supported' if fast else 'is not supported (compute capability < 8.0)'}",
        )
    return DtypeSpeed(str(device), name, False, None, f"{device.type}: half precision is not probed; float32 chosen")


def default_device() -> torch.device:
    """cuda when available, else cpu (where draftsmith trains and serves by default)."""
    return torch.device("cuda" if torch.cuda.is_available() else "cpu")


def dtype_name(dtype: torch.dtype | str) -> str:
    """``torch.bfloat16`` / ``"bfloat16"`` / ``"bf16"`` -> ``"bfloat16"``; ValueError for other dtypes."""
    if isinstance(dtype, torch.dtype):
        names = {v: k for k, v in DTYPE_NAMES.items()}
        if dtype in names:
            return names[dtype]
    elif dtype in DTYPE_NAMES:
        return dtype
    elif dtype in _HALF:
        return dtype_name(_HALF[dtype])
    raise ValueError(f"dtype {dtype!r} is not one of {', '.join(DTYPE_NAMES)}")


def _slow_warning(what: str, speed: DtypeSpeed, fix: str) -> str:
    slowdown = f" ~{speed.ratio:.0f}x slower than float32" if speed.ratio else ""
    return (
        f"{what} asks for {speed.dtype}, which this device emulates ({speed.reason}); it will run{slowdown}. Fix: {fix}"
    )


def resolve_mixed_precision(requested: str, device: torch.device | str | None = None) -> PrecisionChoice:
    """``train.mixed_precision`` -> what accelerate gets, with the reason (rules: module docstring).

    ``auto``: ``bf16`` where bf16 is fast on ``device``, else ``no``. ``bf16`` / ``fp16`` on a device that
    emulates them: kept, with a ``SlowPrecisionWarning`` (and a logged warning) naming the measured
    slowdown and the fix. ``no``: fp32.

    Raises ValueError for a value outside ``MIXED_PRECISION``."""
    if requested not in MIXED_PRECISION:
        raise ValueError(f"train.mixed_precision {requested!r} is not one of {', '.join(MIXED_PRECISION)}")
    if requested == "no":
        return PrecisionChoice("no", "no", "fp32 as asked (train.mixed_precision: no)")
    speed = dtype_speed(_HALF.get(requested, torch.bfloat16), device)
    if requested == "auto":
        value = "bf16" if speed.fast else "no"
        return PrecisionChoice("auto", value, f"auto -> {'bf16' if speed.fast else 'fp32'}: {speed.reason}")
    if not speed.fast:
        message = _slow_warning(
            f"train.mixed_precision: {requested}",
            speed,
            "set train.mixed_precision: auto (or no) to train in fp32 on this machine",
        )
        logger.warning("%s", message)
        warnings.warn(message, SlowPrecisionWarning, stacklevel=2)
        return PrecisionChoice(requested, requested, message, slowdown=speed.ratio)
    return PrecisionChoice(requested, requested, f"{requested} as asked: {speed.reason}")


def resolve_dtype(
    requested: str | torch.dtype,
    device: torch.device | str | None = None,
    model_dtype: torch.dtype | str | None = None,
    what: str = "dtype",
) -> tuple[torch.dtype, str]:
    """A model's weight dtype (``target.dtype``, ``--dtype``) -> (torch dtype, reason).

    ``auto``: ``model_dtype`` (the config's ``torch_dtype``; float32 when unknown) where it is fast on
    ``device``, else float32. An explicit half precision the device emulates is kept and warned about
    (``SlowPrecisionWarning``), naming ``what`` (e.g. ``target.dtype``) in the fix.

    Raises ValueError for an unknown dtype name."""
    if requested == "auto":
        want = dtype_name(model_dtype) if model_dtype is not None else "float32"
        if want not in DTYPE_NAMES:
            want = "float32"
        speed = dtype_speed(want, device)
        if speed.fast:
            return DTYPE_NAMES[want], f"auto -> {want} (the model's dtype): {speed.reason}"
        return torch.float32, f"auto -> float32 (the model's {want} is emulated here): {speed.reason}"
    name = dtype_name(requested)
    speed = dtype_speed(name, device)
    if not speed.fast:
        message = _slow_warning(what, speed, f"set {what} to auto (or float32) on this machine")
        logger.warning("%s", message)
        warnings.warn(message, SlowPrecisionWarning, stacklevel=2)
        return DTYPE_NAMES[name], message
    return DTYPE_NAMES[name], f"{name} as asked: {speed.reason}"


def machine_record() -> dict:
    """What a timing was measured on: CPU, torch version and threads, GPU (if any), and whether bf16 is native."""
    cuda = torch.cuda.is_available()
    return {
        "cpu": cpu_description(),
        "torch": torch.__version__,
        "threads": torch.get_num_threads(),
        "gpu": torch.cuda.get_device_name(0) if cuda else None,
        "bf16": dtype_speed(torch.bfloat16, default_device()).as_dict(),
    }
