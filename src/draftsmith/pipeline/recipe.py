"""The recipe: one job as typed sections, loaded from YAML without torch (a bad recipe answers in a fraction of a
second), and the migration of recipes written before the drafter registry.

    recipe = load_config(Recipe, "recipes/reference/eagle3.yaml", ["train.lr=1e-4"])
    recipe.drafter.method, recipe.drafter.num_speculative_tokens        # 'eagle3', 5

Sections: ``target``, ``data`` (``data_pipeline.config``), ``drafter`` (the one drafter the recipe trains and
evaluates, with its k: ``drafters.config.DrafterSection``, the subclass its ``method`` names), ``train``
(``train.config``), ``capture``, ``export``, ``eval`` (``evaluation.config``). Unknown keys are refused.

Migration (``Recipe.migrate``, applied to every mapping loaded as a Recipe: YAML files, overrides, and the
recipes stored inside checkpoints): draftsmith 0.1 named the drafter with a top-level ``method`` and kept its
settings in a section per drafter (``head`` for eagle3, ``draft_model``, ``mlp_speculator``), with one
``eval.k`` for every row and the comparison rows as bare names (``eval.methods``, configured by
``eval.prompt_lookup_min/max`` and ``eval.draft_model``). These become ``drafter`` (``eval.k`` its
``num_speculative_tokens``) and labelled ``eval.drafters`` rows; the aux layers of an old ``head`` section of
a non-EAGLE-3 recipe (what its offline capture stored) become ``capture.aux_layer_ids``.
"""

from __future__ import annotations

import copy
import logging
from dataclasses import dataclass, field
from pathlib import Path

from draftsmith import drafters
from draftsmith.data_pipeline.config import DataConfig
from draftsmith.drafters.config import DrafterSection
from draftsmith.evaluation.config import EvalConfig
from draftsmith.train.config import TrainConfig

logger = logging.getLogger(__name__)

#: 0.1's eval keys that configured every row (``k``) and named the comparison rows; each drafter's config module
#: names the further keys that configured its row (``LEGACY_EVAL_KEYS``) and applies their 0.1 defaults
#: (``legacy_eval_row``); 0.1's default rows were the drafters whose config module says ``LEGACY_IN_DEFAULT_EVAL``
LEGACY_EVAL_KEYS = ("k", "methods")
LEGACY_K = 5  #: 0.1's default eval.k


@dataclass
class TargetConfig:
    """The target model: a Hub id, a local folder, or ``reference`` (the embedded default)."""

    name_or_path: str = "reference"
    revision: str | None = None
    #: float32 | bfloat16 | float16 | auto (the model's own dtype where the device computes it natively, else
    #: float32: ``draftsmith.precision.resolve_dtype``); capture and serving must use the same
    dtype: str = "float32"
    device: str = "auto"  #: where the target runs: auto (cuda when available, else cpu) | cpu | cuda | cuda:N


@dataclass
class ExportConfig:
    """Which formats ``export`` writes besides draftsmith's own (the drafter's ``formats``; ``all`` = every one), and
    whether the export gets its golden acceptance trace (``HEAD/trace.json``, what ``draftsmith certify`` replays)."""

    formats: list[str] = field(default_factory=lambda: ["draftsmith"])
    trace: bool = True  #: write HEAD/trace.json (evaluation.certify.make_trace: 4 held-out prompts x 32 tokens)


@dataclass
class CaptureConfig:
    """Offline capture (``draftsmith capture``): hidden-state shards written under ``runs/NAME/capture``."""

    shard_size: int = 512  #: conversations per shard
    batch_size: int = 8  #: sequences per target forward
    dtype: str | None = None  #: stored hidden-state dtype, recorded; must be target.dtype (None = it)
    #: target layers whose hidden states are stored (HF hidden_states index, ascending); None = the ones the
    #: drafter reads, else the default (2, N//2, N-3). Every capture also stores the final hidden state.
    aux_layer_ids: list[int] | None = None


@dataclass
class Recipe:
    """One job: the target, its data, the one drafter it trains and evaluates (``drafter.method`` names it; its
    ``num_speculative_tokens`` is the k eval, bench, in-loop τ and export read), and how to train, capture,
    export and evaluate. Unknown keys are rejected when loading; 0.1 recipes are migrated (module docstring)."""

    name: str = "reference-eagle3"
    out_dir: Path = Path("runs")
    target: TargetConfig = field(default_factory=TargetConfig)
    data: DataConfig = field(default_factory=DataConfig)
    drafter: DrafterSection = field(default_factory=lambda: drafters.section_class(drafters.DEFAULT)())
    train: TrainConfig = field(default_factory=TrainConfig)
    capture: CaptureConfig = field(default_factory=CaptureConfig)
    export: ExportConfig = field(default_factory=ExportConfig)
    eval: EvalConfig = field(default_factory=EvalConfig)

    @property
    def run_dir(self) -> Path:
        """``out_dir/name``: where the run's data, capture, checkpoints, head and eval go."""
        return Path(self.out_dir) / self.name

    @staticmethod
    def migrate(data: dict) -> dict:
        """A recipe mapping in today's schema: 0.1's sections moved (module docstring); a current one as is.

        Each drafter's ``config`` module says what it was called in 0.1 (``LEGACY_SECTION``) and how 0.1's
        eval settings configured its comparison row (``legacy_eval_row``)."""
        legacy = {name: getattr(drafters.config_module(name), "LEGACY_SECTION", None) for name in drafters.names()}
        sections = {key for key in legacy.values() if key}
        eval_keys = LEGACY_EVAL_KEYS + tuple(
            key for name in drafters.names() for key in getattr(drafters.config_module(name), "LEGACY_EVAL_KEYS", ())
        )
        if (
            not isinstance(data, dict)
            or not ({"method"} | sections) & set(data)
            and not set(data.get("eval") or {}) & set(eval_keys)
        ):
            return data
        data = copy.deepcopy(data)
        drafter = dict(data.get("drafter") or {})
        method = drafters.check_name(data.pop("method", drafter.get("method", drafters.DEFAULT)), "method")
        if drafter.get("method", method) != method:  # another drafter named: keep only what all share
            drafter = {k: v for k, v in drafter.items() if k == "num_speculative_tokens"}
        old = {key: data.pop(key) for key in sections if key in data}
        # the old section's values win: on a current recipe they come from overrides (``head.ttt_steps=3``)
        drafter = {**drafter, **(old.pop(legacy[method], None) or {}), "method": method}
        aux = next((sec["aux_layer_ids"] for sec in old.values() if (sec or {}).get("aux_layer_ids")), None)
        if aux and "aux_layer_ids" not in (data.get("capture") or {}):
            data.setdefault("capture", {})["aux_layer_ids"] = aux  # what its offline capture stored
        ev = dict(data.get("eval") or {})
        if "k" in ev:  # 0.1's one k: the drafter's (an override wins)
            drafter["num_speculative_tokens"] = ev["k"]
        drafter.setdefault("num_speculative_tokens", LEGACY_K)
        default_rows = [n for n in drafters.names() if getattr(drafters.config_module(n), "LEGACY_IN_DEFAULT_EVAL", 0)]
        old_eval = {"methods": default_rows, **{key: ev.pop(key) for key in eval_keys if key in ev}}
        rows = dict(ev.get("drafters") or {})
        for name in old_eval.get("methods") or ():
            if name == method or name in rows:
                continue  # the recipe's own drafter is always a row
            row_of = getattr(
                drafters.config_module(drafters.check_name(name, "eval.methods entry")), "legacy_eval_row", None
            )
            row = row_of(old_eval) if row_of else None
            if row is None:
                logger.warning(
                    "recipe migration: eval.methods entry %r needs a model the recipe does not name; "
                    "left out (add it under eval.drafters)",
                    name,
                )
            else:
                rows[name] = row
        if rows:
            ev["drafters"] = rows
        data["eval"], data["drafter"] = ev, drafter
        logger.info("recipe migrated from draftsmith 0.1 sections (method %s)", method)
        return data
