"""What every drafter's check shares: the report, the target-identity comparison, and weight-file integrity.

    actual, overridden, warnings = check_recorded_target(meta, target, tokenizer, "reference", (), where)
    data = weight_file_bytes(root, "model.safetensors", meta.weights["model.safetensors"], where)

A drafter's own check (``drafters/<name>/``: ``Drafter.check``) refuses with ``HeadMismatchError`` (a
ValueError naming the field, both values and the fix) what breaks its export, and then compares the target it
records with the one given (``compare_target_identity``):
  - refused unless overridden by name (``allow_mismatch=("tokenizer_sha256",)``, CLI ``--allow-mismatch``;
    overrides are logged and listed in the report with both values): model_type, architectures,
    hidden_size, num_hidden_layers, vocab_size, architecture_sha256 (heads, rope, eps, ...),
    tokenizer_sha256 (``OVERRIDABLE_FIELDS``);
  - warned about: another revision, chat template, or a target running in another dtype than the recorded
    capture dtype, the dtype of the hidden states it was trained on (``WARN_FIELDS``).
Weight files: every file the metadata lists must be present with its recorded sha256, and the bytes that
were hashed are the bytes parsed (``weight_file_bytes``); a ``*.safetensors`` the metadata does not list is
refused (an engine would load it). The tensor checks a layout implies are the drafter's.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from draftsmith.export.metadata import (
    HeadMetadata,
    HeadMismatchError,
)
from draftsmith.export.tensor_parallel import tensor_parallel_problems
from draftsmith.identity import config_dict, sha256_bytes, target_identity

logger = logging.getLogger(__name__)

WEIGHTS_FILE = "model.safetensors"
# Target-identity fields that refuse on mismatch and may be overridden by name.
OVERRIDABLE_FIELDS = (
    "model_type",
    "architectures",
    "hidden_size",
    "num_hidden_layers",
    "vocab_size",
    "architecture_sha256",
    "tokenizer_sha256",
)
# Fields that only warn when they differ. ``dtype``: the capture dtype (export.identity) against the dtype
# the serving target runs in; states rounded otherwise than in training lower acceptance, never correctness.
WARN_FIELDS = ("revision", "chat_template_sha256", "dtype")


@dataclass
class CheckReport:
    """What ``check_head`` found; returned only when the head may be used."""

    head_dir: Path
    metadata: HeadMetadata
    overridden: list[str] = field(default_factory=list)  # allow_mismatch fields that did differ
    warnings: list[str] = field(default_factory=list)
    checked_target: bool = True  # False: integrity only (no target given)
    override_values: dict = field(default_factory=dict)  # field -> {"head": recorded, "target": actual}
    allow_mismatch: tuple[str, ...] = ()  # what the caller allowed
    tensor_parallel_size: int | None = None  # checked layout, when asked

    def record(self) -> dict:
        """The check as plain data for an eval record: head, target, allowed and overridden fields with
        both values, warnings."""
        return {
            "head": str(self.head_dir),
            "target": self.metadata.target.get("name_or_path"),
            "checked_target": self.checked_target,
            "allow_mismatch": list(self.allow_mismatch),
            "overridden": [{"field": f, **self.override_values.get(f, {})} for f in self.overridden],
            "warnings": list(self.warnings),
            "tensor_parallel_size": self.tensor_parallel_size,
        }

    def summary(self) -> str:
        m = self.metadata
        verdict = (
            f"fits target {m.target.get('name_or_path')}" if self.checked_target else "is intact (no target given)"
        )
        aux = f", aux layers {m.aux_layer_ids} [{m.aux_layer_convention}]" if m.aux_layer_ids else ""
        lines = [f"OK: {self.head_dir} ({m.head_type}, draft vocab {m.draft_vocab_size}{aux}) {verdict}"]
        lines += [
            f"  overridden: {name} (head {self.override_values[name]['head']!r}, target "
            f"{self.override_values[name]['target']!r})"
            if name in self.override_values
            else f"  overridden: {name}"
            for name in self.overridden
        ]
        lines += [f"  warning: {w}" for w in self.warnings]
        return "\n".join(lines)


def check_allow_mismatch(allow_mismatch) -> tuple[str, ...]:
    """``allow_mismatch`` as a tuple, every name one of ``OVERRIDABLE_FIELDS``; ValueError naming the
    unknown ones and the fields that can be overridden."""
    allow_mismatch = tuple(allow_mismatch)
    unknown = sorted(set(allow_mismatch) - set(OVERRIDABLE_FIELDS))
    if unknown:
        raise ValueError(
            f"allow_mismatch: unknown field(s) {unknown}; fields that can be overridden: "
            f"{', '.join(OVERRIDABLE_FIELDS)}"
        )
    return allow_mismatch


def check_recorded_target(
    meta,
    target_config: Any,
    tokenizer: Any,
    name_or_path: str | None,
    allow_mismatch: tuple[str, ...],
    where: str,
    what: str = "head",
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


def compare_target_identity(
    recorded: dict, actual: dict, allow_mismatch: tuple[str, ...], where: str
) -> tuple[dict, list[str]]:
    """Step 6 for any drafter that records a target identity (EAGLE-3 heads, MLP speculators, draft
    models): ``recorded`` (draftsmith.json ``target``) against ``actual`` (``target_identity`` of the
    loaded target). Returns (overrides ``{field: {"head", "target"}}``, warnings).

    Raises HeadMismatchError naming the first differing ``OVERRIDABLE_FIELDS`` field (every refusal is
    listed in the message with both values and the fix) unless it is in ``allow_mismatch``; a
    different revision, chat template or dtype (the recorded capture dtype against the dtype the target
    runs in, ``identity.target_dtype``) only warns, naming both values."""
    problems, overridden, warnings = [], {}, []
    name = recorded.get("name_or_path")
    for key in OVERRIDABLE_FIELDS:
        want, got = recorded.get(key), actual.get(key)
        if key == "architectures" and (not want or not got):
            continue  # a config built in memory may not name its class
        if key == "tokenizer_sha256":
            if want is None or got is None:
                msg = (
                    "the head records no tokenizer hash" if want is None else "no tokenizer given"
                ) + "; tokenizer_sha256 not checked"
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
        fix = (
            f"load the tokenizer of {name!r}"
            if key == "tokenizer_sha256"
            else f"use the target this head was trained for ({name!r}) or train a head for this one"
        )
        problems.append(
            f"{key}: head was trained for {want!r}, target has {got!r}{detail}. Fix: {fix}; or pass "
            f"allow_mismatch=({key!r},) (CLI --allow-mismatch {key}) if you know they are compatible."
        )
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


_compare_target = compare_target_identity  # the earlier private name


def _dtype_warnings(captured: str | None, serving: str | None) -> list[str]:
    """The capture dtype recorded at export against the dtype the given target runs in (warn, never refuse:
    the output distribution is the target's whatever the drafter was trained on)."""
    if captured is None:
        return (
            []
            if serving is None
            else [
                f"the head records no capture dtype (exported before draftsmith recorded "
                f"it); the target's dtype {serving!r} was not compared"
            ]
        )
    if serving is None or serving == captured:
        return []
    return [
        f"dtype differs: the head was trained on the target's {captured!r} hidden states (capture dtype), the "
        f"target runs in {serving!r}: states in another dtype round differently and acceptance may be lower. Fix: "
        f"serve the target in {captured} (load it with dtype {captured!r}; vLLM --dtype {captured})"
    ]


def weight_file_bytes(root: Path, rel: str, want: str, where: str) -> bytes:
    """The bytes of weight file ``root/rel``, read once and hashed (what is verified is what is parsed).

    Raises HeadMismatchError (field ``weights``) when the file is missing or its sha256 is not ``want``."""
    path = root / rel
    if not path.is_file():
        raise HeadMismatchError(
            "weights", f"{where}: weights: file {rel} is missing. Fix: re-export or re-download the head directory."
        )
    data = path.read_bytes()
    got = sha256_bytes(data)
    if got != want:
        raise HeadMismatchError(
            "weights",
            f"{where}: weights: sha256 of {rel} is {got}, draftsmith.json "
            f"records {want}: the file is corrupted or was modified after export. "
            f"Fix: re-export or re-download the head.",
        )
    return data


def check_listed_weight_files(
    root: Path, meta: HeadMetadata, layout_files, where: str, what: str, on_disk=("*.safetensors",)
) -> None:
    """draftsmith.json lists only weight files the layout has (``layout_files``: a collection of relative
    paths, or a predicate on one), and every weight file found in the directory (glob patterns
    ``on_disk``) is listed: an unlisted file would be served unchecked, a listed one no layout has would
    be checked by nothing. Raises HeadMismatchError (field ``weights``) naming the files."""
    known = layout_files if callable(layout_files) else (lambda rel: rel in layout_files)
    foreign = sorted(rel for rel in meta.weights if not known(rel))
    if foreign:
        raise HeadMismatchError(
            "weights",
            f"{where}: weights: draftsmith.json lists {', '.join(foreign)}, which "
            f"the {what} layout does not have: nothing reads or checks such a file. Fix: "
            f"re-export the head with draftsmith; never add files to an export by hand.",
        )
    found = sorted({str(p.relative_to(root)) for pattern in on_disk for p in root.glob(pattern) if p.is_file()})
    unlisted = [rel for rel in found if rel not in meta.weights]  # vLLM's loader reads every *.safetensors
    if unlisted:
        raise HeadMismatchError(
            "weights",
            f"{where}: weights: {', '.join(unlisted)} in the directory but not in "
            f"draftsmith.json: an engine would serve it unchecked. Fix: re-export the head "
            f"(or delete the file if it is not part of it).",
        )


def verified_weight_file(root: Path, meta: HeadMetadata, expected: dict[str, tuple[int, ...]], where: str, what: str):
    """The layout's one weight file (``WEIGHTS_FILE``), hashed and parsed from the same bytes, every tensor checked
    against ``expected`` (name -> shape): what a single-file export (MLP speculator, DFlash) loads.

    Raises HeadMismatchError (field ``weights``): the file is not listed, another weight file is listed or lies
    in the directory, the hash differs, the file does not parse, or a tensor is missing, extra or misshapen."""
    from safetensors.torch import load as load_safetensors  # torch only where weights are read

    if WEIGHTS_FILE not in meta.weights:
        raise HeadMismatchError(
            "weights", f"{where}: weights: draftsmith.json lists no {WEIGHTS_FILE}. Fix: re-export."
        )
    check_listed_weight_files(root, meta, (WEIGHTS_FILE,), where, what)
    data = weight_file_bytes(root, WEIGHTS_FILE, meta.weights[WEIGHTS_FILE], where)
    at = str(root / WEIGHTS_FILE)
    try:
        sd = load_safetensors(data)
    except Exception as e:  # noqa: BLE001 - a file matching its hash but unparsable was exported broken
        raise HeadMismatchError("weights", f"{at}: weights: the file cannot be read ({e}). Fix: re-export.") from e
    missing, unexpected = sorted(set(expected) - set(sd)), sorted(set(sd) - set(expected))
    if missing or unexpected:
        raise HeadMismatchError(
            "weights",
            f"{at}: weights: missing tensor(s) {missing}, unexpected {unexpected} for this {what}'s geometry. "
            "Fix: re-export the head.",
        )
    bad = [f"{k} {tuple(sd[k].shape)} (geometry needs {s})" for k, s in expected.items() if tuple(sd[k].shape) != s]
    if bad:
        raise HeadMismatchError(
            "weights", f"{at}: weights: {', '.join(bad)}. Fix: re-export the head; config and weights disagree."
        )
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
            raise HeadMismatchError(
                top,
                f"{where}: {top}: draftsmith.json records {recorded!r}, its head_config "
                f"{inner} {configured!r}. Fix: re-export the head; never edit draftsmith.json "
                f"by hand.",
            )


def _check_tensor_parallel(head_config: dict, target_config: Any, tp_size: int, where: str) -> None:
    """Step 7: HeadMismatchError naming every size of the head (and target, when given) that does not shard."""

    problems = tensor_parallel_problems(head_config, tp_size, "head")
    if target_config is not None:
        problems += tensor_parallel_problems(config_dict(target_config), tp_size, "target")
    if problems:
        raise HeadMismatchError(
            "tensor_parallel_size",
            f"{where}: tensor_parallel_size {tp_size} does not fit:\n"
            f"  - " + "\n  - ".join(problems) + "\nFix: choose a tensor-parallel size that "
            "divides these sizes (1 always does).",
        )
