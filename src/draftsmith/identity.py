"""The target's identity: what a draft head was trained against, as plain data with hashes.

    ident = target_identity(model, tokenizer, "meta-llama/Llama-3.1-8B-Instruct", revision="0e9e39f")

A head only works on the target whose hidden states it learned, so an export records:
- names (``name_or_path``, ``revision``, ``architectures``, ``model_type``) and the sizes a human
  reads first (``hidden_size``, ``num_hidden_layers``, ``vocab_size``);
- ``architecture``: the config fields that change the computation (canonical, see
  ``ARCHITECTURE_FIELDS``) and ``architecture_sha256`` of their canonical JSON;
- ``tokenizer_sha256``: sha256 of the canonical JSON of the sorted vocabulary, the special tokens
  (token, id) and their roles (bos/eos/pad/unk/...). BPE merges are not hashed: the same tokenizer
  serialised by two library versions must not look different, and a different merge table with an
  identical vocabulary has not been seen in practice;
- ``chat_template_sha256``: sha256 of the chat template text (None when the tokenizer has none);
- ``dtype``: the dtype the target computes in (``target_dtype``: its parameters' for a loaded model).
  In a drafter's draftsmith.json this is the CAPTURE dtype, the dtype of the target hidden states
  (or logits) it was trained on: online training runs the target as loaded, and offline training
  refuses a target in another dtype than its shards' (``ShardReader.check_target``). A serving target
  in another dtype only warns (``export.check.compare_target_identity``); records written before this
  field existed lack it (not compared, a note says so).

Canonical JSON: ``json.dumps(obj, sort_keys=True, separators=(",", ":"), ensure_ascii=False)``
encoded as UTF-8. Changing any of these definitions needs a new metadata ``format_version``.
"""

from __future__ import annotations

import hashlib
import json
from typing import Any

import torch

# Config fields that change what the target computes (absent fields hash as null).
ARCHITECTURE_FIELDS = (
    "model_type",
    "hidden_size",
    "num_hidden_layers",
    "num_attention_heads",
    "num_key_value_heads",
    "head_dim",
    "intermediate_size",
    "vocab_size",
    "hidden_act",
    "rms_norm_eps",
    "rope",
    "tie_word_embeddings",
    "attention_bias",
    "mlp_bias",
    "sliding_window",
)


def canonical_json(obj: Any) -> bytes:
    """The canonical byte form hashed everywhere in the metadata."""
    return json.dumps(obj, sort_keys=True, separators=(",", ":"), ensure_ascii=False).encode("utf-8")


def sha256_bytes(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def config_dict(model_or_config: Any) -> dict:
    """A plain dict of the target's (text) config from a model, a PretrainedConfig or a dict."""
    obj = getattr(model_or_config, "config", model_or_config)
    if isinstance(obj, dict):
        d = dict(obj)
    elif hasattr(obj, "to_dict"):
        d = obj.to_dict()
        # attributes resolved by the config class (e.g. head_dim defaulted from hidden/heads)
        for key in ("head_dim", "rope_parameters", "model_type"):
            if d.get(key) is None and getattr(obj, key, None) is not None:
                d[key] = getattr(obj, key)
    else:
        raise TypeError(f"expected a model, a transformers config or a dict, got {type(obj).__name__}")
    text = d.get("text_config")
    if d.get("hidden_size") is None and isinstance(text, dict):  # multimodal wrapper: the LM is inside
        d = {**text, "architectures": d.get("architectures"), "_name_or_path": d.get("_name_or_path")}
    if d.get("head_dim") is None and d.get("hidden_size") and d.get("num_attention_heads"):
        d["head_dim"] = d["hidden_size"] // d["num_attention_heads"]
    if d.get("num_key_value_heads") is None and d.get("num_attention_heads") is not None:
        d["num_key_value_heads"] = d["num_attention_heads"]
    return d


def rope_settings(cfg: dict) -> tuple[float, dict | None]:
    """(rope_theta, rope_scaling or None) from a config dict written by transformers 4 or 5.

    transformers 5 keeps both in ``rope_parameters`` ({"rope_type", "rope_theta", ...}); older
    configs have top-level ``rope_theta`` and ``rope_scaling`` ({"rope_type" | "type", ...})."""
    params = cfg.get("rope_parameters")
    if isinstance(params, dict) and "full_attention" in params:  # per-layer-type form: take the global one
        params = params["full_attention"]
    scaling = dict(cfg.get("rope_scaling") or {})
    if isinstance(params, dict):
        scaling = {**scaling, **params}
    theta = scaling.pop("rope_theta", None)
    if theta is None:
        theta = cfg.get("rope_theta", 10000.0)
    if "type" in scaling and "rope_type" not in scaling:
        scaling["rope_type"] = scaling.pop("type")
    scaling.pop("type", None)
    if scaling.get("rope_type", "default") == "default" and set(scaling) <= {"rope_type"}:
        return float(theta), None
    return float(theta), scaling


def architecture_fields(cfg: dict) -> dict:
    """The canonical computation-relevant fields of a target config dict."""
    theta, scaling = rope_settings(cfg)
    out = {k: cfg.get(k) for k in ARCHITECTURE_FIELDS if k != "rope"}
    out["rope"] = {"rope_theta": theta, "rope_scaling": scaling}
    return out


def tokenizer_sha256(tokenizer: Any) -> str:
    """sha256 of the canonical (vocab, special tokens, special-token roles) of a tokenizer.

    Accepts a transformers tokenizer or a ``tokenizers.Tokenizer``."""
    if hasattr(tokenizer, "all_special_ids"):  # transformers tokenizer
        vocab = tokenizer.get_vocab()
        special = sorted([tok, int(i)] for tok, i in zip(tokenizer.all_special_tokens, tokenizer.all_special_ids))
        roles = {k: v for k, v in getattr(tokenizer, "special_tokens_map", {}).items() if isinstance(v, str)}
    elif hasattr(tokenizer, "get_added_tokens_decoder"):  # tokenizers.Tokenizer
        vocab = tokenizer.get_vocab(with_added_tokens=True)
        special = sorted([t.content, int(i)] for i, t in tokenizer.get_added_tokens_decoder().items() if t.special)
        roles = {}
    else:
        raise TypeError(f"cannot hash a tokenizer of type {type(tokenizer).__name__}")
    payload = {"vocab": sorted([tok, int(i)] for tok, i in vocab.items()), "special": special, "roles": roles}
    return sha256_bytes(canonical_json(payload))


def chat_template_sha256(tokenizer: Any) -> str | None:
    """sha256 of the chat template (a str, or a dict of named templates), None when there is none."""
    template = getattr(tokenizer, "chat_template", None)
    if not template:
        return None
    data = template.encode("utf-8") if isinstance(template, str) else canonical_json(template)
    return sha256_bytes(data)


def target_dtype(model_or_config: Any) -> str | None:
    """The dtype a target computes in, by name (``"bfloat16"``): its parameters' dtype for a model; for a
    config (object or dict) its ``dtype`` / ``torch_dtype`` field, which transformers sets to the dtype a
    model was loaded in (``from_pretrained(dtype=...)``); None when unknown (a config built in memory, "auto")."""
    parameters = getattr(model_or_config, "parameters", None)
    if callable(parameters):
        first = next(iter(parameters()), None)
        if first is not None:
            return str(first.dtype).removeprefix("torch.")
    obj = getattr(model_or_config, "config", model_or_config)
    if isinstance(obj, dict):
        value = obj.get("dtype") or obj.get("torch_dtype")
    else:
        value = getattr(obj, "dtype", None)
    name = str(value).removeprefix("torch.") if value is not None else None
    return None if name in (None, "", "auto") else name


def target_identity(
    model_or_config: Any, tokenizer: Any = None, name_or_path: str | None = None, revision: str | None = None
) -> dict:
    """The identity record of a target (see module docstring); ``tokenizer`` may be None (hashes null).

    ``name_or_path`` and ``revision`` default to what the config itself records
    (``_name_or_path``, ``_commit_hash``)."""
    cfg = config_dict(model_or_config)
    architectures = cfg.get("architectures") or []
    if not architectures and hasattr(model_or_config, "config"):  # a model built from a config
        architectures = [type(model_or_config).__name__]
    arch = architecture_fields(cfg)
    return {
        "name_or_path": name_or_path or cfg.get("_name_or_path") or None,
        "revision": revision
        or cfg.get("_commit_hash")
        or getattr(getattr(model_or_config, "config", model_or_config), "_commit_hash", None),
        "architectures": list(architectures),
        "model_type": cfg.get("model_type"),
        "hidden_size": cfg.get("hidden_size"),
        "num_hidden_layers": cfg.get("num_hidden_layers"),
        "vocab_size": cfg.get("vocab_size"),
        "architecture": arch,
        "architecture_sha256": sha256_bytes(canonical_json(arch)),
        "tokenizer_sha256": tokenizer_sha256(tokenizer) if tokenizer is not None else None,
        "chat_template_sha256": chat_template_sha256(tokenizer) if tokenizer is not None else None,
        "dtype": target_dtype(model_or_config),
    }


def tensor_sha256(tensor) -> str:
    """sha256 of a tensor's raw bytes (contiguous, on CPU; little-endian on every supported host)."""

    flat = tensor.detach().to("cpu").contiguous().view(-1)
    return sha256_bytes(flat.view(torch.uint8).numpy().tobytes())


def file_sha256(path, chunk: int = 1 << 20) -> str:
    """sha256 of a file's bytes, streamed."""
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(chunk):
            h.update(block)
    return h.hexdigest()
