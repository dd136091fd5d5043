"""The runtime's first test: speculative greedy output == the target's own greedy output, for every drafter
(n-gram, draft models, a random one), plus stops inside accepted chunks and the speculation counters."""
from __future__ import annotations

import copy

import pytest
import torch

from draftsmith.inference.generate import GenerationConfig, SpecStats, generate_plain, generate_speculative
from draftsmith.inference.proposers import DraftModelProposer, NgramProposer, Proposal, Proposer
from draftsmith.inference.target import TargetModel

PROMPTS = [
    [5, 6, 7, 8, 5, 6, 7, 8, 5, 6],          # repetitive: n-gram lookup has something to find
    [20, 21, 22, 20, 21, 22, 20],
    list(range(10, 30)),
    [9, 9, 9, 9, 9],
    [42],
]


@pytest.fixture
def target(tiny_llama) -> TargetModel:
    return TargetModel(tiny_llama(seed=0))


@pytest.fixture
def plain(target):
    """Plain greedy outputs of the target, 30 tokens per prompt."""
    return [generate_plain(target, p, GenerationConfig(max_new_tokens=30)).tokens for p in PROMPTS]


def _noisy_copy(model, scale: float = 0.005, seed: int = 5):
    """A draft that agrees with the target often but not always."""
    draft = copy.deepcopy(model)
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for param in draft.parameters():
            param.add_(scale * torch.randn(param.shape, generator=gen))
    return draft


class RandomProposer(Proposer):
    """Proposes k uniformly random tokens (q None): garbage that must not change greedy output."""

    def __init__(self, vocab_size: int, seed: int = 0):
        self.vocab_size, self.generator = vocab_size, torch.Generator().manual_seed(seed)

    def propose(self, k: int) -> Proposal:
        return Proposal(torch.randint(0, self.vocab_size, (k,), generator=self.generator))

    def accept(self, n_accepted, emitted, target_step) -> None:
        pass


class OracleProposer(Proposer):
    """Proposes the known continuation: every draft is accepted."""

    def __init__(self, continuation: list[int]):
        self.continuation, self.emitted = continuation, 0

    def start(self, prompt_ids, first_token, target_step) -> None:
        self.emitted = 1

    def propose(self, k: int) -> Proposal:
        return Proposal(torch.tensor(self.continuation[self.emitted:self.emitted + k], dtype=torch.long))

    def accept(self, n_accepted, emitted, target_step) -> None:
        self.emitted += emitted.numel()


def test_plain_matches_transformers_generate(target):
    prompt = torch.tensor(PROMPTS[2])
    ours = generate_plain(target, prompt, GenerationConfig(max_new_tokens=12))
    with torch.no_grad():
        hf = target.model.generate(prompt[None], max_new_tokens=12, do_sample=False, eos_token_id=None,
                                   pad_token_id=0)
    assert ours.tokens == hf[0, prompt.numel():].tolist()
    assert (ours.finish_reason, ours.num_target_forwards) == ("length", 12)


def _proposer(name: str, target: TargetModel, make_tiny_llama) -> Proposer:
    if name == "ngram":
        return NgramProposer(prompt_lookup_min=1, prompt_lookup_max=3)
    if name == "draft_random":                                   # different seed, same vocab
        return DraftModelProposer(make_tiny_llama(seed=1, num_hidden_layers=2), target.vocab_size)
    if name == "draft_close":
        return DraftModelProposer(_noisy_copy(target.model), target.vocab_size)
    return RandomProposer(target.vocab_size)


@pytest.mark.parametrize("k", [1, 3, 5])
@pytest.mark.parametrize("name", ["ngram", "draft_random", "draft_close", "random"])
def test_speculative_greedy_equals_plain_greedy(target, plain, tiny_llama, name, k):
    proposer = _proposer(name, target, tiny_llama)
    total = SpecStats(k=k)
    for prompt, expected in zip(PROMPTS, plain):
        result = generate_speculative(target, proposer, prompt, GenerationConfig(max_new_tokens=30), k)
        assert result.tokens == expected, f"prompt {prompt}"
        assert result.finish_reason == "length"
        total = total.merge(result.stats)
    assert total.num_drafts > 0
    if name in ("ngram", "draft_close"):                          # not vacuous: drafts were accepted
        assert total.num_accepted_tokens > 0, total
        assert total.acceptance_length > 1.0


def test_k0_is_plain_decoding(target, plain):
    result = generate_speculative(target, NgramProposer(), PROMPTS[0], GenerationConfig(max_new_tokens=30), k=0)
    assert result.tokens == plain[0]
    assert result.num_target_forwards == 30 and result.stats.num_drafts == 0


def test_oracle_accepts_everything(target, plain):
    k = 4
    result = generate_speculative(target, OracleProposer(plain[2]), PROMPTS[2], GenerationConfig(max_new_tokens=30), k)
    assert result.tokens == plain[2]
    assert result.stats.acceptance_rate == 1.0
    # 29 tokens after the prefill's: five steps of 4 drafts + bonus, then 3 drafts + bonus (never past 30)
    assert result.stats.accepted_per_pos == [6, 6, 6, 5] and result.stats.num_draft_tokens == 23
    assert result.num_target_forwards == 1 + 6


def test_eos_inside_an_accepted_chunk_trims_there(target, plain):
    expected = plain[2]
    eos = expected[3]                                            # inside the first verify chunk (tokens 1..6)
    cut = expected.index(eos) + 1
    cfg = GenerationConfig(max_new_tokens=30, eos_token_ids=[eos])
    result = generate_speculative(target, OracleProposer(expected), PROMPTS[2], cfg, k=5)
    assert result.tokens == expected[:cut] and result.finish_reason == "stop"
    emitted_by_verify = 1 + result.stats.num_accepted_tokens + result.stats.num_drafts
    assert emitted_by_verify > len(result.tokens)                # the chunk went past the EOS, the output did not
    assert generate_plain(target, PROMPTS[2], cfg).tokens == expected[:cut]
    stop = GenerationConfig(max_new_tokens=30, stop_token_ids=[eos])
    assert generate_speculative(target, NgramProposer(), PROMPTS[2], stop, k=3).tokens == expected[:cut]


@pytest.mark.parametrize("max_new_tokens", [0, 1, 2, 5, 6, 7, 11])
def test_max_new_tokens_never_overshoots(target, plain, max_new_tokens):
    cfg = GenerationConfig(max_new_tokens=max_new_tokens)
    result = generate_speculative(target, OracleProposer(plain[0]), PROMPTS[0], cfg, k=5)
    assert result.tokens == plain[0][:max_new_tokens]
    assert result.finish_reason == "length"


def test_sampling_path_with_top_k_1_equals_greedy(target, plain):
    """top_k = 1 makes p and q one-hot: rejection sampling must reproduce greedy output exactly."""
    cfg = GenerationConfig(max_new_tokens=30, temperature=0.7, top_k=1, seed=3)
    drafts = [NgramProposer(), DraftModelProposer(_noisy_copy(target.model), target.vocab_size,
                                                  temperature=0.7, top_k=1)]
    for proposer in drafts:
        for prompt, expected in zip(PROMPTS[:3], plain[:3]):
            assert generate_speculative(target, proposer, prompt, cfg, k=3).tokens == expected


def test_sampling_is_seeded(target):
    cfg = GenerationConfig(max_new_tokens=20, temperature=1.0, top_p=0.9, seed=7)
    runs = [generate_speculative(target, DraftModelProposer(_noisy_copy(target.model), 96, temperature=1.0,
                                                            top_p=0.9, seed=1), PROMPTS[0], cfg, k=3)
            for _ in range(2)]
    assert runs[0].tokens == runs[1].tokens and len(runs[0].tokens) == 20
    assert all(0 <= t < 96 for t in runs[0].tokens)
    assert generate_plain(target, PROMPTS[0], cfg).tokens == generate_plain(target, PROMPTS[0], cfg).tokens


def test_contract_violations_are_refused(target):
    class TooMany(RandomProposer):
        def propose(self, k):
            return Proposal(torch.zeros(k + 1, dtype=torch.long))

    with pytest.raises(ValueError, match=r"TooMany.propose\(3\)"):
        generate_speculative(target, TooMany(96), PROMPTS[0], GenerationConfig(max_new_tokens=10), k=3)

    class NeedsAux(RandomProposer):
        needs_aux_hidden = True

    with pytest.raises(ValueError, match="aux_layer_ids"):
        generate_speculative(target, NeedsAux(96), PROMPTS[0], GenerationConfig(max_new_tokens=10), k=3)
    with pytest.raises(ValueError, match="k must be"):
        generate_speculative(target, NgramProposer(), PROMPTS[0], GenerationConfig(), k=-1)


def test_aux_hidden_reaches_the_proposer(tiny_llama):
    """The verify pass's TargetStep (with aux states for rows 0..n) is what accept() receives."""
    seen = []

    class Recording(RandomProposer):
        needs_aux_hidden = True

        def start(self, prompt_ids, first_token, target_step):
            seen.append((prompt_ids.numel(), target_step.aux_hidden.shape))

        def accept(self, n_accepted, emitted, target_step):
            seen.append((n_accepted, target_step.aux_hidden.shape))

    target = TargetModel(tiny_llama(num_hidden_layers=6), aux_layer_ids=(1, 3, 4))
    generate_speculative(target, Recording(96), [1, 2, 3, 4], GenerationConfig(max_new_tokens=6), k=2)
    assert seen[0] == (4, (4, 96))
    assert len(seen) > 1
    assert all(shape[1] == 96 and n + 1 <= shape[0] <= 3 for n, shape in seen[1:])   # rows 0..n are there


def test_spec_stats():
    stats = SpecStats(k=3)
    stats.record(3, 2)
    stats.record(0, 0)                                           # proposing nothing is not a draft
    stats.record(2, 0)
    assert (stats.num_drafts, stats.num_draft_tokens, stats.num_accepted_tokens) == (2, 5, 2)
    assert stats.accepted_per_pos == [1, 1, 0]
    assert stats.acceptance_rate == pytest.approx(2 / 5)
    assert stats.acceptance_length == pytest.approx(1 + 2 / 2)
    assert SpecStats(k=2).acceptance_length == 1.0 and SpecStats(k=2).acceptance_rate == 0.0
    merged = stats.merge(SpecStats(k=4, num_drafts=1, num_draft_tokens=4, num_accepted_tokens=4,
                                   accepted_per_pos=[1, 1, 1, 1]))
    assert merged.accepted_per_pos == [2, 2, 1, 1] and merged.num_drafts == 3


def _pooled_pvalue(counts: torch.Tensor, expected: torch.Tensor) -> float:
    """Chi-square p-value with the cells expecting < 5 pooled into one."""
    from scipy.stats import chisquare

    small = expected < 5
    obs, exp = counts[~small], expected[~small]
    if small.any():
        obs = torch.cat([obs, counts[small].sum().reshape(1)])
        exp = torch.cat([exp, expected[small].sum().reshape(1)])
    return float(chisquare(obs.numpy(), exp.numpy() * obs.sum().item() / exp.sum().item()).pvalue)


def test_speculative_sampling_follows_the_target_distribution(tiny_llama):
    """End to end on an 8-token vocab: (t1, t2) and t3 of speculative sampling vs the target's exact law."""
    temperature, prompt, trials = 0.05, [1, 2, 3], 2000
    model = tiny_llama(vocab_size=8, num_hidden_layers=1, seed=0)
    target = TargetModel(model)
    draft = DraftModelProposer(tiny_llama(vocab_size=8, num_hidden_layers=1, seed=3), 8, temperature=temperature)
    # exact law of three tokens: p(t1) p(t2 | t1) p(t3 | t1 t2), from one batched forward over all 64 prefixes
    prefixes = torch.cartesian_prod(torch.arange(8), torch.arange(8))                     # [64, 2]
    with torch.no_grad():
        logits = model(torch.cat([torch.tensor(prompt).expand(64, 3), prefixes], dim=1)).logits
    probs = torch.softmax(logits.float() / temperature, dim=-1)                          # [64, 5, 8]
    joint = probs[0, 2][:, None, None] * probs[::8, 3][:, :, None] * probs[:, 4].reshape(8, 8, 8)
    counts = torch.zeros(8, 8, 8)
    stats = SpecStats(k=1)
    for seed in range(trials):
        result = generate_speculative(target, draft, prompt, GenerationConfig(max_new_tokens=3, temperature=temperature,
                                                                              seed=seed), k=1)
        counts[tuple(result.tokens)] += 1
        stats = stats.merge(result.stats)
    assert 0.1 < stats.acceptance_rate < 0.9                      # both accept and reject paths ran
    assert _pooled_pvalue(counts.sum(2).flatten(), trials * joint.sum(2).flatten()) > 1e-3
    assert _pooled_pvalue(counts.sum((0, 1)), trials * joint.sum((0, 1))) > 1e-3
