"""DFlash's recipe section and speculative-config rules (torch-free: checked before any model loads).

    drafter:
      method: dflash
      num_speculative_tokens: 7      # k drafted per verify step, <= block_size - 1
      block_size: 8                  # trained block: 1 real token + 7 mask positions
      num_hidden_layers: 2           # draft decoder layers
      target_layer_ids: [1, 3, 5]    # DFlash convention: 0-based target layers whose OUTPUT is read (null: spread)
      mask_token_id: null            # null: the first embedding row past the tokenizer's vocabulary, else pad

Served as vLLM serves it: ``{"method": "dflash", "model": HEAD_DIR, "num_speculative_tokens": k}``.

Every default and its source (the closing note of the issue that added DFlash lists them too):
  * ``target_layer_ids``: z-lab ``build_target_layer_ids`` (``default_target_layer_ids``), one per draft layer;
  * loss weight of block position j >= 1: exp(-(j - 1) / gamma), gamma 7 / 5 / 4 for block 16 / 10 / 8 (DFlash
    paper Eq. 4, SpecForge ``--loss-decay-gamma``), linearly interpolated for other block sizes;
  * ``num_anchors`` 512 blocks sampled per sequence (SpecForge, speculators and Model-Optimizer alike);
  * labels: the target's distribution at the position before each block position (Model-Optimizer's default
    ``dflash_self_logit_distillation``), as every draftsmith drafter distils the target.
"""

from __future__ import annotations

from dataclasses import dataclass

from draftsmith.drafters.config import DrafterSection, SpeculativeRules

RULES = SpeculativeRules(needs_model=True, model_help="the exported DFlash drafter directory", drafts_trees=True)

#: published decay constants by block size (DFlash paper Eq. 4, SpecForge ``train_dflash.py`` help text)
PUBLISHED_GAMMA = {8: 4.0, 10: 5.0, 16: 7.0}


def default_gamma(block_size: int) -> float:
    """The loss decay constant of ``block_size``: the published one (``PUBLISHED_GAMMA``), else linear
    interpolation between the published points (extrapolated with the nearest segment's slope)."""
    if block_size in PUBLISHED_GAMMA:
        return PUBLISHED_GAMMA[block_size]
    points = sorted(PUBLISHED_GAMMA.items())
    if block_size < points[0][0]:
        (x0, y0), (x1, y1) = points[0], points[1]
    elif block_size > points[-1][0]:
        (x0, y0), (x1, y1) = points[-2], points[-1]
    else:
        (x0, y0), (x1, y1) = next((a, b) for a, b in zip(points, points[1:]) if a[0] < block_size < b[0])
    return max(0.5, y0 + (y1 - y0) * (block_size - x0) / (x1 - x0))


def default_target_layer_ids(num_target_layers: int, num_features: int) -> tuple[int, ...]:
    """``num_features`` target layers spread from layer 1 to layer N-3 (DFlash convention: 0-based layer whose
    output is read), z-lab's rule (``dflash/model/utils.py`` ``build_target_layer_ids``): Qwen3-8B (36 layers),
    5 features -> (1, 9, 17, 25, 33). One feature reads the middle layer. Ids are capped at N-2 (their HF index
    must be the input of a decoder layer, ``core.aux_layers``).

    Raises ValueError for a target too shallow to give ``num_features`` distinct layers."""
    n = int(num_target_layers)
    if num_features == 1:
        ids = (n // 2,)
    else:
        start, end = 1, max(1, n - 3)
        ids = tuple(int(round(start + i * (end - start) / (num_features - 1))) for i in range(num_features))
    ids = tuple(min(i, n - 2) for i in ids)
    if len(set(ids)) != len(ids) or min(ids) < 0:
        raise ValueError(
            f"a {n}-layer target has no {num_features} distinct layers to read for DFlash (got {ids}); "
            f"give drafter.target_layer_ids explicitly or read fewer layers"
        )
    return ids


@dataclass
class Section(DrafterSection):
    """DFlash block drafter: shape choices beyond what the target fixes, and the block objective.

    Raises ValueError for block_size < 2, num_speculative_tokens > block_size - 1, target_layer_ids not strictly
    ascending or negative, a gamma <= 0 or num_anchors < 1 (at recipe load, before any model loads)."""

    method: str = "dflash"
    num_speculative_tokens: int = 7
    block_size: int = 8  #: trained block length (1 real token + block_size - 1 masks); k <= block_size - 1
    num_hidden_layers: int = 2  #: draft decoder layers
    intermediate_size: int | None = None  #: draft MLP width; None = the target's
    target_layer_ids: list[int] | None = None  #: 0-based target layers read (DFlash convention); None: spread
    mask_token_id: int | None = None  #: None: first embedding row past the tokenizer, else the pad token
    loss_decay_gamma: float | None = None  #: None: ``default_gamma(block_size)``
    num_anchors: int = 512  #: blocks sampled per sequence and step (at most its valid anchor positions)
    init_from_target: bool = True  #: start the final norm from the target's (its lm_head reads the output)

    def __post_init__(self):
        super().__post_init__()
        if self.block_size < 2:
            raise ValueError(f"drafter.block_size must be >= 2 (one real token and a mask), got {self.block_size}")
        if self.num_speculative_tokens > self.block_size - 1:
            raise ValueError(
                f"drafter.num_speculative_tokens={self.num_speculative_tokens} > block_size - 1 = "
                f"{self.block_size - 1}: a DFlash block drafts at most block_size - 1 tokens; set "
                f"num_speculative_tokens <= {self.block_size - 1} or train a larger block_size"
            )
        if self.num_hidden_layers < 1:
            raise ValueError(f"drafter.num_hidden_layers must be >= 1, got {self.num_hidden_layers}")
        if self.target_layer_ids is not None:
            ids = [int(i) for i in self.target_layer_ids]
            if not ids or min(ids) < 0 or any(a >= b for a, b in zip(ids, ids[1:])):
                raise ValueError(
                    f"drafter.target_layer_ids {ids}: give 0-based target layers (DFlash convention: the layer "
                    f"whose output is read), strictly ascending, e.g. {sorted(set(abs(i) for i in ids)) or [1]}"
                )
        if self.loss_decay_gamma is not None and not self.loss_decay_gamma > 0:
            raise ValueError(f"drafter.loss_decay_gamma must be > 0, got {self.loss_decay_gamma}")
        if self.num_anchors < 1:
            raise ValueError(f"drafter.num_anchors must be >= 1, got {self.num_anchors}")

    @property
    def gamma(self) -> float:
        """The loss decay constant used (``loss_decay_gamma`` or ``default_gamma``)."""
        return float(self.loss_decay_gamma or default_gamma(self.block_size))

    def layer_ids(self, num_hidden_layers: int) -> tuple[int, ...]:
        """``target_layer_ids`` or z-lab's spread over a target of ``num_hidden_layers`` layers (one per draft
        layer); refuses ids past N - 2 (their hidden state must be the input of a decoder layer)."""
        if self.target_layer_ids is None:
            return default_target_layer_ids(num_hidden_layers, self.num_hidden_layers)
        ids = tuple(int(i) for i in self.target_layer_ids)
        if max(ids) > num_hidden_layers - 2:
            raise ValueError(
                f"drafter.target_layer_ids {list(ids)}: a {num_hidden_layers}-layer target's layers are "
                f"0..{num_hidden_layers - 1}, and DFlash reads outputs up to layer {num_hidden_layers - 2} (the "
                f"last layer's output is the normed final state); use ids <= {num_hidden_layers - 2}"
            )
        return ids

    def aux_layers(self, num_hidden_layers: int) -> tuple[int, ...]:
        """The HF hidden_states indices captured for it: ``layer_ids`` + 1."""
        return tuple(i + 1 for i in self.layer_ids(num_hidden_layers))
