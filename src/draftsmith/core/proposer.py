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

from draftsmith.core.processors import SequenceProcessors
from draftsmith.core.sampling import logits_to_probs, sample


@dataclass
class Sampling:
    """How a proposer draws its drafts: the request's settings, so that q follows the target's p.

    Temperature 0 drafts the argmax (q None). Otherwise q = ``core.sampling.logits_to_probs(logits, temperature,
    top_k, top_p, min_p)`` of the draft logits after ``processors`` (min_tokens and penalties of the request, bound
    to its live context: ``core.processors``), and the draft is drawn from q. ``seed`` seeds the drafter's own
    generator (``drafters.base.draft_seed``). Every drafter draws through ``draw``.

    Attributes:
        temperature, top_k, top_p, min_p: as ``logits_to_probs`` (None / 0 disable top_k, top_p, min_p).
        seed: the drafter's generator seed (None: nondeterministic).
        processors: the request's ``SequenceProcessors`` (None: no context-dependent processing); set by the decode
            loop (``core.batch.BatchSequence``) when the request asks for some.
    """

    temperature: float = 0.0
    top_k: int | None = None
    top_p: float | None = None
    seed: int | None = None
    min_p: float = 0.0
    processors: SequenceProcessors | None = None

    @property
    def plain_greedy(self) -> bool:
        """True when a draft is the argmax of the raw logits (temperature 0, no processors): batched drafters may
        then take a whole batch's argmax at once."""
        return self.temperature == 0 and self.processors is None

    def draw(
        self,
        logits: torch.Tensor,
        generator: torch.Generator | None,
        drafted: Sequence[int] = (),
        ids: torch.Tensor | None = None,
        vocab_size: int | None = None,
    ) -> tuple[int, torch.Tensor | None]:
        """One draft from next-token logits ``[C]`` that follow the chain's ``drafted`` tokens (target ids, the
        drafts of this step so far).

        Args:
            logits: ``[C]`` draft logits. generator: the drafter's (on the logits' device). drafted: d_1..d_{i-1}
                when drawing d_i. ids, vocab_size: the target id of each column and the target vocabulary size,
                when the columns are a draft vocabulary (EAGLE-3 ``d2t``); see ``SequenceProcessors.apply``.

        Returns:
            ``(column, q)``: the drawn column (the argmax at temperature 0) and q ``[C]`` float32 (None at
            temperature 0).
        """
        if self.processors is not None:
            logits = self.processors.apply(logits, drafted, first=len(drafted), ids=ids, vocab_size=vocab_size)
        if self.temperature == 0:
            return int(logits.argmax()), None
        q = logits_to_probs(logits.float(), self.temperature, self.top_k, self.top_p, self.min_p)
        return int(sample(q, generator)), q


@dataclass
class Proposal:
    """Drafted continuation.

    Attributes:
        tokens: ``[k']`` int64, k' <= the k asked for (0: nothing to propose; the target then decodes
            one token).
        q: ``[k', V]`` float draft probabilities over the TARGET vocabulary, the distributions the
            tokens were sampled from; ``None`` for deterministic proposers (verification then uses
            one-hot q). Greedy drafts (argmax) must also return ``None``: their q is one-hot.
        parents: ``[N]`` int64 for a TREE proposal (``core.tree``): ``tokens`` are its N nodes and node i follows
            node ``parents[i]`` (-1: the last emitted token), topological (``parents[i] < i``); trees are
            deterministic (top-k children), so ``q`` is None. None: a chain (node i follows node i - 1).
    """

    tokens: torch.Tensor
    q: torch.Tensor | None = None
    parents: torch.Tensor | None = None

    @property
    def is_tree(self) -> bool:
        """True for a tree proposal (``parents`` given)."""
        return self.parents is not None

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
        free_catch_up: True when ``start`` and ``accept`` cost next to nothing (no forward: n-gram lookup), so
            the batched decoder brings every row up to date before each adaptive choice and the drafter's
            ``confidence`` is known for every row (``core.batch``); False: rows catch up lazily.
        has_confidence: True when ``confidence`` can return a value (the default returns None): the batched
            decoder then brings a row that drafted in its last step up to date before each adaptive choice, so
            that its confidence informs it; False: such a row's positions wait, as after a plain step.
    """

    needs_aux_hidden: bool = False
    needs_final_hidden: bool = False
    free_catch_up: bool = False
    has_confidence: bool = False

    def start(self, prompt_ids: torch.Tensor, first_token: int, target_step) -> None:
        """Begin a sequence: context = ``prompt_ids`` ``[T]`` + ``first_token``; ``target_step`` is the
        prefill's ``TargetStep`` (rows 0..T-1). Default: nothing to do."""

    @abc.abstractmethod
    def propose(self, k: int) -> Proposal:
        """Draft up to ``k`` (>= 0) tokens continuing the current context."""

    @abc.abstractmethod
    def accept(self, n_accepted: int, emitted: torch.Tensor, target_step) -> None:
        """Learn the verification outcome: ``n_accepted`` drafts kept, ``emitted`` ``[n+1]`` appended to
        the context; ``target_step`` is the verify forward's ``TargetStep``. After a tree proposal the decode
        loop passes the rows of the accepted path only (root, then its n nodes), so ``accept`` reads the same
        layout after a chain and after a tree."""

    def confidence(self) -> float | None:
        """The drafter's confidence in its next draft, in [0, 1], known before drafting: a head's probability of
        its top token, an n-gram's match length. Adaptive speculation calibrates it per bin (``core.adaptive``),
        so any score that orders drafts by their chance works; None (the default) when it has none without
        drafting."""
        return None

    def propose_tree(self, shape, max_depth: int) -> Proposal:
        """Draft a tree (a ``Proposal`` with ``parents``) within ``shape`` (``core.tree.TreeShape``), at most
        ``max_depth`` deep (``max_depth`` 0: an empty proposal).

        Raises:
            ValueError: this drafter drafts chains only (the default)."""
        raise ValueError(f"{type(self).__name__} drafts chains only; serve it without a tree")


class BatchProposer(abc.ABC):
    """Drafts for the rows of a batch; rows are named by the caller's ``key`` (an int) and join and leave
    between steps. Lists passed to ``propose`` / ``accept`` are in batch order: entry b is row b of the step.

    Attributes:
        needs_aux_hidden, needs_final_hidden, free_catch_up, has_confidence: as ``Proposer``'s.
    """

    needs_aux_hidden: bool = False
    needs_final_hidden: bool = False
    free_catch_up: bool = False
    has_confidence: bool = False

    @property
    def name(self) -> str:
        """What error messages call this drafter (its class name)."""
        return type(self).__name__

    @abc.abstractmethod
    def start(self, key: int, prompt_ids: torch.Tensor, first_token: int, target_step, sampling: Sampling) -> None:
        """A sequence joins: context = ``prompt_ids`` ``[T]`` + ``first_token``; ``target_step`` holds the target's
        states over the T context rows (``aux_hidden`` / ``final_hidden``; ``logits`` may be None: no drafter reads
        them); ``sampling``: how its drafts are drawn. ``core.batch`` starts a row at its first draft, so the
        context may already hold tokens the target emitted: a start must depend on the context only (a start over
        prompt + emitted equals a start over the prompt followed by the accepts of those tokens)."""

    @abc.abstractmethod
    def propose(self, keys: Sequence[int], ks: Sequence[int]) -> list[Proposal]:
        """Draft up to ``ks[b]`` (>= 0) tokens for row ``keys[b]``; one ``Proposal`` per row."""

    @abc.abstractmethod
    def accept(self, keys: Sequence[int], n_accepted: Sequence[int], emitted: Sequence[torch.Tensor], step) -> None:
        """Verification outcome per row: ``n_accepted[b]`` drafts kept, ``emitted[b]`` ``[n+1]`` appended;
        ``step`` is the verify forward's ``BatchTargetStep`` (``step.row(b)``: row b's ``TargetStep``)."""

    def confidence(self, keys: Sequence[int]) -> list[float | None]:
        """Per row, the drafter's probability of its next draft, known before drafting (``Proposer.confidence``);
        default: None for every row."""
        return [None] * len(keys)

    def propose_tree(self, keys: Sequence[int], shape, max_depths: Sequence[int]) -> list[Proposal]:
        """A tree per row within ``shape`` (``core.tree.TreeShape``), row b at most ``max_depths[b]`` deep
        (``Proposer.propose_tree``); ``accept`` then gets each row's accepted path (``Proposer.accept``).

        Raises:
            ValueError: this drafter drafts chains only (the default)."""
        raise ValueError(f"{self.name} drafts chains only; serve it without a tree")

    def stop(self, key: int) -> None:
        """Row ``key`` left the batch (finished, stopped, cancelled): drop its state. Default: nothing."""


class PerSequence(BatchProposer):
    """A ``BatchProposer`` over one ``Proposer`` per row, made by ``factory(sampling)``: rows draft one by one
    (the batched verify forward is still one). For drafters whose work does not batch (n-gram lookup), and
    the reference every batched proposer must agree with.

    Args:
        factory: ``Sampling -> Proposer`` (``LoadedDrafter.new_proposer``).
        needs_aux_hidden, needs_final_hidden, free_catch_up, has_confidence: as its proposers' (``Proposer``
            attributes).
    """

    def __init__(
        self,
        factory: Callable[[Sampling], Proposer],
        *,
        needs_aux_hidden: bool = False,
        needs_final_hidden: bool = False,
        free_catch_up: bool = False,
        has_confidence: bool = False,
    ):
        self.factory = factory
        self.needs_aux_hidden, self.needs_final_hidden = needs_aux_hidden, needs_final_hidden
        self.free_catch_up, self.has_confidence = free_catch_up, has_confidence
        self.rows: dict[int, Proposer] = {}

    @classmethod
    def of(cls, proposer: Proposer) -> "PerSequence":
        """An adapter serving ONE given proposer (a batch of one sequence: ``core.generate``)."""
        return cls(lambda _sampling: proposer, **_reads(proposer))

    @classmethod
    def over(cls, factory: Callable[[Sampling], Proposer]) -> "PerSequence":
        """An adapter making one ``factory(sampling)`` proposer per row; what they read (aux / final hidden
        states) and ``free_catch_up`` are taken from one proposer made with the default ``Sampling``."""
        return cls(factory, **_reads(factory(Sampling())))

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

    def confidence(self, keys) -> list[float | None]:
        return [self.rows[key].confidence() for key in keys]

    def propose_tree(self, keys, shape, max_depths) -> list[Proposal]:
        return [self.rows[key].propose_tree(shape, d) for key, d in zip(keys, max_depths)]

    def accept(self, keys, n_accepted, emitted, step) -> None:
        for b, key in enumerate(keys):
            self.rows[key].accept(n_accepted[b], emitted[b], step.row(b))

    def stop(self, key) -> None:
        self.rows.pop(key, None)


def _reads(proposer: Proposer) -> dict:
    """A proposer's ``PerSequence`` flags (what it reads, whether its catch-up is free, whether it has a
    confidence)."""
    return {
        "needs_aux_hidden": proposer.needs_aux_hidden,
        "needs_final_hidden": proposer.needs_final_hidden,
        "free_catch_up": proposer.free_catch_up,
        "has_confidence": proposer.has_confidence,
    }
