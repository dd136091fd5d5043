"""Check an exported head against a target, and load it: the gate between a head directory and use.

    report = check_head("runs/eagle3/head", target.config, tokenizer)       # `draftsmith check`
    head, meta = load_eagle3("runs/eagle3/head", target_model=target, tokenizer=tokenizer)
    head, meta = load_eagle3("runs/eagle3/head/speculators", target_model=target)  # a format's own weights

Both refuse (``HeadMismatchError``, a ValueError whose message names the field, both values and the
fix) when:
1. ``draftsmith.json`` has a ``format_version`` newer than this runtime, or an unknown aux-layer
   convention; its ``head_config`` holds an unknown field or a norm flag this runtime does not
   implement (``norm_before_residual: true``); its aux layer ids are not strictly ascending (vLLM and
   SGLang concatenate the states in layer order, so such a head would be fed another order than it
   was trained on: ``core.aux_layers.aux_layer_order_problem``); a top-level copy (aux_layer_ids,
   ttt_steps, draft_vocab_size) disagrees with ``head_config``;
2. a weight file listed in the metadata is missing or its sha256 differs (corrupted / modified); the
   metadata lists a file no layout has, or a ``*.safetensors`` in the directory is not listed;
3. in ANY weight file of the export (the root ``model.safetensors`` and ``speculators/model.safetensors``,
   each under its layout's names, ``formats.WEIGHT_LAYOUTS``; not only the one loaded): a tensor is
   missing (e.g. ``lm_head.weight``), unexpected (e.g. ``embed_tokens.weight``), named for another
   layout or of the wrong shape for the head's geometry; the draft vocab is reduced (Vd < V) but
   ``d2t`` is absent; ``d2t`` maps outside [0, V), maps two draft ids to one target id or holds target
   ids instead of offsets (index style); ``t2d`` disagrees with ``d2t``; d2t is not the recorded one;
   two files hold different tensors (one export is one head);
4. an engine config in the directory (``config.json``, ``speculators/config.json``) would make vLLM or
   SGLang build another head than the one recorded: another method (architectures /
   ``speculators_model_type``), an unknown or unsupported norm flag, other aux layers in that engine's
   numbering, geometry, vocab sizes, biases, RoPE (``export.formats.engine_problems``);
5. aux layer ids fall outside the target's layers [0, N-1] (HF hidden_states index);
6. the target differs from the one recorded: model_type, architectures, hidden_size,
   num_hidden_layers, vocab_size, architecture_sha256 (heads, rope, eps, ...), tokenizer_sha256;
7. (``tensor_parallel_size=N``) head or target does not shard over N ranks (heads, KV heads,
   intermediate size), every failing size named.
Step 6 fields can be overridden by name (``allow_mismatch=("tokenizer_sha256",)``, CLI
``--allow-mismatch``); overrides are logged, listed in the report with both values
(``CheckReport.record()``, which ``draftsmith eval`` writes into its report). A different revision or
chat template, or a target running in another dtype than the head's recorded capture dtype (the dtype
of the hidden states it was trained on), only warns. Nothing in steps 1-5 can be overridden: such a
head is broken, not foreign.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load as load_safetensors

from draftsmith.core.aux_layers import aux_layer_order_problem
from draftsmith.drafters.draft_model.export import check_draft_model
from draftsmith.drafters.eagle3.formats import (
    CONFIG_READERS,
    ENGINE_NAMES,
    FORMAT_DIRS,
    NOT_NORM_FLAGS,
    SUPPORTED_NORM_FLAGS,
    WEIGHT_LAYOUTS,
    engine_problems,
    export_names,
)
from draftsmith.drafters.eagle3.head import Eagle3Config, Eagle3Head
from draftsmith.drafters.eagle3.weights import validate_state_dict
from draftsmith.drafters.mlp_speculator.export import check_mlp_speculator
from draftsmith.export.check import (
    WEIGHTS_FILE,
    CheckReport,
    _check_tensor_parallel,
    check_allow_mismatch,
    check_listed_weight_files,
    check_recorded_copies,
    check_recorded_target,
    weight_file_bytes,
)
from draftsmith.export.metadata import (
    KNOWN_AUX_CONVENTIONS,
    METADATA_FILE,
    HeadMetadata,
    HeadMismatchError,
    read_metadata,
)
from draftsmith.identity import tensor_sha256


def validate_aux_layer_ids(aux_layer_ids, convention: str, num_hidden_layers: int | None, where: str = "head") -> None:
    """Known convention; ids strictly ascending (the layer order vLLM and SGLang concatenate the states
    in, ``core.aux_layers.aux_layer_order_problem``: a head trained on another order is mis-served by both);
    with ``num_hidden_layers``, ids in the target's range [0, N-1] of HF hidden_states indices."""

    if convention not in KNOWN_AUX_CONVENTIONS:
        raise HeadMismatchError(
            "aux_layer_convention",
            f"{where}: aux_layer_convention {convention!r} is not "
            f"one of {KNOWN_AUX_CONVENTIONS}. Fix: upgrade draftsmith or re-export the head.",
        )
    problem = aux_layer_order_problem(aux_layer_ids)
    if problem is not None:
        raise HeadMismatchError(
            "aux_layer_ids",
            f"{where}: {problem} (this head cannot be served as trained; a head trained on ascending ids is).",
        )
    if num_hidden_layers is None:
        return
    bad = [i for i in aux_layer_ids if not 0 <= int(i) < num_hidden_layers]
    if bad:
        raise HeadMismatchError(
            "aux_layer_ids",
            f"{where}: aux_layer_ids {list(aux_layer_ids)} ({convention}) "
            f"include {bad}, outside the target's layers [0, {num_hidden_layers - 1}]. Fix: use "
            f"the target this head was trained for, or retrain with ids in range.",
        )


def validate_head_config(head_config: dict, where: str = "head") -> None:
    """The metadata's ``head_config`` builds an ``Eagle3Config`` this runtime implements: no unknown
    field, no unknown norm flag, no norm switch other than the original EAGLE-3 layout."""

    known = {f.name for f in dataclasses.fields(Eagle3Config)}
    norms = sorted(k for k in set(head_config) - known if "norm" in k.lower() and k not in NOT_NORM_FLAGS)
    if norms:
        raise HeadMismatchError(
            "norm_flags",
            f"{where}: norm_flags: head_config has unknown norm flag(s) "
            f"{', '.join(f'{k}={head_config[k]!r}' for k in norms)}; this runtime knows "
            f"{', '.join(SUPPORTED_NORM_FLAGS)}. Fix: upgrade draftsmith, or re-export the head.",
        )
    unknown = sorted(set(head_config) - known)
    if unknown:
        raise HeadMismatchError(
            "head_config",
            f"{where}: head_config: unknown field(s) {', '.join(unknown)}. "
            f"Fix: upgrade draftsmith (the head was written by a newer one), or re-export it.",
        )
    for key, supported in SUPPORTED_NORM_FLAGS.items():
        if key in head_config and bool(head_config[key]) != supported:
            raise HeadMismatchError(
                key,
                f"{where}: {key}: head_config has {head_config[key]!r}, this runtime "
                f"implements only {supported!r} (the original EAGLE-3 layout, the one every "
                f"engine serves). Fix: serve this head with an engine that implements it, or "
                f"retrain with {key}={supported}.",
            )


def check_engine_configs(head_dir: Path, meta: HeadMetadata, target_num_layers: int | None, where: str) -> None:
    """Step 4: every engine config in ``head_dir`` read as its engines read it equals the recorded head.

    The research ``config.json`` must exist (vLLM and SGLang load the directory through it); other
    format directories are checked when present. Raises HeadMismatchError listing every difference."""

    for rel, engines in CONFIG_READERS.items():
        path = head_dir / rel
        if not path.is_file():
            if rel == "config.json":
                raise HeadMismatchError(
                    "config",
                    f"{where}: config: no config.json, which vLLM and SGLang read. "
                    f"Fix: re-export the head with `draftsmith export`.",
                )
            continue
        try:
            cfg = json.loads(path.read_text(encoding="utf-8"))
        except (OSError, ValueError) as e:
            raise HeadMismatchError(
                "config", f"{where}: config: {rel} cannot be read ({e}). Fix: re-export the head."
            ) from e
        problems = []
        for engine in engines:
            problems += [
                (f, f"{rel} as {ENGINE_NAMES[engine]}: {m}")
                for f, m in engine_problems(engine, cfg, meta.head_config, meta.head_type, target_num_layers)
            ]
        if problems:
            raise HeadMismatchError(
                problems[0][0],
                f"{where}: {rel} disagrees with draftsmith.json (the head that "
                f"was trained; engines read the config):\n  - "
                + "\n  - ".join(m for _, m in problems)
                + "\nFix: re-export the head with `draftsmith export`; never edit an exported "
                "config by hand.",
            )


def eagle3_file_state_dict(data: bytes, rel: str, meta: HeadMetadata, at: str) -> dict[str, torch.Tensor]:
    """Weight file ``rel`` of an EAGLE-3 export (``formats.WEIGHT_LAYOUTS``), parsed and checked as its layout
    implies; returned under our export names (``midlayer.*``). ``at`` names the file in messages.

    Refuses (HeadMismatchError): an unparsable file; names of another layout (``midlayer.*`` in the
    speculators file); a missing, unexpected or misshapen tensor (``validate_state_dict``); a d2t that is
    no offset map (index style: target ids) or t2d disagreeing with it; a d2t other than the recorded one."""

    try:
        raw = load_safetensors(data)
    except Exception as e:  # noqa: BLE001 - a file matching its hash but unparsable was exported broken
        raise HeadMismatchError("weights", f"{at}: weights: the file cannot be read ({e}). Fix: re-export.") from e
    sd, misnamed = export_names(raw, rel)
    if misnamed:
        raise HeadMismatchError(
            "weights",
            f"{at}: weights: tensor(s) {', '.join(misnamed[:4])}"
            f"{' ...' if len(misnamed) > 4 else ''} are named for another layout; this file's "
            f"layout names the decoder layer {WEIGHT_LAYOUTS[rel]}*. Fix: re-export with "
            f"`draftsmith export`; never convert an exported file by hand.",
        )
    validate_state_dict(sd, meta.head_config, at)
    got_d2t = tensor_sha256(sd["d2t"]) if "d2t" in sd else None
    if got_d2t != meta.d2t_sha256:
        raise HeadMismatchError(
            "d2t_sha256",
            f"{at}: d2t_sha256: the d2t tensor hashes to {got_d2t}, "
            f"draftsmith.json records {meta.d2t_sha256}. Fix: re-export the head.",
        )
    return sd


def _check_same_head(digests: dict[str, dict[str, str]], ref: str, root: Path) -> None:
    """Every weight file holds the tensors of ``ref`` (per-tensor sha256 ``digests[rel]``): one export, one head."""
    for rel, digest in sorted(digests.items()):
        differ = sorted(k for k in digest if digest[k] != digests[ref].get(k))
        if differ:
            raise HeadMismatchError(
                "weights",
                f"{root / rel}: weights: {', '.join(differ[:4])}"
                f"{' ...' if len(differ) > 4 else ''} hold other values than in {ref}; every "
                f"weight file of an export holds the one head draftsmith.json describes. Fix: "
                f"re-export the head with `draftsmith export --format all`.",
            )


EAGLE3_REQUIRED = ("ttt_steps", "aux_layer_ids")  # draftsmith.json fields optional for others, not for EAGLE-3


def _check(
    head_dir: str | Path,
    target_config: Any,
    tokenizer: Any,
    name_or_path: str | None,
    allow_mismatch,
    tensor_parallel_size: int | None = None,
) -> tuple[CheckReport, dict[str, torch.Tensor]]:
    """All checks of the module docstring; returns the report and the verified state dict (of the format
    sub-directory's own weight file when ``head_dir`` is one, under our export names)."""

    given = Path(head_dir)
    head_dir, sub = resolve_head_dir(given)
    allow_mismatch = check_allow_mismatch(allow_mismatch)
    meta = read_metadata(head_dir)
    where = str(given)
    if meta.head_type != "eagle3":
        raise HeadMismatchError(
            "head_type",
            f"{where}: head_type is {meta.head_type!r}, not 'eagle3'. Fix: check or "
            f"load it as a {meta.head_type} export (`draftsmith check` finds it by itself).",
        )
    missing = [name for name in EAGLE3_REQUIRED if getattr(meta, name) is None]
    if missing:
        raise HeadMismatchError(
            missing[0],
            f"{head_dir / METADATA_FILE}: missing key(s) {', '.join(missing)}. Fix: "
            "re-export the head with draftsmith.",
        )
    # 1. the recorded head is one this runtime implements (and the engines serve: aux ids in layer order)
    validate_head_config(meta.head_config, where)
    validate_aux_layer_ids(
        meta.head_config.get("aux_layer_ids", meta.aux_layer_ids), meta.aux_layer_convention, None, where
    )
    check_recorded_copies(
        meta,
        {"aux_layer_ids": "aux_layer_ids", "ttt_steps": "ttt_steps", "draft_vocab_size": "draft_vocab_size"},
        where,
    )
    # 2-3. every weight file: listed and of a known layout, present, sha256 as recorded, then its tensors as
    # its layout implies; all files hold the same head. Each file is read once, hashed, then parsed.
    load_rel = f"{sub}/{WEIGHTS_FILE}" if sub else WEIGHTS_FILE
    if load_rel not in meta.weights:
        raise HeadMismatchError(
            "weights",
            f"{where}: weights: draftsmith.json lists no {load_rel}. "
            f"Fix: re-export{f' with --format {sub}' if sub else ''}.",
        )
    check_listed_weight_files(
        head_dir,
        meta,
        WEIGHT_LAYOUTS,
        where,
        "EAGLE-3 export",
        on_disk=tuple({str(Path(rel).parent / "*.safetensors") for rel in WEIGHT_LAYOUTS}),
    )
    sd, digests = None, {}
    for rel, want in sorted(meta.weights.items()):
        data = weight_file_bytes(head_dir, rel, want, where)
        file_sd = eagle3_file_state_dict(data, rel, meta, str(head_dir / rel))
        if len(meta.weights) > 1:
            digests[rel] = {k: tensor_sha256(v) for k, v in file_sd.items()}
        if rel == load_rel:
            sd = file_sd
        del data, file_sd
    if digests:
        _check_same_head(digests, load_rel, head_dir)
    # 6. target identity first (its message names the field that differs), then 5. aux layers in range
    actual, overridden, warnings = check_recorded_target(
        meta, target_config, tokenizer, name_or_path, allow_mismatch, where
    )
    validate_aux_layer_ids(
        meta.aux_layer_ids, meta.aux_layer_convention, actual["num_hidden_layers"] if actual else None, where
    )
    # 4. engine configs (after the target: an engine's default aux layers depend on the target's depth)
    check_engine_configs(head_dir, meta, (actual or meta.target).get("num_hidden_layers"), where)
    # 7. tensor-parallel layout
    if tensor_parallel_size is not None:
        _check_tensor_parallel(meta.head_config, target_config, tensor_parallel_size, where)
    report = CheckReport(
        head_dir,
        meta,
        list(overridden),
        warnings,
        checked_target=actual is not None,
        override_values=overridden,
        allow_mismatch=allow_mismatch,
        tensor_parallel_size=tensor_parallel_size,
    )
    return report, sd


def check_head(
    head_dir: str | Path,
    target_config: Any,
    tokenizer: Any = None,
    name_or_path: str | None = None,
    allow_mismatch=(),
    tensor_parallel_size: int | None = None,
) -> CheckReport:
    """Run every check of the module docstring against ``target_config`` (a model, config or dict;
    None checks the head's integrity only). ``tensor_parallel_size``: also check the sharded layout.
    Raises HeadMismatchError on refusal, ValueError for an unknown ``allow_mismatch`` field.
    Other drafters' exports are checked by their own ``Drafter.check`` (``drafters.directory.check_export`` picks
    it by ``head_type``)."""
    root = resolve_head_dir(head_dir)[0]
    if (root / METADATA_FILE).is_file() and read_metadata(root).head_type == "draft_model":
        if tensor_parallel_size is not None:
            raise ValueError("tensor_parallel_size applies to EAGLE-3 heads; a draft model shards like any LM")
        return check_draft_model(root, target_config, tokenizer, name_or_path, allow_mismatch)
    if (root / METADATA_FILE).is_file() and read_metadata(root).head_type == "mlp_speculator":
        if tensor_parallel_size is not None:
            raise ValueError("tensor_parallel_size: an MLP speculator is served unsharded (vLLM runs it at tp 1)")
        return check_mlp_speculator(root, target_config, tokenizer, name_or_path, allow_mismatch)
    report, _ = _check(head_dir, target_config, tokenizer, name_or_path, allow_mismatch, tensor_parallel_size)
    return report


def load_eagle3(head_dir: str | Path, target_model: Any = None, tokenizer: Any = None, allow_mismatch=()):
    """Check (as ``check_head``) then build the head: returns ``(Eagle3Head, HeadMetadata)``.

    ``head_dir`` is an export root or one of its format sub-directories (``HEAD/speculators``: that
    format's own weight file is loaded, checked against the root's metadata). With a ``target_model``
    the head is bound to its input embedding, ready to draft. The weights are hashed and parsed from
    the same bytes, so what was verified is what is loaded."""

    report, sd = _check(head_dir, target_model, tokenizer, None, allow_mismatch)
    meta = report.metadata
    if meta.head_type != "eagle3":
        raise HeadMismatchError(
            "head_type",
            f"{head_dir}: head_type is {meta.head_type!r}, not 'eagle3'. Fix: load it with the loader for its type.",
        )
    head = Eagle3Head(Eagle3Config.from_dict(meta.head_config)).to(sd["fc.weight"].dtype)  # the exported dtype
    head.load_export_state_dict(sd)
    if target_model is not None and hasattr(target_model, "get_input_embeddings"):
        head.bind_embedding(target_model.get_input_embeddings())  # the target's, frozen, never exported
    return head.eval(), meta


def resolve_head_dir(path: str | Path) -> tuple[Path, str | None]:
    """(export root, format sub-directory or None): ``HEAD/speculators`` resolves to (HEAD, "speculators")."""

    path = Path(path)
    subdirs = {d for d in FORMAT_DIRS.values() if d}
    if not (path / METADATA_FILE).is_file() and path.name in subdirs and (path.parent / METADATA_FILE).is_file():
        return path.parent, path.name
    return path, None
