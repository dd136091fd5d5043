"""EAGLE-3 (Li et al. 2025) as a ``Drafter``: the head (``head.py``), its training-time-test spec (``train.py``,
``ttt.py``), its proposer (``proposer.py``), its export in draftsmith / research (vLLM, SGLang) / speculators
layouts (``export.py``, ``formats.py``), its check and loader (``check.py``)."""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any, Sequence

import torch

from draftsmith.core.aux_layers import default_aux_layer_ids
from draftsmith.core.proposer import Proposer
from draftsmith.data_pipeline.vocab import build_vocab_map
from draftsmith.drafters.base import Drafter, LoadedDrafter, MemoryItems, Sampling, example_target_name, in_fast_dtype
from draftsmith.drafters.eagle3.check import check_head, load_eagle3
from draftsmith.drafters.eagle3.config import Section
from draftsmith.drafters.eagle3.export import eagle3_card_lines, export_eagle3, reexport_head
from draftsmith.drafters.eagle3.formats import FORMATS
from draftsmith.drafters.eagle3.head import Eagle3Config, Eagle3Head
from draftsmith.drafters.eagle3.proposer import BatchEagle3Proposer, Eagle3Proposer, warn_beyond_trained_depth
from draftsmith.drafters.eagle3.train import Eagle3Spec, build_head
from draftsmith.drafters.speculative import SpeculativeConfig
from draftsmith.export.metadata import METADATA_FILE
from draftsmith.identity import target_identity
from draftsmith.sizes import dtype_bytes, safetensors_bytes

logger = logging.getLogger(__name__)


class LoadedEagle3(LoadedDrafter):
    """A checked EAGLE-3 head bound to the target's embedding, on the target's device."""

    def __init__(self, spec: SpeculativeConfig, head: Eagle3Head, ttt_steps: int):
        self.spec, self.head = spec, head
        self.modules = (self.head,)
        self.aux_layer_ids = tuple(head.config.aux_layer_ids)
        self.trained_depth = int(ttt_steps)

    def new_proposer(self, sampling: Sampling) -> Proposer:
        """A fresh ``Eagle3Proposer`` drafting with the request's settings."""
        return Eagle3Proposer(self.head, sampling=sampling)

    def new_batch_proposer(self) -> BatchEagle3Proposer:
        """One head step per chain step for the whole batch (``BatchEagle3Proposer``)."""
        return BatchEagle3Proposer(self.head)

    def check_max_model_len(self, max_model_len: int) -> None:
        """A head (RoPE, computed per position) declaring fewer positions than max_model_len runs past them
        untrained: a warning, not a refusal (vLLM serves it to the target's length)."""
        n = int(self.head.config.max_position_embeddings)
        if n < max_model_len:
            logger.warning(
                "the EAGLE-3 head %r declares max_position_embeddings=%d, fewer than max_model_len=%d: "
                "past %d tokens it drafts at positions it was not trained on (output unchanged, acceptance "
                "may drop); --max-model-len %d stays within it",
                self.spec.model,
                n,
                max_model_len,
                n,
                n,
            )


def eagle3_head_bytes(head_config: dict, dtype: str | torch.dtype) -> int:
    """Weight bytes of an EAGLE-3 head of this geometry (``Eagle3Config`` fields), built on the meta device."""
    with torch.device("meta"):
        head = Eagle3Head(Eagle3Config.from_dict(head_config))  # nothing allocated
    return sum(p.numel() for p in head.parameters()) * dtype_bytes(dtype)


class Eagle3Drafter(Drafter):
    """EAGLE-3: one decoder layer over the target's low/mid/high hidden states, trained with training-time test."""

    name = "eagle3"
    summary = "EAGLE-3 head on the target's low/mid/high hidden states (training-time test)"
    formats = FORMATS

    def load(
        self, spec: SpeculativeConfig, target_model, tokenizer, allow_mismatch: Sequence[str] = ()
    ) -> LoadedEagle3:
        """``check.load_eagle3`` (every check of ``draftsmith check``), on the target's device in a native dtype;
        warns once when k exceeds the trained depth (``ttt_steps``)."""
        head, meta = load_eagle3(
            spec.model, target_model=target_model, tokenizer=tokenizer, allow_mismatch=allow_mismatch
        )
        device = next(target_model.parameters()).device
        head = in_fast_dtype(head.to(device), device, f"the EAGLE-3 head {spec.model!r}")
        head.bind_embedding(target_model.get_input_embeddings())
        ttt_steps = meta.ttt_steps if meta.ttt_steps is not None else head.config.ttt_steps
        if not spec.adaptive:  # auto learns how deep the head's drafts are accepted
            warn_beyond_trained_depth(spec.depth, ttt_steps, f"the EAGLE-3 head {spec.model!r}")
        return LoadedEagle3(spec, head, ttt_steps)

    def memory(self, spec: SpeculativeConfig, target_config, dtype: str) -> MemoryItems:
        """Weights as stored (the head's safetensors files; an export root or one of its format folders) and its
        KV cache (one decoder layer) per token; the target keeps its hidden states in the prefill."""
        head_dir = Path(spec.model)
        metadata = next(
            (d / METADATA_FILE for d in (head_dir, head_dir.parent) if (d / METADATA_FILE).is_file()),
            head_dir / METADATA_FILE,
        )
        head_config = json.loads(metadata.read_text())["head_config"]
        files = sorted(head_dir.glob("*.safetensors"))
        if files:
            sizes = [safetensors_bytes(f) for f in files]
            head_bytes, head_b = sum(s for s, _ in sizes), max(e for _, e in sizes)
        else:
            head_bytes, head_b = eagle3_head_bytes(head_config, "float32"), 4
        per_token = 2 * head_config["num_key_value_heads"] * head_config["head_dim"] * head_b
        return MemoryItems(
            fixed={"EAGLE-3 head weights": head_bytes},
            per_token={"EAGLE-3 head KV cache": per_token},
            reads_hidden_states=True,
        )

    def check(
        self,
        head_dir: str | Path,
        target_config: Any = None,
        tokenizer: Any = None,
        name_or_path: str | None = None,
        allow_mismatch: Sequence[str] = (),
        tensor_parallel_size: int | None = None,
    ):
        """``check.check_head``: every refusal in that module's docstring."""
        return check_head(head_dir, target_config, tokenizer, name_or_path, allow_mismatch, tensor_parallel_size)

    def training_spec(self, section, vocab_map=None, tokenizer=None) -> Eagle3Spec:
        """``train.Eagle3Spec`` over the recipe section and the prepared draft vocabulary."""
        if vocab_map is None:
            raise ValueError("an EAGLE-3 head trains on a draft vocabulary: prepare the data first (vocab_map)")
        return Eagle3Spec(section, vocab_map)

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
        """``export.export_eagle3``; ``k`` goes into the speculators config (default: the head's ttt_steps)."""
        return export_eagle3(
            module, out_dir, identity, target_config, training=training, formats=tuple(formats), speculative_tokens=k
        )

    def reexport(self, head_dir, out_dir, formats: Sequence[str] = ("all",)) -> Path:
        """``export.reexport_head``: the same head in other formats, verified, its metadata carried over."""
        return reexport_head(head_dir, out_dir, formats)

    def card_lines(self, head_dir: Path, meta, k: int | None) -> list[str]:
        """Front matter, serve commands (draftsmith, vLLM, SGLang) and the head's geometry."""
        return eagle3_card_lines(head_dir, meta, k)

    def example_section(self) -> Section:
        """Two TTT steps, k = 2, the default aux layers of the target."""
        return Section(ttt_steps=2, num_speculative_tokens=2)

    def example(self, target_model, tokenizer, workdir: Path) -> SpeculativeConfig:
        """An untrained head (warm-started lm_head/norm, a reduced draft vocabulary when the target's is large)
        exported to ``workdir/eagle3`` with the speculators layout."""
        config = target_model.config.get_text_config()
        vocab = int(config.vocab_size)
        counts = torch.randint(1, 100, (vocab,), generator=torch.Generator().manual_seed(0))
        vocab_map = build_vocab_map(
            counts,
            min(vocab, max(2, vocab // 2)),
            always_include=[t for t in (tokenizer.eos_token_id,) if t is not None],
        )
        section = Section(aux_layer_ids=list(default_aux_layer_ids(config.num_hidden_layers)), ttt_steps=5)
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(0)
            head = build_head(target_model, vocab_map, section)
        out = export_eagle3(
            head,
            Path(workdir) / self.name,
            target_identity(target_model, tokenizer, example_target_name(target_model)),
            target_model.config,
            formats=("draftsmith", "speculators"),
            speculative_tokens=3,
        )
        return SpeculativeConfig(self.name, str(out), 3)


DRAFTER = Eagle3Drafter()
