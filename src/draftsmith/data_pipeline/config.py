"""The recipe's ``data`` section (torch-free: checked before any model loads)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from draftsmith.config import ConfigError


@dataclass
class DataConfig:
    """Where the head's training conversations come from and how they are turned into tokens."""

    source: str = "reference:train"  #: .jsonl/.json/.parquet file, a datasets.load_dataset name, or reference:train
    split: str = "train"  #: datasets split (Hub names and local folders)
    subset: str | None = None  #: datasets config name (Hub names)
    on_error: Literal["raise", "skip"] = "raise"  #: malformed records: fail naming the record, or skip and count
    num_conversations: int | None = 512  #: after shuffling; None = all
    regenerate: bool = True  #: replace assistant turns by the target's own answers
    max_new_tokens: int = 192  #: per regenerated answer
    temperature: float = 0.0  #: 0 = greedy regeneration
    batch_size: int = 16  #: regeneration batch (server: requests in flight)
    #: who answers: batched transformers generate in process, draftsmith's runtime in process (batch 1,
    #: the path ``draftsmith serve`` decodes with), or an OpenAI-compatible server at regenerate_url
    regenerate_engine: Literal["transformers", "draftsmith", "server"] = "transformers"
    regenerate_url: str | None = None  #: server engine: base URL, e.g. http://127.0.0.1:8000 (vLLM)
    #: tokens per rendered conversation: longer ones are cut (a cut answer still trains on its first
    #: tokens); one with no supervised token left is left out and counted (manifest ``dropped``)
    max_length: int = 768
    draft_vocab_size: int | None = 4096  #: Vd; None = the whole target vocab (no d2t/t2d)
    heldout_conversations: int = 32  #: kept apart for in-loop acceptance
    #: prepare stops when more than this share [0, 1] of the selected conversations is left out (answers
    #: cut away by max_length, empty regenerated answers, template refusals); 1.0 = never stop
    max_dropped_fraction: float = 0.1
    seed: int = 0

    def __post_init__(self):
        if (self.regenerate_engine == "server") != (self.regenerate_url is not None):
            raise ConfigError(
                f"data.regenerate_url is needed by, and only by, regenerate_engine 'server' "
                f"(engine {self.regenerate_engine!r}, url {self.regenerate_url!r})"
            )
        if not 0.0 <= self.max_dropped_fraction <= 1.0:
            raise ConfigError(
                f"data.max_dropped_fraction must be in [0, 1] (a share of the conversations), "
                f"got {self.max_dropped_fraction}"
            )
        if self.max_length < 2:
            raise ConfigError(
                f"data.max_length must be >= 2 tokens (a label needs a token before it), got {self.max_length}"
            )
        if self.heldout_conversations < 0:
            raise ConfigError(f"data.heldout_conversations must be >= 0, got {self.heldout_conversations}")
