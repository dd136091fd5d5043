"""Accept/reject with stub logits (always / never / sometimes), and the sampling verifier's distribution."""

from __future__ import annotations

import pytest
import torch
from scipy.stats import chisquare

from draftsmith.core import verify
from draftsmith.core.sampling import logits_to_probs, residual_probs, sample
from draftsmith.core.verify import verify_greedy, verify_sampling

V = 10


def _stub_logits(target_tokens: list[int]) -> torch.Tensor:
    """[len, V] logits whose argmax at row i is target_tokens[i]."""
    logits = torch.zeros(len(target_tokens), V)
    logits[torch.arange(len(target_tokens)), torch.tensor(target_tokens)] = 5.0
    return logits


@pytest.mark.parametrize(
    "drafts, targets, n",
    [
        ([3, 4, 5, 6], [3, 4, 5, 6, 7], 4),  # always accept: bonus token 7
        ([1, 4, 5, 6], [3, 4, 5, 6, 7], 0),  # never accept: first draft wrong
        ([3, 4, 9, 6], [3, 4, 5, 6, 7], 2),  # accept 2 of 4: correction 5
        ([], [8], 0),  # k = 0: one target token
    ],
)
def test_verify_greedy(drafts, targets, n):
    emitted, accepted = verify_greedy(torch.tensor(drafts, dtype=torch.long), _stub_logits(targets))
    assert accepted == n
    assert emitted.tolist() == targets[: n + 1]
    assert emitted.dtype == torch.long


def test_verify_greedy_rejects_bad_shapes():
    with pytest.raises(ValueError, match=r"\[k\+1, V\]"):
        verify_greedy(torch.tensor([1, 2]), _stub_logits([1, 2]))


def _one_hot_rows(tokens: list[int]) -> torch.Tensor:
    return torch.nn.functional.one_hot(torch.tensor(tokens), V).float()


def test_verify_sampling_deterministic_cases():
    g = torch.Generator().manual_seed(0)
    drafts = torch.tensor([3, 4, 5])
    # always accept: p puts all mass on the drafts; bonus from p[k]
    emitted, n = verify_sampling(drafts, _one_hot_rows([3, 4, 5]), _one_hot_rows([3, 4, 5, 7]), g)
    assert (emitted.tolist(), n) == ([3, 4, 5, 7], 3)
    # accept 2 of 3: p[2](5) == 0 -> rejected; residual is p[2] = one-hot 9
    emitted, n = verify_sampling(drafts, _one_hot_rows([3, 4, 5]), _one_hot_rows([3, 4, 9, 7]), g)
    assert (emitted.tolist(), n) == ([3, 4, 9], 2)
    # never accept, q = None (one-hot): p[0](3) == 0
    emitted, n = verify_sampling(drafts, None, _one_hot_rows([1, 4, 5, 7]), g)
    assert (emitted.tolist(), n) == ([1], 0)
    # k = 0: one token from p[0]
    emitted, n = verify_sampling(torch.empty(0, dtype=torch.long), None, _one_hot_rows([6]), g)
    assert (emitted.tolist(), n) == ([6], 0)


def test_verify_sampling_refuses_draft_outside_q():
    with pytest.raises(ValueError, match=r"q\(d\) == 0"):
        verify_sampling(torch.tensor([2]), _one_hot_rows([3]), _one_hot_rows([3, 3]))


def _first_token_pvalue(
    p: torch.Tensor,
    q: torch.Tensor | None,
    trials: int,
    seed: int,
    fixed_drafts: torch.Tensor | None = None,
    position: int = 0,
) -> float:
    """Chi-square p-value of emitted[position] against p[position] over many verify calls."""
    g = torch.Generator().manual_seed(seed)
    k = p.shape[0] - 1
    if fixed_drafts is None:
        drafts = torch.stack([torch.multinomial(q, 1, replacement=True, generator=g)[:, 0] for _ in range(trials)])
    else:
        drafts = fixed_drafts.expand(trials, k)
    counts = torch.zeros(p.shape[1])
    for t in range(trials):
        emitted, _ = verify_sampling(drafts[t], q, p, g)
        counts[emitted[position]] += 1
    return float(chisquare(counts.numpy(), (p[position] * trials).numpy()).pvalue)


@pytest.fixture
def pq():
    torch.manual_seed(1234)
    dirichlet = torch.distributions.Dirichlet(torch.ones(6))
    return dirichlet.sample((4,)), dirichlet.sample((3,))  # p [k+1, 6], q [k, 6], k = 3


def test_sampling_first_token_follows_p(pq):
    p, q = pq
    assert _first_token_pvalue(p, q, trials=20000, seed=0) > 1e-3


def test_sampling_with_one_hot_q_follows_p(pq):
    p, _ = pq
    assert _first_token_pvalue(p, None, trials=20000, seed=1, fixed_drafts=torch.tensor([2, 0, 5])) > 1e-3


def test_sampling_bonus_token_follows_p(pq):
    p, _ = pq
    q = p[:1].clone()  # q == p: the draft is always accepted
    assert _first_token_pvalue(p[:2], q, trials=20000, seed=2, position=1) > 1e-3


def test_chi_square_catches_a_wrong_sampler(pq, monkeypatch):
    """Resampling from p instead of norm(max(p - q, 0)) after a rejection is biased: the test must fail."""
    monkeypatch.setattr(verify, "residual_probs", lambda p, q: p)
    p, q = pq
    assert _first_token_pvalue(p, q, trials=20000, seed=0) < 1e-3


def test_logits_to_probs_truncation():
    logits = torch.tensor([[3.0, 2.0, 1.0, 0.0, -1.0]])
    torch.testing.assert_close(logits_to_probs(logits, 1.0), torch.softmax(logits, -1))
    torch.testing.assert_close(logits_to_probs(logits, 0.5), torch.softmax(logits / 0.5, -1))
    top2 = logits_to_probs(logits, 1.0, top_k=2)
    assert (top2[0, 2:] == 0).all() and torch.isclose(top2.sum(), torch.tensor(1.0))
    full = torch.softmax(logits, -1)[0]  # ~[.64, .24, .09, .03, .01]
    nucleus = logits_to_probs(logits, 1.0, top_p=0.8)  # .64 < .8 <= .64 + .24
    assert (nucleus[0, :2] > 0).all() and (nucleus[0, 2:] == 0).all()
    torch.testing.assert_close(nucleus[0, :2], full[:2] / full[:2].sum())
    assert (logits_to_probs(logits, 1.0, top_p=0.01)[0, 1:] == 0).all()  # the top token always stays
    for bad in [dict(temperature=0.0), dict(top_k=-1), dict(top_p=0.0), dict(top_p=1.5)]:
        with pytest.raises(ValueError):
            logits_to_probs(logits, **{"temperature": 1.0, **bad})


def test_residual_probs_and_fallback():
    p = torch.tensor([0.5, 0.3, 0.2])
    q = torch.tensor([0.2, 0.6, 0.2])
    torch.testing.assert_close(residual_probs(p, q), torch.tensor([1.0, 0.0, 0.0]))
    torch.testing.assert_close(residual_probs(p, p), p)  # residual mass 0 -> p


def test_sample_shapes():
    g = torch.Generator().manual_seed(0)
    assert sample(torch.tensor([0.0, 1.0]), g).shape == ()
    assert sample(torch.full((2, 3, 4), 0.25), g).shape == (2, 3)
