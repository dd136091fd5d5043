"""Distribution strategies of the drafter trainer (``train.trainer``) under ``accelerate launch``.

    ACCELERATE_USE_CPU=1 accelerate launch --config_file recipes/accelerate/ddp.yaml --num_processes 2 \\
        -m draftsmith.cli train RECIPE train.strategy=ddp train.num_processes=2

| strategy | accelerate config (recipes/accelerate/) | who shards                | sharded across ranks            |
|----------|-----------------------------------------|---------------------------|---------------------------------|
| single   | single.yaml                             | -                         | nothing                         |
| ddp      | ddp.yaml                                | accelerate (DDP)          | nothing; gradients all-reduced  |
| fsdp     | fsdp.yaml                               | this module (FSDP2)       | head params, grads, optimizer   |
| zero2    | zero2.yaml                              | DeepSpeed via accelerate  | grads, optimizer state          |
| zero3    | zero3.yaml                              | DeepSpeed via accelerate  | params, grads, optimizer state  |

The frozen target is replicated on every rank, except with ``train.target_sharding: fsdp`` (strategy
fsdp only): its decoder layers are then FSDP2-sharded too (:func:`shard_target_fsdp2`), for targets
larger than one device. Facts measured on CPU (issue 5) that shape this file:
  * ``ACCELERATE_USE_CPU=1 accelerate launch --multi_gpu --num_processes 2`` (or a MULTI_GPU config
    file) gives real DDP over gloo; ``--cpu --num_processes 2`` silently runs ONE process. Hence
    :func:`check_launch`: a recipe states ``train.strategy`` / ``train.num_processes`` and the trainer
    refuses to start when the launcher delivered something else.
  * DeepSpeed ZeRO-2/3 run on CPU when the Accelerator gets ``InitProcessGroupKwargs(backend="gloo")``
    (:func:`make_accelerator` adds it when there is no CUDA) and is NOT told to use the CPU: with
    ``ACCELERATE_USE_CPU=1`` or ``Accelerator(cpu=True)`` accelerate silently drops DeepSpeed for DDP.
  * accelerate does not enable FSDP on CPU (it falls back to DDP), while raw FSDP2 ``fully_shard``
    works with gloo. So for ``fsdp`` the trainer applies ``fully_shard`` itself, on CPU and GPU alike
    (one code path, tested here on CPU); the accelerate FSDP config only selects the strategy
    (``ACCELERATE_USE_FSDP``) and launches the processes, and accelerate never wraps the head.

Every strategy computes the same loss curve for the same seed and data (``tests/test_train_distributed.py``):
a step's global batch is cut into the same micro-batches whatever the world size (``train.batches``),
DDP/FSDP/ZeRO average gradients over ranks exactly as gradient accumulation averages them over
micro-batches on one process.
"""

from __future__ import annotations

import contextlib
import math
import os
from dataclasses import dataclass

import torch
from accelerate import Accelerator
from accelerate.state import AcceleratorState
from accelerate.utils import DistributedType, InitProcessGroupKwargs
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_optimizer_state_dict,
    set_optimizer_state_dict,
)
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

STRATEGIES = ("single", "ddp", "fsdp", "zero2", "zero3")
HEAD_PREFIX = "head."  # the drafter sits at ``module.head`` inside the objective that gets wrapped


class LaunchError(RuntimeError):
    """The processes that were launched are not the ones the recipe asks for (message says how to launch)."""


def _env_flag(name: str) -> bool:
    return os.environ.get(name, "").strip().lower() in ("1", "true", "yes")


def _cpu_launch_hint(strategy: str) -> str:
    config = {"single": "single", "ddp": "ddp", "fsdp": "fsdp", "zero2": "zero2", "zero3": "zero3"}.get(strategy, "ddp")
    cpu = (
        "on CPU without ACCELERATE_USE_CPU, which turns DeepSpeed off"
        if config.startswith("zero")
        else "on CPU prefix ACCELERATE_USE_CPU=1"
    )
    return (
        f"launch with `accelerate launch --config_file recipes/accelerate/{config}.yaml --num_processes N ...` "
        f"({cpu}; `accelerate launch --cpu --num_processes N` starts ONE process)"
    )


def make_accelerator(mixed_precision: str, log_with: list[str] | None = None, project_dir: str | None = None):
    """The run's ``Accelerator``: CPU when there is no CUDA, gloo for DeepSpeed on CPU (measured, issue 5).

    accelerate keeps one ``AcceleratorState`` per process and refuses a second ``Accelerator`` with another
    mixed precision; a process that trains several drafters (a notebook, the tests) may choose differently
    per run, so that per-run state is reset here. The process group (``PartialState``) is kept."""

    state = AcceleratorState._shared_state
    if state and state.get("_mixed_precision") not in (None, mixed_precision):
        AcceleratorState._reset_state(reset_partial_state=False)
    cuda = torch.cuda.is_available()
    deepspeed = _env_flag("ACCELERATE_USE_DEEPSPEED")
    handlers = [InitProcessGroupKwargs(backend="gloo")] if deepspeed and not cuda else []
    # cpu=True (like ACCELERATE_USE_CPU=1) would turn DeepSpeed off: accelerate then falls back to DDP
    return Accelerator(
        mixed_precision=mixed_precision,
        cpu=not cuda and not deepspeed,
        kwargs_handlers=handlers,
        log_with=log_with or None,
        project_dir=project_dir,
    )


def launched_strategy(accelerator) -> str:
    """What the launcher started, as a strategy name (see the module table).

    ``fsdp`` when the launcher was given an FSDP config (``ACCELERATE_USE_FSDP``), whatever accelerate
    made of it (on CPU it falls back to DDP; the trainer then shards itself). Raises LaunchError for a
    DeepSpeed stage other than 2 or 3, or an FSDP config asking for FSDP version 1."""

    dt = accelerator.distributed_type
    if dt == DistributedType.DEEPSPEED:
        stage = int(accelerator.state.deepspeed_plugin.zero_stage)
        if stage not in (2, 3):
            raise LaunchError(
                f"DeepSpeed ZeRO stage {stage} is not a draftsmith strategy; use recipes/accelerate/"
                "zero2.yaml or zero3.yaml"
            )
        return f"zero{stage}"
    if dt == DistributedType.FSDP or _env_flag("ACCELERATE_USE_FSDP"):
        if os.environ.get("FSDP_VERSION", "2") != "2":
            raise LaunchError(
                "draftsmith applies FSDP2 (fully_shard) itself: set fsdp_version: 2 in the accelerate "
                "config (recipes/accelerate/fsdp.yaml)"
            )
        return "fsdp"
    return "ddp" if accelerator.num_processes > 1 else "single"


def check_launch(accelerator, strategy: str = "auto", num_processes: int | None = None) -> str:
    """Refuse to train unless the launched processes are what the recipe asks for; returns the strategy.

    strategy: ``auto`` (take what was launched) or one of STRATEGIES. num_processes: the expected
    world size (None: not checked). Raises LaunchError when the world size differs, the launched
    strategy differs, or a multi-process strategy runs on one process (what ``accelerate launch --cpu
    --num_processes 2`` silently does)."""
    if strategy != "auto" and strategy not in STRATEGIES:
        raise ValueError(f"strategy {strategy!r} is not one of auto, {', '.join(STRATEGIES)}")
    got, world = launched_strategy(accelerator), accelerator.num_processes
    if num_processes is not None and world != num_processes:
        raise LaunchError(
            f"the recipe expects {num_processes} processes (train.num_processes) but {world} were "
            f"launched; {_cpu_launch_hint(strategy if strategy != 'auto' else got)}"
        )
    if strategy != "auto" and got != strategy:
        raise LaunchError(
            f"the recipe asks for strategy {strategy!r} (train.strategy) but the launcher started "
            f"{got!r} on {world} process(es); {_cpu_launch_hint(strategy)}"
        )
    if got != "single" and world < 2:
        raise LaunchError(f"strategy {got!r} was launched on a single process; {_cpu_launch_hint(got)}")
    return got


# --------------------------------------------------------------------------------------------- wrapping


@contextlib.contextmanager
def whole_parameters():
    """Build transformers models with whole (unpartitioned) parameters, even under ZeRO-3.

    Measured (accelerate 1.x, transformers 5.24): accelerate registers transformers' ``HfDeepSpeedConfig``
    whenever a ZeRO-3 plugin exists, whatever ``zero3_init_flag`` says, and transformers then partitions
    every model built from a config or loaded (``deepspeed.zero.Init``): a draft LM built inside the
    trainer had 0-element parameters on each rank. The trainer hands the whole drafter to
    ``accelerate.prepare``, which partitions it once, as for an EAGLE-3 head."""
    try:
        from transformers.integrations import deepspeed as hf_deepspeed
    except ImportError:  # no transformers DeepSpeed integration: nothing to undo
        yield
        return
    ref = hf_deepspeed._hf_deepspeed_config_weak_ref  # kept alive by accelerate's plugin (``dschf``)
    config = ref() if ref is not None else None
    if config is None:
        yield
        return
    hf_deepspeed.unset_hf_deepspeed_config()
    try:
        yield
    finally:
        hf_deepspeed.set_hf_deepspeed_config(config)


def configure_deepspeed(accelerator, micro_batch_size: int, grad_accum: int, grad_clip: float) -> None:
    """Fill the DeepSpeed config fields accelerate cannot infer without a prepared dataloader.

    Must run before ``accelerator.prepare``; gradient clipping is then done by DeepSpeed (``grad_clip``)."""
    cfg = accelerator.state.deepspeed_plugin.deepspeed_config
    cfg["train_micro_batch_size_per_gpu"] = micro_batch_size
    cfg["gradient_accumulation_steps"] = grad_accum
    cfg["train_batch_size"] = micro_batch_size * grad_accum * accelerator.num_processes
    cfg["gradient_clipping"] = grad_clip


def apply_fsdp2(
    module: torch.nn.Module,
    device: torch.device,
    world_size: int,
    mixed_precision: str,
    reshard_after_forward: bool = True,
    units=None,
) -> torch.nn.Module:
    """Shard ``module`` (the objective holding the drafter at ``.head``) with FSDP2 ``fully_shard`` over
    all ranks.

    Each of ``units`` (``DrafterSpec.fsdp_units``; default, for an EAGLE-3 head: its decoder layer) is
    its own FSDP unit, the rest (EAGLE-3: fc, norm, lm_head) belongs to the root unit. With
    ``mixed_precision`` bf16/fp16 parameters are cast for compute and gradients reduced in fp32
    (``MixedPrecisionPolicy``). Returns the same module, now an ``FSDPModule``; build the optimizer
    afterwards, over the sharded (DTensor) parameters."""

    mesh = init_device_mesh(device.type, (world_size,))
    dtype = {"bf16": torch.bfloat16, "fp16": torch.float16}.get(mixed_precision)
    policy = MixedPrecisionPolicy(
        param_dtype=dtype, reduce_dtype=torch.float32 if dtype else None, cast_forward_inputs=False
    )
    for unit in [module.head.midlayer] if units is None else units:
        fully_shard(unit, mesh=mesh, mp_policy=policy, reshard_after_forward=reshard_after_forward)
    fully_shard(module, mesh=mesh, mp_policy=policy, reshard_after_forward=reshard_after_forward)
    return module


def shard_target_fsdp2(target, device: torch.device, world_size: int) -> None:
    """Shard the frozen target's decoder layers with FSDP2 (each layer one unit, all-gathered for its
    forward, resharded after) and move everything else (embedding, final norm, lm_head, rotary) to
    ``device`` unsharded: the head reads the embedding and lm_head directly.

    For targets that do not fit one device (Llama-3.3-70B in bf16 is 141 GB). The target must still
    be loaded whole on CPU in every process first. Every rank must then run the same target
    forwards (training steps do; in-loop τ runs all prompts on every rank)."""

    layers = target.get_decoder().layers
    mesh = init_device_mesh(device.type, (world_size,))
    for layer in layers:
        fully_shard(layer, mesh=mesh, reshard_after_forward=True)
    inside = {id(m) for m in layers.modules()}
    for module in target.modules():
        if id(module) not in inside:
            module._apply(lambda t: t.to(device), recurse=False)


# --------------------------------------------------------------------------------------------- inspection


@dataclass
class ShardingReport:
    """Trainable parameter elements held by this rank against the full count, per strategy.

    ``local`` counts what this rank stores of the sharded state: parameters (fsdp, zero3) or the
    fp32 optimizer partition (zero2); ``full`` the unsharded total. Sharded strategies hold about
    full / world_size (padding aside)."""

    strategy: str
    world_size: int
    rank: int
    local: int
    full: int

    @property
    def fraction(self) -> float:
        """local / full (about 1 / world_size when sharded, 1 when replicated)."""
        return self.local / max(1, self.full)

    def as_dict(self) -> dict:
        """JSON-ready view (logged and returned in ``TrainResult.sharding``)."""
        return {
            "strategy": self.strategy,
            "world_size": self.world_size,
            "rank": self.rank,
            "local_elements": self.local,
            "full_elements": self.full,
            "local_fraction": round(self.fraction, 4),
        }


def local_fraction(module: torch.nn.Module) -> float:
    """Share of ``module``'s parameter elements stored on this rank (DTensor shards count their local part)."""
    params = list(module.parameters())
    local = sum(p.to_local().numel() if hasattr(p, "to_local") else p.numel() for p in params)
    return local / max(1, sum(p.numel() for p in params))


def sharding_report(strategy: str, accelerator, module, optimizer) -> ShardingReport:
    """Measure what this rank holds (see :class:`ShardingReport`)."""
    params = [p for p in module.parameters() if p.requires_grad]
    if strategy == "fsdp":
        local = sum(p.to_local().numel() for p in params)
        full = sum(p.numel() for p in params)
    elif strategy == "zero3":
        local = sum(p.ds_tensor.numel() for p in params)
        full = sum(p.ds_numel for p in params)
    elif strategy == "zero2":
        zero = optimizer.optimizer if hasattr(optimizer, "optimizer") else optimizer
        local = sum(t.numel() for t in zero.single_partition_of_fp32_groups)
        full = sum(p.numel() for p in params)
    else:
        local = full = sum(p.numel() for p in params)
    return ShardingReport(strategy, accelerator.num_processes, accelerator.process_index, local, full)


def check_sharding(report: ShardingReport) -> None:
    """Raise LaunchError unless a sharded strategy really holds about 1/world of the state on this rank."""
    if report.strategy in ("fsdp", "zero2", "zero3"):
        bound = math.ceil(report.full / report.world_size) * 1.25 + 1024  # padding / alignment slack
        if report.local > bound:
            raise LaunchError(
                f"{report.strategy} on {report.world_size} ranks should hold about 1/{report.world_size} "
                f"of the {report.full} trainable elements on rank {report.rank}, it holds {report.local}"
            )
    elif report.local != report.full:
        raise LaunchError(
            f"{report.strategy} should replicate the head, rank {report.rank} holds "
            f"{report.local} of {report.full} elements"
        )


# --------------------------------------------------------------------------------------------- full state


def _strip(name: str) -> str:
    return name[len(HEAD_PREFIX) :] if name.startswith(HEAD_PREFIX) else name


def full_head_params(strategy: str, module, raw_module) -> dict[str, torch.Tensor]:
    """Full trainable head parameters by head name (``fc.weight``, ...), on every rank, on CPU.

    Collective for fsdp and zero3 (every rank must call it). ``raw_module`` is the unwrapped objective."""
    if strategy == "fsdp":
        sd = get_model_state_dict(module, options=StateDictOptions(full_state_dict=True))
        trainable = {n for n, p in raw_module.named_parameters() if p.requires_grad}
        return {_strip(n): t.detach().cpu() for n, t in sd.items() if n in trainable}
    named = [(n, p) for n, p in raw_module.named_parameters() if p.requires_grad]
    if strategy == "zero3":
        import deepspeed

        with deepspeed.zero.GatheredParameters([p for _, p in named]):
            return {_strip(n): p.detach().clone().cpu() for n, p in named}
    return {_strip(n): p.detach().cpu() for n, p in named}


def full_optimizer_state(strategy: str, module, raw_module, optimizer) -> dict[str, dict] | None:
    """Full optimizer state ``{head param name: {key: value}}`` (None for ZeRO: DeepSpeed saves its own).

    Collective for fsdp. ``optimizer`` is the torch optimizer (unwrapped)."""
    if strategy in ("zero2", "zero3"):
        return None
    if strategy == "fsdp":
        sd = get_optimizer_state_dict(module, optimizer, options=StateDictOptions(full_state_dict=True))
        return {
            _strip(n): {k: v.detach().cpu() if torch.is_tensor(v) else v for k, v in st.items()}
            for n, st in sd["state"].items()
        }
    ids = {id(p): _strip(n) for n, p in raw_module.named_parameters() if p.requires_grad}
    return {ids[id(p)]: dict(st) for p, st in optimizer.state.items()}


def load_full_optimizer_state(
    strategy: str, module, raw_module, optimizer, state: dict[str, dict], param_groups: list[dict]
) -> None:
    """Install a full optimizer state (as :func:`full_optimizer_state` returns it) into ``optimizer``.

    For fsdp every rank passes the full state and keeps its shard (collective)."""
    if strategy == "fsdp":
        names = [n for n, p in raw_module.named_parameters() if p.requires_grad]
        groups = [{**saved, "params": names} for saved in param_groups[:1]] or [{"params": names}]
        osd = {"state": {HEAD_PREFIX + n: st for n, st in state.items()}, "param_groups": groups}
        set_optimizer_state_dict(module, optimizer, osd, options=StateDictOptions(full_state_dict=True))
        return
    by_name = {_strip(n): p for n, p in raw_module.named_parameters() if p.requires_grad}
    for n, st in state.items():
        p = by_name[n]
        optimizer.state[p] = {k: v.to(p.device) if torch.is_tensor(v) else v for k, v in st.items()}
    for g, saved in zip(optimizer.param_groups, param_groups):
        g.update(saved)
