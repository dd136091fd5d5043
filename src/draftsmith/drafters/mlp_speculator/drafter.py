"""The MLP speculator (Wertheimer et al. 2024, arXiv:2404.19124) as a ``Drafter``: the stages (``head.py``),
their teacher-forced training spec (``train.py``), the chain proposer (``proposer.py``) and the draftsmith + vLLM
directory (``export.py``: export, check, load, card)."""

from __future__ import annotations

from pathlib import Path
from typing import Any, Sequence

import torch

from draftsmith.core.proposer import Proposer
from draftsmith.drafters.base import Drafter, LoadedDrafter, MemoryItems, Sampling, example_target_name, in_fast_dtype
from draftsmith.drafters.mlp_speculator.config import Section
from draftsmith.drafters.mlp_speculator.export import (
    MLP_FORMATS,
    check_mlp_speculator,
    export_mlp_speculator,
    load_mlp_speculator,
    mlp_speculator_card_lines,
    reexport_mlp_speculator,
)
from draftsmith.drafters.mlp_speculator.head import MLPSpeculator
from draftsmith.drafters.mlp_speculator.proposer import BatchMLPSpeculatorProposer, MLPSpeculatorProposer
from draftsmith.drafters.mlp_speculator.train import MLPSpeculatorSpec, build_mlp_speculator
from draftsmith.drafters.speculative import SpeculativeConfig
from draftsmith.identity import target_identity
from draftsmith.sizes import safetensors_bytes


class LoadedMLPSpeculator(LoadedDrafter):
    """A checked MLP speculator on the target's device (it reads the target's final hidden states)."""

    def __init__(self, spec: SpeculativeConfig, head: MLPSpeculator):
        self.spec, self.head = spec, head
        self.modules = (self.head,)
        self.trained_depth = self.max_k = head.config.n_predict

    def new_proposer(self, sampling: Sampling) -> Proposer:
        """A fresh ``MLPSpeculatorProposer`` drafting with the request's settings."""
        return MLPSpeculatorProposer(self.head, sampling=sampling)

    def new_batch_proposer(self) -> BatchMLPSpeculatorProposer:
        """Stages run once per step for the whole batch (``BatchMLPSpeculatorProposer``)."""
        return BatchMLPSpeculatorProposer(self.head)


class MLPSpeculatorDrafter(Drafter):
    """MLP speculator: n_predict small stages on the target's final hidden state, one token each."""

    name = "mlp_speculator"
    summary = "MLP speculator (Wertheimer et al. 2024): stages on the target's final hidden state"
    formats = MLP_FORMATS

    def load(
        self, spec: SpeculativeConfig, target_model, tokenizer, allow_mismatch: Sequence[str] = ()
    ) -> LoadedMLPSpeculator:
        """``export.load_mlp_speculator`` (checked against the target) on its device in a native dtype.

        Raises ValueError when k exceeds n_predict (a stage drafts one token; vLLM refuses it too)."""
        head, _ = load_mlp_speculator(
            spec.model, target_model=target_model, tokenizer=tokenizer, allow_mismatch=allow_mismatch
        )
        if spec.num_speculative_tokens > head.config.n_predict and not spec.adaptive:  # auto drafts <= n_predict
            raise ValueError(
                f"speculative config: num_speculative_tokens {spec.num_speculative_tokens} > the MLP "
                f"speculator's n_predict {head.config.n_predict} (it drafts one token per stage); use "
                f"num_speculative_tokens <= {head.config.n_predict}"
            )
        device = next(target_model.parameters()).device
        return LoadedMLPSpeculator(spec, in_fast_dtype(head.to(device), device, f"the MLP speculator {spec.model!r}"))

    def memory(self, spec: SpeculativeConfig, target_config, dtype: str) -> MemoryItems:
        """Weights only, as stored: its stages keep no cache."""
        files = sorted(Path(spec.model).glob("*.safetensors"))
        return MemoryItems(fixed={"MLP speculator weights": sum(safetensors_bytes(f)[0] for f in files)})

    def check(
        self,
        head_dir,
        target_config: Any = None,
        tokenizer: Any = None,
        name_or_path: str | None = None,
        allow_mismatch: Sequence[str] = (),
        tensor_parallel_size: int | None = None,
    ):
        """``export.check_mlp_speculator``; a tensor-parallel layout is refused (vLLM serves it at tp 1)."""
        if tensor_parallel_size is not None:
            raise ValueError("tensor_parallel_size: an MLP speculator is served unsharded (vLLM runs it at tp 1)")
        return check_mlp_speculator(head_dir, target_config, tokenizer, name_or_path, allow_mismatch)

    def training_spec(self, section, vocab_map=None, tokenizer=None) -> MLPSpeculatorSpec:
        """``train.MLPSpeculatorSpec`` over the recipe section (no draft vocabulary: the stages predict over V)."""
        return MLPSpeculatorSpec(section)

    def export(
        self,
        module,
        out_dir,
        identity: dict,
        target_config,
        *,
        training: dict | None = None,
        formats: Sequence[str] = ("draftsmith",),
        k: int | None = None,
        tokenizer=None,
    ) -> Path:
        """``export.export_mlp_speculator`` (draftsmith and vLLM in one directory)."""
        return export_mlp_speculator(module, out_dir, identity, training=training, formats=tuple(formats))

    def reexport(self, head_dir, out_dir, formats: Sequence[str] = ("all",)) -> Path:
        """``export.reexport_mlp_speculator``."""
        return reexport_mlp_speculator(head_dir, out_dir, formats)

    def card_lines(self, head_dir: Path, meta, k: int | None) -> list[str]:
        """Front matter, serve commands (draftsmith, vLLM) and the stages' geometry."""
        return mlp_speculator_card_lines(head_dir, meta, k)

    def example_section(self) -> Section:
        """Two stages, k = 2."""
        return Section(n_predict=2, num_speculative_tokens=2)

    def example(self, target_model, tokenizer, workdir: Path) -> SpeculativeConfig:
        """Five untrained stages (embeddings warm-started from the target's) exported to ``workdir/mlp_speculator``;
        served at k = 3 (any k <= 5 with ``SpeculativeConfig.with_k``)."""
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(0)
            head = build_mlp_speculator(target_model, Section(n_predict=5, num_speculative_tokens=3))
        out = export_mlp_speculator(
            head, Path(workdir) / self.name, target_identity(target_model, tokenizer, example_target_name(target_model))
        )
        return SpeculativeConfig(self.name, str(out), 3)


DRAFTER = MLPSpeculatorDrafter()
