"""EAGLE-3 training-time test (TTT): unroll the head ``ttt_steps`` times as it runs at inference.

Alignment (a_t = target aux states after reading x0..xt; the head's hidden at step i is h_i):

    tokens         x0    x1    x2    x3    x4    x5
    step 0 at t:   feature a_t,        token x_{t+1},   position t     -> predicts x_{t+2}
    step i at t:   feature h_{i-1,t},  token x_{t+1+i}, position t + i -> predicts x_{t+2+i}
    label (i, t):  softmax of the target's logits at position t+1+i, restricted to the draft vocab
    valid (i, t):  t+1+i < T, token x_{t+2+i} is supervised (assistant), and the target's argmax at
                   t+1+i lies in the draft vocab
    weight (i, t): 1 for valid rows; with ``prompt_loss_weight`` w > 0 also w for rows whose token
                   x_{t+2+i} is a real but unsupervised (prompt/template) token

Step i attends to the step-0 keys of positions <= t plus its own chain keys of steps 1..i
(``head.HeadKV``), which is exactly what the runtime does with a chain of k drafts. Loss:
sum_i 0.8^i * weighted mean soft-CE(q_i, p_i) (EAGLE-3 paper; SpecForge ``core/eagle3.py``).

``prompt_loss_weight`` (default 0: assistant tokens only, as EAGLE-3 and SpecForge train) extends the
distillation to prompt positions. The label there is still the *target's* distribution, so the head
still learns the target, not the dataset; what changes is that the inputs are text the target read
rather than wrote. On small datasets this multiplies the supervised positions at no extra compute
(every position is unrolled anyway). Accuracies are reported on assistant rows only.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from draftsmith.drafters.eagle3.head import Eagle3Head, HeadKV
from draftsmith.train.losses import row_weights, shift_left, soft_cross_entropy


@dataclass
class TTTOutput:
    """loss (scalar, differentiable); per-step loss / accuracy / count as lists of floats/ints."""

    loss: torch.Tensor
    step_loss: list[float]
    step_acc: list[float]
    step_count: list[int]


def ttt_loss(
    head: Eagle3Head,
    aux_hidden: torch.Tensor,
    input_ids: torch.Tensor,
    target_logits: torch.Tensor,
    loss_mask: torch.Tensor,
    ttt_steps: int | None = None,
    step_decay: float = 0.8,
    attention_mask: torch.Tensor | None = None,
    prompt_loss_weight: float = 0.0,
) -> TTTOutput:
    """TTT loss for one batch.

    aux_hidden [B, T, 3H], input_ids [B, T], target_logits [B, T, V], loss_mask [B, T] bool (token t is
    supervised), attention_mask [B, T] (1 = real token; needed when ``prompt_loss_weight`` > 0, where
    padding must not be scored). Right padding is fine: padded tokens are unsupervised and only visible
    to later positions.

    Raises ValueError if ``prompt_loss_weight`` is outside [0, 1] or given without ``attention_mask``."""
    predicts_supervised, row_weight = row_weights(loss_mask, attention_mask, prompt_loss_weight)
    steps = ttt_steps or head.config.ttt_steps
    draft_ids = head.draft_to_target(torch.arange(head.config.draft_vocab_size, device=input_ids.device))
    target_argmax = target_logits.argmax(-1)  # [B, T]
    target_probs = torch.softmax(target_logits[..., draft_ids].float(), dim=-1)  # [B, T, Vd]
    in_draft = head.t2d[target_argmax]  # [B, T]
    kv = HeadKV()
    hidden = head.fuse(aux_hidden)  # [B, T, H]
    total = hidden.new_zeros((), dtype=torch.float32)
    step_loss, step_acc, step_count = [], [], []
    for i in range(steps):
        tokens = shift_left(input_ids, 1 + i, 0)  # x_{t+1+i}
        hidden, _ = head.step(hidden, tokens, kv, mode="prefix" if i == 0 else "chain", with_logits=False)
        weight = shift_left(row_weight * in_draft, 1 + i, 0.0)  # [B, T]
        scored = weight > 0
        supervised = shift_left(predicts_supervised & in_draft, 1 + i, False)[scored]  # [m] accuracy rows
        w = weight[scored]  # [m]
        n = int(supervised.sum())
        logits = head.logits(hidden[scored])  # [m, Vd], scored rows only
        p = shift_left(target_probs, 1 + i, 0.0)[scored]  # label at t+1+i, [m, Vd]
        loss_i = (soft_cross_entropy(logits, p) * w).sum() / w.sum().clamp_min(1e-6)
        total = total + (step_decay**i) * loss_i
        with torch.no_grad():
            pred = head.draft_to_target(logits.argmax(-1))
            hits = int(((pred == shift_left(target_argmax, 1 + i, -1)[scored]) & supervised).sum())
        step_loss.append(float(loss_i.detach()))
        step_acc.append(hits / max(n, 1))
        step_count.append(n)
    return TTTOutput(total, step_loss, step_acc, step_count)
