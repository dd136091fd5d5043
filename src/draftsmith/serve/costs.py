"""The cost model an engine with ``"num_speculative_tokens": "auto"`` decides with: measured at startup
(``core.cost_profile.profile_costs``) and cached per target, drafter and device, so a restart reuses it.

The cache is one JSON file per key under ``$DRAFTSMITH_CACHE/costs`` (default ``$XDG_CACHE_HOME/draftsmith`` or
``~/.cache/draftsmith``). The key holds everything the costs depend on: the target (its name and config), the
drafter (method, model path and its files' sizes and times, options, tree), k_max and the batch sizes measured, the
device, dtype, torch threads and CPU capability, and torch's version. Delete the file to measure again.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
from pathlib import Path

import torch

from draftsmith.core.adaptive import AdaptivePolicy, CostModel
from draftsmith.core.cost_profile import profile_costs
from draftsmith.core.onednn import PackedLinear
from draftsmith.core.rms_norm import fused_rms_norms
from draftsmith.core.target import TargetModel

logger = logging.getLogger(__name__)
PROFILE_MAX_BATCH = 32  #: largest batch the profile measures; larger ones are extrapolated linearly
COSTS_VERSION = 5  #: bump when the profile measures something else


def cache_dir() -> Path:
    """Where cost models are kept (module docstring)."""
    root = os.environ.get("DRAFTSMITH_CACHE")
    if root:
        return Path(root) / "costs"
    xdg = os.environ.get("XDG_CACHE_HOME")
    return (Path(xdg) if xdg else Path.home() / ".cache") / "draftsmith" / "costs"


def profile_batch_sizes(max_num_seqs: int) -> list[int]:
    """Powers of two up to min(max_num_seqs, ``PROFILE_MAX_BATCH``), and that bound itself."""
    top = max(1, min(max_num_seqs, PROFILE_MAX_BATCH))
    sizes = [1 << i for i in range(top.bit_length()) if 1 << i <= top]
    return sorted(set(sizes + [top]))


def _files_stamp(model: str | None) -> list:
    """(name, size, mtime) of a local model directory's files; [] for a Hub id or no model."""
    if not model or not Path(model).is_dir():
        return []
    return sorted((p.name, p.stat().st_size, int(p.stat().st_mtime)) for p in Path(model).iterdir() if p.is_file())


def cost_key(target: TargetModel, spec, k_max: int, batch_sizes: list[int], drafter=None) -> dict:
    """What a cached cost model must have been measured with (module docstring); ``drafter`` is the engine's
    ``LoadedDrafter``, whose packed linears count as the target's do (oneDNN or MKL GEMMs)."""
    config = target.model.config
    param = next(target.model.parameters())
    return {
        "version": COSTS_VERSION,
        "target": getattr(config, "_name_or_path", ""),
        "target_config": hashlib.sha256(config.to_json_string(use_diff=False).encode()).hexdigest()[:16],
        "method": spec.method,
        "model": str(Path(spec.model).resolve()) if spec.model and Path(spec.model).exists() else spec.model,
        "model_files": _files_stamp(spec.model),
        "options": spec.options,
        "tree": str(spec.tree) if spec.tree is not None else None,
        "k_max": k_max,
        "batch_sizes": batch_sizes,
        "device": str(param.device),
        "dtype": str(param.dtype),
        "threads": torch.get_num_threads(),
        "cpu_capability": torch.backends.cpu.get_cpu_capability(),
        "torch": torch.__version__,
        "packed_linears": sum(type(m) is PackedLinear for m in target.model.modules()),  # oneDNN or MKL GEMMs
        "drafter_packed_linears": sum(
            type(m) is PackedLinear
            for module in (drafter.modules if drafter is not None else ())
            for m in module.modules()
        ),
        "fused_norms": sum(  # core.rms_norm: the target's and the drafter's RMSNorms through F.rms_norm
            fused_rms_norms(module) for module in (target.model, *(drafter.modules if drafter is not None else ()))
        ),
    }


def engine_cost_model(target: TargetModel, drafter, spec, k_max: int, max_num_seqs: int) -> CostModel:
    """The cached cost model for this target + drafter on this machine, measured now when there is none (a few
    seconds to a minute: ``profile_costs``); its figures are logged.

    Args:
        target: the engine's wrapped target. drafter: its ``LoadedDrafter``. spec: its ``SpeculativeConfig``.
        k_max: most drafts per step (a tree: its depth). max_num_seqs: the engine's batch bound.
    """
    sizes = profile_batch_sizes(max_num_seqs)
    key = cost_key(target, spec, k_max, sizes, drafter)
    digest = hashlib.sha256(json.dumps(key, sort_keys=True, default=str).encode()).hexdigest()[:20]
    path = cache_dir() / f"{spec.method}-{digest}.json"
    if path.is_file():
        try:
            cost = CostModel.load(path)
            if cost.meta.get("key") == json.loads(json.dumps(key, default=str)):
                logger.info("adaptive speculation: cost model from %s\n%s", path, cost.summary())
                return cost
        except ValueError as e:
            logger.warning("adaptive speculation: %s; measuring again", e)
    logger.info("adaptive speculation: measuring the cost model (batch sizes %s, k <= %d)", sizes, k_max)
    cost = profile_costs(
        target,
        drafter.new_batch_proposer,
        k_max,
        sizes,
        tree=spec.tree,
        meta={"key": json.loads(json.dumps(key, default=str))},
    )
    try:
        cost.save(path)
    except OSError as e:  # a read-only home: serve anyway, measure again next time
        logger.warning("adaptive speculation: cannot cache the cost model at %s (%s)", path, e)
    logger.info("adaptive speculation: cost model measured in %.1f s\n%s", cost.meta["profile_seconds"], cost.summary())
    return cost


def recorded_acceptance(head_dir, head_type: str) -> list[float] | None:
    """A head's held-out conditional acceptance per position, as its export records it (``draftsmith.json``
    ``eval.tasks.TASK.ROW.accepted_per_pos``, the fraction of drafts whose position i was accepted: vLLM's
    ``num_accepted_tokens_per_pos`` / ``num_drafts``), for the rows of the head's own method (``head_type``, or
    ``head_type@kK``) with the most positions; the mean over tasks, then a_i = u_i / u_(i-1). None when the
    directory is no export, records no eval, or records none of its own rows (n-gram and draft models, heads never
    evaluated)."""
    from draftsmith.export.metadata import read_metadata

    try:
        tasks = (read_metadata(head_dir).eval or {}).get("tasks") or {}
    except (FileNotFoundError, ValueError, OSError, TypeError):
        return None
    per_task = []
    for rows in tasks.values():
        own = [
            r.get("accepted_per_pos") or []
            for label, r in (rows or {}).items()
            if isinstance(r, dict) and (label == head_type or label.startswith(f"{head_type}@k"))
        ]
        own = [u for u in own if u]
        if own:
            per_task.append(max(own, key=len))
    if not per_task:
        return None
    depth = min(len(u) for u in per_task)
    mean = [sum(u[i] for u in per_task) / len(per_task) for i in range(depth)]
    rates, before = [], 1.0
    for u in mean:
        rates.append(min(1.0, max(0.0, u / before)) if before > 0 else 0.0)
        before = u
    return rates


def adaptive_policy(target: TargetModel, drafter, spec, max_num_seqs: int) -> AdaptivePolicy:
    """The ``AdaptivePolicy`` for an engine serving ``spec`` (``adaptive``): k_max = the config's (``AUTO_MAX_K`` or a
    tree's depth) lowered to the drafter's own limit (``LoadedDrafter.max_k``); the engine's prior acceptance is the
    head's recorded held-out acceptance where its export has one (``recorded_acceptance``; a tree's is its chain's
    per depth only when the record is a chain's: the prior is then left to the first steps)."""
    k_max = min(spec.depth, drafter.max_k or spec.depth)
    cost = engine_cost_model(target, drafter, spec, k_max, max_num_seqs)
    prior = recorded_acceptance(spec.model, spec.method) if spec.model and spec.tree is None else None
    if prior:
        logger.info("adaptive speculation: prior acceptance per position from %s: %s", spec.model, prior)
    if spec.tree is None:
        return AdaptivePolicy(cost, k_max, prior=prior)
    return AdaptivePolicy(cost, k_max, topk=spec.tree.topk, num_nodes=spec.tree.num_nodes)
