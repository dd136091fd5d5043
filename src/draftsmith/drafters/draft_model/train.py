"""Draft-model distillation: a small causal LM learns the target's next-token distribution.

    draftsmith train recipes/reference/draft_model.yaml          # recipe ``method: draft_model``

The drafter is an ordinary transformers causal LM over the target's tokenizer and vocabulary, either
loaded from a smaller model of the same family (``init_from``, e.g. ``reference-draft``) or built from
the target's config class with its own depth and width. It trains with ``train.trainer.DrafterTrainer``
(same data pipeline, strategies, checkpoints and in-loop τ as EAGLE-3) and is exported as a plain HF
model directory (``export/draft_model.py``) that vLLM serves with ``method: draft_model``.

Alignment (teacher forcing on the data; the draft reads exactly the tokens the target read):

    tokens        x0   x1   x2   x3   x4
    draft q_t     reads x0..xt, predicts x_{t+1}
    label p_t     the target's next-token distribution after x0..xt (target_logits[:, t])
    weight (t)    1 when x_{t+1} is supervised (assistant); ``prompt_loss_weight`` w when x_{t+1} is a
                  real but unsupervised (prompt/template) token; 0 for padding

Loss: forward KL(p ‖ q) = Σ_v p(v) (log p(v) − log q(v)) per row, weighted mean over rows, against the
target's FULL-vocabulary distribution (no draft vocab: a draft model proposes over V). It differs from
the soft cross-entropy −Σ p log q only by the target's entropy, a constant for the draft, so both give
the same gradient. KL is reported because its value means something on its own: it is ≥ 0 and 0
exactly when the draft reproduces the target's distribution, whatever the target's entropy, so
curves of different data or targets compare and "how far from the target" is read off directly
(tests/test_draft_model.py checks both properties and the equal gradients). Forward rather than
reverse KL: the labels come from one teacher-forced target forward over fixed sequences (already the
target's own regenerated answers, i.e. close to on-policy for the target), with a dense signal at
every position, and no sampling from the draft inside the training step. Accuracy = share of
supervised rows where argmax q = argmax p (what greedy verification accepts).
"""

from __future__ import annotations

import copy
import logging
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from transformers import AutoConfig, AutoModelForCausalLM

from draftsmith import reference
from draftsmith.drafters.draft_model.config import GEOMETRY, Section
from draftsmith.drafters.draft_model.proposer import DraftModelProposer, check_same_tokenizer
from draftsmith.models import load_causal_lm
from draftsmith.train.losses import row_weights
from draftsmith.train.trainer import DrafterSpec

logger = logging.getLogger(__name__)


def _vocab_rows(model) -> int:
    return int(model.get_output_embeddings().weight.shape[0])


def check_vocab(draft, target, where: str) -> None:
    """Refuse a draft whose vocabulary size is not the target's (both sizes named).

    A draft model proposes target token ids, and vLLM's ``draft_model`` method needs equal vocabularies."""
    got, want = _vocab_rows(draft), _vocab_rows(target)
    cfg_v = int(draft.config.get_text_config().vocab_size)
    if got != want or cfg_v != want:
        raise ValueError(
            f"{where}: the draft's vocabulary has {got} tokens (config vocab_size {cfg_v}), the "
            f"target's {want}: a draft model must predict over the target's vocabulary. Fix: start from "
            f"a model with the target's tokenizer (draft_model.init_from) or build one from the target's "
            f"config (draft_model.init_from=null)"
        )


def _built_config(target, cfg: Section):
    """The target's config (same class) with the draft's geometry; raises ValueError for a geometry that
    does not divide (hidden / heads / kv heads)."""
    base = copy.deepcopy(target.config.get_text_config())
    d = base.to_dict()
    depth = d["num_hidden_layers"]
    d["num_hidden_layers"] = max(1, depth // 4)
    for key in GEOMETRY + ("tie_word_embeddings",):
        value = getattr(cfg, key)
        if value is not None:
            d[key] = value
    if d["num_hidden_layers"] != depth:
        d.pop("layer_types", None)  # per-layer attention kinds (Qwen3, Gemma): re-derived for the new depth
    h, heads, kv = d["hidden_size"], d["num_attention_heads"], d.get("num_key_value_heads") or d["num_attention_heads"]
    if h % heads or heads % kv:
        raise ValueError(
            f"draft_model: hidden_size {h} must be a multiple of num_attention_heads {heads}, and that of "
            f"num_key_value_heads {kv}; change draft_model.hidden_size / num_attention_heads / "
            "num_key_value_heads"
        )
    if "head_dim" in d and (cfg.hidden_size is not None or cfg.num_attention_heads is not None):
        d["head_dim"] = h // heads  # a new width: heads of hidden / heads dimensions
    d.pop("_name_or_path", None)
    return type(base).from_dict(d)


def build_draft_model(target, cfg: Section, tokenizer=None, fresh: bool = False):
    """The trainable draft LM for ``target`` (fp32, train mode, every parameter requiring grad).

    ``init_from``: loaded (``models.load_causal_lm``; ``fresh`` builds the same config with random
    weights instead); its tokenizer must be ``tokenizer`` (``check_same_tokenizer``, when given).
    Otherwise built from the target's config class (``_built_config``), warm-started from the target
    per ``cfg.init_from_target`` unless ``fresh``.

    Raises:
        ValueError: the draft's vocabulary size differs from the target's (both named), its tokenizer
            differs, or the geometry does not divide.
    """

    if cfg.init_from is not None:
        where = f"draft_model.init_from={cfg.init_from!r}"
        if fresh:
            config = AutoConfig.from_pretrained(reference.resolve(cfg.init_from))
            model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
        else:
            model, draft_tokenizer = load_causal_lm(cfg.init_from, dtype="float32")
            check_vocab(model, target, where)
            if tokenizer is not None:
                check_same_tokenizer(tokenizer, draft_tokenizer)
    else:
        where = "draft_model (built from the target's config)"
        model = AutoModelForCausalLM.from_config(_built_config(target, cfg), dtype=torch.float32)
        if (
            not fresh
            and cfg.init_from_target
            and model.config.hidden_size == target.config.get_text_config().hidden_size
        ):
            _warm_start(model, target)
    check_vocab(model, target, where)
    model.to(torch.float32).requires_grad_(True).train()
    return model


@torch.no_grad()
def _warm_start(model, target) -> None:
    """Copy the target's input embedding, final norm and lm_head into ``model`` (same hidden size)."""
    model.get_input_embeddings().weight.copy_(target.get_input_embeddings().weight)
    if model.get_output_embeddings().weight is not model.get_input_embeddings().weight:
        model.get_output_embeddings().weight.copy_(target.get_output_embeddings().weight)
    norm, target_norm = getattr(model.get_decoder(), "norm", None), getattr(target.get_decoder(), "norm", None)
    if norm is not None and target_norm is not None:
        norm.weight.copy_(target_norm.weight)


@dataclass
class DistillOutput:
    """loss (scalar, differentiable); acc: argmax agreement on supervised rows; count: supervised rows."""

    loss: torch.Tensor
    acc: float
    count: int


def distill_loss(
    draft,
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor,
    loss_mask: torch.Tensor,
    target_logits: torch.Tensor,
    prompt_loss_weight: float = 0.0,
) -> DistillOutput:
    """Weighted mean forward KL(p ‖ q) of one batch (alignment and weights: module docstring).

    input_ids [B, T], attention_mask [B, T] (1 = real token; right padding), loss_mask [B, T] bool
    (token t is supervised), target_logits [B, T, V] (row t predicts token t+1). The draft runs on
    the whole batch (its own forward, so any logit scaling of its architecture applies); p and q are
    compared in float32 on the scored rows only.

    Raises ValueError when the draft's vocabulary is not V or ``prompt_loss_weight`` is outside [0, 1]."""
    predicts_supervised, weight = row_weights(loss_mask, attention_mask, prompt_loss_weight)  # [B, T] each
    scored = weight > 0  # [B, T]
    logits = draft(input_ids=input_ids, attention_mask=attention_mask, use_cache=False).logits  # [B, T, V]
    if logits.shape[-1] != target_logits.shape[-1]:
        raise ValueError(
            f"the draft predicts over {logits.shape[-1]} tokens, the target over "
            f"{target_logits.shape[-1]}; a draft model needs the target's vocabulary"
        )
    log_q = F.log_softmax(logits[scored].float(), dim=-1)  # [m, V]
    log_p = F.log_softmax(target_logits[scored].float(), dim=-1)  # [m, V]
    kl = (log_p.exp() * (log_p - log_q)).sum(-1)  # [m]
    w = weight[scored]  # [m]
    loss = (kl * w).sum() / w.sum().clamp_min(1e-6)
    with torch.no_grad():
        sup = predicts_supervised[scored]  # [m] accuracy rows
        hits = int(((log_q.argmax(-1) == log_p.argmax(-1)) & sup).sum())
        n = int(sup.sum())
    return DistillOutput(loss, hits / max(n, 1), n)


class DistillObjective(torch.nn.Module):
    """The draft LM and its KL loss as one module (DDP / FSDP2 / DeepSpeed arm their hooks in
    ``forward``). Parameters live at ``.head`` (names ``head.model.layers.0...``).

    forward(input_ids [B, T], attention_mask [B, T], loss_mask [B, T], target_logits [B, T, V]) ->
    (loss scalar, stats [3, 1] float64: loss, accuracy, supervised count)."""

    def __init__(self, draft, prompt_loss_weight: float):
        super().__init__()
        self.head, self.prompt_loss_weight = draft, prompt_loss_weight

    def forward(self, input_ids, attention_mask, loss_mask, target_logits):
        """``distill_loss`` of one micro-batch (shapes in the class docstring)."""
        out = distill_loss(self.head, input_ids, attention_mask, loss_mask, target_logits, self.prompt_loss_weight)
        stats = torch.tensor([[float(out.loss.detach())], [out.acc], [out.count]], dtype=torch.float64)
        return out.loss, stats


class DraftModelSpec(DrafterSpec):
    """The draft-model drafter for ``DrafterTrainer``: logits-only batches (the online target runs
    without hidden-state output, offline shards need no particular aux layers), one accuracy row, in-loop
    τ with ``DraftModelProposer``, the draft's decoder layers as FSDP2 units.

    Args:
        cfg: what to distil. tokenizer: the target's, checked against ``init_from``'s (None: not checked).
    """

    name = "draft_model"
    batch_fields = frozenset({"target_logits"})

    def __init__(self, cfg: Section, tokenizer=None):
        self.section, self.tokenizer = cfg, tokenizer

    @property
    def num_steps(self) -> int:
        """One row of statistics: the draft predicts one token per position."""
        return 1

    def build(self, target, fresh: bool = False):
        """:func:`build_draft_model`."""
        return build_draft_model(target, self.section, self.tokenizer, fresh=fresh)

    def objective(self, drafter) -> DistillObjective:
        """:class:`DistillObjective` with the configured prompt weight."""
        return DistillObjective(drafter, self.section.prompt_loss_weight)

    def proposer(self, drafter, target_vocab_size: int):
        """A greedy ``DraftModelProposer`` (its own KV cache) over the draft."""
        return DraftModelProposer(drafter, target_vocab_size)

    def fsdp_units(self, drafter) -> list[torch.nn.Module]:
        """Each decoder layer is an FSDP2 unit; embedding, final norm and lm_head join the root."""
        return list(drafter.get_decoder().layers)
