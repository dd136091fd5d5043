"""Logits processors that read a sequence's context: min_tokens and the repetition / frequency / presence penalties.

    penalties = Penalties(repetition_penalty=1.2, min_tokens=4, min_tokens_ids=(eos,))
    procs = SequenceProcessors(penalties, prompt_ids, output)    # ``output``: the live list of emitted tokens
    logits = procs.apply(logits, drafted=d)                      # [R, V]: row r read prompt + output + d[:r]

vLLM's semantics and order (``vllm/v1/sample/sampler.py``, ``Sampler.apply_logits_processors`` then ``sample``):

  1. min_tokens (``vllm/v1/sample/logits_processor/builtin.py``, ``MinTokensLogitsProcessor``): while fewer than
     ``min_tokens`` tokens have been generated, every stop id (``SamplingParams.all_stop_token_ids``: EOS, even
     with ignore_eos, and stop_token_ids) gets logit -inf;
  2. penalties (``vllm/model_executor/layers/utils.py``, ``apply_penalties``; ``_custom_ops.
     apply_repetition_penalties_torch``): a token seen in the prompt or the output has its logit divided by
     ``repetition_penalty`` when positive, multiplied when not; then ``logit -= frequency_penalty * count`` and
     ``logit -= presence_penalty * [count > 0]``, counts over the OUTPUT only (OpenAI's definition);
  3. greedy takes the argmax of these logits; sampling applies temperature, min_p, top-k, top-p
     (``core.sampling.logits_to_probs``).

Speculative decoding: verify row r of a step that read [t, d1..dk] judges the token after d_r, so its context is
prompt + output + d_1..d_r, and the number of tokens generated before it is len(output) + r. vLLM does the same
(``Sampler._combine_outputs_with_spec_tokens``). Drafters apply the same processors to their own logits (through
``core.proposer.Sampling``) with the drafts of the chain so far, so q follows p; the verification stays exact
whatever q is, since rejection sampling only needs the drafts drawn from the q it is given.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Sequence

import torch


@dataclass(frozen=True)
class Penalties:
    """The context-dependent processing of one request (vLLM ``SamplingParams`` fields of the same names).

    Attributes:
        repetition_penalty: > 0; 1 disables. frequency_penalty, presence_penalty: finite; 0 disables.
        min_tokens: >= 0; generation cannot stop on a token id before this many tokens.
        min_tokens_ids: the ids masked while fewer than ``min_tokens`` were generated (EOS and stop ids).

    Raises:
        ValueError: a repetition_penalty <= 0 or not finite, a non-finite frequency / presence penalty, or a
            negative min_tokens.
    """

    repetition_penalty: float = 1.0
    frequency_penalty: float = 0.0
    presence_penalty: float = 0.0
    min_tokens: int = 0
    min_tokens_ids: tuple[int, ...] = ()

    def __post_init__(self):
        if not math.isfinite(self.repetition_penalty) or self.repetition_penalty <= 0:
            raise ValueError(f"repetition_penalty must be a finite number > 0, got {self.repetition_penalty}")
        for name in ("frequency_penalty", "presence_penalty"):
            if not math.isfinite(getattr(self, name)):
                raise ValueError(f"{name} must be finite, got {getattr(self, name)}")
        if self.min_tokens < 0:
            raise ValueError(f"min_tokens must be >= 0, got {self.min_tokens}")

    @property
    def penalizes(self) -> bool:
        """True when some penalty changes logits (they then depend on the context tokens)."""
        return self.repetition_penalty != 1.0 or self.frequency_penalty != 0.0 or self.presence_penalty != 0.0

    @property
    def active(self) -> bool:
        """True when this processing can change any logit."""
        return self.penalizes or (self.min_tokens > 0 and bool(self.min_tokens_ids))


class SequenceProcessors:
    """``Penalties`` bound to one sequence's context: its prompt and the live list of its emitted tokens.

    ``output`` is read at each call (the decode loop appends to it), so the same object serves the decode loop's
    p and a drafter's q. Prompt masks and output counts are kept per (device, vocabulary size) and brought up to
    date with the tokens emitted since the last call.

    Args:
        penalties: what to apply. prompt: the prompt's token ids. output: the emitted tokens (a list that only
            grows while the sequence runs).
    """

    def __init__(self, penalties: Penalties, prompt: Sequence[int], output: list[int]):
        self.penalties = penalties
        self.prompt = prompt.tolist() if isinstance(prompt, torch.Tensor) else [int(t) for t in prompt]
        self.output = output
        self._counts: dict[tuple[str, int], list] = {}  # (device, V) -> [prompt_mask [V], counts [V], n counted]

    def counts(self, vocab_size: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        """``(prompt_mask [V] bool, output_counts [V] float32)`` over the vocabulary on ``device``."""
        key = (str(device), vocab_size)
        entry = self._counts.get(key)
        if entry is None:
            prompt = torch.tensor(self.prompt, dtype=torch.long, device=device)
            mask = torch.zeros(vocab_size, dtype=torch.bool, device=device)
            mask[prompt[prompt < vocab_size]] = True
            entry = self._counts[key] = [mask, torch.zeros(vocab_size, dtype=torch.float32, device=device), 0]
        if entry[2] < len(self.output):
            new = torch.tensor(self.output[entry[2] :], dtype=torch.long, device=device)
            new = new[new < vocab_size]
            entry[1].index_add_(0, new, torch.ones(new.numel(), dtype=torch.float32, device=device))
            entry[2] = len(self.output)
        return entry[0], entry[1]

    def apply(
        self,
        logits: torch.Tensor,
        drafted: Sequence[int] = (),
        first: int = 0,
        ids: torch.Tensor | None = None,
        vocab_size: int | None = None,
    ) -> torch.Tensor:
        """Processed logits (a float32 copy), row r read after prompt + output + ``drafted[:first + r]``.

        Args:
            logits: ``[R, C]`` or ``[C]`` (one row). drafted: draft tokens after the output (target ids); needs
                ``len(drafted) >= first + R - 1``. first: how many of them row 0 already follows (a drafter's
                draft i is drawn after its drafts 1..i-1: ``first = i - 1``, one row; a verify step: 0).
            ids: ``[C]`` the target id of each column (an EAGLE-3 head's draft vocabulary, ``d2t``); None: column
                c is token c. vocab_size: the target vocabulary size when ``ids`` is given (default C).

        Returns:
            ``[R, C]`` (or ``[C]``) float32.

        Raises:
            ValueError: fewer drafted tokens than the rows need.
        """
        one = logits.dim() == 1
        out = logits.float().clone()
        if one:
            out = out[None]
        rows, cols = out.shape
        if len(drafted) < first + rows - 1:
            raise ValueError(
                f"{rows} rows after {first} drafts need {first + rows - 1} drafted tokens, got {len(drafted)}"
            )
        p, device = self.penalties, out.device
        generated = len(self.output) + first
        if p.min_tokens > generated and p.min_tokens_ids:
            masked = torch.arange(rows, device=device) + generated < p.min_tokens  # [R]
            stop = torch.tensor(p.min_tokens_ids, dtype=torch.long, device=device)
            if ids is None:
                column = torch.zeros(cols, dtype=torch.bool, device=device)
                column[stop[stop < cols]] = True
            else:
                column = torch.isin(ids.to(device), stop)
            out = out.masked_fill(masked[:, None] & column[None], float("-inf"))
        if p.penalizes:
            vocab = vocab_size if ids is not None and vocab_size is not None else cols
            prompt_mask, counts = self.counts(vocab, device)
            counts = counts[None].expand(rows, vocab).clone()  # [R, V]
            extra = torch.tensor([int(t) for t in drafted[: first + rows - 1]], dtype=torch.long, device=device)
            if first:
                counts += torch.bincount(extra[:first], minlength=vocab)[:vocab].float()
            if rows > 1:
                step = torch.nn.functional.one_hot(extra[first:], vocab).float()  # [R-1, V]
                counts[1:] += step.cumsum(0)
            if ids is not None:
                ids = ids.to(device)
                counts, prompt_mask = counts[:, ids], prompt_mask[ids]
            seen = counts > 0
            if p.repetition_penalty != 1.0:
                penalty = torch.where(seen | prompt_mask[None], p.repetition_penalty, 1.0)
                out = torch.where(out > 0, out / penalty, out * penalty)
            if p.frequency_penalty:
                out = out - p.frequency_penalty * counts
            if p.presence_penalty:
                out = out - p.presence_penalty * seen.float()
        return out[0] if one else out
