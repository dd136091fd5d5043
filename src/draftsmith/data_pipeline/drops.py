"""Conversations the data pipeline leaves out: each with a reason, counted, logged, and bounded.

Nothing is left out silently. A stage that leaves a record or a conversation out records a
``SkippedRecord`` (its index, a sentence, a reason code from ``REASONS``); the stage's manifest counts
them by reason (``dropped``, with a few examples) and a warning names the counts and what to change:

  reason                                   stage                       what keeps such conversations
  malformed_record                         dataset.read_conversations  fix the records (on_error=skip)
  template_refused                         dataset.render_dataset      fix the data or the template
  empty_regenerated_answer                 regenerate.regenerate       check the target's generation
  unfinished_regenerated_answer            regenerate (drop_unfinished) raise data.max_new_tokens
  no_supervised_tokens                     render_dataset, shards      answers that are not empty/reasoning only
  no_supervised_tokens_after_truncation    render_dataset, shards      raise data.max_length

A conversation trains when some token after the first is supervised (row t of every drafter's loss
predicts token t+1, so token 0 is predicted by no row) and lies within ``max_length``; see
:func:`supervision_drop`. ``prepare`` stops with :class:`DroppedConversationsError` when more than
``data.max_dropped_fraction`` of the conversations it selected is lost (:func:`check_dropped_share`).
"""

from __future__ import annotations

import logging
from collections import Counter
from dataclasses import dataclass

import torch

#: reason code -> what to change to keep such conversations (said in warnings and errors)
REASONS = {
    "malformed_record": "fix the records (data.on_error=raise names each one)",
    "template_refused": "fix the conversations or the chat template (data.on_error=raise shows the error)",
    "empty_regenerated_answer": "the target ended an answer at once: check its chat template and EOS ids, "
    "or set data.regenerate=false",
    "unfinished_regenerated_answer": "raise data.max_new_tokens",
    "no_supervised_tokens": "give the conversations non-empty answers (reasoning blocks are never supervised)",
    "no_supervised_tokens_after_truncation": "raise data.max_length",
}


@dataclass
class SkippedRecord:
    """A record or conversation left out: its index in the stage's input, why (a sentence), and ``kind``,
    the reason code (a key of ``REASONS``)."""

    index: int
    reason: str
    kind: str = "malformed_record"


class DroppedConversationsError(ValueError):
    """More conversations were lost than ``data.max_dropped_fraction`` allows; the message names the
    count, the share, the main reasons and the fix."""


def supervision_drop(loss_mask: torch.Tensor, max_length: int | None) -> tuple[str, str] | None:
    """Why a rendered conversation trains nothing, or None when it trains.

    ``loss_mask`` [T] bool is the untruncated mask (``chat.render`` without max_length). Truncation to
    ``max_length`` keeps a partially cut answer: its first tokens still train (the labels at kept
    positions do not depend on what was cut). Returns ``(kind, sentence)`` with kind
    ``no_supervised_tokens`` (no supervised token after the first: empty or reasoning-only answers) or
    ``no_supervised_tokens_after_truncation`` (every supervised token lies at or past ``max_length``)."""
    positions = loss_mask.nonzero().flatten()
    positions = positions[positions >= 1]  # token 0 has no context: no row predicts it
    if positions.numel() == 0:
        return "no_supervised_tokens", "no assistant token to supervise (empty or reasoning-only answers)"
    first = int(positions[0])
    if max_length is not None and first >= max_length:
        return (
            "no_supervised_tokens_after_truncation",
            f"its first supervised token is token {first} of {loss_mask.numel()}, past max_length {max_length}",
        )
    return None


def count_by_reason(dropped: list[SkippedRecord]) -> dict[str, int]:
    """``{kind: count}``, most frequent first (ties in ``REASONS`` order)."""
    order = list(REASONS)
    counts = Counter(d.kind for d in dropped)
    return dict(sorted(counts.items(), key=lambda kv: (-kv[1], order.index(kv[0]) if kv[0] in order else len(order))))


def examples_by_reason(dropped: list[SkippedRecord], per_reason: int = 3) -> dict[str, list[str]]:
    """``{kind: [the first sentences]}``, at most ``per_reason`` per kind."""
    out: dict[str, list[str]] = {}
    for d in dropped:
        bucket = out.setdefault(d.kind, [])
        if len(bucket) < per_reason:
            bucket.append(d.reason)
    return out


def describe(counts: dict[str, int]) -> str:
    """``"no_supervised_tokens_after_truncation: 69 (raise data.max_length); ..."``."""
    return "; ".join(f"{kind}: {n} ({REASONS.get(kind, '?')})" for kind, n in counts.items())


def log_counts(logger: logging.Logger, what: str, counts: dict[str, int], total: int, example: str) -> None:
    """One warning naming how many of ``total`` conversations ``what`` left out, by reason (``counts``),
    with the fix per reason and an example; nothing when none was."""
    if counts:
        logger.warning(
            "%s: skipped %d of %d conversations: %s; first: %s",
            what,
            sum(counts.values()),
            total,
            describe(counts),
            example,
        )


def log_dropped(logger: logging.Logger, what: str, dropped: list[SkippedRecord], total: int) -> None:
    """:func:`log_counts` of the records ``dropped``."""
    if dropped:
        log_counts(logger, what, count_by_reason(dropped), total, dropped[0].reason)


def check_dropped_share(
    counts: dict[str, int], total: int, max_fraction: float, examples: dict[str, list[str]], after: str = ""
) -> None:
    """Raise DroppedConversationsError when ``sum(counts) / total`` exceeds ``max_fraction``.

    The message names the count, the share, every reason with its fix and an example of the main one,
    then ``after`` (e.g. where the already computed answers are kept)."""
    lost = sum(counts.values())
    if total <= 0 or lost / total <= max_fraction:
        return
    main = next(iter(counts))
    example = (examples.get(main) or ["?"])[0]
    raise DroppedConversationsError(
        f"prepare lost {lost} of {total} conversations ({lost / total:.1%}, more than data.max_dropped_fraction="
        f"{max_fraction}): {describe(counts)}. Main reason {main}, e.g. {example}. Do what the main reason says, "
        f"or set data.max_dropped_fraction={lost / total:.2f} (or more) to train on what is left.{after}"
    )
