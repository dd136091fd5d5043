"""Operations on an exported drafter directory, whatever its drafter: found by ``draftsmith.json`` ``head_type``.

    report = check_export("runs/reference-eagle3/head", target, tokenizer)     # `draftsmith check`
    write_card("runs/reference-eagle3/head", report=eval_report, plot="runs/.../acceptance.png")
    reexport("runs/reference-eagle3/head", "heads/ref", formats=["all"])

Each call reads the head type recorded in the directory (a format sub-directory such as ``HEAD/speculators``
resolves to its export root) and hands the work to that drafter (``drafters.get``).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Sequence

from draftsmith import drafters
from draftsmith.export.card import write_model_card
from draftsmith.export.check import CheckReport
from draftsmith.export.metadata import METADATA_FILE, read_metadata


def export_root(path: str | Path) -> Path:
    """The export root of ``path``: itself, or its parent when ``path`` is a format folder (``HEAD/speculators``).

    Raises FileNotFoundError when neither holds draftsmith.json."""
    path = Path(path)
    for candidate in (path, path.parent):
        if (candidate / METADATA_FILE).is_file():
            return candidate
    raise FileNotFoundError(
        f"{path}: no {METADATA_FILE}; not a draftsmith export (export one with `draftsmith "
        "train` / `draftsmith export`)"
    )


def drafter_of(path: str | Path):
    """The ``Drafter`` that wrote the export at ``path`` (its recorded ``head_type``)."""
    return drafters.get(read_metadata(export_root(path)).head_type)


def check_export(
    head_dir: str | Path,
    target_config: Any = None,
    tokenizer: Any = None,
    name_or_path: str | None = None,
    allow_mismatch: Sequence[str] = (),
    tensor_parallel_size: int | None = None,
) -> CheckReport:
    """Every check of ``draftsmith check`` by the export's own drafter (``Drafter.check``).

    Raises HeadMismatchError naming the field, both values and the fix; FileNotFoundError for a directory that
    is not an export."""
    return drafter_of(head_dir).check(
        head_dir, target_config, tokenizer, name_or_path, allow_mismatch, tensor_parallel_size
    )


def write_card(head_dir: str | Path, report: dict | None = None, plot: str | Path | None = None) -> Path:
    """(Re)write the export's model card (``export.card.write_model_card`` with its drafter's lines)."""
    return write_model_card(head_dir, drafter_of(head_dir).card_lines, report, plot)


def reexport(head_dir: str | Path, out_dir: str | Path, formats: Sequence[str] = ("all",)) -> Path:
    """The export again, in other formats or another place (``Drafter.reexport``)."""
    return drafter_of(head_dir).reexport(head_dir, out_dir, formats)
