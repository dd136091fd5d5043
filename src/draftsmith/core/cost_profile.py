"""The startup profile behind adaptive speculation: a ``core.adaptive.CostModel`` measured on this machine.

    cost = profile_costs(target, proposer_factory, k_max=8, batch_sizes=[1, 2, 4, 8, 16, 32])

Both halves run the decode loop itself (``core.batch.BatchDecoder``), so they time what serving runs:
  - verify: B rows of ``context_len`` random tokens decode with a proposer that drafts exactly T - 1 random tokens
    per row (``_RandomDrafts``: no drafter work), for T = 1..k_max + 1; a step's ``VerifyStep.verify_s`` (the
    target forward over B x T tokens, verification and the cache commit) is the cost of (B, T);
  - draft: the same rows decode with the real proposer at K = 1..k_max drafts per row; ``VerifyStep.draft_s``
    (propose, and the accept of the previous step's positions) is the cost of (B, K).
The first drafting step starts every row's drafter over its context (``core.batch``'s lazy start): its seconds per
context position, the median over batch sizes, are the model's ``start_s_per_position``.
Each cell is the fastest of ``repeats`` steps after one warm-up step (a busy neighbour only adds time); then, per
batch size, an affine fit (least squares, slope >= 0: ``affine_fit``) over T >= 2 and over K replaces the cells, so
one noisy step does not make 4 drafts look cheaper than 3 (the raw times stay in ``meta``). Costs are nearly affine
there: a step reads the weights once (the intercept) and does work per token (the slope). T = 1 is kept as
measured: a one-token forward takes the matrix-vector path (no GEMM packing), so a two-token forward costs a
step more than the line through T >= 2 says (about 1.4x one token on an AVX512 CPU, ``bench/tree_cost.py``),
and fitting T = 1 with the rest would make plain decoding look dearer and speculation cheaper than they are.
Costs never decrease with B (a running maximum over batch sizes). The context grows by the accepted tokens during
a cell (random drafts: about one token per step), so costs are those of ~``context_len`` tokens of context; the
policy rescales them by what serving measures (``core.adaptive``).
"""

from __future__ import annotations

import statistics
import time
from typing import Callable, Sequence

import torch

from draftsmith.core.adaptive import Choice, CostModel
from draftsmith.core.batch import BatchDecoder, BatchSequence
from draftsmith.core.proposer import BatchProposer, Proposal
from draftsmith.core.sequence import GenerationConfig, VerifyStep
from draftsmith.core.target import TargetModel
from draftsmith.core.tree import TreeShape


class _Schedule:
    """A step policy that drafts a k the profile sets (``core.batch.StepPolicy``)."""

    def __init__(self):
        self.k = 0

    def new_request(self) -> None:
        return None

    def choose(self, rows, batch_size=None, waiting=0) -> Choice:
        return Choice(self.k, 0.0)

    def observe(self, request, num_proposed: int, num_accepted: int) -> None:
        return None

    def finish(self, request) -> None:
        return None

    def observe_step(self, *args, **kwargs) -> None:
        return None


class _RandomDrafts(BatchProposer):
    """Drafts k random token ids per row (greedy: q None); reads nothing, learns nothing."""

    def __init__(self, vocab_size: int, seed: int = 0):
        self.vocab_size = vocab_size
        self.generator = torch.Generator().manual_seed(seed)

    def start(self, key, prompt_ids, first_token, target_step, sampling) -> None:
        return None

    def propose(self, keys, ks) -> list[Proposal]:
        return [Proposal(torch.randint(self.vocab_size, (k,), generator=self.generator)) for k in ks]

    def accept(self, keys, n_accepted, emitted, step) -> None:
        return None


def affine_fit(xs: Sequence[float], ys: Sequence[float]) -> list[float]:
    """Least-squares a + b * x at each x (b clipped at 0, then a refitted; a >= 0): a smoothed ``ys``."""
    n = len(xs)
    if n < 2:
        return list(ys)
    mx, my = sum(xs) / n, sum(ys) / n
    var = sum((x - mx) ** 2 for x in xs)
    b = max(0.0, sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / var) if var else 0.0
    a = max(0.0, my - b * mx)
    return [a + b * x for x in xs]


def _measure(
    target: TargetModel,
    proposer: BatchProposer,
    batch_size: int,
    ks: Sequence[int],
    read: Callable[[VerifyStep], float],
    context_len: int,
    repeats: int,
    tree: TreeShape | None,
) -> tuple[list[float], float]:
    """The fastest ``read(step)`` of ``repeats`` steps (after a warm-up) at each k of ``ks``, for ``batch_size``
    rows of random context decoding together; and the seconds per context position of the drafter starts the
    first drafting step made (every row starts there: ``core.batch``'s lazy start; a free catch-up starts them at
    the first step), 0 when none."""
    schedule = _Schedule()
    k_max = max(ks)
    decoder = BatchDecoder(
        target,
        proposer,
        k_max,
        max_num_seqs=batch_size,
        max_num_batched_tokens=max(2048, batch_size * (context_len + k_max + 1)),
        tree=tree,
        policy=schedule,
    )
    generator = torch.Generator().manual_seed(batch_size)
    seen: list[VerifyStep] = []
    steps = len(ks) * (repeats + 1)
    cfg = GenerationConfig(max_new_tokens=steps * (k_max + 1) + 2, ignore_eos=True)
    for _ in range(batch_size):
        prompt = torch.randint(target.vocab_size, (context_len,), generator=generator)
        decoder.add(BatchSequence(prompt, cfg, on_step=seen.append))
    decoder.step()  # prefill every row (and the first verify step at k = 0)
    out, start = [], 0.0
    if decoder._start_positions:  # a free catch-up (n-gram) starts every row before the first choice
        start = decoder._start_s / decoder._start_positions
    for k in ks:
        schedule.k = k
        samples = []
        for i in range(repeats + 1):
            seen.clear()
            decoder.step()
            if decoder._start_positions and not start:
                start = decoder._start_s / decoder._start_positions
            if i and seen:
                samples.append(read(seen[0]))  # a step's times are shared by its rows
        out.append(min(samples) if samples else 0.0)
    decoder.abort(RuntimeError("profile done"))
    return out, start


@torch.inference_mode()
def profile_costs(
    target: TargetModel,
    make_proposer: Callable[[], BatchProposer],
    k_max: int,
    batch_sizes: Sequence[int],
    *,
    context_len: int = 128,
    repeats: int = 3,
    tree: TreeShape | None = None,
    meta: dict | None = None,
) -> CostModel:
    """Measure verify and draft costs (module docstring) at every batch size of ``batch_sizes``.

    Args:
        target: the wrapped target (with the aux layers the proposer reads). make_proposer: a fresh
            ``BatchProposer`` of the drafter. k_max: most drafts per row measured (a tree: its depth).
        batch_sizes: B values to measure (ascending; others are interpolated). context_len: prompt tokens per row.
        repeats: timed steps per cell (median). tree: draft trees of this shape (verify reads min(K * topk,
            num_nodes) tokens per row then). meta: recorded in the model (the cache key's fields).

    Raises:
        ValueError: k_max < 1, no batch size, or context_len + the profile's tokens beyond the target's limit.
    """
    if k_max < 1 or not batch_sizes:
        raise ValueError(f"a profile needs k_max >= 1 and a batch size, got {k_max}, {list(batch_sizes)}")
    sizes = sorted(set(int(b) for b in batch_sizes))
    ks = list(range(1, k_max + 1))
    reads = [min(k * tree.topk, tree.num_nodes) for k in ks] if tree is not None else ks
    verify_tokens = sorted({1, *(1 + r for r in reads)})
    t0 = time.perf_counter()
    raw_v, raw_d, starts = [], [], []
    for b in sizes:
        raw_v.append(
            _measure(
                target, _RandomDrafts(target.vocab_size), b, [t - 1 for t in verify_tokens],
                lambda s: s.verify_s, context_len, repeats, None,
            )[0]
        )  # fmt: skip
        drafts, start = _measure(target, make_proposer(), b, ks, lambda s: s.draft_s, context_len, repeats, tree)
        raw_d.append(drafts)
        starts.append(start)
    info = dict(meta or {})
    info["measured_start_s_per_position"] = starts
    info["profile_seconds"] = round(time.perf_counter() - t0, 2)
    info["measured_verify_s"], info["measured_draft_s"] = raw_v, raw_d
    verify_s = [row[:1] + [max(row[0], v) for v in affine_fit(verify_tokens[1:], row[1:])] for row in raw_v]
    draft_s = [affine_fit(ks, row) for row in raw_d]
    for table in (verify_s, draft_s):  # never cheaper with more rows
        for b in range(1, len(table)):
            table[b] = [max(a, c) for a, c in zip(table[b - 1], table[b])]
    start_s = statistics.median(starts)  # a start reads one row: its cost per position does not depend on B
    return CostModel(sizes, verify_tokens, verify_s, ks, draft_s, context_len, info, start_s)
