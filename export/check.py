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
   was trained on: ``heads.eagle3.aux_layer_order_problem``); a top-level copy (aux_layer_ids,
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
import logging
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from draftsmith.export.identity import sha256_bytes, target_identity, tensor_sha256
from draftsmith.export.metadata import (KNOWN_AUX_CONVENTIONS, METADATA_FILE, HeadMetadata, HeadMismatchError,
                                        read_metadata)

logger = logging.getLogger(__name__)

WEIGHTS_FILE = "model.safetensors"
# Target-identity fields that refuse on mismatch and may be overridden by name.
OVERRIDABLE_FIELDS = ("model_type", "architectures", "hidden_size", "num_hidden_layers", "vocab_size",
                      "architecture_sha256", "tokenizer_sha256")
# Fields that only warn when they differ. ``dtype``: the capture dtype (export.identity) against the dtype
# the serving target runs in; states rounded otherwise than in training lower acceptance, never correctness.
WARN_FIELDS = ("revision", "chat_template_sha256", "dtype")

__all__ = ["CheckReport", "HeadMismatchError", "check_head", "load_eagle3", "compare_target_identity",
           "expected_weight_shapes",
           "validate_vocab_map", "validate_aux_layer_ids", "validate_head_config", "check_engine_configs",
           "resolve_head_dir", "OVERRIDABLE_FIELDS", "weight_file_bytes", "check_listed_weight_files",
           "eagle3_file_state_dict", "check_recorded_copies"]


@dataclass
class CheckReport:
    """What ``check_head`` found; returned only when the head may be used."""
    head_dir: Path
    metadata: HeadMetadata
    overridden: list[str] = field(default_factory=list)   # allow_mismatch fields that did differ
    warnings: list[str] = field(default_factory=list)
    checked_target: bool = True                            # False: integrity only (no target given)
    override_values: dict = field(default_factory=dict)    # field -> {"head": recorded, "target": actual}
    allow_mismatch: tuple[str, ...] = ()                   # what the caller allowed
    tensor_parallel_size: int | None = None                # checked layout, when asked

    def record(self) -> dict:
        """The check as plain data for an eval record: head, target, allowed and overridden fields with
        both values, warnings."""
        return {"head": str(self.head_dir), "target": self.metadata.target.get("name_or_path"),
                "checked_target": self.checked_target, "allow_mismatch": list(self.allow_mismatch),
                "overridden": [{"field": f, **self.override_values.get(f, {})} for f in self.overridden],
                "warnings": list(self.warnings), "tensor_parallel_size": self.tensor_parallel_size}

    def summary(self) -> str:
        m = self.metadata
        verdict = (f"fits target {m.target.get('name_or_path')}" if self.checked_target
                   else "is intact (no target given)")
        aux = f", aux layers {m.aux_layer_ids} [{m.aux_layer_convention}]" if m.aux_layer_ids else ""
        lines = [f"OK: {self.head_dir} ({m.head_type}, draft vocab {m.draft_vocab_size}{aux}) {verdict}"]
        lines += [f"  overridden: {name} (head {self.override_values[name]['head']!r}, target "
                  f"{self.override_values[name]['target']!r})" if name in self.override_values
                  else f"  overridden: {name}" for name in self.overridden]
        lines += [f"  warning: {w}" for w in self.warnings]
        return "\n".join(lines)


def expected_weight_shapes(head_config: dict) -> dict[str, tuple[int, ...]]:
    """Tensor name -> shape of an exported EAGLE-3 head (names of DESIGN §6; d2t/t2d only if Vd < V)."""
    c = head_config
    h, i, hd = c["hidden_size"], c["intermediate_size"], c["head_dim"]
    q, kv = c["num_attention_heads"] * hd, c["num_key_value_heads"] * hd
    shapes = {
        "fc.weight": (h, 3 * h),
        "midlayer.input_layernorm.weight": (h,),
        "midlayer.hidden_norm.weight": (h,),
        "midlayer.self_attn.q_proj.weight": (q, 2 * h),
        "midlayer.self_attn.k_proj.weight": (kv, 2 * h),
        "midlayer.self_attn.v_proj.weight": (kv, 2 * h),
        "midlayer.self_attn.o_proj.weight": (h, q),
        "midlayer.post_attention_layernorm.weight": (h,),
        "midlayer.mlp.gate_proj.weight": (i, h),
        "midlayer.mlp.up_proj.weight": (i, h),
        "midlayer.mlp.down_proj.weight": (h, i),
        "norm.weight": (h,),
        "lm_head.weight": (c["draft_vocab_size"], h),
    }
    if c["draft_vocab_size"] != c["vocab_size"]:
        shapes["d2t"] = (c["draft_vocab_size"],)
        shapes["t2d"] = (c["vocab_size"],)
    return shapes


def validate_state_dict(sd: dict[str, torch.Tensor], head_config: dict, where: str) -> None:
    """Names and shapes against the geometry, then the vocab map (raises HeadMismatchError)."""
    expected = expected_weight_shapes(head_config)
    vd, v = head_config["draft_vocab_size"], head_config["vocab_size"]
    if vd < v and "d2t" not in sd:
        raise HeadMismatchError("d2t", f"{where}: draft_vocab_size {vd} < target vocab_size {v} but no d2t "
                                f"tensor: draft ids cannot be mapped to target ids. Fix: re-export the head "
                                f"with its vocab map (d2t/t2d from training).")
    missing = sorted(set(expected) - set(sd))
    if missing:
        raise HeadMismatchError("weights", f"{where}: weights: missing tensor(s) {', '.join(missing)}. "
                                f"Fix: re-export the head; the file is incomplete.")
    unexpected = sorted(set(sd) - set(expected))
    if unexpected:
        raise HeadMismatchError("weights", f"{where}: weights: unexpected tensor(s) {', '.join(unexpected)} for "
                                f"an EAGLE-3 head (no biases, no embedding, no model. prefix). Fix: re-export "
                                f"with draftsmith.")
    for name, shape in expected.items():
        if tuple(sd[name].shape) != shape:
            raise HeadMismatchError("weights", f"{where}: weights: {name} has shape {tuple(sd[name].shape)}, the "
                                    f"head's geometry needs {shape}. Fix: re-export the head; config and weights "
                                    f"disagree.")
    validate_vocab_map(sd.get("d2t"), sd.get("t2d"), vd, v, where)


def validate_vocab_map(d2t: torch.Tensor | None, t2d: torch.Tensor | None, draft_vocab_size: int,
                       vocab_size: int, where: str = "head") -> None:
    """d2t [Vd] int64 offsets (target_id = draft_id + d2t[draft_id]) into [0, V), no two draft ids on
    one target id, and t2d [V] bool marking exactly those target ids (``heads.vocab``)."""
    from draftsmith.heads.vocab import validate_vocab_map as validate_map

    if draft_vocab_size > vocab_size:
        raise HeadMismatchError("draft_vocab_size", f"{where}: draft_vocab_size {draft_vocab_size} > target "
                                f"vocab_size {vocab_size}. Fix: the draft vocab must be a subset of the target's.")
    if draft_vocab_size == vocab_size and d2t is None:
        return
    if d2t is None or t2d is None:
        name = "d2t" if d2t is None else "t2d"
        raise HeadMismatchError(name, f"{where}: draft_vocab_size {draft_vocab_size} < vocab_size {vocab_size} "
                                f"and no {name}. Fix: re-export the head with its vocab map (d2t/t2d).")
    if d2t.dtype != torch.int64 or tuple(d2t.shape) != (draft_vocab_size,):
        raise HeadMismatchError("d2t", f"{where}: d2t must be int64 of shape ({draft_vocab_size},), got "
                                f"{d2t.dtype} {tuple(d2t.shape)}. Fix: re-export the head's vocab map.")
    if t2d.dtype != torch.bool or tuple(t2d.shape) != (vocab_size,):
        raise HeadMismatchError("t2d", f"{where}: t2d must be bool of shape ({vocab_size},), got "
                                f"{t2d.dtype} {tuple(t2d.shape)}. Fix: re-export the head's vocab map.")
    try:
        validate_map(d2t, t2d)
    except ValueError as e:
        if _is_index_map(d2t, t2d):
            raise HeadMismatchError("d2t", f"{where}: d2t holds target ids (index style, target_id = d2t[draft_id]) "
                                    f"where vLLM and SGLang read offsets (target_id = draft_id + d2t[draft_id]): every "
                                    f"draft token would be served as another token. Fix: convert it to offsets "
                                    f"(d2t - arange({draft_vocab_size})) and re-export.") from None
        name = "t2d" if str(e).startswith("t2d") else "d2t"
        raise HeadMismatchError(name, f"{where}: {e} (field {name}). Fix: rebuild the vocab map for this "
                                f"target and re-export.") from None


def _is_index_map(d2t: torch.Tensor, t2d: torch.Tensor) -> bool:
    """Whether ``d2t`` read as target ids (not offsets) is the map ``t2d`` marks: the index-style d2t some
    converters write (distinct in-range ids, exactly those of t2d)."""
    ids = d2t.long()
    return bool(ids.numel() and int(ids.min()) >= 0 and int(ids.max()) < t2d.numel()
                and torch.unique(ids).numel() == ids.numel() and bool(t2d[ids].all())
                and int(t2d.sum()) == ids.numel())


def validate_aux_layer_ids(aux_layer_ids, convention: str, num_hidden_layers: int | None,
                           where: str = "head") -> None:
    """Known convention; ids strictly ascending (the layer order vLLM and SGLang concatenate the states
    in, ``heads.eagle3.aux_layer_order_problem``: a head trained on another order is mis-served by both);
    with ``num_hidden_layers``, ids in the target's range [0, N-1] of HF hidden_states indices."""
    from draftsmith.heads.eagle3 import aux_layer_order_problem

    if convention not in KNOWN_AUX_CONVENTIONS:
        raise HeadMismatchError("aux_layer_convention", f"{where}: aux_layer_convention {convention!r} is not "
                                f"one of {KNOWN_AUX_CONVENTIONS}. Fix: upgrade draftsmith or re-export the head.")
    problem = aux_layer_order_problem(aux_layer_ids)
    if problem is not None:
        raise HeadMismatchError("aux_layer_ids", f"{where}: {problem} (this head cannot be served as trained; "
                                f"a head trained on ascending ids is).")
    if num_hidden_layers is None:
        return
    bad = [i for i in aux_layer_ids if not 0 <= int(i) < num_hidden_layers]
    if bad:
        raise HeadMismatchError("aux_layer_ids", f"{where}: aux_layer_ids {list(aux_layer_ids)} ({convention}) "
                                f"include {bad}, outside the target's layers [0, {num_hidden_layers - 1}]. Fix: use "
                                f"the target this head was trained for, or retrain with ids in range.")


def check_allow_mismatch(allow_mismatch) -> tuple[str, ...]:
    """``allow_mismatch`` as a tuple, every name one of ``OVERRIDABLE_FIELDS``; ValueError naming the
    unknown ones and the fields that can be overridden."""
    allow_mismatch = tuple(allow_mismatch)
    unknown = sorted(set(allow_mismatch) - set(OVERRIDABLE_FIELDS))
    if unknown:
        raise ValueError(f"allow_mismatch: unknown field(s) {unknown}; fields that can be overridden: "
                         f"{', '.join(OVERRIDABLE_FIELDS)}")
    return allow_mismatch


def check_recorded_target(meta, target_config: Any, tokenizer: Any, name_or_path: str | None,
                          allow_mismatch: tuple[str, ...], where: str, what: str = "head"
                          ) -> tuple[dict | None, dict, list[str]]:
    """Step 6 as every drafter's check runs it: ``target_identity`` of the given target (None when
    ``target_config`` is None: only a warning, the drafter's own integrity was checked) compared with
    the identity ``meta.target`` records (``compare_target_identity``). Returns (actual identity or
    None, overrides, warnings). Raises HeadMismatchError as ``compare_target_identity``."""
    if target_config is None:
        warning = f"no target given: only the {what}'s own integrity was checked"
        logger.warning("%s: %s", where, warning)
        return None, {}, [warning]
    actual = target_identity(target_config, tokenizer, name_or_path)
    if name_or_path and name_or_path != meta.target.get("name_or_path"):
        logger.info("%s: trained on %r, checked against %r", where, meta.target.get("name_or_path"), name_or_path)
    overridden, warnings = compare_target_identity(meta.target, actual, allow_mismatch, where)
    return actual, overridden, warnings


def compare_target_identity(recorded: dict, actual: dict, allow_mismatch: tuple[str, ...], where: str
                            ) -> tuple[dict, list[str]]:
    """Step 6 for any drafter that records a target identity (EAGLE-3 heads, MLP speculators, draft
    models): ``recorded`` (draftsmith.json ``target``) against ``actual`` (``target_identity`` of the
    loaded target). Returns (overrides ``{field: {"head", "target"}}``, warnings).

    Raises HeadMismatchError naming the first differing ``OVERRIDABLE_FIELDS`` field (every refusal is
    listed in the message with both values and the fix) unless it is in ``allow_mismatch``; a
    different revision, chat template or dtype (the recorded capture dtype against the dtype the target
    runs in, ``export.identity.target_dtype``) only warns, naming both values."""
    problems, overridden, warnings = [], {}, []
    name = recorded.get("name_or_path")
    for key in OVERRIDABLE_FIELDS:
        want, got = recorded.get(key), actual.get(key)
        if key == "architectures" and (not want or not got):
            continue  # a config built in memory may not name its class
        if key == "tokenizer_sha256":
            if want is None or got is None:
                msg = ("the head records no tokenizer hash" if want is None
                       else "no tokenizer given") + "; tokenizer_sha256 not checked"
                warnings.append(msg)
                continue
        if want == got:
            continue
        if key in allow_mismatch:
            overridden[key] = {"head": want, "target": got}
            logger.warning("%s: overriding %s mismatch (head %r, target %r) as asked", where, key, want, got)
            continue
        detail = ""
        if key == "architecture_sha256":
            a, b = recorded.get("architecture") or {}, actual.get("architecture") or {}
            diff = [f"{k}: {a.get(k)!r} vs {b.get(k)!r}" for k in sorted(set(a) | set(b)) if a.get(k) != b.get(k)]
            detail = f" (differing fields: {'; '.join(diff)})" if diff else ""
        fix = (f"load the tokenizer of {name!r}" if key == "tokenizer_sha256"
               else f"use the target this head was trained for ({name!r}) or train a head for this one")
        problems.append(f"{key}: head was trained for {want!r}, target has {got!r}{detail}. Fix: {fix}; or pass "
                        f"allow_mismatch=({key!r},) (CLI --allow-mismatch {key}) if you know they are compatible.")
    for key in WARN_FIELDS:
        want, got = recorded.get(key), actual.get(key)
        if key == "dtype":
            warnings += _dtype_warnings(want, got)
        elif want is not None and got is not None and want != got:
            warnings.append(f"{key} differs: head trained with {want!r}, target has {got!r}")
    for w in warnings:
        logger.warning("%s: %s", where, w)
    if problems:
        first = problems[0].split(":", 1)[0]
        raise HeadMismatchError(first, f"{where} does not fit the target:\n  - " + "\n  - ".join(problems))
    return overridden, warnings


_compare_target = compare_target_identity     # the earlier private name


def _dtype_warnings(captured: str | None, serving: str | None) -> list[str]:
    """The capture dtype recorded at export against the dtype the given target runs in (warn, never refuse:
    the output distribution is the target's whatever the drafter was trained on)."""
    if captured is None:
        return [] if serving is None else [f"the head records no capture dtype (exported before draftsmith recorded "
                                           f"it); the target's dtype {serving!r} was not compared"]
    if serving is None or serving == captured:
        return []
    return [f"dtype differs: the head was trained on the target's {captured!r} hidden states (capture dtype), the "
            f"target runs in {serving!r}: states in another dtype round differently and acceptance may be lower. Fix: "
            f"serve the target in {captured} (load it with dtype {captured!r}; vLLM --dtype {captured})"]


def validate_head_config(head_config: dict, where: str = "head") -> None:
    """The metadata's ``head_config`` builds an ``Eagle3Config`` this runtime implements: no unknown
    field, no unknown norm flag, no norm switch other than the original EAGLE-3 layout."""
    from draftsmith.export.formats import NOT_NORM_FLAGS, SUPPORTED_NORM_FLAGS
    from draftsmith.heads.eagle3 import Eagle3Config

    known = {f.name for f in dataclasses.fields(Eagle3Config)}
    norms = sorted(k for k in set(head_config) - known if "norm" in k.lower() and k not in NOT_NORM_FLAGS)
    if norms:
        raise HeadMismatchError("norm_flags", f"{where}: norm_flags: head_config has unknown norm flag(s) "
                                f"{', '.join(f'{k}={head_config[k]!r}' for k in norms)}; this runtime knows "
                                f"{', '.join(SUPPORTED_NORM_FLAGS)}. Fix: upgrade draftsmith, or re-export the head.")
    unknown = sorted(set(head_config) - known)
    if unknown:
        raise HeadMismatchError("head_config", f"{where}: head_config: unknown field(s) {', '.join(unknown)}. "
                                f"Fix: upgrade draftsmith (the head was written by a newer one), or re-export it.")
    for key, supported in SUPPORTED_NORM_FLAGS.items():
        if key in head_config and bool(head_config[key]) != supported:
            raise HeadMismatchError(key, f"{where}: {key}: head_config has {head_config[key]!r}, this runtime "
                                    f"implements only {supported!r} (the original EAGLE-3 layout, the one every "
                                    f"engine serves). Fix: serve this head with an engine that implements it, or "
                                    f"retrain with {key}={supported}.")


def check_engine_configs(head_dir: Path, meta: HeadMetadata, target_num_layers: int | None,
                         where: str) -> None:
    """Step 4: every engine config in ``head_dir`` read as its engines read it equals the recorded head.

    The research ``config.json`` must exist (vLLM and SGLang load the directory through it); other
    format directories are checked when present. Raises HeadMismatchError listing every difference."""
    from draftsmith.export.formats import CONFIG_READERS, ENGINE_NAMES, engine_problems

    for rel, engines in CONFIG_READERS.items():
        path = head_dir / rel
        if not path.is_file():
            if rel == "config.json":
                raise HeadMismatchError("config", f"{where}: config: no config.json, which vLLM and SGLang read. "
                                        f"Fix: re-export the head with `draftsmith export`.")
            continue
        try:
            cfg = json.loads(path.read_text(encoding="utf-8"))
        except (OSError, ValueError) as e:
            raise HeadMismatchError("config", f"{where}: config: {rel} cannot be read ({e}). Fix: re-export the "
                                    f"head.") from e
        problems = []
        for engine in engines:
            problems += [(f, f"{rel} as {ENGINE_NAMES[engine]}: {m}")
                         for f, m in engine_problems(engine, cfg, meta.head_config, meta.head_type, target_num_layers)]
        if problems:
            raise HeadMismatchError(problems[0][0], f"{where}: {rel} disagrees with draftsmith.json (the head that "
                                    f"was trained; engines read the config):\n  - " +
                                    "\n  - ".join(m for _, m in problems) +
                                    "\nFix: re-export the head with `draftsmith export`; never edit an exported "
                                    "config by hand.")


def resolve_head_dir(path: str | Path) -> tuple[Path, str | None]:
    """(export root, format sub-directory or None): ``HEAD/speculators`` resolves to (HEAD, "speculators")."""
    from draftsmith.export.formats import FORMAT_DIRS

    path = Path(path)
    subdirs = {d for d in FORMAT_DIRS.values() if d}
    if not (path / METADATA_FILE).is_file() and path.name in subdirs and (path.parent / METADATA_FILE).is_file():
        return path.parent, path.name
    return path, None


def weight_file_bytes(root: Path, rel: str, want: str, where: str) -> bytes:
    """The bytes of weight file ``root/rel``, read once and hashed (what is verified is what is parsed).

    Raises HeadMismatchError (field ``weights``) when the file is missing or its sha256 is not ``want``."""
    path = root / rel
    if not path.is_file():
        raise HeadMismatchError("weights", f"{where}: weights: file {rel} is missing. Fix: re-export or "
                                f"re-download the head directory.")
    data = path.read_bytes()
    got = sha256_bytes(data)
    if got != want:
        raise HeadMismatchError("weights", f"{where}: weights: sha256 of {rel} is {got}, draftsmith.json "
                                f"records {want}: the file is corrupted or was modified after export. "
                                f"Fix: re-export or re-download the head.")
    return data


def check_listed_weight_files(root: Path, meta: HeadMetadata, layout_files, where: str, what: str,
                              on_disk=("*.safetensors",)) -> None:
    """draftsmith.json lists only weight files the layout has (``layout_files``: a collection of relative
    paths, or a predicate on one), and every weight file found in the directory (glob patterns
    ``on_disk``) is listed: an unlisted file would be served unchecked, a listed one no layout has would
    be checked by nothing. Raises HeadMismatchError (field ``weights``) naming the files."""
    known = layout_files if callable(layout_files) else (lambda rel: rel in layout_files)
    foreign = sorted(rel for rel in meta.weights if not known(rel))
    if foreign:
        raise HeadMismatchError("weights", f"{where}: weights: draftsmith.json lists {', '.join(foreign)}, which "
                                f"the {what} layout does not have: nothing reads or checks such a file. Fix: "
                                f"re-export the head with draftsmith; never add files to an export by hand.")
    found = sorted({str(p.relative_to(root)) for pattern in on_disk for p in root.glob(pattern) if p.is_file()})
    unlisted = [rel for rel in found if rel not in meta.weights]    # vLLM's loader reads every *.safetensors
    if unlisted:
        raise HeadMismatchError("weights", f"{where}: weights: {', '.join(unlisted)} in the directory but not in "
                                f"draftsmith.json: an engine would serve it unchecked. Fix: re-export the head "
                                f"(or delete the file if it is not part of it).")


def eagle3_file_state_dict(data: bytes, rel: str, meta: HeadMetadata, at: str) -> dict[str, torch.Tensor]:
    """Weight file ``rel`` of an EAGLE-3 export (``formats.WEIGHT_LAYOUTS``), parsed and checked as its layout
    implies; returned under our export names (``midlayer.*``). ``at`` names the file in messages.

    Refuses (HeadMismatchError): an unparsable file; names of another layout (``midlayer.*`` in the
    speculators file); a missing, unexpected or misshapen tensor (``validate_state_dict``); a d2t that is
    no offset map (index style: target ids) or t2d disagreeing with it; a d2t other than the recorded one."""
    from safetensors.torch import load as load_safetensors

    from draftsmith.export.formats import WEIGHT_LAYOUTS, export_names

    try:
        raw = load_safetensors(data)
    except Exception as e:  # noqa: BLE001 - a file matching its hash but unparsable was exported broken
        raise HeadMismatchError("weights", f"{at}: weights: the file cannot be read ({e}). Fix: re-export.") from e
    sd, misnamed = export_names(raw, rel)
    if misnamed:
        raise HeadMismatchError("weights", f"{at}: weights: tensor(s) {', '.join(misnamed[:4])}"
                                f"{' ...' if len(misnamed) > 4 else ''} are named for another layout; this file's "
                                f"layout names the decoder layer {WEIGHT_LAYOUTS[rel]}*. Fix: re-export with "
                                f"`draftsmith export`; never convert an exported file by hand.")
    validate_state_dict(sd, meta.head_config, at)
    got_d2t = tensor_sha256(sd["d2t"]) if "d2t" in sd else None
    if got_d2t != meta.d2t_sha256:
        raise HeadMismatchError("d2t_sha256", f"{at}: d2t_sha256: the d2t tensor hashes to {got_d2t}, "
                                f"draftsmith.json records {meta.d2t_sha256}. Fix: re-export the head.")
    return sd


def check_recorded_copies(meta: HeadMetadata, fields: dict[str, str], where: str) -> None:
    """Top-level copies in draftsmith.json equal the ``head_config`` field they restate (``fields``: top-level
    name -> head_config name; a head_config without the field is not compared). Tools read either copy
    (the model card and the runtime the top level, the loader head_config), so two values would mean
    two heads. Raises HeadMismatchError naming the field and both values."""
    for top, inner in fields.items():
        recorded, configured = getattr(meta, top), meta.head_config.get(inner, getattr(meta, top))
        if isinstance(recorded, (list, tuple)) or isinstance(configured, (list, tuple)):
            recorded, configured = list(recorded or []), list(configured or [])
        if recorded != configured:
            raise HeadMismatchError(top, f"{where}: {top}: draftsmith.json records {recorded!r}, its head_config "
                                    f"{inner} {configured!r}. Fix: re-export the head; never edit draftsmith.json "
                                    f"by hand.")


def _check_same_head(digests: dict[str, dict[str, str]], ref: str, root: Path) -> None:
    """Every weight file holds the tensors of ``ref`` (per-tensor sha256 ``digests[rel]``): one export, one head."""
    for rel, digest in sorted(digests.items()):
        differ = sorted(k for k in digest if digest[k] != digests[ref].get(k))
        if differ:
            raise HeadMismatchError("weights", f"{root / rel}: weights: {', '.join(differ[:4])}"
                                    f"{' ...' if len(differ) > 4 else ''} hold other values than in {ref}; every "
                                    f"weight file of an export holds the one head draftsmith.json describes. Fix: "
                                    f"re-export the head with `draftsmith export --format all`.")


def _check(head_dir: str | Path, target_config: Any, tokenizer: Any, name_or_path: str | None,
           allow_mismatch, tensor_parallel_size: int | None = None) -> tuple[CheckReport, dict[str, torch.Tensor]]:
    """All checks of the module docstring; returns the report and the verified state dict (of the format
    sub-directory's own weight file when ``head_dir`` is one, under our export names)."""
    from draftsmith.export.formats import WEIGHT_LAYOUTS

    given = Path(head_dir)
    head_dir, sub = resolve_head_dir(given)
    allow_mismatch = check_allow_mismatch(allow_mismatch)
    meta = read_metadata(head_dir)
    where = str(given)
    # 1. the recorded head is one this runtime implements (and the engines serve: aux ids in layer order)
    validate_head_config(meta.head_config, where)
    validate_aux_layer_ids(meta.head_config.get("aux_layer_ids", meta.aux_layer_ids), meta.aux_layer_convention,
                           None, where)
    check_recorded_copies(meta, {"aux_layer_ids": "aux_layer_ids", "ttt_steps": "ttt_steps",
                                 "draft_vocab_size": "draft_vocab_size"}, where)
    # 2-3. every weight file: listed and of a known layout, present, sha256 as recorded, then its tensors as
    # its layout implies; all files hold the same head. Each file is read once, hashed, then parsed.
    load_rel = f"{sub}/{WEIGHTS_FILE}" if sub else WEIGHTS_FILE
    if load_rel not in meta.weights:
        raise HeadMismatchError("weights", f"{where}: weights: draftsmith.json lists no {load_rel}. "
                                f"Fix: re-export{f' with --format {sub}' if sub else ''}.")
    check_listed_weight_files(head_dir, meta, WEIGHT_LAYOUTS, where, "EAGLE-3 export",
                              on_disk=tuple({str(Path(rel).parent / "*.safetensors") for rel in WEIGHT_LAYOUTS}))
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
    actual, overridden, warnings = check_recorded_target(meta, target_config, tokenizer, name_or_path,
                                                         allow_mismatch, where)
    validate_aux_layer_ids(meta.aux_layer_ids, meta.aux_layer_convention,
                           actual["num_hidden_layers"] if actual else None, where)
    # 4. engine configs (after the target: an engine's default aux layers depend on the target's depth)
    check_engine_configs(head_dir, meta, (actual or meta.target).get("num_hidden_layers"), where)
    # 7. tensor-parallel layout
    if tensor_parallel_size is not None:
        _check_tensor_parallel(meta.head_config, target_config, tensor_parallel_size, where)
    report = CheckReport(head_dir, meta, list(overridden), warnings, checked_target=actual is not None,
                         override_values=overridden, allow_mismatch=allow_mismatch,
                         tensor_parallel_size=tensor_parallel_size)
    return report, sd


def _check_tensor_parallel(head_config: dict, target_config: Any, tp_size: int, where: str) -> None:
    """Step 7: HeadMismatchError naming every size of the head (and target, when given) that does not shard."""
    from draftsmith.export.identity import config_dict
    from draftsmith.export.tensor_parallel import tensor_parallel_problems

    problems = tensor_parallel_problems(head_config, tp_size, "head")
    if target_config is not None:
        problems += tensor_parallel_problems(config_dict(target_config), tp_size, "target")
    if problems:
        raise HeadMismatchError("tensor_parallel_size", f"{where}: tensor_parallel_size {tp_size} does not fit:\n"
                                f"  - " + "\n  - ".join(problems) + "\nFix: choose a tensor-parallel size that "
                                f"divides these sizes (1 always does).")


def check_head(head_dir: str | Path, target_config: Any, tokenizer: Any = None, name_or_path: str | None = None,
               allow_mismatch=(), tensor_parallel_size: int | None = None) -> CheckReport:
    """Run every check of the module docstring against ``target_config`` (a model, config or dict;
    None checks the head's integrity only). ``tensor_parallel_size``: also check the sharded layout.
    Raises HeadMismatchError on refusal, ValueError for an unknown ``allow_mismatch`` field.
    A distilled draft model (``head_type: draft_model``) is checked by ``export.draft_model.check_draft_model``,
    an MLP speculator (``head_type: mlp_speculator``) by ``export.mlp_speculator.check_mlp_speculator``."""
    root = resolve_head_dir(head_dir)[0]
    if (root / METADATA_FILE).is_file() and read_metadata(root).head_type == "draft_model":
        from draftsmith.export.draft_model import check_draft_model

        if tensor_parallel_size is not None:
            raise ValueError("tensor_parallel_size applies to EAGLE-3 heads; a draft model shards like any LM")
        return check_draft_model(root, target_config, tokenizer, name_or_path, allow_mismatch)
    if (root / METADATA_FILE).is_file() and read_metadata(root).head_type == "mlp_speculator":
        from draftsmith.export.mlp_speculator import check_mlp_speculator

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
    from draftsmith.heads.eagle3 import Eagle3Config, Eagle3Head

    report, sd = _check(head_dir, target_model, tokenizer, None, allow_mismatch)
    meta = report.metadata
    if meta.head_type != "eagle3":
        raise HeadMismatchError("head_type", f"{head_dir}: head_type is {meta.head_type!r}, not 'eagle3'. Fix: "
                                f"load it with the loader for its type.")
    head = Eagle3Head(Eagle3Config.from_dict(meta.head_config)).to(sd["fc.weight"].dtype)  # the exported dtype
    head.load_export_state_dict(sd)
    if target_model is not None and hasattr(target_model, "get_input_embeddings"):
        head.bind_embedding(target_model.get_input_embeddings())   # the target's, frozen, never exported
    return head.eval(), meta
