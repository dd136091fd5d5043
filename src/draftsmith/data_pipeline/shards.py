"""Offline capture: the frozen target's training signals, written once to safetensors shards.

    manifest = write_shards(target, tokenizer, conversations, "runs/NAME/capture", aux_layer_ids=(2, 16, 29),
                            max_length=2048, shard_size=512, batch_size=8,
                            target_name="meta-llama/Llama-3.1-8B-Instruct")
    reader = ShardReader("runs/NAME/capture")          # each shard's sha256 is checked before it is read
    for seq in reader:
        logits = ShardReader.target_logits(target.lm_head, seq.final_hidden)     # [T, V]

Folder: ``manifest.json`` and ``shard-00000.safetensors``, ``shard-00001.safetensors``, ... Shard k holds
the conversations ``[k * shard_size, (k + 1) * shard_size)`` of the input list, less those with nothing
to supervise within max_length (``drops.supervision_drop``; counted by reason in the shard's entry and
the manifest, ``dropped`` with ``dropped_examples``, and logged), stored longest first (the batching
order). One tensor per sequence j and field, so a sequence is read without touching the others:

    {j}.input_ids       [T]      int64          the rendered conversation (``chat.render``), cut to max_length
    {j}.loss_mask       [T]      bool           assistant-only mask
    {j}.aux_hidden      [T, nH]  capture dtype  hidden_states[i] for i in aux_layer_ids, concatenated, as
                                                ``capture.capture`` (HF hidden-states index convention)
    {j}.final_hidden    [T, H]   capture dtype  hidden_states[-1]: the last layer's output AFTER the final norm
    conversation_index  [n]      int64          input-list position of each stored sequence

Why the final hidden state rather than the logits: the logits are lm_head(final_hidden), one matmul
at training time (``ShardReader.target_logits``), and [T, H] is V/H times smaller than [T, V]
(128256 / 4096 ≈ 31x for Llama-3.1-8B). Every captured batch checks that lm_head(final_hidden)
reproduces the target's own logits at the last position, so a target whose logits are not a plain
lm_head of that state (softcapping, logit scaling) is refused instead of stored wrong.

Dtype. The stored states are in the target's own dtype, which is what the runtime feeds the head
(``core.target.TargetModel`` returns aux states in the model's dtype): ``capture_dtype`` may only
restate it, and ``ShardReader.check_target`` refuses a target that runs in another dtype than the
capture was made in (bf16 states differ from fp32 states rounded to bf16).

Validation. On write: the file's header (names, shapes, dtypes) against the planned layout, and every
stored state finite (a NaN/inf names its conversation). On read: a shard's sha256 (``verify``), its
header against its manifest entry (sequences, tokens, widths 3H and H, capture dtype), and each
sequence read (shapes agree, ids inside the target's vocab, states finite).

Steps of write_shards:
  1. refuse a folder whose manifest was written for other inputs (conversations, settings including
     batch_size, since padding changes the last bits, and the target's identity);
  2. per shard: skip it when its file matches the sha256 the manifest records (a killed run resumes);
  3. render its conversations and lay out the safetensors header from their lengths, so the file can
     be written batch by batch;
  4. capture batch by batch without grad and stream each batch into ``shard-k.safetensors.tmp``:
     memory holds one batch of activations, never a shard;
  5. validate the written file (header, names, shapes), hash it, rename it to its final name;
  6. rewrite ``manifest.json`` atomically with the shard's entry, so a kill loses at most one shard.
"""

from __future__ import annotations

import bisect
import hashlib
import json
import logging
import math
import os
import struct
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import safe_open
from tqdm.auto import tqdm

from draftsmith.core.aux_layers import AUX_LAYER_CONVENTION, check_aux_layer_ids
from draftsmith.core.target import TargetModel
from draftsmith.data_pipeline.chat import render
from draftsmith.data_pipeline.dataset import pad_batch
from draftsmith.data_pipeline.drops import SkippedRecord, count_by_reason, log_counts, supervision_drop
from draftsmith.identity import canonical_json, file_sha256, target_identity

logger = logging.getLogger(__name__)

FORMAT, FORMAT_VERSION = "draftsmith-capture", 1
MANIFEST = "manifest.json"
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
ST_DTYPES = {
    torch.float64: "F64",
    torch.float32: "F32",
    torch.float16: "F16",
    torch.bfloat16: "BF16",
    torch.int64: "I64",
    torch.int32: "I32",
    torch.uint8: "U8",
    torch.bool: "BOOL",
}
# target identity fields a capture depends on
IDENTITY_KEYS = ("name_or_path", "revision", "architecture_sha256", "tokenizer_sha256", "chat_template_sha256")


class ShardError(ValueError):
    """A capture folder, shard or target that fails validation; the message names the file."""


def shard_name(k: int) -> str:
    return f"shard-{k:05d}.safetensors"


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


# --------------------------------------------------------------------------------------------- writing


class SafetensorsStream:
    """A safetensors file written tensor by tensor, in the order of a layout fixed up front.

    The header (names, dtypes, shapes, byte offsets) depends only on the layout, so it goes first and
    each tensor's bytes follow as soon as they exist. ``close`` raises unless every tensor came."""

    def __init__(
        self, path: Path, layout: list[tuple[str, torch.dtype, tuple[int, ...]]], metadata: dict[str, str] | None = None
    ):
        header, offset = {"__metadata__": dict(metadata or {})}, 0
        for name, dtype, shape in layout:
            size = math.prod(shape) * dtype.itemsize
            header[name] = {"dtype": ST_DTYPES[dtype], "shape": list(shape), "data_offsets": [offset, offset + size]}
            offset += size
        blob = json.dumps(header, separators=(",", ":")).encode()
        blob += b" " * (-len(blob) % 8)  # data starts 8-byte aligned, as safetensors writes it
        self.path, self._layout, self._next = Path(path), layout, 0
        self._file = open(self.path, "wb")
        self._file.write(struct.pack("<Q", len(blob)) + blob)

    def write(self, name: str, tensor: torch.Tensor) -> None:
        """Append the next tensor of the layout (its name, dtype and shape must be the expected ones)."""
        if self._next >= len(self._layout):
            raise ValueError(f"{self.path}: {name} is past the end of the layout")
        want, dtype, shape = self._layout[self._next]
        if (name, tensor.dtype, tuple(tensor.shape)) != (want, dtype, tuple(shape)):
            raise ValueError(
                f"{self.path}: expected {want} {dtype} {tuple(shape)}, got {name} {tensor.dtype} {tuple(tensor.shape)}"
            )
        raw = tensor.detach().to("cpu").contiguous().reshape(-1).view(torch.uint8).numpy()
        self._file.write(raw.data)
        self._next += 1

    def close(self) -> None:
        missing = len(self._layout) - self._next
        if missing:
            self._file.close()
            raise ValueError(f"{self.path}: {missing} tensors of the layout were never written")
        self._file.flush()
        os.fsync(self._file.fileno())
        self._file.close()

    def __enter__(self) -> "SafetensorsStream":
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        if exc_type is None:
            self.close()
        else:
            self._file.close()


@torch.no_grad()
def capture_final(
    target, input_ids: torch.Tensor, aux_layer_ids, attention_mask: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """aux states [B, T, 3H] and the final hidden state after the final norm [B, T, H] for input_ids [B, T].

    The target's lm_head runs on the last position only; there it must reproduce the target's logits
    from the final hidden state, else ShardError (the logits could not be recomputed from the shards)."""
    layers = check_aux_layer_ids(aux_layer_ids, target.config.get_text_config().num_hidden_layers)
    out = target(
        input_ids=input_ids, attention_mask=attention_mask, output_hidden_states=True, use_cache=False, logits_to_keep=1
    )
    aux = torch.cat([out.hidden_states[i] for i in layers], dim=-1)  # [B, T, 3H]
    final = out.hidden_states[-1]  # [B, T, H], normed
    want = out.logits[:, -1:].float()  # [B, 1, V]
    got = target.get_output_embeddings()(final[:, -1:]).float()
    if (got - want).abs().max() > 1e-3 * (1.0 + want.abs().max()):
        raise ShardError(
            f"{type(target).__name__}: lm_head(final hidden state) does not reproduce the target's "
            "logits (logit softcapping or scaling?); offline capture cannot store this target, "
            "train with online capture instead"
        )
    return aux, final


def _render_shard(tokenizer, conversations, lo: int, hi: int, max_length: int, kwargs: dict | None):
    """(sequences [(conversation index, input_ids [T], loss_mask [T])] longest first, the conversations
    left out [SkippedRecord] with their reasons, how many kept ones max_length cut)."""
    seqs, dropped, truncated = [], [], 0
    for ci in range(lo, hi):
        r = render(tokenizer, conversations[ci]["messages"], chat_template_kwargs=kwargs)
        drop = supervision_drop(r.loss_mask, max_length)
        if drop is not None:
            dropped.append(SkippedRecord(ci, f"conversation {ci}: {drop[1]}", drop[0]))
            continue
        truncated += r.input_ids.numel() > max_length
        seqs.append((ci, r.input_ids[:max_length], r.loss_mask[:max_length]))
    seqs.sort(key=lambda s: -s[1].numel())  # stable: equal lengths keep input order
    return seqs, dropped, truncated


def _write_shard(
    target,
    tokenizer,
    conversations,
    *,
    index: int,
    lo: int,
    hi: int,
    out: Path,
    aux_layer_ids,
    max_length: int,
    batch_size: int,
    dtype: torch.dtype,
    chat_template_kwargs: dict | None,
) -> dict:
    """Steps 3-5 for shard ``index`` (conversations [lo, hi)); returns its manifest entry."""
    seqs, dropped, truncated = _render_shard(tokenizer, conversations, lo, hi, max_length, chat_template_kwargs)
    hidden = target.config.get_text_config().hidden_size
    layout = [("conversation_index", torch.int64, (len(seqs),))]
    for j, (_, ids, _) in enumerate(seqs):
        t = ids.numel()
        layout += [
            (f"{j}.input_ids", torch.int64, (t,)),
            (f"{j}.loss_mask", torch.bool, (t,)),
            (f"{j}.aux_hidden", dtype, (t, len(aux_layer_ids) * hidden)),
            (f"{j}.final_hidden", dtype, (t, hidden)),
        ]
    metadata = {
        "format": FORMAT,
        "format_version": str(FORMAT_VERSION),
        "shard_index": str(index),
        "conversations": f"{lo}:{hi}",
        "aux_layer_ids": ",".join(map(str, aux_layer_ids)),
        "aux_layer_convention": AUX_LAYER_CONVENTION,
        "capture_dtype": dtype_name(dtype),
    }
    pad_id = next((i for i in (tokenizer.pad_token_id, tokenizer.eos_token_id) if i is not None), 0)
    device = next(target.parameters()).device
    name = shard_name(index)
    tmp = out / f"{name}.tmp"
    with SafetensorsStream(tmp, layout, metadata) as stream:
        stream.write("conversation_index", torch.tensor([s[0] for s in seqs], dtype=torch.long))
        for b in range(0, len(seqs), batch_size):
            batch = seqs[b : b + batch_size]
            ids, attn, _ = pad_batch([s[1] for s in batch], [s[2] for s in batch], pad_id)  # [B, T]
            aux, final = capture_final(target, ids.to(device), aux_layer_ids, attn.to(device))
            aux, final = aux.to("cpu", dtype), final.to("cpu", dtype)  # one copy per batch
            for row, (ci, seq_ids, seq_mask) in enumerate(batch):
                t, j = seq_ids.numel(), b + row
                if not (torch.isfinite(aux[row, :t]).all() and torch.isfinite(final[row, :t]).all()):
                    raise ShardError(
                        f"conversation {ci}: the target's hidden states hold NaN/inf in "
                        f"{dtype_name(dtype)} (overflow? capture in the dtype the target serves in)"
                    )
                stream.write(f"{j}.input_ids", seq_ids)
                stream.write(f"{j}.loss_mask", seq_mask)
                stream.write(f"{j}.aux_hidden", aux[row, :t])  # [T, 3H], padding cut off
                stream.write(f"{j}.final_hidden", final[row, :t])  # [T, H]
    _validate_file(tmp, layout)
    digest = file_sha256(tmp)
    os.replace(tmp, out / name)
    return {
        "index": index,
        "file": name,
        "sha256": digest,
        "bytes": (out / name).stat().st_size,
        "conversations": [lo, hi],
        "sequences": len(seqs),
        "skipped_conversations": len(dropped),
        "dropped": count_by_reason(dropped),
        "dropped_examples": [d.reason for d in dropped[:3]],
        "truncated_conversations": truncated,
        "tokens": sum(s[1].numel() for s in seqs),
        "supervised_tokens": sum(int(s[2].sum()) for s in seqs),
    }


def _validate_file(path: Path, layout) -> None:
    """Step 5: the file parses as safetensors and holds exactly the layout's tensors and shapes."""
    with safe_open(str(path), framework="pt") as f:
        names = set(f.keys())
        if names != {name for name, _, _ in layout}:
            raise ShardError(f"{path}: written file does not hold the planned tensors")
        for name, dtype, shape in layout:
            piece = f.get_slice(name)
            if list(piece.get_shape()) != list(shape) or piece.get_dtype() != ST_DTYPES[dtype]:
                raise ShardError(
                    f"{path}: {name} was written as {piece.get_dtype()} {piece.get_shape()}, "
                    f"planned {ST_DTYPES[dtype]} {list(shape)}"
                )


def _write_json_atomic(path: Path, obj: dict) -> None:
    tmp = path.with_name(path.name + ".tmp")
    with open(tmp, "w") as f:
        f.write(json.dumps(obj, indent=1))
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def _capture_key(conversations, identity: dict, settings: dict) -> str:
    """sha256 over everything a capture's bytes depend on: conversations, settings, target identity."""
    h = hashlib.sha256(canonical_json({"settings": settings, "target": {k: identity.get(k) for k in IDENTITY_KEYS}}))
    for conv in conversations:
        h.update(canonical_json(conv["messages"]))
        h.update(b"\n")
    return h.hexdigest()


def _sum_shards(manifest: dict) -> None:
    shards = manifest["shards"]
    for total, per_shard in (
        ("num_sequences", "sequences"),
        ("num_tokens", "tokens"),
        ("num_supervised_tokens", "supervised_tokens"),
        ("skipped_conversations", "skipped_conversations"),
        ("truncated_conversations", "truncated_conversations"),
        ("bytes", "bytes"),
    ):
        manifest[total] = sum(e[per_shard] for e in shards)
    dropped: dict[str, int] = {}
    for e in shards:  # entries of captures made before reasons were recorded lack them
        for kind, n in e.get("dropped", {}).items():
            dropped[kind] = dropped.get(kind, 0) + n
    manifest["dropped"] = dict(sorted(dropped.items(), key=lambda kv: -kv[1]))
    manifest["dropped_examples"] = [x for e in shards for x in e.get("dropped_examples", [])][:5]


def write_shards(
    target,
    tokenizer,
    conversations: list[dict],
    out_dir,
    aux_layer_ids,
    max_length: int,
    shard_size: int,
    batch_size: int,
    target_name: str,
    revision: str | None = None,
    capture_dtype: torch.dtype | str | None = None,
    chat_template_kwargs: dict | None = None,
    progress: bool = True,
) -> dict:
    """Capture ``conversations`` through ``target`` into shards under ``out_dir``; returns the manifest.

    ``shard_size``: conversations per shard; ``batch_size``: sequences per target forward;
    ``capture_dtype``: the dtype of the stored hidden states, recorded in the manifest; it is the
    target's (what the runtime feeds the head), and a different one raises ShardError.
    Follows the numbered steps of the module docstring. Raises ShardError when ``out_dir`` holds a
    capture of other inputs, the target's logits cannot be recomputed from its final hidden state, or
    a state is NaN/inf."""
    if min(max_length, shard_size, batch_size) < 1:
        raise ValueError(
            f"max_length, shard_size and batch_size must be positive, got {max_length}, {shard_size}, {batch_size}"
        )
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    layers = check_aux_layer_ids(aux_layer_ids, target.config.get_text_config().num_hidden_layers)
    target_dtype = next(target.parameters()).dtype
    dtype = DTYPES[capture_dtype] if isinstance(capture_dtype, str) else (capture_dtype or target_dtype)
    if dtype != target_dtype:
        raise ShardError(
            f"capture dtype {dtype_name(dtype)} differs from the target's {dtype_name(target_dtype)}: "
            "the runtime feeds the head the target's own states, so load the target in the dtype it "
            f"will serve in (target.dtype: {dtype_name(dtype)}) instead of converting the states"
        )
    identity = target_identity(target, tokenizer, target_name, revision)
    settings = {
        "aux_layer_ids": list(layers),
        "max_length": max_length,
        "shard_size": shard_size,
        "batch_size": batch_size,
        "capture_dtype": dtype_name(dtype),
        "target_dtype": dtype_name(target_dtype),
        "chat_template_kwargs": chat_template_kwargs or {},
    }
    key = _capture_key(conversations, identity, settings)
    num_shards = math.ceil(len(conversations) / shard_size)
    manifest_path = out / MANIFEST
    manifest = json.loads(manifest_path.read_text()) if manifest_path.exists() else None
    if manifest is not None and manifest.get("key") != key:  # step 1
        raise ShardError(
            f"{out} holds a capture of other inputs (conversations, settings or target differ from "
            f"{manifest_path}); capture into a new folder or delete this one"
        )
    if manifest is None:
        manifest = {
            "format": FORMAT,
            "format_version": FORMAT_VERSION,
            "key": key,
            "complete": False,
            "target": identity,
            "aux_layer_ids": list(layers),
            "aux_layer_convention": AUX_LAYER_CONVENTION,
            "hidden_size": target.config.get_text_config().hidden_size,
            "capture_dtype": dtype_name(dtype),
            "target_dtype": dtype_name(target_dtype),
            "final_hidden": "hidden_states[-1], after the final norm; target logits = lm_head(final_hidden)",
            "tensors": {
                "{j}.input_ids": "int64 [T]",
                "{j}.loss_mask": "bool [T]",
                "{j}.aux_hidden": "capture_dtype [T, 3H]",
                "{j}.final_hidden": "capture_dtype [T, H]",
                "conversation_index": "int64 [n]",
            },
            **{k: settings[k] for k in ("max_length", "shard_size", "batch_size", "chat_template_kwargs")},
            "num_conversations": len(conversations),
            "num_shards": num_shards,
            "shards": [],
        }
        _sum_shards(manifest)
        _write_json_atomic(manifest_path, manifest)
    done = {e["index"]: e for e in manifest["shards"]}
    for k in tqdm(range(num_shards), desc="capture shards", disable=not progress):
        entry = done.get(k)  # step 2
        if entry and (out / entry["file"]).exists() and file_sha256(out / entry["file"]) == entry["sha256"]:
            continue
        lo, hi = k * shard_size, min(len(conversations), (k + 1) * shard_size)
        done[k] = _write_shard(
            target,
            tokenizer,
            conversations,
            index=k,
            lo=lo,
            hi=hi,
            out=out,  # steps 3-5
            aux_layer_ids=layers,
            max_length=max_length,
            batch_size=batch_size,
            dtype=dtype,
            chat_template_kwargs=chat_template_kwargs,
        )
        manifest["shards"] = [done[i] for i in sorted(done)]  # step 6
        manifest["complete"] = len(done) == num_shards
        _sum_shards(manifest)
        _write_json_atomic(manifest_path, manifest)
    if not manifest["complete"]:  # e.g. zero conversations, or every shard was already there
        manifest["complete"] = True
        _write_json_atomic(manifest_path, manifest)
    log_counts(
        logger,
        f"capture {out}",
        manifest.get("dropped", {}),
        len(conversations),
        next(iter(manifest.get("dropped_examples", [])), "?"),
    )
    return manifest


# --------------------------------------------------------------------------------------------- reading


@dataclass
class CapturedSequence:
    """One stored sequence; shapes and dtypes in the module docstring."""

    input_ids: torch.Tensor
    loss_mask: torch.Tensor
    aux_hidden: torch.Tensor
    final_hidden: torch.Tensor
    conversation_index: int


class ShardReader:
    """The sequences of a capture folder, by index or in storage order.

    With ``verify`` each shard's sha256 is checked against the manifest before its first read.
    Raises FileNotFoundError for a missing manifest or shard, ShardError for an unknown format, an
    incomplete capture (unless ``allow_incomplete``) or a shard whose bytes changed (named)."""

    def __init__(self, out_dir, verify: bool = True, allow_incomplete: bool = False):
        self.folder = Path(out_dir)
        path = self.folder / MANIFEST
        if not path.exists():
            raise FileNotFoundError(
                f"{path} not found: {self.folder} is not a capture folder "
                "(write one with write_shards / draftsmith capture)"
            )
        self.manifest = json.loads(path.read_text())
        if self.manifest.get("format") != FORMAT or self.manifest.get("format_version", 0) > FORMAT_VERSION:
            raise ShardError(f"{path}: not a {FORMAT} manifest of version <= {FORMAT_VERSION}")
        self.shards = self.manifest["shards"]
        if not self.manifest["complete"] and not allow_incomplete:
            raise ShardError(
                f"{self.folder}: capture incomplete ({len(self.shards)} of {self.manifest['num_shards']} "
                "shards); run write_shards again with the same inputs to finish it"
            )
        self.verify = verify
        self._starts = [0]
        for entry in self.shards:
            self._starts.append(self._starts[-1] + entry["sequences"])
        self._verified: set[int] = set()  # shards whose sha256 was checked
        self._headers_checked: set[int] = set()  # shards whose header was checked against the manifest
        self._open_shard: tuple[int, object] | None = None

    @property
    def aux_layer_ids(self) -> tuple[int, ...]:
        return tuple(self.manifest["aux_layer_ids"])

    @property
    def capture_dtype(self) -> torch.dtype:
        return DTYPES[self.manifest["capture_dtype"]]

    def __len__(self) -> int:
        return self._starts[-1]

    def _shard(self, k: int):
        if self._open_shard is not None and self._open_shard[0] == k:
            return self._open_shard[1]
        entry = self.shards[k]
        path = self.folder / entry["file"]
        if not path.exists():
            raise FileNotFoundError(
                f"shard {entry['file']} listed in {self.folder / MANIFEST} is missing; "
                "run write_shards again with the same inputs to recapture it"
            )
        if self.verify and k not in self._verified:
            digest = file_sha256(path)
            if digest != entry["sha256"]:
                raise ShardError(
                    f"shard {entry['file']} in {self.folder} is corrupt: sha256 {digest[:16]}... differs "
                    f"from the manifest's {entry['sha256'][:16]}...; run write_shards again with the "
                    "same inputs to recapture it"
                )
            self._verified.add(k)
        handle = safe_open(str(path), framework="pt")
        if k not in self._headers_checked:
            self._check_header(handle, entry)
            self._headers_checked.add(k)
        self._open_shard = (k, handle)
        return handle

    def _check_header(self, f, entry: dict) -> None:
        """A shard's tensors against its manifest entry: sequence count, token total, widths, dtypes."""
        where = f"shard {entry['file']} in {self.folder}"
        meta = f.metadata() or {}
        if meta.get("capture_dtype") != self.manifest["capture_dtype"]:
            raise ShardError(
                f"{where} holds {meta.get('capture_dtype')} states; the manifest says {self.manifest['capture_dtype']}"
            )
        n = entry["sequences"]
        if list(f.get_slice("conversation_index").get_shape()) != [n]:
            raise ShardError(f"{where} does not hold the {n} sequences its manifest entry lists")
        h, st_dtype, tokens = self.manifest["hidden_size"], ST_DTYPES[self.capture_dtype], 0
        for j in range(n):
            (t,) = f.get_slice(f"{j}.input_ids").get_shape()
            for name, shape, dtype in (
                ("loss_mask", [t], "BOOL"),
                ("aux_hidden", [t, len(self.aux_layer_ids) * h], st_dtype),
                ("final_hidden", [t, h], st_dtype),
            ):
                piece = f.get_slice(f"{j}.{name}")
                if list(piece.get_shape()) != shape or piece.get_dtype() != dtype:
                    raise ShardError(
                        f"{where}: {j}.{name} is {piece.get_dtype()} {piece.get_shape()}, expected {dtype} {shape}"
                    )
            tokens += t
        if tokens != entry["tokens"]:
            raise ShardError(f"{where} holds {tokens} tokens; its manifest entry says {entry['tokens']}")

    def _read(self, k: int, j: int) -> CapturedSequence:
        f = self._shard(k)
        seq = CapturedSequence(
            f.get_tensor(f"{j}.input_ids"),
            f.get_tensor(f"{j}.loss_mask"),
            f.get_tensor(f"{j}.aux_hidden"),
            f.get_tensor(f"{j}.final_hidden"),
            int(f.get_slice("conversation_index")[j : j + 1][0]),
        )
        vocab = self.manifest["target"].get("vocab_size")
        ids = seq.input_ids
        if ids.numel() and (int(ids.min()) < 0 or (vocab is not None and int(ids.max()) >= vocab)):
            raise ShardError(
                f"sequence {j} of {self.shards[k]['file']}: token ids outside the target's vocab 0..{vocab}"
            )
        if not (torch.isfinite(seq.aux_hidden).all() and torch.isfinite(seq.final_hidden).all()):
            raise ShardError(f"sequence {j} of {self.shards[k]['file']}: hidden states hold NaN/inf")
        return seq

    def __getitem__(self, i: int) -> CapturedSequence:
        i = i + len(self) if i < 0 else i
        if not 0 <= i < len(self):
            raise IndexError(f"sequence {i} out of range for a capture of {len(self)}")
        k = bisect.bisect_right(self._starts, i) - 1
        return self._read(k, i - self._starts[k])

    def lengths(self) -> list[int]:
        """Tokens of every stored sequence, in index order (read from shard headers, no tensor data)."""
        return [
            int(self._shard(k).get_slice(f"{j}.input_ids").get_shape()[0])
            for k, entry in enumerate(self.shards)
            for j in range(entry["sequences"])
        ]

    def __iter__(self):
        for k, entry in enumerate(self.shards):
            for j in range(entry["sequences"]):
                yield self._read(k, j)

    def check_target(self, target, tokenizer=None) -> None:
        """Raise ShardError unless ``target`` (and ``tokenizer``) are the ones the capture was made with,
        running in the capture's dtype (the runtime feeds the head states in the target's dtype).

        ``target``: a transformers model or an ``core.target.TargetModel`` (its ``.model``)."""

        target = target.model if isinstance(target, TargetModel) else target
        now = target_identity(target, tokenizer)
        keys = ["architecture_sha256"] + (["tokenizer_sha256", "chat_template_sha256"] if tokenizer is not None else [])
        wrong = [k for k in keys if now[k] != self.manifest["target"].get(k)]
        if wrong:
            raise ShardError(
                f"{self.folder} was captured from {self.manifest['target'].get('name_or_path')!r}; "
                f"this target differs in {', '.join(wrong)}"
            )
        dtype = next(target.parameters()).dtype
        if dtype != self.capture_dtype:
            raise ShardError(
                f"{self.folder} holds {self.manifest['capture_dtype']} states, but this target runs in "
                f"{dtype_name(dtype)}: the head would train on other states than the runtime feeds it; "
                f"load the target in {self.manifest['capture_dtype']} or capture again"
            )

    @staticmethod
    @torch.no_grad()
    def target_logits(lm_head, final_hidden: torch.Tensor) -> torch.Tensor:
        """The target's logits [..., V] from stored final hidden states [..., H] (cast to lm_head's dtype)."""
        weight = getattr(lm_head, "weight", None)
        if weight is not None:
            final_hidden = final_hidden.to(device=weight.device, dtype=weight.dtype)
        return lm_head(final_hidden)
