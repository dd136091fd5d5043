"""Loading targets and draft models by name: the embedded reference models or any transformers model.

``load_causal_lm("reference")`` gives the embedded target; ``load_causal_lm("meta-llama/Llama-3.1-8B-Instruct")``
loads from the Hub (or a local folder) through transformers, like vLLM's ``--model``.
"""
from __future__ import annotations

import logging
from dataclasses import dataclass

from draftsmith import reference
from draftsmith.precision import DTYPE_NAMES, dtype_name, resolve_dtype

logger = logging.getLogger(__name__)

@dataclass
class TargetConfig:
    """The target model: a Hub id, a local folder, or ``reference`` (the embedded default)."""

    name_or_path: str = "reference"
    revision: str | None = None
    #: float32 | bfloat16 | float16 | auto (the model's own dtype where the device computes it natively, else
    #: float32: ``draftsmith.precision.resolve_dtype``); capture and serving must use the same
    dtype: str = "float32"


DTYPES = DTYPE_NAMES


def resolve_model_dtype(name_or_path: str, dtype: str, revision: str | None = None, device=None) -> str:
    """The dtype name a model is loaded in: ``dtype`` itself, or for ``auto`` the rule of
    ``precision.resolve_dtype`` over the model config's ``dtype`` (read without loading weights).
    An explicit half precision the device emulates is kept, with a ``SlowPrecisionWarning``.

    Raises ValueError for a dtype outside float32 | bfloat16 | float16 | auto."""
    if dtype != "auto" and dtype not in DTYPES:
        raise ValueError(f"dtype {dtype!r} is not one of {', '.join([*DTYPES, 'auto'])}")
    model_dtype = None
    if dtype == "auto":
        from transformers import AutoConfig

        config = AutoConfig.from_pretrained(reference.resolve(name_or_path), revision=revision)
        model_dtype = getattr(config, "dtype", None) or getattr(config, "torch_dtype", None)
        if isinstance(model_dtype, str):
            model_dtype = DTYPES.get(model_dtype)
    resolved, reason = resolve_dtype(dtype, device, model_dtype=model_dtype, what="the dtype (target.dtype / --dtype)")
    logger.info("%s: loading in %s (%s)", name_or_path, dtype_name(resolved), reason)
    return dtype_name(resolved)


def load_causal_lm(name_or_path: str, revision: str | None = None, dtype: str = "float32"):
    """(model in eval mode with frozen parameters, tokenizer) for ``name_or_path``, in ``dtype``
    (``resolve_model_dtype``: ``auto`` follows the device).

    Raises ValueError for an unknown dtype name; transformers' errors for a missing model."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    dtype = resolve_model_dtype(name_or_path, dtype, revision)
    path = reference.resolve(name_or_path)
    model = AutoModelForCausalLM.from_pretrained(path, revision=revision, dtype=DTYPES[dtype]).eval()
    model.requires_grad_(False)
    tokenizer = AutoTokenizer.from_pretrained(path, revision=revision)
    return model, tokenizer
