"""The recipe's ``train`` section (torch-free: checked before any model loads): optimisation, data mode,
distribution, logging, and in-loop acceptance (``train.acceptance``)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal


@dataclass
class AcceptanceConfig:
    """In-loop acceptance on the held-out split (``data.heldout_conversations``)."""

    every: int = 0  #: optimiser steps between measurements; 0 = never
    prompts: int = 8  #: held-out conversations measured (their last user turn is the prompt)
    k: int | None = None  #: num_speculative_tokens; None = the recipe drafter's (as eval)
    max_new_tokens: int = 32  #: tokens generated per prompt


@dataclass
class TrainConfig:
    """Optimisation, data mode, distribution and logging. EAGLE-3 paper defaults: AdamW(0.9, 0.95),
    grad clip 0.5, lr 5e-5 for 8B targets."""

    epochs: int = 2
    max_steps: int | None = None  #: stop after this many optimiser steps
    batch_size: int = 8  #: sequences per optimiser step, over all processes
    micro_batch_size: int | None = None  #: sequences per forward per process; None = batch_size / processes.
    #: gradient accumulation steps = batch_size / (micro_batch_size x processes)
    lr: float = 1e-3
    warmup_steps: int = 20
    min_lr_ratio: float = 0.1
    weight_decay: float = 0.0
    grad_clip: float = 0.5
    seed: int = 0
    threads: int | None = None  #: torch CPU threads; None = leave torch's default
    ckpt_every: int = 0  #: optimiser steps between checkpoints; 0 = only at the end
    log_every: int = 10
    #: the drafter's mixed precision: auto (bf16 where the device computes it natively, else fp32; measured,
    #: ``draftsmith.precision``) | no (fp32) | bf16 | fp16; the choice and its reason are logged and recorded
    mixed_precision: Literal["auto", "no", "bf16", "fp16"] = "auto"
    group_by_length: bool = False  #: batches of similar lengths (less padding; see batches_for_epoch)
    mode: Literal["online", "offline"] = "online"  #: offline: read runs/NAME/capture (``draftsmith capture``)
    strategy: Literal["auto", "single", "ddp", "fsdp", "zero2", "zero3"] = "auto"  #: checked at start
    num_processes: int | None = None  #: expected world size, checked at start; None = not checked
    target_sharding: Literal["replicated", "fsdp"] = "replicated"  #: fsdp: shard the target's layers too
    #: (strategy fsdp only; for targets larger than one device, see train.distributed.shard_target_fsdp2)
    trackers: list[str] = field(default_factory=list)  #: wandb | tensorboard (rank 0, via accelerate)
    wandb_project: str | None = None  #: tracker project name; setting it alone turns wandb on
    acceptance: AcceptanceConfig = field(default_factory=AcceptanceConfig)  #: in-loop τ on held-out data
