"""``--speculative-config``: vLLM's JSON keys, checked against the drafter they name (torch-free).

    spec = SpeculativeConfig.parse('{"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 3}')
    spec.method, spec.num_speculative_tokens, spec.options       # 'ngram', 4, {'prompt_lookup_min': 1, ...}

Keys (``vllm/config/speculative.py``): ``method``, ``model``, ``num_speculative_tokens`` (an integer, or draftsmith's
``"auto"``: adaptive speculation, ``core.adaptive``), draftsmith's ``tree``
(an EAGLE-2 draft tree, SGLang's ``topk`` / ``num_steps`` / ``num_draft_tokens``: ``core.tree.TreeShape``; its
``num_steps`` is then k), and the keys the method's own rules take (``drafters/<name>/config.py`` ``RULES``;
e.g. ngram's ``prompt_lookup_min`` / ``prompt_lookup_max``). Any other key is refused, naming the keys that
method accepts. When ``method`` is omitted it is inferred from ``model`` as vLLM does: the ``head_type`` of an
exported directory's ``draftsmith.json``, else a plain causal LM (the draft-model method).
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, Mapping

from draftsmith import drafters
from draftsmith.core.adaptive import AUTO, AUTO_MAX_K
from draftsmith.core.tree_shape import TreeShape
from draftsmith.sources import check_head_dir, check_model_source, is_head_dir

METADATA_FILE = "draftsmith.json"  # marks an exported drafter directory (export.metadata.METADATA_FILE)
PLAIN_LM = "draft_model"  # what a model directory without draftsmith.json is drafted with
LEGACY_HEAD_TYPE = "eagle3"  # draftsmith.json written before head_type existed: an EAGLE-3 head
GENERIC_KEYS = ("method", "model", "num_speculative_tokens", "tree", "speculative_token_tree")


def recorded_head_type(path: str | Path) -> str | None:
    """``head_type`` in ``path/draftsmith.json``; None when the directory has none. An unreadable file or an
    unknown type gives the EAGLE-3 loader (the first head type), which says what is wrong with it."""
    meta = Path(path) / METADATA_FILE
    if not meta.is_file():
        return None
    try:
        head_type = json.loads(meta.read_text(encoding="utf-8")).get("head_type") or LEGACY_HEAD_TYPE
    except (OSError, ValueError, AttributeError):
        return LEGACY_HEAD_TYPE
    return head_type if head_type in drafters.REGISTRY else LEGACY_HEAD_TYPE


@dataclass
class SpeculativeConfig:
    """A checked ``--speculative-config``.

    Attributes:
        method: a registered drafter (``drafters.REGISTRY``).
        model: what the drafter drafts with (an exported head directory, a draft model's name or folder), or
            None for drafters without a model (n-gram lookup).
        num_speculative_tokens: k, drafted tokens per verify step (>= 1; required), or ``"auto"``: each step
            chooses how much to draft (0 allowed) from a measured cost model and live acceptance
            (``core.adaptive``); the attribute then holds the most a step may draft (``AUTO_MAX_K``, a tree's
            ``num_steps``; the engine lowers it to the drafter's own limit).
        options: the method's further keys, completed with their defaults (its ``RULES.options``).
        adaptive: True when ``num_speculative_tokens`` was ``"auto"``.
        tree: draft trees of this shape instead of chains (``core.tree.TreeShape``, or its dict / string), for a
            method whose rules say it drafts trees; ``num_speculative_tokens`` then defaults to (and must equal)
            its ``num_steps``. vLLM's key ``speculative_token_tree`` (a static tree) is read as a tree too, and
            its ``num_speculative_tokens`` is the tree's node count, as vLLM counts a static tree's tokens.

    Raises:
        ValueError: a missing or invalid value, a key the method does not take, an unknown method, a tree for a
            method that drafts chains only.
    """

    method: str
    model: str | None = None
    num_speculative_tokens: int | None = None
    options: dict[str, Any] = field(default_factory=dict)
    tree: Any = None
    adaptive: bool = False

    def __post_init__(self):
        if self.num_speculative_tokens == AUTO:
            self.adaptive, self.num_speculative_tokens = True, None
        drafters.check_name(self.method, "speculative config: method")
        rules = drafters.config_module(self.method).RULES
        unknown = sorted(set(self.options) - set(rules.options))
        if unknown:
            owners = sorted(
                {n for n in drafters.names() for key in unknown if key in drafters.config_module(n).RULES.options}
            )
            elsewhere = f" ({', '.join(unknown)}: a key of {', '.join(owners)})" if owners else ""
            raise ValueError(
                f"speculative config: unknown key(s) {', '.join(map(repr, unknown))} for method "
                f"{self.method!r}{elsewhere}; it takes {', '.join(GENERIC_KEYS + tuple(rules.options))}"
            )
        self.tree = TreeShape.parse(self.tree)
        if self.tree is not None:
            if not rules.drafts_trees:
                tree_methods = [n for n in drafters.names() if drafters.config_module(n).RULES.drafts_trees]
                raise ValueError(
                    f"speculative config: method {self.method!r} drafts chains only; drop 'tree' or use "
                    f"{' or '.join(tree_methods)}"
                )
            want, what = (
                (self.tree.num_nodes, "node count (vLLM's speculative_token_tree)")
                if self.tree.is_static
                else (self.tree.num_steps, "num_steps, its depth")
            )
            if self.adaptive and self.tree.is_static:
                raise ValueError(
                    "speculative config: num_speculative_tokens 'auto' adapts a dynamic tree's depth; a static "
                    "tree (speculative_token_tree) has a fixed node set: give a dynamic tree or an integer k"
                )
            if self.num_speculative_tokens is None:
                self.num_speculative_tokens = want
            elif self.num_speculative_tokens != want:
                raise ValueError(
                    f"speculative config: num_speculative_tokens ({self.num_speculative_tokens}) must equal the "
                    f"tree's {what}: {want}; omit one of them"
                )
        if self.adaptive and self.num_speculative_tokens is None:
            self.num_speculative_tokens = AUTO_MAX_K
        k = self.num_speculative_tokens
        if k is None:
            raise ValueError(
                "speculative config: 'num_speculative_tokens' is required (drafted tokens per step, e.g. 5, "
                'or "auto")'
            )
        if isinstance(k, bool) or not isinstance(k, int) or k < 1:
            raise ValueError(f'speculative config: num_speculative_tokens must be an integer >= 1 or "auto", got {k!r}')
        if self.model is not None and not isinstance(self.model, str):
            raise ValueError(f"speculative config: model must be a string, got {self.model!r}")
        if rules.needs_model and self.model is None:
            raise ValueError(f"speculative config: method {self.method!r} needs 'model' ({rules.model_help})")
        if not rules.needs_model and self.model is not None:
            raise ValueError(
                f"speculative config: method {self.method!r} takes no model (got {self.model!r}); "
                f"use a method that drafts with a model ({', '.join(_model_methods())})"
            )
        options = {**rules.options, **self.options}
        self.options = rules.fill(options) if rules.fill else options

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> "SpeculativeConfig":
        """Build from a parsed JSON object (``method`` inferred from ``model`` when omitted)."""
        data = dict(data)
        method = data.pop("method", None)
        model = data.pop("model", None)
        k = data.pop("num_speculative_tokens", None)
        tree = data.pop("tree", None)
        token_tree = data.pop("speculative_token_tree", None)
        if token_tree is not None:
            if tree is not None:
                raise ValueError("speculative config: give 'tree' or 'speculative_token_tree', not both")
            tree = TreeShape.static(token_tree)
        if method is None:
            if model is None:
                raise ValueError(f"speculative config: 'method' is required (one of {', '.join(drafters.names())})")
            method = recorded_head_type(model) or PLAIN_LM
        return cls(method=method, model=model, num_speculative_tokens=k, options=data, tree=tree)

    @classmethod
    def parse(cls, value: "str | Mapping[str, Any] | SpeculativeConfig | None") -> "SpeculativeConfig | None":
        """A config from a JSON string (as ``--speculative-config``), a mapping, a config or None."""
        if value is None or isinstance(value, SpeculativeConfig):
            return value
        if isinstance(value, str):
            try:
                value = json.loads(value)
            except json.JSONDecodeError as e:
                raise ValueError(f"speculative config is not valid JSON ({e}): {value!r}") from None
        if not isinstance(value, Mapping):
            raise ValueError(f"speculative config must be a JSON object, got {value!r}")
        return cls.from_dict(value)

    def to_dict(self) -> dict[str, Any]:
        """The config as vLLM's JSON keys (what ``/v1/models`` shows and a vLLM server would take)."""
        k = AUTO if self.adaptive else self.num_speculative_tokens
        out = {"method": self.method, "model": self.model, "num_speculative_tokens": k}
        if self.tree is not None and self.tree.is_static:
            out["speculative_token_tree"] = self.tree.token_tree()
        elif self.tree is not None:
            out["tree"] = self.tree.to_dict()
        return {k: v for k, v in {**out, **self.options}.items() if v is not None}

    @property
    def depth(self) -> int:
        """Drafted tokens along one path per step: k for a chain, a tree's ``num_steps``."""
        return self.tree.num_steps if self.tree is not None else int(self.num_speculative_tokens)

    def with_k(self, k: "int | str") -> "SpeculativeConfig":
        """The same drafter at another ``num_speculative_tokens`` (an integer or ``"auto"``); a tree keeps its own
        depth (``num_steps``), and ``"auto"`` makes it adapt that depth."""
        if self.tree is not None:
            return replace(self, adaptive=k == AUTO) if k == AUTO or self.adaptive else self
        return SpeculativeConfig(self.method, self.model, k, dict(self.options))

    def with_tree(self, tree) -> "SpeculativeConfig":
        """The same drafter drafting trees of shape ``tree`` (a ``TreeShape``, dict or string; None: chains)."""
        shape = TreeShape.parse(tree)
        k = AUTO if self.adaptive else None if shape is not None else self.num_speculative_tokens
        return SpeculativeConfig(self.method, self.model, k, dict(self.options), shape)


def _model_methods() -> list[str]:
    return [n for n in drafters.names() if drafters.config_module(n).RULES.needs_model]


def check_speculative_models(spec: Mapping[str, Any], where: str = "speculative config") -> None:
    """Check the ``model`` a speculative config names (vLLM's keys, ``drafters.speculative``): an exported
    directory for a drafter whose rules want one (``SpeculativeRules.model_kind`` ``export``), a loadable model
    otherwise (also when the method is omitted and ``model`` is no export: the engine drafts with it as a plain
    causal LM then). Other problems (types, missing keys, unknown methods) are ``SpeculativeConfig``'s to report.

    Raises:
        ModelSourceError: the model is missing, not a head where a head is needed, or not loadable.
    """
    model, method = spec.get("model"), spec.get("method")
    if not isinstance(model, str):
        return
    if method is None:
        if not is_head_dir(model):
            check_model_source(model, role=f"{where}: draft model")
        return
    if method not in drafters.REGISTRY:
        return
    if drafters.config_module(method).RULES.model_kind == "export":
        plain = [n for n in drafters.names() if drafters.config_module(n).RULES.model_kind == "model"]
        check_head_dir(
            model,
            f"{where}: {method} model",
            hint=f"use method {' or '.join(plain)} for a plain model "
            "folder, or export one (`draftsmith train RECIPE` writes runs/NAME/head)",
        )
    else:
        check_model_source(model, role=f"{where}: draft model")
