"""MLP speculator training: the stage loss, and the drafter spec the generic trainer runs.

    draftsmith train recipes/reference/mlp_speculator.yaml

The loop, strategies, accumulation, checkpoints and in-loop τ are ``train.trainer.DrafterTrainer``'s;
this module says what is MLP-speculator about a run (:class:`MLPSpeculatorSpec`):
  * the drafter: an ``MLPSpeculator`` (``drafters/mlp_speculator/head.py``) sized for the target, optionally
    warm-started from the target's embeddings;
  * the batch: the target's final hidden states [B, T, H] and logits [B, T, V];
  * the objective: every stage unrolled with teacher forcing, soft cross-entropy against the target's
    distribution (:func:`mlp_speculator_loss`), per-stage accuracy;
  * in-loop τ with ``MLPSpeculatorProposer`` (no aux layers; the target gives its final hidden states).

Alignment of the loss (h_t = final hidden state after reading x0..x_t; s_i = stage i's output):

    tokens          x0     x1     x2     x3     x4     x5
    stage 0 at t:   state h_t,        token x_{t+1}     -> predicts x_{t+2}
    stage i at t:   state s_{i-1,t},  token x_{t+1+i}   -> predicts x_{t+2+i}
    label (i, t):   softmax of the target's logits at row t+1+i (the row that predicts x_{t+2+i})
    weight (i, t):  1 when t+1+i < T and x_{t+2+i} is supervised (assistant); with ``prompt_loss_weight``
                    w > 0 also w when x_{t+2+i} is a real but unsupervised token; 0 otherwise

The paper (Wertheimer et al. 2024, arXiv:2404.19124) trains in two phases, first on ordinary text, then
on the base model's own generations so that the stages learn what the base model emits. Here the
conversations are already the target's own answers (``data.regenerate``) and the labels are its
distributions (as ``train/ttt.py`` distils EAGLE-3), so one teacher-forced phase covers both. Loss:
sum_i decay^i * weighted mean soft-CE(q_i, p_i); accuracy of stage i: argmax q_i == argmax p_i on
assistant rows.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import torch

from draftsmith.drafters.mlp_speculator.config import Section
from draftsmith.drafters.mlp_speculator.head import MLPSpeculator, MLPSpeculatorConfig
from draftsmith.drafters.mlp_speculator.proposer import MLPSpeculatorProposer
from draftsmith.train.losses import row_weights, shift_left, soft_cross_entropy
from draftsmith.train.trainer import DrafterSpec

logger = logging.getLogger(__name__)


@dataclass
class StageLossOutput:
    """loss (scalar, differentiable); per-stage loss / accuracy / supervised count as lists."""

    loss: torch.Tensor
    stage_loss: list[float]
    stage_acc: list[float]
    stage_count: list[int]


def mlp_speculator_loss(
    head: MLPSpeculator,
    final_hidden: torch.Tensor,
    input_ids: torch.Tensor,
    target_logits: torch.Tensor,
    loss_mask: torch.Tensor,
    attention_mask: torch.Tensor | None = None,
    stages: int | None = None,
    stage_decay: float = 1.0,
    prompt_loss_weight: float = 0.0,
) -> StageLossOutput:
    """Teacher-forced loss of every stage (alignment in the module docstring).

    Args:
        final_hidden: [B, T, H] the target's lm_head inputs. input_ids: [B, T] int64.
        target_logits: [B, T, V] (row t predicts token t+1). loss_mask: [B, T] bool (token t supervised).
        attention_mask: [B, T] (1 = real token); needed when ``prompt_loss_weight`` > 0.
        stages: stages trained (default: all n_predict). stage_decay: weight of stage i is decay**i.

    Returns:
        ``StageLossOutput``; stage rows with no scored position contribute 0 loss.

    Raises:
        ValueError: ``prompt_loss_weight`` outside [0, 1] or > 0 without ``attention_mask``; stages outside
            1..n_predict; mismatched shapes.
    """
    predicts_supervised, row_weight = row_weights(loss_mask, attention_mask, prompt_loss_weight)  # [B, T]
    n = stages or head.config.n_predict
    if not 1 <= n <= head.config.n_predict:
        raise ValueError(f"stages must be in 1..n_predict ({head.config.n_predict}), got {n}")
    b, t = input_ids.shape
    if final_hidden.shape[:2] != (b, t) or target_logits.shape[:2] != (b, t) or loss_mask.shape != (b, t):
        raise ValueError(
            f"shapes disagree: input_ids {tuple(input_ids.shape)}, final_hidden "
            f"{tuple(final_hidden.shape)}, target_logits {tuple(target_logits.shape)}, loss_mask "
            f"{tuple(loss_mask.shape)}; all must be [B, T, ...] of the same batch"
        )
    state = head.input_state(final_hidden)  # [B, T, H]
    total = state.new_zeros((), dtype=torch.float32)
    stage_loss, stage_acc, stage_count = [], [], []
    for i in range(n):
        state = head.stage(i, state, shift_left(input_ids, 1 + i, 0))  # token x_{t+1+i}; [B, T, D]
        weight = shift_left(row_weight, 1 + i, 0.0)  # row_weight[t+1+i]: x_{t+2+i}
        rows = (weight > 0).nonzero(as_tuple=True)  # (b [m], t [m]); t+1+i < T
        label_rows = (rows[0], rows[1] + 1 + i)  # target row t+1+i
        w = weight[rows]  # [m]
        logits = head.logits(i, state[rows])  # [m, V], scored rows only
        p = torch.softmax(target_logits[label_rows].float(), dim=-1)  # [m, V]
        loss_i = (soft_cross_entropy(logits, p) * w).sum() / w.sum().clamp_min(1e-6)
        total = total + (stage_decay**i) * loss_i
        with torch.no_grad():
            supervised = predicts_supervised[label_rows]  # [m] assistant rows
            hits = (logits.argmax(-1) == target_logits[label_rows].argmax(-1)) & supervised
            count = int(supervised.sum())
        stage_loss.append(float(loss_i.detach()))
        stage_acc.append(int(hits.sum()) / max(count, 1))
        stage_count.append(count)
    return StageLossOutput(total, stage_loss, stage_acc, stage_count)


class MLPSpeculatorObjective(torch.nn.Module):
    """The speculator and its stage loss as one module (DDP / FSDP2 / DeepSpeed arm their hooks in a
    ``forward``); parameters live at ``.head`` (names ``head.emb.0.weight``, ...).

    forward(input_ids [B, T], attention_mask [B, T], loss_mask [B, T], final_hidden [B, T, H],
    target_logits [B, T, V]) -> (loss scalar, stats float64 [3, n_predict]: per-stage loss, accuracy, count)."""

    def __init__(self, head: MLPSpeculator, stage_decay: float, prompt_loss_weight: float):
        super().__init__()
        self.head, self.stage_decay, self.prompt_loss_weight = head, stage_decay, prompt_loss_weight

    def forward(self, input_ids, attention_mask, loss_mask, final_hidden, target_logits):
        """``mlp_speculator_loss`` of one micro-batch (shapes in the class docstring)."""
        out = mlp_speculator_loss(
            self.head,
            final_hidden,
            input_ids,
            target_logits,
            loss_mask,
            attention_mask,
            stage_decay=self.stage_decay,
            prompt_loss_weight=self.prompt_loss_weight,
        )
        stats = torch.tensor([out.stage_loss, out.stage_acc, out.stage_count], dtype=torch.float64)
        return out.loss, stats


def build_mlp_speculator(target, cfg: Section, warm_start: bool | None = None) -> MLPSpeculator:
    """An ``MLPSpeculator`` sized for ``target`` (fp32); warm-started from the target's embeddings when
    ``cfg.init_from_target`` (or ``warm_start``) says so."""
    config = MLPSpeculatorConfig.from_target(
        target.config, n_predict=cfg.n_predict, inner_dim=cfg.inner_dim, scale_input=cfg.scale_input
    )
    head = MLPSpeculator(config)
    if cfg.init_from_target if warm_start is None else warm_start:
        head.init_from_target(target)
    return head


class MLPSpeculatorSpec(DrafterSpec):
    """The MLP speculator for ``train.trainer.DrafterTrainer`` (hooks: that module's docstring).

    Args:
        head_cfg: the recipe's drafter section (``config.Section``).
    """

    name = "mlp_speculator"
    batch_fields = frozenset({"final_hidden", "target_logits"})

    def __init__(self, head_cfg: Section):
        self.section = head_cfg

    @property
    def num_steps(self) -> int:
        """One accuracy row per stage."""
        return self.section.n_predict

    def build(self, target, fresh: bool = False) -> MLPSpeculator:
        """``build_mlp_speculator``; ``fresh`` skips the warm start."""
        return build_mlp_speculator(target, self.section, warm_start=False if fresh else None)

    def objective(self, drafter: MLPSpeculator) -> MLPSpeculatorObjective:
        """The speculator and its stage loss."""
        return MLPSpeculatorObjective(drafter, self.section.stage_decay, self.section.prompt_loss_weight)

    @property
    def max_k(self) -> int:
        """One token per stage: in-loop τ may draft at most ``n_predict`` (``DrafterTrainer`` refuses more)."""
        return self.section.n_predict

    def proposer(self, drafter: MLPSpeculator, target_vocab_size: int):
        """A greedy ``MLPSpeculatorProposer`` over the speculator."""
        return MLPSpeculatorProposer(drafter)
