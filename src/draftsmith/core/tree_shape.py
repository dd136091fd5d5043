"""A draft tree's budget, SGLang's three numbers, or a static tree in vLLM's ``speculative_token_tree`` form
(torch-free: speculative configs are checked before torch loads).

    TreeShape.parse("topk=4,num_steps=5,num_draft_tokens=32")     # or {"topk": 4, ...}: EAGLE-2 / DDTree
    TreeShape.parse("[(0,), (1,), (0, 0)]")                       # a static tree: rank paths
"""

from __future__ import annotations

import ast
import re
from dataclasses import dataclass
from typing import Any, Mapping, Sequence


@dataclass(frozen=True)
class TreeShape:
    """An EAGLE-2 dynamic tree's budget, as SGLang names it (``--speculative-eagle-topk``,
    ``--speculative-num-steps``, ``--speculative-num-draft-tokens``; ``sglang/srt/server_args.py``).

    A static tree (``paths``) names its nodes as vLLM's ``speculative_token_tree`` does (``vllm/config/
    speculative.py``): each node is the path of ranks from the root, ``(0,)`` the drafter's top-1 token after the
    context, ``(0, 1)`` the second likeliest after that one; every prefix of a node is a node. Its three numbers
    are derived: topk the largest rank + 1, num_steps the depth, num_draft_tokens the nodes + 1.

    Attributes:
        topk: children expanded per node and nodes kept per depth (the beam), >= 1.
        num_steps: the tree's depth (drafter steps), >= 1.
        num_draft_tokens: tokens of the verify forward: the root (the last emitted token) plus
            ``num_draft_tokens - 1`` draft nodes, as SGLang counts them (``eagle_utils.organize_draft_results``
            keeps ``num_draft_tokens - 1``); 2 .. 1 + ``max_candidates`` (a dynamic tree).
        paths: a static tree's nodes, breadth-first (None: a dynamic tree).

    Raises:
        ValueError: a value out of range, naming it and the range; static numbers that are not the paths'.
    """

    topk: int
    num_steps: int
    num_draft_tokens: int
    paths: tuple[tuple[int, ...], ...] | None = None

    def __post_init__(self):
        for name in ("topk", "num_steps", "num_draft_tokens"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"tree: {name} must be an integer >= 1, got {value!r}")
        if self.paths is not None:
            derived = (max(max(p) for p in self.paths) + 1, max(len(p) for p in self.paths), len(self.paths) + 1)
            if (self.topk, self.num_steps, self.num_draft_tokens) != derived:
                raise ValueError(f"tree: a static tree of these paths has topk, num_steps, num_draft_tokens {derived}")
            return
        if not 2 <= self.num_draft_tokens <= 1 + self.max_candidates:
            raise ValueError(
                f"tree: num_draft_tokens must be in 2..{1 + self.max_candidates} for topk={self.topk}, "
                f"num_steps={self.num_steps} (the root plus at most topk + (num_steps - 1) * topk^2 "
                f"candidates), got {self.num_draft_tokens}"
            )

    @property
    def max_candidates(self) -> int:
        """Nodes an EAGLE-2 expansion generates: topk at depth 1, topk^2 at each further depth."""
        return self.topk + (self.num_steps - 1) * self.topk**2

    @property
    def num_nodes(self) -> int:
        """Draft nodes per tree: ``num_draft_tokens - 1``."""
        return self.num_draft_tokens - 1

    @property
    def is_static(self) -> bool:
        """True for a static tree (``paths``)."""
        return self.paths is not None

    @classmethod
    def static(cls, tree: "str | Sequence[Sequence[int]]") -> "TreeShape":
        """A static tree from vLLM's ``speculative_token_tree`` (its string, or a list of rank tuples).

        Raises:
            ValueError: not a list of non-empty tuples of ranks >= 0, a duplicate, or a node whose prefix is
                missing."""
        text = tree
        if isinstance(tree, str):
            try:
                tree = ast.literal_eval(tree)
            except (ValueError, SyntaxError):
                raise ValueError(f"speculative_token_tree {text!r} is not a Python list of tuples") from None
        if not isinstance(tree, (list, tuple)) or not tree:
            raise ValueError(
                f"speculative_token_tree must be a non-empty list of tuples, e.g. [(0,), (0, 0)]; got {text!r}"
            )
        paths = []
        for node in tree:
            if (
                not isinstance(node, (list, tuple))
                or not node
                or any(isinstance(r, bool) or not isinstance(r, int) or r < 0 for r in node)
            ):
                raise ValueError(f"speculative_token_tree: {node!r} is not a non-empty tuple of ranks >= 0")
            paths.append(tuple(node))
        if len(set(paths)) != len(paths):
            raise ValueError("speculative_token_tree: a node is listed twice")
        missing = sorted({p[:-1] for p in paths if len(p) > 1} - set(paths))
        if missing:
            raise ValueError(f"speculative_token_tree: node {missing[0]} is missing (every prefix of a node is a node)")
        paths.sort(key=lambda p: (len(p), p))
        return cls(max(max(p) for p in paths) + 1, max(len(p) for p in paths), len(paths) + 1, tuple(paths))

    @classmethod
    def parse(cls, value: "str | Mapping[str, Any] | TreeShape | None") -> "TreeShape | None":
        """A shape from ``"topk=4,num_steps=5,num_draft_tokens=32"``, a mapping of those keys, a shape or None.

        Raises:
            ValueError: unknown or missing keys, or values ``TreeShape`` refuses."""
        if value is None or isinstance(value, TreeShape):
            return value
        if isinstance(value, str) and value.strip().startswith("speculative_token_tree="):
            value = value.strip().removeprefix("speculative_token_tree=")
        if isinstance(value, str) and value.strip().startswith("["):
            return cls.static(value)
        if isinstance(value, Mapping) and set(value) == {"speculative_token_tree"}:
            return cls.static(value["speculative_token_tree"])
        if isinstance(value, str):
            pairs = [p for p in re.split(r"[,\s]+", value.strip()) if p]
            if not pairs or any("=" not in p for p in pairs):
                raise ValueError(f"tree: expected 'topk=4,num_steps=5,num_draft_tokens=32', got {value!r}")
            data: dict[str, Any] = {}
            for pair in pairs:
                key, _, text = pair.partition("=")
                try:
                    data[key.strip()] = int(text)
                except ValueError:
                    raise ValueError(f"tree: {key.strip()} must be an integer, got {text!r}") from None
            value = data
        if not isinstance(value, Mapping):
            raise ValueError(f"tree: expected a mapping or 'topk=..,num_steps=..,num_draft_tokens=..', got {value!r}")
        keys = ("topk", "num_steps", "num_draft_tokens")
        unknown, missing = sorted(set(value) - set(keys)), [k for k in keys if k not in value]
        if unknown or missing:
            raise ValueError(
                f"tree: takes exactly {', '.join(keys)}"
                + (f"; unknown {', '.join(unknown)}" if unknown else "")
                + (f"; missing {', '.join(missing)}" if missing else "")
            )
        return cls(**{k: value[k] for k in keys})

    def to_dict(self) -> dict[str, Any]:
        """The shape as a speculative config's ``tree`` value (``parse`` reads it back)."""
        if self.paths is not None:
            return {"speculative_token_tree": self.token_tree()}
        return {"topk": self.topk, "num_steps": self.num_steps, "num_draft_tokens": self.num_draft_tokens}

    def token_tree(self) -> str:
        """A static tree as vLLM's ``speculative_token_tree`` string (breadth-first)."""
        return str([tuple(p) for p in self.paths or ()])

    def __str__(self) -> str:
        if self.paths is not None:
            return f"speculative_token_tree={self.token_tree()}"
        return f"topk={self.topk},num_steps={self.num_steps},num_draft_tokens={self.num_draft_tokens}"

    def sglang_args(self) -> list[str]:
        """The SGLang server flags serving an EAGLE-3 head with this tree.

        Raises:
            ValueError: a static tree (SGLang drafts dynamic EAGLE trees only)."""
        if self.paths is not None:
            raise ValueError("SGLang drafts dynamic trees only (topk / num_steps / num_draft_tokens), not static ones")
        return [
            "--speculative-algorithm",
            "EAGLE3",
            "--speculative-num-steps",
            str(self.num_steps),
            "--speculative-eagle-topk",
            str(self.topk),
            "--speculative-num-draft-tokens",
            str(self.num_draft_tokens),
        ]
