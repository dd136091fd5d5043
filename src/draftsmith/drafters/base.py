"""The ``Drafter`` contract: everything the trainer, exporter, checker, engine, memory plan, eval, bench and
CLI need from one kind of drafter. Each drafter folder's ``drafter.py`` defines one as ``DRAFTER``; the other
layers find it only through the registry (``drafters.get(name)``).

    drafter = drafters.get(spec.method)
    loaded = drafter.load(spec, target_model, tokenizer)              # checked against the target, on its device
    proposer = loaded.new_proposer(temperature=0.0)                   # one per sequence (core.proposer.Proposer)
    report = drafter.check(head_dir, target, tokenizer)               # `draftsmith check`
    spec = drafter.training_spec(section, vocab_map)                  # train.trainer.DrafterSpec, or None
    drafter.export(trained, out_dir, identity, target.config, training=..., formats=..., k=...)

What each method must do, and which contract tests hold it to that, is in its docstring; a drafter that
cannot meet a contract names it in ``opt_outs`` with the reason (``tests/test_contract.py``).
"""

from __future__ import annotations

import abc
import logging
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, ClassVar, Sequence

import torch

from draftsmith.core.proposer import BatchProposer, PerSequence, Proposer, Sampling
from draftsmith.core.sampling import DRAFT_SEED_OFFSET, draft_seed  # noqa: F401 - re-exported
from draftsmith.drafters.speculative import SpeculativeConfig
from draftsmith.precision import resolve_dtype

logger = logging.getLogger(__name__)


def example_target_name(target_model) -> str:
    """The name an example export records for its target: the model's own (``config._name_or_path``), else
    ``example-target`` (engines' configs need one; a model built from a config in memory has none)."""
    return getattr(target_model.config, "_name_or_path", None) or "example-target"


class LoadedDrafter(abc.ABC):
    """One drafter loaded for one target, checked and on the target's device; serves many sequences.

    Attributes:
        spec: the speculative config it was loaded from.
        aux_layer_ids: target hidden-state indices its proposers read (``core.target.TargetModel``), or None.
        trained_depth: how many draft positions it was trained for (EAGLE-3 ``ttt_steps``), or None.
        max_k: most drafts per step it can make at all (an MLP speculator's ``n_predict``, a DFlash block's
            ``block_size - 1``), or None (no limit of its own): adaptive speculation drafts at most this.
        modules: its own torch modules, not the target's (``Engine`` packs their linears for oneDNN with the
            target's: ``core.onednn``); empty for a drafter without weights.
    """

    spec: SpeculativeConfig
    aux_layer_ids: tuple[int, ...] | None = None
    trained_depth: int | None = None
    max_k: int | None = None
    modules: tuple[torch.nn.Module, ...] = ()

    @abc.abstractmethod
    def new_proposer(self, sampling: Sampling) -> Proposer:
        """A fresh proposer for one sequence (``core.proposer.Proposer``)."""

    def new_batch_proposer(self) -> BatchProposer:
        """A proposer for the rows of a batch (``core.proposer.BatchProposer``), each row drafting with its own
        ``Sampling``. Default: one ``new_proposer`` per row (``PerSequence``); drafters whose work batches
        override it, and must draft exactly what ``new_proposer`` drafts for each row (contract test)."""
        return PerSequence.over(self.new_proposer)

    def check_max_model_len(self, max_model_len: int) -> None:
        """Refuse (ValueError naming both lengths and the fix) or warn when sequences of ``max_model_len`` tokens
        go past what the drafter can read; default: no limit of its own."""


class Drafter(abc.ABC):
    """One kind of drafter (module docstring). Class attributes say what it is; methods do its work.

    Attributes:
        name: the registry key = recipe ``drafter.method`` = ``head_type`` = vLLM ``method``.
        summary: one line for CLI help and the README's table.
        trainable: whether ``training_spec`` trains it (n-gram lookup has nothing to train).
        formats: export formats it writes (``draftsmith export --format``; ``all`` = every one).
        default_model: the model a bare method name drafts with where eval and bench need one (None: the caller
            must give it: an exported head directory).
        opt_outs: contract test name -> the reason this drafter cannot meet it (``tests/test_contract.py``).
    """

    name: ClassVar[str]
    summary: ClassVar[str]
    trainable: ClassVar[bool] = True
    formats: ClassVar[tuple[str, ...]] = ("draftsmith",)
    default_model: ClassVar[str | None] = None
    opt_outs: ClassVar[dict[str, str]] = {}

    # --- serving ---------------------------------------------------------------------------------------------
    @abc.abstractmethod
    def load(
        self, spec: SpeculativeConfig, target_model, tokenizer, allow_mismatch: Sequence[str] = ()
    ) -> LoadedDrafter:
        """Check ``spec.model`` against the target (refusing a mismatch: ``HeadMismatchError`` naming the field)
        and load it on the target's device, in a dtype the device computes natively.

        Raises:
            HeadMismatchError / ValueError: a drafter that does not fit the target, or a k it cannot draft."""

    def check_before_loading(self, spec: SpeculativeConfig, target_config, max_model_len: int) -> None:
        """Refuse, from configs alone and before any weights load, what ``load`` would refuse (default: nothing)."""

    def memory(self, spec: SpeculativeConfig, target_config, dtype: str) -> "MemoryItems":
        """Bytes the drafter needs while serving (``serve.memory``): weights and KV cache per token."""
        return MemoryItems()

    # --- checking and exporting ------------------------------------------------------------------------------
    def check(
        self,
        head_dir: str | Path,
        target_config: Any = None,
        tokenizer: Any = None,
        name_or_path: str | None = None,
        allow_mismatch: Sequence[str] = (),
        tensor_parallel_size: int | None = None,
    ):
        """Every check of ``draftsmith check`` (``export.check.CheckReport``); ``target_config`` None checks the
        export's own integrity. Raises HeadMismatchError naming the field, both values and the fix."""
        raise NotImplementedError(f"the {self.name} drafter writes no exports to check")

    def training_spec(self, section, vocab_map=None):
        """The ``train.trainer.DrafterSpec`` that trains this drafter as the recipe section says; None when
        the drafter is not trainable."""
        return None

    def export(
        self,
        module: torch.nn.Module,
        out_dir: str | Path,
        identity: dict,
        target_config,
        *,
        training: dict | None = None,
        formats: Sequence[str] = ("draftsmith",),
        k: int | None = None,
        tokenizer=None,
    ) -> Path:
        """Write the trained ``module`` to ``out_dir`` (atomically: ``export.writer.staged_directory``) with
        draftsmith.json (``identity``: ``identity.target_identity``) and the model card; ``k`` is the
        num_speculative_tokens written into engine configs. Returns out_dir."""
        raise NotImplementedError(f"the {self.name} drafter has nothing to export")

    def reexport(self, head_dir: str | Path, out_dir: str | Path, formats: Sequence[str] = ("all",)) -> Path:
        """Export an exported directory again (other formats, another place), unchanged and verified."""
        raise NotImplementedError(f"the {self.name} drafter has nothing to export")

    def card_lines(self, head_dir: Path, meta, k: int | None) -> list[str]:
        """The model card's front matter, serve commands and geometry (``export.card`` adds the rest)."""
        return []

    def speculative_config(self, model: str | None, k: int, **options) -> SpeculativeConfig:
        """The speculative config that serves ``model`` with this drafter at ``k``."""
        return SpeculativeConfig(self.name, model, k, dict(options))

    def example_section(self):
        """A small recipe section of this drafter (``drafters.config.DrafterSection``) that trains on any tiny
        target in a step or two: what the contract tests train and resume; None when not trainable."""
        return None

    def example(self, target_model, tokenizer, workdir: Path) -> SpeculativeConfig:
        """A speculative config of an untrained (random-weight, warm-started where it applies) drafter for
        ``target_model``, exported under ``workdir`` when it has weights: what the contract tests serve. Its k is 3;
        it must serve every k up to 5 (``SpeculativeConfig.with_k``)."""
        raise NotImplementedError


@dataclass
class MemoryItems:
    """A drafter's serving memory: fixed bytes by item, bytes per cached token by item, and whether its
    proposers read the target's hidden states (the prefill then keeps them)."""

    fixed: dict[str, int] = field(default_factory=dict)
    per_token: dict[str, int] = field(default_factory=dict)
    reads_hidden_states: bool = False
    advice: list[str] = field(default_factory=list)


def in_fast_dtype(module: torch.nn.Module, device: torch.device, what: str) -> torch.nn.Module:
    """``module`` in a dtype ``device`` computes natively: an export stored in bf16/fp16 runs in float32 on a CPU
    that emulates half precision (``precision.resolve_dtype`` 'auto'); the change is logged. Drafts stay lossless
    either way (verification uses the q the drafter computed)."""

    stored = next(module.parameters()).dtype
    dtype, reason = resolve_dtype("auto", device, model_dtype=stored)
    if dtype != stored:
        logger.info("%s: computing in %s instead of its stored %s (%s)", what, dtype, stored, reason)
        module = module.to(dtype)
    return module
