"""Pieces every drafter's distillation loss shares: shifted labels, row weights, soft cross-entropy.

Row t of a batch predicts token t+1 (the target's next-token distribution there is the label); the losses of
EAGLE-3 (``drafters/eagle3/ttt.py``), the MLP speculator and the draft model weigh rows alike
(:func:`row_weights`) and compare distributions with :func:`soft_cross_entropy`.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def shift_left(x: torch.Tensor, n: int, fill) -> torch.Tensor:
    """x [B, T, ...] -> y with y[:, t] = x[:, t + n] (``fill`` past the end)."""
    if n == 0:
        return x
    pad = torch.full_like(x[:, :n], fill)
    return torch.cat([x[:, n:], pad], dim=1)


def row_weights(
    loss_mask: torch.Tensor, attention_mask: torch.Tensor | None, prompt_loss_weight: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """Which rows a distillation loss scores, and with what weight (shared by every drafter's loss).

    Row t predicts token t+1: it weighs 1 when that token is supervised (``loss_mask`` [B, T] bool), else
    ``prompt_loss_weight`` when it is a real token (``attention_mask`` [B, T], 1 = real), else 0 (padding).
    Returns (predicts_supervised [B, T] bool, row_weight [B, T] float32).

    Raises ValueError if ``prompt_loss_weight`` is outside [0, 1] or > 0 without ``attention_mask``."""
    if not 0.0 <= prompt_loss_weight <= 1.0:
        raise ValueError(f"prompt_loss_weight must be in [0, 1], got {prompt_loss_weight}")
    if prompt_loss_weight > 0 and attention_mask is None:
        raise ValueError("prompt_loss_weight > 0 needs the attention_mask (padding must not be scored)")
    predicts_supervised = shift_left(loss_mask.bool(), 1, False)  # token t+1 supervised
    row_weight = predicts_supervised.float()  # [B, T]
    if prompt_loss_weight > 0:
        predicts_real = shift_left(attention_mask.bool(), 1, False)
        row_weight = torch.where(predicts_supervised, 1.0, prompt_loss_weight * predicts_real.float())
    return predicts_supervised, row_weight


def soft_cross_entropy(logits: torch.Tensor, target_probs: torch.Tensor) -> torch.Tensor:
    """-sum_v p(v) log q(v) per row: logits [..., Vd], target_probs [..., Vd] -> [...]."""
    return -(target_probs * F.log_softmax(logits.float(), dim=-1)).sum(-1)
