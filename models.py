"""Loading targets and draft models by name: the embedded reference models or any transformers model.

``load_causal_lm("reference")`` gives the embedded target; ``load_causal_lm("meta-llama/Llama-3.1-8B-Instruct")``
loads from the Hub (or a local folder) through transformers, like vLLM's ``--model``.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from draftsmith import reference

@dataclass
class TargetConfig:
    """The target model: a Hub id, a local folder, or ``reference`` (the embedded default)."""

    name_or_path: str = "reference"
    revision: str | None = None
    dtype: str = "float32"       #: float32 | bfloat16 | float16; capture and serving must use the same


DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def load_causal_lm(name_or_path: str, revision: str | None = None, dtype: str = "float32"):
    """(model in eval mode with frozen parameters, tokenizer) for ``name_or_path``.

    Raises ValueError for an unknown dtype name; transformers' errors for a missing model."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    if dtype not in DTYPES:
        raise ValueError(f"dtype {dtype!r} is not one of {sorted(DTYPES)}")
    path = reference.resolve(name_or_path)
    model = AutoModelForCausalLM.from_pretrained(path, revision=revision, dtype=DTYPES[dtype]).eval()
    model.requires_grad_(False)
    tokenizer = AutoTokenizer.from_pretrained(path, revision=revision)
    return model, tokenizer
