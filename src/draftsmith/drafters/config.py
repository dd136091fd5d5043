"""What every drafter's recipe section and speculative-config rules have in common (torch-free).

    drafter:                        # a recipe's one drafter section; `method` picks the drafter
      method: eagle3
      num_speculative_tokens: 5     # k: eval, bench, in-loop τ and the exported engine configs read it
      aux_layer_ids: [2, 4, 7]      # the rest is the drafter's own (drafters/eagle3/config.py)

Each drafter's ``config.py`` subclasses :class:`DrafterSection` as ``Section`` and states its rules for a
``--speculative-config`` (:class:`SpeculativeRules`: whether a ``model`` is required and what it is, which
further keys it takes). ``draftsmith.config`` builds the subclass that ``method`` names (``variant``).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable

from draftsmith import drafters


@dataclass
class DrafterSection:
    """A recipe's ``drafter`` section: the drafter and how many tokens it drafts per verify step.

    Attributes:
        method: a registered drafter (``drafters.REGISTRY``).
        num_speculative_tokens: k, drafted tokens per verify step (>= 1), as vLLM's speculative config names it.
    """

    method: str = drafters.DEFAULT
    num_speculative_tokens: int = 5

    def __post_init__(self):
        drafters.check_name(self.method, "drafter.method")
        k = self.num_speculative_tokens
        if isinstance(k, bool) or not isinstance(k, int) or k < 1:
            raise ValueError(f"drafter.num_speculative_tokens must be an integer >= 1, got {k!r}")

    def models(self) -> dict[str, str]:
        """The models this section loads to train, by recipe key (``drafter.init_from`` -> name): the CLI checks
        they exist before anything loads. Default: none."""
        return {}

    def aux_layers(self, num_hidden_layers: int) -> tuple[int, ...] | None:
        """The target layers (HF hidden_states index) whose hidden states this drafter reads, for a target of
        ``num_hidden_layers`` layers: what an offline capture stores for it; None when it reads none."""
        return None

    @classmethod
    def variant(cls, data: dict) -> type:
        """The section class of the drafter ``data["method"]`` names (``draftsmith.config`` calls this)."""
        return drafters.section_class(drafters.check_name(data.get("method", drafters.DEFAULT), "method"))


@dataclass(frozen=True)
class SpeculativeRules:
    """How a drafter reads a ``--speculative-config`` (vLLM's keys, ``vllm/config/speculative.py``).

    Attributes:
        needs_model: whether ``model`` is required (False: it must be absent).
        model_help: what ``model`` names, for error messages (``the exported head directory``).
        model_kind: ``export`` (a draftsmith export: a folder with draftsmith.json) or ``model`` (any causal LM
            by name or folder, a draftsmith export included).
        options: further keys the drafter takes, with their defaults (None: computed by ``fill``).
        fill: ``fill(options) -> options`` completes and checks them (ValueError naming the key).
        drafts_trees: whether its proposers draft trees (``Proposer.propose_tree``): a ``tree`` key is refused
            otherwise.
        sglang_algorithm: SGLang's ``--speculative-algorithm`` for it (``sglang/srt/server_args.py``), or None when
            SGLang does not serve it (``serve --engine sglang`` refuses it).
    """

    needs_model: bool = True
    model_help: str = "the exported head directory"
    model_kind: str = "export"
    options: dict[str, Any] = field(default_factory=dict)
    fill: Callable[[dict], dict] | None = None
    drafts_trees: bool = False
    sglang_algorithm: str | None = None
