"""Resumable training checkpoints in safetensors + JSON (no pickle).

A checkpoint is a directory written atomically (``DIR.tmp`` then renamed):

    model.safetensors      trainable parameters, by name
    optimizer.safetensors  per-parameter optimizer state, keys ``<param name>/<state key>``
    state.json             step, scheduler state, optimizer hyper-parameters, caller's ``extra``
    rng.safetensors        torch CPU RNG state (and CUDA when present)

Restoring gives the same next batch and the same loss as the uninterrupted run, provided the data
order is a function of (seed, step), as in every draftsmith trainer.
"""
from __future__ import annotations

import json
import shutil
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file


def _named_params(model: torch.nn.Module) -> dict[str, torch.nn.Parameter]:
    return {n: p for n, p in model.named_parameters() if p.requires_grad}


def save_checkpoint(path: str | Path, model: torch.nn.Module, optimizer: torch.optim.Optimizer | None,
                    scheduler=None, step: int = 0, extra: dict | None = None) -> Path:
    """Write a checkpoint directory at ``path`` atomically; returns ``path``.

    ``extra`` must be JSON-serialisable (data position, config, vocab-map hash, ...)."""
    path = Path(path)
    tmp = path.with_name(path.name + ".tmp")
    if tmp.exists():
        shutil.rmtree(tmp)
    tmp.mkdir(parents=True)
    params = _named_params(model)
    save_file({n: p.detach().contiguous().cpu() for n, p in params.items()}, str(tmp / "model.safetensors"))
    state = {"step": step, "extra": extra or {}}
    if optimizer is not None:
        ids = {id(p): n for n, p in params.items()}
        tensors, scalars = {}, {}
        for p, st in optimizer.state.items():
            name = ids[id(p)]
            for k, v in st.items():
                if torch.is_tensor(v):
                    tensors[f"{name}/{k}"] = v.detach().contiguous().cpu()
                else:
                    scalars[f"{name}/{k}"] = v
        save_file(tensors, str(tmp / "optimizer.safetensors"))
        state["optimizer_scalars"] = scalars
        state["param_groups"] = [{k: v for k, v in g.items() if k != "params"} for g in optimizer.param_groups]
    if scheduler is not None:
        state["scheduler"] = scheduler.state_dict()
    rng = {"cpu": torch.get_rng_state()}
    if torch.cuda.is_available():
        rng.update({f"cuda{i}": s for i, s in enumerate(torch.cuda.get_rng_state_all())})
    save_file(rng, str(tmp / "rng.safetensors"))
    (tmp / "state.json").write_text(json.dumps(state, indent=1, default=str))
    if path.exists():
        shutil.rmtree(path)
    tmp.rename(path)
    return path


def load_checkpoint(path: str | Path, model: torch.nn.Module, optimizer: torch.optim.Optimizer | None = None,
                    scheduler=None) -> dict:
    """Restore a checkpoint written by :func:`save_checkpoint` in place; returns its ``state.json``.

    Raises FileNotFoundError when ``path`` holds no checkpoint, KeyError when parameter names differ."""
    path = Path(path)
    if not (path / "state.json").exists():
        raise FileNotFoundError(f"{path} holds no checkpoint (no state.json); was the run saved?")
    state = json.loads((path / "state.json").read_text())
    params = _named_params(model)
    weights = load_file(str(path / "model.safetensors"))
    missing = set(params) ^ set(weights)
    if missing:
        raise KeyError(f"checkpoint {path} and the model differ in parameters: {sorted(missing)[:5]}")
    with torch.no_grad():
        for n, p in params.items():
            p.copy_(weights[n])
    if optimizer is not None and (path / "optimizer.safetensors").exists():
        tensors = load_file(str(path / "optimizer.safetensors"))
        scalars = state.get("optimizer_scalars", {})
        for n, p in params.items():
            st = {k.split("/", 1)[1]: v.to(p.device) for k, v in tensors.items() if k.split("/", 1)[0] == n}
            st.update({k.split("/", 1)[1]: v for k, v in scalars.items() if k.split("/", 1)[0] == n})
            if st:
                optimizer.state[p] = st
        for g, saved in zip(optimizer.param_groups, state.get("param_groups", [])):
            g.update(saved)
    if scheduler is not None and "scheduler" in state:
        scheduler.load_state_dict(state["scheduler"])
    rng = load_file(str(path / "rng.safetensors"))
    torch.set_rng_state(rng["cpu"])
    if torch.cuda.is_available():
        cuda = [rng[k] for k in sorted(rng) if k.startswith("cuda")]
        if cuda:
            torch.cuda.set_rng_state_all(cuda)
    return state
