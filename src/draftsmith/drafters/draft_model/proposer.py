"""Draft-model proposer: a smaller causal LM with the target's tokenizer drafts k tokens autoregressively.

The draft keeps its OWN KV cache (``core/cache.py``). Its bookkeeping, for one sequence:
  context  = prompt + every emitted token            (what the target has committed)
  cached   = the tokens whose K/V sit in the draft's cache (always a prefix of what it has read)
``propose(k)`` feeds ``context[len(cached):]`` (never empty: the last context token is always fed, to
get the next-token logits), then drafts d1..dk one forward at a time, so afterwards
cached = context + d1..d_{k-1}. ``accept`` appends the emitted tokens to the context and crops the
cache to the longest common prefix of cached and context (at most len(context) − 1).
Greedy drafts (temperature 0) are argmax and return q = None (one-hot: the draft is deterministic);
with temperature > 0 drafts are sampled from q = logits_to_probs(draft logits) and q is returned,
as rejection sampling requires. Use the target's temperature / top-k / top-p for the best acceptance.
"""

from __future__ import annotations

import logging

import torch

from draftsmith.core.proposer import Proposal, Proposer
from draftsmith.core.sampling import logits_to_probs, sample, seeded_generator
from draftsmith.core.target import TargetModel, has_learned_positions, position_limit

logger = logging.getLogger(__name__)

_SPECIAL_TOKEN_IDS = ("bos_token_id", "eos_token_id", "unk_token_id", "pad_token_id")


def check_same_tokenizer(target_tokenizer, draft_tokenizer) -> None:
    """Refuse a draft whose tokenizer is not the target's: same ``get_vocab()`` and special token ids.

    Raises:
        ValueError: naming the first differences and the fix.
    """
    target_vocab, draft_vocab = target_tokenizer.get_vocab(), draft_tokenizer.get_vocab()
    if target_vocab != draft_vocab:
        differing = sorted(
            t for t in target_vocab.keys() | draft_vocab.keys() if target_vocab.get(t) != draft_vocab.get(t)
        )
        examples = ", ".join(
            f"{t!r}: target {target_vocab.get(t)} vs draft {draft_vocab.get(t)}" for t in differing[:5]
        )
        raise ValueError(
            f"the draft tokenizer differs from the target's ({len(target_vocab)} vs {len(draft_vocab)} "
            f"tokens, {len(differing)} differ, e.g. {examples}); a draft model must use the target's "
            f"tokenizer: pick a draft from the same model family or train one on the target's tokenizer"
        )
    for name in _SPECIAL_TOKEN_IDS:
        t, d = getattr(target_tokenizer, name, None), getattr(draft_tokenizer, name, None)
        if t != d:
            raise ValueError(
                f"the draft tokenizer's {name} is {d} but the target's is {t}; a draft model must use "
                f"the target's tokenizer and special tokens"
            )


class DraftModelProposer(Proposer):
    """Drafts with a smaller transformers causal LM sharing the target's vocabulary.

    Args:
        draft_model: transformers ``*ForCausalLM`` in eval mode, on any device.
        target_vocab_size: V of the target (``TargetModel.vocab_size``).
        temperature: 0 → greedy (argmax) drafts with q None; > 0 → drafts sampled from q.
        top_k, top_p: as ``sampling.logits_to_probs``; only used when temperature > 0.
        seed: seeds the draft's sampling generator (``None``: nondeterministic).
        target_tokenizer, draft_tokenizer: when both are given, ``check_same_tokenizer`` runs.

    Raises:
        ValueError: the draft's vocabulary size differs from ``target_vocab_size``, or the tokenizers
            differ.
    """

    def __init__(
        self,
        draft_model,
        target_vocab_size: int,
        *,
        temperature: float = 0.0,
        top_k: int | None = None,
        top_p: float | None = None,
        seed: int | None = 0,
        target_tokenizer=None,
        draft_tokenizer=None,
    ):
        # The draft LM is run through the same one-sequence wrapper (positions + KVCache) as the target.
        self.lm = TargetModel(draft_model)
        if self.lm.vocab_size != target_vocab_size:
            raise ValueError(
                f"draft model vocab size {self.lm.vocab_size} != target vocab size {target_vocab_size}: "
                f"draft-model speculation needs the draft to predict over the target's vocabulary; use a "
                f"draft with the target's tokenizer and embedding size (or an EAGLE-3 head with a d2t map)"
            )
        if target_tokenizer is not None and draft_tokenizer is not None:
            check_same_tokenizer(target_tokenizer, draft_tokenizer)
        if temperature < 0:
            raise ValueError(f"temperature must be >= 0, got {temperature}")
        self.temperature, self.top_k, self.top_p = temperature, top_k, top_p
        self.generator = seeded_generator(self.lm.device, seed)
        self.cache = self.lm.new_cache()
        self._context: list[int] = []
        self._cached: list[int] = []

    def start(self, prompt_ids: torch.Tensor, first_token: int, target_step=None) -> None:
        """Reset for a new sequence: context = prompt ``[T]`` + first token, empty draft cache."""
        self._context = [int(t) for t in prompt_ids.tolist()] + [int(first_token)]
        self.cache = self.lm.new_cache()
        self._cached = []

    def _next_logits(self, tokens: list[int]) -> torch.Tensor:
        """Feed ``tokens`` to the draft; return the logits ``[V]`` after the last one."""
        self._cached.extend(tokens)
        return self.lm.forward(torch.tensor(tokens, dtype=torch.long), self.cache).logits[-1]

    def propose(self, k: int) -> Proposal:
        """Draft ``k`` tokens (k forwards of the draft; the first also reads the uncached context).

        A draft with learned positions (GPT-2 ``wpe``, OPT) drafts only what fits its position table: d1..dk
        are read at positions len(context)..len(context)+k-2, so k <= limit + 1 - len(context) (none past it:
        the target decodes alone there, as sequences past vLLM's ``speculative_max_model_len`` skip speculation;
        the engine refuses such a draft up front, ``engine.check_draft_positions``)."""
        if self.lm.learned_positions:
            k = min(k, self.lm.position_limit[1] + 1 - len(self._context))
        if k <= 0:
            return Proposal.empty()
        logits = self._next_logits(self._context[len(self._cached) :])
        tokens, qs = [], []
        for i in range(k):
            if self.temperature == 0:
                token = int(logits.argmax())
            else:
                q = logits_to_probs(logits, self.temperature, self.top_k, self.top_p)  # [V]
                token = int(sample(q, self.generator))
                qs.append(q)
            tokens.append(token)
            if i < k - 1:
                logits = self._next_logits([token])
        return Proposal(tokens=torch.tensor(tokens, dtype=torch.long), q=torch.stack(qs) if qs else None)

    def accept(self, n_accepted: int, emitted: torch.Tensor, target_step=None) -> None:
        """Extend the context by ``emitted`` ``[n+1]``; crop the draft cache to what is still valid."""
        # Cached tokens before the old context's end were read from the context, so they still match.
        keep = min(len(self._cached), len(self._context))
        self._context.extend(int(t) for t in emitted.tolist())
        limit = min(len(self._cached), len(self._context) - 1)
        while keep < limit and self._cached[keep] == self._context[keep]:
            keep += 1
        self.cache.crop(keep)
        del self._cached[keep:]


def check_draft_positions(draft_model, name: str, max_model_len: int, warn: bool = True) -> None:
    """Refuse a draft whose learned position table is shorter than ``max_model_len`` (a longer request would index
    past it: IndexError mid-request); a RoPE / ALiBi draft declaring fewer positions is served with a warning.
    vLLM likewise bounds the draft by min(draft length, max_model_len) (``vllm/config/speculative.py``,
    ``_maybe_override_draft_max_model_len``). ``draft_model`` may live on the meta device (checked before loading;
    ``warn=False`` leaves the warning to the engine's own check).

    Raises:
        ValueError: naming the draft's config key and length, max_model_len and the fix (``--max-model-len``).
    """
    limit = position_limit(draft_model.config)
    if limit is None or limit[1] >= max_model_len:
        return
    key, n = limit
    if has_learned_positions(draft_model):
        raise ValueError(
            f"the draft model {name!r} has learned positions for {key}={n} tokens, fewer than "
            f"max_model_len={max_model_len}: a request longer than {n} tokens would index past its "
            f"position table. Serve with --max-model-len {n} (max_model_len={n}), or use a draft with "
            f"{key} >= {max_model_len}"
        )
    if warn:
        logger.warning(
            "the draft model %r declares %s=%d, fewer than max_model_len=%d: past %d tokens it drafts "
            "at positions it was not trained on (output unchanged, acceptance may drop); --max-model-len "
            "%d stays within it",
            name,
            key,
            n,
            max_model_len,
            n,
            n,
        )
