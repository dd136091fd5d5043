"""EAGLE-3 head training: the head, its TTT objective and in-loop proposer as a ``DrafterSpec``.

    draftsmith train recipes/reference/eagle3.yaml                                # one process
    ACCELERATE_USE_CPU=1 accelerate launch --config_file recipes/accelerate/ddp.yaml --num_processes 2 \\
        -m draftsmith.cli train RECIPE train.strategy=ddp train.num_processes=2    # see train.distributed

The loop, strategies, accumulation, checkpoints and in-loop τ are ``train.trainer.DrafterTrainer``'s;
this module says what is EAGLE-3 about a run (:class:`Eagle3Spec`):
  * the drafter: an ``Eagle3Head`` sized for the target with the draft vocab map installed and the
    target's embedding bound, warm-started from the target's lm_head / norm (``build_head``);
  * the batch: aux states [B, T, 3H] and logits [B, T, V] of the frozen target;
  * the objective: the training-time-test unroll (``ttt.py``), per-step loss and accuracy over
    ``ttt_steps`` steps (:class:`TTTObjective`);
  * in-loop τ with ``Eagle3Proposer`` over the head, the target exposing the head's aux layers;
  * the vocab map is kept with every checkpoint and wins on resume (the weights were trained on it).
"""

from __future__ import annotations

import logging
from dataclasses import replace
from pathlib import Path

import torch

from draftsmith.data_pipeline.vocab import VocabMap
from draftsmith.drafters.eagle3.config import Section
from draftsmith.drafters.eagle3.head import Eagle3Config, Eagle3Head
from draftsmith.drafters.eagle3.proposer import Eagle3Proposer
from draftsmith.drafters.eagle3.ttt import ttt_loss
from draftsmith.train.checkpoint import checkpoint_vocab_map
from draftsmith.train.trainer import DrafterSpec

logger = logging.getLogger(__name__)


def build_head(target, vocab_map: VocabMap, cfg: Section) -> Eagle3Head:
    """An EAGLE-3 head sized for ``target`` with ``vocab_map`` installed and the target's embedding bound."""
    config = Eagle3Config.from_target(
        target.config,
        draft_vocab_size=vocab_map.draft_vocab_size,
        aux_layer_ids=tuple(cfg.aux_layer_ids) if cfg.aux_layer_ids else None,
        ttt_steps=cfg.ttt_steps,
    )
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
        out = ttt_loss(
            self.head,
            aux_hidden,
            input_ids,
            target_logits,
            loss_mask,
            step_decay=self.step_decay,
            attention_mask=attention_mask,
            prompt_loss_weight=self.prompt_loss_weight,
        )
        stats = torch.tensor([out.step_loss, out.step_acc, out.step_count], dtype=torch.float64)
        return out.loss, stats


class Eagle3Spec(DrafterSpec):
    """The EAGLE-3 drafter for ``DrafterTrainer`` (what each hook does: module docstring).

    Args:
        head_cfg: the recipe's drafter section (``config.Section``): shape choices and loss weights.
        vocab_map: the draft vocabulary; on resume the checkpoint's map replaces it (warning if it differs).
    """

    name = "eagle3"
    batch_fields = frozenset({"aux_hidden", "target_logits"})
    reads_unnamed_checkpoints = True  # the trainer's checkpoints before drafter specs were EAGLE-3's

    def __init__(self, head_cfg: Section, vocab_map: VocabMap):
        self.section, self.vocab_map = head_cfg, vocab_map

    @property
    def num_steps(self) -> int:
        """The TTT unroll depth (one accuracy per step)."""
        return self.section.ttt_steps

    @property
    def trained_depth(self) -> int:
        """Draft positions the head learns (``ttt_steps``): in-loop τ past it warns (``DrafterTrainer``)."""
        return self.section.ttt_steps

    trained_depth_field = "drafter.ttt_steps"

    def build(self, target, fresh: bool = False) -> Eagle3Head:
        """``build_head`` with the run's vocab map; ``fresh`` skips the warm start from the target."""
        cfg = replace(self.section, init_from_target=False) if fresh else self.section
        return build_head(target, self.vocab_map, cfg)

    def objective(self, drafter: Eagle3Head) -> TTTObjective:
        """The head and its TTT loss (:class:`TTTObjective`)."""
        return TTTObjective(drafter, self.section.step_decay, self.section.prompt_loss_weight)

    def proposer(self, drafter: Eagle3Head, target_vocab_size: int):
        """A greedy ``Eagle3Proposer`` over the head."""
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
        if saved is None:  # checkpoint written before maps were saved: only the hash is known
            if resume.state["extra"].get("d2t_sha256") != self.vocab_map.sha256():
                raise ValueError(
                    f"{ckpt_dir} was trained with another vocab map and does not hold it; keep the "
                    "run's prepared data or start anew"
                )
            return
        if saved.sha256() != self.vocab_map.sha256():
            logger.warning(
                "resuming %s: the data's draft vocabulary differs from the checkpoint's; keeping the "
                "checkpoint's (the head was trained on it)",
                ckpt_dir,
            )
        self.vocab_map = saved

    def checkpoint_extra(self) -> dict:
        """The vocab map's hash (the map itself goes to vocab_map.safetensors)."""
        return {"d2t_sha256": self.vocab_map.sha256()}
