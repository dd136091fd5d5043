"""Writing an export directory so that a reader never sees half of it: a temp directory beside the target,
fsynced, then renamed into place (a previous export there is replaced, anything else is refused).

    with staged_directory(Path("runs/x/head")) as tmp:
        save_safetensors(state_dict, tmp / "model.safetensors")
        ...                                   # every file of the export, written into tmp

Every drafter's exporter writes through this (``drafters/<name>/export.py``).
"""

from __future__ import annotations

import contextlib
import logging
import os
import shutil
import tempfile
from pathlib import Path

import torch
from safetensors.torch import save_file

from draftsmith.export.metadata import METADATA_FILE

logger = logging.getLogger(__name__)


def save_safetensors(sd: dict[str, torch.Tensor], path: Path) -> None:

    save_file(
        {k: v.detach().to("cpu").contiguous().clone() for k, v in sd.items()}, str(path), metadata={"format": "pt"}
    )


def _fsync_tree(root: Path) -> None:
    for p in sorted(root.rglob("*")):
        if p.is_file():
            with open(p, "rb") as f:
                os.fsync(f.fileno())


@contextlib.contextmanager
def staged_directory(out_dir: Path):
    """Write a directory atomically: yields an empty temp directory beside ``out_dir``; when the block
    ends normally its files are fsynced and it replaces ``out_dir`` (``_install``: a previous draftsmith
    export there is replaced, any other non-empty directory refused); on any error it is deleted and
    ``out_dir`` is left as it was."""
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(dir=out_dir.parent, prefix=f".{out_dir.name}.tmp-"))
    try:
        yield tmp
        _fsync_tree(tmp)
        _install(tmp, out_dir)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


def _install(tmp: Path, out_dir: Path) -> None:
    """Move the finished temp dir to ``out_dir``; a previous head export there is replaced, any
    other non-empty directory is refused."""
    if out_dir.exists():
        if any(out_dir.iterdir()) and not (out_dir / METADATA_FILE).is_file():
            raise FileExistsError(
                f"{out_dir} exists, is not empty and is not a draftsmith head; choose another output directory"
            )
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
