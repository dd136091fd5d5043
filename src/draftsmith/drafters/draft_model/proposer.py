"""Draft-model proposer: a smaller causal LM with the target's tokenizer drafts k tokens autoregressively.

The draft keeps its OWN KV cache (``core/cache.py``). Its bookkeeping, for one sequence:
  context  = prompt + every emitted token            (what the target has committed)
  cached   = the tokens whose K/V sit in the draft's cache (always a prefix of what it has read)
``propose(k)`` feeds ``context[len(cached):]`` (never empty: the last context token is always fed, to
get the next-token logits), then drafts d1..dk one forward at a time, so afterwards
cached = context + d1..d_{k-1}. ``accept`` appends the emitted tokens to the context and crops the
cache to the longest common prefix of cached and context (at most len(context) − 1).
Drafts are drawn by ``core.proposer.Sampling.draw``: greedy drafts (temperature 0) are the argmax and return
q = None (one-hot: the draft is deterministic); with temperature > 0 drafts are sampled from q = logits_to_probs(
processed draft logits) and q is returned, as rejection sampling requires. The request's processors (min_tokens,
penalties: ``core.processors``) apply to the draft logits with the drafts made so far, as to the target's p.

``DraftModelProposer`` drafts for one sequence; ``BatchDraftModelProposer`` drafts for every row of a batch with
the same bookkeeping per row and ONE ``BatchKVCache`` (``core/batch_cache.py``): each draft forward reads all rows.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Sequence

import torch

from draftsmith.core.batch_cache import BatchKVCache
from draftsmith.core.proposer import BatchProposer, Proposal, Proposer, Sampling
from draftsmith.core.sampling import seeded_generator
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
        sampling: a ``core.proposer.Sampling`` instead of temperature / top_k / top_p / seed (min_p and the
            request's processors included).
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
        sampling: Sampling | None = None,
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
        self.sampling = sampling if sampling is not None else Sampling(temperature, top_k, top_p, seed)
        if self.sampling.temperature < 0:
            raise ValueError(f"temperature must be >= 0, got {self.sampling.temperature}")
        self.generator = seeded_generator(self.lm.device, self.sampling.seed)
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
        k = _draft_budget(self.lm, len(self._context), k)
        if k <= 0:
            return Proposal.empty()
        logits = self._next_logits(self._context[len(self._cached) :])
        tokens, qs = [], []
        for i in range(k):
            token, q = self.sampling.draw(logits, self.generator, tokens)  # q [V] or None (greedy)
            if q is not None:
                qs.append(q)
            tokens.append(token)
            if i < k - 1:
                logits = self._next_logits([token])
        return Proposal(tokens=torch.tensor(tokens, dtype=torch.long), q=torch.stack(qs) if qs else None)

    def accept(self, n_accepted: int, emitted: torch.Tensor, target_step=None) -> None:
        """Extend the context by ``emitted`` ``[n+1]``; crop the draft cache to what is still valid."""
        keep = _extend_and_keep(self._context, self._cached, emitted)
        self.cache.crop(keep)
        del self._cached[keep:]


def _draft_budget(lm: TargetModel, context_len: int, k: int) -> int:
    """Drafts (<= ``k``, may be <= 0) a draft LM may make after ``context_len`` tokens: a learned position table
    bounds them (``DraftModelProposer.propose``), RoPE / ALiBi drafts are not bounded."""
    if lm.learned_positions:
        return min(k, lm.position_limit[1] + 1 - context_len)
    return k


def _extend_and_keep(context: list[int], cached: list[int], emitted: torch.Tensor) -> int:
    """Append ``emitted`` ``[n+1]`` to ``context``; return how many leading ``cached`` tokens are still valid: the
    longest common prefix of cached and the new context, at most len(context) - 1 (the last context token is fed
    again, to get the next-token logits)."""
    # Cached tokens before the old context's end were read from the context, so they still match.
    keep = min(len(cached), len(context))
    context.extend(int(t) for t in emitted.tolist())
    limit = min(len(cached), len(context) - 1)
    while keep < limit and cached[keep] == context[keep]:
        keep += 1
    return keep


@dataclass(eq=False)
class _Row:
    """One sequence of a ``BatchDraftModelProposer``: the bookkeeping of ``DraftModelProposer`` (``context``,
    ``cached``: the tokens in its cache row, none when it has no row) and its own sampling settings and generator."""

    context: list[int]
    cached: list[int]
    sampling: Sampling
    generator: torch.Generator

    def draw(self, logits: torch.Tensor, argmax: int | None, drafted: list[int]) -> tuple[int, torch.Tensor | None]:
        """One draft from next-token logits ``[V]`` after this step's ``drafted`` tokens, as ``DraftModelProposer.
        propose`` draws it (``Sampling.draw``); ``argmax`` (the row's argmax, computed for the batch) is taken
        as is when the row drafts plain greedy."""
        if self.sampling.plain_greedy:
            return argmax, None
        return self.sampling.draw(logits, self.generator, drafted)


class BatchDraftModelProposer(BatchProposer):
    """The draft LM over a batch: ``DraftModelProposer``'s bookkeeping per row, ONE ``BatchKVCache`` for all rows,
    and each draft forward reads every row (``TargetModel.forward_batch``).

    - ``start`` prefills the row's prompt ``[T]`` in its own one-row cache (``last_only``: its logits are not
      needed) and ``merge``s it, so that ``cached`` = prompt and the first ``propose`` reads the first token;
    - ``propose(keys, ks)``: forward 1 reads each drafting row's uncached context (ragged, ``[T_b]``, >= 1 token),
      then forwards 2..max(k) read one draft per row still drafting; every row draws from its own logits with its
      own settings and generator, as ``DraftModelProposer`` would alone;
    - ``accept`` keeps each row's longest valid prefix (``BatchKVCache.truncate``), as ``DraftModelProposer``
      crops its cache; ``stop`` drops the row.

    Rows not drafting in a forward (k_b = 0, or their k_b drafts already made) must still read one token, since
    every cached row does: they RE-READ their last cached token in place (truncate by one, read it again at the
    same position, keep it). Their cache then holds the same tokens at the same positions (the token's keys and
    values recomputed: equal up to the batched kernels' rounding), nothing is rolled back afterwards, and no row
    ever reads a position it had not read before, so a learned position table is never indexed past its end
    (a dummy token would be read at the row's next position, which a row at the table's end does not have).
    Taking such rows out of the batch instead would copy the whole cache twice per forward.

    Learned positions (GPT-2 ``wpe``, OPT): k is bounded by the table as in ``DraftModelProposer.propose``; a row
    whose context outgrows the table can never draft again and gives up its cache row (at ``start`` it never gets
    one).

    Args:
        draft_model: transformers ``*ForCausalLM`` in eval mode, on any device (attention-only layers:
            ``BatchKVCache``).
        target_vocab_size: V of the target (``TargetModel.vocab_size``).
        target_tokenizer, draft_tokenizer: when both are given, ``check_same_tokenizer`` runs.

    Raises:
        ValueError: as ``DraftModelProposer``; or a draft whose layers cannot be rolled back per row
            (``BatchKVCache``).
    """

    def __init__(self, draft_model, target_vocab_size: int, *, target_tokenizer=None, draft_tokenizer=None):
        DraftModelProposer(  # its checks: vocabulary size, tokenizers
            draft_model, target_vocab_size, target_tokenizer=target_tokenizer, draft_tokenizer=draft_tokenizer
        )
        self.lm = TargetModel(draft_model)
        self.cache = BatchKVCache(draft_model.config)
        self.order: list[int] = []  # keys of the rows in the cache, in cache row order
        self.rows: dict[int, _Row] = {}

    def _fits(self, row: _Row) -> bool:
        """False when the row can never draft again (its context outgrew a learned position table)."""
        return _draft_budget(self.lm, len(row.context), 1) >= 1

    def start(self, key: int, prompt_ids: torch.Tensor, first_token: int, target_step, sampling: Sampling) -> None:
        """Row ``key`` joins: context = ``prompt_ids`` ``[T]`` (T >= 1) + ``first_token``; the prompt is prefilled
        into a new cache row. ``target_step`` is not read. A key already started is restarted.

        Raises:
            ValueError: an empty prompt, or a negative temperature."""
        if sampling.temperature < 0:
            raise ValueError(f"temperature must be >= 0, got {sampling.temperature}")
        prompt = [int(t) for t in torch.as_tensor(prompt_ids).reshape(-1).tolist()]
        if not prompt:
            raise ValueError("prompt_ids must hold at least one token")
        self.stop(key)
        row = _Row(prompt + [int(first_token)], [], sampling, seeded_generator(self.lm.device, sampling.seed))
        self.rows[key] = row
        if not self._fits(row):
            return
        own = BatchKVCache(self.lm.model.config)
        own.add_empty_row()
        self.lm.forward_batch([torch.tensor(prompt)], own, last_only=True)
        own.commit([len(prompt)])
        self.cache.merge(own)
        row.cached = prompt
        self.order.append(key)

    def _forward(self, inputs: list[list[int]]) -> torch.Tensor:
        """One draft forward reading ``inputs[i]`` (>= 1 token) after cache row i, all kept; returns the logits
        ``[B, V]`` after each row's last token."""
        step = self.lm.forward_batch([torch.tensor(x) for x in inputs], self.cache, last_only=True)
        self.cache.commit([len(x) for x in inputs])
        return step.logits[:, 0]

    def _reread(self, i: int, row: _Row) -> list[int]:
        """The input of a row not drafting in this forward: its last cached token, read again in place."""
        self.cache.truncate(i, len(row.cached) - 1)
        return row.cached[-1:]

    def propose(self, keys: Sequence[int], ks: Sequence[int]) -> list[Proposal]:
        """Draft up to ``ks[b]`` tokens for row ``keys[b]`` (fewer where a learned position table ends): max(k')
        forwards of the draft for the whole batch (none when no row drafts). Returns one ``Proposal`` per key:
        tokens ``[k'_b]``, q ``[k'_b, V]`` (on the draft's device) or None at temperature 0.

        Raises:
            ValueError: ``keys`` and ``ks`` of different lengths. KeyError: a key not started."""
        if len(keys) != len(ks):
            raise ValueError(f"{len(keys)} keys but {len(ks)} draft counts")
        index = {key: i for i, key in enumerate(self.order)}
        want = [0] * len(self.order)  # drafts per cache row
        for key, k in zip(keys, ks):
            row = self.rows[key]
            if key in index:
                want[index[key]] = max(0, _draft_budget(self.lm, len(row.context), k))
        rows = [self.rows[key] for key in self.order]
        tokens: list[list[int]] = [[] for _ in rows]
        qs: list[list[torch.Tensor]] = [[] for _ in rows]
        depth = max(want, default=0)
        if depth:
            inputs = []
            for i, row in enumerate(rows):
                if want[i]:
                    inputs.append(row.context[len(row.cached) :])
                    row.cached.extend(inputs[-1])
                else:
                    inputs.append(self._reread(i, row))
            for d in range(depth):
                logits = self._forward(inputs)  # [B, V]
                greedy = logits.argmax(dim=-1).tolist() if any(r.sampling.plain_greedy for r in rows) else None
                for i, row in enumerate(rows):
                    if d < want[i]:
                        token, q = row.draw(logits[i], greedy[i] if greedy is not None else None, tokens[i])
                        tokens[i].append(token)
                        if q is not None:
                            qs[i].append(q)
                if d + 1 == depth:  # d_k is not read (as DraftModelProposer: cached = context + d_1..d_{k-1})
                    break
                inputs = []
                for i, row in enumerate(rows):
                    if d + 1 < want[i]:  # this row's newest draft is read to draft its next
                        inputs.append(tokens[i][-1:])
                        row.cached.append(tokens[i][-1])
                    else:
                        inputs.append(self._reread(i, row))
        out = []
        for key in keys:
            i = index.get(key)
            if i is None or not tokens[i]:
                out.append(Proposal.empty())
            else:
                out.append(Proposal(torch.tensor(tokens[i], dtype=torch.long), torch.stack(qs[i]) if qs[i] else None))
        return out

    def accept(self, keys: Sequence[int], n_accepted: Sequence[int], emitted: Sequence[torch.Tensor], step) -> None:
        """Row ``keys[b]`` appends ``emitted[b]`` ``[n+1]`` to its context; its cache row is truncated to its longest
        valid prefix (``DraftModelProposer.accept``), or dropped once it can never draft again. ``step`` (the
        target's verify forward) and ``n_accepted`` are not read: ``emitted`` says it all."""
        index = {key: i for i, key in enumerate(self.order)}
        gone = []
        for b, key in enumerate(keys):
            row = self.rows[key]
            keep = _extend_and_keep(row.context, row.cached, emitted[b])
            del row.cached[keep:]
            i = index.get(key)
            if i is None:
                continue
            if not self._fits(row):
                gone.append(i)
            else:
                self.cache.truncate(i, keep)
        if gone:
            self._remove(gone)

    def _remove(self, rows: list[int]) -> None:
        """Drop cache rows ``rows`` (indices); their sequences hold no cache row afterwards."""
        for i in set(rows):
            self.rows[self.order[i]].cached = []
        order = self.cache.remove_rows(rows)  # the cache's new row order, as old indices
        self.order = [self.order[i] for i in order]

    def stop(self, key: int) -> None:
        """Row ``key`` left: its state and cache row are dropped (an unknown key: nothing to do)."""
        if key in self.order:
            self._remove([self.order.index(key)])
        self.rows.pop(key, None)


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
