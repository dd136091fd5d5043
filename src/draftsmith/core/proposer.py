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
"""

from __future__ import annotations

import abc
from dataclasses import dataclass

import torch


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
