"""The reference target: a small Llama pretrained on CPython sources, its draft sibling and held-out tasks.

    from draftsmith import reference
    model, tokenizer = reference.target()      # LlamaForCausalLM + tokenizer, from files in this package
    draft, _ = reference.draft()               # the much smaller sibling (same tokenizer)
    tasks = reference.tasks()                  # {"code-complete": [records...], ...}

Built by the scripts in ``tools/reference/`` (corpus, tokenizer, pretraining); the exact commands, seeds
and measured losses are in ``REPRODUCE.md`` beside this file.
"""

from __future__ import annotations

import json
from pathlib import Path

ROOT = Path(__file__).resolve().parent
TARGET_DIR = ROOT / "target"
DRAFT_DIR = ROOT / "draft"
TASKS_DIR = ROOT / "tasks"
#: Names that resolve to the embedded models wherever a ``--target`` / ``model`` is accepted.
ALIASES = {"reference": TARGET_DIR, "reference-target": TARGET_DIR, "reference-draft": DRAFT_DIR}
TASK_NAMES = ("code-complete", "code-foreign", "code-edit", "docstring")
#: ChatML (`<|im_start|>role\n…<|im_end|>\n`), as Qwen2/Qwen3 without tools or thinking.
CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)
SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]  #: the tokenizer's special tokens


def resolve(name_or_path: str | Path) -> str:
    """Map ``reference`` / ``reference-draft`` to the embedded model folders; other names pass through."""
    return str(ALIASES.get(str(name_or_path), name_or_path))


def _load(path: Path, dtype):
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    if not (path / "model.safetensors").exists():
        raise FileNotFoundError(
            f"{path} has no model.safetensors; rebuild it with the commands in {ROOT / 'REPRODUCE.md'}"
        )
    model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype or torch.float32).eval()
    return model, AutoTokenizer.from_pretrained(path)


def target(dtype=None):
    """The reference target (LlamaForCausalLM, eval mode, float32 by default) and its tokenizer."""
    return _load(TARGET_DIR, dtype)


def draft(dtype=None):
    """The draft sibling (same tokenizer and vocabulary as the target) and its tokenizer."""
    return _load(DRAFT_DIR, dtype)


def tasks(names=TASK_NAMES, limit: int | None = None) -> dict[str, list[dict]]:
    """Held-out tasks: ``{task: [{"id", "task", "messages", "reference", "provenance"}, ...]}``.

    Raises KeyError for an unknown task name (the known ones are ``TASK_NAMES``)."""
    out = {}
    for name in names:
        path = TASKS_DIR / f"{name}.jsonl"
        if not path.exists():
            raise KeyError(f"unknown held-out task {name!r}; known: {', '.join(TASK_NAMES)}")
        records = [json.loads(line) for line in path.open()]
        out[name] = records[:limit] if limit else records
    return out
