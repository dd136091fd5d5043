"""Export, check and load a DFlash drafter directory (draftsmith and vLLM formats in one).

    export_dflash(head, "runs/reference-dflash/head", target_identity(target, tokenizer, "reference"))
    report = check_dflash("runs/reference-dflash/head", target, tokenizer)          # `draftsmith check`
    head, meta = load_dflash("runs/reference-dflash/head", target_model=target, tokenizer=tokenizer)

Layout (written into a temp directory beside it, fsynced, renamed into place: ``export.writer``):
    model.safetensors   vLLM's ``DFlashQwen3Model`` names without their ``model.`` prefix: ``fc.weight`` [H, n·H],
                        ``hidden_norm.weight``, ``norm.weight``, ``layers.{i}.self_attn.{q,k,v,o}_proj.weight``,
                        ``layers.{i}.self_attn.{q,k}_norm.weight``, ``layers.{i}.{input,post_attention}_layernorm
                        .weight``, ``layers.{i}.mlp.{gate,up,down}_proj.weight``. No ``embed_tokens`` and no
                        ``lm_head``: vLLM then shares the target's (``llm_base_proposer._maybe_share_embeddings`` /
                        ``_maybe_share_lm_head``), as the drafter was trained with them.
    config.json         a Qwen3 config (``architectures: [DFlashDraftModel]``, ``model_type: qwen3``: vLLM's registry
                        maps it to ``qwen3_dflash.DFlashQwen3ForCausalLM``) with ``dflash_config: {mask_token_id,
                        target_layer_ids}`` (read by ``v1/spec_decode/llm_base_proposer.py`` and
                        ``eagle3_utils.get_eagle3_aux_layers_from_config``), ``block_size`` and ``num_target_layers``
                        (z-lab's fields, recorded), no ``causal`` / ``layer_types`` (non-causal: the default)
    draftsmith.json     ``head_type: dflash``, the drafter config, ``aux_layer_ids`` (HF index), the target's
                        identity, training, eval, the weight file's sha256
    README.md           the model card
vLLM serves it with ``--speculative-config '{"method": "dflash", "model": DIR, "num_speculative_tokens": k}'``.

Checks (``check_dflash``; refusals are ``HeadMismatchError`` naming the field, both values and the fix): format and
head_type; the config builds (no unknown field); the recorded aux_layer_ids are target_layer_ids + 1; one listed
weight file, hashed, every tensor present with its shape and none other; config.json read as vLLM reads it equals
the recorded drafter; the target's identity (``export.check``); the drafter's hidden size, vocabulary and depth
fit the target (never overridable: it reads the target's layers and uses its embedding and lm_head).
"""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any

import torch

from draftsmith.core.aux_layers import AUX_LAYER_CONVENTION
from draftsmith.drafters.dflash.head import DFlashConfig, DFlashHead, expected_weight_shapes
from draftsmith.export.card import write_model_card
from draftsmith.export.check import (
    WEIGHTS_FILE,
    CheckReport,
    check_allow_mismatch,
    check_recorded_target,
    verified_weight_file,
)
from draftsmith.export.metadata import HeadMetadata, HeadMismatchError, read_metadata, write_json_atomic, write_metadata
from draftsmith.export.writer import save_safetensors, staged_directory
from draftsmith.identity import file_sha256

logger = logging.getLogger(__name__)

HEAD_TYPE = "dflash"
DFLASH_FORMATS = ("draftsmith", "vllm")
VLLM_ARCHITECTURE = "DFlashDraftModel"  #: vllm/model_executor/models/registry.py -> qwen3_dflash


def dflash_formats(formats) -> tuple[str, ...]:
    """``--format`` values for DFlash: draftsmith (always) and vllm, ``all`` = both.

    Raises ValueError for sglang / speculators (this export's layout is vLLM's) or an unknown name."""
    asked = set(formats or ()) | {"draftsmith"}
    if "all" in asked:
        asked = (asked - {"all"}) | set(DFLASH_FORMATS)
    unknown = sorted(asked - set(DFLASH_FORMATS))
    if unknown:
        raise ValueError(
            f"format(s) {unknown}: a DFlash drafter exports as {', '.join(DFLASH_FORMATS)} (one directory, the "
            "layout vLLM loads as method dflash) or all"
        )
    return tuple(f for f in DFLASH_FORMATS if f in asked)


def vllm_config(c: DFlashConfig, dtype: str) -> dict:
    """config.json as vLLM reads a DFlash drafter (module docstring)."""
    rope = {"rope_type": "default", **(c.rope_scaling or {}), "rope_theta": c.rope_theta}
    return {
        "architectures": [VLLM_ARCHITECTURE],
        "model_type": "qwen3",
        "hidden_size": c.hidden_size,
        "intermediate_size": c.intermediate_size,
        "num_hidden_layers": c.num_hidden_layers,
        "num_attention_heads": c.num_attention_heads,
        "num_key_value_heads": c.num_key_value_heads,
        "head_dim": c.head_dim,
        "vocab_size": c.vocab_size,
        "rms_norm_eps": c.rms_norm_eps,
        "rope_theta": c.rope_theta,
        "rope_parameters": rope,
        **({"rope_scaling": dict(c.rope_scaling)} if c.rope_scaling else {}),
        "max_position_embeddings": c.max_position_embeddings,
        "hidden_act": c.hidden_act,
        "attention_bias": False,
        "tie_word_embeddings": False,
        "block_size": c.block_size,
        "num_target_layers": c.num_target_layers,
        "dflash_config": {"mask_token_id": c.mask_token_id, "target_layer_ids": list(c.target_layer_ids)},
        "torch_dtype": dtype,
    }


def config_from_vllm(cfg: dict) -> DFlashConfig:
    """The drafter config.json describes, read with vLLM's precedence (``dflash_config`` first).

    Raises ValueError / KeyError for a config vLLM would not build a DFlash drafter from."""
    if VLLM_ARCHITECTURE not in (cfg.get("architectures") or []):
        raise ValueError(f"architectures {cfg.get('architectures')} do not name {VLLM_ARCHITECTURE}")
    dflash = cfg.get("dflash_config") or {}
    if cfg.get("causal", dflash.get("causal")) or any(t == "sliding_attention" for t in cfg.get("layer_types") or []):
        raise ValueError("a causal or sliding-window DFlash layout; draftsmith drafters are non-causal, full attention")
    rope = dict(cfg.get("rope_parameters") or {})
    theta = float(rope.pop("rope_theta", cfg.get("rope_theta", 1_000_000.0)))  # vLLM's default for a Qwen3 draft
    scaling = rope if rope.get("rope_type", "default") != "default" else None
    return DFlashConfig(
        hidden_size=cfg["hidden_size"],
        intermediate_size=cfg["intermediate_size"],
        num_hidden_layers=cfg["num_hidden_layers"],
        num_attention_heads=cfg["num_attention_heads"],
        num_key_value_heads=cfg["num_key_value_heads"],
        head_dim=cfg.get("head_dim") or cfg["hidden_size"] // cfg["num_attention_heads"],
        vocab_size=cfg["vocab_size"],
        target_layer_ids=tuple(dflash["target_layer_ids"]),
        block_size=cfg["block_size"],
        mask_token_id=dflash.get("mask_token_id", cfg.get("mask_token_id")),
        num_target_layers=cfg["num_target_layers"],
        rms_norm_eps=cfg["rms_norm_eps"],
        rope_theta=theta,
        rope_scaling=scaling,
        max_position_embeddings=cfg["max_position_embeddings"],
        hidden_act=cfg.get("hidden_act", "silu"),
    )


def _fits_target(c: DFlashConfig, target: dict, where: str) -> None:
    """The drafter reads the target's layers and uses its embedding and lm_head: hidden size, vocabulary and
    depth must be the target's (never overridable)."""
    for field, head_value in (
        ("hidden_size", c.hidden_size),
        ("vocab_size", c.vocab_size),
        ("num_hidden_layers", c.num_target_layers),
    ):
        value = target.get(field)
        if value is not None and int(value) != int(head_value):
            raise HeadMismatchError(
                field,
                f"{where}: {field}: the DFlash drafter was built for {head_value}, the target has {value}; it "
                f"cannot run on this target (not overridable). Fix: use the target it was trained for, or train "
                f"a drafter for this one.",
            )


def export_dflash(
    head: DFlashHead,
    out_dir: str | Path,
    target_identity: dict,
    training: dict | None = None,
    formats=("draftsmith",),
    *,
    eval: dict | None = None,
) -> Path:
    """Write ``head`` to ``out_dir`` as the module docstring describes; returns ``out_dir``.

    Raises ValueError for a format it has no layout for; HeadMismatchError when the drafter does not fit the
    recorded target; FileExistsError for a non-empty ``out_dir`` that is not a head directory."""
    formats = dflash_formats(formats)
    out_dir = Path(out_dir)
    c = head.config
    _fits_target(c, target_identity, "export")
    sd = head.export_state_dict()
    dtype = str(sd["fc.weight"].dtype).removeprefix("torch.")
    with staged_directory(out_dir) as tmp:
        save_safetensors(sd, tmp / WEIGHTS_FILE)
        cfg = vllm_config(c, dtype)
        if config_from_vllm(cfg) != c:  # what vLLM would build
            raise RuntimeError(f"export: config.json would be read as another drafter: {cfg}")
        write_json_atomic(tmp / "config.json", cfg)
        meta = HeadMetadata(
            head_type=HEAD_TYPE,
            head_config=c.to_dict(),
            aux_layer_ids=list(c.aux_layer_ids),
            aux_layer_convention=AUX_LAYER_CONVENTION,
            draft_vocab_size=c.vocab_size,
            target=dict(target_identity),
            training=dict(training or {}),
            eval=dict(eval or {}),
            weights={WEIGHTS_FILE: file_sha256(tmp / WEIGHTS_FILE)},
        )
        write_metadata(tmp, meta)
    write_model_card(out_dir, dflash_card_lines)
    logger.info(
        "exported DFlash drafter (%d layers, block %d) to %s (%s)",
        c.num_hidden_layers,
        c.block_size,
        out_dir,
        ", ".join(formats),
    )
    return out_dir


def _head_config(meta: HeadMetadata, where: str) -> DFlashConfig:
    if meta.head_type != HEAD_TYPE:
        raise HeadMismatchError(
            "head_type",
            f"{where}: head_type is {meta.head_type!r}, not {HEAD_TYPE!r}. Fix: load it with the loader for its "
            f"type (method {meta.head_type!r}).",
        )
    try:
        c = DFlashConfig.from_dict(meta.head_config)
    except (TypeError, ValueError) as e:
        raise HeadMismatchError(
            "head_config", f"{where}: head_config: {e}. Fix: upgrade draftsmith, or re-export the drafter."
        ) from None
    if list(meta.aux_layer_ids or []) != list(c.aux_layer_ids):
        raise HeadMismatchError(
            "aux_layer_ids",
            f"{where}: aux_layer_ids: draftsmith.json records {meta.aux_layer_ids}, its target_layer_ids "
            f"{list(c.target_layer_ids)} read hidden states {list(c.aux_layer_ids)}. Fix: re-export the drafter; "
            "never edit draftsmith.json by hand.",
        )
    if meta.draft_vocab_size != c.vocab_size:
        raise HeadMismatchError(
            "draft_vocab_size",
            f"{where}: draft_vocab_size {meta.draft_vocab_size} is not the drafter's vocab_size {c.vocab_size} (a "
            "DFlash drafter predicts over the target's vocabulary). Fix: re-export the drafter.",
        )
    return c


def _verified_state_dict(head_dir: Path, meta: HeadMetadata, c: DFlashConfig, where: str) -> dict[str, torch.Tensor]:
    """``export.check.verified_weight_file`` against the drafter's geometry."""
    return verified_weight_file(head_dir, meta, expected_weight_shapes(c), where, "DFlash drafter")


def _check_vllm_config(head_dir: Path, c: DFlashConfig, where: str) -> None:
    try:
        seen = config_from_vllm(json.loads((head_dir / "config.json").read_text(encoding="utf-8")))
    except (OSError, ValueError, TypeError, KeyError) as e:
        raise HeadMismatchError(
            "config",
            f"{where}: config: config.json cannot be read as vLLM's DFlash config ({e}). Fix: re-export the "
            "drafter with `draftsmith export`.",
        ) from None
    if seen != c:
        diff = [
            f"{k}: config.json {v!r} vs draftsmith.json {getattr(c, k)!r}"
            for k, v in seen.to_dict().items()
            if v != c.to_dict()[k]
        ]
        raise HeadMismatchError(
            "config",
            f"{where}: config.json as vLLM reads it disagrees with draftsmith.json: {'; '.join(diff)}. Fix: "
            "re-export the drafter; never edit an exported config by hand.",
        )


def _check(head_dir, target_config, tokenizer, name_or_path, allow_mismatch):
    head_dir = Path(head_dir)
    where = str(head_dir)
    allow_mismatch = check_allow_mismatch(allow_mismatch)
    meta = read_metadata(head_dir)
    c = _head_config(meta, where)
    sd = _verified_state_dict(head_dir, meta, c, where)
    _check_vllm_config(head_dir, c, where)
    _fits_target(c, meta.target, where)
    actual, overridden, warnings = check_recorded_target(
        meta, target_config, tokenizer, name_or_path, allow_mismatch, where
    )
    if actual is not None:
        _fits_target(c, actual, where)
    report = CheckReport(
        head_dir,
        meta,
        list(overridden),
        warnings,
        checked_target=actual is not None,
        override_values=overridden,
        allow_mismatch=allow_mismatch,
    )
    return report, sd, c


def check_dflash(
    head_dir: str | Path,
    target_config: Any = None,
    tokenizer: Any = None,
    name_or_path: str | None = None,
    allow_mismatch=(),
) -> CheckReport:
    """Every check of the module docstring against ``target_config`` (a model, config or dict; None checks the
    export's own integrity). Raises HeadMismatchError on refusal, ValueError for an unknown ``allow_mismatch``."""
    report, _, _ = _check(head_dir, target_config, tokenizer, name_or_path, allow_mismatch)
    return report


def load_dflash(
    head_dir: str | Path, target_model: Any = None, tokenizer: Any = None, allow_mismatch=()
) -> tuple[DFlashHead, HeadMetadata]:
    """Check (as ``check_dflash``) then build the drafter in its exported dtype, in eval mode (embedding and
    lm_head still to bind: ``DFlashHead.bind_target``). The weights loaded are the bytes that were hashed."""
    report, sd, c = _check(head_dir, target_model, tokenizer, None, allow_mismatch)
    head = DFlashHead(c).to(sd["fc.weight"].dtype)
    head.load_export_state_dict(sd)
    return head.eval(), report.metadata


def reexport_dflash(head_dir: str | Path, out_dir: str | Path, formats=("all",)) -> Path:
    """The export again elsewhere, unchanged (verified first; records carried over). Raises ValueError when
    ``out_dir`` is ``head_dir``; HeadMismatchError for a broken source."""
    head_dir, out_dir = Path(head_dir), Path(out_dir)
    if head_dir.resolve() == out_dir.resolve():
        raise ValueError(f"re-export of {head_dir} onto itself; choose another --out")
    head, meta = load_dflash(head_dir)
    return export_dflash(head, out_dir, meta.target, training=meta.training, formats=formats, eval=meta.eval)


def dflash_card_lines(head_dir: Path, meta, k: int | None) -> list[str]:
    """Front matter, serve commands and geometry of a DFlash drafter."""
    target, c = meta.target, meta.head_config
    name = target.get("name_or_path")
    k = int(k or c.get("block_size", 2) - 1)
    spec = f'{{"method": "dflash", "model": "{head_dir}", "num_speculative_tokens": {k}}}'
    return [
        "---",
        "library_name: draftsmith",
        "tags: [speculative-decoding, dflash, block-drafter]",
        f"base_model: {name}",
        "---",
        "",
        f"# DFlash drafter for `{name}`",
        "",
        "A DFlash block drafter (Chen et al. 2026: a few decoder layers whose keys and values include the "
        "target's fused hidden states; the block [last token, mask, ...] is drafted in one forward) made with "
        "draftsmith. It uses the target's embedding and lm_head (not shipped). `draftsmith.json` records the "
        "target's identity, the training data and the sha256 of the weight file; `draftsmith check` refuses a "
        "mismatched target.",
        "",
        "## Serve",
        "",
        "```bash",
        "# draftsmith (checks this drafter against the target before serving)",
        f"draftsmith serve --target {name} --speculative-config '{spec}'",
        "# vLLM (method dflash; config.json is its DFlashDraftModel layout)",
        f"vllm serve {name} --speculative-config '{spec}'",
        "```",
        "",
        "## Drafter",
        "",
        f"- target: `{name}` ({', '.join(target.get('architectures') or [])}, {target.get('num_hidden_layers')} "
        f"layers, hidden {target.get('hidden_size')}, vocab {target.get('vocab_size')})",
        f"- {c.get('num_hidden_layers')} draft layers; block_size {c.get('block_size')} (at most "
        f"{int(c.get('block_size', 2)) - 1} drafts per step); target_layer_ids {c.get('target_layer_ids')} "
        f"(hidden states {meta.aux_layer_ids}); mask_token_id {c.get('mask_token_id')}",
        "",
    ]
