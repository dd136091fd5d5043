"""One sequence's decoding: its settings, the stop rules its emitted tokens pass, its counters and result.

Shared by the decode loop (``core/batch.py``, one loop for one sequence or many) and its one-sequence entry
points (``core/generate.py``).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, Literal, Sequence

import torch

from draftsmith.core.processors import Penalties, SequenceProcessors
from draftsmith.core.proposer import Proposal, Sampling
from draftsmith.core.sampling import logits_to_probs, sample
from draftsmith.core.target import TargetModel
from draftsmith.core.tree import check_parents


@dataclass
class GenerationConfig:
    """How to decode one sequence (vLLM ``SamplingParams`` names and semantics, ``vllm/sampling_params.py``).

    Attributes:
        max_new_tokens: most tokens to emit (>= 0).
        temperature: 0 → greedy (argmax); > 0 → sampling from ``logits_to_probs``.
        top_k, top_p: truncation for sampling (None disables), as ``sampling.logits_to_probs``.
        min_p: in [0, 1]; drops tokens below min_p x the likeliest one's probability when sampling (0 disables).
        repetition_penalty, frequency_penalty, presence_penalty: as vLLM's (``core.processors.Penalties``);
            they apply to greedy decoding too (vLLM penalises before the argmax).
        min_tokens: no stop id (EOS included, even with ``ignore_eos``) can be generated before this many tokens:
            their logits are -inf until then (``core.processors``); <= max_new_tokens.
        ignore_eos: EOS ids do not end generation (stop_token_ids still do), as vLLM's ``ignore_eos``.
        seed: seeds the target's sampling generator; ``None`` → nondeterministic.
        eos_token_ids: ids that end generation (finish_reason 'stop'); the stop token IS included
            in the output tokens, as transformers' ``generate`` and vLLM's token ids do.
        stop_token_ids: further ids that end generation, same handling as EOS.

    Raises:
        ValueError: a negative max_new_tokens or temperature, min_p outside [0, 1], min_tokens outside
            [0, max_new_tokens], or a penalty ``core.processors.Penalties`` refuses.
    """

    max_new_tokens: int = 128
    temperature: float = 0.0
    top_k: int | None = None
    top_p: float | None = None
    seed: int | None = 0
    eos_token_ids: Sequence[int] = ()
    stop_token_ids: Sequence[int] = ()
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    frequency_penalty: float = 0.0
    presence_penalty: float = 0.0
    min_tokens: int = 0
    ignore_eos: bool = False

    def __post_init__(self):
        if self.max_new_tokens < 0:
            raise ValueError(f"max_new_tokens must be >= 0, got {self.max_new_tokens}")
        if self.temperature < 0:
            raise ValueError(f"temperature must be >= 0, got {self.temperature}")
        if not 0.0 <= self.min_p <= 1.0:
            raise ValueError(f"min_p must be in [0, 1], got {self.min_p}")
        if not 0 <= self.min_tokens <= self.max_new_tokens:
            raise ValueError(f"min_tokens must be in [0, max_new_tokens={self.max_new_tokens}], got {self.min_tokens}")
        self.penalties()  # refuses bad penalties now

    @property
    def greedy(self) -> bool:
        """True when decoding takes the argmax (temperature 0)."""
        return self.temperature == 0

    def probs(self, logits: torch.Tensor) -> torch.Tensor:
        """Target probabilities p ``[..., V]`` from (processed) logits ``[..., V]`` (sampling mode only)."""
        return logits_to_probs(logits, self.temperature, self.top_k, self.top_p, self.min_p)

    def stop_ids(self) -> frozenset[int]:
        """The ids that end generation: stop token ids, and EOS unless ``ignore_eos``."""
        eos = () if self.ignore_eos else self.eos_token_ids
        return frozenset(int(t) for t in (*eos, *self.stop_token_ids))

    def penalties(self) -> Penalties:
        """The context-dependent processing (``core.processors``); min_tokens masks EOS and stop ids alike."""
        masked = tuple(sorted({int(t) for t in (*self.eos_token_ids, *self.stop_token_ids)}))
        return Penalties(
            self.repetition_penalty, self.frequency_penalty, self.presence_penalty, self.min_tokens, masked
        )

    def processors(self, prompt: Sequence[int], output: list[int]) -> SequenceProcessors | None:
        """The processors bound to a sequence's prompt and live output list; None when nothing applies."""
        penalties = self.penalties()
        return SequenceProcessors(penalties, prompt, output) if penalties.active else None

    def draft_sampling(self, seed: int | None) -> Sampling:
        """How a drafter draws for this request (``core.proposer.Sampling``), its generator seeded ``seed``; the
        decode loop binds the request's processors to it (``core.batch.BatchSequence``)."""
        return Sampling(self.temperature, self.top_k, self.top_p, seed, self.min_p)


@dataclass
class SpecStats:
    """Speculation counters (the names of vLLM's ``spec_decode`` metrics; DESIGN.md §7).

    A draft is a verify step whose proposal had >= 1 token; steps proposing 0 tokens are not
    counted. Counts are verification outcomes, before any stop trimmed the emitted chunk.

    Attributes:
        num_drafts: verify steps with a non-empty proposal.
        num_draft_tokens: drafted tokens proposed, summed.
        num_accepted_tokens: drafted tokens accepted, summed.
        accepted_per_pos: ``[k]``; entry i counts drafts whose token i (0-based) was accepted (a tree: drafts
            whose accepted path reached depth i + 1).
        accepted_paths: trees only: rank path (``core.tree.path_ranks``) -> drafts whose accepted path went
            through it, every prefix of each accepted path counted (``core.tree.best_static_tree`` reads it).
        chosen_k: adaptive speculation only (``core.adaptive``): k chosen -> verify steps that chose it (0: a plain
            step), before max_new_tokens capped it.
    """

    k: int
    num_drafts: int = 0
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    accepted_per_pos: list[int] = field(default_factory=list)
    accepted_paths: dict[tuple[int, ...], int] = field(default_factory=dict)
    chosen_k: dict[int, int] = field(default_factory=dict)

    def __post_init__(self):
        if not self.accepted_per_pos:
            self.accepted_per_pos = [0] * self.k

    def record(self, num_proposed: int, num_accepted: int) -> None:
        """Count one verify step that checked ``num_proposed`` drafts and accepted ``num_accepted``."""
        if num_proposed == 0:
            return
        self.num_drafts += 1
        self.num_draft_tokens += num_proposed
        self.num_accepted_tokens += num_accepted
        for i in range(num_accepted):
            self.accepted_per_pos[i] += 1

    def record_choice(self, k: int) -> None:
        """Count one verify step whose k was chosen live (``core.adaptive``)."""
        self.chosen_k[k] = self.chosen_k.get(k, 0) + 1

    @property
    def mean_chosen_k(self) -> float | None:
        """Mean k chosen per step (None without adaptive speculation)."""
        steps = sum(self.chosen_k.values())
        return sum(k * n for k, n in self.chosen_k.items()) / steps if steps else None

    def record_tree(self, num_nodes: int, ranks: tuple[int, ...]) -> None:
        """Count one tree verify step over ``num_nodes`` nodes whose accepted path has sibling ranks ``ranks``
        (``core.tree.path_ranks``; its length is the accepted tokens)."""
        if num_nodes == 0:
            return
        self.record(num_nodes, len(ranks))
        for d in range(1, len(ranks) + 1):
            self.accepted_paths[ranks[:d]] = self.accepted_paths.get(ranks[:d], 0) + 1

    def merge(self, other: "SpecStats") -> "SpecStats":
        """Sum of two runs' counters (per-position lists padded to the longer k)."""
        k = max(self.k, other.k)
        pad = lambda xs: list(xs) + [0] * (k - len(xs))  # noqa: E731
        return SpecStats(
            k=k,
            num_drafts=self.num_drafts + other.num_drafts,
            num_draft_tokens=self.num_draft_tokens + other.num_draft_tokens,
            num_accepted_tokens=self.num_accepted_tokens + other.num_accepted_tokens,
            accepted_per_pos=[a + b for a, b in zip(pad(self.accepted_per_pos), pad(other.accepted_per_pos))],
            accepted_paths={
                path: self.accepted_paths.get(path, 0) + other.accepted_paths.get(path, 0)
                for path in {**self.accepted_paths, **other.accepted_paths}
            },
            chosen_k={
                k: self.chosen_k.get(k, 0) + other.chosen_k.get(k, 0) for k in sorted({*self.chosen_k, *other.chosen_k})
            },
        )

    @property
    def acceptance_rate(self) -> float:
        """accepted / drafted tokens; 0.0 when nothing was drafted."""
        return self.num_accepted_tokens / self.num_draft_tokens if self.num_draft_tokens else 0.0

    @property
    def acceptance_length(self) -> float:
        """τ = 1 + accepted / drafts: tokens emitted per drafted verify step; 1.0 when no drafts."""
        return 1.0 + self.num_accepted_tokens / self.num_drafts if self.num_drafts else 1.0


@dataclass
class GenerationResult:
    """Output of one sequence.

    Attributes:
        tokens: emitted token ids (the prompt excluded), stop token included when one ended the run.
        finish_reason: 'stop' (EOS / stop id) or 'length' (max_new_tokens reached).
        stats: speculation counters (``None`` for ``generate_plain``).
        num_target_forwards: target forward passes, prefill included.
    """

    tokens: list[int]
    finish_reason: Literal["stop", "length"]
    stats: SpecStats | None
    num_target_forwards: int


def as_prompt(prompt_ids) -> torch.Tensor:
    """One sequence's prompt as ``[T]`` int64 on the CPU, from ``[T]``, ``[1, T]`` or a list.

    Raises:
        ValueError: an empty prompt, or a batch of several."""
    prompt = torch.as_tensor(prompt_ids, dtype=torch.long).cpu()
    if prompt.dim() == 2 and prompt.shape[0] == 1:
        prompt = prompt[0]
    if prompt.dim() != 1 or prompt.numel() == 0:
        raise ValueError(f"prompt_ids must be a non-empty 1-D sequence [T] (one sequence), got {tuple(prompt.shape)}")
    return prompt


def check_length(target: TargetModel, prompt: torch.Tensor, cfg: GenerationConfig) -> None:
    """Refuse a prompt + max_new_tokens longer than the target's declared position limit (what the engine's
    max_model_len is bounded by), before any forward: past it a learned position table raises IndexError."""
    if target.position_limit is None:
        return
    key, limit = target.position_limit
    n = prompt.numel()
    if n + cfg.max_new_tokens > limit:
        raise ValueError(
            f"prompt ({n} tokens) + max_new_tokens ({cfg.max_new_tokens}) = {n + cfg.max_new_tokens} "
            f"exceeds the target's {key} ({limit}); shorten the prompt or set max_new_tokens <= "
            f"{max(limit - n, 0)}"
        )


def next_token(
    logits: torch.Tensor,
    cfg: GenerationConfig,
    generator: torch.Generator,
    processors: SequenceProcessors | None = None,
) -> int:
    """One token from next-token logits ``[V]`` (after ``processors``, read after the output so far): argmax
    (greedy) or a draw from p."""
    if processors is not None:
        logits = processors.apply(logits)
    return int(logits.argmax()) if cfg.greedy else int(sample(cfg.probs(logits), generator))


class Emitted:
    """A sequence's emitted tokens with the stop rules applied token by token (never overshoots).

    A stop id (``cfg.stop_ids()``) ends generation only from token ``min_tokens + 1`` on (before, the processors
    mask stop ids, so none is drawn; vLLM ``vllm/v1/core/sched/utils.py``, ``check_stop``). ``stop_reason`` is the
    stop token id that ended generation when it is not an EOS id (vLLM's ``stop_reason``: None for EOS and length).
    ``on_tokens`` (optional) is called with each appended chunk, after the stop rules trimmed it.

    Attributes:
        tokens: the emitted tokens (one list for the sequence's life: its processors read it).
        finish_reason: 'stop' / 'length' once finished. stop_reason: as above.
    """

    def __init__(self, cfg: GenerationConfig, on_tokens: Callable[[list[int]], None] | None = None):
        self.on_tokens = on_tokens
        self.tokens: list[int] = []
        self.max_new_tokens = cfg.max_new_tokens
        self.min_tokens = cfg.min_tokens
        self.stop_ids = cfg.stop_ids()
        self.eos_ids = frozenset() if cfg.ignore_eos else frozenset(int(t) for t in cfg.eos_token_ids)
        self.finish_reason: Literal["stop", "length"] | None = None if cfg.max_new_tokens > 0 else "length"
        self.stop_reason: int | None = None

    def extend(self, tokens: Sequence[int]) -> bool:
        """Append tokens until a stop id or max_new_tokens; return True when generation is finished."""
        start = len(self.tokens)
        for token in tokens:
            token = int(token)
            self.tokens.append(token)
            if token in self.stop_ids and len(self.tokens) > self.min_tokens:
                self.finish_reason = "stop"
                self.stop_reason = None if token in self.eos_ids else token
            elif len(self.tokens) >= self.max_new_tokens:
                self.finish_reason = "length"
            if self.finish_reason:
                break
        if self.on_tokens is not None and len(self.tokens) > start:
            self.on_tokens(self.tokens[start:])
        return self.finish_reason is not None


def check_proposal(proposal: Proposal, requested: int, vocab_size: int, proposer) -> Proposal:
    """Validate a proposer's output against the contract in ``core/proposer.py``."""
    name = getattr(proposer, "name", None) or type(proposer).__name__  # a BatchProposer names its drafter
    tokens = proposal.tokens
    if tokens.dim() != 1 or tokens.dtype != torch.long or tokens.numel() > requested:
        raise ValueError(
            f"{name}.propose({requested}) must return tokens as int64 [k' <= {requested}], "
            f"got {tokens.dtype} {tuple(tokens.shape)}"
        )
    if proposal.parents is not None:
        try:
            check_parents(proposal.parents, tokens.numel())
        except ValueError as e:
            raise ValueError(f"{name}.propose_tree returned a bad tree: {e}") from None
        if proposal.q is not None:
            raise ValueError(f"{name}.propose_tree returned q: tree drafts are deterministic (top-k), q must be None")
    if proposal.q is not None and tuple(proposal.q.shape) != (tokens.numel(), vocab_size):
        raise ValueError(
            f"{name}.propose returned q of shape {tuple(proposal.q.shape)}, expected "
            f"[{tokens.numel()}, {vocab_size}] (draft probs over the target vocabulary)"
        )
    return proposal


@dataclass
class VerifyStep:
    """One verify step of ``generate_speculative`` as an observer (``on_step``) sees it.

    Attributes:
        proposed: drafts verified (k' <= k; 0 when the proposer had nothing: the step decoded one token).
        accepted: n, drafts accepted.
        emitted: d1..dn and the target's token, before the stop rules trimmed them (vLLM counts outcomes so).
        draft_s: seconds inside the proposer for this step (propose and the accept of earlier steps' positions,
            ``core.batch``; the first step also start).
        verify_s: seconds of the target forward and verification.
        k: the k adaptive speculation chose for this step (``core.adaptive``; 0: a plain step), None otherwise.
    """

    proposed: int
    accepted: int
    emitted: list[int]
    draft_s: float
    verify_s: float
    k: int | None = None
