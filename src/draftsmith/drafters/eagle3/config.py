"""EAGLE-3's recipe section and speculative-config rules (torch-free: checked before any model loads).

    drafter:
      method: eagle3
      num_speculative_tokens: 5      # k served and evaluated; ttt_steps is how deep the head is trained
      aux_layer_ids: [2, 4, 7]       # HF hidden_states indices, ascending (aux_layer_order_problem)
      ttt_steps: 5

Served as vLLM serves it: ``{"method": "eagle3", "model": HEAD_DIR, "num_speculative_tokens": k}``.
"""

from __future__ import annotations

from dataclasses import dataclass

from draftsmith.core.aux_layers import aux_layer_order_problem, default_aux_layer_ids
from draftsmith.drafters.config import DrafterSection, SpeculativeRules

LEGACY_SECTION = "head"  #: this drafter's recipe section in draftsmith 0.1 (pipeline.recipe)
LEGACY_IN_DEFAULT_EVAL = True  #: one of 0.1's default eval.methods (pipeline.recipe migration)
RULES = SpeculativeRules(
    needs_model=True, model_help="the exported EAGLE-3 head directory", drafts_trees=True, sglang_algorithm="EAGLE3"
)


@dataclass
class Section(DrafterSection):
    """EAGLE-3 head: the shape choices beyond what the target fixes, and the TTT loss weights.

    Raises ValueError for aux layer ids no engine serves as written (``aux_layer_order_problem``), at recipe
    load, before any capture or training step."""

    method: str = "eagle3"
    aux_layer_ids: list[int] | None = None  #: HF hidden-state indices, ascending; None = (2, N//2, N-3)
    ttt_steps: int = 7  #: training-time-test unroll depth (the depth the head is trained for)
    step_decay: float = 0.8  #: loss weight of step i is step_decay**i
    prompt_loss_weight: float = 0.0  #: weight of prompt positions in the distillation loss (ttt.py)
    init_from_target: bool = True  #: start lm_head/norm from the target's (warm start)

    def __post_init__(self):
        super().__post_init__()
        if self.aux_layer_ids is None:
            return
        if len(self.aux_layer_ids) != 3:
            raise ValueError(
                f"drafter.aux_layer_ids {list(self.aux_layer_ids)}: an EAGLE-3 head reads 3 layers. "
                f"Fix: give three HF hidden_states indices, ascending, or null for the default"
            )
        if (problem := aux_layer_order_problem(self.aux_layer_ids)) is not None:
            raise ValueError(f"drafter.{problem}")

    def aux_layers(self, num_hidden_layers: int) -> tuple[int, ...]:
        """The head's three layers: ``aux_layer_ids``, else the default (2, N//2, N-3)."""
        return tuple(self.aux_layer_ids or default_aux_layer_ids(num_hidden_layers))
