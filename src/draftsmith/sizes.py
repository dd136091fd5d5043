"""Sizes of models and caches, read from configs and file headers without loading weights (for memory plans).

Shared by ``serve.memory`` (the plan) and the drafters (their own items, ``Drafter.memory``).
"""

from __future__ import annotations

import json
import struct
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM

_SAFETENSORS_DTYPE_BYTES = {
    "F64": 8,
    "F32": 4,
    "F16": 2,
    "BF16": 2,
    "I64": 8,
    "I32": 4,
    "I16": 2,
    "I8": 1,
    "U8": 1,
    "BOOL": 1,
    "F8_E4M3": 1,
    "F8_E5M2": 1,
}


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
                return int(line.split()[1]) * 1024  # kB
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
