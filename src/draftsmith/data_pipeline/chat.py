"""Render conversations with the target's chat template and derive the assistant-only loss mask.

The mask comes from rendering prefixes of the conversation and diffing them, so it works for any
template, including those without ``{% generation %}`` tags (DESIGN.md §4):

    text(messages[:i], add_generation_prompt=True)   = "...<|im_start|>assistant\\n"
    text(messages[:i+1])                             = "...<|im_start|>assistant\\nANSWER<|im_end|>\\n"
                                                        supervised span: ^^^^^^^^^^^^^^^^^^^^ (trailing
                                                        whitespace of the template excluded)

What the target generates for turn i is the text of ``messages[:i+1]`` past its generation prompt
(so a leading space the model writes, as in Mistral's ``[/INST] ANSWER</s>``, is supervised, and a
header the prompt already holds is not). Characters of reasoning blocks (``<think>…</think>``) are
never supervised, including the rest of a block the generation prompt opened (``<think>\\n``); system,
user and tool turns never are. Token i is supervised when the first character it covers is.

Templates that re-render history. Some templates render a finished assistant turn differently once
the conversation moves on: Qwen3 drops the ``<think>`` block of every assistant turn before the last
user query, and its ``enable_thinking=False`` generation prompt holds an empty think block that a turn
with reasoning does not. The final sequence is always the template's rendering of the whole
conversation (the text the target reads, one forward pass); each answer is located turn by turn:
  1. render turn i alone (``messages[:i]`` + generation prompt vs ``messages[:i+1]``) and cut out what
     the model writes, minus reasoning blocks: the answer pieces (text + end-of-turn token). The two
     renderings may differ only inside reasoning scaffolding; anything else raises ChatTemplateError;
  2. if that rendering is a prefix of the whole conversation's, the pieces map onto it as they are;
  3. otherwise render the whole conversation with answer i replaced by a placeholder, which gives the
     position of answer i in the final text, and match the pieces there exactly; only whitespace and
     reasoning blocks may be skipped on the way, so a span can never land in another turn.
A template that changes non-assistant text as the conversation grows (Mistral v0.3 moving the system
prompt to the last user turn) is refused with ChatTemplateError.
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass

import torch

ROLES = ("system", "user", "assistant", "tool")
THINK_OPEN, THINK_CLOSE = "<think>", "</think>"
THINK_RE = re.compile(r"<think>.*?</think>\s*", re.DOTALL)
LEADING_THINK_RE = re.compile(r"\s*<think>.*?</think>\s*", re.DOTALL)
PLACEHOLDER = "\ue000draftsmith-answer\ue001"  # private-use characters: no template or answer holds them


class ChatTemplateError(ValueError):
    """The template renders conversations in a way the prefix-diff mask cannot follow."""


@dataclass
class Rendered:
    """One rendered conversation: ``input_ids`` [T] int64, ``loss_mask`` [T] bool, and the text."""

    input_ids: torch.Tensor
    loss_mask: torch.Tensor
    text: str


def render_text(
    tokenizer, messages: list[dict], add_generation_prompt: bool = False, chat_template_kwargs: dict | None = None
) -> str:
    """The chat template's text for ``messages`` (raises ChatTemplateError if the tokenizer has none).

    ``chat_template_kwargs`` are passed to the template (e.g. ``{"enable_thinking": False}`` for Qwen3)."""
    if not getattr(tokenizer, "chat_template", None):
        raise ChatTemplateError(
            f"tokenizer {getattr(tokenizer, 'name_or_path', '?')} has no chat_template; "
            "pass a tokenizer with one or set tokenizer.chat_template"
        )
    return tokenizer.apply_chat_template(
        messages, tokenize=False, add_generation_prompt=add_generation_prompt, **(chat_template_kwargs or {})
    )


def _name(tokenizer) -> str:
    return getattr(tokenizer, "name_or_path", "") or "this tokenizer"


def _inside_think(text: str) -> bool:
    """Whether ``text`` ends inside an unclosed reasoning block."""
    return text.rfind(THINK_OPEN) > text.rfind(THINK_CLOSE)


def _reasoning_only(text: str, inside_think: bool) -> bool:
    """Whether ``text`` holds nothing but reasoning scaffolding (blocks, the rest of an open one, an opener)."""
    if inside_think:
        close = text.find(THINK_CLOSE)
        if close < 0:
            return True
        text = text[close + len(THINK_CLOSE) :]
    text = THINK_RE.sub("", text)
    opener = text.find(THINK_OPEN)
    return not (text[:opener] if opener >= 0 else text).strip()


def _answer_pieces(text: str, start: int, end: int, inside_think: bool) -> list[tuple[int, int]]:
    """``[a, b)`` spans of ``text[start:end]`` outside reasoning blocks; ``inside_think``: start is in one."""
    cursor = start
    if inside_think:
        close = text.find(THINK_CLOSE, start, end)
        if close < 0:  # the whole turn is (unfinished) reasoning
            return []
        cursor = close + len(THINK_CLOSE)
        while cursor < end and text[cursor].isspace():
            cursor += 1
    spans = []
    for think in THINK_RE.finditer(text, cursor, end):
        spans.append((cursor, think.start()))
        cursor = think.end()
    unclosed = text.find(THINK_OPEN, cursor, end)
    spans.append((cursor, unclosed if unclosed >= 0 else end))
    return [(a, b) for a, b in spans if b > a]


def _turn_answer(tokenizer, messages: list[dict], i: int, kwargs: dict | None) -> tuple[str, list[tuple[int, int]]]:
    """Step 1: the rendering of ``messages[:i+1]`` and the spans of assistant turn i's answer in it."""
    before = render_text(tokenizer, messages[:i], add_generation_prompt=True, chat_template_kwargs=kwargs)
    after = render_text(tokenizer, messages[: i + 1], chat_template_kwargs=kwargs)
    start = len(before)
    if not after.startswith(before):
        # the generation prompt may differ from the finished turn only in reasoning scaffolding
        # (Qwen3 enable_thinking=False prompts "<think>\n\n</think>\n\n"; R1-style prompts open "<think>\n")
        start = len(os.path.commonprefix([before, after]))
        opener = before.rfind(THINK_OPEN, 0, start + len(THINK_OPEN))
        if not _reasoning_only(before[start:], _inside_think(before[:start])) and 0 <= opener <= start:
            start = opener  # the common prefix ran into the opener ("<t" of "<think>")
        if not _reasoning_only(before[start:], _inside_think(before[:start])):
            raise ChatTemplateError(
                f"{_name(tokenizer)}: rendering turn {i} changes the text of earlier turns, so the prefix-diff "
                f"mask cannot locate the answer (the generation prompt {before[start : start + 40]!r}... is not how "
                f"the finished turn {after[start : start + 40]!r}... begins: does the template move non-assistant "
                "text, e.g. the system prompt, as turns are added?)"
            )
    end = len(after.rstrip())
    return after, _answer_pieces(after, start, end, _inside_think(after[:start]))


def _locate(full: str, pieces: list[str], anchor: int, floor: int) -> list[tuple[int, int]] | None:
    """Step 3: match ``pieces`` in order in ``full`` from ``anchor`` (backed up over whitespace, not
    below ``floor``), skipping only whitespace and reasoning blocks; None when they are not there."""
    pos = anchor
    while pos > floor and full[pos - 1].isspace():
        pos -= 1
    spans = []
    for piece in pieces:
        inside = _inside_think(full[:pos])
        while not full.startswith(piece, pos):
            if inside:
                close = full.find(THINK_CLOSE, pos)
                if close < 0:
                    return None
                pos, inside = close + len(THINK_CLOSE), False
            elif pos < len(full) and full[pos].isspace():
                pos += 1
            elif full.startswith(THINK_OPEN, pos):
                pos, inside = pos + len(THINK_OPEN), True
            else:
                return None
        spans.append((pos, pos + len(piece)))
        pos += len(piece)
    return spans


def supervised_spans(
    tokenizer, messages: list[dict], chat_template_kwargs: dict | None = None
) -> tuple[str, list[tuple[int, int]]]:
    """Full text and the ``[start, end)`` character spans of every assistant answer to supervise.

    Follows the numbered steps of the module docstring; raises ChatTemplateError when the template
    renders conversations in a way they cannot follow, ValueError on a malformed message."""
    for i, m in enumerate(messages):
        if m.get("role") not in ROLES or not isinstance(m.get("content"), str):
            raise ValueError(f"message {i} must have role in {ROLES} and a string content, got {m!r}")
    full = render_text(tokenizer, messages, chat_template_kwargs=chat_template_kwargs)
    spans: list[tuple[int, int]] = []
    for i, m in enumerate(messages):
        if m["role"] != "assistant":
            continue
        after, pieces = _turn_answer(tokenizer, messages, i, chat_template_kwargs)
        if not pieces:  # an empty answer, or reasoning only
            continue
        floor = spans[-1][1] if spans else 0
        if full.startswith(after[: pieces[-1][1]]) and pieces[0][0] >= floor:
            spans.extend(pieces)  # step 2: this turn renders the same in the whole conversation
            continue
        think = LEADING_THINK_RE.match(m["content"])
        stand_in = {**m, "content": (think.group(0) if think else "") + PLACEHOLDER}
        marked = render_text(
            tokenizer, messages[:i] + [stand_in] + messages[i + 1 :], chat_template_kwargs=chat_template_kwargs
        )
        anchor = marked.find(PLACEHOLDER)
        located = None
        if anchor >= 0 and marked.count(PLACEHOLDER) == 1 and full.startswith(marked[:anchor]):
            located = _locate(full, [after[a:b] for a, b in pieces], anchor, floor)
        if located is None:
            raise ChatTemplateError(
                f"{_name(tokenizer)}: the answer of turn {i} as rendered on its own is not where the whole "
                "conversation's rendering puts it; the template changes the text of earlier turns in a way the "
                "mask cannot follow"
            )
        spans.extend(located)
    return full, spans


def render(
    tokenizer, messages: list[dict], max_length: int | None = None, chat_template_kwargs: dict | None = None
) -> Rendered:
    """Tokenize ``messages`` with the chat template and the assistant-only mask.

    Returns input_ids [T] int64 and loss_mask [T] bool (truncated to ``max_length``: the first tokens
    and their mask, so a partially cut answer keeps its first tokens supervised, and an answer past the
    cut keeps none; ``dataset.render_conversations`` leaves out, and counts, conversations with no
    supervised token left). Needs a fast tokenizer (offset mapping); raises ChatTemplateError /
    ValueError on a bad template or message."""
    full, spans = supervised_spans(tokenizer, messages, chat_template_kwargs)
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


def prompt_ids(tokenizer, messages: list[dict], chat_template_kwargs: dict | None = None) -> torch.Tensor:
    """Token ids [T] of ``messages`` followed by the generation prompt (what the server feeds the target)."""
    text = render_text(tokenizer, messages, add_generation_prompt=True, chat_template_kwargs=chat_template_kwargs)
    return torch.tensor(tokenizer(text, add_special_tokens=False)["input_ids"], dtype=torch.long)
