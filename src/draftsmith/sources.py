"""Where a model name points, checked before anything heavy is imported: the embedded reference models, a
local folder, a Hub id, or an exported head directory.

    path = check_model_source("/models/llama", role="target")   # a folder with config.json and whole weights
    check_model_source("meta-llama/Llama-3.1-8B-Instruct")        # a Hub id (offline: it must be in the cache)
    check_head_dir("runs/reference-eagle3/head", role="--head")   # holds draftsmith.json (or is a format sub-dir)

Each check raises ``ModelSourceError`` (an OSError, as transformers' own loading errors are) with one line
naming what was given, what is wrong and what to pass instead. This module imports only the standard
library, ``huggingface_hub`` (its id rules and cache) and ``draftsmith.reference``: the CLI runs these checks
before torch and transformers are imported, and ``models.load_causal_lm`` runs them before loading.

Safetensors files are checked from their header alone (layout of the format: an 8-byte little-endian header
length N, N bytes of JSON ``{name: {dtype, shape, data_offsets: [begin, end]}}``, then the data, which must
end exactly where the largest ``end`` says; huggingface/safetensors ``docs/source/index.mdx``), so a
truncated download is reported by name instead of as "incomplete metadata, file not fully covered".
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from draftsmith import reference

#: What marks an exported head directory (``export.metadata.METADATA_FILE``; kept equal by a test).
METADATA_FILE = "draftsmith.json"
#: The largest safetensors header the format allows (bytes; safetensors ``MAX_HEADER_SIZE``).
MAX_SAFETENSORS_HEADER = 100_000_000


class ModelSourceError(OSError):
    """A model or head name that points at nothing loadable; the message names it, the problem and the fix."""


def _named(role: str, name: Any) -> str:
    return f"{role} {str(name)!r}" if role else repr(str(name))


def _check_json_object(path: Path, label: str, fix: str) -> None:
    """``path`` holds a JSON object (UTF-8); else ModelSourceError naming the file, the line and ``fix``."""
    try:
        value = json.loads(path.read_text(encoding="utf-8"))
    except json.JSONDecodeError as e:
        raise ModelSourceError(
            f"{label}: {path} is not valid JSON ({e.msg} at line {e.lineno}, column {e.colno}); {fix}"
        ) from None
    except UnicodeDecodeError:
        raise ModelSourceError(f"{label}: {path} is not UTF-8 text; {fix}") from None
    except OSError as e:
        raise ModelSourceError(f"{label}: {path} cannot be read ({e.strerror or e}); fix its permissions") from None
    if not isinstance(value, dict):
        raise ModelSourceError(f"{label}: {path} holds JSON but not an object; {fix}")


def is_head_dir(path: str | Path) -> bool:
    """True when ``path`` is an exported head directory or one of its format sub-directories (draftsmith.json
    in it or in its parent)."""
    path = Path(path)
    return path.is_dir() and ((path / METADATA_FILE).is_file() or (path.parent / METADATA_FILE).is_file())


def check_head_dir(
    path: str | Path,
    role: str = "head",
    hint: str = "export one with `draftsmith train RECIPE` (runs/NAME/head) or `draftsmith export RUN_DIR --out DIR`",
) -> Path:
    """``path`` as a Path when it is an exported head directory (``is_head_dir``).

    Raises:
        ModelSourceError: it does not exist, is a file, or holds no draftsmith.json (``hint`` says what to do), or
            its draftsmith.json is not a JSON object.
    """
    p = Path(path)
    if not p.exists():
        raise ModelSourceError(f"{_named(role, path)} does not exist; pass an exported head directory, or {hint}")
    if not p.is_dir():
        raise ModelSourceError(
            f"{_named(role, path)} is a file, not a head directory; pass the directory that holds {METADATA_FILE}"
        )
    if not is_head_dir(p):
        raise ModelSourceError(f"{_named(role, path)} is not an exported head (no {METADATA_FILE}); {hint}")
    meta = p / METADATA_FILE if (p / METADATA_FILE).is_file() else p.parent / METADATA_FILE
    _check_json_object(meta, _named(role, path), "re-export the head (`draftsmith export`)")
    return p


def check_safetensors_file(path: str | Path, role: str = "model") -> None:
    """Check that ``path`` is a whole safetensors file from its header and size (the data is not read).

    Raises:
        ModelSourceError: shorter than its header says (truncated download or copy), longer (appended bytes),
            or a header that is not the format's JSON.
    """
    path = Path(path)
    fix = "re-download it, or re-export the model"
    size = path.stat().st_size
    try:
        with path.open("rb") as f:
            first = f.read(8)
            n = int.from_bytes(first, "little") if len(first) == 8 else -1
            if n < 0 or n > min(size - 8, MAX_SAFETENSORS_HEADER):
                raise ModelSourceError(
                    f"{role}: {path} is truncated or not a safetensors file ({size} bytes, "
                    f"too short for its header); {fix}"
                )
            header = json.loads(f.read(n))
        ends = [int(v["data_offsets"][1]) for k, v in header.items() if k != "__metadata__"]
    except (ValueError, KeyError, TypeError, IndexError, AttributeError):
        raise ModelSourceError(f"{role}: {path} has a corrupted safetensors header; {fix}") from None
    expected = 8 + n + max(ends, default=0)
    if size < expected:
        raise ModelSourceError(
            f"{role}: {path} is truncated ({size} bytes on disk, its header describes {expected}); {fix}"
        )
    if size > expected:
        raise ModelSourceError(f"{role}: {path} has {size - expected} bytes past its last tensor (corrupted); {fix}")


def check_model_folder(folder: str | Path, role: str = "model", name: Any = None) -> None:
    """A transformers model folder: ``config.json`` (a JSON object), weights, every shard named by a safetensors
    index present, every ``*.safetensors`` whole (``check_safetensors_file``). Raises ModelSourceError."""
    folder = Path(folder)
    label = _named(role, name if name is not None else folder)
    if not (folder / "config.json").is_file():
        raise ModelSourceError(
            f"{label} is a folder without config.json, not a transformers model; pass the folder "
            f"that holds config.json and the weights"
        )
    _check_json_object(folder / "config.json", label, "re-download the model, or re-export it")
    for index in folder.glob("*.safetensors.index.json"):
        try:
            shards = sorted(set(json.loads(index.read_text(encoding="utf-8"))["weight_map"].values()))
        except (OSError, ValueError, KeyError, AttributeError):
            raise ModelSourceError(f"{label}: {index} is not a readable safetensors index; re-download it") from None
        missing = [s for s in shards if not (folder / s).is_file()]
        if missing:
            raise ModelSourceError(
                f"{label}: {index.name} names {len(missing)} shard(s) not in the folder "
                f"({', '.join(missing[:3])}{', ...' if len(missing) > 3 else ''}); finish the "
                f"download"
            )
    weights = sorted(folder.glob("*.safetensors"))
    if not weights and not any(folder.glob("*.bin")):
        raise ModelSourceError(
            f"{label} holds config.json but no weights (model.safetensors or pytorch_model.bin); "
            f"finish the download, or pass the folder that holds the weights"
        )
    for file in weights:
        check_safetensors_file(file, label)


def _hub_problem(name: str) -> str | None:
    """Why ``name`` cannot be a Hub repo id (huggingface_hub's rules), or None when it can."""
    from huggingface_hub.utils import HFValidationError, validate_repo_id

    try:
        validate_repo_id(name)
    except HFValidationError:
        return "no such folder, and not a Hub id of the form ORG/NAME"
    return None


def check_model_source(name_or_path: str | Path, revision: str | None = None, role: str = "model") -> str:
    """What ``models.load_causal_lm`` will load for ``name_or_path``: the folder of ``reference`` /
    ``reference-draft``, a local folder, or a Hub id (returned as given).

    A local folder must pass ``check_model_folder``. A name that is no folder must be a valid Hub id; in
    offline mode (``HF_HUB_OFFLINE=1``) its ``config.json`` must be in the Hub cache, whose snapshot folder is
    then checked like a local one. Online, a Hub id is left to the loader (the Hub is not contacted here).

    Raises:
        ModelSourceError: one line naming ``role`` and the name, the problem and what to pass instead.
    """
    from huggingface_hub import constants, try_to_load_from_cache

    name = str(name_or_path)
    path = Path(reference.resolve(name))
    if path.exists():
        if not path.is_dir():
            raise ModelSourceError(
                f"{_named(role, name)} is a file, not a model folder; pass the folder that holds "
                f"config.json and the weights"
            )
        check_model_folder(path, role, name)
        return str(path)
    problem = _hub_problem(name)
    if problem is not None:
        raise ModelSourceError(
            f"{_named(role, name)} is neither a local folder nor a Hub id ({problem}); pass a "
            f"model folder or `reference`"
        )
    if constants.is_offline_mode():
        cached = try_to_load_from_cache(name, "config.json", revision=revision)
        if not isinstance(cached, str):
            raise ModelSourceError(
                f"{_named(role, name)} is neither a local folder nor a Hub id reachable offline "
                f"(HF_HUB_OFFLINE=1): pass a model folder or `reference`"
            )
        check_model_folder(Path(cached).parent, role, name)
    return name
