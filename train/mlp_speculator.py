"""MLP speculator training: the stage loss, and the drafter spec the generic trainer runs.

    draftsmith train recipes/reference/mlp_speculator.yaml

The loop, strategies, accumulation, checkpoints and in-loop τ are ``train.trainer.DrafterTrainer``'s;
this module says what is MLP-speculator about a run (:class:`MLPSpeculatorSpec`):
  * the drafter: an ``MLPSpeculator`` (``heads/mlp_speculator.py``) sized for the target, optionally
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
from pathlib import Path

import torch

from draftsmith.heads.eagle3 import soft_cross_entropy
from draftsmith.heads.mlp_speculator import MLPSpeculator, MLPSpeculatorConfig
from draftsmith.train.trainer import DrafterSpec, DrafterTrainer
from draftsmith.train.ttt import row_weights, shift_left

__all__ = ["MLPSpeculatorHeadConfig", "StageLossOutput", "mlp_speculator_loss", "MLPSpeculatorObjective",
           "MLPSpeculatorSpec", "build_mlp_speculator", "train_mlp_speculator"]
logger = logging.getLogger(__name__)


@dataclass
class MLPSpeculatorHeadConfig:
    """The recipe's ``mlp_speculator:`` section: shape choices beyond what the target fixes, loss weights."""

    n_predict: int = 5                   #: stages = most tokens drafted per step (serve k <= n_predict)
    inner_dim: int | None = None         #: stages' width D; None = the target's hidden size
    scale_input: bool = False            #: rms-normalise the stage-0 state and divide it by sqrt(2) (vLLM field)
    stage_decay: float = 1.0             #: loss weight of stage i is stage_decay**i (1.0: all stages alike)
    prompt_loss_weight: float = 0.0      #: weight of prompt positions in the distillation loss (as train/ttt.py)
    init_from_target: bool = True        #: stages' emb / head start from the target's embeddings (needs D == H)

    def __post_init__(self):
        if self.n_predict < 1:
            raise ValueError(f"mlp_speculator.n_predict must be >= 1, got {self.n_predict}")
        if not 0.0 < self.stage_decay <= 1.0:
            raise ValueError(f"mlp_speculator.stage_decay must be in (0, 1], got {self.stage_decay}")


@dataclass
class StageLossOutput:
    """loss (scalar, differentiable); per-stage loss / accuracy / supervised count as lists."""

    loss: torch.Tensor
    stage_loss: list[float]
    stage_acc: list[float]
    stage_count: list[int]


def mlp_speculator_loss(head: MLPSpeculator, final_hidden: torch.Tensor, input_ids: torch.Tensor,
                        target_logits: torch.Tensor, loss_mask: torch.Tensor,
                        attention_mask: torch.Tensor | None = None, stages: int | None = None, stage_decay: float = 1.0,
                        prompt_loss_weight: float = 0.0) -> StageLossOutput:
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
    predicts_supervised, row_weight = row_weights(loss_mask, attention_mask, prompt_loss_weight)   # [B, T]
    n = stages or head.config.n_predict
    if not 1 <= n <= head.config.n_predict:
        raise ValueError(f"stages must be in 1..n_predict ({head.config.n_predict}), got {n}")
    b, t = input_ids.shape
    if final_hidden.shape[:2] != (b, t) or target_logits.shape[:2] != (b, t) or loss_mask.shape != (b, t):
        raise ValueError(f"shapes disagree: input_ids {tuple(input_ids.shape)}, final_hidden "
                         f"{tuple(final_hidden.shape)}, target_logits {tuple(target_logits.shape)}, loss_mask "
                         f"{tuple(loss_mask.shape)}; all must be [B, T, ...] of the same batch")
    state = head.input_state(final_hidden)                                             # [B, T, H]
    total = state.new_zeros((), dtype=torch.float32)
    stage_loss, stage_acc, stage_count = [], [], []
    for i in range(n):
        state = head.stage(i, state, shift_left(input_ids, 1 + i, 0))                  # token x_{t+1+i}; [B, T, D]
        weight = shift_left(row_weight, 1 + i, 0.0)                                    # row_weight[t+1+i]: x_{t+2+i}
        rows = (weight > 0).nonzero(as_tuple=True)                                     # (b [m], t [m]); t+1+i < T
        label_rows = (rows[0], rows[1] + 1 + i)                                        # target row t+1+i
        w = weight[rows]                                                               # [m]
        logits = head.logits(i, state[rows])                                          # [m, V], scored rows only
        p = torch.softmax(target_logits[label_rows].float(), dim=-1)                   # [m, V]
        loss_i = (soft_cross_entropy(logits, p) * w).sum() / w.sum().clamp_min(1e-6)
        total = total + (stage_decay ** i) * loss_i
        with torch.no_grad():
            supervised = predicts_supervised[label_rows]                               # [m] assistant rows
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
        out = mlp_speculator_loss(self.head, final_hidden, input_ids, target_logits, loss_mask, attention_mask,
                                  stage_decay=self.stage_decay, prompt_loss_weight=self.prompt_loss_weight)
        stats = torch.tensor([out.stage_loss, out.stage_acc, out.stage_count], dtype=torch.float64)
        return out.loss, stats


def build_mlp_speculator(target, cfg: MLPSpeculatorHeadConfig, warm_start: bool | None = None) -> MLPSpeculator:
    """An ``MLPSpeculator`` sized for ``target`` (fp32); warm-started from the target's embeddings when
    ``cfg.init_from_target`` (or ``warm_start``) says so."""
    config = MLPSpeculatorConfig.from_target(target.config, n_predict=cfg.n_predict, inner_dim=cfg.inner_dim,
                                             scale_input=cfg.scale_input)
    head = MLPSpeculator(config)
    if cfg.init_from_target if warm_start is None else warm_start:
        head.init_from_target(target)
    return head


class MLPSpeculatorSpec(DrafterSpec):
    """The MLP speculator for ``train.trainer.DrafterTrainer`` (hooks: that module's docstring).

    Args:
        head_cfg: the recipe's ``mlp_speculator`` section.
    """

    name = "mlp_speculator"
    batch_fields = frozenset({"final_hidden", "target_logits"})

    def __init__(self, head_cfg: MLPSpeculatorHeadConfig):
        self.head_cfg = head_cfg

    @property
    def num_steps(self) -> int:
        """One accuracy row per stage."""
        return self.head_cfg.n_predict

    def build(self, target, fresh: bool = False) -> MLPSpeculator:
        """``build_mlp_speculator``; ``fresh`` skips the warm start."""
        return build_mlp_speculator(target, self.head_cfg, warm_start=False if fresh else None)

    def objective(self, drafter: MLPSpeculator) -> MLPSpeculatorObjective:
        """The speculator and its stage loss."""
        return MLPSpeculatorObjective(drafter, self.head_cfg.stage_decay, self.head_cfg.prompt_loss_weight)

    def proposer(self, drafter: MLPSpeculator, target_vocab_size: int):
        """A greedy ``MLPSpeculatorProposer`` over the speculator."""
        from draftsmith.inference.proposers.mlp_speculator import MLPSpeculatorProposer

        return MLPSpeculatorProposer(drafter)


def train_mlp_speculator(target, data, head_cfg: MLPSpeculatorHeadConfig, cfg, out_dir: Path, pad_id: int | None,
                         run_config: dict | None = None, heldout: list[dict] | None = None, tokenizer=None):
    """Train an MLP speculator on ``data`` (``RenderedDataset`` online, ``ShardReader`` offline) against the
    frozen ``target``; checkpoints go to ``out_dir/checkpoint`` and a run resumes from them. Returns the
    trainer's ``TrainResult`` (``result.head`` is the speculator). Arguments and errors:
    ``train.trainer.DrafterTrainer``; also ValueError when in-loop τ would draft more tokens
    (``train.acceptance.k``) than the speculator has stages."""
    if cfg.acceptance.every and cfg.acceptance.k > head_cfg.n_predict:
        raise ValueError(f"train.acceptance.k={cfg.acceptance.k} > mlp_speculator.n_predict={head_cfg.n_predict}: "
                         f"one token per stage is drafted: set train.acceptance.k <= {head_cfg.n_predict}")
    return DrafterTrainer(MLPSpeculatorSpec(head_cfg), target, data, cfg, out_dir, pad_id, run_config, heldout,
                          tokenizer).run()
