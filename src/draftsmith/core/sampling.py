"""Logits → probabilities, the residual distribution, and drawing a token.

Kept separate as in gpt-fast ``generate.py`` (``logits_to_probs`` / ``sample``): the speculative
verifier needs the probabilities themselves (p for the target, q for the draft), not only samples.
Temperature 0 (greedy) is NOT handled here: callers take ``argmax`` of the logits instead.
"""

from __future__ import annotations

import torch


def logits_to_probs(
    logits: torch.Tensor,
    temperature: float = 1.0,
    top_k: int | None = None,
    top_p: float | None = None,
    min_p: float | None = None,
) -> torch.Tensor:
    """Softmax of ``logits / temperature`` restricted by min-p, then to the top-k, then to the top-p nucleus.

    Args:
        logits: ``[..., V]``; any float dtype (computed in float32).
        temperature: > 0. Greedy decoding (temperature 0) is the caller's job (``argmax``).
        top_k: keep the ``top_k`` largest logits; ``None`` or 0 disables (ties at the k-th value
            are all kept).
        top_p: keep the smallest set of most likely tokens whose mass reaches ``top_p`` (the most
            likely token is always kept); ``None`` or 1.0 disables. Applied after top-k, the order
            of transformers' logits processors and vLLM's sampler.
        min_p: drop tokens whose probability (after temperature) is below ``min_p`` times the most likely one's;
            ``None`` or 0 disables. As vLLM's ``MinPLogitsProcessor`` (``vllm/v1/sample/logits_processor/
            builtin.py``), applied after temperature and before top-k / top-p (``vllm/v1/sample/sampler.py``).

    Returns:
        probs ``[..., V]`` float32, summing to 1 over the last dimension.

    Raises:
        ValueError: temperature <= 0, top_k < 0, top_p outside (0, 1], or min_p outside [0, 1].
    """
    if temperature <= 0:
        raise ValueError(f"temperature must be > 0 here, got {temperature}; use argmax for greedy decoding")
    if top_k is not None and top_k < 0:
        raise ValueError(f"top_k must be >= 0 (0 or None disables it), got {top_k}")
    if top_p is not None and not 0.0 < top_p <= 1.0:
        raise ValueError(f"top_p must be in (0, 1], got {top_p}")
    if min_p is not None and not 0.0 <= min_p <= 1.0:
        raise ValueError(f"min_p must be in [0, 1], got {min_p}")
    logits = logits.float() / temperature
    if min_p:
        probs = torch.softmax(logits, dim=-1)
        floor = probs.amax(dim=-1, keepdim=True) * min_p
        logits = logits.masked_fill(probs < floor, float("-inf"))
    if top_k and top_k < logits.shape[-1]:
        kth = torch.topk(logits, top_k, dim=-1).values[..., -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    probs = torch.softmax(logits, dim=-1)
    if top_p is not None and top_p < 1.0:
        sorted_probs, order = torch.sort(probs, dim=-1, descending=True)
        mass_before = sorted_probs.cumsum(dim=-1) - sorted_probs  # mass of strictly more likely tokens
        drop_sorted = mass_before >= top_p
        drop_sorted[..., 0] = False  # the most likely token stays, even for a top_p that is 0.0 in float32 (1e-300)
        drop = drop_sorted.scatter(-1, order, drop_sorted)
        probs = probs.masked_fill(drop, 0.0)
        probs = probs / probs.sum(dim=-1, keepdim=True)
    return probs


def residual_probs(p: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
    """The rejection distribution norm(max(p − q, 0)) of speculative sampling (Leviathan et al. 2023).

    Args:
        p: ``[..., V]`` target probabilities; q: ``[..., V]`` draft probabilities (same shape).

    Returns:
        ``[..., V]`` float32. Where max(p − q, 0) sums to 0 (p ≤ q everywhere, i.e. p == q up to
        rounding — a rejection then had probability ~0) the row falls back to p, the exact limit.
    """
    p = p.float()
    residual = (p - q.float()).clamp_min(0.0)
    mass = residual.sum(dim=-1, keepdim=True)
    return torch.where(mass > 0, residual / mass.clamp_min(torch.finfo(torch.float32).tiny), p)


DRAFT_SEED_OFFSET = 0x9E3779B97F4A7C15  # request seed + offset seeds the drafter's sampling generator


def draft_seed(seed: int | None) -> int | None:
    """The drafter's sampling seed for a request seeded ``seed``: offset, so that the drafter's generator does not
    replay the target's random stream (same seed -> correlated draws); None stays None (nondeterministic)."""
    return None if seed is None else (int(seed) + DRAFT_SEED_OFFSET) % 2**63


def seeded_generator(device: torch.device | str, seed: int | None) -> torch.Generator:
    """A sampling generator on ``device``: ``manual_seed(seed)``, or for ``seed`` None one seeded from the OS
    (nondeterministic), never torch's fixed default seed (two unseeded samplers would draw alike)."""
    generator = torch.Generator(device=device)
    if seed is None:
        generator.seed()
    else:
        generator.manual_seed(seed)
    return generator


def sample(probs: torch.Tensor, generator: torch.Generator | None = None) -> torch.Tensor:
    """Draw one token per row of ``probs`` ``[..., V]``; returns int64 ``[...]`` (a 0-d tensor for ``[V]``).

    Uses ``torch.multinomial`` with ``generator`` (on the probs' device) for reproducibility.
    """
    flat = probs.reshape(-1, probs.shape[-1])
    tokens = torch.multinomial(flat, num_samples=1, generator=generator)  # [R, 1]
    return tokens.reshape(probs.shape[:-1])
