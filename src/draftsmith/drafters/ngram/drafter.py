"""N-gram prompt lookup (Saxena 2023) as a ``Drafter``: nothing to train, export or check; ``proposer.py`` holds
the lookup, with vLLM's ``ngram`` semantics."""

from __future__ import annotations

from pathlib import Path
from typing import Sequence

from draftsmith.core.proposer import Proposer
from draftsmith.drafters.base import Drafter, LoadedDrafter, Sampling
from draftsmith.drafters.ngram.proposer import NgramProposer
from draftsmith.drafters.speculative import SpeculativeConfig


class LoadedNgram(LoadedDrafter):
    """Lookup bounds; every sequence gets its own context."""

    def __init__(self, spec: SpeculativeConfig):
        self.spec = spec

    def new_proposer(self, sampling: Sampling) -> Proposer:
        """A fresh ``NgramProposer`` (deterministic: its drafts carry q None whatever the sampling)."""
        return NgramProposer(self.spec.options["prompt_lookup_min"], self.spec.options["prompt_lookup_max"])


class NgramDrafter(Drafter):
    """Prompt lookup: propose what followed the longest earlier occurrence of the context's suffix n-gram."""

    name = "ngram"
    summary = "n-gram prompt lookup (Saxena 2023; vLLM's ngram): nothing to train"
    trainable = False
    formats = ()
    opt_outs = {
        "export": "n-gram lookup has no weights to export, reload or check against a target",
        "refusal": "n-gram lookup records no target, so there is no other target to refuse",
        "train": "n-gram lookup has nothing to train",
    }

    def load(self, spec: SpeculativeConfig, target_model, tokenizer, allow_mismatch: Sequence[str] = ()) -> LoadedNgram:
        """Nothing to load: the lookup bounds of ``spec.options``."""
        return LoadedNgram(spec)

    def example(self, target_model, tokenizer, workdir: Path) -> SpeculativeConfig:
        """Lookup of suffixes of 1..3 tokens, k = 3."""
        return SpeculativeConfig(self.name, None, 3, {"prompt_lookup_min": 1, "prompt_lookup_max": 3})


DRAFTER = NgramDrafter()
