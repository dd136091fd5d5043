"""Many sequences per step: batched speculative verification with rows joining and leaving between steps.

One ``BatchDecoder.step()``:
  1. rows that finished or were cancelled leave (their cache rows and drafter state are dropped);
  2. newcomers are prefilled within the step's token budget (``max_num_batched_tokens`` minus the tokens the
     running rows read this step): whole prompts that fit are prefilled together in one ragged forward (while
     padding to the longest adds at most ``PREFILL_PADDING``; logits of each row's last token only); the
     first that does not fit is prefilled in chunks over several steps (chunked prefill), so running rows
     never wait more than one budget's worth of prefill. A prefilled row takes its first token from the target
     and joins the running batch; its drafter starts (``BatchProposer.start``) when the row first drafts
     (below). A fixed k reserves 1 + k tokens per running row; with a ``policy`` a row reserves 1 + the depth
     the policy chose last step (its best guess at this one), and this step's choice is capped to what the
     prefill left, so the step still reads at most the budget (reserving k_max = 8 per row while auto decodes
     plain would leave a batch of long prompts less prefill per step than plain decoding has);
  3. running rows: each asks for k'_b = min(k, max_new_tokens_b - emitted_b - 1) drafts (``BatchProposer.
     propose``: one call for the batch); ONE target forward reads [last token_b, d_b1..d_bk'] for every row
     (``TargetModel.forward_batch``: padded, per-row positions and masks); each row is verified alone (greedy or
     rejection sampling with its own p, q, generator: ``verify.py``), keeps 1 + n_b slots of the cache
     (``BatchKVCache.commit``: per-row rollback), records its counters and appends its tokens through the same
     stop rules as one sequence (``sequence.Emitted``).

With a ``policy`` (``core.adaptive.AdaptivePolicy``: ``"num_speculative_tokens": "auto"``) step 3 first chooses one
k for the batch (0 allowed: a plain step) from the rows' live acceptance estimates and the measured cost model, and
each row's verify outcome updates its estimate; every step also reports its measured seconds (verify, drafts and
accepts, starts, emitting its tokens, and the time between the previous step and this one, prefill excluded:
``StepPolicy.observe_step``). A row that drafts nothing in a step does not call the proposer:
its verified positions wait (``BatchSequence.pending``) and reach ``BatchProposer.accept`` as ONE call, before the
row's next ``propose`` (or once ``PENDING_LIMIT`` tokens wait): several plain steps are one context extension of
n + 1 positions, which every proposer reads as after a verify step that accepted n drafts. So a plain step costs
the drafter nothing, and a drafter catches up in one forward when drafting resumes (with a policy, the choice is
offered each row's positions waiting, and that catch-up's seconds are reported apart from the drafts'). Accepts
are deferred so for
every row (a fixed k too): the accept of a row's last step, after which it leaves, is never made.

The drafter's start is deferred the same way (lazy start): a row's prefill states wait with its pending positions,
and the row's first draft starts its drafter ONCE over the whole context so far (prompt + every token read since:
``start(prompt + read, last emitted, prefill + pending states)``, which every proposer reads as a start followed
by accepts: it depends on the context only). So a row that never drafts (``auto`` choosing plain decoding
throughout, or no drafts left to ask for) costs its drafter nothing, not even a prefill; a row that has not
started holds at most ``START_LIMIT`` pending positions (then it starts); with a policy a started row does too,
so a run of plain steps costs its drafter nothing until the row drafts again (flushing every ``PENDING_LIMIT``
positions caught up rows that never drafted again: ~2% of the decode time of DFlash on code-edit at concurrency 8,
where ``auto`` drafted in 10% of its steps). Until it starts, a row holds the target
states its drafter will read (aux ``[T, 3H]`` for EAGLE-3 and DFlash, final ``[T, H]`` for the MLP speculator),
where an eager start would hold the drafter's own cache of those positions instead (for a one-layer EAGLE-3 head,
2/3 of that). With a policy and
a proposer that has a confidence (``has_confidence``: an EAGLE-3 head's top probability), a row that drafted in its
last step is brought up to date before the choice, so that the drafter's confidence in its next draft
(``BatchProposer.confidence``) can inform it; with a proposer whose catch-up is free (``free_catch_up``: n-gram
lookup, no forward) every row is, started or not. Other proposers keep such a row's positions waiting until it
drafts again, as after a plain step (an accept at each plain step that followed a drafting one cost DFlash
~2 ms at 4 rows, in the drain of a closed batch of 8 where auto drafted single steps).

With a ``tree`` (``core.tree.TreeShape``) each running row drafts a tree instead (``BatchProposer.propose_tree``):
the verify forward reads [last token_b, its nodes] with ancestor-only attention (``BatchKVCache.begin``), each row
walks its tree (``verify_tree_greedy`` / ``verify_tree_sampling``), the cache keeps the root and the accepted path
(``BatchKVCache.commit`` with indices) and the proposer's ``accept`` reads those rows only
(``BatchTargetStep.gather``), as after a chain.

Row independence (tested): a row's drafts, p, q, random draws, stops and cache depend on that row only, so its
output equals the same request decoded alone, whatever else is in the batch, up to the rounding of batched
kernels (a GEMM's per-row result may depend on the batch size by ~1e-6 relative: on targets whose greedy argmax
margins exceed that, tokens are identical; the bench counts every greedy response against the one served
alone). A callback that raises ends its own row only (``BatchSequence.error``).
"""

from __future__ import annotations

import itertools
import time
from dataclasses import dataclass, field, replace
from typing import Callable, Protocol, Sequence

import torch

from draftsmith.core.adaptive import Choice
from draftsmith.core.batch_cache import BatchKVCache
from draftsmith.core.proposer import BatchProposer, Proposal, Sampling
from draftsmith.core.sampling import draft_seed, seeded_generator
from draftsmith.core.sequence import (
    Emitted,
    GenerationConfig,
    GenerationResult,
    SpecStats,
    VerifyStep,
    as_prompt,
    check_length,
    check_proposal,
    next_token,
)
from draftsmith.core.target import BatchTargetStep, TargetModel, TargetStep
from draftsmith.core.tree import (
    TreeShape,
    depths,
    path_ranks,
    path_tokens,
    verify_tree_greedy,
    verify_tree_sampling,
)
from draftsmith.core.verify import verify_greedy, verify_sampling

_keys = itertools.count()
PREFILL_PADDING = 1.25  #: newcomers are prefilled together while padding adds at most 25% to their tokens
PENDING_LIMIT = 32  #: a row's deferred positions reach its proposer once this many wait (bounded memory)
START_LIMIT = 1024  #: a row whose drafter has not started holds at most this many pending positions (0: start at
#: prefill, eagerly)


class StepPolicy(Protocol):
    """What ``BatchDecoder`` asks each step when the amount to draft is chosen live (``core.adaptive``)."""

    def new_request(self) -> object:
        """Per-request state, kept in ``BatchSequence.estimate``."""

    def choose(
        self,
        rows: Sequence[tuple[object, int, float | None, int, int, int]],
        batch_size: int | None = None,
        waiting: int = 0,
    ) -> Choice:
        """k for this step, given each running row's (state, most drafts it may ask for, the drafter's confidence
        in its next draft or None, context positions its drafter must read to start: 0 once started, tokens it may
        still emit: what max_new_tokens leaves, positions its started drafter must catch up on: those its plain
        steps left);
        ``batch_size``: the rows the batch will decode with once the waiting requests have joined (running +
        waiting, at most ``max_num_seqs``); ``waiting``: the requests waiting to join (0: the batch drains)."""

    def observe(self, request: object, num_proposed: int, num_accepted: int) -> None:
        """One row's verify outcome: the depth it asked its drafter for (0: a plain step) and the drafts accepted.
        The depth asked, not the depth drafted: the choice prices E(k) tokens for asking k, so a draft the drafter
        did not make (an n-gram's match shorter than k, or none) must count as a rejection there."""

    def finish(self, request: object) -> None:
        """A request left the batch (finished, stopped, cancelled or failed; not a whole batch's ``abort``);
        ``request``: its state."""

    def observe_step(
        self,
        batch_size: int,
        tokens_per_row: int,
        drafting: int,
        k: int,
        verify_s: float,
        draft_s: float,
        start_s: float = 0.0,
        start_positions: int = 0,
        between_s: float | None = None,
        emit_s: float = 0.0,
        emitted: int = 0,
        *,
        catch_up_s: float = 0.0,
        catch_up_rows: int = 0,
        catch_up_positions: int = 0,
    ) -> None:
        """One step's measured seconds: the verify forward (rows, padded tokens per row), the proposer's drafts
        and accepts (but catch-ups), and the drafter starts (lazy: a row's first draft) made in the step over
        ``start_positions`` context positions in all; ``catch_up_s``: the accepts of ``catch_up_rows`` drafting rows
        over the ``catch_up_positions`` positions their plain steps left; ``between_s``: the seconds between the
        previous step's end and this step's start, prefill excluded (the scheduler's and the server's work between
        steps; None when the decoder was idle in between); ``emit_s``: the seconds this step spent emitting its
        ``emitted`` tokens (the stop rules and the requests' callbacks: a server's detokenizing and streaming)."""


@dataclass(eq=False)
class BatchSequence:
    """One request in a ``BatchDecoder``.

    Args:
        prompt_ids: ``[T]`` token ids. cfg: its decoding settings (temperature, seed, stops, max_new_tokens).
        sampling: how its drafts are drawn (default: ``cfg.draft_sampling(draft_seed(cfg.seed))``, as the engine
            does); the request's processors (``cfg.processors``: min_tokens, penalties) are bound to it when it
            has none, so every drafter's q follows them.
        on_tokens: called with each emitted chunk after the stop rules; an exception it raises ends THIS row
            (kept in ``error``), as in ``generate_speculative``.
        on_step: called with each verify step of this row (``sequence.VerifyStep``; draft_s / verify_s are the
            whole batch step's, shared by its rows), before its tokens reach ``on_tokens``.

    Attributes:
        key: the row's id for the proposer. tokens: emitted so far. stats: its speculation counters.
        finish_reason: 'stop' / 'length' once finished by a stop rule, else None. stop_reason: the stop token id
            that ended it when not an EOS id (``sequence.Emitted``). error: what a callback raised (or
            ``cancel``'s reason). done: finished, failed or cancelled. result: ``GenerationResult`` once done
            (without ``error``). processors: the request's ``core.processors.SequenceProcessors`` or None.
        queued_s, scheduled_s, first_token_s, last_token_s, finished_s: ``time.perf_counter()`` when it was queued
            (``BatchDecoder.add``, unless the caller set it earlier), when its first prefill chunk was read, when
            its first and its latest tokens were emitted, when it ended (None until then); the engine's metrics
            read them (vLLM's QUEUED / SCHEDULED / NEW_TOKENS events, ``vllm/v1/metrics/stats.py``).
        estimate: the decoder policy's per-request state (``core.adaptive.AcceptanceEstimate``), or None.
        started: its drafter has started (``BatchProposer.start``; lazy: at its first draft, module docstring).
        pending: verified positions not yet given to the proposer: (emitted ``[n+1]``, aux ``[n+1, 3H]`` or None,
            final ``[n+1, H]`` or None) per step since its last ``accept`` (module docstring).
    """

    prompt_ids: object
    cfg: GenerationConfig
    sampling: Sampling | None = None
    on_tokens: Callable[[list[int]], None] | None = None
    on_step: Callable[[VerifyStep], None] | None = None
    key: int = field(default_factory=lambda: next(_keys))
    error: BaseException | None = None
    done: bool = False
    result: GenerationResult | None = None
    queued_s: float | None = None
    scheduled_s: float | None = None
    first_token_s: float | None = None
    last_token_s: float | None = None
    finished_s: float | None = None

    def __post_init__(self):
        self.prompt = as_prompt(self.prompt_ids)
        self.out = Emitted(self.cfg, self.on_tokens)
        self.processors = self.cfg.processors(self.prompt, self.out.tokens)
        if self.sampling is None:
            self.sampling = self.cfg.draft_sampling(draft_seed(self.cfg.seed))
        if self.processors is not None and self.sampling.processors is None:
            self.sampling = replace(self.sampling, processors=self.processors)
        self.stats: SpecStats | None = None
        self.forwards = 0
        self.prefilled = 0  # prompt tokens the target has read
        self.cache: BatchKVCache | None = None  # own cache while prefilled in chunks
        self.aux_chunks: list[torch.Tensor] = []
        self.final_chunks: list[torch.Tensor] = []
        self.generator: torch.Generator | None = None
        self.started = False  # its drafter has started (proposer.start)
        self.prefill: TargetStep | None = None  # its prefill's states, until its drafter starts
        self.estimate: object | None = None
        self.drafted_last = False  # the row drafted in its latest verify step
        self.pending: list[tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]] = []
        self.pending_positions = 0  # positions in ``pending``

    @property
    def tokens(self) -> list[int]:
        return self.out.tokens

    @property
    def finish_reason(self):
        return self.out.finish_reason

    @property
    def stop_reason(self) -> int | None:
        return self.out.stop_reason


class BatchDecoder:
    """Continuous batching over one target and (optionally) one ``BatchProposer``.

    Args:
        target: the wrapped target (with the aux layers the proposer reads).
        proposer: drafts for every row, or None (plain decoding: each step reads one token per row).
        k: most drafts per row per step (>= 0).
        max_num_seqs: most rows running at once (vLLM ``--max-num-seqs``); newcomers wait beyond it.
        max_num_batched_tokens: tokens one step may read, decode rows and prefill chunks together (vLLM
            ``--max-num-batched-tokens``); a step always makes progress (at least one prefill token when nothing
            runs).
        tree: draft trees of this shape instead of chains of k (``core.tree.TreeShape``; counters then run over
            ``tree.num_steps`` depths); None: chains.
        policy: chooses each step's k (at most k, a tree's depth at most its ``num_steps``) for the batch
            (``core.adaptive.AdaptivePolicy``); None: every row drafts k each step.

    Raises:
        ValueError: k < 0, max_num_seqs < 1, max_num_batched_tokens < 1, a proposer reading aux states of
            a target built without ``aux_layer_ids``, or a tree or a policy without a proposer.
    """

    def __init__(
        self,
        target: TargetModel,
        proposer: BatchProposer | None,
        k: int = 0,
        *,
        max_num_seqs: int = 64,
        max_num_batched_tokens: int = 2048,
        tree: TreeShape | None = None,
        policy: StepPolicy | None = None,
    ):
        if k < 0:
            raise ValueError(f"k must be >= 0, got {k}")
        if max_num_seqs < 1 or max_num_batched_tokens < 1:
            raise ValueError(
                f"max_num_seqs and max_num_batched_tokens must be >= 1, got {max_num_seqs}, {max_num_batched_tokens}"
            )
        if proposer is not None and proposer.needs_aux_hidden and target.aux_layer_ids is None:
            raise ValueError(
                f"{type(proposer).__name__} reads the target's aux hidden states: build the "
                f"TargetModel with aux_layer_ids (e.g. from the head's config)"
            )
        if tree is not None and proposer is None:
            raise ValueError("a draft tree needs a proposer (plain decoding drafts nothing)")
        if policy is not None and proposer is None:
            raise ValueError("adaptive speculation needs a proposer (plain decoding drafts nothing)")
        self.target, self.proposer, self.tree, self.policy = target, proposer, tree, policy
        self.k = (tree.num_steps if tree is not None else k) if proposer is not None else 0
        self.max_num_seqs, self.max_num_batched_tokens = max_num_seqs, max_num_batched_tokens
        self.final_hidden = bool(proposer is not None and proposer.needs_final_hidden)
        self.free_catch_up = bool(getattr(proposer, "free_catch_up", False))  # ``Proposer.free_catch_up``
        self.has_confidence = bool(getattr(proposer, "has_confidence", False))  # ``Proposer.has_confidence``
        self.cache = BatchKVCache(target.model.config)
        self._start_s, self._start_positions = 0.0, 0  # drafter starts in the current step: seconds, positions
        self._mark: float | None = None  # when the last decode ended (None: idle since)
        self._prefill_s = 0.0  # prefill seconds since then
        self._prefill_tokens = 0  # prompt tokens the current step's prefill read
        self._last_k = 0  # the policy's last choice: the depth the next step's budget reserves per running row
        self.running: list[BatchSequence] = []  # in cache row order
        self.waiting: list[BatchSequence] = []  # arrival order; the first may be partly prefilled

    # -- requests --------------------------------------------------------------------------------------
    def add(self, seq: BatchSequence) -> BatchSequence:
        """Queue ``seq``; it joins at a coming step.

        Raises:
            ValueError: prompt + max_new_tokens beyond the target's position limit."""
        check_length(self.target, seq.prompt, seq.cfg)
        if seq.queued_s is None:
            seq.queued_s = time.perf_counter()
        seq.stats = SpecStats(k=self.k) if self.proposer is not None else None
        if self.policy is not None:
            seq.estimate = self.policy.new_request()
        if seq.out.finish_reason:  # max_new_tokens 0
            self._finish(seq)
        else:
            self.waiting.append(seq)
        return seq

    def cancel(self, seq: BatchSequence, reason: BaseException | None = None) -> None:
        """End ``seq`` at the next step (``error`` = ``reason``); the other rows are unaffected."""
        if not seq.done:
            seq.error = reason or RuntimeError("cancelled")
            seq.done = True

    @property
    def has_work(self) -> bool:
        """True while some sequence is waiting or running."""
        return bool(self.running or self.waiting)

    def abort(self, error: BaseException) -> list[BatchSequence]:
        """End every waiting and running sequence with ``error`` (a step failed for the whole batch); returns them.
        The decoder is empty and usable afterwards."""
        ended = self.running + self.waiting
        for seq in ended:
            if self.proposer is not None and seq.started:
                self.proposer.stop(seq.key)
            if not seq.done:
                seq.error, seq.done = error, True
            seq.cache, seq.pending, seq.prefill, seq.pending_positions = None, [], None, 0
        self.running, self.waiting = [], []
        self.cache = BatchKVCache(self.target.model.config)
        return ended

    def exclude(self, seconds: float) -> None:
        """Leave ``seconds`` since the last step out of the next step's ``between_s`` (``StepPolicy.observe_step``):
        time this decoder did not own, e.g. another decoder's steps on the same device while a bench interleaves
        two (``bench/adaptive_closed.py --interleave``). Nothing to do while idle (no ``between_s`` then)."""
        if self._mark is not None:
            self._mark += max(0.0, seconds)

    # -- one step --------------------------------------------------------------------------------------
    def step(self) -> list[BatchSequence]:
        """Run one scheduler step (module docstring); returns the sequences that ended in it."""
        ended = self._leave()
        depth = self._last_k if self.policy is not None else self.k  # auto: its last choice (module docstring)
        decode_tokens = sum(1 + self._reads(s, depth) for s in self.running)
        t0 = time.perf_counter()
        self._prefill_tokens = 0
        ended += self._prefill(max(0, self.max_num_batched_tokens - decode_tokens))
        self._prefill_s += time.perf_counter() - t0
        if self.running:
            ended += self._decode()
        ended += self._leave()
        if not self.running:  # idle next: the time until work comes is no step's
            self._mark = None
        return ended

    def run(self) -> None:
        """Step until every queued sequence has ended."""
        while self.has_work:
            self.step()

    def _requested(self, seq: BatchSequence) -> int:
        """Drafts this row may ask for (a tree: its depth): the verify step adds one token, and no more than
        max_new_tokens are read (positions stay within what ``check_length`` allowed)."""
        return max(0, min(self.k, seq.cfg.max_new_tokens - len(seq.tokens) - 1))

    def _reads(self, seq: BatchSequence, depth: int | None = None) -> int:
        """Draft tokens this row's verify step reads at most (a tree's node budget), drafting at most ``depth``
        (None: k)."""
        depth = self._requested(seq) if depth is None else min(depth, self._requested(seq))
        return min(depth * self.tree.topk, self.tree.num_nodes) if self.tree is not None and depth else depth

    def _finish(self, seq: BatchSequence) -> None:
        seq.done = True
        if seq.finished_s is None:
            seq.finished_s = time.perf_counter()
        seq.cache, seq.pending, seq.prefill, seq.pending_positions = None, [], None, 0
        seq.aux_chunks, seq.final_chunks = [], []
        if seq.error is None:
            seq.result = GenerationResult(list(seq.tokens), seq.finish_reason, seq.stats, seq.forwards)

    def _leave(self) -> list[BatchSequence]:
        """Drop ended rows from the cache, the proposer and the queues."""
        ended = []
        gone = [b for b, s in enumerate(self.running) if s.done]
        if gone:
            for b in gone:
                seq = self.running[b]
                if self.proposer is not None and seq.started:
                    self.proposer.stop(seq.key)
                ended.append(seq)
            order = self.cache.remove_rows(gone)
            self.running = [self.running[i] for i in order]
        for seq in [s for s in self.waiting if s.done]:
            self.waiting.remove(seq)
            ended.append(seq)
        for seq in ended:
            if self.policy is not None:
                self.policy.finish(seq.estimate)
            if seq.result is None and seq.error is None:
                self._finish(seq)
            else:
                seq.cache = None
                if seq.finished_s is None:
                    seq.finished_s = time.perf_counter()
        return ended

    def _emit(self, seq: BatchSequence, tokens: list[int]) -> bool:
        """Append through the stop rules; True when the row ended (a stop, or its callback raised)."""
        seq.last_token_s = time.perf_counter()
        if seq.first_token_s is None:
            seq.first_token_s = seq.last_token_s
        try:
            finished = seq.out.extend(tokens)
        except Exception as e:  # noqa: BLE001 - the row's own callback: it ends this row only
            seq.error = e
            finished = True
        if finished:
            self._finish(seq)
        return finished

    # -- prefill ---------------------------------------------------------------------------------------
    def _prefill(self, budget: int) -> list[BatchSequence]:
        """Prefill waiting sequences within ``budget`` tokens (module docstring, step 2)."""
        room = self.max_num_seqs - len(self.running)
        if room <= 0 or not self.waiting:
            return []
        if budget <= 0 and self.running:
            return []
        budget = max(budget, 1)
        head = self.waiting[0]
        if head.prefilled or len(head.prompt) > budget:  # a long prompt: one chunk of it, alone
            chunk = min(budget, len(head.prompt) - head.prefilled)
            return self._prefill_group([head], [chunk])
        group, longest, total = [], 0, 0
        for seq in self.waiting[:room]:
            n = len(seq.prompt)
            padded = max(longest, n) * (len(group) + 1)  # a ragged forward pads every row to the longest
            if n > budget or (group and padded > PREFILL_PADDING * (total + n)):
                break
            group.append(seq)
            budget, longest, total = budget - n, max(longest, n), total + n
        return self._prefill_group(group, [len(s.prompt) for s in group])

    def _prefill_group(self, group: list[BatchSequence], chunks: list[int]) -> list[BatchSequence]:
        """One forward over the next ``chunks[i]`` prompt tokens of each sequence of ``group``."""
        if len(group) == 1 and group[0].cache is not None:
            cache = group[0].cache
        else:
            cache = BatchKVCache(self.target.model.config)
            for _ in group:
                cache.add_empty_row()
        inputs = [s.prompt[s.prefilled : s.prefilled + c] for s, c in zip(group, chunks)]
        now = time.perf_counter()
        for seq in group:
            if seq.scheduled_s is None:
                seq.scheduled_s = now
        step = self.target.forward_batch(inputs, cache, final_hidden=self.final_hidden, last_only=True)
        cache.commit(chunks)
        self._prefill_tokens += sum(chunks)
        ended, joined = [], []
        for b, (seq, chunk) in enumerate(zip(group, chunks)):
            seq.forwards += 1
            seq.prefilled += chunk
            row = step.row(b)
            if self.proposer is not None and self.proposer.needs_aux_hidden:
                seq.aux_chunks.append(row.aux_hidden)
            if self.final_hidden:
                seq.final_chunks.append(row.final_hidden)
            if seq.prefilled < len(seq.prompt):
                seq.cache = cache  # continues next step (a group of one)
                continue
            self.waiting.remove(seq)
            seq.generator = seeded_generator(self.target.device, seq.cfg.seed)
            first = next_token(row.logits[-1], seq.cfg, seq.generator, seq.processors)
            if self._emit(seq, [first]):
                ended.append(seq)
                continue
            if self.proposer is not None:  # its drafter starts at its first draft (``_flush``)
                seq.prefill = TargetStep(
                    logits=None,
                    aux_hidden=torch.cat(seq.aux_chunks) if seq.aux_chunks else None,
                    final_hidden=torch.cat(seq.final_chunks) if seq.final_chunks else None,
                )
                if START_LIMIT <= 0:
                    self._start(seq)
            seq.aux_chunks, seq.final_chunks, seq.cache = [], [], None
            joined.append(b)
        finished_rows = [b for b, s in enumerate(group) if s.done or s.prefilled < len(s.prompt)]
        if joined:
            order = cache.remove_rows(finished_rows) if finished_rows else list(range(len(group)))
            self.cache.merge(cache)
            self.running += [group[b] for b in order]
        return ended

    # -- decode ----------------------------------------------------------------------------------------
    def _decode(self) -> list[BatchSequence]:
        """One verify step over every running row (module docstring, step 3)."""
        rows = self.running
        caps = [self._requested(s) for s in rows]
        if self.policy is not None:  # what this step's prefill left of the budget bounds the depth it may choose
            room = self.max_num_batched_tokens - self._prefill_tokens
            depth = max(caps, default=0)
            while depth > 0 and sum(1 + self._reads(s, depth) for s in rows) > room:
                depth -= 1
            caps = [min(cap, depth) for cap in caps]
        self._start_s, self._start_positions = 0.0, 0
        t0 = time.perf_counter()  # the proposer's time (draft_s) includes the accepts made before the choice
        between = None if self._mark is None else max(0.0, t0 - self._mark - self._prefill_s)
        self._prefill_s = 0.0
        if self.policy is not None:
            free = self.free_catch_up  # every row current, so every row's confidence is known
            if free or self.has_confidence:  # confidence needs the drafter's state current
                self._flush([s for s in rows if s.drafted_last or free])
            confidence = self._confidence(rows)
            soon = min(self.max_num_seqs, len(rows) + len(self.waiting))  # the batch once the waiting have joined
            starts = [0 if s.started else len(s.prompt) + len(s.tokens) - 1 for s in rows]  # positions to read
            lefts = [s.cfg.max_new_tokens - len(s.tokens) for s in rows]  # what a start is spread over
            catches = [s.pending_positions if s.started and not s.drafted_last else 0 for s in rows]  # plain steps'
            choice = self.policy.choose(
                [(s.estimate, *row) for s, *row in zip(rows, caps, confidence, starts, lefts, catches)],
                batch_size=soon,
                waiting=len(self.waiting),
            )
            ks = [min(choice.k, cap) if choice.rows is None or b in choice.rows else 0 for b, cap in enumerate(caps)]
            self._last_k = choice.k if choice.rows is None else 0  # a probe drafts for one row, once
        else:
            ks, catches = caps, [0] * len(rows)
        proposals = [Proposal.empty() for _ in rows]
        drafting = [b for b, k in enumerate(ks) if k > 0] if self.proposer is not None else []
        catch_up_s, catch_up = 0.0, [catches[b] for b in drafting if catches[b] > 0]  # rows resuming after plain steps
        if drafting:
            self._flush([rows[b] for b in drafting if rows[b].drafted_last])  # a run going on: its drafts' time
            ta, starts_before = time.perf_counter(), self._start_s
            self._flush([rows[b] for b in drafting])  # starts and catch-ups
            catch_up_s = time.perf_counter() - ta - (self._start_s - starts_before)
            keys, wanted = [rows[b].key for b in drafting], [ks[b] for b in drafting]
            if self.tree is not None:
                got = self.proposer.propose_tree(keys, self.tree, wanted)
            else:
                got = self.proposer.propose(keys, wanted)
            if len(got) != len(drafting):
                raise ValueError(
                    f"{type(self.proposer).__name__}.propose returned {len(got)} proposals for {len(drafting)} rows"
                )
            for b, p in zip(drafting, got):
                proposals[b] = self._check(p, ks[b])
        t1 = time.perf_counter()
        inputs = [torch.cat([torch.tensor(s.tokens[-1:]), p.tokens.cpu()]) for s, p in zip(rows, proposals)]
        trees = [p.parents for p in proposals] if any(p.is_tree for p in proposals) else None
        step = self.target.forward_batch(inputs, self.cache, final_hidden=self.final_hidden, trees=trees)
        ns, emitted, kept, ranks = [], [], [], []
        for b, (seq, p) in enumerate(zip(rows, proposals)):
            logits = step.logits[b, : p.tokens.numel() + 1]
            if p.is_tree:
                out, path = self._verify_tree(seq, p, logits)
                ns.append(len(path))
                ranks.append(path_ranks(p.parents, path))
                kept.append([0] + [i + 1 for i in path])
            else:
                if seq.processors is not None:  # row i read the context through d_i (core/processors.py)
                    logits = seq.processors.apply(logits, p.tokens.tolist())
                if seq.cfg.greedy:
                    out, n = verify_greedy(p.tokens, logits)
                else:
                    out, n = verify_sampling(p.tokens, p.q, seq.cfg.probs(logits), seq.generator)
                ns.append(n)
                kept.append(n + 1 if trees is None else list(range(n + 1)))
                ranks.append(None)
            emitted.append(out.cpu())
        self.cache.commit(kept)
        t2 = time.perf_counter()
        if self.proposer is not None:
            self._defer(rows, ns, emitted, step if trees is None else step.gather(kept))
        t3 = time.perf_counter()
        ended = []
        for seq, p, k, n, out, rank in zip(rows, proposals, ks, ns, emitted, ranks):
            seq.forwards += 1
            seq.drafted_last = k > 0
            if seq.stats is not None and rank is not None:
                seq.stats.record_tree(p.tokens.numel(), rank)
            elif seq.stats is not None:
                seq.stats.record(p.tokens.numel(), n)
            if self.policy is not None:  # the depth ASKED for: a draft not made (an n-gram match ending early)
                self.policy.observe(seq.estimate, k, n)  # emits nothing, as a rejected one (``StepPolicy.observe``)
                seq.stats.record_choice(k)
            if seq.on_step is not None:
                draft_s = (t1 - t0) + (t3 - t2)
                try:
                    seq.on_step(
                        VerifyStep(int(p.tokens.numel()), n, out.tolist(), draft_s, t2 - t1, k if self.policy else None)
                    )
                except Exception as e:  # noqa: BLE001 - ends this row only
                    seq.error = e
                    self._finish(seq)
                    ended.append(seq)
                    continue
            if self._emit(seq, out.tolist()):
                ended.append(seq)
        t4 = self._mark = time.perf_counter()
        if self.policy is not None:
            self.policy.observe_step(
                len(rows),
                1 + max(p.tokens.numel() for p in proposals),
                len(drafting),
                max(ks),
                t2 - t1,
                (t1 - t0) + (t3 - t2) - self._start_s - catch_up_s,
                self._start_s,
                self._start_positions,
                between,
                t4 - t3,
                sum(int(out.numel()) for out in emitted),
                catch_up_s=catch_up_s,
                catch_up_rows=len(catch_up),
                catch_up_positions=sum(catch_up),
            )
        return ended

    def _confidence(self, rows: list[BatchSequence]) -> list[float | None]:
        """The proposer's confidence in each row's next draft (``BatchProposer.confidence``); None for rows whose
        positions wait for a deferred accept or start (their drafter has not read them), and for every row when the
        proposer has none (``has_confidence``)."""
        out: list[float | None] = [None] * len(rows)
        if not self.has_confidence:
            return out
        ready = [b for b, s in enumerate(rows) if s.started and not s.pending]
        if ready:
            for b, c in zip(ready, self.proposer.confidence([rows[b].key for b in ready])):
                out[b] = c
        return out

    def _defer(self, rows: list[BatchSequence], ns: list[int], emitted: list[torch.Tensor], step) -> None:
        """Keep each row's verified positions (rows 0..n of ``step``, a chain's layout) for its next ``accept``;
        rows with ``PENDING_LIMIT`` positions waiting (``START_LIMIT`` before their drafter started, or with a
        policy) are flushed now."""
        none = (None,) * len(rows)  # one view per row in one call each (a plain step's rows are its whole width)
        auxes = step.aux_hidden.unbind(0) if step.aux_hidden is not None else none
        finals = step.final_hidden.unbind(0) if step.final_hidden is not None else none
        for seq, n, out, aux, final in zip(rows, ns, emitted, auxes, finals):
            if aux is not None and aux.shape[0] > n + 1:
                aux = aux[: n + 1]
            if final is not None and final.shape[0] > n + 1:
                final = final[: n + 1]
            seq.pending.append((out if out.numel() == n + 1 else out[: n + 1], aux, final))
            seq.pending_positions += n + 1
        full = [
            s for s in rows if s.pending_positions >= (PENDING_LIMIT if s.started and not self.policy else START_LIMIT)
        ]
        if full:
            self._flush(full)

    def _flush(self, seqs: list[BatchSequence]) -> None:
        """Bring the drafter of each of ``seqs`` up to date: a row whose drafter has not started starts over its
        whole context (``_start``); the others get ONE ``proposer.accept`` over the positions waiting in each
        (module docstring)."""
        for seq in [s for s in seqs if not s.started]:
            self._start(seq)
        seqs = [s for s in seqs if s.pending]
        if not seqs:
            return
        emitted, auxes, finals = [], [], []
        for seq in seqs:
            parts = seq.pending
            emitted.append(torch.cat([e for e, _, _ in parts]))
            auxes.append(torch.cat([a for _, a, _ in parts]) if parts[0][1] is not None else None)
            finals.append(torch.cat([f for _, _, f in parts]) if parts[0][2] is not None else None)
            seq.pending, seq.pending_positions = [], 0
        counts = [e.numel() for e in emitted]
        step = BatchTargetStep(None, _padded(auxes), _padded(finals), counts)
        self.proposer.accept([s.key for s in seqs], [c - 1 for c in counts], emitted, step)

    def _start(self, seq: BatchSequence) -> None:
        """Start ``seq``'s drafter (lazy, module docstring): the context is the prompt and every token the target has
        read since (its first token, then each step's emitted tokens but the last), the states are the prefill's
        followed by the pending steps', and the last emitted token is the one the target has not read yet."""
        emitted = [e for e, _, _ in seq.pending]
        read = torch.cat([torch.tensor([seq.tokens[0]]), *emitted])  # every emitted token; the last is unread
        context = torch.cat([seq.prompt, read[:-1].to(seq.prompt.dtype)])
        prefill = seq.prefill
        aux = [prefill.aux_hidden, *(a for _, a, _ in seq.pending)] if prefill.aux_hidden is not None else None
        final = [prefill.final_hidden, *(f for _, _, f in seq.pending)] if prefill.final_hidden is not None else None
        step = TargetStep(
            logits=None,
            aux_hidden=torch.cat(aux) if aux is not None else None,
            final_hidden=torch.cat(final) if final is not None else None,
        )
        t0 = time.perf_counter()
        self.proposer.start(seq.key, context, int(read[-1]), step, seq.sampling)
        self._start_s += time.perf_counter() - t0
        self._start_positions += int(context.numel())
        seq.started, seq.prefill, seq.pending, seq.pending_positions = True, None, [], 0

    def _check(self, proposal: Proposal, requested: int) -> Proposal:
        """``check_proposal``, and for a tree: at most the shape's nodes, at most ``requested`` deep."""
        if self.tree is None or not proposal.is_tree:
            return check_proposal(proposal, requested, self.target.vocab_size, self.proposer)
        check_proposal(proposal, self.tree.num_nodes, self.target.vocab_size, self.proposer)
        depth = int(depths(proposal.parents).max()) if proposal.tokens.numel() else 0
        if depth > requested:
            raise ValueError(
                f"{self.proposer.name}.propose_tree returned a tree {depth} deep; this row allows {requested}"
            )
        return proposal

    @staticmethod
    def _verify_tree(seq: BatchSequence, p: Proposal, logits: torch.Tensor) -> tuple[torch.Tensor, list[int]]:
        """Walk row ``seq``'s tree ``p`` over its verify logits ``[N + 1, V]``: (emitted, accepted path)."""
        if seq.processors is not None:  # node i read the context through its own path (core/processors.py)
            rows = [seq.processors.apply(logits[0])]
            for i in range(p.tokens.numel()):
                path = path_tokens(p.tokens, p.parents, i)
                rows.append(seq.processors.apply(logits[i + 1], path, first=len(path)))
            logits = torch.stack(rows)
        if seq.cfg.greedy:
            return verify_tree_greedy(p.tokens, p.parents, logits)
        return verify_tree_sampling(p.tokens, p.parents, seq.cfg.probs(logits), seq.generator)


def _padded(rows: list[torch.Tensor | None]) -> torch.Tensor | None:
    """``[B, T, D]``: each ``[t_b, D]`` row zero-padded to the longest (None when the rows are None)."""
    return None if rows[0] is None else torch.nn.utils.rnn.pad_sequence(rows, batch_first=True)


def generate_batch(
    target: TargetModel,
    proposer: BatchProposer | None,
    prompts: Sequence,
    cfgs: GenerationConfig | Sequence[GenerationConfig],
    k: int = 0,
    *,
    samplings: Sequence[Sampling] | None = None,
    max_num_seqs: int = 64,
    max_num_batched_tokens: int = 2048,
    tree: TreeShape | None = None,
    policy: StepPolicy | None = None,
) -> list[GenerationResult]:
    """Decode ``prompts`` together (at most ``max_num_seqs`` at once); results in prompt order.

    Args:
        prompts: ``[T_i]`` token ids each. cfgs: one ``GenerationConfig`` for all, or one per prompt.
        samplings: the drafter's ``Sampling`` per prompt (default: each cfg's, seeded ``draft_seed(cfg.seed)``).
        tree: draft trees of this shape instead of chains (``BatchDecoder``). policy: choose each step's k live
            (``BatchDecoder``; ``core.adaptive.AdaptivePolicy``).

    Raises:
        ValueError: as ``BatchDecoder``; or the first error a row's decoding raised (none here: no callbacks).
    """
    cfgs = [cfgs] * len(prompts) if isinstance(cfgs, GenerationConfig) else list(cfgs)
    if len(cfgs) != len(prompts):
        raise ValueError(f"{len(prompts)} prompts but {len(cfgs)} generation configs")
    decoder = BatchDecoder(
        target,
        proposer,
        k,
        max_num_seqs=max_num_seqs,
        max_num_batched_tokens=max_num_batched_tokens,
        tree=tree,
        policy=policy,
    )
    seqs = [
        decoder.add(BatchSequence(p, c, samplings[i] if samplings is not None else None))
        for i, (p, c) in enumerate(zip(prompts, cfgs))
    ]
    decoder.run()
    for seq in seqs:
        if seq.error is not None:
            raise seq.error
    return [seq.result for seq in seqs]
