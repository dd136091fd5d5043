"""Draft trees (``core.tree``, ``drafters/eagle3/tree.py``): shapes, masks, verification, and the invariants.

- tree verification walks the target's argmax (greedy) and keeps the target's law (sampling: chi-square, with a
  broken variant that the same test rejects, so it has power);
- tree greedy output equals plain greedy on tiny Llama / Qwen3 / Mistral targets and the reference target,
  with an oracle drafter that hides the target's continuation among siblings at random depths (acceptance
  guaranteed, every KV path exercised) and with an EAGLE-3 head; batched trees equal each row alone;
- the EAGLE-2 expansion equals a brute-force one that recomputes every node's distribution along its own path;
- tree sampling through the runtime (stub target, EAGLE-3 head, batches of 1 and 4) follows the exact law.
"""

from __future__ import annotations

import random

import pytest
import torch
from scipy.stats import chisquare

from conftest import make_tiny_llama, make_word_tokenizer
from draftsmith import drafters, reference
from draftsmith.core.batch import BatchDecoder, BatchSequence, generate_batch
from draftsmith.core.generate import GenerationConfig, generate_plain, generate_speculative
from draftsmith.core.proposer import PerSequence, Proposal, Proposer
from draftsmith.core.sampling import residual_probs, sample
from draftsmith.core.target import TargetModel
from draftsmith.core.tree import (
    TreeShape,
    ancestor_mask,
    depths,
    tree_positions,
    verify_tree_greedy,
    verify_tree_sampling,
)
from draftsmith.drafters.speculative import SpeculativeConfig
from draftsmith.serve.engine import Engine

# ------------------------------------------------------------------------------------------------ shapes


def test_tree_shape_parses_sglang_names_and_refuses_bad_budgets():
    shape = TreeShape.parse("topk=4,num_steps=5,num_draft_tokens=32")
    assert shape == TreeShape.parse({"topk": 4, "num_steps": 5, "num_draft_tokens": 32}) == TreeShape(4, 5, 32)
    assert shape.num_nodes == 31 and str(shape) == "topk=4,num_steps=5,num_draft_tokens=32"
    assert shape.sglang_args()[-2:] == ["--speculative-num-draft-tokens", "32"]
    for bad, words in [
        ("topk=4,num_steps=5", "missing num_draft_tokens"),
        ("topk=4,num_steps=5,num_draft_tokens=32,depth=3", "unknown depth"),
        ("topk=x,num_steps=5,num_draft_tokens=32", "topk must be an integer"),
        ("topk=1,num_steps=3,num_draft_tokens=9", "num_draft_tokens must be in 2..4"),
        ("topk=0,num_steps=3,num_draft_tokens=2", "topk must be an integer >= 1"),
    ]:
        with pytest.raises(ValueError, match=words):
            TreeShape.parse(bad)


def test_speculative_config_takes_a_tree_for_tree_drafters_only():
    head = "runs/HEAD"  # not loaded: the config alone is checked
    spec = SpeculativeConfig.from_dict({"method": "ngram", "num_speculative_tokens": 3})  # a chain: nothing changes
    assert spec.tree is None and "tree" not in spec.to_dict()
    with pytest.raises(ValueError, match="drafts chains only"):
        SpeculativeConfig.from_dict({"method": "ngram", "tree": "topk=2,num_steps=3,num_draft_tokens=6"})
    rules = drafters.config_module("eagle3").RULES
    assert rules.drafts_trees
    spec = SpeculativeConfig("eagle3", head, None, {}, "topk=2,num_steps=3,num_draft_tokens=6")
    assert spec.num_speculative_tokens == 3 and spec.to_dict()["tree"] == {
        "topk": 2,
        "num_steps": 3,
        "num_draft_tokens": 6,
    }
    assert spec.with_k(7) is spec and spec.with_tree(None).tree is None
    with pytest.raises(ValueError, match="must equal the tree's num_steps"):
        SpeculativeConfig("eagle3", head, 5, {}, "topk=2,num_steps=3,num_draft_tokens=6")


# -------------------------------------------------------------------------------------- masks, positions

#        root
#       /  |  \
#      0   1   2          node: token
#     / \      |          0: 5   1: 6   2: 7
#    3   4     5          3: 1   4: 2   5: 3
#    |                    6: 4
#    6
PARENTS = torch.tensor([-1, -1, -1, 0, 0, 2, 3])
TOKENS = torch.tensor([5, 6, 7, 1, 2, 3, 4])


def test_ancestor_mask_and_positions():
    mask = ancestor_mask(PARENTS)
    assert mask.shape == (8, 8)
    assert mask[7].nonzero().flatten().tolist() == [0, 1, 4, 7]  # node 6: root, node 0, node 3, itself
    assert mask[6].nonzero().flatten().tolist() == [0, 3, 6]  # node 5: root, node 2, itself
    assert depths(PARENTS).tolist() == [1, 1, 1, 2, 2, 2, 3]
    assert tree_positions(PARENTS, 10).tolist() == [10, 11, 11, 11, 12, 12, 12, 13]
    with pytest.raises(ValueError, match="topological"):
        verify_tree_greedy(TOKENS, torch.tensor([-1, 2, -1, 0, 0, 2, 3]), torch.zeros(8, 9))


def _logits_with_argmax(argmax: list[int], v: int = 9) -> torch.Tensor:
    logits = torch.zeros(len(argmax), v)
    logits[torch.arange(len(argmax)), torch.tensor(argmax)] = 1.0
    return logits


def test_greedy_tree_verification_follows_the_argmax_through_siblings():
    # root wants 5 (node 0), node 0 wants 1 (node 3), node 3 wants 4 (node 6), node 6 wants 8: bonus
    emitted, path = verify_tree_greedy(TOKENS, PARENTS, _logits_with_argmax([5, 1, 0, 0, 4, 0, 0, 8]))
    assert path == [0, 3, 6] and emitted.tolist() == [5, 1, 4, 8]
    # root wants 7 (node 2, a later sibling), node 2 wants 0: no child has it
    emitted, path = verify_tree_greedy(TOKENS, PARENTS, _logits_with_argmax([7, 0, 0, 0, 0, 0, 0, 0]))
    assert path == [2] and emitted.tolist() == [7, 0]
    emitted, path = verify_tree_greedy(TOKENS, PARENTS, _logits_with_argmax([8] * 8))
    assert path == [] and emitted.tolist() == [8]


# ------------------------------------------------------------------------------- sampling verification


def _broken_tree_sampling(tokens, parents, p, generator):
    """A plausible bug: each sibling tried against the node's p itself, no residual update (and the final draw
    from p). Over-emits the drafted tokens."""
    kids: dict[int, list[int]] = {}
    for i, par in enumerate(parents.tolist()):
        kids.setdefault(par, []).append(i)
    node, out = -1, []
    while True:
        r = p[node + 1]
        nxt = next(
            (c for c in kids.get(node, ()) if float(torch.rand(1, generator=generator)) < float(r[tokens[c]])), None
        )
        if nxt is None:
            out.append(int(sample(r, generator)))
            return torch.tensor(out), None
        out.append(int(tokens[nxt]))
        node = nxt


def _first_two_law(p: torch.Tensor) -> torch.Tensor:
    """Exact law of the first two emitted tokens [V, V] of a target whose p after the root is p[0] and after a
    first token t is: the row of the root's child holding t, or (a token no child holds) a fixed row p[-1]."""
    v = p.shape[1]
    child_row = {int(TOKENS[i]): i + 1 for i, par in enumerate(PARENTS.tolist()) if par == -1}
    law = torch.zeros(v, v, dtype=torch.float64)
    for t in range(v):
        law[t] = p[0, t].double() * p[child_row.get(t, p.shape[0] - 1)].double()
    return law


def _sampled_pairs(verify, p: torch.Tensor, trials: int) -> torch.Tensor:
    """[V, V] counts of the first two emitted tokens; when a step emits one token, the second is drawn from the
    target row after it (what the next step would do), so every trial gives a pair."""
    v = p.shape[1]
    gen = torch.Generator().manual_seed(0)
    child_row = {int(TOKENS[i]): i + 1 for i, par in enumerate(PARENTS.tolist()) if par == -1}
    counts = torch.zeros(v, v, dtype=torch.float64)
    for _ in range(trials):
        emitted, _ = verify(TOKENS, PARENTS, p[:-1], gen)  # the last row is the fallback, no node
        first = int(emitted[0])
        second = int(emitted[1]) if emitted.numel() > 1 else int(sample(p[child_row.get(first, p.shape[0] - 1)], gen))
        counts[first, second] += 1
    return counts


def _pvalue(counts: torch.Tensor, law: torch.Tensor) -> float:
    counts, expected = counts.flatten(), law.flatten() * counts.sum()
    keep = expected >= 5
    obs = torch.cat([counts[keep], counts[~keep].sum().reshape(1)])
    exp = torch.cat([expected[keep], expected[~keep].sum().reshape(1)])
    return float(chisquare(obs.numpy(), exp.numpy() * obs.sum().item() / exp.sum().item()).pvalue)


@pytest.mark.parametrize("temperature", [0.5, 1.0])
def test_tree_sampling_keeps_the_target_law_and_the_test_rejects_a_broken_variant(temperature):
    v = 9
    logits = 1.5 * torch.randn(8 + 1, v, generator=torch.Generator().manual_seed(3))  # rows 0..7 + a fallback
    logits[0, TOKENS[:3]] += 1.0  # the drafted children are likely, not certain
    p = torch.softmax(logits / temperature, dim=-1)
    law = _first_two_law(p)
    trials = 6000
    assert _pvalue(_sampled_pairs(verify_tree_sampling, p, trials), law) > 1e-3
    assert _pvalue(_sampled_pairs(_broken_tree_sampling, p, trials), law) < 1e-3  # power: the bug is caught


def test_residual_of_a_one_hot_draft_removes_the_token():
    p = torch.tensor([0.5, 0.3, 0.2])
    assert torch.allclose(residual_probs(p, torch.tensor([1.0, 0.0, 0.0])), torch.tensor([0.0, 0.6, 0.4]))


# --------------------------------------------------------------------------- greedy through the runtime


class OracleTree(Proposer):
    """Hides the target's greedy continuation (known in advance) in a random tree: at each depth the right token
    sits at a random sibling position among distractors, the tree ends at a random depth, and other branches
    grow too. Deterministic for a seed; acceptance is guaranteed, at varied depths and sibling indices."""

    def __init__(self, continuation: list[int], vocab: int, seed: int):
        self.truth, self.vocab, self.rng = continuation, vocab, random.Random(seed)
        self.done = 0  # emitted tokens so far (the first comes from the prefill)

    def start(self, prompt_ids, first_token, target_step) -> None:
        self.done = 1

    def propose(self, k: int) -> Proposal:
        raise AssertionError("a tree run must call propose_tree")

    def propose_tree(self, shape, max_depth: int) -> Proposal:
        truth = self.truth[self.done : self.done + min(max_depth, shape.num_steps)]
        depth = self.rng.randint(0, len(truth))  # the right path is this deep
        tokens, parents, parent = [], [], -1
        for d in range(len(truth)):
            siblings = self.rng.randint(1, shape.topk)
            right = self.rng.randrange(siblings) if d < depth else None
            wrong = [t for t in range(self.vocab) if t != truth[d]]
            self.rng.shuffle(wrong)
            here = None
            for j in range(siblings):
                if len(tokens) >= shape.num_nodes:
                    break
                tokens.append(truth[d] if j == right else wrong[j])
                parents.append(parent)
                if j == right:
                    here = len(tokens) - 1
                elif (
                    d + 1 < len(truth) and self.rng.random() < 0.3 and len(tokens) < shape.num_nodes
                ):  # a wrong branch grows one node
                    tokens.append(self.rng.randrange(self.vocab))
                    parents.append(len(tokens) - 2)
            if here is None:
                break
            parent = here
        return Proposal(torch.tensor(tokens, dtype=torch.long), parents=torch.tensor(parents, dtype=torch.long))

    def accept(self, n_accepted, emitted, target_step) -> None:
        assert emitted.tolist() == self.truth[self.done : self.done + n_accepted + 1]
        self.done += n_accepted + 1


TREE = TreeShape(topk=3, num_steps=4, num_draft_tokens=14)


def _tiny(arch: str):
    return make_tiny_llama(seed=5, num_hidden_layers=8, arch=arch), make_word_tokenizer(96)


@pytest.mark.parametrize("arch", ["llama", "qwen3", "mistral"])
def test_tree_greedy_equals_plain_with_an_oracle_tree(arch):
    """Any tree holding the continuation, verified in one forward with ancestor-only attention and rolled back
    to its accepted path, gives plain greedy output; the accepted paths are the hidden ones."""
    model, tok = _tiny(arch)
    target = TargetModel(model, tok)
    cfg = GenerationConfig(max_new_tokens=30)
    for seed, prompt in enumerate([[3, 4, 5, 6], [7, 8, 9, 10, 11, 12, 13, 14, 15]]):
        plain = generate_plain(target, prompt, cfg).tokens
        out = generate_speculative(target, OracleTree(plain, 96, seed), prompt, cfg, k=0, tree=TREE)
        assert out.tokens == plain, f"{arch}: tree greedy differs from plain"
        s = out.stats
        assert s.num_drafts > 0 and s.num_accepted_tokens > 0 and s.k == TREE.num_steps
        assert out.num_target_forwards < len(plain)  # trees saved forwards
        assert sum(s.accepted_per_pos) == s.num_accepted_tokens
        assert all(a >= b for a, b in zip(s.accepted_per_pos, s.accepted_per_pos[1:]))


@pytest.mark.parametrize("arch", ["llama", "qwen3"])
def test_batched_oracle_trees_equal_each_sequence_alone(arch):
    """Rows with different prompt lengths and max_tokens, trees of different sizes in one ragged verify forward,
    rows joining later: each row's output is plain greedy."""
    model, tok = _tiny(arch)
    target = TargetModel(model, tok)
    prompts = [[3, 4, 5, 6], [7, 8, 9, 10, 11, 12, 13], [20, 21], [30, 31, 32, 33, 34]]
    cfgs = [GenerationConfig(max_new_tokens=n) for n in (20, 9, 16, 12)]
    plains = [generate_plain(target, p, c).tokens for p, c in zip(prompts, cfgs)]
    order = iter(range(len(prompts)))  # rows start in prompt order

    def factory(sampling):
        i = next(order)
        return OracleTree(plains[i], 96, 100 + i)

    decoder = BatchDecoder(target, PerSequence(factory), max_num_seqs=3, max_num_batched_tokens=40, tree=TREE)
    seqs = [BatchSequence(p, c) for p, c in zip(prompts, cfgs)]
    for seq in seqs[:2]:
        decoder.add(seq)
    decoder.step()
    for seq in seqs[2:]:
        decoder.add(seq)
    decoder.run()
    for i, seq in enumerate(seqs):
        assert seq.error is None and seq.result.tokens == plains[i], f"{arch}: row {i} differs"
    assert sum(s.stats.num_accepted_tokens for s in seqs) > 0


TREE_DRAFTERS = [n for n in drafters.names() if drafters.config_module(n).RULES.drafts_trees]


def _tree_engine(model, tok, workdir, tree, name="eagle3"):
    spec = drafters.get(name).example(model, tok, workdir)
    return Engine(model, tok, spec.with_tree(tree))


def _eagle3_engine(model, tok, workdir, tree):
    return _tree_engine(model, tok, workdir, tree)


def test_tree_drafters_are_eagle3_and_dflash():
    assert set(TREE_DRAFTERS) == {"eagle3", "dflash"}


@pytest.mark.parametrize("name", TREE_DRAFTERS)
@pytest.mark.parametrize("which", ["tiny", "reference"])
def test_tree_greedy_equals_plain_and_batched_equals_alone(tmp_path, which, name):
    if which == "tiny":
        model, tok = _tiny("llama")
        prompts = [[5, 6, 7, 8, 9, 5, 6, 7, 10, 11, 5, 6], [20, 21, 22, 20, 21, 22, 23]]
    else:
        from draftsmith.data_pipeline.chat import prompt_ids

        model, tok = reference.target()
        records = reference.tasks(["code-complete", "docstring"], limit=1)
        prompts = [prompt_ids(tok, r[0]["messages"]).tolist() for r in records.values()]
    tree = TreeShape(topk=3, num_steps=3, num_draft_tokens=10)
    engine = _tree_engine(model, tok, tmp_path, tree, name)
    cfgs = [GenerationConfig(max_new_tokens=n, eos_token_ids=engine.eos_token_ids) for n in (20, 12)]
    plains = [generate_plain(TargetModel(model, tok), p, c).tokens for p, c in zip(prompts, cfgs)]
    alone = [engine.generate(p, c) for p, c in zip(prompts, cfgs)]
    for out, plain in zip(alone, plains):
        assert out.tokens == plain and out.stats.num_drafts > 0
        assert out.stats.num_draft_tokens <= tree.num_nodes * out.stats.num_drafts
    batched = generate_batch(
        engine.target, engine.drafter.new_batch_proposer(), prompts, cfgs, max_num_seqs=2, tree=tree
    )
    for b, out, a in zip(batched, plains, alone):
        assert b.tokens == out
        assert (b.stats.num_drafts, b.stats.num_draft_tokens, b.stats.num_accepted_tokens) == (
            a.stats.num_drafts,
            a.stats.num_draft_tokens,
            a.stats.num_accepted_tokens,
        )


def test_a_tree_of_topk_one_is_the_chain(tmp_path):
    """topk = 1: the tree is the greedy chain of the same depth, drafted and accepted alike."""
    model, tok = _tiny("llama")
    spec = drafters.get("eagle3").example(model, tok, tmp_path)
    prompt = [5, 6, 7, 8, 9, 5, 6, 7, 10, 11, 5, 6]
    cfg = GenerationConfig(max_new_tokens=24)
    chain = Engine(model, tok, spec.with_k(4)).generate(prompt, cfg)
    tree = Engine(model, tok, spec.with_tree("topk=1,num_steps=4,num_draft_tokens=5")).generate(prompt, cfg)
    assert tree.tokens == chain.tokens
    assert tree.stats.accepted_per_pos == chain.stats.accepted_per_pos
    assert tree.stats.num_draft_tokens == chain.stats.num_draft_tokens


# ------------------------------------------------------------------------------------ EAGLE-2 expansion


def _brute_eagle2(head, kv, hidden, logits, shape, draft_ids):
    """EAGLE-2 by definition: every frontier node's distribution recomputed from scratch along its own path."""
    length = kv.length

    def dist(path_cols: list[int]) -> torch.Tensor:
        kv.reset_chain()
        h, lg = hidden.reshape(1, 1, -1), logits
        for d, col in enumerate(path_cols, start=1):
            pos = torch.tensor([[length - 1 + d]])
            h, _ = head.step(h, draft_ids[torch.tensor([[col]])], kv, "chain", position_ids=pos, with_logits=False)
            lg = head.logits(h[0, 0])
        kv.reset_chain()
        return torch.log_softmax(lg.float(), dim=-1)

    cands = []  # (score, cols path, parent index)
    s, c = dist([]).topk(shape.topk)
    frontier = []
    for score, col in zip(s.tolist(), c.tolist()):
        cands.append((score, [col], -1))
        frontier.append(len(cands) - 1)
    for _ in range(1, shape.num_steps):
        new = []
        for f in frontier:
            score, path, _ = cands[f]
            s, c = dist(path).topk(shape.topk)
            for cs, cc in zip(s.tolist(), c.tolist()):
                cands.append((score + cs, path + [cc], f))
                new.append(len(cands) - 1)
        frontier = sorted(new, key=lambda i: -cands[i][0])[: shape.topk]
    keep = sorted(sorted(range(len(cands)), key=lambda i: -cands[i][0])[: shape.num_nodes])
    where = {i: j for j, i in enumerate(keep)}
    tokens = [int(draft_ids[cands[i][1][-1]]) for i in keep]
    parents = [-1 if cands[i][2] < 0 else where[cands[i][2]] for i in keep]
    return tokens, parents


def test_eagle2_tree_equals_the_brute_force_expansion(tmp_path):
    from draftsmith.drafters.eagle3.proposer import Eagle3Proposer
    from draftsmith.drafters.eagle3.tree import eagle2_tree

    model, tok = _tiny("llama")
    engine = _eagle3_engine(model, tok, tmp_path, None)
    proposer = engine.new_proposer(GenerationConfig())
    assert isinstance(proposer, Eagle3Proposer)
    prompt = torch.tensor([5, 6, 7, 8, 9, 5, 6, 7, 10, 11])
    step = engine.target.forward(prompt, engine.target.new_cache())
    proposer.start(prompt, int(step.logits[-1].argmax()), step)
    for shape in (TreeShape(2, 3, 8), TreeShape(3, 4, 20), TreeShape(4, 2, 17)):
        got = eagle2_tree(
            proposer.head, proposer.kv, proposer.last_hidden, proposer.last_logits, shape, 9, proposer.draft_ids
        )
        want = _brute_eagle2(
            proposer.head, proposer.kv, proposer.last_hidden, proposer.last_logits, shape, proposer.draft_ids
        )
        assert (got.tokens.tolist(), got.parents.tolist()) == want, shape
        assert got.q is None and not proposer.kv.chain
    depth_capped = eagle2_tree(
        proposer.head,
        proposer.kv,
        proposer.last_hidden,
        proposer.last_logits,
        TreeShape(3, 4, 20),
        2,
        proposer.draft_ids,
    )
    assert int(depths(depth_capped.parents).max()) == 2


# ------------------------------------------------------------------------------ sampling through the runtime


@pytest.mark.parametrize("name", TREE_DRAFTERS)
@pytest.mark.parametrize(("batch_size", "temperature"), [(1, 0.5), (1, 1.0), (4, 1.0)])
def test_tree_sampling_is_lossless(tmp_path, batch_size, temperature, name):
    """T = 0.5 and 1 on the stub target with every tree drafter drafting trees: every adjacent pair follows the
    exact law and plain sampling, with nodes accepted and rejected."""
    import lossless

    model, tok = lossless.TrigramLM(lossless.TARGET_TABLE), lossless.word_tokenizer()
    tree = TreeShape(topk=2, num_steps=3, num_draft_tokens=6)
    engine = _tree_engine(model, tok, tmp_path, tree, name)
    settings = {"temperature": temperature}
    trials = 1500
    plain, _ = lossless.run_trials(TargetModel(model), None, settings, trials=trials)
    if batch_size == 1:
        seqs, stats = lossless.run_trials(
            engine.target,
            lambda seed: engine.new_proposer(GenerationConfig(seed=seed, **settings)),
            settings,
            trials=trials,
            tree=tree,
        )
    else:
        seqs, stats = lossless.run_trials_batched(
            engine.target, engine.drafter.new_batch_proposer(), settings, batch_size, trials=trials, tree=tree
        )
    assert stats.num_drafts >= trials and 0 < stats.num_accepted_tokens < stats.num_draft_tokens
    assert stats.num_draft_tokens <= tree.num_nodes * stats.num_drafts
    lossless.check_lossless(seqs, plain, settings)


def test_best_first_tree_holds_the_best_paths_of_the_marginals():
    """DDTree's best-first tree equals the brute-force top-N of every rank path (scores summed per position)."""
    import itertools

    from draftsmith.core.tree import best_first_tree, path_ranks

    logprobs = torch.log_softmax(torch.randn(4, 11, generator=torch.Generator().manual_seed(1)), dim=-1)
    shape = TreeShape(topk=3, num_steps=4, num_draft_tokens=21)
    tokens, parents = best_first_tree(logprobs, shape)
    top_lp, top_ids = logprobs.topk(3, dim=-1)
    paths = [p for d in range(1, 5) for p in itertools.product(range(3), repeat=d)]
    score = {p: sum(float(top_lp[i, r]) for i, r in enumerate(p)) for p in paths}
    want = sorted(paths, key=lambda p: -score[p])[: shape.num_nodes]
    got = [path_ranks(parents, _path(parents, i)) for i in range(tokens.numel())]
    assert sorted(got) == sorted(want)
    for i, ranks in enumerate(got):
        assert int(tokens[i]) == int(top_ids[len(ranks) - 1, ranks[-1]])
    assert depths(parents).max() <= 4 and tokens.numel() == shape.num_nodes


def _path(parents: torch.Tensor, node: int) -> list[int]:
    out = []
    while node >= 0:
        out.append(node)
        node = int(parents[node])
    return out[::-1]


def test_chain_drafters_refuse_a_tree_clearly():
    model, tok = _tiny("llama")
    target = TargetModel(model, tok)
    ngram = drafters.get("ngram").load(SpeculativeConfig("ngram", None, 3), model, tok, ())
    with pytest.raises(ValueError, match="drafts chains only"):
        generate_speculative(
            target,
            ngram.new_proposer(GenerationConfig().draft_sampling(0)),
            [1, 2, 3],
            GenerationConfig(max_new_tokens=4),
            3,
            tree=TREE,
        )


# ------------------------------------------------------------------------------ counters and static trees


def test_tree_counters_and_the_best_static_tree():
    from draftsmith.core.generate import SpecStats
    from draftsmith.core.tree import best_static_tree, path_ranks, static_tree_tau

    assert path_ranks(PARENTS, [0, 3, 6]) == (0, 0, 0) and path_ranks(PARENTS, [2, 5]) == (2, 0)
    assert path_ranks(PARENTS, [0, 4]) == (0, 1) and path_ranks(PARENTS, []) == ()
    stats = SpecStats(k=3)
    for ranks in [(0, 0, 0), (0, 1), (1,), (0, 0), ()]:
        stats.record_tree(7, ranks)
    assert (stats.num_drafts, stats.num_draft_tokens, stats.num_accepted_tokens) == (5, 35, 8)
    assert stats.accepted_per_pos == [4, 3, 1] and stats.accepted_paths[(0,)] == 3
    merged = stats.merge(stats)
    assert merged.accepted_paths[(0, 0)] == 4 and merged.num_accepted_tokens == 16
    tree = best_static_tree(stats.accepted_paths, 3)
    assert tree == [(0,), (1,), (0, 0)]  # breadth-first; (0, 1) and (1,) tie at 1: the shorter is kept
    assert static_tree_tau(stats.accepted_paths, tree, stats.num_drafts) == pytest.approx(1 + (3 + 1 + 2) / 5)
    whole = best_static_tree(stats.accepted_paths, 10)
    assert static_tree_tau(stats.accepted_paths, whole, 5) == pytest.approx(stats.acceptance_length)


def test_eval_puts_the_tree_beside_the_chain_and_the_card_serves_it(tmp_path):
    """``eval --tree``: each tree-drafting row gets a ``+tree`` twin, decoded greedy-exact, one prompt at a time and
    in batches alike; the report carries the best static tree; the exported card gives the draftsmith, SGLang and
    vLLM static-tree commands."""
    from draftsmith.drafters.directory import write_card
    from draftsmith.evaluation.heldout import format_table
    from draftsmith.export.metadata import update_metadata
    from draftsmith.pipeline.stages import eval_rows, eval_summary, run_eval
    from test_eval import recipe_with

    model, tok = reference.target()
    spec = drafters.get("eagle3").example(model, tok, tmp_path / "head")
    head = spec.model
    tree = TreeShape(3, 3, 10)
    recipe = recipe_with(tmp_path, "drafter.num_speculative_tokens=3", "eval.drafters={}")
    assert list(eval_rows(recipe, head, tree=tree)) == ["eagle3", "eagle3+tree"]
    with pytest.raises(ValueError, match="no eval row drafts trees"):
        eval_rows(recipe_with(tmp_path, "drafter.method=ngram"), None, tree=tree)
    report = run_eval(recipe, head, model, tok, tree=tree)
    rows = report["tasks"]["code-complete"]
    assert report["config"]["trees"] == {"eagle3+tree": str(tree)}
    assert rows["eagle3+tree"]["greedy_mismatches"] == 0 and rows["eagle3"]["greedy_mismatches"] == 0
    assert len(rows["eagle3+tree"]["accepted_per_pos"]) == tree.num_steps
    static = report["static_trees"]["eagle3+tree"]
    assert static["num_nodes"] <= tree.num_nodes and static["tau_lower_bound"] <= static["dynamic_tau"] + 1e-9
    assert "eagle3+tree" in format_table(report)
    batched = run_eval(
        recipe_with(tmp_path / "b", "drafter.num_speculative_tokens=3", "eval.batch_size=2"),
        head,
        model,
        tok,
        tree=tree,
    )
    for c in ("tau", "accepted_per_pos", "num_drafts", "num_draft_tokens", "new_tokens"):
        assert batched["tasks"]["code-complete"]["eagle3+tree"][c] == rows["eagle3+tree"][c], c
    update_metadata(head, eval=eval_summary(report))
    card = write_card(head, report).read_text()
    assert "--speculative-eagle-topk 3 --speculative-num-draft-tokens 10" in card
    assert '"tree": {"topk": 3, "num_steps": 3, "num_draft_tokens": 10}' in card
    assert "speculative_token_tree" in card


def test_bench_serves_the_tree_beside_the_chain(tmp_path):
    """``draftsmith bench --tree``: each tree drafter's ``+tree`` twin is served over HTTP at every concurrency
    (trees verified per row in the batch), its greedy responses equal plain's, its acceptance read from /metrics."""
    from draftsmith.evaluation.bench import run_bench
    from draftsmith.evaluation.bench_config import BenchConfig, bench_methods, speculative_config

    model, tok = reference.target()
    head = drafters.get("eagle3").example(model, tok, tmp_path / "head").model
    tree = "topk=3,num_steps=3,num_draft_tokens=10"
    cfg = BenchConfig(
        target="reference",
        methods=["none", "eagle3", "ngram"],
        head=head,
        k=3,
        tree=tree,
        num_prompts=2,
        max_tokens=8,
        concurrency=[1, 2],
        rounds=1,
        threads=1,
        out=str(tmp_path / "bench"),
    )
    assert bench_methods(cfg) == ["none", "eagle3", "eagle3+tree", "ngram"]
    spec = speculative_config("eagle3+tree", cfg)
    assert spec["tree"] == TreeShape.parse(tree).to_dict() and "num_speculative_tokens" not in spec
    with pytest.raises(ValueError, match="none of the methods drafts trees"):
        bench_methods(BenchConfig(methods=["none", "ngram"], tree=tree))
    report = run_bench(cfg, model=model, tokenizer=tok)
    for row in report["methods"]["eagle3+tree"]["per_concurrency"]:
        assert row["failed"] == 0 and row["greedy_mismatches"] == 0 and row["baseline_mismatches"] == 0
        assert row["counters"]["draft_tokens"] > 0 and row["tau"] >= 1


# ------------------------------------------------------------------------------------------- static trees


def test_static_trees_parse_vllm_speculative_token_tree():
    shape = TreeShape.parse("[(0, 0), (0,), (1,)]")
    assert shape.is_static and shape.paths == ((0,), (1,), (0, 0))  # breadth-first, as vLLM sorts it
    assert (shape.topk, shape.num_steps, shape.num_draft_tokens) == (2, 2, 4)
    assert TreeShape.parse(str(shape)) == shape == TreeShape.parse(shape.to_dict())
    for bad, words in [
        ("[(0, 1)]", r"node \(0,\) is missing"),
        ("[(0,), (0,)]", "listed twice"),
        ("[(0,), (-1,)]", "ranks >= 0"),
        ("[(0,), oops]", "not a Python list"),
        ("[]", "non-empty list"),
    ]:
        with pytest.raises(ValueError, match=words):
            TreeShape.parse(bad)
    with pytest.raises(ValueError, match="dynamic trees only"):
        shape.sglang_args()
    spec = SpeculativeConfig.from_dict(
        {"method": "eagle3", "model": "runs/HEAD", "speculative_token_tree": "[(0,), (1,), (0, 0)]"}
    )
    assert spec.tree == shape and spec.num_speculative_tokens == 3  # vLLM: a static tree's k is its node count
    assert spec.to_dict()["speculative_token_tree"] == "[(0,), (1,), (0, 0)]"
    with pytest.raises(ValueError, match="not both"):
        SpeculativeConfig.from_dict(
            {
                "method": "eagle3",
                "model": "x",
                "speculative_token_tree": "[(0,)]",
                "tree": "topk=1,num_steps=1,num_draft_tokens=2",
            }
        )


@pytest.mark.parametrize("name", TREE_DRAFTERS)
def test_a_static_tree_of_the_dynamic_trees_nodes_drafts_the_same_tokens(tmp_path, name):
    """The rank paths of a drafted dynamic tree (EAGLE-2 / DDTree), served as a static tree, draft the same
    tokens and parents: the static expansion computes each node as the dynamic one did; and a static tree is
    greedy-exact end to end."""
    from draftsmith.core.tree import path_ranks

    model, tok = _tiny("llama")
    dynamic = TreeShape(3, 3, 12)
    engine = _tree_engine(model, tok, tmp_path, dynamic, name)
    prompt = torch.tensor([5, 6, 7, 8, 9, 5, 6, 7, 10, 11])
    step = engine.target.forward(prompt, engine.target.new_cache())
    proposer = engine.new_proposer(GenerationConfig())
    proposer.start(prompt, int(step.logits[-1].argmax()), step)
    drafted = proposer.propose_tree(dynamic, 3)
    ranks = [path_ranks(drafted.parents, _path(drafted.parents, i)) for i in range(drafted.tokens.numel())]
    # the chain (0, 0, 0) keeps the static tree 3 deep: a DFlash block's marginals depend on its length
    static = TreeShape.static(sorted(set(ranks) | {(0,), (0, 0), (0, 0, 0)}))
    again = proposer.propose_tree(static, 3)
    order = [static.paths.index(r) for r in ranks]  # the static tree lists the same nodes breadth-first
    assert again.tokens[order].tolist() == drafted.tokens.tolist()
    assert [path_ranks(again.parents, _path(again.parents, j)) for j in order] == ranks
    spec = drafters.get(name).example(model, tok, tmp_path / "again").with_tree(static)
    cfg = GenerationConfig(max_new_tokens=16)
    out = Engine(model, tok, spec).generate(prompt.tolist(), cfg)
    assert out.tokens == generate_plain(TargetModel(model, tok), prompt, cfg).tokens and out.stats.num_drafts > 0
