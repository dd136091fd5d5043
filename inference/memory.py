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
                    [(layers + 1), T, H] that ``output_hidden_states`` keeps.
  4. margin         10% of the above (allocator fragmentation, temporary copies while a cache grows).
The serving engine runs ONE sequence at a time (``engine.py``: requests queue, batch size 1), so it plans
with ``max_num_seqs=1`` whatever the number of concurrent clients.

Free memory: CUDA ``torch.cuda.mem_get_info`` (free bytes on that device); CPU ``psutil.virtual_memory()
.available`` (falling back to ``MemAvailable`` in /proc/meminfo). These are the numbers vLLM's and
PyTorch's own tooling report; both are snapshots, so the plan is a guard against certain failure, not a
guarantee.
"""
from __future__ import annotations

import json
import struct
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from .target import position_limit

MARGIN = 0.10
MIB = 2**20
_SAFETENSORS_DTYPE_BYTES = {"F64": 8, "F32": 4, "F16": 2, "BF16": 2, "I64": 8, "I32": 4, "I16": 2, "I8": 1,
                            "U8": 1, "BOOL": 1, "F8_E4M3": 1, "F8_E5M2": 1}


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


def free_memory_bytes(device: str | torch.device) -> int:
    """Free bytes on ``device``: CUDA ``torch.cuda.mem_get_info``, CPU available RAM (psutil, else /proc/meminfo).

    Raises:
        RuntimeError: CPU memory cannot be read (no psutil and no /proc/meminfo).
    """
    device = torch.device(device)
    if device.type == "cuda":
        free, _total = torch.cuda.mem_get_info(device)
        return int(free)
    try:
        import psutil

        return int(psutil.virtual_memory().available)
    except ImportError:
        pass
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024            # kB
    except OSError:
        pass
    raise RuntimeError("cannot read free CPU memory (install psutil)")


def dtype_bytes(dtype: str | torch.dtype) -> int:
    """Bytes per element of a dtype name ('float32', 'bfloat16', ...) or ``torch.dtype``."""
    if isinstance(dtype, str):
        dtype = getattr(torch, dtype)
    return torch.empty((), dtype=dtype).element_size()


def parameter_count(config) -> int:
    """Parameters of a transformers causal LM built from ``config`` on the meta device (no memory used;
    shared/tied tensors count once)."""
    from transformers import AutoModelForCausalLM

    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    return sum(p.numel() for p in model.parameters())


def kv_bytes_per_token(config, dtype: str | torch.dtype) -> int:
    """K and V bytes one token adds to the cache of a transformers decoder: 2 x layers x kv_heads x head_dim x b."""
    c = config.get_text_config() if hasattr(config, "get_text_config") else config
    heads = c.num_attention_heads
    kv_heads = getattr(c, "num_key_value_heads", None) or heads
    head_dim = getattr(c, "head_dim", None) or c.hidden_size // heads
    return 2 * c.num_hidden_layers * kv_heads * head_dim * dtype_bytes(dtype)


def safetensors_bytes(path: str | Path) -> tuple[int, int]:
    """(tensor bytes, bytes per element of the largest tensor) of a .safetensors file, from its header only."""
    with open(path, "rb") as f:
        (length,) = struct.unpack("<Q", f.read(8))
        header = json.loads(f.read(length))
    tensors = [v for k, v in header.items() if k != "__metadata__"]
    total = sum(v["data_offsets"][1] - v["data_offsets"][0] for v in tensors)
    largest = max(tensors, key=lambda v: v["data_offsets"][1] - v["data_offsets"][0])
    return total, _SAFETENSORS_DTYPE_BYTES.get(largest["dtype"], 4)


def eagle3_head_bytes(head_config: dict, dtype: str | torch.dtype) -> int:
    """Weight bytes of an EAGLE-3 head of this geometry (``Eagle3Config`` fields), built on the meta device."""
    from draftsmith.heads.eagle3 import Eagle3Config, Eagle3Head

    with torch.device("meta"):
        head = Eagle3Head(Eagle3Config.from_dict(head_config))
    return sum(p.numel() for p in head.parameters()) * dtype_bytes(dtype)


def _prefill_bytes(config, tokens: int, dtype: str | torch.dtype, keeps_hidden_states: bool) -> int:
    c = config.get_text_config() if hasattr(config, "get_text_config") else config
    b = dtype_bytes(dtype)
    logits = tokens * c.vocab_size * (b + 4)                             # model dtype + float32 copy
    mlp = 3 * tokens * getattr(c, "intermediate_size", 4 * c.hidden_size) * b
    hidden = (c.num_hidden_layers + 1) * tokens * c.hidden_size * b if keeps_hidden_states else 0
    return logits + mlp + hidden


def plan_memory(target_config, *, dtype: str = "float32", device: str = "cpu", max_model_len: int | None = None,
                max_num_seqs: int = 1, method: str | None = None, draft_config=None,
                head_dir: str | Path | None = None, free_bytes: int | None = None) -> MemoryPlan:
    """Estimate the serving memory of a target (+ drafter) and compare it with free memory.

    Args:
        target_config: the target's transformers ``PretrainedConfig``.
        dtype: serving dtype name of the target and draft model. device: 'cpu' or 'cuda[:i]'.
        max_model_len: tokens per sequence (default: the target's declared position limit, ``max_position_embeddings``
            or ``n_positions``: ``target.position_limit``).
        max_num_seqs: sequences whose KV caches live at once (the engine: 1).
        method: None (no speculation), 'ngram', 'draft_model' (needs ``draft_config``), 'eagle3'
            (needs ``head_dir``, an exported head directory or one of its format folders) or 'mlp_speculator'
            (needs ``head_dir``).
        free_bytes: free memory to plan against (default: ``free_memory_bytes(device)``; tests pass a number).

    Returns:
        A ``MemoryPlan`` whose ``advice`` is filled when it does not fit; call ``check()`` to enforce it.

    Raises:
        ValueError: a drafter method without its config / head directory; no max_model_len for a target that
            declares no position limit.
    """
    limit = position_limit(target_config)
    if not max_model_len and limit is None:
        raise ValueError("plan_memory: the target's config declares no position limit: pass max_model_len")
    max_model_len = int(max_model_len or limit[1])
    b = dtype_bytes(dtype)
    items: dict[str, int] = {"target weights": parameter_count(target_config) * b}
    per_token = {"target KV cache": kv_bytes_per_token(target_config, dtype)}
    if method == "draft_model":
        if draft_config is None:
            raise ValueError("plan_memory: method 'draft_model' needs draft_config")
        items["draft model weights"] = parameter_count(draft_config) * b
        per_token["draft model KV cache"] = kv_bytes_per_token(draft_config, dtype)
    elif method == "eagle3":
        if head_dir is None:
            raise ValueError("plan_memory: method 'eagle3' needs head_dir")
        head_dir = Path(head_dir)                            # an export root, or one of its format folders
        metadata = next((d / "draftsmith.json" for d in (head_dir, head_dir.parent) if (d / "draftsmith.json").is_file()),
                        head_dir / "draftsmith.json")
        head_config = json.loads(metadata.read_text())["head_config"]
        files = sorted(head_dir.glob("*.safetensors"))
        if files:
            sizes = [safetensors_bytes(f) for f in files]
            head_bytes, head_b = sum(s for s, _ in sizes), max(e for _, e in sizes)
        else:
            head_bytes, head_b = eagle3_head_bytes(head_config, "float32"), 4
        items["EAGLE-3 head weights"] = head_bytes
        per_token["EAGLE-3 head KV cache"] = 2 * head_config["num_key_value_heads"] * head_config["head_dim"] * head_b
    elif method == "mlp_speculator":                         # weights only: its stages keep no cache
        if head_dir is None:
            raise ValueError("plan_memory: method 'mlp_speculator' needs head_dir")
        files = sorted(Path(head_dir).glob("*.safetensors"))
        items["MLP speculator weights"] = sum(safetensors_bytes(f)[0] for f in files)
    for name, size in per_token.items():
        items[name] = size * max_model_len * max_num_seqs
    items["prefill activations"] = _prefill_bytes(target_config, max_model_len, dtype, method == "eagle3")
    items["margin (10%)"] = int(MARGIN * sum(items.values()))
    free = free_memory_bytes(device) if free_bytes is None else int(free_bytes)
    plan = MemoryPlan(device=str(device), free_bytes=free, items=items, max_model_len=max_model_len,
                      max_num_seqs=max_num_seqs)
    if not plan.fits:
        plan.advice = _advice(plan, target_config, dtype, method, per_token)
    return plan


def _advice(plan: MemoryPlan, target_config, dtype, method, per_token: dict[str, int]) -> list[str]:
    """What to change, most effective first, with the numbers that make it fit where one knob suffices."""
    advice = []
    # 1. a shorter max length: KV caches and prefill scale with it, weights do not
    fixed = sum(v for n, v in plan.items.items() if "weights" in n)
    per_len = (sum(per_token.values()) * plan.max_num_seqs
               + _prefill_bytes(target_config, 1, dtype, method == "eagle3"))
    budget = plan.free_bytes / (1 + MARGIN) - fixed
    longest = int(budget // per_len) if budget > 0 else 0
    if longest >= 16:
        advice.append(f"lower the max length: --max-model-len {min(longest, plan.max_model_len - 1)} fits "
                      f"(KV caches and prefill scale with it; now {plan.max_model_len})")
    else:
        advice.append(f"the weights alone ({fixed / MIB:.1f} MiB + margin) leave no room for a KV cache in "
                      f"{plan.free_bytes / MIB:.1f} MiB free: a shorter max length will not do")
    if plan.max_num_seqs > 1:
        advice.append(f"serve fewer sequences at once (now {plan.max_num_seqs}); each holds its own KV caches")
    if method == "draft_model":
        from draftsmith.heads.eagle3 import Eagle3Config

        head = Eagle3Config.from_target(target_config).to_dict()
        eagle = eagle3_head_bytes(head, dtype)                          # full draft vocab: an upper bound
        draft = plan.items["draft model weights"] + plan.items["draft model KV cache"]
        tip = (f", or an EAGLE-3 head instead: one decoder layer, at most {eagle / MIB:.1f} MiB, reading the "
               f"target's own hidden states" if eagle < draft else "")
        advice.append(f"use a smaller draft model (now {plan.items['draft model weights'] / MIB:.1f} MiB of weights "
                      f"+ {plan.items['draft model KV cache'] / MIB:.1f} MiB of KV cache){tip}")
    if dtype_bytes(dtype) > 2:
        advice.append(f"serve in bfloat16 (--dtype bfloat16): weights and KV caches take half of {dtype}'s")
    if str(plan.device).startswith("cuda"):
        advice.append("free the GPU of other processes (nvidia-smi) or use a device with more memory")
    else:
        advice.append("close other programs, or serve on a GPU")
    return advice


def plan_for_engine(target: str, speculative_config: Any = None, *, dtype: str = "float32", device: str = "cpu",
                    max_model_len: int | None = None, revision: str | None = None,
                    free_bytes: int | None = None) -> MemoryPlan:
    """``plan_memory`` for what ``Engine.from_pretrained`` is about to load, reading configs only.

    Args:
        target: name or path as ``models.load_causal_lm`` takes it (``reference`` resolves to the embedded one).
        speculative_config: as ``SpeculativeConfig.parse`` (JSON string, dict, config or None).
        dtype, device, max_model_len, free_bytes: as ``plan_memory``; the engine plans for one sequence.

    Raises:
        ValueError: a bad speculative config. transformers' errors: a target or draft config that cannot be read.
    """
    from transformers import AutoConfig

    from draftsmith import reference

    from .engine import SpeculativeConfig

    spec = SpeculativeConfig.parse(speculative_config)
    config = AutoConfig.from_pretrained(reference.resolve(target), revision=revision)
    method = spec.method if spec is not None else None
    draft_config = AutoConfig.from_pretrained(reference.resolve(spec.model)) if method == "draft_model" else None
    return plan_memory(config, dtype=dtype, device=device, max_model_len=max_model_len, max_num_seqs=1,
                       method=method, draft_config=draft_config,
                       head_dir=spec.model if method in ("eagle3", "mlp_speculator") else None,
                       free_bytes=free_bytes)
