"""Memory plan: before any weight is loaded, will the target, the drafter and their KV caches fit?

    plan = plan_for_engine("reference", '{"method": "draft_model", "model": "reference-draft", ...}',
                           dtype="float32", device="cpu", max_model_len=2048)
    print(plan.summary())
    plan.check()        # MemoryPlanError (a ValueError) with advice when the estimate exceeds free memory

What is counted (bytes; ``b`` = bytes per element of the serving dtype):
  1. weights        target parameters x b, counted by building the architecture on the meta device (nothing
                    is allocated; tied embeddings count once); draft model the same; an EAGLE-3 head by the
                    size of its exported weight file.
  2. KV caches      2 (K and V) x layers x kv_heads x head_dim x b per token, for max_model_len tokens per
                    sequence and ``max_num_seqs`` sequences (the runtime never drafts past max_tokens, so no
                    cache outgrows max_model_len); the drafter's cache too (draft model: all its layers;
                    EAGLE-3: its one decoder layer).
  3. prefill        one forward over max_model_len tokens: the logits [T, V] in the model dtype and in
                    float32 (``TargetModel`` returns every row as float32), the MLP intermediate
                    [T, intermediate_size] x 3, and, for EAGLE-3, the hidden states of every layer
                    [(layers + 1), T, H] that ``output_hidden_states`` keeps (an upper bound: the runtime
                    keeps the aux layers' inputs only, ``core/target.py``).
  4. margin         10% of the above (allocator fragmentation, temporary copies while a cache grows).
The serving engine runs ONE sequence at a time (``engine.py``: requests queue, batch size 1), so it plans
with ``max_num_seqs=1`` whatever the number of concurrent clients.

Free memory: CUDA ``torch.cuda.mem_get_info`` (free bytes on that device); CPU ``psutil.virtual_memory()
.available`` (falling back to ``MemAvailable`` in /proc/meminfo). These are the numbers vLLM's and
PyTorch's own tooling report; both are snapshots, so the plan is a guard against certain failure, not a
guarantee.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch
from transformers import AutoConfig

from draftsmith import drafters, reference
from draftsmith.core.target import position_limit
from draftsmith.drafters.base import MemoryItems
from draftsmith.drafters.speculative import SpeculativeConfig
from draftsmith.sizes import dtype_bytes, free_memory_bytes, kv_bytes_per_token, parameter_count

MARGIN = 0.10
MIB = 2**20


class MemoryPlanError(ValueError):
    """The plan does not fit in free memory; the message holds the plan's table and what to change.

    Attributes:
        plan: the ``MemoryPlan`` that failed.
    """

    def __init__(self, plan: "MemoryPlan"):
        super().__init__(plan.summary() + "\n" + "\n".join(f"  - {a}" for a in plan.advice))
        self.plan = plan


@dataclass
class MemoryPlan:
    """Estimated bytes per item against the device's free bytes.

    Attributes:
        device: 'cpu' or 'cuda[:i]'. free_bytes: free memory there when planned.
        items: name -> estimated bytes (weights, KV caches, prefill activations, margin).
        max_model_len: tokens per sequence planned for. max_num_seqs: sequences whose caches coexist.
        advice: what to change when the plan does not fit (empty when it fits).
    """

    device: str
    free_bytes: int
    items: dict[str, int]
    max_model_len: int
    max_num_seqs: int = 1
    advice: list[str] = field(default_factory=list)

    @property
    def total_bytes(self) -> int:
        """Sum of the items (margin included)."""
        return sum(self.items.values())

    @property
    def fits(self) -> bool:
        """True when the estimate is at most the free memory."""
        return self.total_bytes <= self.free_bytes

    def summary(self) -> str:
        """A small table: one line per item, the total, and the free memory of the device."""
        width = max(len(k) for k in self.items) + 2
        lines = [f"memory plan on {self.device} (max_model_len={self.max_model_len}, sequences={self.max_num_seqs}):"]
        lines += [f"  {name:<{width}}{size / MIB:>10.1f} MiB" for name, size in self.items.items()]
        lines.append(f"  {'total':<{width}}{self.total_bytes / MIB:>10.1f} MiB")
        verdict = "fits" if self.fits else f"does NOT fit ({(self.total_bytes - self.free_bytes) / MIB:.1f} MiB short)"
        lines.append(f"  {'free':<{width}}{self.free_bytes / MIB:>10.1f} MiB -> {verdict}")
        return "\n".join(lines)

    def check(self) -> None:
        """Raise ``MemoryPlanError`` (table + advice) unless the plan fits."""
        if not self.fits:
            raise MemoryPlanError(self)


def _prefill_bytes(config, tokens: int, dtype: str | torch.dtype, keeps_hidden_states: bool) -> int:
    c = config.get_text_config() if hasattr(config, "get_text_config") else config
    b = dtype_bytes(dtype)
    logits = tokens * c.vocab_size * (b + 4)  # model dtype + float32 copy
    mlp = 3 * tokens * getattr(c, "intermediate_size", 4 * c.hidden_size) * b
    hidden = (c.num_hidden_layers + 1) * tokens * c.hidden_size * b if keeps_hidden_states else 0
    return logits + mlp + hidden


def plan_memory(
    target_config,
    *,
    dtype: str = "float32",
    device: str = "cpu",
    max_model_len: int | None = None,
    max_num_seqs: int = 1,
    drafter: MemoryItems | None = None,
    free_bytes: int | None = None,
) -> MemoryPlan:
    """Estimate the serving memory of a target (+ drafter) and compare it with free memory.

    Args:
        target_config: the target's transformers ``PretrainedConfig``.
        dtype: serving dtype name of the target. device: 'cpu' or 'cuda[:i]'.
        max_model_len: tokens per sequence (default: the target's declared position limit).
        max_num_seqs: sequences whose KV caches live at once (the engine: 1).
        drafter: the drafter's own items (``Drafter.memory``: weights, KV cache per token, whether it reads the
            target's hidden states), or None (no speculation).
        free_bytes: free memory to plan against (default: ``free_memory_bytes(device)``; tests pass a number).

    Returns:
        A ``MemoryPlan`` whose ``advice`` is filled when it does not fit; call ``check()`` to enforce it.

    Raises:
        ValueError: no max_model_len for a target that declares no position limit.
    """
    drafter = drafter or MemoryItems()
    limit = position_limit(target_config)
    if not max_model_len and limit is None:
        raise ValueError("plan_memory: the target's config declares no position limit: pass max_model_len")
    max_model_len = int(max_model_len or limit[1])
    items: dict[str, int] = {"target weights": parameter_count(target_config) * dtype_bytes(dtype), **drafter.fixed}
    per_token = {"target KV cache": kv_bytes_per_token(target_config, dtype), **drafter.per_token}
    for name, size in per_token.items():
        items[name] = size * max_model_len * max_num_seqs
    items["prefill activations"] = _prefill_bytes(target_config, max_model_len, dtype, drafter.reads_hidden_states)
    items["margin (10%)"] = int(MARGIN * sum(items.values()))
    free = free_memory_bytes(device) if free_bytes is None else int(free_bytes)
    plan = MemoryPlan(
        device=str(device), free_bytes=free, items=items, max_model_len=max_model_len, max_num_seqs=max_num_seqs
    )
    if not plan.fits:
        plan.advice = _advice(plan, target_config, dtype, drafter, per_token)
    return plan


def _advice(plan: MemoryPlan, target_config, dtype, drafter: MemoryItems, per_token: dict[str, int]) -> list[str]:
    """What to change, most effective first, with the numbers that make it fit where one knob suffices."""
    advice = []
    # 1. a shorter max length: KV caches and prefill scale with it, weights do not
    fixed = sum(v for n, v in plan.items.items() if "weights" in n)
    per_len = sum(per_token.values()) * plan.max_num_seqs + _prefill_bytes(
        target_config, 1, dtype, drafter.reads_hidden_states
    )
    budget = plan.free_bytes / (1 + MARGIN) - fixed
    longest = int(budget // per_len) if budget > 0 else 0
    if longest >= 16:
        advice.append(
            f"lower the max length: --max-model-len {min(longest, plan.max_model_len - 1)} fits "
            f"(KV caches and prefill scale with it; now {plan.max_model_len})"
        )
    else:
        advice.append(
            f"the weights alone ({fixed / MIB:.1f} MiB + margin) leave no room for a KV cache in "
            f"{plan.free_bytes / MIB:.1f} MiB free: a shorter max length will not do"
        )
    if plan.max_num_seqs > 1:
        advice.append(f"serve fewer sequences at once (now {plan.max_num_seqs}); each holds its own KV caches")
    advice += drafter.advice
    if dtype_bytes(dtype) > 2:
        advice.append(f"serve in bfloat16 (--dtype bfloat16): weights and KV caches take half of {dtype}'s")
    if str(plan.device).startswith("cuda"):
        advice.append("free the GPU of other processes (nvidia-smi) or use a device with more memory")
    else:
        advice.append("close other programs, or serve on a GPU")
    return advice


def plan_for_engine(
    target: str,
    speculative_config: Any = None,
    *,
    dtype: str = "float32",
    device: str = "cpu",
    max_model_len: int | None = None,
    revision: str | None = None,
    free_bytes: int | None = None,
) -> MemoryPlan:
    """``plan_memory`` for what ``Engine.from_pretrained`` is about to load, reading configs only.

    Args:
        target: name or path as ``models.load_causal_lm`` takes it (``reference`` resolves to the embedded one).
        speculative_config: as ``SpeculativeConfig.parse`` (JSON string, dict, config or None); its drafter
            adds its own items (``Drafter.memory``).
        dtype, device, max_model_len, free_bytes: as ``plan_memory``; the engine plans for one sequence.

    Raises:
        ValueError: a bad speculative config. transformers' errors: a target or draft config that cannot be read.
    """

    spec = SpeculativeConfig.parse(speculative_config)
    config = AutoConfig.from_pretrained(reference.resolve(target), revision=revision)
    items = drafters.get(spec.method).memory(spec, config, dtype) if spec is not None else None
    return plan_memory(
        config,
        dtype=dtype,
        device=device,
        max_model_len=max_model_len,
        max_num_seqs=1,
        drafter=items,
        free_bytes=free_bytes,
    )
