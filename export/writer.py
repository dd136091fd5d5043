"""Write a trained EAGLE-3 head as a self-describing directory that vLLM and SGLang can serve.

    ident = target_identity(target, tokenizer, "meta-llama/Llama-3.1-8B-Instruct")
    export_eagle3(head, "runs/eagle3/head", ident, target.config, training={"tokens": 12_000_000},
                  formats=("draftsmith", "speculators"))

Layout of ``out_dir`` (everything is written to a temp directory beside it, fsynced, then renamed
into place, so a reader never sees a half-written head):
    model.safetensors   fc / midlayer.* / norm / lm_head (+ d2t, t2d when Vd < V); no ``model.``
                        prefix, no biases, no embedding
    config.json         ``LlamaForCausalLMEagle3`` config read by SGLang and by vLLM ``method: eagle3``
    draftsmith.json     our metadata (export/metadata.py), with the sha256 of every weight file
    speculators/        (format "speculators") config.json + model.safetensors (``layers.0.*``)
                        for ``vllm serve out_dir/speculators``

Engine facts the config follows (read in their source; see the export issue for file names):
- vLLM and SGLang size ``fc`` as 3 * ``target_hidden_size`` when the key exists (a null crashes
  both), and SGLang gives ``fc`` a bias when a key ``bias`` is truthy: so we write
  ``target_hidden_size`` = H and no key named ``bias``.
- aux layers: vLLM reads top-level ``eagle_aux_hidden_state_layer_ids`` as HF hidden_states
  indices; SGLang reads ``eagle_config.eagle_aux_hidden_state_layer_ids`` and adds one. We write both,
  always (vLLM warns and falls back to its default when the ids are absent).
- vLLM's speculators path defaults ``norm_before_residual`` to true when absent: written explicitly.
"""
from __future__ import annotations

import logging
import os
import shutil
import tempfile
from pathlib import Path
from typing import Any

import torch

from draftsmith.export.check import WEIGHTS_FILE, validate_aux_layer_ids, validate_state_dict
from draftsmith.export.identity import config_dict, file_sha256, rope_settings, tensor_sha256
from draftsmith.export.metadata import (AUX_LAYER_CONVENTION, METADATA_FILE, HeadMetadata, write_json_atomic,
                                        write_metadata)

logger = logging.getLogger(__name__)

FORMATS = ("draftsmith", "speculators")
SPECULATORS_DIR = "speculators"


def _rope_keys(theta: float, scaling: dict | None) -> dict:
    """RoPE in both spellings: ``rope_theta``/``rope_scaling`` (transformers 4, older engines) and
    ``rope_parameters`` (transformers 5); transformers 5 prefers the latter when both are present."""
    return {"rope_theta": theta, "rope_scaling": scaling,
            "rope_parameters": {"rope_type": "default", **(scaling or {}), "rope_theta": theta}}


def _verifier_path(name_or_path: str | None) -> str | None:
    """What vLLM can load as the verifier: draftsmith's aliases (``reference``) become their folders."""
    from draftsmith import reference

    return reference.resolve(name_or_path) if name_or_path else name_or_path


def _layer_config(hc: dict, target_cfg: dict, dtype: str) -> dict:
    """The Llama-style geometry shared by both config formats."""
    theta, scaling = hc["rope_theta"], hc.get("rope_scaling")
    return {
        "model_type": "llama",
        "num_hidden_layers": 1,
        "hidden_size": hc["hidden_size"],
        "intermediate_size": hc["intermediate_size"],
        "num_attention_heads": hc["num_attention_heads"],
        "num_key_value_heads": hc["num_key_value_heads"],
        "head_dim": hc["head_dim"],
        "hidden_act": hc.get("hidden_act", "silu"),
        "rms_norm_eps": hc["rms_norm_eps"],
        "vocab_size": hc["vocab_size"],
        "max_position_embeddings": max(int(hc["max_position_embeddings"]),
                                       int(target_cfg.get("max_position_embeddings") or 0)),
        **_rope_keys(float(theta), scaling),
        "tie_word_embeddings": False,
        "attention_bias": False,
        "mlp_bias": False,
        "torch_dtype": dtype,
    }


def eagle3_engine_config(hc: dict, target_cfg: dict, dtype: str = "float32") -> dict:
    """config.json for SGLang and vLLM (``LlamaForCausalLMEagle3``); ``hc`` is Eagle3Config.to_dict()."""
    aux = [int(i) for i in hc["aux_layer_ids"]]
    return {
        "architectures": ["LlamaForCausalLMEagle3"],
        **_layer_config(hc, target_cfg, dtype),
        "draft_vocab_size": hc["draft_vocab_size"],
        "target_hidden_size": hc["hidden_size"],
        "norm_before_residual": bool(hc.get("norm_before_residual", False)),
        "norm_before_fc": False,
        "eagle_aux_hidden_state_layer_ids": aux,                     # vLLM: HF hidden_states index
        "eagle_config": {"eagle_aux_hidden_state_layer_ids": [i - 1 for i in aux],  # SGLang: one lower
                         "use_aux_hidden_state": True},
    }


def eagle3_speculators_config(hc: dict, target_cfg: dict, identity: dict, speculative_tokens: int,
                              dtype: str = "float32") -> dict:
    """config.json in the vllm-project/speculators format (``speculators_model_type: eagle3``)."""
    return {
        "architectures": ["Eagle3Speculator"],
        "speculators_model_type": "eagle3",
        "transformer_layer_config": {"architectures": ["LlamaForCausalLM"], **_layer_config(hc, target_cfg, dtype)},
        "draft_vocab_size": hc["draft_vocab_size"],
        "target_hidden_size": hc["hidden_size"],
        "norm_before_residual": bool(hc.get("norm_before_residual", False)),
        "norm_before_fc": False,
        "embed_requires_grad": False,
        "eagle_aux_hidden_state_layer_ids": [int(i) for i in hc["aux_layer_ids"]],  # HF index, as vLLM
        "speculators_config": {
            "algorithm": "eagle3",
            "proposal_methods": [{"proposal_type": "greedy", "speculative_tokens": int(speculative_tokens),
                                  "verifier_accept_k": 1, "accept_tolerance": 0.0}],
            "default_proposal_method": "greedy",
            "verifier": {"name_or_path": _verifier_path(identity.get("name_or_path")),
                         "architectures": list(identity.get("architectures") or [])},
        },
        "torch_dtype": dtype,
    }


def _check_head_fits_target(hc: dict, target_cfg: dict) -> None:
    for key in ("hidden_size", "vocab_size"):
        if hc[key] != target_cfg.get(key):
            raise ValueError(f"export: head {key} {hc[key]} != target {key} {target_cfg.get(key)}; "
                             f"this head was not built for this target")
    validate_aux_layer_ids(hc["aux_layer_ids"], AUX_LAYER_CONVENTION, target_cfg.get("num_hidden_layers"), "export")
    if 0 in [int(i) for i in hc["aux_layer_ids"]]:
        logger.warning("export: aux layer id 0 (the embeddings) is not servable by vLLM/SGLang")
    theta, scaling = rope_settings(target_cfg)
    if (float(hc["rope_theta"]), hc.get("rope_scaling") or None) != (theta, scaling):
        logger.warning("export: head RoPE (theta %s, scaling %s) differs from the target's (theta %s, scaling %s); "
                       "the head's own settings are written", hc["rope_theta"], hc.get("rope_scaling"), theta, scaling)
    if hc.get("norm_before_residual"):
        logger.warning("export: norm_before_residual=true; SGLang ignores this flag and will serve the head wrong")


def _save_safetensors(sd: dict[str, torch.Tensor], path: Path) -> None:
    from safetensors.torch import save_file

    save_file({k: v.detach().to("cpu").contiguous().clone() for k, v in sd.items()}, str(path),
              metadata={"format": "pt"})


def _fsync_tree(root: Path) -> None:
    for p in sorted(root.rglob("*")):
        if p.is_file():
            with open(p, "rb") as f:
                os.fsync(f.fileno())


def _install(tmp: Path, out_dir: Path) -> None:
    """Move the finished temp dir to ``out_dir``; a previous head export there is replaced, any
    other non-empty directory is refused."""
    if out_dir.exists():
        if any(out_dir.iterdir()) and not (out_dir / METADATA_FILE).is_file():
            raise FileExistsError(f"{out_dir} exists, is not empty and is not a draftsmith head; "
                                  f"choose another output directory")
        old = Path(tempfile.mkdtemp(dir=out_dir.parent, prefix=f".{out_dir.name}.old-"))
        os.replace(out_dir, old / out_dir.name)
        try:
            os.replace(tmp, out_dir)
        except BaseException:
            os.replace(old / out_dir.name, out_dir)  # put the previous export back
            shutil.rmtree(old, ignore_errors=True)
            raise
        shutil.rmtree(old, ignore_errors=True)
    else:
        os.replace(tmp, out_dir)


def export_eagle3(head: Any, out_dir: str | Path, target_identity: dict, target_config: Any,
                  training: dict | None = None, formats=("draftsmith",), *, eval: dict | None = None,
                  speculative_tokens: int | None = None) -> Path:
    """Write ``head`` (an Eagle3Head) to ``out_dir`` as described in the module docstring.

    ``target_identity`` comes from ``export.identity.target_identity``; ``target_config`` is the
    target's config (model, config or dict) used for RoPE and max_position_embeddings;
    ``speculative_tokens`` (speculators format) defaults to the head's ttt_steps. Returns out_dir."""
    formats = tuple(formats)
    unknown = sorted(set(formats) - set(FORMATS))
    if unknown or "draftsmith" not in formats:
        raise ValueError(f"formats {formats}: known formats are {FORMATS}, and 'draftsmith' (model.safetensors, "
                         f"config.json, draftsmith.json) is always written")
    out_dir = Path(out_dir)
    hc = head.config.to_dict()
    target_cfg = config_dict(target_config)
    _check_head_fits_target(hc, target_cfg)
    sd = head.export_state_dict()
    validate_state_dict(sd, hc, "export")
    dtype = str(sd["fc.weight"].dtype).removeprefix("torch.")
    ttt_steps = int(hc.get("ttt_steps", 7))

    out_dir.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(dir=out_dir.parent, prefix=f".{out_dir.name}.tmp-"))
    try:
        _save_safetensors(sd, tmp / WEIGHTS_FILE)
        write_json_atomic(tmp / "config.json", eagle3_engine_config(hc, target_cfg, dtype))
        weight_files = [WEIGHTS_FILE]
        if "speculators" in formats:
            spec = tmp / SPECULATORS_DIR
            spec.mkdir()
            renamed = {k.replace("midlayer.", "layers.0.", 1): v for k, v in sd.items()}
            _save_safetensors(renamed, spec / WEIGHTS_FILE)
            write_json_atomic(spec / "config.json", eagle3_speculators_config(
                hc, target_cfg, target_identity, speculative_tokens or ttt_steps, dtype))
            weight_files.append(f"{SPECULATORS_DIR}/{WEIGHTS_FILE}")
        meta = HeadMetadata(
            head_type="eagle3", head_config=hc, ttt_steps=ttt_steps,
            aux_layer_ids=[int(i) for i in hc["aux_layer_ids"]], draft_vocab_size=int(hc["draft_vocab_size"]),
            d2t_sha256=tensor_sha256(sd["d2t"]) if "d2t" in sd else None,
            target=dict(target_identity), training=dict(training or {}), eval=dict(eval or {}),
            weights={rel: file_sha256(tmp / rel) for rel in weight_files})
        write_metadata(tmp, meta)
        _fsync_tree(tmp)
        _install(tmp, out_dir)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    logger.info("exported EAGLE-3 head to %s (%s)", out_dir, ", ".join(formats))
    return out_dir
