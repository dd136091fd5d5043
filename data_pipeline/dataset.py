"""Conversation datasets: load, normalise to one schema, and render into training tensors.

Schema: a conversation is ``{"messages": [{"role": "system"|"user"|"assistant"|"tool", "content": str}, ...]}``
plus optional ``provenance``. Accepted inputs: OpenAI ``messages``, ShareGPT ``conversations``
(``from``/``value``, human/gpt), UltraChat ``messages``/``data`` lists, and ``reference:train`` (the
reference target's train split, derived from the running interpreter's stdlib, DESIGN.md §8).
"""
from __future__ import annotations

import json
import random
from dataclasses import dataclass
from pathlib import Path

import torch

from draftsmith.data_pipeline.chat import render

SHAREGPT_ROLES = {"human": "user", "user": "user", "gpt": "assistant", "assistant": "assistant",
                  "system": "system", "tool": "tool", "chatgpt": "assistant", "bing": "assistant"}


class DatasetError(ValueError):
    """A record that cannot be normalised; the message names its index and the problem."""


def normalise(record: dict, index: int) -> dict:
    """One record in any accepted shape -> ``{"messages": [...], ...}``; raises DatasetError."""
    if "messages" in record and isinstance(record["messages"], list):
        messages = [{"role": m.get("role"), "content": m.get("content")} for m in record["messages"]]
    elif "conversations" in record:
        messages = []
        for m in record["conversations"]:
            role = SHAREGPT_ROLES.get(str(m.get("from", m.get("role"))).lower())
            messages.append({"role": role, "content": m.get("value", m.get("content"))})
    elif "data" in record and isinstance(record["data"], list):   # UltraChat: alternating user/assistant strings
        messages = [{"role": "user" if i % 2 == 0 else "assistant", "content": c} for i, c in enumerate(record["data"])]
    else:
        raise DatasetError(f"record {index}: no 'messages', 'conversations' or 'data' field (keys: {sorted(record)})")
    for j, m in enumerate(messages):
        if m["role"] not in ("system", "user", "assistant", "tool"):
            raise DatasetError(f"record {index}, turn {j}: unknown role {m['role']!r}")
        if not isinstance(m["content"], str) or not m["content"].strip():
            raise DatasetError(f"record {index}, turn {j}: empty or missing content")
    if not any(m["role"] == "user" for m in messages):
        raise DatasetError(f"record {index}: no user turn")
    out = {k: v for k, v in record.items() if k not in ("messages", "conversations", "data")}
    out["messages"] = messages
    return out


def load_conversations(source: str, limit: int | None = None, seed: int = 0) -> list[dict]:
    """Conversations from ``source`` (a .jsonl/.json path or ``reference:train``), shuffled with ``seed``.

    Raises FileNotFoundError for a missing file, DatasetError for a malformed record."""
    if source == "reference:train":
        from draftsmith.reference import corpus

        train = [s for s in corpus.stdlib_sources() if not corpus.is_heldout(s.module)]
        records = corpus.examples(train, corpus.FAMILIES, seed)
    else:
        path = Path(source)
        if not path.exists():
            raise FileNotFoundError(f"dataset {source} not found (give a .jsonl/.json file or 'reference:train')")
        text = path.read_text()
        raw = json.loads(text) if path.suffix == ".json" else [json.loads(l) for l in text.splitlines() if l.strip()]
        records = [normalise(r, i) for i, r in enumerate(raw)]
    random.Random(seed).shuffle(records)
    return records[:limit] if limit else records


@dataclass
class RenderedDataset:
    """Rendered conversations: lists of input_ids [T_i] int64 and loss_mask [T_i] bool."""

    input_ids: list[torch.Tensor]
    loss_mask: list[torch.Tensor]

    def __len__(self) -> int:
        return len(self.input_ids)

    def supervised_fraction(self) -> float:
        total = sum(m.numel() for m in self.loss_mask)
        return sum(int(m.sum()) for m in self.loss_mask) / max(1, total)

    def num_tokens(self) -> int:
        return sum(m.numel() for m in self.loss_mask)


def render_dataset(tokenizer, conversations: list[dict], max_length: int) -> RenderedDataset:
    """Render every conversation with the chat template and assistant-only mask (truncated to max_length).

    Raises ValueError when the whole dataset's supervised fraction is 0% or above 95%: the template's
    mask is then wrong (e.g. a template that re-renders earlier turns)."""
    ids, masks = [], []
    for conv in conversations:
        r = render(tokenizer, conv["messages"], max_length=max_length)
        if r.loss_mask.any():
            ids.append(r.input_ids)
            masks.append(r.loss_mask)
    ds = RenderedDataset(ids, masks)
    frac = ds.supervised_fraction()
    if not ds.input_ids or frac == 0.0 or frac > 0.95:
        raise ValueError(f"supervised fraction {frac:.1%} over {len(ds)} conversations is implausible for the chat "
                         f"template of {getattr(tokenizer, 'name_or_path', '?')}: check the template and the data")
    return ds


def pad_batch(seqs: list[torch.Tensor], masks: list[torch.Tensor], pad_id: int):
    """Right-pad to the longest: (input_ids [B, T], attention_mask [B, T], loss_mask [B, T])."""
    t = max(s.numel() for s in seqs)
    ids = torch.full((len(seqs), t), pad_id, dtype=torch.long)
    attn = torch.zeros((len(seqs), t), dtype=torch.long)
    loss = torch.zeros((len(seqs), t), dtype=torch.bool)
    for i, (s, m) in enumerate(zip(seqs, masks)):
        ids[i, : s.numel()], attn[i, : s.numel()], loss[i, : s.numel()] = s, 1, m
    return ids, attn, loss
