"""Speculative sampling is lossless: the decode loop's rejection sampling checked on hand-built proposers.

Every registered drafter is held to the same chi-square tests by ``test_contract.py``
(``test_sampling_is_lossless``); here: plain sampling follows the stub target's exact law, top-k/top-p truncate p
and q alike, the test has power (a biased residual is caught), and a target drafting for itself accepts
everything. The stub target, its exact law and the tests' thresholds are in ``tests/lossless.py``.
"""

from __future__ import annotations

import pytest

from draftsmith.core import verify
from draftsmith.core.generate import GenerationConfig, SpecStats, generate_speculative
from draftsmith.core.target import TargetModel
from draftsmith.drafters.draft_model.proposer import DraftModelProposer
from lossless import (
    ALPHA,
    DRAFT_TABLE,
    NEW,
    TARGET_TABLE,
    TRIALS,
    K,
    TrigramLM,
    V,
    check_counters,
    exact_law,
    homogeneity_pvalue,
    pair_counts,
    pair_law,
    pooled_pvalue,
    run_trials,
)


def make_proposer(method: str, target: TargetModel, settings: dict):
    """A fresh hand-built proposer drawing its drafts with the same temperature / top-k / top-p as the target."""
    if method == "self_draft":
        return DraftModelProposer(target.model, V, seed=12345, **settings)
    return DraftModelProposer(TrigramLM(DRAFT_TABLE), V, seed=12345, **settings)


def run(method: str, settings: dict, trials: int = TRIALS):
    """``lossless.run_trials`` with plain sampling or a hand-built proposer (one per trial)."""
    target = TargetModel(TrigramLM(TARGET_TABLE))
    proposer = None if method == "plain" else make_proposer(method, target, settings)  # one for all trials
    make = None if proposer is None else (lambda seed: proposer)
    return run_trials(target, make, settings, trials)


SETTINGS = {
    "T=0.5": dict(temperature=0.5),
    "T=1.0": dict(temperature=1.0),
    "T=1.0,top_k=5,top_p=0.9": dict(temperature=1.0, top_k=5, top_p=0.9),
}


@pytest.fixture(scope="module")
def plain_runs():
    """Plain-sampling sequences per setting (computed once; they are the reference sample)."""
    return {name: run("plain", settings)[0] for name, settings in SETTINGS.items()}


@pytest.mark.parametrize("setting", list(SETTINGS))
def test_plain_sampling_follows_the_exact_law(plain_runs, setting):
    law = exact_law(SETTINGS[setting])
    for i in range(NEW - 1):
        assert pooled_pvalue(pair_counts(plain_runs[setting], i), TRIALS * pair_law(law, i)) > ALPHA


def test_top_k_top_p_apply_to_p_and_q(plain_runs):
    """Truncation applied to both p and q (draft model): still the truncated target's law."""
    setting = "T=1.0,top_k=5,top_p=0.9"
    seqs, stats = run("draft_model", SETTINGS[setting])
    check_counters(stats)
    assert stats.accepted_per_pos[K - 1] > 0  # whole chains accepted: the bonus token is sampled too
    law = exact_law(SETTINGS[setting])
    for i in range(NEW - 1):
        expected = TRIALS * pair_law(law, i)
        assert pooled_pvalue(pair_counts(seqs, i), expected) > ALPHA
        assert homogeneity_pvalue(pair_counts(seqs, i), pair_counts(plain_runs[setting], i), expected) > ALPHA
        assert (pair_counts(seqs, i)[pair_law(law, i) == 0] == 0).all()  # truncated tokens never appear


def test_chi_square_has_power(monkeypatch):
    """Resampling from p instead of norm(max(p - q, 0)) after a rejection is biased: the same test catches it."""
    monkeypatch.setattr(verify, "residual_probs", lambda p, q: p)
    seqs, _ = run("draft_model", SETTINGS["T=1.0"])
    law = exact_law(SETTINGS["T=1.0"])
    assert min(pooled_pvalue(pair_counts(seqs, i), TRIALS * pair_law(law, i)) for i in range(NEW - 1)) < ALPHA


@pytest.mark.parametrize("temperature", [0.5, 1.0])
def test_target_as_its_own_draft_accepts_everything(temperature):
    """q == p exactly (same model, same settings): accept with min(1, p/q) = 1 every time."""
    _, stats = run("self_draft", dict(temperature=temperature), trials=200)
    check_counters(stats)
    assert stats.acceptance_rate == 1.0 and stats.acceptance_length == 1 + K


def test_target_as_its_own_draft_on_a_transformers_model(tiny_llama):
    """A real tiny Llama drafting for itself: ~100% acceptance (batched vs one-token forwards differ in float
    rounding only)."""
    model = tiny_llama(seed=0, num_hidden_layers=2)
    target = TargetModel(model)
    stats = SpecStats(k=4)
    for seed in range(6):
        proposer = DraftModelProposer(model, target.vocab_size, temperature=1.0, seed=1000 + seed)
        cfg = GenerationConfig(max_new_tokens=24, temperature=1.0, seed=seed)
        stats = stats.merge(generate_speculative(target, proposer, [5, 6, 7, 8, 9], cfg, k=4).stats)
    check_counters(stats)
    assert stats.num_draft_tokens >= 60 and stats.acceptance_rate >= 0.98
