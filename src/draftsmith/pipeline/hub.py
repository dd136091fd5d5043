"""``draftsmith push``: upload an exported head directory to the Hugging Face Hub.

The head is checked for integrity first (``drafters.directory.check_export`` without a target: format version, weight
sha256, tensor names and shapes, vocab map), so a corrupted export is never published. The token
comes from the usual places (``HF_TOKEN``, ``huggingface-cli login``) through huggingface_hub.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from huggingface_hub import HfApi

from draftsmith.drafters.directory import check_export


@dataclass
class PushPlan:
    """What a push uploads: files (relative paths) with their sizes in bytes."""

    repo_id: str
    revision: str | None
    private: bool
    files: list[tuple[str, int]]

    def summary(self) -> str:
        total = sum(size for _, size in self.files)
        lines = [
            f"{self.repo_id}@{self.revision or 'main'} ({'private' if self.private else 'public'}): "
            f"{len(self.files)} files, {total / 1e6:.1f} MB"
        ]
        lines += [f"  {name}  {size:,} B" for name, size in self.files]
        return "\n".join(lines)


def plan_push(head_dir: str | Path, repo_id: str, revision: str | None = None, private: bool = False) -> PushPlan:
    """Check the head and list what would be uploaded (hidden files and temp files excluded).

    Raises HeadMismatchError for a broken head, ValueError for a repo id not of the form ORG/NAME."""
    head_dir = Path(head_dir)
    if repo_id.count("/") != 1 or not all(repo_id.split("/")):
        raise ValueError(f"repo id {repo_id!r} must look like ORG/NAME")
    check_export(head_dir, None)
    files = sorted(
        (str(p.relative_to(head_dir)), p.stat().st_size)
        for p in head_dir.rglob("*")
        if p.is_file()
        and not any(part.startswith(".") for part in p.relative_to(head_dir).parts)
        and not p.name.endswith(".tmp")
    )
    return PushPlan(repo_id, revision, private, files)


def push_head(
    head_dir: str | Path,
    repo_id: str,
    revision: str | None = None,
    private: bool = False,
    dry_run: bool = False,
    token: str | None = None,
) -> PushPlan:
    """Upload ``head_dir`` to model repo ``repo_id`` (created if absent; branch ``revision`` too).

    With ``dry_run`` nothing is sent and the plan is returned."""
    plan = plan_push(head_dir, repo_id, revision, private)
    if dry_run:
        return plan

    api = HfApi(token=token)
    api.create_repo(repo_id, repo_type="model", private=private, exist_ok=True)
    if revision:
        api.create_branch(repo_id, branch=revision, repo_type="model", exist_ok=True)
    api.upload_folder(
        folder_path=str(head_dir),
        repo_id=repo_id,
        repo_type="model",
        revision=revision,
        commit_message="Upload draftsmith head",
        ignore_patterns=[".*", "*.tmp"],
    )
    return plan
