"""EAGLE-3 head training with online capture from the frozen target, through accelerate.

Steps of one optimiser step:
  1. a batch of rendered conversations, right-padded (input_ids, attention_mask, loss_mask [B, T]);
  2. the frozen target runs once without grad -> aux states [B, T, 3H] and logits [B, T, V];
  3. training-time test unroll of the head (``train.ttt``) -> loss, per-step accuracy;
  4. backward, grad clip, AdamW step, warmup + cosine schedule; tqdm and (optionally) wandb on rank 0.
Data order is a function of (seed, epoch), so a checkpoint's step number is its data position.

Run: ``draftsmith train recipes/reference/eagle3.yaml`` (or ``accelerate launch -m draftsmith.cli train ...``).
"""
from __future__ import annotations

import json
import math
import random
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch
from tqdm.auto import tqdm

from draftsmith.data_pipeline.capture import capture
from draftsmith.data_pipeline.dataset import RenderedDataset, pad_batch
from draftsmith.heads.eagle3 import Eagle3Config, Eagle3Head
from draftsmith.heads.vocab import VocabMap
from draftsmith.train.checkpoint import load_checkpoint, save_checkpoint
from draftsmith.train.ttt import ttt_loss


@dataclass
class HeadConfig:
    """Shape choices of the EAGLE-3 head beyond what the target fixes."""

    aux_layer_ids: list[int] | None = None   #: HF hidden-state indices; None = (2, N//2, N-3)
    ttt_steps: int = 7                       #: training-time-test unroll depth
    step_decay: float = 0.8                  #: loss weight of step i is step_decay**i
    prompt_loss_weight: float = 0.0          #: weight of prompt positions in the distillation loss (train/ttt.py)
    init_from_target: bool = True            #: start lm_head/norm from the target's (warm start)


@dataclass
class TrainConfig:
    """Optimisation. EAGLE-3 paper defaults: AdamW(0.9, 0.95), grad clip 0.5 (lr 5e-5 for 8B targets)."""

    epochs: int = 2
    max_steps: int | None = None             #: stop after this many optimiser steps
    batch_size: int = 8
    lr: float = 1e-3
    warmup_steps: int = 20
    min_lr_ratio: float = 0.1
    weight_decay: float = 0.0
    grad_clip: float = 0.5
    seed: int = 0
    threads: int | None = None               #: torch CPU threads; None = leave torch's default
    ckpt_every: int = 0                      #: optimiser steps between checkpoints; 0 = only at the end
    log_every: int = 10
    wandb_project: str | None = None         #: log to wandb (WANDB_MODE=offline works without network)
    mixed_precision: str = "no"              #: accelerate mixed precision for the head: no | bf16 | fp16
    group_by_length: bool = False            #: batches of similar lengths (less padding; see batches_for_epoch)


@dataclass
class TrainResult:
    """What a finished run produced."""

    head: Eagle3Head
    steps: int
    log: list[dict] = field(default_factory=list)
    seconds: float = 0.0


def batches_for_epoch(n: int, batch_size: int, seed: int, epoch: int,
                      lengths: list[int] | None = None, megabatch: int = 32) -> list[list[int]]:
    """Shuffled index batches of epoch ``epoch``; a pure function of its arguments.

    With ``lengths`` (tokens per example) batches are grouped by length the way transformers'
    ``LengthGroupedSampler`` does: the shuffled order is cut into mega-batches of ``megabatch``
    batches, each sorted by length (longest first) and cut into batches, and the batches are shuffled.
    Right padding then wastes little compute while the epoch still visits every example once."""
    rng = random.Random(seed * 7919 + epoch)
    order = list(range(n))
    rng.shuffle(order)
    if lengths is None:
        return [order[i:i + batch_size] for i in range(0, n, batch_size)]
    span = batch_size * megabatch
    batches = []
    for m in range(0, n, span):
        group = sorted(order[m:m + span], key=lambda i: -lengths[i])
        batches += [group[i:i + batch_size] for i in range(0, len(group), batch_size)]
    rng.shuffle(batches)
    return batches


def build_head(target, vocab_map: VocabMap, cfg: HeadConfig) -> Eagle3Head:
    """An EAGLE-3 head sized for ``target`` with ``vocab_map`` installed and the target's embedding bound."""
    config = Eagle3Config.from_target(target.config, draft_vocab_size=vocab_map.draft_vocab_size,
                                      aux_layer_ids=tuple(cfg.aux_layer_ids) if cfg.aux_layer_ids else None,
                                      ttt_steps=cfg.ttt_steps)
    head = Eagle3Head(config)
    head.set_vocab_map(vocab_map.d2t, vocab_map.t2d)
    head.bind_embedding(target.get_input_embeddings())
    if cfg.init_from_target:
        head.init_from_target(target)
    return head


def lr_lambda(cfg: TrainConfig, total_steps: int):
    """Linear warmup then cosine to ``min_lr_ratio`` (multiplier of cfg.lr)."""
    def f(step: int) -> float:
        if step < cfg.warmup_steps:
            return (step + 1) / cfg.warmup_steps
        frac = min(1.0, (step - cfg.warmup_steps) / max(1, total_steps - cfg.warmup_steps))
        return cfg.min_lr_ratio + (1 - cfg.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * frac))
    return f


def train_eagle3(target, data: RenderedDataset, vocab_map: VocabMap, head_cfg: HeadConfig, cfg: TrainConfig,
                 out_dir: Path, pad_id: int, run_config: dict | None = None) -> TrainResult:
    """Train a head on ``data`` against the frozen ``target``; checkpoints go to ``out_dir/checkpoint``.

    Resumes from that checkpoint when it exists (same data order, same next batch)."""
    from accelerate import Accelerator
    from accelerate.utils import set_seed

    if cfg.threads:
        torch.set_num_threads(cfg.threads)
    set_seed(cfg.seed)
    accelerator = Accelerator(mixed_precision=cfg.mixed_precision, cpu=not torch.cuda.is_available())
    target.requires_grad_(False)
    target.to(accelerator.device)
    head = build_head(target, vocab_map, head_cfg)
    opt = torch.optim.AdamW(head.parameters(), lr=cfg.lr, betas=(0.9, 0.95), weight_decay=cfg.weight_decay)
    per_epoch = math.ceil(len(data) / cfg.batch_size)
    lengths = [len(x) for x in data.input_ids] if cfg.group_by_length else None
    total = min(cfg.max_steps or per_epoch * cfg.epochs, per_epoch * cfg.epochs)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lr_lambda(cfg, total))
    ckpt = out_dir / "checkpoint"
    start, log = 0, []
    if (ckpt / "state.json").exists():
        state = load_checkpoint(ckpt, head, opt, sched)
        if state["extra"].get("d2t_sha256") != vocab_map.sha256():
            raise ValueError(f"{ckpt} was trained with another vocab map; keep the run's prepared data or start anew")
        start, log = state["step"], state["extra"].get("log", [])
    head, opt, sched = accelerator.prepare(head, opt, sched)
    raw_head = accelerator.unwrap_model(head)
    tracker = _wandb(cfg, run_config) if accelerator.is_main_process else None
    bar = tqdm(total=total, initial=start, desc="train eagle3", disable=not accelerator.is_main_process)
    step, t0, tokens = start, time.time(), 0
    while step < total:
        epoch, within = divmod(step, per_epoch)
        idx = batches_for_epoch(len(data), cfg.batch_size, cfg.seed, epoch, lengths)[within]
        ids, attn, mask = pad_batch([data.input_ids[i] for i in idx], [data.loss_mask[i] for i in idx], pad_id)
        ids, attn, mask = ids.to(accelerator.device), attn.to(accelerator.device), mask.to(accelerator.device)
        cap = capture(target, ids, raw_head.config.aux_layer_ids, attention_mask=attn)
        with accelerator.autocast():
            out = ttt_loss(raw_head, cap.aux_hidden, ids, cap.target_logits, mask, step_decay=head_cfg.step_decay,
                           attention_mask=attn, prompt_loss_weight=head_cfg.prompt_loss_weight)
        accelerator.backward(out.loss)
        accelerator.clip_grad_norm_(head.parameters(), cfg.grad_clip)
        opt.step()
        sched.step()
        opt.zero_grad(set_to_none=True)
        step += 1
        tokens += int(attn.sum())
        bar.update(1)
        bar.set_postfix(loss=f"{out.loss.item():.3f}", acc0=f"{out.step_acc[0]:.2f}")
        if step % cfg.log_every == 0 or step == total:
            entry = {"step": step, "epoch": epoch, "loss": out.loss.item(), "lr": sched.get_last_lr()[0],
                     "tokens_per_s": tokens / (time.time() - t0),
                     **{f"acc_{i}": a for i, a in enumerate(out.step_acc)}}
            log.append(entry)
            if tracker is not None:
                tracker.log(entry, step=step)
        if (cfg.ckpt_every and step % cfg.ckpt_every == 0) or step == total:
            accelerator.wait_for_everyone()
            if accelerator.is_main_process:
                save_checkpoint(ckpt, raw_head, opt, sched, step=step,
                                extra={"log": log, "d2t_sha256": vocab_map.sha256(), "config": run_config or {}})
    bar.close()
    if tracker is not None:
        tracker.finish()
    (out_dir / "train_log.json").write_text(json.dumps(log, indent=1))
    return TrainResult(raw_head, step, log, time.time() - t0)


def _wandb(cfg: TrainConfig, run_config: dict | None):
    if not cfg.wandb_project:
        return None
    try:
        import wandb
    except ImportError as e:
        raise ImportError("wandb_project is set but wandb is not installed: pip install wandb") from e
    return wandb.init(project=cfg.wandb_project, config=run_config or {})
