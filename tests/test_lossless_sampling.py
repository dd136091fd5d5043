"""Speculative sampling is lossless, end to end, for every drafter: chi-square tests against the target's law.

The target is a stub causal LM with an 8-token vocabulary whose next-token logits are a fixed random table
indexed by the last two tokens (``TrigramLM``). It keeps those tokens in a real transformers ``DynamicCache``
through ``inference/cache.py``, so a wrong rollback changes its outputs. Its exact law of the first
``NEW`` tokens after the prompt is a product of table rows, computed here without sampling.

For T in {0.5, 1.0} (plus one top-k/top-p case), plain sampling and speculative sampling with each method
(n-gram: one-hot q; draft model: sampled q; EAGLE-3: q on a 6-token draft vocab scattered through d2t;
MLP speculator: sampled q from stages rooted at the target's final hidden state)
each decode ``TRIALS`` seeded sequences. For every adjacent pair of positions (t_i, t_{i+1}) the counts are
tested (scipy, cells expecting < 5 pooled) against the exact law AND against the plain-sampling counts
(two-sample homogeneity). Threshold: a test fails when p < ``ALPHA`` = 1e-3. Seeds are fixed, so the
outcome is deterministic; ``test_chi_square_has_power`` shows the same test rejects a biased sampler.
"""
from __future__ import annotations

import math
from types import SimpleNamespace

import pytest
import torch
from scipy.stats import chi2_contingency, chisquare
from torch import nn
from transformers import PretrainedConfig

from draftsmith.inference import verify
from draftsmith.inference.generate import GenerationConfig, SpecStats, generate_plain, generate_speculative
from draftsmith.inference.proposers import DraftModelProposer, NgramProposer
from draftsmith.inference.proposers.eagle3 import Eagle3Proposer
from draftsmith.inference.sampling import logits_to_probs
from draftsmith.inference.target import TargetModel

V, H, LAYERS = 8, 16, 3
K, NEW = 3, 5                                    # one verify pass covers t2..t5 when all 3 drafts are accepted
TRIALS = 2000
ALPHA = 1e-3


class TrigramLM(nn.Module):
    """Stub causal LM: logits after token x_t are ``table[x_{t-1}, x_t]`` (x_{-1} = 0), for a [V, V, V] table.

    Called like a transformers causal LM by ``TargetModel``: ``model(input_ids=[1, T], position_ids,
    output_hidden_states, cache=DynamicCache)``. The tokens read so far are stored as the keys of every cache
    layer, so the previous token comes from the cache (a bad crop shows). ``hidden_states`` (LAYERS + 1 tensors
    [1, T, H]) are fixed random embeddings of each token per layer, enough to drive an EAGLE-3 head.
    """

    def __init__(self, table: torch.Tensor, seed: int = 0):
        super().__init__()
        self.config = PretrainedConfig(vocab_size=V, hidden_size=H, num_hidden_layers=LAYERS,
                                       max_position_embeddings=64)
        gen = torch.Generator().manual_seed(seed)
        self.table = table
        self.embed = nn.Embedding(V, H)
        self.lm_head = nn.Linear(H, V, bias=False)
        self.layer_states = nn.Parameter(torch.randn(LAYERS + 1, V, H, generator=gen), requires_grad=False)

    def get_input_embeddings(self):
        return self.embed

    def get_output_embeddings(self):
        return self.lm_head

    def forward(self, input_ids, position_ids=None, output_hidden_states=False, cache=None, use_cache=True):
        ids = input_ids[0]
        past = cache.layers[0].keys[0, 0, :, 0].long() if cache.get_seq_length() else ids.new_zeros(1)
        prev = torch.cat([past[-1:], ids[:-1]])
        for layer in range(LAYERS):
            keys = ids.float().view(1, 1, -1, 1)
            cache.update(keys, keys, layer)
        hidden = tuple(self.layer_states[i][ids][None] for i in range(LAYERS + 1)) if output_hidden_states else None
        self.lm_head(self.layer_states[LAYERS][ids][None])   # applied once like a real LM's head: the MLP
        # speculator reads its input (TargetModel final_hidden); the logits still come from the table
        return SimpleNamespace(logits=self.table[prev, ids][None], hidden_states=hidden)


def _table(seed: int, scale: float = 1.5) -> torch.Tensor:
    return scale * torch.randn(V, V, V, generator=torch.Generator().manual_seed(seed))


TARGET_TABLE = _table(0)
DRAFT_TABLE = TARGET_TABLE + _table(1, scale=1.0)          # close to the target: drafts accepted often, not always


def _greedy_chain(start: list[int], n: int) -> list[int]:
    seq = list(start)
    for _ in range(n):
        seq.append(int(TARGET_TABLE[seq[-2], seq[-1]].argmax()))
    return seq


# every token occurs (n-gram lookup always finds a 1-gram), then the target's greedy chain, which n-gram
# lookup copies: its drafts are the likeliest tokens, so whole chunks get accepted too
PROMPT = _greedy_chain(list(range(V)), 10)


def exact_law(settings: dict) -> torch.Tensor:
    """P(t1..t_NEW | PROMPT) as a [V] * NEW tensor, from the table with temperature/top-k/top-p applied."""
    p = logits_to_probs(TARGET_TABLE, **settings)                  # [V, V, V]: p[a, b] = law of the token after a, b
    law = p[PROMPT[-2], PROMPT[-1]]                                 # [V]      law of t1
    law = law[:, None] * p[PROMPT[-1]]                              # [V, V]   law of t1 t2
    for _ in range(NEW - 2):                                        # [V] * n  times p[t_{n-1}, t_n, t_{n+1}]
        law = law[..., None] * p.reshape((1,) * (law.dim() - 2) + (V, V, V))
    return law


def _eagle3_head():
    from draftsmith.heads.eagle3 import Eagle3Config, Eagle3Head
    from draftsmith.heads.vocab import build_vocab_map

    cfg = Eagle3Config(hidden_size=H, intermediate_size=2 * H, num_attention_heads=2, num_key_value_heads=1,
                       head_dim=8, vocab_size=V, draft_vocab_size=6, aux_layer_ids=(0, 1, 2),
                       max_position_embeddings=64)
    torch.manual_seed(0)
    head = Eagle3Head(cfg).eval()
    vmap = build_vocab_map(torch.arange(V).flip(0), 6)                         # target ids 6, 7 are not drafted
    head.set_vocab_map(vmap.d2t, vmap.t2d)
    return head


def _mlp_speculator():
    from draftsmith.heads.mlp_speculator import MLPSpeculator, MLPSpeculatorConfig

    torch.manual_seed(0)
    return MLPSpeculator(MLPSpeculatorConfig(vocab_size=V, emb_dim=H, inner_dim=2 * H, n_predict=K)).eval()


def make_proposer(method: str, target: TargetModel, settings: dict):
    """A fresh proposer drawing its drafts with the same temperature / top-k / top-p as the target."""
    if method == "mlp_speculator":
        from draftsmith.inference.proposers.mlp_speculator import MLPSpeculatorProposer

        return MLPSpeculatorProposer(_mlp_speculator(), seed=12345, **settings)
    if method == "ngram":
        return NgramProposer(prompt_lookup_min=1, prompt_lookup_max=3)
    if method == "draft_model":
        return DraftModelProposer(TrigramLM(DRAFT_TABLE), V, seed=12345, **settings)
    if method == "self_draft":
        return DraftModelProposer(target.model, V, seed=12345, **settings)
    head = _eagle3_head()
    head.bind_embedding(target.model.get_input_embeddings())
    return Eagle3Proposer(head, seed=12345, **settings)


def run(method: str, settings: dict, trials: int = TRIALS) -> tuple[torch.Tensor, SpecStats]:
    """Sequences ``[trials, NEW]`` decoded with target seeds 0..trials-1, and the summed speculation counters."""
    target = TargetModel(TrigramLM(TARGET_TABLE), aux_layer_ids=(0, 1, 2) if method == "eagle3" else None)
    proposer = None if method == "plain" else make_proposer(method, target, settings)
    stats = SpecStats(k=K)
    out = torch.empty(trials, NEW, dtype=torch.long)
    for seed in range(trials):
        cfg = GenerationConfig(max_new_tokens=NEW, seed=seed, **settings)
        if proposer is None:
            result = generate_plain(target, PROMPT, cfg)
        else:
            result = generate_speculative(target, proposer, PROMPT, cfg, K)
            stats = stats.merge(result.stats)
        out[seed] = torch.tensor(result.tokens)
    return out, stats


def pooled_pvalue(counts: torch.Tensor, expected: torch.Tensor) -> float:
    """One-sample chi-square p-value; cells expecting < 5 are pooled into one, impossible cells (expected 0,
    e.g. cut by top-k) must be empty and are left out."""
    counts, expected = counts.flatten().double(), expected.flatten().double()
    assert counts[expected == 0].sum() == 0, "a token the law excludes was sampled"
    counts, expected = counts[expected > 0], expected[expected > 0]
    small = expected < 5
    obs, exp = counts[~small], expected[~small]
    if small.any():
        obs = torch.cat([obs, counts[small].sum().reshape(1)])
        exp = torch.cat([exp, expected[small].sum().reshape(1)])
    return float(chisquare(obs.numpy(), exp.numpy() * obs.sum().item() / exp.sum().item()).pvalue)


def homogeneity_pvalue(a: torch.Tensor, b: torch.Tensor, expected: torch.Tensor) -> float:
    """Two-sample chi-square (contingency) p-value of two count tables; rare cells (expected < 5) pooled."""
    a, b, expected = a.flatten().double(), b.flatten().double(), expected.flatten().double()
    a, b, expected = a[expected > 0], b[expected > 0], expected[expected > 0]
    small = expected < 5
    rows = [torch.cat([x[~small], x[small].sum().reshape(1)]) for x in (a, b)]
    table = torch.stack(rows)
    table = table[:, table.sum(0) > 0]
    return float(chi2_contingency(table.numpy()).pvalue)


def pair_counts(seqs: torch.Tensor, i: int) -> torch.Tensor:
    """[V, V] counts of (t_i, t_{i+1}) (0-based positions)."""
    return torch.bincount(seqs[:, i] * V + seqs[:, i + 1], minlength=V * V).reshape(V, V).double()


def pair_law(law: torch.Tensor, i: int) -> torch.Tensor:
    """[V, V] exact law of (t_i, t_{i+1}) from the full law."""
    other = tuple(d for d in range(NEW) if d not in (i, i + 1))
    return law.sum(dim=other) if other else law


def check_counters(stats: SpecStats) -> None:
    """Counters are finite, non-negative and consistent (prefix acceptance: per-position counts decrease)."""
    values = [stats.num_drafts, stats.num_draft_tokens, stats.num_accepted_tokens, *stats.accepted_per_pos]
    assert all(isinstance(v, int) and v >= 0 for v in values), stats
    assert stats.num_accepted_tokens <= stats.num_draft_tokens <= stats.k * stats.num_drafts
    assert sum(stats.accepted_per_pos) == stats.num_accepted_tokens
    assert all(a >= b for a, b in zip(stats.accepted_per_pos, stats.accepted_per_pos[1:]))
    for rate in (stats.acceptance_rate, stats.acceptance_length):
        assert math.isfinite(rate) and rate >= 0
    assert 0 <= stats.acceptance_rate <= 1 and 1 <= stats.acceptance_length <= 1 + stats.k


SETTINGS = {"T=0.5": dict(temperature=0.5), "T=1.0": dict(temperature=1.0),
            "T=1.0,top_k=5,top_p=0.9": dict(temperature=1.0, top_k=5, top_p=0.9)}


@pytest.fixture(scope="module")
def plain_runs():
    """Plain-sampling sequences per setting (computed once; they are the reference sample)."""
    return {name: run("plain", settings)[0] for name, settings in SETTINGS.items()}


@pytest.mark.parametrize("setting", list(SETTINGS))
def test_plain_sampling_follows_the_exact_law(plain_runs, setting):
    law = exact_law(SETTINGS[setting])
    for i in range(NEW - 1):
        assert pooled_pvalue(pair_counts(plain_runs[setting], i), TRIALS * pair_law(law, i)) > ALPHA


@pytest.mark.parametrize("method", ["ngram", "draft_model", "eagle3", "mlp_speculator"])
@pytest.mark.parametrize("setting", ["T=0.5", "T=1.0"])
def test_speculative_sampling_is_lossless(plain_runs, method, setting):
    """Every adjacent pair (t_i, t_i+1), i = 1..4, matches the exact law and plain sampling (p > 1e-3)."""
    seqs, stats = run(method, SETTINGS[setting])
    law = exact_law(SETTINGS[setting])
    check_counters(stats)
    # not vacuous: drafts were made, some accepted, some rejected, and whole chunks accepted (bonus token)
    assert stats.num_drafts >= TRIALS and 0 < stats.num_accepted_tokens < stats.num_draft_tokens
    assert stats.accepted_per_pos[K - 1] > 0
    for i in range(NEW - 1):
        expected = TRIALS * pair_law(law, i)
        assert pooled_pvalue(pair_counts(seqs, i), expected) > ALPHA, f"(t{i + 1}, t{i + 2}) vs the exact law"
        p_two = homogeneity_pvalue(pair_counts(seqs, i), pair_counts(plain_runs[setting], i), expected)
        assert p_two > ALPHA, f"(t{i + 1}, t{i + 2}) vs plain sampling"


def test_top_k_top_p_apply_to_p_and_q(plain_runs):
    """Truncation applied to both p and q (draft model): still the truncated target's law."""
    setting = "T=1.0,top_k=5,top_p=0.9"
    seqs, stats = run("draft_model", SETTINGS[setting])
    check_counters(stats)
    law = exact_law(SETTINGS[setting])
    for i in range(NEW - 1):
        expected = TRIALS * pair_law(law, i)
        assert pooled_pvalue(pair_counts(seqs, i), expected) > ALPHA
        assert homogeneity_pvalue(pair_counts(seqs, i), pair_counts(plain_runs[setting], i), expected) > ALPHA
        assert (pair_counts(seqs, i)[pair_law(law, i) == 0] == 0).all()        # truncated tokens never appear


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
