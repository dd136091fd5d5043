"""The MLP speculator's recipe section and speculative-config rules (torch-free).

    drafter:
      method: mlp_speculator
      num_speculative_tokens: 5      # <= n_predict: one token per stage
      n_predict: 5

Served as vLLM reads it: ``{"method": "mlp_speculator", "model": HEAD_DIR, "num_speculative_tokens": k}``.
"""

from __future__ import annotations

from dataclasses import dataclass

from draftsmith.drafters.config import DrafterSection, SpeculativeRules

LEGACY_SECTION = "mlp_speculator"  #: this drafter's recipe section in draftsmith 0.1 (pipeline.recipe)
RULES = SpeculativeRules(needs_model=True, model_help="the exported MLP speculator directory")


@dataclass
class Section(DrafterSection):
    """MLP speculator stages (Wertheimer et al. 2024): shape choices beyond what the target fixes, loss weights.

    Raises ValueError for n_predict < 1, a stage decay outside (0, 1], or num_speculative_tokens > n_predict
    (a stage drafts one token; vLLM refuses more too)."""

    method: str = "mlp_speculator"
    n_predict: int = 5  #: stages = most tokens drafted per step (serve k <= n_predict)
    inner_dim: int | None = None  #: stages' width D; None = the target's hidden size
    scale_input: bool = False  #: rms-normalise the stage-0 state and divide it by sqrt(2) (vLLM field)
    stage_decay: float = 1.0  #: loss weight of stage i is stage_decay**i (1.0: all stages alike)
    prompt_loss_weight: float = 0.0  #: weight of prompt positions in the distillation loss (as EAGLE-3's)
    init_from_target: bool = True  #: stages' emb / head start from the target's embeddings (needs D == H)

    def __post_init__(self):
        super().__post_init__()
        if self.n_predict < 1:
            raise ValueError(f"drafter.n_predict must be >= 1, got {self.n_predict}")
        if not 0.0 < self.stage_decay <= 1.0:
            raise ValueError(f"drafter.stage_decay must be in (0, 1], got {self.stage_decay}")
        if self.num_speculative_tokens > self.n_predict:
            raise ValueError(
                f"drafter.num_speculative_tokens={self.num_speculative_tokens} > drafter.n_predict="
                f"{self.n_predict}: an MLP speculator drafts one token per stage; set "
                f"num_speculative_tokens <= {self.n_predict} or train more stages"
            )
