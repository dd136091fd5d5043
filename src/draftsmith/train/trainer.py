"""The drafter-agnostic trainer: accelerate, every strategy, accumulation, resume, in-loop τ, trackers.

    result = DrafterTrainer(spec, target, data, cfg, out_dir, pad_id, heldout=heldout, tokenizer=tok).run()

One class trains every drafter draftsmith ships (EAGLE-3 heads in ``train/eagle3.py``, draft models in
``train/draft_model.py``); what differs between drafters is a :class:`DrafterSpec`. Steps of one
optimiser step (:meth:`DrafterTrainer.train_step`):
  1. this rank's micro-batches of the step's global batch (``train.batches.StepSchedule``);
  2. per micro-batch: right-padded sequences with the fields the spec asks for (aux states [B, T, 3H],
     target logits [B, T, V], final hidden [B, T, H]), from the frozen target (online) or from capture
     shards (offline) (``train.batches``);
  3. the spec's objective module -> loss and per-step stats; backward, gradients averaged over
     micro-batches (accumulation) and ranks (DDP / FSDP2 / DeepSpeed);
  4. grad clip, AdamW step, warmup + cosine schedule;
  5. bookkeeping outside the step (:meth:`DrafterTrainer.run`): log (loss, per-step accuracy, lr, grad
     norm, tokens/s of real tokens over all ranks during training steps) to tqdm, train_log.json and
     the trackers (wandb, tensorboard) on rank 0; every ``acceptance.every`` steps τ on the held-out
     split (``train.acceptance``, with the spec's proposer); checkpoints.
Data order is a function of (seed, epoch), so a checkpoint's step number is its data position.

Adding a drafter (README.md, "Adding a drafter"): subclass :class:`DrafterSpec` in the drafter's folder
(``drafters/<name>/train.py``), return it from ``Drafter.training_spec``, and implement its five methods.
``build(target, fresh)`` returns the trainable module sized for the target (warm-started when ``fresh`` is
False; ``fresh=True`` is an untrained copy of the same shapes, which the trainer fills with gathered weights
under fsdp / zero3). ``objective(drafter)`` wraps it in an ``nn.Module`` holding the drafter at ``.head``
(``train.distributed`` strips that prefix) whose ``forward`` takes the batch fields as keywords
(``input_ids``, ``attention_mask``, ``loss_mask`` and each name in ``batch_fields``) and returns ``(loss,
stats)`` with stats float64 ``[3, S]`` (per-step loss, accuracy, supervised count; ``S = num_steps``).
``proposer(drafter, target_vocab_size)`` returns a fresh greedy ``core.proposer.Proposer`` for in-loop τ;
``aux_layer_ids(drafter)`` says which target layers that proposer and the batches need (None: no hidden
states). Optional hooks: ``fsdp_units`` (submodules sharded as their own FSDP2 unit), ``restore`` /
``checkpoint_extra`` / ``vocab_map`` (state kept with checkpoints). Nothing else:
``pipeline.stages.train_drafter`` finds the spec through the registry and runs ``DrafterTrainer(spec,
...).run()``.
"""

from __future__ import annotations

import abc
import contextlib
import importlib.util
import json
import logging
import math
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch
import torch.distributed as dist
from accelerate.utils import set_seed
from tqdm.auto import tqdm

from draftsmith.data_pipeline.shards import ShardReader
from draftsmith.precision import default_device, resolve_mixed_precision
from draftsmith.train import distributed as dist_utils
from draftsmith.train.acceptance import (
    heldout_prompts,
    log_fields,
    measure_acceptance,
    stats_from_tensor,
    stats_tensor,
)
from draftsmith.train.batches import (
    BATCH_FIELDS,
    OfflineSource,
    OnlineSource,
    StepSchedule,
    TrainBatch,
    micro_batch_size,
)
from draftsmith.train.checkpoint import (
    begin_checkpoint,
    commit_checkpoint,
    read_checkpoint,
    restore_params,
    restore_rng,
    write_checkpoint,
)
from draftsmith.train.config import TrainConfig

__all__ = ["DrafterSpec", "DrafterTrainer", "TrainConfig", "TrainResult", "lr_lambda", "TRACKERS"]
logger = logging.getLogger(__name__)
TRACKERS = {"wandb": ("wandb",), "tensorboard": ("tensorboard", "tensorboardX")}


@dataclass
class TrainResult:
    """What a finished run produced; ``head`` is the trained drafter (an EAGLE-3 head, a draft LM, ...),
    full (unsharded) on every rank."""

    head: torch.nn.Module
    steps: int
    log: list[dict] = field(default_factory=list)
    seconds: float = 0.0
    is_main_process: bool = True
    sharding: dict = field(default_factory=dict)
    precision: dict = field(default_factory=dict)  #: ``precision.PrecisionChoice.as_dict()`` of the run


class DrafterSpec(abc.ABC):
    """What the trainer needs to know about one kind of drafter (how to add one: module docstring).

    Attributes:
        name: the drafter's name (``eagle3``, ``draft_model``, ...): progress bar, checkpoints (a
            checkpoint of another drafter is refused on resume).
        batch_fields: the optional ``TrainBatch`` fields the objective reads, a subset of
            ``train.batches.BATCH_FIELDS`` (``aux_hidden``, ``target_logits``, ``final_hidden``);
            the sources compute nothing else.
        vocab_map: a ``data_pipeline.vocab.VocabMap`` saved with every checkpoint, or None.
        section: the recipe's drafter section it trains (``drafters.config.DrafterSection``: its
            ``num_speculative_tokens`` is in-loop τ's k unless ``train.acceptance.k`` says otherwise).
        trained_depth: draft positions the drafter learns (in-loop τ past it warns once), or None.
        trained_depth_field: the recipe field that sets it (named in that warning), e.g. ``drafter.ttt_steps``.
        reads_unnamed_checkpoints: whether it resumes checkpoints that name no drafter (written before drafter
            specs existed, when EAGLE-3 was the only drafter trained).
        max_k: most tokens it can draft per step (in-loop τ past it is refused), or None.
    """

    name: str = "drafter"
    batch_fields: frozenset[str] = frozenset({"target_logits"})
    vocab_map = None
    section = None
    trained_depth: int | None = None
    trained_depth_field: str = "trained depth"
    max_k: int | None = None
    reads_unnamed_checkpoints: bool = False

    @property
    @abc.abstractmethod
    def num_steps(self) -> int:
        """S: rows of per-step statistics the objective reports (EAGLE-3: the TTT unroll depth)."""

    @abc.abstractmethod
    def build(self, target, fresh: bool = False) -> torch.nn.Module:
        """The trainable drafter for ``target`` (parameters requiring grad, fp32, on CPU).

        ``fresh=False``: initialised as configured (warm start, loaded weights). ``fresh=True``: the same
        parameter names and shapes with a throwaway init, loading nothing (the trainer copies gathered
        weights into it); the trainer forks the RNG around it."""

    @abc.abstractmethod
    def objective(self, drafter: torch.nn.Module) -> torch.nn.Module:
        """The module DDP / FSDP2 / DeepSpeed wrap: holds ``drafter`` at ``.head``; ``forward(**fields)``
        -> (loss scalar, stats float64 [3, S]: per-step loss, accuracy, supervised count)."""

    @abc.abstractmethod
    def proposer(self, drafter: torch.nn.Module, target_vocab_size: int):
        """A fresh greedy ``core.proposer.Proposer`` drafter over ``drafter`` for in-loop τ."""

    def aux_layer_ids(self, drafter: torch.nn.Module) -> tuple[int, ...] | None:
        """Target hidden-state indices the batches (``aux_hidden``) and the proposer read; None = none."""
        return None

    def fsdp_units(self, drafter: torch.nn.Module) -> list[torch.nn.Module]:
        """Submodules of ``drafter`` sharded as their own FSDP2 units (the rest joins the root unit)."""
        return []

    def restore(self, ckpt_dir: Path, resume) -> None:
        """Called before ``build`` when resuming from ``resume`` (``checkpoint.CheckpointData``); may
        adopt state kept with the checkpoint (the EAGLE-3 vocab map) or refuse it (ValueError)."""

    def checkpoint_extra(self) -> dict:
        """JSON-ready entries added to every checkpoint's ``extra``."""
        return {}


def lr_lambda(cfg: TrainConfig, total_steps: int):
    """Linear warmup then cosine to ``min_lr_ratio`` (multiplier of cfg.lr)."""

    def f(step: int) -> float:
        if step < cfg.warmup_steps:
            return (step + 1) / cfg.warmup_steps
        frac = min(1.0, (step - cfg.warmup_steps) / max(1, total_steps - cfg.warmup_steps))
        return cfg.min_lr_ratio + (1 - cfg.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * frac))

    return f


def _flat(d: dict, prefix: str = "") -> dict:
    """Nested config -> {dotted key: scalar or str} (what tensorboard hparams accept)."""
    out = {}
    for k, v in d.items():
        if isinstance(v, dict):
            out.update(_flat(v, f"{prefix}{k}."))
        else:
            out[f"{prefix}{k}"] = v if isinstance(v, (int, float, str, bool)) else str(v)
    return out


def _trackers(cfg: TrainConfig) -> list[str]:
    names = list(dict.fromkeys(cfg.trackers + (["wandb"] if cfg.wandb_project else [])))
    for name in names:
        if name not in TRACKERS:
            raise ValueError(f"unknown tracker {name!r} in train.trackers; known: {', '.join(TRACKERS)}")
        if not any(importlib.util.find_spec(m) for m in TRACKERS[name]):
            raise ImportError(
                f"train.trackers asks for {name} but it is not installed: pip install {TRACKERS[name][0]}"
            )
    return names


class DrafterTrainer:
    """One training run of the drafter ``spec`` describes. ``__init__`` sets everything up (launch
    check, drafter, wrapping, resume); :meth:`train_step` is one optimiser step; :meth:`run` trains to
    the end and returns the result.

    Args:
        spec: the drafter (:class:`DrafterSpec`).
        target: the frozen HF causal LM (online: it runs every step; offline: only its lm_head is used,
            plus generation for in-loop τ).
        data: ``RenderedDataset`` (online) or ``data_pipeline.shards.ShardReader`` (offline).
        cfg: optimisation and distribution; out_dir: ``checkpoint/`` and ``train_log.json`` go there.
        pad_id: padding token id (None: 0; padding is never read).
        run_config: the recipe as plain data (checkpoints, trackers).
        heldout, tokenizer: held-out conversations and the target's tokenizer for in-loop τ.
    Raises:
        distributed.LaunchError: the launched processes do not match ``cfg.strategy`` / ``num_processes``.
        ValueError: inconsistent batch sizes, a checkpoint from another strategy family, data schedule or
            drafter, offline shards captured at other aux layers.
    """

    def __init__(
        self,
        spec: DrafterSpec,
        target,
        data,
        cfg: TrainConfig,
        out_dir: Path,
        pad_id: int | None,
        run_config: dict | None = None,
        heldout: list[dict] | None = None,
        tokenizer=None,
    ):

        unknown = set(spec.batch_fields) - set(BATCH_FIELDS)
        if unknown:
            raise ValueError(
                f"drafter {spec.name!r} asks for unknown batch field(s) {sorted(unknown)}; "
                f"known: {', '.join(BATCH_FIELDS)}"
            )
        if cfg.threads:
            torch.set_num_threads(cfg.threads)
        set_seed(cfg.seed)
        self.spec, self.cfg, self.out_dir = spec, cfg, Path(out_dir)
        self.target, self.tokenizer, self.run_config = target, tokenizer, run_config or {}
        self.acceptance_k = self._acceptance_k()  # refused before anything is loaded or built
        trackers = _trackers(cfg)
        self.precision = resolve_mixed_precision(cfg.mixed_precision, default_device())
        acc = self.accelerator = dist_utils.make_accelerator(
            self.precision.value, trackers, str(self.out_dir / "logs") if trackers else None
        )
        self.strategy = dist_utils.check_launch(acc, cfg.strategy, cfg.num_processes)
        if self.strategy == "fsdp" and self.precision.value == "fp16":
            raise ValueError(
                "strategy fsdp trains in fp32 or bf16 (train.mixed_precision no | bf16): its optimizer "
                "step does not unscale fp16 gradients"
            )
        if cfg.target_sharding == "fsdp" and self.strategy != "fsdp":
            raise ValueError(f"train.target_sharding=fsdp needs strategy fsdp, the run is {self.strategy}")
        self.ckpt = self.out_dir / "checkpoint"
        resume = read_checkpoint(self.ckpt) if (self.ckpt / "state.json").exists() else None
        if resume is not None:
            saved = resume.state["extra"].get("drafter")  # None: written before specs (only EAGLE-3 trained)
            if saved != spec.name and not (saved is None and spec.reads_unnamed_checkpoints):
                raise ValueError(
                    f"{self.ckpt} holds a checkpoint of drafter {saved!r}, this run trains {spec.name!r}; "
                    "use another out_dir (recipe name) or delete the checkpoint"
                )
            spec.restore(self.ckpt, resume)
        target.requires_grad_(False)
        if cfg.target_sharding == "fsdp":
            dist_utils.shard_target_fsdp2(target, acc.device, acc.num_processes)
        else:
            target.to(acc.device)
        with dist_utils.whole_parameters():  # ZeRO-3 partitions it in prepare, not at construction
            drafter = spec.build(target)
        if resume is not None:
            restore_params(drafter, resume.params, f"checkpoint {self.ckpt}")
        pad_id = 0 if pad_id is None else pad_id  # e.g. Llama-3.1 has no pad token; padding is never read
        self.source = self._source(data, target, pad_id, drafter)
        micro = micro_batch_size(cfg.batch_size, cfg.micro_batch_size, acc.num_processes)
        self.schedule = StepSchedule(
            len(self.source),
            cfg.batch_size,
            micro,
            acc.num_processes,
            cfg.seed,
            self.source.lengths() if cfg.group_by_length else None,
        )
        acc.gradient_accumulation_steps = self.schedule.grad_accum
        self._check_resumed_schedule(resume)
        self.total = self.schedule.total_steps(cfg.epochs, cfg.max_steps)
        self.raw = spec.objective(drafter)
        self._wrap(micro, resume)
        report = dist_utils.sharding_report(self.strategy, acc, self.module, self.optimizer)
        dist_utils.check_sharding(report)
        self.sharding = report.as_dict()
        if cfg.target_sharding == "fsdp":
            self.sharding["target_layers_local_fraction"] = round(
                dist_utils.local_fraction(target.get_decoder().layers), 4
            )
        acc.print(
            f"draftsmith train: {self.strategy} on {acc.num_processes} process(es), {self.source.mode} mode, "
            f"{self.schedule.grad_accum} accumulation step(s) of {micro} sequences per process; rank 0 holds "
            f"{report.local}/{report.full} trainable elements"
        )
        acc.print(f"draftsmith train: mixed precision {self.precision.value} ({self.precision.reason})")
        logger.info("mixed precision %s: %s", self.precision.value, self.precision.reason)
        self.step, self.log = (resume.step, resume.state["extra"].get("log", [])) if resume else (0, [])
        if resume is not None:
            restore_rng(resume.rng)
        self.heldout = heldout_prompts(heldout or [], cfg.acceptance.prompts) if cfg.acceptance.every else []
        if cfg.acceptance.every and (not self.heldout or tokenizer is None):
            raise ValueError(
                "acceptance.every > 0 needs held-out conversations and the tokenizer (data.heldout_conversations > 0)"
            )
        if trackers:
            acc.init_trackers(
                cfg.wandb_project or "draftsmith",
                config=_flat(self.run_config),
                init_kwargs={"wandb": {"dir": str(self.out_dir)}},
            )

    # -- setup helpers -------------------------------------------------------------------------
    def _acceptance_k(self) -> int:
        """In-loop τ's k: ``train.acceptance.k``, else the drafter section's num_speculative_tokens (eval's k).

        Raises ValueError above the spec's ``max_k``; warns once above its ``trained_depth``."""
        k = self.cfg.acceptance.k or getattr(self.spec.section, "num_speculative_tokens", None) or 5
        if self.cfg.acceptance.every and self.spec.max_k is not None and k > self.spec.max_k:
            raise ValueError(
                f"train.acceptance.k={k} > {self.spec.max_k}, the most the {self.spec.name} drafter drafts "
                f"per step: set train.acceptance.k <= {self.spec.max_k}"
            )
        depth = self.spec.trained_depth
        if self.cfg.acceptance.every and depth is not None and k > depth:
            logger.warning(
                "train.acceptance.k=%d exceeds %s=%d, the depth the %s drafter is trained for: drafts "
                "past position %d come from untrained steps and are rarely accepted",
                k,
                self.spec.trained_depth_field,
                depth,
                self.spec.name,
                depth,
            )
        return k

    def schedule_key(self) -> dict:
        """What the data order depends on (not the world size: any number of processes reads the same data)."""
        return {
            "sequences": len(self.source),
            "batch_size": self.cfg.batch_size,
            "micro_batches": self.schedule.parts,
            "seed": self.cfg.seed,
            "group_by_length": self.cfg.group_by_length,
        }

    def _check_resumed_schedule(self, resume) -> None:
        saved = resume.state["extra"].get("schedule") if resume is not None else None
        if saved is not None and saved != self.schedule_key():
            raise ValueError(
                f"{self.ckpt} was written with the data schedule {saved}, this run has "
                f"{self.schedule_key()}: step {resume.step} would point at other data; keep the "
                "batch sizes, seed and data of the run (the number of processes may change)"
            )

    def _source(self, data, target, pad_id: int, drafter):

        fields = self.spec.batch_fields
        aux = self.spec.aux_layer_ids(drafter) if "aux_hidden" in fields else None
        if isinstance(data, ShardReader):
            if self.cfg.mode != "offline":
                logger.info("data is a capture folder: training in offline mode")
            return OfflineSource(data, target.get_output_embeddings(), pad_id, aux, fields)
        if self.cfg.mode == "offline":
            raise ValueError(
                "train.mode is offline but the data is not a capture folder (ShardReader); run "
                "`draftsmith capture RECIPE` first"
            )
        return OnlineSource(data, target, pad_id, aux, fields)

    def _wrap(self, micro: int, resume) -> None:
        """Wrap the objective for the strategy, build AdamW and the schedule, restore optimizer state."""
        cfg, acc, strategy = self.cfg, self.accelerator, self.strategy
        zero = strategy in ("zero2", "zero3")
        if resume is not None and zero != (resume.path / "deepspeed").exists():
            raise ValueError(
                f"{self.ckpt} was written by a {'non-' if zero else ''}DeepSpeed run; resume it with the "
                f"strategy family that wrote it (strategy {resume.state['extra'].get('strategy')!r})"
            )
        if strategy == "fsdp":
            dist_utils.apply_fsdp2(
                self.raw, acc.device, acc.num_processes, self.precision.value, units=self.spec.fsdp_units(self.raw.head)
            )
        self.base_optimizer = torch.optim.AdamW(
            self.raw.parameters(), lr=cfg.lr, betas=(0.9, 0.95), weight_decay=cfg.weight_decay
        )
        self.scheduler = torch.optim.lr_scheduler.LambdaLR(self.base_optimizer, lr_lambda(cfg, self.total))
        if resume is not None and not zero:
            dist_utils.load_full_optimizer_state(
                strategy,
                self.raw,
                self.raw,
                self.base_optimizer,
                resume.optimizer_state,
                resume.state.get("param_groups", []),
            )
        if strategy == "fsdp":
            self.module, self.optimizer = self.raw, self.base_optimizer
        else:
            if zero:
                dist_utils.configure_deepspeed(acc, micro, self.schedule.grad_accum, cfg.grad_clip)
            self.module, self.optimizer = acc.prepare(self.raw, self.base_optimizer)
        if resume is not None:
            if zero:
                self.module.load_checkpoint(
                    str(resume.path / "deepspeed"),
                    tag="state",
                    load_optimizer_states=True,
                    load_lr_scheduler_states=False,
                )
            if "scheduler" in resume.state:
                self.scheduler.load_state_dict(resume.state["scheduler"])
            for group, lr in zip(self.base_optimizer.param_groups, self.scheduler.get_last_lr()):
                group["lr"] = lr  # the schedule's value for the next step

    # -- the algorithm -------------------------------------------------------------------------
    def _forward_backward(self, batch: TrainBatch, last: bool) -> tuple[torch.Tensor, torch.Tensor]:
        """Loss and backward of one micro-batch; gradients sync across ranks only on the ``last`` one."""
        acc = self.accelerator
        if self.strategy == "fsdp":
            self.module.set_requires_gradient_sync(last)
        autocast = contextlib.nullcontext() if self.strategy == "fsdp" else acc.autocast()
        with acc.accumulate(self.module), autocast:
            loss, stats = self.module(**batch.inputs(self.spec.batch_fields))
            acc.backward(loss)
        return loss.detach(), stats

    def _clip(self) -> float:
        if self.strategy == "fsdp":
            norm = torch.nn.utils.clip_grad_norm_(self.module.parameters(), self.cfg.grad_clip)
            norm = norm.full_tensor() if hasattr(norm, "full_tensor") else norm
        else:
            norm = self.accelerator.clip_grad_norm_(self.module.parameters(), self.cfg.grad_clip)
        return float(norm) if norm is not None else float("nan")

    def train_step(self) -> dict:
        """One optimiser step over this rank's micro-batches (steps 1-4 of the module docstring).

        Returns the step's figures over all ranks: loss (mean over micro-batches), per-step accuracy
        ``acc_i`` (over supervised rows), real tokens, grad norm (before clipping) and the lr used."""
        acc = self.accelerator
        micro = self.schedule.micro_batches(self.step, acc.process_index)
        steps = self.spec.num_steps
        totals = torch.zeros(3 + 2 * steps, dtype=torch.float64)  # loss sum, micro-batches, tokens, hits, counts
        for j, indices in enumerate(micro):
            batch = self.source.batch(indices, acc.device)
            loss, stats = self._forward_backward(batch, last=j == len(micro) - 1)
            totals[0] += float(loss)
            totals[1] += 1
            totals[2] += batch.num_tokens
            totals[3 : 3 + steps] += stats[1] * stats[2]
            totals[3 + steps :] += stats[2]
        grad_norm = self._clip()
        lr = self.scheduler.get_last_lr()[0]
        self.optimizer.step()
        self.scheduler.step()
        self.optimizer.zero_grad(set_to_none=True)
        self.step += 1
        totals = self._sum_over_ranks(totals)
        hits, counts = totals[3 : 3 + steps], totals[3 + steps :]
        return {
            "loss": float(totals[0] / totals[1]),
            "tokens": int(totals[2]),
            "grad_norm": grad_norm,
            "lr": lr,
            **{f"acc_{i}": float(hits[i] / max(counts[i], 1.0)) for i in range(steps)},
        }

    def _sum_over_ranks(self, t: torch.Tensor) -> torch.Tensor:
        if self.accelerator.num_processes == 1:
            return t

        t = t.to(self.accelerator.device)
        dist.all_reduce(t)
        return t.cpu()

    # -- bookkeeping ---------------------------------------------------------------------------
    def full_drafter(self) -> torch.nn.Module:
        """The drafter with full weights on every rank (a fresh copy for fsdp / zero3; collective there)."""
        drafter = self.raw.head
        if self.strategy not in ("fsdp", "zero3"):
            return drafter
        params = dist_utils.full_head_params(self.strategy, self.module, self.raw)
        with torch.random.fork_rng(devices=[]), dist_utils.whole_parameters():  # throwaway init: RNG untouched
            copy = self.spec.build(self.target, fresh=True)
        restore_params(copy, params, "gathered drafter")
        return copy.to(self.accelerator.device)

    def measure_acceptance(self) -> dict:
        """τ and acceptance on the held-out prompts, summed over ranks (collective)."""
        acc, a = self.accelerator, self.cfg.acceptance
        drafter = self.full_drafter()
        was_training = drafter.training
        drafter.eval()  # as served; restored below
        vocab_size = int(self.target.get_output_embeddings().weight.shape[0])
        make = lambda: self.spec.proposer(drafter, vocab_size)  # noqa: E731
        aux = self.spec.aux_layer_ids(drafter)
        # a sharded target needs the same forwards on every rank: then every rank measures every prompt
        rank, world = (0, 1) if self.cfg.target_sharding == "fsdp" else (acc.process_index, acc.num_processes)
        try:
            with torch.no_grad():
                stats = measure_acceptance(
                    self.target,
                    self.tokenizer,
                    make,
                    self.heldout,
                    self.acceptance_k,
                    a.max_new_tokens,
                    rank,
                    world,
                    aux_layer_ids=aux,
                )
        finally:
            drafter.train(was_training)
        if world == 1:
            return log_fields(stats)
        return log_fields(stats_from_tensor(self._sum_over_ranks(stats_tensor(stats)), self.acceptance_k))

    def _commit(self, path: Path) -> Path:
        """Install the staged checkpoint (``checkpoint.commit_checkpoint``); tests interrupt runs here."""
        return commit_checkpoint(path)

    def save(self) -> None:
        """Checkpoint (collective): full drafter params and optimizer state, schedule, RNG, step, spec state."""
        acc, strategy = self.accelerator, self.strategy
        params = dist_utils.full_head_params(strategy, self.module, self.raw)
        optim = dist_utils.full_optimizer_state(strategy, self.module, self.raw, self.base_optimizer)
        staging = self.ckpt.with_name(self.ckpt.name + ".tmp")
        if acc.is_main_process:
            begin_checkpoint(self.ckpt)
        acc.wait_for_everyone()
        if strategy in ("zero2", "zero3"):
            self.module.save_checkpoint(str(staging / "deepspeed"), tag="state", save_latest=False)
            acc.wait_for_everyone()
        if acc.is_main_process:
            extra = {
                "log": self.log,
                "drafter": self.spec.name,
                **self.spec.checkpoint_extra(),
                "config": self.run_config,
                "strategy": strategy,
                "world_size": acc.num_processes,
                "mode": self.source.mode,
                "schedule": self.schedule_key(),
                "precision": self.precision.as_dict(),
            }
            write_checkpoint(
                staging,
                params,
                optim,
                self.base_optimizer.param_groups,
                self.scheduler.state_dict(),
                self.step,
                extra,
                self.spec.vocab_map,
            )
            self._commit(self.ckpt)
        acc.wait_for_everyone()

    def run(self) -> TrainResult:
        """Train from the current step to the end; returns the full drafter and the log."""
        acc, cfg = self.accelerator, self.cfg
        bar = tqdm(total=self.total, initial=self.step, desc=f"train {self.spec.name}", disable=not acc.is_main_process)
        t0 = time.time()
        tokens, busy = 0, 0.0  # since the last log entry: tokens trained, seconds in train_step
        while self.step < self.total:
            started = time.time()
            figures = self.train_step()
            busy += time.time() - started
            tokens += figures["tokens"]
            bar.update(1)
            bar.set_postfix(loss=f"{figures['loss']:.3f}", acc0=f"{figures['acc_0']:.2f}")
            measured = bool(cfg.acceptance.every) and self.step % cfg.acceptance.every == 0
            if measured:
                figures.update(self.measure_acceptance())
            if self.step % cfg.log_every == 0 or self.step == self.total or measured:
                entry = {
                    "step": self.step,
                    "epoch": (self.step - 1) // self.schedule.steps_per_epoch,
                    "tokens_per_s": tokens / max(busy, 1e-9),
                    **{k: v for k, v in figures.items() if k != "tokens"},
                }
                tokens, busy = 0, 0.0
                self.log.append(entry)
                acc.log(entry, step=self.step)
                if measured:
                    acc.print(f"step {self.step}: tau {entry['tau']:.3f} on {len(self.heldout)} held-out prompts")
            if (cfg.ckpt_every and self.step % cfg.ckpt_every == 0) or self.step == self.total:
                self.save()
        bar.close()
        drafter = self.full_drafter()
        for tracker in acc.trackers:  # not acc.end_training(): it also destroys the process group
            tracker.finish()
        if acc.is_main_process:
            self.out_dir.mkdir(parents=True, exist_ok=True)
            (self.out_dir / "train_log.json").write_text(json.dumps(self.log, indent=1))
        return TrainResult(
            drafter, self.step, self.log, time.time() - t0, acc.is_main_process, self.sharding, self.precision.as_dict()
        )
