"""The stub target of the losslessness tests and the chi-square helpers they share (``test_lossless_sampling``,
``test_contract``).

The target is a stub causal LM with an 8-token vocabulary whose next-token logits are a fixed random table
indexed by the last two tokens (``TrigramLM``). It keeps those tokens in a real transformers ``DynamicCache``
through ``core/cache.py``, so a wrong rollback changes its outputs. Its exact law of the first ``NEW`` tokens
after the prompt is a product of table rows, computed here without sampling (``exact_law``). Its config is a
``LlamaConfig`` and ``word_tokenizer`` gives it a tokenizer, so every drafter's ``example`` can be built for it.

Counts of every adjacent pair of positions (t_i, t_{i+1}) are tested (scipy, cells expecting < 5 pooled) against
the exact law and against plain-sampling counts (two-sample homogeneity); a test fails when p < ``ALPHA``.
"""

from __future__ import annotations

import math
from types import SimpleNamespace

import torch
from scipy.stats import chi2_contingency, chisquare
from torch import nn
from transformers import LlamaConfig

from draftsmith.core.generate import SpecStats
from draftsmith.core.sampling import logits_to_probs

V, H, LAYERS = 8, 16, 8  # 8 layers: EAGLE-3's default aux layers (2, 4, 5) are distinct
K, NEW = 3, 5  # one verify pass covers t2..t5 when all 3 drafts are accepted
TRIALS = 2000
ALPHA = 1e-3


class TrigramLM(nn.Module):
    """Stub causal LM: logits after token x_t are ``table[x_{t-1}, x_t]`` (x_{-1} = 0), for a [V, V, V] table.

    Called like a transformers causal LM by ``TargetModel``: ``model(input_ids=[B, T], position_ids,
    output_hidden_states, cache=..., attention_mask=None or 4D, logits_to_keep)``. The tokens read so far are
    stored as the keys of every cache layer, so the previous token comes from the cache (a bad crop or a bad
    per-row mask shows). ``hidden_states`` (LAYERS + 1 tensors [B, T, H]) are fixed random embeddings of each
    token per layer, enough to drive an EAGLE-3 head.
    """

    def __init__(self, table: torch.Tensor, seed: int = 0):
        super().__init__()
        self.config = LlamaConfig(
            vocab_size=V,
            hidden_size=H,
            intermediate_size=2 * H,
            num_hidden_layers=LAYERS,
            num_attention_heads=2,
            num_key_value_heads=1,
            head_dim=8,
            max_position_embeddings=64,
            tie_word_embeddings=False,
            eos_token_id=None,
            pad_token_id=None,
            bos_token_id=None,
        )
        gen = torch.Generator().manual_seed(seed)
        self.table = table
        self.embed = nn.Embedding(V, H)
        self.lm_head = nn.Linear(H, V, bias=False)
        self.norm = nn.RMSNorm(H)  # what a draft model warm-starts from (get_decoder().norm)
        self.config._name_or_path = "trigram-stub"
        self.layer_states = nn.Parameter(torch.randn(LAYERS + 1, V, H, generator=gen), requires_grad=False)

    def get_input_embeddings(self):
        return self.embed

    def get_output_embeddings(self):
        return self.lm_head

    def get_decoder(self):
        return self

    def forward(
        self,
        input_ids,
        position_ids=None,
        output_hidden_states=False,
        cache=None,
        use_cache=True,
        attention_mask=None,
        logits_to_keep=0,
    ):
        """``input_ids [B, T]``; the token before each query is the latest key it attends to (a 4D
        ``attention_mask`` of the batched runtime: bool, or additive with 0 = attend), so a wrong per-row
        rollback or mask changes the logits."""
        b, t = input_ids.shape
        for layer in range(LAYERS):
            new = input_ids.float().view(b, 1, t, 1)
            keys, _ = cache.update(new, new, layer)
        keys = keys[:, 0, :, 0].long()  # [B, S+T]: every cached token
        s = keys.shape[1] - t
        if attention_mask is None:
            attend = torch.ones(t, s + t, dtype=torch.bool).tril(diagonal=s)[None].expand(b, -1, -1)
        else:
            mask = attention_mask[:, 0]
            attend = mask if mask.dtype == torch.bool else mask == 0  # [B, T, S+T]
        own = torch.arange(s, s + t)  # each query's own slot
        earlier = attend & (torch.arange(s + t)[None, None, :] < own[None, :, None])
        slot = torch.where(earlier, torch.arange(s + t), -1).max(dim=-1).values  # [B, T]: latest attended key
        prev = torch.where(slot >= 0, keys.gather(1, slot.clamp_min(0)), 0)
        hidden = tuple(self.layer_states[i][input_ids] for i in range(LAYERS + 1)) if output_hidden_states else None
        logits = self.table[prev, input_ids]  # [B, T, V]
        final = self.layer_states[LAYERS][input_ids]
        if isinstance(logits_to_keep, torch.Tensor):
            logits, final = logits[:, logits_to_keep], final[:, logits_to_keep]
        elif logits_to_keep:
            logits, final = logits[:, -logits_to_keep:], final[:, -logits_to_keep:]
        self.lm_head(final)  # applied once like a real LM's head: the MLP speculator reads its input
        # (TargetModel final_hidden); the logits still come from the table
        return SimpleNamespace(logits=logits, hidden_states=hidden)


def _table(seed: int, scale: float = 1.5) -> torch.Tensor:
    return scale * torch.randn(V, V, V, generator=torch.Generator().manual_seed(seed))


TARGET_TABLE = _table(0)
DRAFT_TABLE = TARGET_TABLE + _table(1, scale=1.0)  # close to the target: drafts accepted often, not always


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
    p = logits_to_probs(TARGET_TABLE, **settings)  # [V, V, V]: p[a, b] = law of the token after a, b
    law = p[PROMPT[-2], PROMPT[-1]]  # [V]      law of t1
    law = law[:, None] * p[PROMPT[-1]]  # [V, V]   law of t1 t2
    for _ in range(NEW - 2):  # [V] * n  times p[t_{n-1}, t_n, t_{n+1}]
        law = law[..., None] * p.reshape((1,) * (law.dim() - 2) + (V, V, V))
    return law


def processed_law(settings: dict) -> torch.Tensor:
    """P(t1..t_NEW | PROMPT) as a [V] * NEW tensor with vLLM's context-dependent processing, enumerating every
    prefix (V^NEW = 32768 sequences), written from vLLM's formulas independently of ``core.processors``:

      min_tokens   logits of ``stop_token_ids`` are -inf while fewer than min_tokens tokens were generated
                   (``MinTokensLogitsProcessor``); a stop id drawn later ends the sequence, so the settings must
                   keep every sequence NEW long (min_tokens >= NEW - 1);
      repetition   a token in PROMPT or the prefix: logit / penalty if > 0, else * penalty (``apply_penalties``);
      frequency, presence   logit -= f * count, p * [count > 0] over the prefix only;
    then temperature / min_p / top-k / top-p (``logits_to_probs``)."""
    s = dict(settings)
    rep, freq, pres = s.pop("repetition_penalty", 1.0), s.pop("frequency_penalty", 0.0), s.pop("presence_penalty", 0.0)
    min_tokens, stops = s.pop("min_tokens", 0), list(s.pop("stop_token_ids", ()))
    assert not stops or min_tokens >= NEW - 1, "a stop id drawn early would end sequences before NEW tokens"
    prefixes = torch.zeros(1, 0, dtype=torch.long)  # [N, j]
    probs = torch.ones(1, dtype=torch.float64)  # [N]
    for j in range(NEW):
        context = torch.cat([torch.tensor(PROMPT).expand(prefixes.shape[0], -1), prefixes], dim=1)
        logits = TARGET_TABLE[context[:, -2], context[:, -1]].clone()  # [N, V]
        if j < min_tokens and stops:
            logits[:, stops] = float("-inf")
        counts = torch.stack([torch.bincount(row, minlength=V) for row in prefixes]) if j else torch.zeros(1, V)
        in_prompt = torch.bincount(torch.tensor(PROMPT), minlength=V) > 0
        seen = (counts > 0) | in_prompt
        logits = torch.where(seen & (logits > 0), logits / rep, torch.where(seen, logits * rep, logits))
        logits = logits - freq * counts - pres * (counts > 0).float()
        p = logits_to_probs(logits, **s).double()  # [N, V]
        probs = (probs[:, None] * p).reshape(-1)
        prefixes = torch.cat([prefixes.repeat_interleave(V, 0), torch.arange(V).repeat(prefixes.shape[0])[:, None]], 1)
    return probs.reshape((V,) * NEW).float()


def word_tokenizer():
    """A whitespace word tokenizer of the stub's V tokens ``t0`` .. ``t7``, no special tokens (none ends a
    sequence: every trial decodes ``NEW`` tokens)."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    backend = Tokenizer(models.WordLevel({f"t{i}": i for i in range(V)}, unk_token="t0"))
    backend.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    return PreTrainedTokenizerFast(tokenizer_object=backend, unk_token="t0")


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


class ScriptedPolicy:
    """A step policy (``core.batch.StepPolicy``) for tests: step i drafts ``ks[i]`` in every row (past the end, the
    last k again; default: plain decoding throughout). It records what the decoder tells it: ``rows`` (each
    ``choose``'s rows), ``chosen`` (each step's k), ``observed`` ((depth asked, accepted) per row and step) and
    ``steps`` (each ``observe_step``'s positional arguments) and ``step_kwargs`` (its keyword arguments)."""

    def __init__(self, ks=(0,)):
        self.ks = list(ks)
        self.rows: list[list] = []
        self.chosen: list[int] = []
        self.observed: list[tuple[int, int]] = []
        self.steps: list[tuple] = []
        self.step_kwargs: list[dict] = []

    def new_request(self):
        return None

    def next_k(self) -> int:
        """This step's k."""
        return self.ks[min(len(self.chosen), len(self.ks) - 1)]

    def choose(self, rows, batch_size=None, waiting=0):
        from draftsmith.core.adaptive import Choice

        self.rows.append(list(rows))
        self.chosen.append(self.next_k())
        return Choice(self.chosen[-1], 0.0)

    def observe(self, request, num_proposed: int, num_accepted: int) -> None:
        self.observed.append((num_proposed, num_accepted))

    def finish(self, request) -> None:
        pass

    def observe_step(self, *args, **kwargs) -> None:
        self.steps.append(args)
        self.step_kwargs.append(kwargs)


class RandomSchedule(ScriptedPolicy):
    """A step policy drafting a random k in 0..k_max each step (0 half the time), from its own seeded generator: a
    function of nothing the drafts hold, as adaptive speculation's choice must be, so every output invariant holds
    under it; it exercises plain steps, deferred accepts and catch-up."""

    def __init__(self, k_max: int, seed: int = 0):
        super().__init__()
        self.k_max, self.generator = k_max, torch.Generator().manual_seed(seed)

    def next_k(self) -> int:
        plain = bool(torch.rand((), generator=self.generator) < 0.5)
        return 0 if plain else int(torch.randint(1, self.k_max + 1, (), generator=self.generator))


def run_trials(
    target, make_proposer, settings: dict, trials: int = TRIALS, k: int = K, tree=None, policy=None
) -> tuple[torch.Tensor, SpecStats]:
    """Sequences ``[trials, NEW]`` decoded from ``PROMPT`` with target seeds 0..trials-1, and the summed counters.

    ``target``: a ``core.target.TargetModel``; ``make_proposer(seed)``: a fresh proposer for the trial seeded
    ``seed`` (drawing with ``settings``), or None for plain sampling. ``tree``: draft trees of that shape
    (``core.tree.TreeShape``; k is then its depth). ``policy``: choose each step's k live (``RandomSchedule``)."""
    from draftsmith.core.generate import GenerationConfig, generate_plain, generate_speculative

    k = tree.num_steps if tree is not None else k
    stats = SpecStats(k=k)
    out = torch.empty(trials, NEW, dtype=torch.long)
    for seed in range(trials):
        cfg = GenerationConfig(max_new_tokens=NEW, seed=seed, **settings)
        if make_proposer is None:
            result = generate_plain(target, PROMPT, cfg)
        else:
            result = generate_speculative(target, make_proposer(seed), PROMPT, cfg, k, tree=tree, policy=policy)
            stats = stats.merge(result.stats)
        out[seed] = torch.tensor(result.tokens)
    return out, stats


def run_trials_batched(
    target, batch_proposer, settings: dict, batch_size: int, trials: int = TRIALS, k: int = K, tree=None, policy=None
) -> tuple[torch.Tensor, SpecStats]:
    """As ``run_trials``, decoded ``batch_size`` trials at a time by the batched runtime (``core.batch``): trial
    ``seed`` samples with target seed ``seed`` and drafter seed ``draft_seed(seed)``; ``batch_proposer`` serves
    every row (None: plain sampling). Rows join as earlier ones finish (continuous batching)."""
    from draftsmith.core.batch import generate_batch
    from draftsmith.core.generate import GenerationConfig
    from draftsmith.drafters.base import draft_seed

    cfgs = [GenerationConfig(max_new_tokens=NEW, seed=seed, **settings) for seed in range(trials)]
    samplings = [cfg.draft_sampling(draft_seed(seed)) for seed, cfg in enumerate(cfgs)]
    results = generate_batch(
        target,
        batch_proposer,
        [PROMPT] * trials,
        cfgs,
        k if batch_proposer is not None else 0,
        samplings=samplings,
        max_num_seqs=batch_size,
        tree=tree,
        policy=policy,
    )
    stats = SpecStats(k=tree.num_steps if tree is not None else k)
    for r in results:
        if r.stats is not None:
            stats = stats.merge(r.stats)
    return torch.tensor([r.tokens for r in results]), stats


def check_lossless(seqs: torch.Tensor, plain: torch.Tensor, settings: dict, law: torch.Tensor | None = None) -> None:
    """Every adjacent pair (t_i, t_i+1) of ``seqs`` matches the exact law (default ``exact_law(settings)``) and the
    ``plain`` sample (p > ALPHA)."""
    law = exact_law(settings) if law is None else law
    trials = seqs.shape[0]
    for i in range(NEW - 1):
        expected = trials * pair_law(law, i)
        assert pooled_pvalue(pair_counts(seqs, i), expected) > ALPHA, f"(t{i + 1}, t{i + 2}) vs the exact law"
        p_two = homogeneity_pvalue(pair_counts(seqs, i), pair_counts(plain, i), expected)
        assert p_two > ALPHA, f"(t{i + 1}, t{i + 2}) vs plain sampling"
