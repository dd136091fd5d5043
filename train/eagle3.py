"""EAGLE-3 head training: the head, its TTT objective and in-loop proposer as a ``DrafterSpec``.

    draftsmith train recipes/reference/eagle3.yaml                                # one process
    ACCELERATE_USE_CPU=1 accelerate launch --config_file recipes/accelerate/ddp.yaml --num_processes 2 \\
        -m draftsmith.cli train RECIPE train.strategy=ddp train.num_processes=2    # see train.distributed

The loop, strategies, accumulation, checkpoints and in-loop τ are ``train.trainer.DrafterTrainer``'s;
this module says what is EAGLE-3 about a run (:class:`Eagle3Spec`):
  * the drafter: an ``Eagle3Head`` sized for the target with the draft vocab map installed and the
    target's embedding bound, warm-started from the target's lm_head / norm (``build_head``);
  * the batch: aux states [B, T, 3H] and logits [B, T, V] of the frozen target;
  * the objective: the training-time-test unroll (``train.ttt``), per-step loss and accuracy over
    ``ttt_steps`` steps (:class:`TTTObjective`);
  * in-loop τ with ``Eagle3Proposer`` over the head, the target exposing the head's aux layers;
  * the vocab map is kept with every checkpoint and wins on resume (the weights were trained on it).
"""
from __future__ import annotations

import logging
from dataclasses import dataclass, replace
from pathlib import Path

import torch

from draftsmith.heads.eagle3 import Eagle3Config, Eagle3Head, aux_layer_order_problem
from draftsmith.heads.vocab import VocabMap
from draftsmith.train.batches import batches_for_epoch
from draftsmith.train.checkpoint import checkpoint_vocab_map, commit_checkpoint
from draftsmith.train.trainer import TRACKERS, DrafterSpec, DrafterTrainer, TrainConfig, TrainResult, lr_lambda
from draftsmith.train.ttt import ttt_loss

__all__ = ["HeadConfig", "TrainConfig", "TrainResult", "Eagle3Spec", "Eagle3Trainer", "TTTObjective",
           "train_eagle3", "build_head", "lr_lambda", "batches_for_epoch", "TRACKERS"]
logger = logging.getLogger(__name__)


@dataclass
class HeadConfig:
    """Shape choices of the EAGLE-3 head beyond what the target fixes."""

    aux_layer_ids: list[int] | None = None   #: HF hidden-state indices, ascending; None = (2, N//2, N-3)
    ttt_steps: int = 7                       #: training-time-test unroll depth
    step_decay: float = 0.8                  #: loss weight of step i is step_decay**i
    prompt_loss_weight: float = 0.0          #: weight of prompt positions in the distillation loss (train/ttt.py)
    init_from_target: bool = True            #: start lm_head/norm from the target's (warm start)

    def __post_init__(self):
        """Refuse ids no engine serves as written (``heads.eagle3.aux_layer_order_problem``): at recipe
        load, before any capture or training step. Raises ValueError naming ``head.aux_layer_ids``."""
        if self.aux_layer_ids is None:
            return
        if len(self.aux_layer_ids) != 3:
            raise ValueError(f"head.aux_layer_ids {list(self.aux_layer_ids)}: an EAGLE-3 head reads 3 layers. "
                             f"Fix: give three HF hidden_states indices, ascending, or null for the default")
        if (problem := aux_layer_order_problem(self.aux_layer_ids)) is not None:
            raise ValueError(f"head.{problem}")


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


class TTTObjective(torch.nn.Module):
    """The head and its TTT loss as one module, so that DDP, FSDP2 and DeepSpeed see a ``forward``
    (their gradient hooks are armed there). Parameters live at ``.head`` (names ``head.fc.weight``, ...).

    forward(aux_hidden [B, T, 3H], input_ids [B, T], target_logits [B, T, V], loss_mask [B, T],
    attention_mask [B, T]) -> (loss scalar, stats [3, S] float: per-step loss, accuracy, count)."""

    def __init__(self, head: Eagle3Head, step_decay: float, prompt_loss_weight: float):
        super().__init__()
        self.head, self.step_decay, self.prompt_loss_weight = head, step_decay, prompt_loss_weight

    def forward(self, aux_hidden, input_ids, target_logits, loss_mask, attention_mask):
        """``ttt_loss`` of one micro-batch (shapes in the class docstring); stats rows: loss, acc, count."""
        out = ttt_loss(self.head, aux_hidden, input_ids, target_logits, loss_mask, step_decay=self.step_decay,
                       attention_mask=attention_mask, prompt_loss_weight=self.prompt_loss_weight)
        stats = torch.tensor([out.step_loss, out.step_acc, out.step_count], dtype=torch.float64)
        return out.loss, stats


class Eagle3Spec(DrafterSpec):
    """The EAGLE-3 drafter for ``DrafterTrainer`` (what each hook does: module docstring).

    Args:
        head_cfg: the head's shape choices and loss weights.
        vocab_map: the draft vocabulary; on resume the checkpoint's map replaces it (warning if it differs).
    """

    name = "eagle3"
    batch_fields = frozenset({"aux_hidden", "target_logits"})

    def __init__(self, head_cfg: HeadConfig, vocab_map: VocabMap):
        self.head_cfg, self.vocab_map = head_cfg, vocab_map

    @property
    def num_steps(self) -> int:
        """The TTT unroll depth (one accuracy per step)."""
        return self.head_cfg.ttt_steps

    def build(self, target, fresh: bool = False) -> Eagle3Head:
        """``build_head`` with the run's vocab map; ``fresh`` skips the warm start from the target."""
        cfg = replace(self.head_cfg, init_from_target=False) if fresh else self.head_cfg
        return build_head(target, self.vocab_map, cfg)

    def objective(self, drafter: Eagle3Head) -> TTTObjective:
        """The head and its TTT loss (:class:`TTTObjective`)."""
        return TTTObjective(drafter, self.head_cfg.step_decay, self.head_cfg.prompt_loss_weight)

    def proposer(self, drafter: Eagle3Head, target_vocab_size: int):
        """A greedy ``Eagle3Proposer`` over the head."""
        from draftsmith.inference.proposers.eagle3 import Eagle3Proposer

        return Eagle3Proposer(drafter)

    def aux_layer_ids(self, drafter: Eagle3Head) -> tuple[int, ...]:
        """The head's three aux layers (HF hidden_states index)."""
        return tuple(drafter.config.aux_layer_ids)

    def fsdp_units(self, drafter: Eagle3Head) -> list[torch.nn.Module]:
        """The decoder layer is its own FSDP2 unit; fc, norm and lm_head join the root."""
        return [drafter.midlayer]

    def restore(self, ckpt_dir: Path, resume) -> None:
        """The checkpoint's vocab map wins on resume: the weights were trained on it.

        Raises ValueError for a checkpoint that holds no map and was trained on another one."""
        saved = checkpoint_vocab_map(ckpt_dir)
        if saved is None:                         # checkpoint written before maps were saved: only the hash is known
            if resume.state["extra"].get("d2t_sha256") != self.vocab_map.sha256():
                raise ValueError(f"{ckpt_dir} was trained with another vocab map and does not hold it; keep the "
                                 "run's prepared data or start anew")
            return
        if saved.sha256() != self.vocab_map.sha256():
            logger.warning("resuming %s: the data's draft vocabulary differs from the checkpoint's; keeping the "
                           "checkpoint's (the head was trained on it)", ckpt_dir)
        self.vocab_map = saved

    def checkpoint_extra(self) -> dict:
        """The vocab map's hash (the map itself goes to vocab_map.safetensors)."""
        return {"d2t_sha256": self.vocab_map.sha256()}


class Eagle3Trainer(DrafterTrainer):
    """One EAGLE-3 training run: ``DrafterTrainer`` with an :class:`Eagle3Spec`.

    Args:
        target: the frozen HF causal LM (online: it runs every step; offline: only its embedding,
            lm_head and final norm are used, plus generation for in-loop τ).
        data: ``RenderedDataset`` (online) or ``data_pipeline.shards.ShardReader`` (offline).
        vocab_map: the draft vocabulary; on resume the checkpoint's map is kept (warning if it differs).
        heldout, tokenizer: held-out conversations and the target's tokenizer for in-loop τ.
    Raises:
        distributed.LaunchError: the launched processes do not match ``cfg.strategy`` / ``num_processes``.
        ValueError: inconsistent batch sizes, a checkpoint from another strategy family, offline
            shards captured at other aux layers.
    """

    def __init__(self, target, data, vocab_map: VocabMap, head_cfg: HeadConfig, cfg: TrainConfig, out_dir: Path,
                 pad_id: int | None, run_config: dict | None = None, heldout: list[dict] | None = None, tokenizer=None):
        from draftsmith.inference.proposers.eagle3 import warn_beyond_trained_depth

        self.head_cfg = head_cfg
        if cfg.acceptance.every:                  # in-loop τ drafts k per step: past ttt_steps is untrained
            warn_beyond_trained_depth(cfg.acceptance.k, head_cfg.ttt_steps, "the head in training",
                                      "train.acceptance.k")
        super().__init__(Eagle3Spec(head_cfg, vocab_map), target, data, cfg, out_dir, pad_id, run_config, heldout,
                         tokenizer)

    @property
    def vocab_map(self) -> VocabMap:
        """The draft vocabulary the head trains on (the checkpoint's after a resume)."""
        return self.spec.vocab_map

    def full_head(self) -> Eagle3Head:
        """The head with full weights on every rank (``DrafterTrainer.full_drafter``)."""
        return self.full_drafter()

    def _commit(self, path: Path) -> Path:
        return commit_checkpoint(path)       # this module's name: tests interrupt EAGLE-3 runs here


def train_eagle3(target, data, vocab_map: VocabMap, head_cfg: HeadConfig, cfg: TrainConfig, out_dir: Path,
                 pad_id: int | None, run_config: dict | None = None, heldout: list[dict] | None = None,
                 tokenizer=None) -> TrainResult:
    """Train a head on ``data`` against the frozen ``target``; checkpoints go to ``out_dir/checkpoint``.

    ``data``: a ``RenderedDataset`` (online capture) or a ``ShardReader`` over ``draftsmith capture``
    shards (offline). Resumes from the checkpoint when it exists (same data order, same next batch,
    the checkpoint's vocab map). Arguments and errors: :class:`Eagle3Trainer`."""
    return Eagle3Trainer(target, data, vocab_map, head_cfg, cfg, out_dir, pad_id, run_config, heldout,
                         tokenizer).run()
