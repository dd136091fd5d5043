"""``draftsmith.json``: the versioned record a head directory carries about itself.

    meta = read_metadata("runs/eagle3/head")           # HeadMetadata; refuses a newer format_version
    update_metadata("runs/eagle3/head", eval={"humaneval": {"tau": 2.9}})

Fields (format_version 1):
- ``format_version``; ``toolkit`` {name, version, git_sha (None outside a git checkout)};
- ``head_type`` ("eagle3", "draft_model", ...) and ``head_config`` (the geometry: ``Eagle3Config.to_dict()``
  for EAGLE-3, the draft LM's config fields for a draft model, ``export/draft_model.py``);
- ``ttt_steps``; ``aux_layer_ids`` with ``aux_layer_convention`` ("hf_hidden_states_index": id i is
  ``output_hidden_states[i]`` of the target, the input of its decoder layer i; vLLM uses the same
  numbers, SGLang one lower). Required for EAGLE-3 heads; null for drafters that read no hidden
  states (a draft model);
- ``draft_vocab_size`` and ``d2t_sha256`` (of the int64 little-endian bytes; None when Vd == V);
- ``target``: the identity from ``identity.target_identity``;
- ``training``: caller-provided (data manifest, token counts, ...); ``eval``: held-out acceptance
  results, filled at export or later with ``update_metadata``;
- ``referee``: verdicts of serving engines that decoded exactly as draftsmith does (``evaluation/referee.py``),
  keyed ``engine/format/k``: {engine, version, format, k, prompts, match, details, checked_at};
- ``weights``: {relative file path: sha256 of its bytes} for every weight file in the directory;
- ``created_at``: UTC ISO-8601 time of the export.
"""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import draftsmith
from draftsmith.core.aux_layers import AUX_LAYER_CONVENTION

FORMAT_VERSION = 1
METADATA_FILE = "draftsmith.json"
KNOWN_AUX_CONVENTIONS = (AUX_LAYER_CONVENTION,)


class HeadMismatchError(ValueError):
    """A head directory that must not be used as asked; the message names the field, both values
    and the fix. ``field`` holds the field name (the name ``allow_mismatch`` takes, where allowed)."""

    def __init__(self, field: str, message: str):
        super().__init__(message)
        self.field = field


@dataclass
class HeadMetadata:
    """The parsed ``draftsmith.json`` (see module docstring for each field)."""

    head_type: str
    head_config: dict
    ttt_steps: int | None = field(default=None, kw_only=True)  # required for eagle3 (from_dict)
    aux_layer_ids: list[int] | None = field(default=None, kw_only=True)  # required for eagle3 (from_dict)
    draft_vocab_size: int
    target: dict
    weights: dict[str, str]
    d2t_sha256: str | None = None
    aux_layer_convention: str = AUX_LAYER_CONVENTION
    training: dict = field(default_factory=dict)
    eval: dict = field(default_factory=dict)
    referee: dict = field(default_factory=dict)
    toolkit: dict = field(default_factory=lambda: toolkit_info())
    created_at: str = field(default_factory=lambda: time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()))
    format_version: int = FORMAT_VERSION

    def to_dict(self) -> dict:
        d = dataclasses.asdict(self)
        return {"format_version": d.pop("format_version"), **d}

    @classmethod
    def from_dict(cls, d: dict, source: str = METADATA_FILE) -> "HeadMetadata":
        """Parse, refusing a newer ``format_version``, unknown keys and missing required keys."""
        version = d.get("format_version")
        if not isinstance(version, int):
            raise HeadMismatchError(
                "format_version",
                f"{source}: format_version is {version!r}, expected an "
                f"integer. Fix: re-export the head with draftsmith.",
            )
        if version > FORMAT_VERSION:
            raise HeadMismatchError(
                "format_version",
                f"{source}: format_version {version} is newer than this "
                f"draftsmith runtime reads (<= {FORMAT_VERSION}). Fix: upgrade draftsmith "
                f"(pip install -U draftsmith).",
            )
        names = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(d) - names)
        if unknown:
            raise HeadMismatchError(
                "format_version",
                f"{source}: unknown key(s) {', '.join(unknown)} for "
                f"format_version {version}. Fix: upgrade draftsmith, or re-export the head.",
            )
        required = {
            f.name
            for f in dataclasses.fields(cls)
            if f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING
        }
        missing = sorted(required - set(d))
        if missing:
            raise HeadMismatchError(
                missing[0], f"{source}: missing key(s) {', '.join(missing)}. Fix: re-export the head with draftsmith."
            )
        return cls(**d)


def toolkit_info() -> dict:
    """{name, version, git_sha}: git_sha is HEAD of the draftsmith checkout, None when not in one."""

    return {"name": "draftsmith", "version": draftsmith.__version__, "git_sha": _git_sha(draftsmith.checkout_root())}


def _git_sha(root: Path | None) -> str | None:
    """HEAD sha of draftsmith's own checkout (``draftsmith.checkout_root``); None for an installed wheel,
    never the sha of some unrelated repository that happens to contain site-packages."""
    if root is None:
        return None
    try:
        out = subprocess.run(["git", "-C", str(root), "rev-parse", "HEAD"], capture_output=True, text=True, timeout=10)
    except (OSError, subprocess.SubprocessError):
        return None
    sha = out.stdout.strip()
    return sha if out.returncode == 0 and len(sha) >= 40 else None


def write_json_atomic(path: Path, obj: Any) -> None:
    """Write JSON to ``path`` via a temp file in the same directory + fsync + rename."""
    path = Path(path)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            json.dump(obj, f, indent=2, sort_keys=False)
            f.write("\n")
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def read_metadata(head_dir: str | Path) -> HeadMetadata:
    """Read ``head_dir/draftsmith.json``; FileNotFoundError names the directory when absent."""
    path = Path(head_dir) / METADATA_FILE
    if not path.is_file():
        raise FileNotFoundError(
            f"{head_dir}: no {METADATA_FILE}; not a draftsmith head directory (export one with `draftsmith export`)"
        )
    return HeadMetadata.from_dict(json.loads(path.read_text(encoding="utf-8")), source=str(path))


def write_metadata(head_dir: str | Path, meta: HeadMetadata) -> Path:
    path = Path(head_dir) / METADATA_FILE
    write_json_atomic(path, meta.to_dict())
    return path


def update_metadata(
    head_dir: str | Path, *, eval: dict | None = None, training: dict | None = None, referee: dict | None = None
) -> HeadMetadata:
    """Merge ``eval`` / ``training`` / ``referee`` entries (shallow, by key) into an exported head's metadata."""
    meta = read_metadata(head_dir)
    if eval:
        meta.eval.update(eval)
    if training:
        meta.training.update(training)
    if referee:
        meta.referee.update(referee)
    write_metadata(head_dir, meta)
    return meta
