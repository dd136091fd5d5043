"""The drafter contract: every proposer (n-gram, draft model, EAGLE-3, MLP speculator) is a ``Proposer``.

The outer loop (``core/generate.py``) calls, for one sequence:
  1. ``start(prompt_ids, first_token, target_step)`` once, after the target's prefill produced the
     first token (``target_step`` is the prefill's ``TargetStep`` over the prompt);
  2. ``propose(k)`` → ``Proposal``: up to k tokens continuing prompt + every emitted token so far;
  3. ``accept(n_accepted, emitted, target_step)`` after verification, where ``target_step`` is the
     verify forward over [last emitted token, d1..dk'] (rows 0..n are the positions whose tokens are
     now part of the context: row i read the token before d_{i+1}) and ``emitted`` ``[n+1]`` is
     d1..dn plus the target's token. After ``accept`` the context is prompt + all emitted tokens.
Modelled on transformers' ``CandidateGenerator`` (``get_candidates`` / ``update_candidate_strategy``).

The batched loop (``core/batch.py``) talks to a ``BatchProposer``, which drafts for every row of a batch at once:
``start(key, ...)`` when a sequence joins, ``propose(keys, ks)`` / ``accept(keys, ...)`` per step over the rows in
batch order, ``stop(key)`` when it leaves. ``PerSequence`` adapts any ``Proposer`` (one per row, drafting row by
row); drafters whose work batches (EAGLE-3 and MLP head steps, a draft model's forwards) implement their own.
"""

from __future__ import annotations

import abc
from dataclasses import dataclass
from typing import Callable, Sequence

import torch


@dataclass
class Sampling:
    """How a proposer draws its drafts: the request's settings (``core.sampling.logits_to_probs``); temperature 0
    drafts the argmax with q None. ``seed`` seeds the drafter's own generator (``drafters.base.draft_seed``)."""

    temperature: float = 0.0
    top_k: int | None = None
    top_p: float | None = None
    seed: int | None = None


@dataclass
class Proposal:
    """Drafted continuation.

    Attributes:
        tokens: ``[k']`` int64, k' <= the k asked for (0: nothing to propose; the target then decodes
            one token).
        q: ``[k', V]`` float draft probabilities over the TARGET vocabulary, the distributions the
            tokens were sampled from; ``None`` for deterministic proposers (verification then uses
            one-hot q). Greedy drafts (argmax) must also return ``None``: their q is one-hot.
    """

    tokens: torch.Tensor
    q: torch.Tensor | None = None

    @classmethod
    def empty(cls) -> "Proposal":
        """A proposal of zero tokens."""
        return cls(tokens=torch.empty(0, dtype=torch.long), q=None)


class Proposer(abc.ABC):
    """One sequence's drafter; stateful across ``start`` → (``propose`` → ``accept``)*.

    Attributes:
        needs_aux_hidden: True when ``target_step.aux_hidden`` must be filled (EAGLE-3); the runtime
            then refuses a target built without ``aux_layer_ids``.
        needs_final_hidden: True when ``target_step.final_hidden`` (the target's lm_head input) must be
            filled (MLP speculator); the runtime then asks every target forward for it.
    """

    needs_aux_hidden: bool = False
    needs_final_hidden: bool = False

    def start(self, prompt_ids: torch.Tensor, first_token: int, target_step) -> None:
        """Begin a sequence: context = ``prompt_ids`` ``[T]`` + ``first_token``; ``target_step`` is the
        prefill's ``TargetStep`` (rows 0..T-1). Default: nothing to do."""

    @abc.abstractmethod
    def propose(self, k: int) -> Proposal:
        """Draft up to ``k`` (>= 0) tokens continuing the current context."""

    @abc.abstractmethod
    def accept(self, n_accepted: int, emitted: torch.Tensor, target_step) -> None:
        """Learn the verification outcome: ``n_accepted`` drafts kept, ``emitted`` ``[n+1]`` appended to
        the context; ``target_step`` is the verify forward's ``TargetStep``."""


class BatchProposer(abc.ABC):
    """Drafts for the rows of a batch; rows are named by the caller's ``key`` (an int) and join and leave
    between steps. Lists passed to ``propose`` / ``accept`` are in batch order: entry b is row b of the step.

    Attributes:
        needs_aux_hidden, needs_final_hidden: as ``Proposer``'s.
    """

    needs_aux_hidden: bool = False
    needs_final_hidden: bool = False

    @property
    def name(self) -> str:
        """What error messages call this drafter (its class name)."""
        return type(self).__name__

    @abc.abstractmethod
    def start(self, key: int, prompt_ids: torch.Tensor, first_token: int, target_step, sampling: Sampling) -> None:
        """A sequence joins: context = ``prompt_ids`` ``[T]`` + ``first_token``; ``target_step`` is its prefill
        (``aux_hidden`` / ``final_hidden`` over the T prompt rows; ``logits`` over at least the last one);
        ``sampling``: how its drafts are drawn."""

    @abc.abstractmethod
    def propose(self, keys: Sequence[int], ks: Sequence[int]) -> list[Proposal]:
        """Draft up to ``ks[b]`` (>= 0) tokens for row ``keys[b]``; one ``Proposal`` per row."""

    @abc.abstractmethod
    def accept(self, keys: Sequence[int], n_accepted: Sequence[int], emitted: Sequence[torch.Tensor], step) -> None:
        """Verification outcome per row: ``n_accepted[b]`` drafts kept, ``emitted[b]`` ``[n+1]`` appended;
        ``step`` is the verify forward's ``BatchTargetStep`` (``step.row(b)``: row b's ``TargetStep``)."""

    def stop(self, key: int) -> None:
        """Row ``key`` left the batch (finished, stopped, cancelled): drop its state. Default: nothing."""


class PerSequence(BatchProposer):
    """A ``BatchProposer`` over one ``Proposer`` per row, made by ``factory(sampling)``: rows draft one by one
    (the batched verify forward is still one). For drafters whose work does not batch (n-gram lookup), and
    the reference every batched proposer must agree with.

    Args:
        factory: ``Sampling -> Proposer`` (``LoadedDrafter.new_proposer``).
        needs_aux_hidden, needs_final_hidden: what its proposers read (``Proposer`` attributes).
    """

    def __init__(
        self,
        factory: Callable[[Sampling], Proposer],
        *,
        needs_aux_hidden: bool = False,
        needs_final_hidden: bool = False,
    ):
        self.factory = factory
        self.needs_aux_hidden, self.needs_final_hidden = needs_aux_hidden, needs_final_hidden
        self.rows: dict[int, Proposer] = {}

    @classmethod
    def of(cls, proposer: Proposer) -> "PerSequence":
        """An adapter serving ONE given proposer (a batch of one sequence: ``core.generate``)."""
        return cls(
            lambda _sampling: proposer,
            needs_aux_hidden=proposer.needs_aux_hidden,
            needs_final_hidden=proposer.needs_final_hidden,
        )

    @property
    def name(self) -> str:
        """The per-sequence proposers' class name (``PerSequence`` before any row started)."""
        return type(next(iter(self.rows.values()))).__name__ if self.rows else type(self).__name__

    def start(self, key, prompt_ids, first_token, target_step, sampling) -> None:
        proposer = self.factory(sampling)
        proposer.start(prompt_ids, first_token, target_step)
        self.rows[key] = proposer

    def propose(self, keys, ks) -> list[Proposal]:
        return [self.rows[key].propose(k) for key, k in zip(keys, ks)]

    def accept(self, keys, n_accepted, emitted, step) -> None:
        for b, key in enumerate(keys):
            self.rows[key].accept(n_accepted[b], emitted[b], step.row(b))

    def stop(self, key) -> None:
        self.rows.pop(key, None)
