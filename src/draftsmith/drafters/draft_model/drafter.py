"""The draft model as a ``Drafter``: a small causal LM with the target's tokenizer, distilled with forward KL
(``train.py``), drafting autoregressively with its own KV cache (``proposer.py``), exported as an HF model
directory with draftsmith.json (``export.py``: export, check, load, card). A plain transformers causal LM with
the target's tokenizer is served too (only the tokenizer and vocabulary are checked then)."""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any, Sequence

import torch
from transformers import AutoConfig, AutoModelForCausalLM

from draftsmith import reference
from draftsmith.core.proposer import Proposer
from draftsmith.core.target import position_limit, resolve_max_model_len
from draftsmith.drafters.base import Drafter, LoadedDrafter, MemoryItems, Sampling, example_target_name
from draftsmith.drafters.draft_model.config import Section
from draftsmith.drafters.draft_model.export import (
    check_draft_model,
    draft_model_card_lines,
    export_draft_model,
    reexport_draft_model,
)
from draftsmith.drafters.draft_model.proposer import (
    BatchDraftModelProposer,
    DraftModelProposer,
    check_draft_positions,
    check_same_tokenizer,
)
from draftsmith.drafters.draft_model.train import DraftModelSpec, build_draft_model
from draftsmith.drafters.speculative import SpeculativeConfig
from draftsmith.export.metadata import METADATA_FILE
from draftsmith.identity import target_identity
from draftsmith.models import load_causal_lm
from draftsmith.sizes import dtype_bytes, kv_bytes_per_token, parameter_count

logger = logging.getLogger(__name__)
MIB = 2**20


class LoadedDraftModel(LoadedDrafter):
    """A draft LM with the target's tokenizer and vocabulary, on the target's device and in its dtype."""

    def __init__(self, spec: SpeculativeConfig, model, target_vocab_size: int):
        self.spec, self.model, self.target_vocab_size = spec, model, target_vocab_size
        self.modules = (self.model,)
        DraftModelProposer(model, target_vocab_size)  # refuses a vocabulary size mismatch now

    def new_proposer(self, sampling: Sampling) -> Proposer:
        """A fresh ``DraftModelProposer`` (its own KV cache) drafting with the request's settings."""
        return DraftModelProposer(self.model, self.target_vocab_size, sampling=sampling)

    def new_batch_proposer(self) -> BatchDraftModelProposer:
        """One draft forward per draft position for the whole batch, one KV cache for all rows
        (``BatchDraftModelProposer``); each row drafts what ``new_proposer`` would with its ``Sampling``."""
        return BatchDraftModelProposer(self.model, self.target_vocab_size)

    def check_max_model_len(self, max_model_len: int) -> None:
        """``proposer.check_draft_positions``: a learned position table shorter than max_model_len is refused."""
        check_draft_positions(self.model, self.spec.model, max_model_len)


class DraftModelDrafter(Drafter):
    """A smaller causal LM of the target's family (the target's tokenizer), optionally distilled on its answers."""

    name = "draft_model"
    summary = "small causal LM with the target's tokenizer, distilled with forward KL against the target"
    default_model = "reference-draft"  # the embedded draft of the embedded target

    def load(
        self, spec: SpeculativeConfig, target_model, tokenizer, allow_mismatch: Sequence[str] = ()
    ) -> LoadedDraftModel:
        """Load the draft in the target's dtype on its device; a draftsmith export must record this target
        (``export.check_draft_model``), any draft must share the target's tokenizer and vocabulary size."""
        if (Path(spec.model) / METADATA_FILE).is_file():  # exported by draftsmith: it records its target
            check_draft_model(spec.model, target_model, tokenizer, allow_mismatch=allow_mismatch)
        dtype = str(next(target_model.parameters()).dtype).removeprefix("torch.")
        draft, draft_tokenizer = load_causal_lm(spec.model, dtype=dtype, role="draft model")
        check_same_tokenizer(tokenizer, draft_tokenizer)
        device = next(target_model.parameters()).device
        return LoadedDraftModel(spec, draft.to(device), int(target_model.get_output_embeddings().weight.shape[0]))

    def check_before_loading(self, spec: SpeculativeConfig, target_config, max_model_len: int | None) -> None:
        """``check_draft_positions`` from the configs alone (the draft built on the meta device), so that a draft
        the engine would refuse is refused before the target's weights load."""
        draft_config = AutoConfig.from_pretrained(reference.resolve(spec.model))
        with torch.device("meta"):
            draft = AutoModelForCausalLM.from_config(draft_config)
        length = resolve_max_model_len(position_limit(target_config), max_model_len)
        check_draft_positions(draft, spec.model, length, warn=False)

    def memory(self, spec: SpeculativeConfig, target_config, dtype: str) -> MemoryItems:
        """The draft's weights and its KV cache (all its layers) per token, in the serving dtype."""
        config = AutoConfig.from_pretrained(reference.resolve(spec.model))
        weights = parameter_count(config) * dtype_bytes(dtype)
        per_token = kv_bytes_per_token(config, dtype)
        return MemoryItems(
            fixed={"draft model weights": weights},
            per_token={"draft model KV cache": per_token},
            advice=[
                f"use a smaller draft model (now {weights / MIB:.1f} MiB of weights + "
                f"{per_token / 1024:.1f} KiB of KV cache per token), or a drafter that reads the "
                "target's own hidden states (one small head, no model of its own)"
            ],
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
        """``export.check_draft_model``; a tensor-parallel layout is not checked (a draft shards like any LM)."""
        if tensor_parallel_size is not None:
            raise ValueError("tensor_parallel_size applies to draft heads; a draft model shards like any LM")
        return check_draft_model(head_dir, target_config, tokenizer, name_or_path, allow_mismatch)

    def training_spec(self, section, vocab_map=None, tokenizer=None) -> DraftModelSpec:
        """``train.DraftModelSpec`` (the target's tokenizer is checked against ``init_from``'s)."""
        return DraftModelSpec(section, tokenizer)

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
        """``export.export_draft_model``: an HF model directory with the target's tokenizer and draftsmith.json."""
        if tokenizer is None:
            raise ValueError("a draft model is exported with the target's tokenizer: pass tokenizer")
        return export_draft_model(module.eval(), tokenizer, out_dir, identity, training=training)

    def reexport(self, head_dir, out_dir, formats: Sequence[str] = ("all",)) -> Path:
        """``export.reexport_draft_model`` (its one format)."""
        return reexport_draft_model(head_dir, out_dir)

    def card_lines(self, head_dir: Path, meta, k: int | None) -> list[str]:
        """Front matter, serve commands (draftsmith, vLLM) and the draft's geometry."""
        return draft_model_card_lines(head_dir, meta, k)

    def example_section(self) -> Section:
        """A one-layer draft built from the target's config, k = 2."""
        return Section(init_from=None, num_hidden_layers=1, num_speculative_tokens=2)

    def example(self, target_model, tokenizer, workdir: Path) -> SpeculativeConfig:
        """A one-layer draft built from the target's config (embeddings warm-started), exported to
        ``workdir/draft_model``."""
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(0)
            draft = build_draft_model(target_model, Section(init_from=None, num_hidden_layers=1))
        out = export_draft_model(
            draft.eval(),
            tokenizer,
            Path(workdir) / self.name,
            target_identity(target_model, tokenizer, example_target_name(target_model)),
        )
        return SpeculativeConfig(self.name, str(out), 3)


DRAFTER = DraftModelDrafter()
