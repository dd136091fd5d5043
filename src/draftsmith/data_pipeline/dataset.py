"""Conversation datasets: load, normalise to one schema, and render into training tensors.

Schema: a conversation is ``{"messages": [{"role": "system"|"user"|"assistant"|"tool", "content": str}, ...]}``
plus optional ``provenance``. Accepted inputs: OpenAI ``messages``, ShareGPT ``conversations``
(``from``/``value``, human/gpt), UltraChat ``messages``/``data`` lists, and ``reference:train`` (the
reference target's train split, derived from the running interpreter's stdlib, DESIGN.md §8).

Turn order: an optional system message first, then a user turn; a user turn is answered by the
assistant; the assistant is followed by a user or a tool turn; tool turns are followed by more tool
turns or the assistant. Anything else (two user turns in a row, an assistant first, a system message
later on) is malformed.

Malformed records follow a policy, ``on_error``: ``"raise"`` (DatasetError naming the record) or
``"skip"``: the record is left out, and every skipped record is returned with its reason
(``LoadedConversations.skipped``, ``RenderedDataset.skipped``) and logged as a warning; never silent.
Rendering also leaves out, whatever ``on_error``, the conversations that train nothing (no supervised
token, or none left within ``max_length``): returned and logged the same way, with a reason code of
``drops.REASONS`` (``SkippedRecord.kind``).
"""

from __future__ import annotations

import json
import logging
import random
from dataclasses import dataclass, field
from pathlib import Path

import torch
from jinja2 import TemplateError

from draftsmith.data_pipeline.chat import render
from draftsmith.data_pipeline.drops import SkippedRecord, count_by_reason, describe, log_dropped, supervision_drop
from draftsmith.reference import corpus

logger = logging.getLogger(__name__)
ON_ERROR = ("raise", "skip")
# role -> roles that may follow it; None is the start of the conversation
NEXT_ROLES = {
    None: ("system", "user"),
    "system": ("user",),
    "user": ("assistant",),
    "assistant": ("user", "tool"),
    "tool": ("tool", "assistant"),
}

SHAREGPT_ROLES = {
    "human": "user",
    "user": "user",
    "gpt": "assistant",
    "assistant": "assistant",
    "system": "system",
    "tool": "tool",
    "chatgpt": "assistant",
    "bing": "assistant",
}


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
    elif "data" in record and isinstance(record["data"], list):  # UltraChat: alternating user/assistant strings
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
    previous = None
    for j, m in enumerate(messages):
        if m["role"] not in NEXT_ROLES[previous]:
            where = "come first" if previous is None else f"follow a {previous!r} turn"
            raise DatasetError(
                f"record {index}, turn {j}: role {m['role']!r} cannot {where} (expected "
                f"{' or '.join(map(repr, NEXT_ROLES[previous]))}); turns must alternate"
            )
        previous = m["role"]
    out = {k: v for k, v in record.items() if k not in ("messages", "conversations", "data")}
    out["messages"] = messages
    return out


@dataclass
class LoadedConversations:
    """What :func:`read_conversations` kept, and what it skipped (with reasons)."""

    conversations: list[dict]
    skipped: list[SkippedRecord] = field(default_factory=list)
    total: int = 0  #: records in the source


def _check_on_error(on_error: str) -> None:
    if on_error not in ON_ERROR:
        raise ValueError(f"on_error must be one of {ON_ERROR}, got {on_error!r}")


def _log_skipped(what: str, skipped: list[SkippedRecord], total: int) -> None:
    if skipped:
        first = "; ".join(s.reason for s in skipped[:3])
        logger.warning("%s: skipped %d of %d malformed records (first: %s)", what, len(skipped), total, first)


LOCAL_SUFFIXES = (".jsonl", ".json", ".parquet")


def _hub_records(source: str, subset: str | None, split: str):
    """Records of ``datasets.load_dataset(source, subset, split=split)`` (a Hub name, or a local folder of
    data files) as plain dicts; honours ``HF_DATASETS_OFFLINE``."""
    import datasets

    try:
        ds = datasets.load_dataset(source, subset, split=split)
    except ValueError as e:  # e.g. an unknown split: say which exist
        raise DatasetError(
            f"dataset {source!r} (subset {subset!r}) has no split {split!r}: {e}; set data.split "
            "(and data.subset) to one the dataset has"
        ) from None
    return ds


def _local_records(path: Path, split: str) -> tuple[list, bool]:
    """(raw records, whether each is a JSON line still to parse) of a local .jsonl / .json / .parquet file."""
    if path.suffix == ".parquet":
        import datasets

        return list(datasets.load_dataset("parquet", data_files={split: str(path)}, split=split)), False
    text = path.read_text()
    if path.suffix == ".json":
        data = json.loads(text)
        if not isinstance(data, list):
            raise DatasetError(f"{path}: a .json dataset must hold a list of records; got {type(data).__name__}")
        return data, False
    return [line for line in text.splitlines() if line.strip()], True


def read_conversations(
    source: str,
    limit: int | None = None,
    seed: int = 0,
    on_error: str = "raise",
    split: str = "train",
    subset: str | None = None,
) -> LoadedConversations:
    """Conversations from ``source``, normalised (``normalise``), shuffled with ``seed``, first ``limit`` kept.

    ``source``: ``reference:train``; a local ``.jsonl`` / ``.json`` (a list) / ``.parquet`` file; or
    anything else ``datasets.load_dataset`` takes (a Hub name such as ``HuggingFaceH4/ultrachat_200k`` with
    ``subset`` and ``split``, or a local folder of data files). Malformed records raise DatasetError naming
    the record's index, or are skipped and counted per ``on_error``.

    Raises FileNotFoundError for a missing local file (a path ending in .jsonl/.json/.parquet)."""
    _check_on_error(on_error)
    skipped: list[SkippedRecord] = []
    if source == "reference:train":
        train = [s for s in corpus.stdlib_sources() if not corpus.is_heldout(s.module)]
        # Re-derive the prompts with another seed than pretraining's (cut points, renamed identifiers,
        # added parameters differ), so the target answers prompts it has not memorised, as when serving.
        records = corpus.examples(train, corpus.FAMILIES, corpus.HEAD_DATA_SEED + seed)
        total = len(records)
    else:
        path = Path(source)
        if path.is_file():
            raw, jsonl = _local_records(path, split)
        elif path.suffix in LOCAL_SUFFIXES:
            raise FileNotFoundError(
                f"dataset {source} not found (give a .jsonl/.json/.parquet file, a "
                "datasets.load_dataset name, or 'reference:train')"
            )
        else:
            raw, jsonl = _hub_records(source, subset, split), False
        records, total = [], len(raw)
        for i, r in enumerate(raw):
            try:
                if jsonl:
                    try:
                        r = json.loads(r)
                    except json.JSONDecodeError as e:
                        raise DatasetError(f"record {i}: not valid JSON ({e})") from None
                if not isinstance(r, dict):
                    raise DatasetError(f"record {i}: expected a JSON object, got {type(r).__name__}")
                records.append(normalise(r, i))
            except DatasetError as e:
                if on_error == "raise":
                    raise
                skipped.append(SkippedRecord(i, str(e)))
        _log_skipped(f"dataset {source}", skipped, total)
    random.Random(seed).shuffle(records)
    return LoadedConversations(records[:limit] if limit else records, skipped, total)


def load_conversations(
    source: str,
    limit: int | None = None,
    seed: int = 0,
    on_error: str = "raise",
    split: str = "train",
    subset: str | None = None,
) -> list[dict]:
    """Conversations from ``source`` (see :func:`read_conversations`), shuffled with ``seed``.

    Raises FileNotFoundError for a missing file, DatasetError for a malformed record (``on_error="raise"``);
    with ``on_error="skip"`` malformed records are logged and left out (:func:`read_conversations`
    returns them too)."""
    return read_conversations(source, limit, seed, on_error, split, subset).conversations


@dataclass
class RenderedDataset:
    """Rendered conversations: lists of input_ids [T_i] int64 and loss_mask [T_i] bool.

    ``kept[j]`` is the input index of sequence j; ``skipped`` holds every conversation left out, with its
    reason (``SkippedRecord.kind``: template_refused, no_supervised_tokens,
    no_supervised_tokens_after_truncation); ``truncated`` counts kept conversations cut by max_length."""

    input_ids: list[torch.Tensor]
    loss_mask: list[torch.Tensor]
    skipped: list[SkippedRecord] = field(default_factory=list)  #: conversations left out, with reasons
    kept: list[int] = field(default_factory=list)
    truncated: int = 0

    def __len__(self) -> int:
        return len(self.input_ids)

    def supervised_fraction(self) -> float:
        total = sum(m.numel() for m in self.loss_mask)
        return sum(int(m.sum()) for m in self.loss_mask) / max(1, total)

    def num_tokens(self) -> int:
        return sum(m.numel() for m in self.loss_mask)


def render_conversations(
    tokenizer,
    conversations: list[dict],
    max_length: int,
    on_error: str = "raise",
    chat_template_kwargs: dict | None = None,
) -> RenderedDataset:
    """Render every conversation with the chat template and assistant-only mask, truncated to max_length.

    Truncation keeps the first ``max_length`` tokens and their mask, so a partially cut answer still
    trains on its first tokens (the labels at kept positions are the same as without the cut; the cut
    answer only loses its end-of-turn token). Left out and reported in ``skipped`` (and logged): a
    conversation the template or the mask refuses (ChatTemplateError, a template's raise_exception),
    which raises instead under ``on_error="raise"``; and, whatever ``on_error``, one that trains nothing
    (``drops.supervision_drop``: no supervised token, or none within max_length). The caller reports
    ``skipped`` (``render_dataset`` logs it; ``prepare`` logs and counts it in its manifest)."""
    _check_on_error(on_error)
    ds = RenderedDataset([], [])
    for i, conv in enumerate(conversations):
        try:
            r = render(tokenizer, conv["messages"], chat_template_kwargs=chat_template_kwargs)
        except (ValueError, TemplateError) as e:
            if on_error == "raise":
                raise
            ds.skipped.append(SkippedRecord(i, f"conversation {i}: {type(e).__name__}: {e}", "template_refused"))
            continue
        drop = supervision_drop(r.loss_mask, max_length)
        if drop is not None:
            ds.skipped.append(SkippedRecord(i, f"conversation {i}: {drop[1]}", drop[0]))
            continue
        ds.truncated += r.input_ids.numel() > max_length
        ds.input_ids.append(r.input_ids[:max_length])
        ds.loss_mask.append(r.loss_mask[:max_length])
        ds.kept.append(i)
    return ds


def check_supervised_fraction(ds: RenderedDataset, tokenizer) -> None:
    """Raise ValueError when no sequence is kept, or when the supervised fraction of the kept ones is 0%
    or above 95%: the template's mask is then wrong (the message names what was left out, by reason)."""
    frac = ds.supervised_fraction()
    if not ds.input_ids or frac == 0.0 or frac > 0.95:
        left_out = f" ({len(ds.skipped)} left out: {describe(count_by_reason(ds.skipped))})" if ds.skipped else ""
        raise ValueError(
            f"supervised fraction {frac:.1%} over {len(ds)} conversations{left_out} is implausible for "
            f"the chat template of {getattr(tokenizer, 'name_or_path', '?')}: check the template and "
            "the data"
        )


def render_dataset(
    tokenizer,
    conversations: list[dict],
    max_length: int,
    on_error: str = "raise",
    chat_template_kwargs: dict | None = None,
) -> RenderedDataset:
    """:func:`render_conversations`, a warning naming what it left out (by reason), then
    :func:`check_supervised_fraction` (which raises ValueError)."""
    ds = render_conversations(tokenizer, conversations, max_length, on_error, chat_template_kwargs)
    log_dropped(logger, "render_dataset", ds.skipped, len(conversations))
    check_supervised_fraction(ds, tokenizer)
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
