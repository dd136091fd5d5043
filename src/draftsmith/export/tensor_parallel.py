"""Will a head (and its target) shard over N tensor-parallel ranks? Checked before serving with TP.

vLLM and SGLang split attention heads, KV heads (replicated when fewer than N, if N is a multiple of
them) and the MLP's intermediate size across ranks (vLLM ``ColumnParallelLinear`` /
``QKVParallelLinear``); a head whose sizes do not divide fails at load time there, on the GPU box.
"""

from __future__ import annotations


def tensor_parallel_problems(config: dict, tp_size: int, what: str = "head") -> list[str]:
    """Problems (empty when fine) of sharding ``config`` (head or target config dict) over ``tp_size`` ranks."""
    if tp_size < 1:
        raise ValueError(f"tensor parallel size must be >= 1, got {tp_size}")
    problems = []
    heads = config.get("num_attention_heads")
    kv = config.get("num_key_value_heads") or heads
    inter = config.get("intermediate_size")
    if heads is not None and heads % tp_size:
        problems.append(f"{what}: num_attention_heads {heads} is not divisible by tensor_parallel_size {tp_size}")
    if kv is not None and kv % tp_size and tp_size % kv:
        problems.append(
            f"{what}: num_key_value_heads {kv} neither divides nor is divisible by tensor_parallel_size {tp_size}"
        )
    if inter is not None and inter % tp_size:
        problems.append(f"{what}: intermediate_size {inter} is not divisible by tensor_parallel_size {tp_size}")
    return problems
