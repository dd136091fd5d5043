"""DFlash (Chen et al. 2026) as a ``Drafter``: the block drafter (``head.py``), its block objective (``train.py``),
its one-forward-per-step proposer (``proposer.py``) and the draftsmith + vLLM directory (``export.py``)."""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any, Sequence

import torch

from draftsmith.core.proposer import Proposer
from draftsmith.drafters.base import Drafter, LoadedDrafter, MemoryItems, Sampling, example_target_name, in_fast_dtype
from draftsmith.drafters.dflash.config import Section
from draftsmith.drafters.dflash.export import (
    DFLASH_FORMATS,
    check_dflash,
    dflash_card_lines,
    export_dflash,
    load_dflash,
    reexport_dflash,
)
from draftsmith.drafters.dflash.head import DFlashConfig, DFlashHead
from draftsmith.drafters.dflash.proposer import BatchDFlashProposer, DFlashProposer
from draftsmith.drafters.dflash.train import DFlashSpec, build_dflash
from draftsmith.drafters.speculative import SpeculativeConfig
from draftsmith.export.metadata import read_metadata
from draftsmith.identity import target_identity
from draftsmith.sizes import dtype_bytes, safetensors_bytes

logger = logging.getLogger(__name__)


class LoadedDFlash(LoadedDrafter):
    """A checked DFlash drafter bound to the target's embedding and lm_head, on the target's device."""

    def __init__(self, spec: SpeculativeConfig, head: DFlashHead):
        self.spec, self.head = spec, head
        self.modules = (self.head,)
        self.aux_layer_ids = head.config.aux_layer_ids
        self.trained_depth = self.max_k = head.config.max_k

    def new_proposer(self, sampling: Sampling) -> Proposer:
        """A fresh ``DFlashProposer`` drafting with the request's settings."""
        return DFlashProposer(self.head, sampling=sampling)

    def new_batch_proposer(self) -> BatchDFlashProposer:
        """One drafter forward per step for the whole batch (``BatchDFlashProposer``)."""
        return BatchDFlashProposer(self.head)

    def check_max_model_len(self, max_model_len: int) -> None:
        """Past max_position_embeddings the drafter runs at positions it was not trained on: a warning."""
        n = int(self.head.config.max_position_embeddings)
        if n < max_model_len:
            logger.warning(
                "the DFlash drafter %r declares max_position_embeddings=%d, fewer than max_model_len=%d: past %d "
                "tokens it drafts at untrained positions (output unchanged, acceptance may drop)",
                self.spec.model,
                n,
                max_model_len,
                n,
            )


class DFlashDrafter(Drafter):
    """DFlash: a block drafter over the target's fused hidden states; one forward drafts the whole block."""

    name = "dflash"
    summary = "DFlash block drafter (Chen et al. 2026): every draft of a step in one forward"
    formats = DFLASH_FORMATS

    def load(
        self, spec: SpeculativeConfig, target_model, tokenizer, allow_mismatch: Sequence[str] = ()
    ) -> LoadedDFlash:
        """``export.load_dflash`` (checked against the target), bound to the target's embedding and lm_head, on its
        device in a native dtype.

        Raises ValueError when k exceeds block_size - 1 (the block has no position for it)."""
        head, _ = load_dflash(spec.model, target_model=target_model, tokenizer=tokenizer, allow_mismatch=allow_mismatch)
        if spec.depth > head.config.max_k and not spec.adaptive:  # auto drafts at most max_k
            raise ValueError(
                f"speculative config: {'the tree depth' if spec.tree else 'num_speculative_tokens'} {spec.depth} > "
                f"the DFlash drafter's block_size - 1 = {head.config.max_k}; draft at most {head.config.max_k} deep"
            )
        device = next(target_model.parameters()).device
        head = in_fast_dtype(head.to(device), device, f"the DFlash drafter {spec.model!r}")
        head.bind_target(target_model.get_input_embeddings(), target_model.get_output_embeddings())
        return LoadedDFlash(spec, head)

    def memory(self, spec: SpeculativeConfig, target_config, dtype: str) -> MemoryItems:
        """Weights as stored and the context KV cache (every draft layer) per token; the target keeps its hidden
        states in the prefill."""
        head_dir = Path(spec.model)
        c = DFlashConfig.from_dict(read_metadata(head_dir).head_config)
        files = sorted(head_dir.glob("*.safetensors"))
        sizes = [safetensors_bytes(f) for f in files]
        element = max((e for _, e in sizes), default=dtype_bytes("float32"))
        per_token = c.num_hidden_layers * 2 * c.num_key_value_heads * c.head_dim * element
        return MemoryItems(
            fixed={"DFlash drafter weights": sum(s for s, _ in sizes)},
            per_token={"DFlash context KV cache": per_token},
            reads_hidden_states=True,
        )

    def check(
        self,
        head_dir,
        target_config: Any = None,
        tokenizer: Any = None,
        name_or_path: str | None = None,
        allow_mismatch: Sequence[str] = (),
        tensor_parallel_size: int | None = None,
    ):
        """``export.check_dflash``; a tensor-parallel check is not offered (vLLM replicates small drafters)."""
        if tensor_parallel_size is not None:
            raise ValueError("tensor_parallel_size: draftsmith checks DFlash drafters unsharded")
        return check_dflash(head_dir, target_config, tokenizer, name_or_path, allow_mismatch)

    def training_spec(self, section, vocab_map=None, tokenizer=None) -> DFlashSpec:
        """``train.DFlashSpec`` (no draft vocabulary: the target's lm_head predicts over V)."""
        return DFlashSpec(section, tokenizer)

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
        """``export.export_dflash`` (draftsmith and vLLM in one directory)."""
        return export_dflash(module, out_dir, identity, training=training, formats=tuple(formats))

    def reexport(self, head_dir, out_dir, formats: Sequence[str] = ("all",)) -> Path:
        """``export.reexport_dflash``."""
        return reexport_dflash(head_dir, out_dir, formats)

    def card_lines(self, head_dir: Path, meta, k: int | None) -> list[str]:
        """Front matter, serve commands (draftsmith, vLLM) and the geometry."""
        return dflash_card_lines(head_dir, meta, k)

    def example_section(self) -> Section:
        """One draft layer, block 4 (k = 3), 8 anchors."""
        return Section(num_hidden_layers=1, block_size=4, num_speculative_tokens=3, num_anchors=8)

    def example(self, target_model, tokenizer, workdir: Path) -> SpeculativeConfig:
        """An untrained drafter (two layers, block 8) exported to ``workdir/dflash``, served at k = 3."""
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(0)
            head = build_dflash(target_model, Section(block_size=8, num_speculative_tokens=3), tokenizer)
        out = export_dflash(
            head, Path(workdir) / self.name, target_identity(target_model, tokenizer, example_target_name(target_model))
        )
        return SpeculativeConfig(self.name, str(out), 3)


DRAFTER = DFlashDrafter()
