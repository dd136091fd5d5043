"""N-gram prompt-lookup drafting (Saxena 2023, "prompt lookup decoding"), with vLLM's ``ngram`` semantics.

Given the context (prompt + emitted tokens), take its suffix n-gram for n = prompt_lookup_max down to
prompt_lookup_min; for the longest n that also occurs earlier in the context, propose the (up to) k
tokens that followed its EARLIEST earlier occurrence. Fewer than k tokens are proposed when the match
is near the end, none when no n-gram of length >= prompt_lookup_min repeats.
Semantics read from vLLM ``vllm/v1/spec_decode/ngram_proposer.py``
(``_find_longest_matched_ngram_and_propose_tokens``: longest match wins, ties go to the earliest
position; the earlier occurrence may overlap the suffix). vLLM's defaults are min = max = 5 when
neither is set; ours are min 1, max 5.
"""

from __future__ import annotations

import torch

from draftsmith.core.proposer import Proposal, Proposer


def find_ngram_continuation(context: torch.Tensor, k: int, min_n: int, max_n: int) -> torch.Tensor:
    """Tokens following the earliest earlier occurrence of the longest repeated suffix n-gram.

    Args:
        context: ``[L]`` int64 token ids. k: most tokens to return. min_n <= max_n: n-gram lengths.

    Returns:
        ``[k']`` int64 with 0 <= k' <= k (empty when nothing matches or k == 0).
    """
    length = context.numel()
    for n in range(min(max_n, length - 1), min_n - 1, -1):
        if k <= 0 or n <= 0:
            break
        suffix = context[length - n :]
        windows = context[: length - 1].unfold(0, n, 1)  # [L-n, n]: every n-gram ending before L-1
        hits = (windows == suffix).all(dim=1).nonzero()
        if hits.numel():
            start = int(hits[0]) + n  # earliest occurrence
            return context[start : start + k].clone()
    return context.new_empty(0)


class NgramIndex:
    """The earliest start of every n-gram (n in [min_n, max_n]) of a growing token list, kept as tokens arrive.

    ``append`` costs O(max_n - min_n + 1) dictionary updates per token and ``continuation`` O(max_n) look-ups,
    so a sequence of L tokens costs O(L) in all, where rescanning the context at every step (unfolding each
    n-gram length, :func:`find_ngram_continuation`) costs O(L) per step. Both give the same drafts (a test
    checks it)."""

    def __init__(self, min_n: int, max_n: int):
        self.min_n, self.max_n = min_n, max_n
        self.tokens: list[int] = []
        self.first: dict[tuple[int, ...], int] = {}  # n-gram -> its earliest start

    def append(self, tokens) -> None:
        """Add ``tokens`` (ints) at the end, registering every n-gram they complete."""
        for t in tokens:
            self.tokens.append(int(t))
            end = len(self.tokens)
            for n in range(self.min_n, min(self.max_n, end) + 1):
                self.first.setdefault(tuple(self.tokens[end - n :]), end - n)

    def match(self) -> tuple[int, int]:
        """(n, start of the continuation) for the longest repeated suffix n-gram; (0, -1) when none repeats."""
        length = len(self.tokens)
        for n in range(min(self.max_n, length - 1), self.min_n - 1, -1):
            if n <= 0:
                break
            start = self.first.get(tuple(self.tokens[length - n :]))
            if start is not None and start < length - n:  # an occurrence other than the suffix itself
                return n, start + n
        return 0, -1

    def continuation(self, k: int) -> list[int]:
        """Up to ``k`` tokens after the earliest earlier occurrence of the longest repeated suffix n-gram."""
        n, start = self.match() if k > 0 else (0, -1)
        return self.tokens[start : start + k] if n else []


class NgramProposer(Proposer):
    """Prompt-lookup proposer; deterministic, so ``Proposal.q`` is ``None`` (one-hot). The context is indexed
    incrementally (:class:`NgramIndex`): linear in the sequence's length.

    Its ``confidence`` is the length of the suffix match its next draft would follow, over
    ``prompt_lookup_max`` (0 when nothing matches: it would draft nothing): a longer repeated suffix is likelier
    to go on repeating. Adaptive speculation calibrates it per bin (``core.adaptive``) and needs no probability.
    Its accepts and start are dictionary updates (``free_catch_up``), so the batched decoder keeps every row
    current and the score is known at each step's choice.

    Args:
        prompt_lookup_min: shortest suffix n-gram to match (>= 1).
        prompt_lookup_max: longest suffix n-gram to match (>= prompt_lookup_min).

    Raises:
        ValueError: invalid n-gram bounds.
    """

    def __init__(self, prompt_lookup_min: int = 1, prompt_lookup_max: int = 5):
        if not 1 <= prompt_lookup_min <= prompt_lookup_max:
            raise ValueError(
                f"need 1 <= prompt_lookup_min ({prompt_lookup_min}) <= prompt_lookup_max ({prompt_lookup_max})"
            )
        self.prompt_lookup_min = prompt_lookup_min
        self.prompt_lookup_max = prompt_lookup_max
        self.index = NgramIndex(prompt_lookup_min, prompt_lookup_max)

    def start(self, prompt_ids: torch.Tensor, first_token: int, target_step=None) -> None:
        """Context = prompt ``[T]`` + first token."""
        self.index = NgramIndex(self.prompt_lookup_min, self.prompt_lookup_max)
        self.index.append(prompt_ids.tolist() + [int(first_token)])

    free_catch_up = True
    has_confidence = True

    def confidence(self) -> float:
        """The suffix match's length over ``prompt_lookup_max`` in [0, 1] (class docstring)."""
        return self.index.match()[0] / self.prompt_lookup_max

    def propose(self, k: int) -> Proposal:
        """Up to ``k`` tokens found by prompt lookup; q is None."""
        return Proposal(tokens=torch.tensor(self.index.continuation(k), dtype=torch.long), q=None)

    def accept(self, n_accepted: int, emitted: torch.Tensor, target_step=None) -> None:
        """Append the emitted tokens ``[n+1]`` to the context."""
        self.index.append(emitted.tolist())
