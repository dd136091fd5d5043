"""draftsmith: train speculative-decoding draft heads (EAGLE-3, MLP speculators, draft models) and serve them."""

from __future__ import annotations

from pathlib import Path

__version__ = "0.1.0"


def checkout_root() -> Path | None:
    """The repository root when draftsmith runs from a source checkout (``ROOT/src/draftsmith`` with
    ``ROOT/.git``), else None (an installed wheel): where the git sha and the vLLM referee's venv are found."""
    root = Path(__file__).resolve().parents[2]
    return root if (root / ".git").exists() and (root / "pyproject.toml").is_file() else None
