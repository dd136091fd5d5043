"""The runtime's first test: speculative greedy output == the target's own greedy output, for every drafter
(n-gram, draft models, a random one), plus stops inside accepted chunks and the speculation counters."""

from __future__ import annotations

import copy

import pytest
import torch

from draftsmith.core.generate import GenerationConfig, SpecStats, generate_plain, generate_speculative
from draftsmith.core.proposer import Proposal, Proposer
from draftsmith.core.target import TargetModel
from draftsmith.drafters.draft_model.proposer import DraftModelProposer
from draftsmith.drafters.ngram.proposer import NgramProposer

PROMPTS = [
    [5, 6, 7, 8, 5, 6, 7, 8, 5, 6],  # repetitive: n-gram lookup has something to find
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
        return Proposal(torch.tensor(self.continuation[self.emitted : self.emitted + k], dtype=torch.long))

    def accept(self, n_accepted, emitted, target_step) -> None:
        self.emitted += emitted.numel()


def test_plain_matches_transformers_generate(target):
    prompt = torch.tensor(PROMPTS[2])
    ours = generate_plain(target, prompt, GenerationConfig(max_new_tokens=12))
    with torch.no_grad():
        hf = target.model.generate(prompt[None], max_new_tokens=12, do_sample=False, eos_token_id=None, pad_token_id=0)
    assert ours.tokens == hf[0, prompt.numel() :].tolist()
    assert (ours.finish_reason, ours.num_target_forwards) == ("length", 12)


def _random_prompts(n: int, seed: int = 11) -> list[list[int]]:
    """``n`` seeded prompts of 1..24 tokens over ids 2..95; every other one repeats a short pattern (so
    n-gram lookup finds drafts), the rest are uniform noise."""
    gen = torch.Generator().manual_seed(seed)
    prompts = []
    for i in range(n):
        length = int(torch.randint(1, 25, (1,), generator=gen))
        if i % 2:
            pattern = torch.randint(2, 96, (int(torch.randint(1, 5, (1,), generator=gen)),), generator=gen)
            prompts.append(pattern.repeat(length)[:length].tolist())
        else:
            prompts.append(torch.randint(2, 96, (length,), generator=gen).tolist())
    return prompts


GREEDY_PROMPTS = PROMPTS + _random_prompts(45)  # 50 prompts
GREEDY_TOKENS = 12


class ScriptedProposer(Proposer):
    """Drafts from the known greedy continuation, right or wrong per ``script(step, position)``.

    ``expected[prompt]`` is the plain greedy output; a wrong draft is (right + 1) mod V, never the argmax.
    ``pause_after_multi_accept``: after a verify step that accepted >= 2 drafts, the next proposal is empty
    (the loop must then decode one target token from the cropped cache)."""

    def __init__(self, expected: list[int], script, vocab_size: int, pause_after_multi_accept: bool = False):
        self.expected, self.script, self.vocab_size = expected, script, vocab_size
        self.pause_after_multi_accept = pause_after_multi_accept
        self.emitted = self.step = 0
        self.paused = False
        self.empty_proposals = 0

    def start(self, prompt_ids, first_token, target_step) -> None:
        self.emitted, self.step, self.paused = 1, 0, False

    def propose(self, k: int) -> Proposal:
        if self.paused:
            self.empty_proposals += 1
            return Proposal.empty()
        right = self.expected[self.emitted : self.emitted + k]
        tokens = [t if self.script(self.step, i) else (t + 1) % self.vocab_size for i, t in enumerate(right)]
        return Proposal(torch.tensor(tokens, dtype=torch.long))

    def accept(self, n_accepted, emitted, target_step) -> None:
        self.emitted += emitted.numel()
        self.step += 1
        self.paused = self.pause_after_multi_accept and not self.paused and n_accepted >= 2


SCRIPTS = {
    "always_right": (lambda step, i: True, False),
    "always_wrong": (lambda step, i: False, False),
    "wrong_first_token": (lambda step, i: i > 0, False),  # every draft wrong at its first token
    "wrong_first_draft_only": (lambda step, i: step > 0 or i > 0, False),  # only the sequence's first token
    "nothing_after_multi_accept": (lambda step, i: True, True),
}


def _make_head(target: TargetModel, draft_vocab_size: int = 48):
    """A random (untrained) EAGLE-3 head on ``target`` with a d2t map; its drafts are mostly rejected."""
    from draftsmith.data_pipeline.vocab import build_vocab_map
    from draftsmith.drafters.eagle3.head import Eagle3Config, Eagle3Head

    model = target.model
    cfg = Eagle3Config.from_target(model.config, draft_vocab_size=draft_vocab_size, aux_layer_ids=target.aux_layer_ids)
    torch.manual_seed(0)
    head = Eagle3Head(cfg).eval()
    vmap = build_vocab_map(torch.arange(model.config.vocab_size).flip(0), draft_vocab_size)
    head.set_vocab_map(vmap.d2t, vmap.t2d)
    head.bind_embedding(model.get_input_embeddings())
    head.init_from_target(model)  # lm_head from the target: some drafts right
    return head


def _proposer(
    name: str, target: TargetModel, make_tiny_llama, expected: list[int] | None = None, head=None
) -> Proposer:
    if name == "ngram":
        return NgramProposer(prompt_lookup_min=1, prompt_lookup_max=3)
    if name == "draft_random":  # different seed, same vocab
        return DraftModelProposer(make_tiny_llama(seed=1, num_hidden_layers=2), target.vocab_size)
    if name == "draft_close":
        return DraftModelProposer(_noisy_copy(target.model), target.vocab_size)
    if name == "eagle3":
        from draftsmith.drafters.eagle3.proposer import Eagle3Proposer

        return Eagle3Proposer(head)
    if name in SCRIPTS:
        script, pause = SCRIPTS[name]
        return ScriptedProposer(expected, script, target.vocab_size, pause_after_multi_accept=pause)
    return RandomProposer(target.vocab_size)


@pytest.fixture(scope="module")
def greedy_setup(tiny_llama):
    """(target with aux layers, EAGLE-3 head, plain greedy outputs of the 50 prompts)."""
    target = TargetModel(tiny_llama(seed=0, num_hidden_layers=3), aux_layer_ids=(0, 1, 2))
    expected = [
        generate_plain(target, p, GenerationConfig(max_new_tokens=GREEDY_TOKENS)).tokens for p in GREEDY_PROMPTS
    ]
    return target, _make_head(target), expected


@pytest.mark.parametrize("k", [1, 3, 5, 8])
@pytest.mark.parametrize("name", ["ngram", "draft_random", "draft_close", "eagle3", "random", *SCRIPTS])
def test_speculative_greedy_equals_plain_greedy(greedy_setup, tiny_llama, name, k):
    """Token-identical to plain greedy decoding over 50 prompts, for every drafter and scripted behaviour."""
    target, head, expected = greedy_setup
    total = SpecStats(k=k)
    cfg = GenerationConfig(max_new_tokens=GREEDY_TOKENS)
    shared = None if name in SCRIPTS else _proposer(name, target, tiny_llama, head=head)  # reused: start() resets
    empty_proposals = 0
    for prompt, plain in zip(GREEDY_PROMPTS, expected):
        proposer = shared or _proposer(name, target, tiny_llama, expected=plain)
        result = generate_speculative(target, proposer, prompt, cfg, k)
        assert result.tokens == plain, f"prompt {prompt}"
        assert result.finish_reason == "length"
        total = total.merge(result.stats)
        empty_proposals += getattr(proposer, "empty_proposals", 0)
    assert total.num_drafts > 0
    assert 0 <= total.num_accepted_tokens <= total.num_draft_tokens
    assert sum(total.accepted_per_pos) == total.num_accepted_tokens
    if name in ("ngram", "draft_close", "eagle3"):  # not vacuous: drafts were accepted
        assert total.num_accepted_tokens > 0, total
        assert total.acceptance_length > 1.0
    if name == "always_right":
        assert total.acceptance_rate == 1.0
    if name in ("always_wrong", "wrong_first_token"):
        assert total.num_accepted_tokens == 0
    if name == "wrong_first_draft_only":
        assert 0 < total.num_accepted_tokens < total.num_draft_tokens
    if name == "nothing_after_multi_accept":
        assert total.acceptance_rate == 1.0
        assert (empty_proposals > 0) == (k >= 2)  # k = 1 never accepts 2 drafts at once


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
    eos = expected[3]  # inside the first verify chunk (tokens 1..6)
    cut = expected.index(eos) + 1
    cfg = GenerationConfig(max_new_tokens=30, eos_token_ids=[eos])
    result = generate_speculative(target, OracleProposer(expected), PROMPTS[2], cfg, k=5)
    assert result.tokens == expected[:cut] and result.finish_reason == "stop"
    emitted_by_verify = 1 + result.stats.num_accepted_tokens + result.stats.num_drafts
    assert emitted_by_verify > len(result.tokens)  # the chunk went past the EOS, the output did not
    assert generate_plain(target, PROMPTS[2], cfg).tokens == expected[:cut]
    stop = GenerationConfig(max_new_tokens=30, stop_token_ids=[eos])
    assert generate_speculative(target, NgramProposer(), PROMPTS[2], stop, k=3).tokens == expected[:cut]


@pytest.mark.parametrize("max_new_tokens", [0, 1, 2, 5, 6, 7, 11])
def test_max_new_tokens_never_overshoots(target, plain, max_new_tokens):
    cfg = GenerationConfig(max_new_tokens=max_new_tokens)
    result = generate_speculative(target, OracleProposer(plain[0]), PROMPTS[0], cfg, k=5)
    assert result.tokens == plain[0][:max_new_tokens]
    assert result.finish_reason == "length"


def test_stop_inside_a_chunk_emits_up_to_the_stop():
    """The issue's case: chunk [a, b, STOP, c, d, e] with max_tokens 5 emits [a, b, STOP], finish 'stop'."""
    from draftsmith.core.sequence import Emitted

    a, b, stop, c, d, e = 10, 11, 1, 12, 13, 14
    seen = []
    out = Emitted(GenerationConfig(max_new_tokens=5, eos_token_ids=[stop]), on_tokens=seen.append)
    assert out.extend([a, b, stop, c, d, e]) is True
    assert (out.tokens, out.finish_reason, seen) == ([a, b, stop], "stop", [[a, b, stop]])
    out = Emitted(GenerationConfig(max_new_tokens=5, stop_token_ids=[stop]))  # a stop id, not EOS: same
    assert out.extend([a, b, stop, c, d, e]) and (out.tokens, out.finish_reason) == ([a, b, stop], "stop")
    out = Emitted(GenerationConfig(max_new_tokens=5))  # no stop: cut at 5
    assert out.extend([a, b, stop, c, d, e]) and (out.tokens, out.finish_reason) == ([a, b, stop, c, d], "length")
    out = Emitted(GenerationConfig(max_new_tokens=5, eos_token_ids=[e]))  # stop after max_tokens: length
    assert out.extend([a, b, stop, c, d, e]) and (out.tokens, out.finish_reason) == ([a, b, stop, c, d], "length")


@pytest.mark.parametrize("name", ["ngram", "draft_close", "always_right", "eagle3"])
def test_eos_as_third_greedy_token_with_k4_ends_there(greedy_setup, tiny_llama, name):
    """EOS = the 3rd token of the plain greedy output (first occurrence): output ends right after it."""
    target, head, expected = greedy_setup
    cases = [(p, e) for p, e in zip(GREEDY_PROMPTS, expected) if e[2] not in e[:2]][:10]
    assert len(cases) >= 5
    for prompt, plain in cases:
        cfg = GenerationConfig(max_new_tokens=GREEDY_TOKENS, eos_token_ids=[plain[2]])
        result = generate_speculative(
            target, _proposer(name, target, tiny_llama, expected=plain, head=head), prompt, cfg, k=4
        )
        assert (result.tokens, result.finish_reason) == (plain[:3], "stop")


def test_rejected_drafted_eos_does_not_end_generation(target, plain):
    """A proposer that always drafts EOS first: the target rejects it, generation goes on to max_tokens."""
    expected = plain[2]
    eos = next(t for t in range(2, 96) if t not in expected)

    class DraftsEos(OracleProposer):
        def propose(self, k):
            right = super().propose(k).tokens
            return Proposal(torch.cat([torch.tensor([eos]), right[1:]]) if right.numel() else right)

    cfg = GenerationConfig(max_new_tokens=30, eos_token_ids=[eos])
    result = generate_speculative(target, DraftsEos(expected), PROMPTS[2], cfg, k=4)
    assert (result.tokens, result.finish_reason) == (expected, "length")
    assert result.stats.num_drafts > 0 and result.stats.num_accepted_tokens == 0


@pytest.mark.parametrize("max_new_tokens", [1, 2])
def test_ngram_k3_returns_exactly_max_tokens(greedy_setup, max_new_tokens):
    """n-gram with k=3 on prompts it drafts 3 tokens from: exactly 1 or 2 tokens, never the whole chunk."""
    target, _, expected = greedy_setup

    def drafts_three(prompt, plain) -> bool:
        proposer = NgramProposer(prompt_lookup_min=1, prompt_lookup_max=3)
        proposer.start(torch.tensor(prompt), plain[0], None)
        return proposer.propose(3).tokens.numel() == 3

    assert any(drafts_three(p, e) for p, e in zip(GREEDY_PROMPTS, expected))  # not vacuous
    for prompt, plain in zip(GREEDY_PROMPTS, expected):
        result = generate_speculative(
            target, NgramProposer(1, 3), prompt, GenerationConfig(max_new_tokens=max_new_tokens), k=3
        )
        assert (result.tokens, result.finish_reason) == (plain[:max_new_tokens], "length")
        # drafts asked per step: min(k, max_tokens - emitted - 1) = 0 here: the verify pass adds one token itself
        assert result.stats.num_draft_tokens == 0


def test_sampling_path_with_top_k_1_equals_greedy(target, plain):
    """top_k = 1 makes p and q one-hot: rejection sampling must reproduce greedy output exactly."""
    cfg = GenerationConfig(max_new_tokens=30, temperature=0.7, top_k=1, seed=3)
    drafts = [
        NgramProposer(),
        DraftModelProposer(_noisy_copy(target.model), target.vocab_size, temperature=0.7, top_k=1),
    ]
    for proposer in drafts:
        for prompt, expected in zip(PROMPTS[:3], plain[:3]):
            assert generate_speculative(target, proposer, prompt, cfg, k=3).tokens == expected


def test_sampling_is_seeded(target):
    cfg = GenerationConfig(max_new_tokens=20, temperature=1.0, top_p=0.9, seed=7)
    runs = [
        generate_speculative(
            target,
            DraftModelProposer(_noisy_copy(target.model), 96, temperature=1.0, top_p=0.9, seed=1),
            PROMPTS[0],
            cfg,
            k=3,
        )
        for _ in range(2)
    ]
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
    assert all(shape[1] == 96 and n + 1 <= shape[0] <= 3 for n, shape in seen[1:])  # rows 0..n are there


def test_spec_stats():
    stats = SpecStats(k=3)
    stats.record(3, 2)
    stats.record(0, 0)  # proposing nothing is not a draft
    stats.record(2, 0)
    assert (stats.num_drafts, stats.num_draft_tokens, stats.num_accepted_tokens) == (2, 5, 2)
    assert stats.accepted_per_pos == [1, 1, 0]
    assert stats.acceptance_rate == pytest.approx(2 / 5)
    assert stats.acceptance_length == pytest.approx(1 + 2 / 2)
    assert SpecStats(k=2).acceptance_length == 1.0 and SpecStats(k=2).acceptance_rate == 0.0
    merged = stats.merge(
        SpecStats(k=4, num_drafts=1, num_draft_tokens=4, num_accepted_tokens=4, accepted_per_pos=[1, 1, 1, 1])
    )
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
    prefixes = torch.cartesian_prod(torch.arange(8), torch.arange(8))  # [64, 2]
    with torch.no_grad():
        logits = model(torch.cat([torch.tensor(prompt).expand(64, 3), prefixes], dim=1)).logits
    probs = torch.softmax(logits.float() / temperature, dim=-1)  # [64, 5, 8]
    joint = probs[0, 2][:, None, None] * probs[::8, 3][:, :, None] * probs[:, 4].reshape(8, 8, 8)
    counts = torch.zeros(8, 8, 8)
    stats = SpecStats(k=1)
    for seed in range(trials):
        result = generate_speculative(
            target, draft, prompt, GenerationConfig(max_new_tokens=3, temperature=temperature, seed=seed), k=1
        )
        counts[tuple(result.tokens)] += 1
        stats = stats.merge(result.stats)
    assert 0.1 < stats.acceptance_rate < 0.9  # both accept and reject paths ran
    assert _pooled_pvalue(counts.sum(2).flatten(), trials * joint.sum(2).flatten()) > 1e-3
    assert _pooled_pvalue(counts.sum((0, 1)), trials * joint.sum((0, 1))) > 1e-3
