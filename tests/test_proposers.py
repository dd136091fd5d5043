"""Proposers on their own: n-gram lookup semantics (vLLM's), draft-model bookkeeping and refusals."""

from __future__ import annotations

import pytest
import torch
from tokenizers import Tokenizer, models
from transformers import PreTrainedTokenizerFast

from draftsmith.core.generate import GenerationConfig, generate_plain
from draftsmith.core.proposer import Proposal
from draftsmith.core.target import TargetModel
from draftsmith.drafters.draft_model.proposer import DraftModelProposer, check_same_tokenizer
from draftsmith.drafters.ngram.proposer import NgramProposer, find_ngram_continuation


def _lookup(context, k, min_n, max_n):
    return find_ngram_continuation(torch.tensor(context), k, min_n, max_n).tolist()


def test_ngram_vllm_docstring_example():
    # vLLM ngram_proposer.py: [1,2,3,4,2,3], min 2, max 3, k 4: [4,2,3] has no match, [2,3] does -> 3 tokens
    assert _lookup([1, 2, 3, 4, 2, 3], 4, 2, 3) == [4, 2, 3]


def test_ngram_longest_match_wins_and_ties_go_to_earliest():
    # suffix [7, 8] occurs at 2 (-> 1, 7, 8); the 1-gram [8] occurs earlier at 0 (-> 0, ...) but is shorter
    assert _lookup([8, 0, 7, 8, 1, 7, 8], 3, 1, 2) == [1, 7, 8]
    # [5] occurs at 0 and 2: the earliest occurrence is used
    assert _lookup([5, 1, 5, 2, 5], 2, 1, 3) == [1, 5]
    # the earlier occurrence may overlap the suffix: [4, 4] in [4, 4, 4]
    assert _lookup([4, 4, 4], 3, 2, 2) == [4]


def test_ngram_nothing_to_propose():
    assert _lookup([1, 2, 3, 4], 3, 1, 3) == []  # no repeated token
    assert _lookup([1, 2, 1], 3, 2, 3) == []  # only a 1-gram repeats, min is 2
    assert _lookup([1], 3, 1, 3) == []  # context shorter than any match
    assert _lookup([1, 2, 1], 0, 1, 3) == []  # k = 0


def test_ngram_proposer_tracks_context():
    proposer = NgramProposer(prompt_lookup_min=1, prompt_lookup_max=3)
    proposer.start(torch.tensor([10, 11, 12, 13, 10]), first_token=11, target_step=None)
    proposal = proposer.propose(2)
    assert proposal.tokens.tolist() == [12, 13] and proposal.q is None
    proposer.accept(1, torch.tensor([12, 20]), target_step=None)  # context ... 10 11 12 20
    assert proposer.propose(3).tokens.tolist() == []
    with pytest.raises(ValueError, match="prompt_lookup_min"):
        NgramProposer(prompt_lookup_min=3, prompt_lookup_max=2)


def test_draft_vocab_mismatch_is_refused(tiny_llama):
    with pytest.raises(ValueError, match=r"draft model vocab size 64 != target vocab size 96.*tokenizer"):
        DraftModelProposer(tiny_llama(vocab_size=64), target_vocab_size=96)


def _tokenizer(vocab: dict[str, int], eos: str) -> PreTrainedTokenizerFast:
    return PreTrainedTokenizerFast(
        tokenizer_object=Tokenizer(models.WordLevel(vocab, unk_token="<unk>")), eos_token=eos, unk_token="<unk>"
    )


def test_check_same_tokenizer():
    vocab = {"<unk>": 0, "</s>": 1, "a": 2, "b": 3}
    check_same_tokenizer(_tokenizer(vocab, "</s>"), _tokenizer(dict(vocab), "</s>"))
    with pytest.raises(ValueError, match=r"draft tokenizer differs.*'b': target 3 vs draft 4"):
        check_same_tokenizer(_tokenizer(vocab, "</s>"), _tokenizer({**vocab, "b": 4}, "</s>"))
    with pytest.raises(ValueError, match="eos_token_id is 2 but the target's is 1"):
        check_same_tokenizer(_tokenizer(vocab, "</s>"), _tokenizer(vocab, "a"))


def test_draft_model_proposals_are_its_greedy_continuation_and_cache_is_cropped(tiny_llama):
    draft = tiny_llama(seed=1, num_hidden_layers=2)
    prompt = torch.tensor([5, 6, 7, 8, 9])
    draft_greedy = generate_plain(TargetModel(draft), prompt, GenerationConfig(max_new_tokens=8)).tokens
    proposer = DraftModelProposer(draft, target_vocab_size=96)
    proposer.start(prompt, first_token=draft_greedy[0], target_step=None)
    proposal = proposer.propose(4)
    assert proposal.tokens.tolist() == draft_greedy[1:5] and proposal.q is None
    assert proposer.cache.length == 5 + 1 + 3  # context + d1..d3 (d4 never fed)
    # the target accepted 2 drafts and emitted a different third token: keep context + d1 d2
    proposer.accept(2, torch.tensor([draft_greedy[1], draft_greedy[2], 0]), target_step=None)
    assert proposer.cache.length == 5 + 1 + 2
    # both drafts accepted + bonus: nothing is dropped; e2 and the bonus are fed by the next propose
    proposal = proposer.propose(2)  # reads the 0, then e1
    assert proposer.cache.length == 5 + 1 + 3 + 1
    proposer.accept(2, torch.cat([proposal.tokens, torch.tensor([1])]), target_step=None)
    assert proposer.cache.length == 5 + 1 + 3 + 1
    # next proposal continues the (new) context exactly as a fresh draft would
    context = proposer._context
    fresh = generate_plain(TargetModel(draft), torch.tensor(context), GenerationConfig(max_new_tokens=3)).tokens
    assert proposer.propose(3).tokens.tolist() == fresh


def test_draft_model_sampling_returns_q(tiny_llama):
    draft = tiny_llama(seed=1, num_hidden_layers=2)

    def run(seed: int) -> Proposal:
        proposer = DraftModelProposer(draft, 96, temperature=0.8, top_k=20, top_p=0.9, seed=seed)
        proposer.start(torch.tensor([3, 4, 5]), first_token=6, target_step=None)
        return proposer.propose(3)

    proposal = run(0)
    assert proposal.q.shape == (3, 96)
    torch.testing.assert_close(proposal.q.sum(-1), torch.ones(3))
    assert (proposal.q[torch.arange(3), proposal.tokens] > 0).all()
    assert ((proposal.q > 0).sum(-1) <= 20).all()  # top-k applied to q
    assert run(0).tokens.tolist() == proposal.tokens.tolist()  # seeded


def test_incremental_index_drafts_what_a_rescan_drafts():
    """``NgramIndex`` (kept as tokens arrive) proposes exactly what rescanning the whole context proposes
    (``find_ngram_continuation``), at every step of random low-entropy sequences, for every bound pair and k."""
    from draftsmith.drafters.ngram.proposer import NgramIndex

    g = torch.Generator().manual_seed(0)
    for trial in range(30):
        seq = torch.randint(0, 3 + trial % 5, (60,), generator=g).tolist()
        for min_n, max_n in ((1, 1), (1, 3), (2, 5), (3, 3)):
            index = NgramIndex(min_n, max_n)
            for i, token in enumerate(seq):
                index.append([token])
                for k in (1, 4):
                    assert index.continuation(k) == _lookup(seq[: i + 1], k, min_n, max_n), (trial, i, k)


def test_ngram_proposer_does_not_rescan_its_context(monkeypatch):
    """A step costs the same at any context length: proposing never unfolds the context again."""
    proposer = NgramProposer(1, 5)
    context = torch.randint(0, 50, (20_000,), generator=torch.Generator().manual_seed(1))
    proposer.start(context[:-1], int(context[-1]))

    def unfold(*args, **kwargs):
        raise AssertionError("the proposer rescanned its context")

    monkeypatch.setattr(torch.Tensor, "unfold", unfold)
    for step in range(200):
        proposal = proposer.propose(4)
        proposer.accept(0, torch.tensor([step % 50]))
        assert proposal.tokens.numel() <= 4
