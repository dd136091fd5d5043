"""A draft tree's budget, SGLang's three numbers (torch-free: speculative configs are checked before torch loads).

TreeShape.parse("topk=4,num_steps=5,num_draft_tokens=32")     # or {"topk": 4, ...}
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any, Mapping


@dataclass(frozen=True)
class TreeShape:
    """An EAGLE-2 dynamic tree's budget, as SGLang names it (``--speculative-eagle-topk``,
    ``--speculative-num-steps``, ``--speculative-num-draft-tokens``; ``sglang/srt/server_args.py``).

    Attributes:
        topk: children expanded per node and nodes kept per depth (the beam), >= 1.
        num_steps: the tree's depth (drafter steps), >= 1.
        num_draft_tokens: tokens of the verify forward: the root (the last emitted token) plus
            ``num_draft_tokens - 1`` draft nodes, as SGLang counts them (``eagle_utils.organize_draft_results``
            keeps ``num_draft_tokens - 1``); 2 .. 1 + ``max_candidates``.

    Raises:
        ValueError: a value out of range, naming it and the range.
    """

    topk: int
    num_steps: int
    num_draft_tokens: int

    def __post_init__(self):
        for name in ("topk", "num_steps", "num_draft_tokens"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"tree: {name} must be an integer >= 1, got {value!r}")
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

    @classmethod
    def parse(cls, value: "str | Mapping[str, Any] | TreeShape | None") -> "TreeShape | None":
        """A shape from ``"topk=4,num_steps=5,num_draft_tokens=32"``, a mapping of those keys, a shape or None.

        Raises:
            ValueError: unknown or missing keys, or values ``TreeShape`` refuses."""
        if value is None or isinstance(value, TreeShape):
            return value
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

    def to_dict(self) -> dict[str, int]:
        return {"topk": self.topk, "num_steps": self.num_steps, "num_draft_tokens": self.num_draft_tokens}

    def __str__(self) -> str:
        return f"topk={self.topk},num_steps={self.num_steps},num_draft_tokens={self.num_draft_tokens}"

    def sglang_args(self) -> list[str]:
        """The SGLang server flags serving an EAGLE-3 head with this tree."""
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
