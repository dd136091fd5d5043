"""Verification of k drafted tokens against one target forward: pure functions, tensors in, tokens out.

Notation (Leviathan et al. 2023; transformers ``generation/utils.py::_speculative_sampling``): the
target read [x, d1..dk] and gave p ``[k+1, V]``: row i is the target's distribution for the token
after d_i (row 0: after x, the last emitted token), so p[i] judges draft d_{i+1} and p[k] gives the
bonus token. q ``[k, V]``: the draft distributions the d_i were drawn from. n: drafts accepted.
Both functions return ``(emitted [n+1] int64, n)``: the n accepted drafts plus one target token,
so every verify pass emits at least one token (k = 0 degenerates to ordinary decoding).
Modelled on gpt-fast ``generate.py::speculative_decode``.
"""

from __future__ import annotations

import torch

from draftsmith.core.sampling import residual_probs, sample


def _check(draft_tokens: torch.Tensor, p: torch.Tensor) -> int:
    if draft_tokens.dim() != 1:
        raise ValueError(f"draft_tokens must be 1-D [k], got shape {tuple(draft_tokens.shape)}")
    k = draft_tokens.numel()
    if p.dim() != 2 or p.shape[0] != k + 1:
        raise ValueError(f"target rows must be [k+1, V] = [{k + 1}, V], got shape {tuple(p.shape)}")
    return k


def verify_greedy(draft_tokens: torch.Tensor, target_logits: torch.Tensor) -> tuple[torch.Tensor, int]:
    """Greedy verification: accept the longest prefix where d_i == argmax p[i-1].

    Args:
        draft_tokens: ``[k]`` int64 (k may be 0).
        target_logits: ``[k+1, V]`` target logits (or probabilities: only the argmax is used).

    Returns:
        ``(emitted, n)``: emitted ``[n+1]`` int64 = d_1..d_n followed by the target's argmax at row n
        (the correction when d_{n+1} was rejected, the bonus token when n == k).

    Raises:
        ValueError: shapes inconsistent with ``[k]`` / ``[k+1, V]``.
    """
    k = _check(draft_tokens, target_logits)
    target_tokens = target_logits.argmax(dim=-1)  # [k+1]
    matches = draft_tokens.to(target_tokens.device) == target_tokens[:k]  # [k]
    n = int(matches.long().cumprod(dim=0).sum()) if k else 0
    # The accepted drafts equal the target's argmax, so the emitted chunk is the argmax prefix.
    return target_tokens[: n + 1].clone(), n


def verify_sampling(
    draft_tokens: torch.Tensor, q: torch.Tensor | None, p: torch.Tensor, generator: torch.Generator | None = None
) -> tuple[torch.Tensor, int]:
    """Speculative (rejection) sampling: the emitted tokens are distributed exactly as sampling from p.

    Steps:
      1. For i = 1..k accept d_i with probability min(1, p[i-1](d_i) / q[i-1](d_i)) (one uniform each).
      2. At the first rejection (draft n+1), draw the replacement from norm(max(p[n] − q[n], 0)).
      3. If all k were accepted, draw a bonus token from p[k].

    Args:
        draft_tokens: ``[k]`` int64 (k may be 0), drawn from q.
        q: ``[k, V]`` draft probabilities over the TARGET vocabulary, or ``None`` for deterministic
            proposers (n-gram, greedy drafts): q is then one-hot at each draft, so acceptance is
            p(d) and the residual is p with d removed.
        p: ``[k+1, V]`` target probabilities (temperature / top-k / top-p already applied).
        generator: for the uniforms and the final draw (on p's device).

    Returns:
        ``(emitted [n+1] int64, n)``.

    Raises:
        ValueError: inconsistent shapes, or a draft with q(d) == 0 (it cannot have been drawn from q:
            the proposer sampled with different settings than the q it returned).
    """
    k = _check(draft_tokens, p)
    p = p.float()
    draft_tokens = draft_tokens.to(p.device)
    rows = torch.arange(k, device=p.device)
    p_draft = p[rows, draft_tokens]  # [k]
    if q is None:
        q_draft = torch.ones_like(p_draft)
    else:
        if q.shape != (k, p.shape[1]):
            raise ValueError(f"q must be [k, V] = [{k}, {p.shape[1]}], got shape {tuple(q.shape)}")
        q = q.float().to(p.device)
        q_draft = q[rows, draft_tokens]
        if bool((q_draft <= 0).any()):
            raise ValueError("a draft token has q(d) == 0: drafts must be sampled from the q the proposer returns")
    uniforms = torch.rand(k, generator=generator, device=p.device)
    accepted = uniforms < p_draft / q_draft  # accept w.p. min(1, p/q)
    n = int(accepted.long().cumprod(dim=0).sum()) if k else 0
    if n == k:
        last = sample(p[k], generator)  # bonus token
    else:
        q_n = torch.nn.functional.one_hot(draft_tokens[n], p.shape[1]).float() if q is None else q[n]
        last = sample(residual_probs(p[n], q_n), generator)  # replacement token
    return torch.cat([draft_tokens[:n], last.reshape(1)]), n
