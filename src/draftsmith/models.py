"""Loading targets and draft models by name: the embedded reference models or any transformers model.

``load_causal_lm("reference")`` gives the embedded target; ``load_causal_lm("meta-llama/Llama-3.1-8B-Instruct")``
loads from the Hub (or a local folder) through transformers, like vLLM's ``--model``.
"""

from __future__ import annotations

import logging

from huggingface_hub.errors import (
    GatedRepoError,
    LocalEntryNotFoundError,
    RepositoryNotFoundError,
    RevisionNotFoundError,
)
from safetensors import SafetensorError
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

from draftsmith.precision import DTYPE_NAMES, default_device, dtype_name, resolve_dtype
from draftsmith.sources import ModelSourceError, check_model_source

logger = logging.getLogger(__name__)


DTYPES = DTYPE_NAMES


def load_target(cfg):
    """(model, tokenizer) of a recipe's target (``pipeline.recipe.TargetConfig``: name_or_path, revision, dtype,
    device), loaded in ``cfg.dtype`` and moved to ``cfg.device`` (auto: cuda when available)."""

    device = default_device() if cfg.device == "auto" else cfg.device
    dtype = resolve_model_dtype(cfg.name_or_path, cfg.dtype, cfg.revision, device)
    model, tokenizer = load_causal_lm(cfg.name_or_path, cfg.revision, dtype, role="target")
    return model.to(device), tokenizer


def resolve_model_dtype(name_or_path: str, dtype: str, revision: str | None = None, device=None) -> str:
    """The dtype name a model is loaded in: ``dtype`` itself, or for ``auto`` the rule of
    ``precision.resolve_dtype`` over the model config's ``dtype`` (read without loading weights).
    An explicit half precision the device emulates is kept, with a ``SlowPrecisionWarning``.

    Raises ValueError for a dtype outside float32 | bfloat16 | float16 | auto."""
    if dtype != "auto" and dtype not in DTYPES:
        raise ValueError(f"dtype {dtype!r} is not one of {', '.join([*DTYPES, 'auto'])}; pass one of them")
    model_dtype = None
    if dtype == "auto":
        config = AutoConfig.from_pretrained(check_model_source(name_or_path, revision), revision=revision)
        model_dtype = getattr(config, "dtype", None) or getattr(config, "torch_dtype", None)
        if isinstance(model_dtype, str):
            model_dtype = DTYPES.get(model_dtype)
    resolved, reason = resolve_dtype(dtype, device, model_dtype=model_dtype, what="the dtype (target.dtype / --dtype)")
    logger.info("%s: loading in %s (%s)", name_or_path, dtype_name(resolved), reason)
    return dtype_name(resolved)


def load_causal_lm(name_or_path: str, revision: str | None = None, dtype: str = "float32", role: str = "model"):
    """(model in eval mode with frozen parameters, tokenizer) for ``name_or_path``, in ``dtype``
    (``resolve_model_dtype``: ``auto`` follows the device).

    ``role`` names the model in error messages ("target", "draft model").

    Raises:
        ValueError: an unknown dtype name.
        ModelSourceError (an OSError): ``name_or_path`` is no loadable model (``sources.check_model_source``:
            no such folder, an offline Hub id not in the cache, a truncated safetensors file, ...), or
            transformers failed to load it (the message says why, by the kind of error, and what to do).
    """

    path = check_model_source(name_or_path, revision, role)
    dtype = resolve_model_dtype(name_or_path, dtype, revision)
    try:
        model = AutoModelForCausalLM.from_pretrained(path, revision=revision, dtype=DTYPES[dtype]).eval()
        tokenizer = AutoTokenizer.from_pretrained(path, revision=revision)
    except Exception as e:
        problem, fix = _load_failure(e)
        if problem is None:
            raise
        raise ModelSourceError(f"{role} {str(name_or_path)!r} could not be loaded: {problem}; {fix}") from e
    model.requires_grad_(False)
    return model, tokenizer


def _load_failure(error: BaseException) -> tuple[str | None, str]:
    """(problem, fix) for an error transformers raised while loading a model, chosen by the kind of the error or
    of its causes (huggingface_hub's, safetensors'); problem None: not a loading error (re-raise it)."""

    chain, e = [], error
    while e is not None and e not in chain:
        chain.append(e)
        e = e.__cause__ or e.__context__
    text = " ".join(line.strip() for line in str(error).splitlines() if line.strip()) or type(error).__name__
    first = text if len(text) <= 300 else text[:297] + "..."
    for e in chain:
        if isinstance(e, GatedRepoError):
            return "it is a gated Hub repo", "accept its terms on its Hub page, then log in (`hf auth login`)"
        if isinstance(e, RepositoryNotFoundError):
            return "no such Hub repo, or a private one", "check the id, or log in (`hf auth login`)"
        if isinstance(e, RevisionNotFoundError):
            return "the Hub repo has no such revision", "check the revision (--revision / target.revision)"
        if isinstance(e, LocalEntryNotFoundError):
            return (
                "the Hub cannot be reached and its files are not in the cache",
                "connect to the network, or pass a model folder or `reference`",
            )
        if isinstance(e, SafetensorError):
            return f"a weights file is not valid safetensors ({e})", "re-download it, or re-export the model"
    if isinstance(error, (OSError, ValueError)):
        return first.rstrip(
            " .:;"
        ), "check the name and the folder's files, or pass another model folder or `reference`"
    return None, ""
