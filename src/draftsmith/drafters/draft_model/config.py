"""The draft model's recipe section and speculative-config rules (torch-free).

    drafter:
      method: draft_model
      num_speculative_tokens: 5
      init_from: reference-draft     # a smaller model of the target's family, or null to build one

Served as vLLM serves it: ``{"method": "draft_model", "model": DIR_OR_NAME, "num_speculative_tokens": k}``; a
plain transformers causal LM with the target's tokenizer works too.
"""

from __future__ import annotations

from dataclasses import dataclass

from draftsmith.config import ConfigError
from draftsmith.drafters.config import DrafterSection, SpeculativeRules

LEGACY_SECTION = "draft_model"  #: this drafter's recipe section in draftsmith 0.1 (pipeline.recipe)
LEGACY_IN_DEFAULT_EVAL = True  #: one of 0.1's default eval.methods (pipeline.recipe migration)
RULES = SpeculativeRules(
    needs_model=True,
    model_kind="model",
    model_help="the draft model's name or folder; reference-draft is the embedded one",
    sglang_algorithm="STANDALONE",
)

#: geometry fields of ``Section`` copied onto the target's config for a model built from scratch
GEOMETRY = ("num_hidden_layers", "hidden_size", "intermediate_size", "num_attention_heads", "num_key_value_heads")


@dataclass
class Section(DrafterSection):
    """The draft LM to distil (the recipe's drafter section, ``method: draft_model``).

    With ``init_from`` the model is loaded from that name or folder (same family, the target's
    tokenizer) and the geometry fields must stay null; without it a model of the target's config class
    is built with the geometry given here (null = the target's value; depth: a quarter of the target's).

    Raises ConfigError for geometry given together with ``init_from`` or a weight outside [0, 1]."""

    method: str = "draft_model"
    init_from: str | None = (
        "reference-draft"  #: causal LM to start from (name, folder or reference-draft); null = build
    )
    num_hidden_layers: int | None = None  #: built model only; null = a quarter of the target's (at least 1)
    hidden_size: int | None = None  #: built model only; null = the target's
    intermediate_size: int | None = None  #: built model only; null = the target's
    num_attention_heads: int | None = None  #: built model only; null = the target's
    num_key_value_heads: int | None = None  #: built model only; null = the target's
    tie_word_embeddings: bool | None = None  #: built model only; null = the target's setting
    init_from_target: bool = True  #: built model of the target's hidden size: start embedding,
    #: final norm and lm_head from the target's (warm start, as EAGLE-3's head.init_from_target)
    prompt_loss_weight: float = 0.0  #: weight of prompt positions in the KL (train.py docstring)

    def __post_init__(self):
        super().__post_init__()
        if not 0.0 <= self.prompt_loss_weight <= 1.0:
            raise ConfigError(f"drafter.prompt_loss_weight must be in [0, 1], got {self.prompt_loss_weight}")
        if self.init_from is not None:
            given = [k for k in GEOMETRY + ("tie_word_embeddings",) if getattr(self, k) is not None]
            if given:
                raise ConfigError(
                    f"drafter.{given[0]} applies to a model built from the target's config; with "
                    f"drafter.init_from={self.init_from!r} the loaded model's geometry is used. Set "
                    f"{', '.join('drafter.' + k + '=null' for k in given)}, or init_from=null"
                )

    def models(self) -> dict[str, str]:
        """``init_from``, the model distillation starts from (when given)."""
        return {"drafter.init_from": self.init_from} if self.init_from else {}


LEGACY_EVAL_KEYS = ("draft_model",)  #: 0.1's eval key that named this row's model (pipeline.recipe migration)


def legacy_eval_row(old_eval: dict) -> dict | None:
    """The comparison row 0.1's ``eval.methods: [draft_model]`` meant: the draft ``eval.draft_model`` named
    (0.1's default: the embedded reference-draft)."""
    model = old_eval.get("draft_model", "reference-draft")
    return {"method": "draft_model", "model": model} if model else None
