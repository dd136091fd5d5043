"""Resumable training checkpoints in safetensors + JSON (no pickle).

A checkpoint is a directory written atomically (``DIR.tmp`` then renamed):

    model.safetensors      trainable parameters, full (unsharded), by name
    optimizer.safetensors  per-parameter optimizer state, keys ``<param name>/<state key>``
    state.json             step, scheduler state, optimizer hyper-parameters, caller's ``extra``
    rng.safetensors        torch CPU RNG state (and CUDA when present)
    vocab_map.safetensors  the draft vocabulary (d2t, t2d) the weights were trained with (EAGLE-3 runs)
    deepspeed/             DeepSpeed's own sharded model/optimizer files (ZeRO runs only; their
                           optimizer state lives there instead of optimizer.safetensors)

The files do not depend on the distribution strategy that wrote them (except ``deepspeed/``): the
trainer gathers full tensors first (``train.distributed``), so a DDP or FSDP checkpoint resumes on
one process and vice versa. Restoring gives the same next batch and the same loss as the
uninterrupted run, provided the data order is a function of (seed, step), as in every draftsmith trainer.

Two levels: :func:`save_checkpoint` / :func:`load_checkpoint` take a module and a torch optimizer
(single process); :func:`begin_checkpoint`, :func:`write_checkpoint`, :func:`commit_checkpoint` and
:func:`read_checkpoint` work on plain name -> tensor mappings, for callers that gather shards first.
"""

from __future__ import annotations

import json
import shutil
from dataclasses import dataclass, field
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from draftsmith.data_pipeline.vocab import VocabMap

VOCAB_MAP_FILE = "vocab_map.safetensors"


def _named_params(model: torch.nn.Module) -> dict[str, torch.nn.Parameter]:
    return {n: p for n, p in model.named_parameters() if p.requires_grad}


def _staging(path: Path) -> Path:
    return path.with_name(path.name + ".tmp")


def begin_checkpoint(path: str | Path) -> Path:
    """Create an empty staging directory ``PATH.tmp`` (removing a stale one); returns it."""
    tmp = _staging(Path(path))
    if tmp.exists():
        shutil.rmtree(tmp)
    tmp.mkdir(parents=True)
    return tmp


def commit_checkpoint(path: str | Path) -> Path:
    """Replace ``path`` by its staging directory (the last step of an atomic write); returns ``path``."""
    path = Path(path)
    tmp = _staging(path)
    if not (tmp / "state.json").exists():
        raise FileNotFoundError(f"{tmp} holds no state.json; call write_checkpoint before committing")
    if path.exists():
        shutil.rmtree(path)
    tmp.rename(path)
    return path


def write_checkpoint(
    folder: str | Path,
    params: dict[str, torch.Tensor],
    optimizer_state: dict[str, dict] | None = None,
    param_groups: list[dict] | None = None,
    scheduler_state: dict | None = None,
    step: int = 0,
    extra: dict | None = None,
    vocab_map=None,
) -> None:
    """Write the checkpoint files into ``folder`` (normally the staging directory of :func:`begin_checkpoint`).

    params: full tensors by parameter name. optimizer_state: ``{param name: {state key: tensor or
    scalar}}`` (None: no optimizer.safetensors). param_groups: the optimizer's groups without their
    ``params``. vocab_map: a ``heads.vocab.VocabMap`` (or None). ``extra`` must be JSON-serialisable."""
    folder = Path(folder)
    save_file({n: p.detach().contiguous().cpu() for n, p in params.items()}, str(folder / "model.safetensors"))
    state = {"step": step, "extra": extra or {}}
    if optimizer_state is not None:
        tensors, scalars = {}, {}
        for name, st in optimizer_state.items():
            for k, v in st.items():
                if torch.is_tensor(v):
                    tensors[f"{name}/{k}"] = v.detach().contiguous().cpu()
                else:
                    scalars[f"{name}/{k}"] = v
        save_file(tensors, str(folder / "optimizer.safetensors"))
        state["optimizer_scalars"] = scalars
    if param_groups is not None:
        state["param_groups"] = [{k: v for k, v in g.items() if k != "params"} for g in param_groups]
    if scheduler_state is not None:
        state["scheduler"] = scheduler_state
    if vocab_map is not None:
        save_file({k: v.contiguous().cpu() for k, v in vocab_map.to_tensors().items()}, str(folder / VOCAB_MAP_FILE))
    rng = {"cpu": torch.get_rng_state()}
    if torch.cuda.is_available():
        rng.update({f"cuda{i}": s for i, s in enumerate(torch.cuda.get_rng_state_all())})
    save_file(rng, str(folder / "rng.safetensors"))
    (folder / "state.json").write_text(json.dumps(state, indent=1, default=str))


def optimizer_state_by_name(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, dict]:
    """A torch optimizer's per-parameter state keyed by ``model``'s parameter names."""
    ids = {id(p): n for n, p in _named_params(model).items()}
    return {ids[id(p)]: dict(st) for p, st in optimizer.state.items()}


def save_checkpoint(
    path: str | Path,
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer | None,
    scheduler=None,
    step: int = 0,
    extra: dict | None = None,
    vocab_map=None,
) -> Path:
    """Write a checkpoint directory at ``path`` atomically from a (single-process) model; returns ``path``.

    ``extra`` must be JSON-serialisable (data position, config, ...)."""
    tmp = begin_checkpoint(path)
    write_checkpoint(
        tmp,
        _named_params(model),
        optimizer_state_by_name(model, optimizer) if optimizer is not None else None,
        optimizer.param_groups if optimizer is not None else None,
        scheduler.state_dict() if scheduler is not None else None,
        step,
        extra,
        vocab_map,
    )
    return commit_checkpoint(path)


@dataclass
class CheckpointData:
    """What :func:`read_checkpoint` found: ``state`` is state.json; tensors by name."""

    path: Path
    state: dict
    params: dict[str, torch.Tensor]
    optimizer_state: dict[str, dict] = field(default_factory=dict)
    rng: dict[str, torch.Tensor] = field(default_factory=dict)

    @property
    def step(self) -> int:
        """Optimiser steps done when the checkpoint was written (the data position)."""
        return int(self.state["step"])


def read_checkpoint(path: str | Path) -> CheckpointData:
    """Read a checkpoint directory without applying it. Raises FileNotFoundError when ``path`` holds none."""
    path = Path(path)
    if not (path / "state.json").exists():
        raise FileNotFoundError(f"{path} holds no checkpoint (no state.json); was the run saved?")
    state = json.loads((path / "state.json").read_text())
    optimizer_state: dict[str, dict] = {}
    if (path / "optimizer.safetensors").exists():
        for key, v in load_file(str(path / "optimizer.safetensors")).items():
            name, k = key.rsplit("/", 1)
            optimizer_state.setdefault(name, {})[k] = v
        for key, v in state.get("optimizer_scalars", {}).items():
            name, k = key.rsplit("/", 1)
            optimizer_state.setdefault(name, {})[k] = v
    rng = load_file(str(path / "rng.safetensors")) if (path / "rng.safetensors").exists() else {}
    return CheckpointData(path, state, load_file(str(path / "model.safetensors")), optimizer_state, rng)


def checkpoint_vocab_map(path: str | Path):
    """The ``VocabMap`` saved with a checkpoint, or None when it holds none (written before vocab maps were saved)."""

    file = Path(path) / VOCAB_MAP_FILE
    return VocabMap.from_tensors(load_file(str(file))) if file.exists() else None


def restore_params(model: torch.nn.Module, params: dict[str, torch.Tensor], where: str = "checkpoint") -> None:
    """Copy ``params`` into ``model``'s trainable parameters; KeyError when the names differ."""
    own = _named_params(model)
    differ = set(own) ^ set(params)
    if differ:
        raise KeyError(f"{where} and the model differ in parameters: {sorted(differ)[:5]}")
    with torch.no_grad():
        for n, p in own.items():
            p.copy_(params[n])


def restore_optimizer(model: torch.nn.Module, optimizer: torch.optim.Optimizer, data: CheckpointData) -> None:
    """Install the saved per-parameter state and hyper-parameters into a torch optimizer over ``model``."""
    for n, p in _named_params(model).items():
        st = data.optimizer_state.get(n)
        if st:
            optimizer.state[p] = {k: v.to(p.device) if torch.is_tensor(v) else v for k, v in st.items()}
    for g, saved in zip(optimizer.param_groups, data.state.get("param_groups", [])):
        g.update(saved)


def restore_rng(rng: dict[str, torch.Tensor]) -> None:
    """Set torch's CPU (and CUDA) RNG states from a checkpoint's ``rng.safetensors``."""
    if "cpu" in rng:
        torch.set_rng_state(rng["cpu"])
    if torch.cuda.is_available():
        cuda = [rng[k] for k in sorted(rng) if k.startswith("cuda")]
        if cuda:
            torch.cuda.set_rng_state_all(cuda)


def load_checkpoint(
    path: str | Path, model: torch.nn.Module, optimizer: torch.optim.Optimizer | None = None, scheduler=None
) -> dict:
    """Restore a checkpoint written by :func:`save_checkpoint` in place; returns its ``state.json``.

    Raises FileNotFoundError when ``path`` holds no checkpoint, KeyError when parameter names differ."""
    data = read_checkpoint(path)
    restore_params(model, data.params, f"checkpoint {data.path}")
    if optimizer is not None:
        restore_optimizer(model, optimizer, data)
    if scheduler is not None and "scheduler" in data.state:
        scheduler.load_state_dict(data.state["scheduler"])
    restore_rng(data.rng)
    return data.state
