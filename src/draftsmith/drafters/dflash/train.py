"""DFlash training: the block objective over sampled anchors, and the drafter spec the generic trainer runs.

    draftsmith train recipes/reference/dflash.yaml

The loop, strategies, accumulation, checkpoints and in-loop τ are ``train.trainer.DrafterTrainer``'s; this module
says what is DFlash about a run (:class:`DFlashSpec`): the drafter (``head.DFlashHead`` sized for the target, its
embedding and lm_head bound), the batch (aux states [B, T, n·H] of ``target_layer_ids`` + 1 and the target's logits
[B, T, V]), the objective (:func:`block_loss`) and in-loop τ with ``DFlashProposer``.

The objective, as the runtime sees a block (``proposer.py``), with every choice's source:

    anchors a       up to ``num_anchors`` positions per sequence drawn without replacement among those where
                    x_a and x_{a+1} are supervised (assistant) tokens (SpecForge ``_sample_anchor_positions``)
    block (a)       tokens [x_a, m, ..., m] at positions a .. a+B-1 (B = block_size)
    attention       block (a) sees context features of positions < a (strictly: at inference the anchor is the
                    token the target just emitted, whose hidden state does not exist yet; SpecForge 507da3e5) and
                    every key of its own block, bidirectionally; blocks never see each other
    label (a, j)    block index j >= 1 predicts x_{a+j} (same position, no shift): the target's distribution at
                    row a+j-1, soft cross-entropy (Model-Optimizer's ``dflash_self_logit_distillation``; hard labels
                    in SpecForge; on the target's own generations the two agree in expectation)
    valid (a, j)    a+j < T and x_{a+j} is supervised
    weight (a, j)   exp(-(j-1)/gamma) (DFlash paper Eq. 4; ``config.default_gamma``); loss = Σ w·CE / Σ w

All blocks of a micro-batch run in ONE forward: queries [B, N·block_size] over keys [T context | N·block_size
block], with the mask above as a dense boolean SDPA mask (SpecForge builds the same with flex attention).
"""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass

import torch

from draftsmith.drafters.dflash.config import Section
from draftsmith.drafters.dflash.head import DFlashConfig, DFlashHead
from draftsmith.drafters.dflash.proposer import DFlashProposer
from draftsmith.train.losses import soft_cross_entropy
from draftsmith.train.trainer import DrafterSpec

logger = logging.getLogger(__name__)


def choose_mask_token_id(target_config, tokenizer=None) -> int:
    """The mask token: the first embedding row past the tokenizer's vocabulary when the target has spare rows
    (z-lab's choice: 151669 for Qwen3's 151936 rows), else the tokenizer's pad token, else its eos, else 0."""
    vocab = int(target_config.get_text_config().vocab_size)
    if tokenizer is not None:
        n = len(tokenizer)
        if n < vocab:
            return n
        for tid in (tokenizer.pad_token_id, tokenizer.eos_token_id):
            if tid is not None and 0 <= int(tid) < vocab:
                return int(tid)
    return 0


@dataclass
class BlockLossOutput:
    """loss (scalar, differentiable); per block position j = 1..B-1: loss, accuracy, supervised count."""

    loss: torch.Tensor
    step_loss: list[float]
    step_acc: list[float]
    step_count: list[int]


def sample_anchors(
    loss_mask: torch.Tensor, attention_mask: torch.Tensor | None, num_anchors: int, generator=None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Anchors (module docstring): ``(anchors [B, N] int64 ascending, keep [B, N] bool)``; rows with fewer than N
    valid positions are padded with anchor 1 and keep False. N = min(num_anchors, most valid positions in a row)."""
    b, t = loss_mask.shape
    sup = loss_mask.bool() if attention_mask is None else loss_mask.bool() & attention_mask.bool()
    valid = torch.zeros_like(sup)
    valid[:, 1 : t - 1] = sup[:, 1 : t - 1] & sup[:, 2:t]
    counts = valid.sum(1)
    n = int(min(num_anchors, int(counts.max()) if b else 0))
    if n == 0:
        return torch.zeros(b, 0, dtype=torch.long, device=loss_mask.device), torch.zeros(b, 0, dtype=torch.bool)
    scores = torch.rand(b, t, generator=generator, device=loss_mask.device)
    scores = scores.masked_fill(~valid, 2.0)
    picked = scores.argsort(dim=1)[:, :n]  # n random valid positions first (invalid ones score 2)
    keep = torch.arange(n, device=loss_mask.device)[None] < counts[:, None]
    anchors = torch.where(keep, picked, torch.ones_like(picked))
    order = torch.where(keep, anchors, torch.full_like(anchors, t)).argsort(dim=1)
    return anchors.gather(1, order), keep.gather(1, order)


def block_mask(anchors: torch.Tensor, block_size: int, seq_len: int, attention_mask=None) -> torch.Tensor:
    """[B, 1, N·bs, T + N·bs] bool: block n's queries see context keys j < anchors[:, n] (real tokens only) and the
    keys of block n."""
    b, n = anchors.shape
    dev = anchors.device
    q_block = torch.arange(n * block_size, device=dev) // block_size  # [Q] block of each query
    q_anchor = anchors[:, q_block]  # [B, Q]
    ctx = torch.arange(seq_len, device=dev)[None, None] < q_anchor[..., None]  # [B, Q, T]
    if attention_mask is not None:
        ctx = ctx & attention_mask.bool()[:, None, :]
    own = (q_block[:, None] == q_block[None, :])[None].expand(b, -1, -1)  # [B, Q, Q]
    return torch.cat([ctx, own], dim=-1)[:, None]


def block_loss(
    head: DFlashHead,
    aux_hidden: torch.Tensor,
    input_ids: torch.Tensor,
    target_logits: torch.Tensor,
    loss_mask: torch.Tensor,
    attention_mask: torch.Tensor | None = None,
    *,
    num_anchors: int = 512,
    gamma: float = 4.0,
    generator: torch.Generator | None = None,
) -> BlockLossOutput:
    """The block objective (module docstring) for one micro-batch.

    aux_hidden [B, T, n·H], input_ids [B, T], target_logits [B, T, V] (row t predicts token t+1), loss_mask [B, T]
    bool (token t supervised), attention_mask [B, T] (1 = real token) or None."""
    c = head.config
    bs, steps = c.block_size, c.block_size - 1
    b, t = input_ids.shape
    dev = input_ids.device
    anchors, keep = sample_anchors(loss_mask, attention_mask, num_anchors, generator)
    n = anchors.shape[1]
    if n == 0:  # no supervised pair in the batch: a zero loss that still reaches every parameter
        zero = sum(p.sum() for p in head.parameters()) * 0.0
        return BlockLossOutput(zero, [0.0] * steps, [0.0] * steps, [0] * steps)
    offsets = torch.arange(bs, device=dev)
    pos = anchors[..., None] + offsets  # [B, N, bs] positions of the block tokens
    ids = torch.full_like(pos, c.mask_token_id)
    ids[..., 0] = input_ids.gather(1, anchors)
    at = pos.clamp(max=t - 1)
    label_ok = (pos < t) & loss_mask.bool().gather(1, at.view(b, -1)).view_as(pos) & keep[..., None]
    label_ok[..., 0] = False
    context = head.context(aux_hidden)  # [B, T, H]
    ctx_kv = head.context_kv(context, torch.arange(t, device=dev)[None].expand(b, t))
    mask = block_mask(anchors, bs, t, attention_mask)
    hidden = head.block(ids.view(b, n * bs), pos.view(b, n * bs), ctx_kv, mask)  # [B, N·bs, H]
    scored = label_ok.view(b, n * bs)
    rows_b, rows_q = scored.nonzero(as_tuple=True)  # [m]
    j = rows_q % bs  # block index of each scored row, 1..bs-1
    teacher = target_logits[rows_b, pos.view(b, -1)[rows_b, rows_q] - 1].float()  # [m, V] row a+j-1
    logits = head.logits(hidden[rows_b, rows_q])  # [m, V]
    ce = soft_cross_entropy(logits, torch.softmax(teacher, dim=-1))  # [m]
    w = torch.exp(-(j.float() - 1.0) / gamma)
    loss = (ce * w).sum() / w.sum().clamp_min(1e-6)
    with torch.no_grad():
        hits = (logits.argmax(-1) == teacher.argmax(-1)).float()
        count = torch.bincount(j, minlength=bs)[1:]
        loss_j = torch.bincount(j, weights=ce.detach(), minlength=bs)[1:] / count.clamp_min(1)
        acc_j = torch.bincount(j, weights=hits, minlength=bs)[1:] / count.clamp_min(1)
    return BlockLossOutput(loss, loss_j.tolist(), acc_j.tolist(), [int(x) for x in count])


class BlockObjective(torch.nn.Module):
    """The drafter and its block loss as one module (DDP / FSDP2 / DeepSpeed arm their hooks in a ``forward``);
    parameters live at ``.head`` (``head.fc.weight``, ``head.layers.0...``).

    forward(aux_hidden [B, T, n·H], input_ids [B, T], target_logits [B, T, V], loss_mask [B, T], attention_mask
    [B, T]) -> (loss scalar, stats float64 [3, block_size - 1]: per-position loss, accuracy, count)."""

    def __init__(self, head: DFlashHead, num_anchors: int, gamma: float):
        super().__init__()
        self.head, self.num_anchors, self.gamma = head, num_anchors, gamma

    def forward(self, aux_hidden, input_ids, target_logits, loss_mask, attention_mask):
        """``block_loss`` of one micro-batch (shapes in the class docstring)."""
        out = block_loss(
            self.head,
            aux_hidden,
            input_ids,
            target_logits,
            loss_mask,
            attention_mask,
            num_anchors=self.num_anchors,
            gamma=self.gamma,
        )
        stats = torch.tensor([out.step_loss, out.step_acc, out.step_count], dtype=torch.float64)
        return out.loss, stats


def build_dflash(target, cfg: Section, tokenizer=None, warm_start: bool | None = None) -> DFlashHead:
    """A ``DFlashHead`` sized for ``target`` (fp32) with its embedding and lm_head bound; the final norm
    warm-started from the target's when ``cfg.init_from_target`` (or ``warm_start``) says so."""
    text = target.config.get_text_config()
    config = DFlashConfig.from_target(
        target.config,
        num_hidden_layers=cfg.num_hidden_layers,
        target_layer_ids=cfg.layer_ids(text.num_hidden_layers),
        block_size=cfg.block_size,
        mask_token_id=cfg.mask_token_id
        if cfg.mask_token_id is not None
        else choose_mask_token_id(target.config, tokenizer),
        intermediate_size=cfg.intermediate_size,
    )
    head = DFlashHead(config)
    head.bind_target(target.get_input_embeddings(), target.get_output_embeddings())
    if cfg.init_from_target if warm_start is None else warm_start:
        head.init_from_target(target)
    return head


class DFlashSpec(DrafterSpec):
    """The DFlash drafter for ``train.trainer.DrafterTrainer`` (hooks: that module's docstring).

    Args:
        section: the recipe's drafter section (``config.Section``). tokenizer: the target's (picks the mask token
            when the section leaves it null).
    """

    name = "dflash"
    batch_fields = frozenset({"aux_hidden", "target_logits"})
    trained_depth_field = "drafter.block_size"

    def __init__(self, section: Section, tokenizer=None):
        self.section, self.tokenizer = section, tokenizer

    @property
    def num_steps(self) -> int:
        """One statistics row per predicted block position (block_size - 1)."""
        return self.section.block_size - 1

    @property
    def trained_depth(self) -> int:
        return self.section.block_size - 1

    @property
    def max_k(self) -> int:
        """A block drafts at most block_size - 1 tokens (in-loop τ past it is refused)."""
        return self.section.block_size - 1

    def build(self, target, fresh: bool = False) -> DFlashHead:
        """``build_dflash``; ``fresh`` skips the warm start."""
        return build_dflash(target, self.section, self.tokenizer, warm_start=False if fresh else None)

    def objective(self, drafter: DFlashHead) -> BlockObjective:
        """The drafter and its block loss."""
        return BlockObjective(drafter, self.section.num_anchors, self.section.gamma)

    def proposer(self, drafter: DFlashHead, target_vocab_size: int):
        """A greedy ``DFlashProposer`` over the drafter."""
        return DFlashProposer(drafter)

    def aux_layer_ids(self, drafter: DFlashHead) -> tuple[int, ...]:
        """HF hidden_states indices read: target_layer_ids + 1."""
        return drafter.config.aux_layer_ids

    def fsdp_units(self, drafter: DFlashHead) -> list[torch.nn.Module]:
        """Each draft layer is its own FSDP2 unit; fc and the norms join the root."""
        return list(drafter.layers)

    def checkpoint_extra(self) -> dict:
        """The loss decay constant used (recorded for the run's provenance)."""
        return {
            "dflash_gamma": self.section.gamma,
            "dflash_weight_at_last": math.exp(-(self.num_steps - 1) / self.section.gamma),
        }
