"""Render conversations with the target's chat template and derive the assistant-only loss mask.

The mask comes from rendering prefixes of the conversation and diffing them, so it works for any
template, including those without ``{% generation %}`` tags (DESIGN.md §4):

    text(messages[:i], add_generation_prompt=True)   = "...<|im_start|>assistant\\n"
    text(messages[:i+1])                             = "...<|im_start|>assistant\\nANSWER<|im_end|>\\n"
                                                        supervised span: ^^^^^^^^^^^^^^^^^^^^ (trailing
                                                        whitespace of the template excluded)

Characters of reasoning blocks (``<think>…</think>``) inside an answer are never supervised; system,
user and tool turns never are. Token i is supervised when the first character it covers is.
"""
from __future__ import annotations

import re
from dataclasses import dataclass

import torch

ROLES = ("system", "user", "assistant", "tool")
THINK_RE = re.compile(r"<think>.*?</think>\s*", re.DOTALL)


class ChatTemplateError(ValueError):
    """The template renders conversations in a way the prefix-diff mask cannot follow."""


@dataclass
class Rendered:
    """One rendered conversation: ``input_ids`` [T] int64, ``loss_mask`` [T] bool, and the text."""

    input_ids: torch.Tensor
    loss_mask: torch.Tensor
    text: str


def render_text(tokenizer, messages: list[dict], add_generation_prompt: bool = False) -> str:
    """The chat template's text for ``messages`` (raises ChatTemplateError if the tokenizer has none)."""
    if not getattr(tokenizer, "chat_template", None):
        raise ChatTemplateError(f"tokenizer {getattr(tokenizer, 'name_or_path', '?')} has no chat_template; "
                                "pass a tokenizer with one or set tokenizer.chat_template")
    return tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=add_generation_prompt)


def supervised_spans(tokenizer, messages: list[dict]) -> tuple[str, list[tuple[int, int]]]:
    """Full text and the ``[start, end)`` character spans of every assistant answer to supervise."""
    for i, m in enumerate(messages):
        if m.get("role") not in ROLES or not isinstance(m.get("content"), str):
            raise ValueError(f"message {i} must have role in {ROLES} and a string content, got {m!r}")
    full = render_text(tokenizer, messages)
    spans = []
    for i, m in enumerate(messages):
        if m["role"] != "assistant":
            continue
        before = render_text(tokenizer, messages[:i], add_generation_prompt=True)
        after = render_text(tokenizer, messages[:i + 1])
        if not (after.startswith(before) and full.startswith(after)):
            raise ChatTemplateError(
                f"{getattr(tokenizer, 'name_or_path', 'this tokenizer')}: rendering turn {i} changes the text of "
                "earlier turns, so the prefix-diff mask cannot locate the answer; render turn by turn instead")
        start, end = len(before), len(after)
        while end > start and full[end - 1].isspace():
            end -= 1
        answer = full[start:end]
        cursor = start
        for think in THINK_RE.finditer(answer):
            spans.append((cursor, start + think.start()))
            cursor = start + think.end()
        spans.append((cursor, end))
    return full, [(a, b) for a, b in spans if b > a]


def render(tokenizer, messages: list[dict], max_length: int | None = None) -> Rendered:
    """Tokenize ``messages`` with the chat template and the assistant-only mask.

    Returns input_ids [T] int64 and loss_mask [T] bool (truncated to ``max_length``). Needs a fast
    tokenizer (offset mapping); raises ChatTemplateError / ValueError on a bad template or message."""
    full, spans = supervised_spans(tokenizer, messages)
    enc = tokenizer(full, add_special_tokens=False, return_offsets_mapping=True)
    ids = enc["input_ids"]
    mask = []
    for a, _ in enc["offset_mapping"]:
        mask.append(any(s <= a < e for s, e in spans))
    ids_t = torch.tensor(ids, dtype=torch.long)
    mask_t = torch.tensor(mask, dtype=torch.bool)
    if max_length is not None:
        ids_t, mask_t = ids_t[:max_length], mask_t[:max_length]
    return Rendered(ids_t, mask_t, full)


def prompt_ids(tokenizer, messages: list[dict]) -> torch.Tensor:
    """Token ids [T] of ``messages`` followed by the generation prompt (what the server feeds the target)."""
    text = render_text(tokenizer, messages, add_generation_prompt=True)
    return torch.tensor(tokenizer(text, add_special_tokens=False)["input_ids"], dtype=torch.long)
