"""The recipe's ``eval`` section (torch-free: checked before any model loads)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

from draftsmith.reference import TASK_NAMES


@dataclass
class EvalConfig:
    """What ``draftsmith eval`` measures: the recipe's own drafter (its ``drafter`` section's k) and the rows
    named here, each against plain decoding on the same prompts."""

    tasks: list[str] = field(default_factory=lambda: list(TASK_NAMES))
    #: further rows: label -> speculative config (``{method, model, num_speculative_tokens, ...}`` as
    #: ``--speculative-config``; k defaults to the recipe drafter's, so rows compare at the same k), e.g.
    #: ``ngram: {method: ngram, prompt_lookup_min: 2}``, ``distilled: {method: draft_model, model: DIR}``
    drafters: dict[str, dict] = field(default_factory=dict)
    prompts_per_task: int | None = None  #: None = the whole task
    max_new_tokens: int = 128
    threads: int | None = 2  #: torch CPU threads while timing
    #: sequences decoded together (the batched runtime, ``core.batch``); 1 = one prompt at a time, methods
    #: interleaved per prompt. Counters (τ, acceptance) are the same either way; times are per batch.
    batch_size: int = 1
    #: the float32 CPU linears of target and drafters through oneDNN over packed weights, as ``draftsmith serve``
    #: runs them (``core.onednn``, ``serve.engine.Engine``): auto (where they fit in memory), on, off (MKL)
    onednn: Literal["auto", "on", "off"] = "auto"

    def __post_init__(self):
        if isinstance(self.batch_size, bool) or not isinstance(self.batch_size, int) or self.batch_size < 1:
            raise ValueError(f"eval.batch_size must be an integer >= 1, got {self.batch_size!r}")
        if self.onednn not in ("auto", "on", "off"):
            raise ValueError(f"eval.onednn must be auto, on or off, got {self.onednn!r}")
