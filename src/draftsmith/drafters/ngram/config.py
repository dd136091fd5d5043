"""N-gram prompt lookup's recipe section and speculative-config rules (torch-free).

    drafter: {method: ngram, num_speculative_tokens: 5, prompt_lookup_min: 2, prompt_lookup_max: 5}

vLLM's keys and meaning (``vllm/config/speculative.py``): ``prompt_lookup_min`` / ``prompt_lookup_max`` bound
the suffix n-gram looked up. vLLM's defaults are min = max = 5 when neither is set; draftsmith's are min 1,
max max(5, min): a short match still drafts (``proposer.py``).
"""

from __future__ import annotations

from dataclasses import dataclass

from draftsmith.drafters.config import DrafterSection, SpeculativeRules


def fill_lookup_bounds(options: dict) -> dict:
    """``prompt_lookup_min`` / ``prompt_lookup_max`` completed (1 and max(5, min)) and checked.

    Raises ValueError for a bound that is not an integer >= 1, or min > max."""
    lo, hi = options.get("prompt_lookup_min"), options.get("prompt_lookup_max")
    for name, value in (("prompt_lookup_min", lo), ("prompt_lookup_max", hi)):
        if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
            raise ValueError(f"speculative config: {name} must be an integer >= 1, got {value!r}")
    lo = 1 if lo is None else lo
    hi = max(5, lo) if hi is None else hi
    if lo > hi:
        raise ValueError(f"speculative config: prompt_lookup_min ({lo}) > prompt_lookup_max ({hi})")
    return {**options, "prompt_lookup_min": lo, "prompt_lookup_max": hi}


LEGACY_IN_DEFAULT_EVAL = True  #: one of 0.1's default eval.methods (pipeline.recipe migration)
RULES = SpeculativeRules(
    needs_model=False,
    options={"prompt_lookup_min": None, "prompt_lookup_max": None},
    fill=fill_lookup_bounds,
    sglang_algorithm="NGRAM",
)


@dataclass
class Section(DrafterSection):
    """N-gram lookup as a recipe's drafter (nothing to train; eval and bench serve it)."""

    method: str = "ngram"
    prompt_lookup_min: int | None = None  #: shortest suffix n-gram looked up (None: 1)
    prompt_lookup_max: int | None = None  #: longest suffix n-gram looked up (None: max(5, min))

    def __post_init__(self):
        super().__post_init__()
        bounds = fill_lookup_bounds(
            {"prompt_lookup_min": self.prompt_lookup_min, "prompt_lookup_max": self.prompt_lookup_max}
        )
        self.prompt_lookup_min, self.prompt_lookup_max = bounds["prompt_lookup_min"], bounds["prompt_lookup_max"]


LEGACY_EVAL_KEYS = ("prompt_lookup_min", "prompt_lookup_max")  #: 0.1's eval keys of this row (pipeline.recipe)


def legacy_eval_row(old_eval: dict) -> dict:
    """The comparison row 0.1's ``eval.methods: [ngram]`` meant, with its ``eval.prompt_lookup_min/max`` (0.1's
    defaults: 2 and 5)."""
    return {
        "method": "ngram",
        "prompt_lookup_min": old_eval.get("prompt_lookup_min", 2),
        "prompt_lookup_max": old_eval.get("prompt_lookup_max", 5),
    }
