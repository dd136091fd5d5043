"""Adaptive speculation (``"num_speculative_tokens": "auto"``): each step drafts the amount that maximises the
batch's expected emitted tokens per second, from a cost model measured on this machine and acceptance estimates
updated by every verify step. Zero is a choice: the step is then plain decoding.

The choice, for a batch of B running rows, each with its own acceptance estimate and cap (what max_new_tokens
leaves):

    K* = argmax_K  sum_b E_b(min(K, cap_b))  /  (verify(B, 1 + reads(K')) + draft(B', K))

    E(d)     = 1 + sum_{i=1..d} prod_{j<=i} a_j     expected tokens a step emits when d tokens are drafted along a path
               (a_j: conditional acceptance at position j, given positions < j accepted; Leviathan et al. 2023, §3.1)
    K'       = max_b min(K, cap_b); B' = rows drafting (min(K, cap_b) > 0); reads(K) = K for a chain, min(K * topk,
               num_draft_tokens - 1) for a tree of depth K
    verify, draft: ``CostModel`` (seconds of one target forward over B rows of T tokens, padded as
               ``core.target.TargetModel.forward_batch`` pads; seconds in the proposer for K drafts per row).

Drafting must beat plain decoding by ``SPECULATE_MARGIN`` (expected tokens/s): the model's errors (a profile on
another context length, a noisy machine, time outside the decode step) are a few percent, and "never slower than
plain" is worth more than the last few percent of a marginal gain.

One K serves the whole batch: the verify forward pads every row to the longest, so a row drafting less than K
saves nothing there. Its tokens/s is not always the batch's measure, though; what the queue holds decides:

- Requests queued for a full batch (running = max_num_seqs): a row that finishes sooner lets one in sooner, and
  tokens/s is the measure.
- A request waiting to join with a free row (its prefill in progress: ``core.batch`` prefills a few prompts a step,
  grouped by length): the step is plain. A step's drafting delays its prefill, and in a batch sent together the
  request that starts last finishes last. Measured behind the server (MLP speculator, code-foreign, concurrency 8,
  2-core AMD EPYC): the 5 steps that prefilled the batch took 460 ms while auto drafted 2 in them, 381 ms plain,
  the same prompts. (Pricing those steps at the batch they would decode at, running + waiting, chose drafting for
  the full batch's sake, and the full batch paid for it by starting later. ``throughput`` still prices the running
  rows as standing for that batch: what a probe is chosen by.)
- Nobody waiting (a client's last requests; a benchmark's batch of c requests): the batch is done when its slowest
  row is, not when it has emitted the most tokens per second. Drafting that wins a step's tokens/s from the rows
  that accept finishes them early and leaves a row that does not to run alone, at a step's fixed price for about
  one token a step: in the same cell the last row (it accepted 2 of the 57 tokens drafted for it) ran 17-25 steps
  alone under auto against 1-2 under plain decoding. So a K that beats plain on tokens/s must also not lengthen
  the batch's drain (``drain_seconds``): each row needs left / E(d) steps (left: what max_new_tokens leaves, at
  most ``START_HORIZON``), and the batch pays each step at the size it has then. (Also spreading the rows' steps as
  order statistics of their variance, for the straggler a drafting batch waits for, held auto plain where drafting
  won: docstring at concurrency 8, EAGLE-3 1.13x -> 1.06x and MLP 1.41x -> 1.34x; the rows' lengths, cut by EOS,
  vary far more than their step counts, and left cannot see them.)

A row's drafter starts at its first draft (``core.batch``): a forward over its whole context so far, ~65 us per
position for an EAGLE-3 head on the reference target, as much as a plain step for a 200-token prompt. A row that
has not started is charged its start at ``start_s_per_position`` (measured by the startup profile, then on every
start), spread over the tokens it may still emit (what max_new_tokens leaves, at most ``START_HORIZON``: a bound,
not a forecast, since a request may stop earlier): a step drafting d for it pays E(d) / left of its start. So a
request with most of its tokens ahead starts its drafter for almost nothing, and one near its end does not start it
to win one step. (Spreading it over the step's own cap instead, at most k, charged a row ~E(d) / k of its start in
one step: at concurrency 8 a batch of new rows then looked slower drafting than plain, auto stayed plain until a
few rows had started, drafted intermittently, and read 0.96x where k = 3 read 1.16x.)

What a start buys is the tokens the row's drafting steps emit afterwards, and "every token left" is what it buys only
if the row drafts to its end: a row whose drafts stop paying goes plain, and one that meets EOS stops. So the tokens
left are scaled by ``horizon``, measured: over finished requests whose drafter started, the tokens their drafting
steps emitted since, over the tokens they could still emit then (decayed per request, ``HORIZON_PRIOR`` pseudo-tokens
of 1). A step drafting d for a new row pays E(d) / (left x horizon) of its start. Measured behind the server (the
draft model on code-edit, concurrency 8): at each batch's start auto drafted 3 for all 8 rows, starting 8 draft-model
drafters over 1210-1451 context positions in one step (51-90 ms, ~55 us a position, against a 24 ms plain step);
they drafted 2-3 steps and went plain (mean k 0.05-0.2), so each start was priced as spread over ~60 tokens and
bought 5-8, and auto read 0.92-0.94x plain while its later drafting steps about broke even. Requests that draft to
their end keep ``horizon`` near 1 (what was priced before); a row already started pays nothing for it either way.

A started row's plain steps leave positions its drafter has not read (``core.batch`` defers them), and the step that
drafts for it again first catches the drafter up on them in one ``accept``: a forward over those positions for a
head. ``core.batch`` times that catch-up apart from the drafts (``observe_step``'s ``catch_up_*``), so the draft
scales keep the drafts' own cost, and the policy fits its seconds as a part per row and a part per position (the
same online fit as ``EmissionCost``). Inside the draft seconds, it made every drafting step of EAGLE-3 on
code-foreign at concurrency 8 look ~2x dearer than it is (21-23 ms measured against ~8 ms modelled: the few steps
that drafted were resumptions), and auto drafted where it paid least. A row that resumes is charged its catch-up
as a start is, spread over what it buys: the tokens a drafting run that resumed after plain steps emits until its
next plain step or its end (``run_tokens``, measured over recent runs, decayed per run, ``RUN_PRIOR`` runs of
``RUN_PRIOR_TOKENS``; a probe is not a run): a step drafting d for it pays min(1, E(d) / run_tokens) of it. (Priced
per position alone, the rate measured on short catch-ups is mostly a forward's fixed cost over a few positions and
overprices a long one: EAGLE-3 on docstring then drafted less, mean k 0.9-1.5 -> 0.2-0.5.) Resumed rows also have
their own optimism, ``realized_resumed``, measured as ``realized`` is over the rows that resumed (their sums age per
such step only, not per plain step: resumptions are apart by plain steps), and scaling their E(d): a row goes plain
because its text got hard, and when its rates, aged towards the engine's, price drafting again, the text often is
still hard. With the catch-up priced but not that ratio, EAGLE-3 on code-edit resumed more and read 0.94x plain in
a closed batch where it read 1.03x before.

The choice is a function of the past only (earlier verify outcomes and the cost model), never
of this step's drafts, so the output keeps the target's law: any k drafted from q and verified by
``core.verify`` is lossless (the contract tests run every drafter with ``auto``).

Acceptance estimates (``AcceptanceEstimate``) are exponentially decayed counts per position: a verify step that
asked for k' tokens along its path and accepted n counts positions 1..n as accepted and position n + 1 (when
n < k') as rejected (vLLM's per-position acceptance; a tree counts its accepted path's depth). The depth asked for,
not the depth drafted: a drafter may return fewer (an n-gram match that ends early, or none), and E(k) prices
what asking for k emits, so a draft not made counts as a rejected one (counted as drafted, an n-gram head's rates
read the few long matches as its usual case). A request's rates
are shrunk towards the engine's (``AdaptivePolicy.rates``), whose own prior for position i is its estimate at
i - 1 (a position never tried is assumed as good as the one before it), or, for a trained head whose export
records its held-out acceptance per position (``draftsmith.json`` ``eval``), that acceptance, the mean over its
tasks: a cold engine then drafts as much as the head earned on held-out data, not as an optimistic guess (an
optimistic prior at concurrency 8 started every row's drafter before the first verify step could say that drafting
lost there).

A request's counts also age on its plain steps (``AcceptanceEstimate.age``: each decays them once, as a drafting
step does the positions it tried), so its rates return towards the engine's as its text moves on. Without it a
request that met a few rejections in a row chose plain, then learnt nothing more and stayed plain to its end: EAGLE-3
on code-foreign at concurrency 1 decoded 112 of its 351 steps plain with every draft rate frozen at its dip (k = 5
read 0.94x plain) while the engine's rates read 1.3x, and auto read 1.14-1.20x against k = 3's 1.29-1.32x.
With ageing, what a request saw weighs half after ~7 plain steps (``REQUEST_DECAY`` 0.9), and it drafts again
once its rates, pulled towards the engine's, price drafting above plain (13 of 277 steps plain mid-request in the
same cell); if its text is still hard, the next verify step says so again at the cost of one step.
The engine's rates weigh as ``REQUEST_PRIOR`` = 1 observation in a request's: requests differ more than that
prior's old weight of 4 allowed. At concurrency 8 an MLP speculator on code-foreign accepted 2 of the 57 tokens it
drafted for one request and 21 of 33 for another; against at most ~10 decayed observations of its own, 4 held the
failing request's position-1 rate at >= 0.26 (the engine's 0.49), so once alone at the batch's end it drafted 4 every
third step and was rejected each time, and while the batch drafted it looked worth drafting for (auto 0.94x plain
in two 5-round runs, mean k 0.53-0.64; with 1: 0.95-0.99x in three, mean k 0.22-0.32; at concurrency 1 on the same
task EAGLE-3 and the MLP speculator read 1.42x and 1.41x against 1.38x and 1.40x).

When zero drafts win for every request, nothing is learnt;
so the policy drafts once at its best positive K (a probe) when exploring is affordable: at least ``PROBE_AFTER``
plain steps in a row, and probes cost at most ``PROBE_BUDGET`` of the plain decoding time since the last one. A
probe drafts for ONE row (a row whose drafter has started, else the one with the most tokens left; the others
stay plain): the engine-wide estimate learns as much from it, and it costs one drafter start at most, not one per
row. A probe's cost is its step's verify, draft and catch-up seconds beyond a plain step's, modelled before the first
probe and then as last measured (the catch-up of the row it probed then), plus the probed row's drafter start when
it has not started (its positions x ``start_s_per_position``). So where
speculation does not pay, auto loses at most ~PROBE_BUDGET to exploring, at any batch size and drafter cost. (The
budget is 1%: with the decoder's own bookkeeping, ~1% of a plain step at B = 8 on the reference target, a batch
that never drafts stays within 2-3% of plain decoding, inside the "never slower than plain" bar's 3%.)

A probe that finds drafting still losing is evidence that it keeps losing, so each probe since the last step that
drafted for the batch halves the budget (``PROBE_BACKOFF``), at most ``PROBE_BACKOFF_MAX`` times (to 1/8 of it); a
step whose prices choose drafting restores it. Where speculation never pays (the batch too large for drafting on
this machine), exploring then costs ~0.125% of plain decoding, not 1%; where the text turns easy, the first probe
after it is up to 8x later than at the full budget, and any change that the prices see at once (a smaller batch,
a new request starting at the engine's rates) needs no probe. Measured in a closed batch of 32 rows (EAGLE-3 on
code-complete, ``bench/adaptive_closed.py --interleave``, 2-core AMD EPYC): at the full budget auto probed 25 of
485 steps and read 0.973x plain (its machinery forced plain: 0.986x); with the backoff, 2 of 503 and 0.988x (0.978x).

Pricing a step is pure Python over every row and every k (~0.12 ms at B = 8, ~0.3 ms at B = 32 with each request's
own rates, 2-core AMD EPYC), 1-2% of a plain step on the reference target, paid where auto drafts nothing as well.
So a priced plain step that follows a plain step holds the next steps of the same rows (the same requests'
estimates and caps), batch size and queue plain without pricing, unless a probe is due (its budget spent), for as
many steps as its distance from drafting allows: with x the best k's tokens/s over what drafting must reach (plain's
x (1 + ``SPECULATE_MARGIN``)), n steps while x / (1 - ``HOLD_DRIFT``)^n stays below 1, at most ``HOLD_STEPS``; a
step that a request waiting to join keeps plain holds ``HOLD_STEPS`` (that rule does not read the prices). Between
two plain steps of one batch x moves little: over the priced plain steps that followed a plain step with the same
rows (DFlash on code-complete and EAGLE-3 on code-edit, 8 rows, closed batches), |log| of its step-to-step ratio had
a median of 0.2% and a 90th percentile of 1%; its rare larger moves came where a row's cap shrank at the batch's end
(the caps are in the hold's key) and at the first plain step after a drafting one (a drafting step's observations,
a row's confidence unknown once its positions wait: a hold starts only after two plain steps). Any change in the
batch prices the next step at once. The policy's time at a held plain step (choosing, observing every row, the
step's costs) is 8 us at B = 8 and 16 us at B = 32, against ~110 and ~320 us priced (14 and 39 us before a plain
step's ageing of each request became a count, applied when its rates are next read: ``AcceptanceEstimate.age``;
2-core AMD EPYC). (Holding only where plain won by
20% or more left DFlash on code-complete at 8 rows, whose best k priced at a median 0.90 of plain's, priced at every
step: auto's machinery with every choice forced to plain read 0.977x plain in a closed batch, 0.989x with the pricing
taken out.)

The drafter's own confidence, where it has one before drafting (``BatchProposer.confidence``: an EAGLE-3 head
holds its next-token logits after each accept), refines position 1: the engine keeps decayed acceptance counts of
position 1 per confidence bin (``CONFIDENCE_BINS`` equal bins of the head's top probability), and a row whose
confidence is known takes its bin's rate (shrunk towards the engine's position-1 rate) as a_1. It is known before
the step drafts, so the choice stays a function of the past. A row whose positions wait for a deferred accept has
none (its drafter has not read them yet).

Every step also pays for what the decoder does outside its verify forward, drafts and accepts, which the profile
cannot see, so the policy measures it: the time between two steps (``between_s``, an exponential average, prefill
excluded and each capped at that step's own seconds: the scheduler, the HTTP threads holding the GIL) is paid once
per step, whatever k; emitting the tokens (``EmissionCost``: a server's hand-off of each row's chunk to the thread
that streams it, then the stop rules and detokenizing per token) is paid per chunk (one per row) and per token,
both parts fitted online. Speculation pays the first and the per-chunk part once for several tokens, the per-token
part for each: behind a server at concurrency 1 on the reference target a step
spends ~2 ms outside its forward (plain TPOT 8.9 ms against a profiled forward of 6.5-7 ms), and leaving it out
made drafting look less worth than it is (DFlash on code-complete at c = 1: auto 0.86x plain against 1.04x at
k = 3; with it, 1.08x against 1.10x). Pricing the emission per token instead overcharged every drafting option
(EAGLE-3, code-complete, c = 1: auto drafted 2.7 a step, not 4.4); timing each chunk showed its fixed part dominates
(``EmissionCost``).

The acceptance estimates are unbiased over every step, but a step drafts when they read high, so over the steps
that draft they are optimistic (the winner's curse; DFlash on code-edit at concurrency 8: drafting steps expected
16.6 tokens from 8 rows and emitted 14.7, and ~+10% predicted read ~-5% measured). So the policy also measures its
own optimism: ``realized``, the drafts accepted over those it expected (E(d) - 1 per drafting row, for the k
chosen), summed over recent drafting steps (decayed by ``REALIZED_DECAY``, ``REALIZED_PRIOR`` pseudo-tokens of
1), scales the drafted part of every E(d): a step is priced at 1 + (E(d) - 1) x realized tokens per row. Plain
steps age those sums too (each decays them once, as a drafting step does), so ``realized`` returns towards 1 while
nothing is drafted: at concurrency 1 a drafting step expects only ~2-4 drafts, so a few hard steps in a row pulled
``realized`` down (0.73-1.25 within one EAGLE-3 docstring batch) and, as plain steps left it where it was, only the
1%-budget probes could lift it while auto stayed plain (the request's own rates, which saw the same rejections,
already return by ageing). A probe's outcome stays out of those sums: ``realized`` corrects the bias of steps taken
because their estimates read high, and a probe is taken because plain priced higher, when the estimates read low, so
its outcome is biased the other way. Counted, one lucky probe lifted ``realized`` above 1 (1.28-1.45) and the next
step drafted for the whole batch on it: DFlash on code-complete, 4 rows left in a closed batch of 8, each such step
starting 3 drafters (6-7 ms) and emitting 7 tokens where plain steps emit 4 in ~16 ms.

The cost model is measured once, on a context of fixed length and maybe on a busier (or idler) machine than now;
so every step's measured seconds update scales that multiply the model's costs (``AdaptivePolicy.observe_step``:
an exponential average of measured ÷ modelled, clipped to [1/4, 4]): one per batch size (in powers of two) and
tokens-per-row count T for the verify forward and one per k for the drafter (a longer context makes a many-token
forward dearer than a one-token one, not only dearer), each starting from its batch size's average over every T
(then the average over all, every k) until its own is measured. Per batch size because a server meets its batch
sizes at different times and loads: with one scale per T, an EAGLE-3 server that drafted at c = 1 and 8 and then
served c = 32 priced a 2-token verify at B = 32 with the ratio learnt at B <= 8 (1.4-1.5x the profile) and a plain
one with B = 32's (1.6-1.8x), so drafting looked ~20% cheaper than it was there, and it drafted (mean k 0.55, 0.90x
plain, code-foreign). The profile counts
as one measurement: a scale's n-th measurement weighs 1 / (n + 1) until that falls to ``SCALE_WEIGHT`` (a mean,
then an exponential average). With the fixed weight alone, the few drafting steps a batch at concurrency 8 takes
left its k > 0 scales near the profile's (DFlash, code-edit: drafting steps modelled ~15% cheaper than measured
after 40 of them) and auto kept drafting where it lost.

This module is torch-free (the profile that measures a ``CostModel`` is ``core.cost_profile``).
"""

from __future__ import annotations

import bisect
import json
import math
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Sequence

AUTO = "auto"  #: the ``num_speculative_tokens`` value that turns adaptive speculation on
AUTO_MAX_K = 8  #: most drafts per step ``auto`` considers (lowered to a drafter's own limit)
REQUEST_DECAY = 0.9  #: a request's counts decay per observation (~10 recent steps weigh)
ENGINE_DECAY = 0.99  #: the engine's counts decay per observation (~100 recent steps weigh)
REQUEST_PRIOR = 1.0  #: pseudo-observations of the engine's rates in a request's estimate (module docstring)
ENGINE_PRIOR = 2.0  #: pseudo-observations of the prior in the engine's estimate
FIRST_PRIOR = 0.6  #: the engine's prior acceptance at position 1 before any step (optimistic: it gets tried)
SPECULATE_MARGIN = 0.05  #: drafting is chosen only when its expected tokens/s beats plain's by this fraction
PROBE_AFTER = 8  #: fewest plain steps in a row before a probe
HOLD_DRIFT = 0.02  #: the most a batch's best-k ÷ plain tokens/s is assumed to move per plain step (module docstring)
HOLD_STEPS = 8  #: most plain steps held without pricing, while the rows, their caps, the batch size and queue stay
PROBE_BUDGET = 0.01  #: probes cost at most this fraction of the plain decoding time since the last probe
PROBE_BACKOFF = 0.5  #: the budget's factor per probe since the last step that drafted for the batch (module docstring)
PROBE_BACKOFF_MAX = 3  #: most such factors: the budget falls to PROBE_BUDGET x PROBE_BACKOFF^3 at least
CONFIDENCE_BINS = 10  #: equal-width bins of the drafter's confidence in [0, 1]
SCALE_WEIGHT = 0.05  #: weight of one step's measured ÷ predicted cost in the scales
SCALE_RANGE = (0.25, 4.0)  #: the scales stay within this
START_WEIGHT = 0.2  #: weight of one measured drafter start in ``start_s_per_position``
OVERHEAD_WEIGHT = 0.05  #: weight of one step's measurement in ``between_s`` and the emission fit
START_HORIZON = 256  #: most tokens a drafter start is spread over (module docstring)
HORIZON_DECAY = 0.9  #: the sums behind ``horizon`` decay per finished request (~10 recent requests weigh)
HORIZON_PRIOR = 64.0  #: pseudo-tokens of a horizon of 1 (every token left emitted by drafting steps)
REALIZED_DECAY = 0.95  #: the drafted-token sums behind ``realized`` decay per step (~20 recent steps weigh)
REALIZED_PRIOR = 4.0  #: pseudo-tokens of a realized ratio of 1 in ``realized``
RESUMED_DECAY = 0.9  #: the sums behind ``realized_resumed`` decay per step that resumes drafting (~10 recent ones)
RUN_DECAY = 0.9  #: the sums behind ``run_tokens`` decay per ended drafting run (~10 recent runs weigh)
RUN_PRIOR = 2.0  #: pseudo-runs of ``RUN_PRIOR_TOKENS`` tokens in ``run_tokens``
RUN_PRIOR_TOKENS = 16.0  #: tokens of a prior drafting run
COLLINEAR = 1e-3  #: below this 1 - cos^2 of (chunks, tokens) over the steps seen, emission is priced per chunk


class EmissionCost:
    """Seconds a step spends emitting: ``per_chunk`` x rows + ``per_token`` x tokens, fitted online.

    A step emits one chunk per row (its accepted tokens plus the target's); a chunk costs a fixed part (a server
    hands it to its event loop, waking the thread that streams it) and a part per token (the stop rules and
    detokenizing read its tokens one by one). Measured behind the in-process server on the reference target
    (ngram, k = 5, one chunk's seconds against its tokens, 2-core AMD EPYC): about 650 us + 10 us per token at
    c = 1 and 210 us + 29 us per token at c = 8 while each chunk woke the server's event loop at once, 90 us + 13 us
    and 29 us + 11 us since a step's text leaves at its end (``serve.scheduler.Handoff``): pricing it all per token
    overcharged drafting several-fold.

    The fit is least squares over the steps seen, each weighted ``OVERHEAD_WEIGHT`` against the decayed past
    (exponentially weighted sums of chunks^2, chunks x tokens, tokens^2, chunks x seconds, tokens x seconds),
    both parts >= 0. While every chunk held one token (plain decoding) the two parts cannot be told apart
    (``COLLINEAR``) and all of it is priced per chunk, as measured above.

    The same fit prices a drafter's catch-up after plain steps (``AdaptivePolicy.catch_up``): one part per row
    caught up (a "chunk") and one per position it reads (a "token").
    """

    def __init__(self):
        self.sums = [0.0] * 5  # cc, ct, tt, ce, te
        self.per_chunk = self.per_token = 0.0  #: fitted seconds
        self.seen = False

    def observe(self, chunks: int, tokens: int, seconds: float) -> None:
        """One step: ``chunks`` rows emitted ``tokens`` tokens in ``seconds``; refits both parts."""
        if chunks <= 0 or tokens <= 0 or seconds < 0:
            return
        w = OVERHEAD_WEIGHT if self.seen else 1.0
        point = (chunks * chunks, chunks * tokens, tokens * tokens, chunks * seconds, tokens * seconds)
        self.sums = [(1 - w) * old + w * new for old, new in zip(self.sums, point)]
        self.seen = True
        cc, ct, tt, ce, te = self.sums
        det = cc * tt - ct * ct
        if det <= COLLINEAR * cc * tt:
            self.per_chunk, self.per_token = ce / cc, 0.0
            return
        a, b = (tt * ce - ct * te) / det, (cc * te - ct * ce) / det
        if a < 0:
            a, b = 0.0, te / tt
        elif b < 0:
            a, b = ce / cc, 0.0
        self.per_chunk, self.per_token = a, b

    def seconds(self, chunks: float, tokens: float) -> float:
        """Modelled seconds of emitting ``tokens`` tokens in ``chunks`` chunks."""
        return self.per_chunk * chunks + self.per_token * tokens


def _interp(xs: Sequence[float], ys: Sequence[float], x: float) -> float:
    """Piecewise-linear y(x) through the points (xs ascending), extrapolated linearly past both ends, >= 0."""
    if len(xs) == 1:
        return max(0.0, ys[0] * x / xs[0]) if x > xs[0] else ys[0]
    i = min(max(bisect.bisect_left(xs, x), 1), len(xs) - 1)
    x0, x1, y0, y1 = xs[i - 1], xs[i], ys[i - 1], ys[i]
    return max(0.0, y0 + (y1 - y0) * (x - x0) / (x1 - x0))


@dataclass
class CostModel:
    """Measured step costs of one target + drafter on one device (``core.cost_profile.profile_costs``).

    Attributes:
        batch_sizes: measured B, ascending. verify_tokens: measured tokens per row T, ascending (1 = plain).
        verify_s: ``[len(batch_sizes)][len(verify_tokens)]`` seconds of one verify forward over B rows of T tokens.
        draft_ks: measured drafts per row K (>= 1), ascending.
        draft_s: ``[len(batch_sizes)][len(draft_ks)]`` seconds inside the proposer (propose + accept) for K drafts
            in each of B rows.
        context_len: the context each row had while measured (tokens). meta: what was measured (target, drafter,
            device, threads, torch CPU capability): the cache key's fields.
        start_s_per_position: seconds of a drafter start per context position it reads (0: not measured).

    Between measured points costs are interpolated linearly (in B, then T or K), past them extrapolated linearly.
    """

    batch_sizes: list[int]
    verify_tokens: list[int]
    verify_s: list[list[float]]
    draft_ks: list[int]
    draft_s: list[list[float]]
    context_len: int = 0
    meta: dict = field(default_factory=dict)
    start_s_per_position: float = 0.0

    def __post_init__(self):
        if not self.batch_sizes or not self.verify_tokens or not self.draft_ks:
            raise ValueError("a cost model needs at least one batch size, token count and k")
        if len(self.verify_s) != len(self.batch_sizes) or len(self.draft_s) != len(self.batch_sizes):
            raise ValueError("a cost model needs one row of verify and draft costs per batch size")
        self._memo: dict[tuple, float] = {}  # (table, b, x) -> seconds: every step prices the same few points

    def _grid(self, table: list[list[float]], xs: list[int], b: int, x: float) -> float:
        key = (id(table), b, x)
        if key not in self._memo:
            per_b = [_interp(xs, row, x) for row in table]
            self._memo[key] = _interp(self.batch_sizes, per_b, b)
        return self._memo[key]

    def verify(self, b: int, t: int) -> float:
        """Seconds of one target forward over ``b`` rows of ``t`` new tokens each."""
        return self._grid(self.verify_s, self.verify_tokens, b, t)

    def draft(self, b: int, k: int) -> float:
        """Seconds inside the proposer for ``k`` drafts in each of ``b`` rows (0 for k = 0 or b = 0: nothing is
        drafted, and a plain step's accept is deferred: ``core.batch``)."""
        if k <= 0 or b <= 0:
            return 0.0
        return self._grid(self.draft_s, self.draft_ks, b, k)

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: dict) -> "CostModel":
        """Rebuild from ``to_dict``'s output (ValueError for anything else)."""
        try:
            return cls(**data)
        except TypeError as e:
            raise ValueError(f"not a cost model: {e}") from None

    def save(self, path: str | Path) -> None:
        """Write as JSON through a temporary file and a rename."""
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(path.name + ".tmp")
        tmp.write_text(json.dumps(self.to_dict(), indent=1))
        tmp.replace(path)

    @classmethod
    def load(cls, path: str | Path) -> "CostModel":
        """Read what ``save`` wrote (ValueError when it is not a cost model)."""
        try:
            return cls.from_dict(json.loads(Path(path).read_text()))
        except (OSError, json.JSONDecodeError) as e:
            raise ValueError(f"cannot read the cost model {path}: {e}") from None

    def summary(self) -> str:
        """One line per batch size: verify ms at each T and draft ms at each K (what the logs print)."""
        lines = []
        for b, v, d in zip(self.batch_sizes, self.verify_s, self.draft_s):
            ver = " ".join(f"{t}:{1000 * s:.1f}" for t, s in zip(self.verify_tokens, v))
            dra = " ".join(f"{k}:{1000 * s:.1f}" for k, s in zip(self.draft_ks, d))
            lines.append(f"B={b}: verify ms by tokens/row {ver} | draft ms by k {dra}")
        lines.append(f"drafter start: {1e6 * self.start_s_per_position:.1f} us per context position")
        return "\n".join(lines)


class AcceptanceEstimate:
    """Exponentially decayed counts of tried and accepted drafts per position (module docstring).

    Args:
        k_max: positions tracked. decay: each observation of a position first multiplies its counts by this.
    """

    def __init__(self, k_max: int, decay: float):
        self.decay = decay
        self.tried = [0.0] * k_max  # decayed counts per position, before the ageing ``_aged`` holds (``rates``
        self.accepted = [0.0] * k_max  # and ``observe`` apply it first)
        self.confidence: float | None = None  #: the drafter's confidence at this step's choice (a request's)
        self.start_left: int | None = None  #: tokens it could still emit when its drafter started (None: not yet)
        self.drafted = 0  #: tokens its drafting steps emitted since its drafter started
        self.resuming = False  #: at this step's choice its drafter had positions to catch up on (plain steps')
        self.run: int | None = None  #: tokens emitted by its drafting run since it resumed (None: no such run)
        self._aged = 0  # plain steps whose decay the counts have not had yet (``age``)

    def observe(self, num_proposed: int, num_accepted: int) -> None:
        """One verify step that drafted ``num_proposed`` positions along its path and accepted ``num_accepted``."""
        self._settle()
        for i in range(min(num_accepted + 1, num_proposed, len(self.tried))):
            self.tried[i] = self.decay * self.tried[i] + 1.0
            self.accepted[i] = self.decay * self.accepted[i] + float(i < num_accepted)

    def age(self) -> None:
        """One step that drafted nothing: every count decays once, so what the estimate saw grows old with the
        text (module docstring: a request's plain steps). Kept as a count until the counts are read (``_settle``):
        a plain step pays one increment per row, not a pass over every position."""
        self._aged += 1

    def _settle(self) -> None:
        """Apply the decays of the plain steps counted by ``age`` since the counts were last read."""
        if self._aged:
            factor, self._aged = self.decay**self._aged, 0
            self.tried = [factor * t for t in self.tried]
            self.accepted = [factor * a for a in self.accepted]

    def rates(self, prior: Sequence[float] | None, strength: float) -> list[float]:
        """Posterior-mean conditional acceptance per position: (accepted + strength * prior) / (tried + strength);
        past the end of ``prior`` (None: from the first position) a position's prior is the rate found for the
        position before it (``FIRST_PRIOR`` for the first)."""
        self._settle()
        out: list[float] = []
        for i, (a, t) in enumerate(zip(self.accepted, self.tried)):
            p = prior[i] if prior is not None and i < len(prior) else (out[-1] if out else FIRST_PRIOR)
            out.append((a + strength * p) / (t + strength))
        return out


def expected_tokens(rates: Sequence[float], depth: int) -> float:
    """E(d) = 1 + sum_{i<=d} prod_{j<=i} a_j: tokens one step emits with ``depth`` drafts (module docstring)."""
    return _prefix(rates, max(0, depth))[-1]


@dataclass
class Choice:
    """One step's decision: ``k`` drafts per row (0: plain), its expected tokens/s, whether it is a probe, and the
    rows that draft (indices into the rows given to ``choose``; None: every row)."""

    k: int
    tokens_per_s: float
    probe: bool = False
    rows: tuple[int, ...] | None = None


class AdaptivePolicy:
    """Chooses each step's k for a batch (module docstring); one per decoder, shared by its requests.

    Args:
        cost: the measured ``CostModel``. k_max: most drafts per row per step (a tree: its depth).
        topk, num_nodes: for a tree, SGLang's ``topk`` and the node budget (``num_draft_tokens - 1``): a tree of
            depth d reads min(d * topk, num_nodes) tokens; None for chains.
        prior: the engine's prior conditional acceptance per position before any step (a head's recorded held-out
            acceptance: ``serve.costs.recorded_acceptance``); None: ``FIRST_PRIOR``, each later position as good as
            the one before it.

    Raises:
        ValueError: k_max < 1, or a prior rate outside [0, 1].

    Attributes:
        engine: the engine-wide ``AcceptanceEstimate``. histogram: steps per chosen k (``[k_max + 1]``).
        verify_scale, draft_scale: measured ÷ modelled cost over recent steps, any T / k (module docstring).
        verify_scales, draft_scales: the same per (batch-size bucket, tokens-per-row T), per k.
        bucket_scales: the verify forward's per batch-size bucket, any T.
    """

    def __init__(
        self,
        cost: CostModel,
        k_max: int,
        *,
        topk: int | None = None,
        num_nodes: int | None = None,
        prior: Sequence[float] | None = None,
    ):
        if k_max < 1:
            raise ValueError(f"adaptive speculation needs k_max >= 1, got {k_max}")
        if prior is not None and not all(0.0 <= a <= 1.0 for a in prior):
            raise ValueError(f"a prior acceptance is a rate per position in [0, 1], got {list(prior)}")
        self.cost, self.k_max, self.topk, self.num_nodes = cost, k_max, topk, num_nodes
        self.prior = list(prior) if prior else None
        self.engine = AcceptanceEstimate(k_max, ENGINE_DECAY)
        self.histogram = [0] * (k_max + 1)
        self._plain_run = 0
        self._plain_s = 0.0  # seconds of plain steps since the last probe (or drafting step)
        self._probe_cost: float | None = None  # a probe step's measured seconds beyond a plain step's
        self._probes_unanswered = 0  # probes since the last step that drafted for the batch (``probe_budget``)
        self._probing = False  # the step being chosen / observed is a probe
        self._hold: tuple | None = None  # (steps left, its key: ``choose``, plain's tokens/s, a probe's cost)
        self.verify_scale = self.draft_scale = 1.0
        self.verify_scales: dict[tuple[int, int], float] = {}
        self.bucket_scales: dict[int, float] = {}
        self.draft_scales: dict[int, float] = {}
        self._measured: dict[tuple, int] = {}  # measurements per scale (its weight: module docstring)
        self.realized = 1.0  #: drafts accepted ÷ expected over recent drafting steps (module docstring)
        self._realized_sums = [0.0, 0.0]  # decayed (accepted, expected) drafts
        self._expected = 0.0  # drafts the step being observed was expected to get accepted (unscaled)
        self._accepted = 0  # drafts accepted in the step being observed (``observe``)
        self.calibration = AcceptanceEstimate(CONFIDENCE_BINS, ENGINE_DECAY)  # per bin: position-1 counts
        self.start_s_per_position = cost.start_s_per_position  #: seconds of a drafter start per context position
        self.horizon = 1.0  #: tokens started requests' drafting steps emitted ÷ the tokens left at their starts
        self._horizon_sums = [0.0, 0.0]  # decayed (emitted by drafting steps, left at the start) over finished requests
        self.between_s = 0.0  #: measured seconds between two steps (module docstring)
        self.emission = EmissionCost()  #: measured seconds of emitting chunks and tokens (module docstring)
        self._between_seen = False
        self.catch_up = EmissionCost()  #: measured seconds of a drafter's catch-up: per row and per position
        self.run_tokens = RUN_PRIOR_TOKENS  #: tokens a drafting run that resumed after plain steps emits (mean)
        self._run_sums = [0.0, 0.0]  # decayed (tokens, runs) over ended runs
        self.realized_resumed = 1.0  #: ``realized`` over the rows that resumed drafting after plain steps
        self._resumed_sums = [0.0, 0.0]  # decayed (accepted, expected) drafts of resumed rows
        self._expected_resumed = 0.0  # as ``_expected``, for resumed rows
        self._accepted_resumed = 0  # as ``_accepted``, for resumed rows

    def new_request(self) -> AcceptanceEstimate:
        """A fresh estimate for one request (its rates start at the engine's)."""
        return AcceptanceEstimate(self.k_max, REQUEST_DECAY)

    def rates(
        self, request: AcceptanceEstimate | None, confidence: float | None = None, engine: list[float] | None = None
    ) -> list[float]:
        """A request's conditional acceptance per position, shrunk towards the engine's; with the drafter's
        ``confidence`` in its next draft, position 1 is its confidence bin's rate (module docstring). ``engine``:
        the engine's rates when the caller has them (one computation for a batch's rows)."""
        engine = engine if engine is not None else self.engine.rates(self.prior, ENGINE_PRIOR)
        fresh = request is None or not any(request.tried)  # nothing observed: its rates are the engine's
        rates = engine if fresh else request.rates(engine, REQUEST_PRIOR)
        if confidence is not None:
            b = _bin(confidence)
            tried, accepted = self.calibration.tried[b], self.calibration.accepted[b]
            rates = [(accepted + ENGINE_PRIOR * engine[0]) / (tried + ENGINE_PRIOR), *rates[1:]]
        return rates

    def reads(self, k: int) -> int:
        """Draft tokens one row's verify reads when it drafts ``k`` (a tree's depth)."""
        if self.topk is None:
            return k
        return min(k * self.topk, self.num_nodes or k * self.topk)

    def throughput(self, rows: Sequence[tuple], k: int, batch_size: int | None = None) -> float:
        """Expected emitted tokens per second of one step drafting ``k`` per row; ``rows``: (rates, cap[, context
        positions its drafter must read to start, 0 when started[, tokens it may still emit, default cap + 1[,
        positions its started drafter must catch up on, left by its plain steps]]]) each, standing for
        ``batch_size`` rows (default: themselves; module docstring)."""
        return self._options(self._rows(rows), batch_size, [k])[0]

    def _rows(self, rows: Sequence[tuple]) -> "_Rows":
        return _Rows(rows, catch_up=lambda positions: self.catch_up.seconds(1, positions))

    def _tokens(self, prefix: list[float], d: int, resumed: bool) -> float:
        """Expected tokens of one row drafting ``d`` (E(d)), its drafted part scaled by the realized ratio of its
        kind (a row resuming after plain steps or not: module docstring), at most 1 + d."""
        realized = self.realized_resumed if resumed else self.realized
        return min(1.0 + (prefix[d] - 1.0) * realized, 1.0 + d)

    def _options(self, rows: "_Rows", batch_size: int | None, ks: Sequence[int]) -> list[float]:
        """``throughput`` at each of ``ks`` for the same rows: O(groups x len(ks)) (what ``choose`` prices)."""
        n = len(rows.caps)
        scale = max(batch_size or n, n) / max(n, 1)
        out = []
        for k in ks:
            tokens, once = 0.0, 0.0
            for prefix, cap, count, spread, catch_s, resumed in rows.groups:
                d = k if k < cap else cap
                e = self._tokens(prefix, d, resumed)
                tokens += count * e
                if spread and d > 0:  # its rows' starts, each spread over the tokens it may still emit (E(d) <= left)
                    once += spread * self.start_s_per_position * e / self.horizon
                if catch_s and d > 0:  # its rows' catch-ups, each spread over the tokens a resumed run emits
                    once += catch_s * min(1.0, e / self.run_tokens)
            seconds = self._seconds(rows, k, batch_size) + (once + self.emission.seconds(n, tokens)) * scale
            out.append(tokens * scale / max(seconds, 1e-9))
        return out

    def choose(self, rows: Sequence[tuple], batch_size: int | None = None, waiting: int = 0) -> Choice:
        """This step's k for ``rows``, each (its estimate, the most it may draft[, the drafter's confidence in its
        next draft or None[, context positions its drafter must read to start, 0 once started[, tokens it may still
        emit]]]), priced at ``batch_size`` rows (the batch once the waiting requests have joined; default: the rows
        given); ``waiting``: requests waiting to join (0: the batch drains). While a
        waiting request has a free row (``batch_size`` > rows) the step is plain, and a batch that nobody waits to
        join drafts only what does not lengthen its drain; after two plain steps, the next steps of the same batch are
        plain without pricing, the more the farther drafting is from paying (``_hold_steps``; module docstring).
        Counted in ``histogram``."""
        if not rows:
            return Choice(0, 0.0)
        ids = tuple(id(row[0]) for row in rows if row[0] is not None)  # rows without an estimate: never held
        key = (ids, tuple(row[1] for row in rows), batch_size, waiting) if len(ids) == len(rows) else None
        held = self._held(key)
        if held is not None:
            return held
        engine = self.engine.rates(self.prior, ENGINE_PRIOR)
        scored = []
        for row in rows:
            est, cap, confidence, start, left, catch = (*row, *_ROW_DEFAULTS[len(row) - 2 :])
            if est is not None:
                est.confidence, est.resuming = confidence, bool(catch)
            cap = max(0, min(cap, self.k_max))
            scored.append((self.rates(est, confidence, engine), cap, start or 0, left, catch or 0))  # left: ``_Rows``
        priced = self._rows(scored)
        best_cap = max(priced.caps)
        options = list(zip(self._options(priced, batch_size, range(best_cap + 1)), range(best_cap + 1)))
        n = len(scored)
        eligible = [o for o in options[1:] if o[0] >= (1 + SPECULATE_MARGIN) * options[0][0]]
        queued = (batch_size or n) > n
        if queued:  # a request waits for this step to end to start: drafting delays it
            eligible = []
        elif eligible and n > 1 and waiting == 0:  # nobody waits to join: the batch drains
            drains = self._drains(priced, [0] + [k for _, k in eligible])
            eligible = [o for o, drain in zip(eligible, drains[1:]) if drain <= drains[0]]
        rate, k = max(eligible, key=lambda o: (o[0], -o[1])) if eligible else options[0]
        probe = False
        if k == 0 and best_cap > 0:
            self._plain_run += 1
            rate_k, k_probe = max(options[1:], key=lambda o: (o[0], -o[1]))
            one = max(
                (b for b, cap in enumerate(priced.caps) if cap > 0),
                key=lambda b: (not priced.starts[b], priced.lefts[b]),  # a started row first, then the most tokens left
            )
            k_probe = min(k_probe, priced.caps[one])
            hold = self._hold_steps(rate_k / ((1 + SPECULATE_MARGIN) * rate), queued) if key is not None else 0
            probe_s = self.probe_cost(scored, one, k_probe) if hold or self._plain_run >= PROBE_AFTER else 0.0
            if self._plain_run >= PROBE_AFTER and self._plain_s * self.probe_budget >= probe_s:
                rate, k, probe = rate_k, k_probe, True  # learn again: one row drafts once at the best positive k
                self._plain_run, self._plain_s = 0, 0.0
                self._probes_unanswered += 1
            elif hold:
                self._hold = (hold, key, rate, probe_s)
        elif k > 0:
            self._plain_run, self._plain_s, self._probes_unanswered = 0, 0.0, 0
        self._probing = probe
        self.histogram[k] += 1
        chosen = (
            priced
            if not probe
            else self._rows([(r, c if b == one else 0, *rest) for b, (r, c, *rest) in enumerate(scored)])
        )
        if k > 0:  # the rows whose drafter starts this step: what they may still emit, for ``horizon``
            for b, row in enumerate(rows):
                if row[0] is not None and priced.starts[b] and chosen.caps[b] > 0:  # a probe's: its one row
                    row[0].start_left = priced.lefts[b]
        self._expected = self._expected_resumed = 0.0
        self._accepted = self._accepted_resumed = 0
        for p, cap, count, _, _, resumed in chosen.groups if k and not probe else ():  # a probe: not in ``realized``
            if resumed:
                self._expected_resumed += count * (p[min(k, cap)] - 1.0)
            else:
                self._expected += count * (p[min(k, cap)] - 1.0)
        return Choice(k, rate, probe, (one,) if probe else None)

    def _hold_steps(self, x: float, queued: bool) -> int:
        """Plain steps to hold without pricing after this plain one (module docstring): ``x``, the best k's tokens/s
        over what drafting must reach; ``queued``: a request waiting to join keeps the step plain whatever the
        prices. 0 before two plain steps in a row (the first after drafting moves the prices most)."""
        if self._plain_run < 2:
            return 0
        if queued or x <= 0:
            return HOLD_STEPS
        if x >= 1:
            return 0
        return min(HOLD_STEPS, int(math.log(x) / math.log(1 - HOLD_DRIFT)))

    def _held(self, key: tuple | None) -> Choice | None:
        """A plain step without pricing, while a hold set by the last priced step lasts (``HOLD_STEPS``; the same
        rows, batch size and queue, no probe due: module docstring); None: price this step."""
        if self._hold is None or key is None:
            return None
        steps, held, rate, probe_s = self._hold
        self._hold = None
        if steps <= 0 or held != key or self._plain_s * self.probe_budget >= probe_s:
            return None
        self._hold = (steps - 1, held, rate, probe_s)
        self._plain_run += 1
        self._probing = False
        self.histogram[0] += 1
        self._expected = self._expected_resumed = 0.0
        self._accepted = self._accepted_resumed = 0
        return Choice(0, rate)

    def drain_seconds(self, rows: Sequence[tuple], k: int) -> float:
        """Modelled seconds until every one of ``rows`` (as ``throughput``'s) has emitted its tokens left, drafting
        ``k`` per row every step and no row joining (module docstring: a closed batch)."""
        return self._drains(self._rows(rows), [k])[0]

    def _drains(self, rows: "_Rows", ks: Sequence[int]) -> list[float]:
        """``drain_seconds`` at each of ``ks``: a row needs left / E(d) steps, and the batch pays each step at the
        size it has then: rows leave in order of their steps, the one that needs the most running last, alone."""
        out = []
        for k in ks:
            need = []  # (steps, depth, E) per row, by steps
            for (prefix, cap, _, _, _, resumed), members in zip(rows.groups, rows.members):
                d = k if k < cap else cap
                e = self._tokens(prefix, d, resumed)
                need.extend((rows.lefts[b] / e, d, e) for b in members)
            need.sort()
            total, depth, drafting, tokens = 0.0, 0, 0, 0.0
            for i in range(len(need) - 1, -1, -1):  # from the last row to leave: rows i.. run until need[i]'s steps
                steps, d, e = need[i]
                depth, drafting, tokens = max(depth, d), drafting + (d > 0), tokens + e  # one K serves them all
                since = need[i - 1][0] if i else 0.0
                if steps > since:
                    rows_left = len(need) - i
                    step = self._step_s(rows_left, depth, drafting) + self.emission.seconds(rows_left, tokens)
                    total += (steps - since) * step
            out.append(total)
        return out

    def step_seconds(self, rows: Sequence[tuple[list[float], int]], k: int, batch_size: int | None = None) -> float:
        """Modelled seconds of one step drafting ``k`` per row, ``rows`` standing for ``batch_size`` rows
        (``throughput``'s denominator)."""
        return self._seconds(_Rows(rows, prefixes=False), k, batch_size)

    def _seconds(self, rows: "_Rows", k: int, batch_size: int | None) -> float:
        n = len(rows.caps)
        longest = min(k, max(rows.caps, default=0))
        b = max(batch_size or n, n)
        drafting = round(rows.drafting * b / max(n, 1)) if longest > 0 else 0
        return self._step_s(b, longest, drafting)

    def _step_s(self, b: int, depth: int, drafting: int) -> float:
        """Modelled seconds of one step of ``b`` rows, ``drafting`` of them drafting ``depth`` (verify, the time
        between steps, drafts; scaled as measured)."""
        t = 1 + self.reads(depth)
        seconds = self.verify_scale_at(b, t) * self.cost.verify(b, t) + self.between_s
        return seconds + self.draft_scales.get(depth, self.draft_scale) * self.cost.draft(drafting, depth)

    def verify_scale_at(self, b: int, t: int) -> float:
        """The verify forward's measured ÷ modelled cost at ``b`` rows of ``t`` tokens: its batch-size bucket's at
        ``t``, else that bucket's at any T, else the average over all (module docstring)."""
        bucket = _bucket(b)
        scale = self.verify_scales.get((bucket, t))
        return scale if scale is not None else self.bucket_scales.get(bucket, self.verify_scale)

    @property
    def probe_budget(self) -> float:
        """The fraction of plain decoding time probes may cost now: ``PROBE_BUDGET``, halved (``PROBE_BACKOFF``) per
        probe since the last step that drafted for the batch, at most ``PROBE_BACKOFF_MAX`` times (module
        docstring)."""
        return PROBE_BUDGET * PROBE_BACKOFF ** min(self._probes_unanswered, PROBE_BACKOFF_MAX)

    def probe_cost(self, rows: Sequence[tuple], row: int, k: int) -> float:
        """Seconds a probe of ``k`` drafts in row ``row`` alone costs beyond a plain step: its verify and draft
        seconds as last measured (else modelled), plus the row's drafter start when it has not started (module
        docstring)."""
        start = rows[row][2] if len(rows[row]) > 2 else 0
        start_s = start * self.start_s_per_position
        if self._probe_cost is not None:
            return self._probe_cost + start_s
        catch = rows[row][4] if len(rows[row]) > 4 else 0
        catch_s = self.catch_up.seconds(1, catch) if catch else 0.0
        alone = [(rates, k if b == row else 0, *rest) for b, (rates, _, *rest) in enumerate(rows)]
        return max(0.0, self.step_seconds(alone, k) - self.step_seconds(rows, 0)) + start_s + catch_s

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
        """One step's measured costs: a verify forward over ``batch_size`` rows of ``tokens_per_row`` tokens took
        ``verify_s`` seconds, ``drafting`` rows drafting ``k`` took ``draft_s`` in the proposer (drafts and
        accepts), and drafter starts over ``start_positions`` context positions in all took ``start_s`` (a row's
        first draft: ``core.batch``); ``catch_up_rows`` drafting rows caught their drafters up on the
        ``catch_up_positions`` positions their plain steps left in ``catch_up_s`` (not in ``draft_s``);
        ``between_s`` (None: not measured) passed between the previous step and this one, and emitting its
        ``emitted`` tokens took ``emit_s`` (module docstring). Verify and draft seconds update the scales, starts
        the cost per position, catch-ups their fit, the others their averages; a plain step's seconds count towards
        the probe budget, a probe's set its cost."""
        own = verify_s + draft_s + start_s + catch_up_s
        if between_s is not None and between_s >= 0:  # a pause longer than the step itself is no step's cost
            w = OVERHEAD_WEIGHT if self._between_seen else 1.0
            self.between_s, self._between_seen = (1 - w) * self.between_s + w * min(between_s, own), True
        if emitted > 0 and emit_s >= 0:  # one chunk per row
            self.emission.observe(batch_size, emitted, min(emit_s, own))
        if catch_up_rows > 0 and catch_up_positions > 0:
            self.catch_up.observe(catch_up_rows, catch_up_positions, catch_up_s)
        if start_positions > 0:
            per_position = start_s / start_positions
            w = START_WEIGHT if self.start_s_per_position > 0 else 1.0  # the first measurement, when none was profiled
            self.start_s_per_position = (1 - w) * self.start_s_per_position + w * per_position
        sums = self._realized_sums
        if k > 0 and self._expected > 0:  # the policy's own optimism (module docstring)
            sums[0] = REALIZED_DECAY * sums[0] + self._accepted
            sums[1] = REALIZED_DECAY * sums[1] + self._expected
        elif k == 0:  # a plain step ages what the sums saw, as it does a request's counts
            sums[0], sums[1] = REALIZED_DECAY * sums[0], REALIZED_DECAY * sums[1]
        self.realized = (sums[0] + REALIZED_PRIOR) / (sums[1] + REALIZED_PRIOR)
        sums = self._resumed_sums
        if k > 0 and self._expected_resumed > 0:  # resumptions are apart by plain steps: those do not age these sums
            sums[0] = RESUMED_DECAY * sums[0] + self._accepted_resumed
            sums[1] = RESUMED_DECAY * sums[1] + self._expected_resumed
            self.realized_resumed = (sums[0] + REALIZED_PRIOR) / (sums[1] + REALIZED_PRIOR)
        self._expected = self._expected_resumed = 0.0
        self._accepted = self._accepted_resumed = 0
        if k == 0:
            self._plain_s += verify_s + draft_s + start_s
        elif self._probing:
            plain = self.verify_scale_at(batch_size, 1) * self.cost.verify(batch_size, 1)
            self._probe_cost = max(0.0, verify_s + draft_s + catch_up_s - plain)  # its start: priced per position
        self._probing = False

        def update(key: tuple, scale: float, measured: float, modelled: float) -> float:
            if measured <= 0 or modelled <= 0:
                return scale
            n = self._measured[key] = self._measured.get(key, 0) + 1
            w = max(SCALE_WEIGHT, 1.0 / (n + 1))  # the profile weighs as one measurement (module docstring)
            ratio = min(max(measured / modelled, SCALE_RANGE[0]), SCALE_RANGE[1])
            return (1 - w) * scale + w * ratio

        t, modelled = tokens_per_row, self.cost.verify(batch_size, tokens_per_row)
        bucket = _bucket(batch_size)
        scale = self.verify_scale_at(batch_size, t)
        self.verify_scales[(bucket, t)] = update(("verify", bucket, t), scale, verify_s, modelled)
        scale = self.bucket_scales.get(bucket, self.verify_scale)
        self.bucket_scales[bucket] = update(("verify", bucket), scale, verify_s, modelled)
        self.verify_scale = update(("verify",), self.verify_scale, verify_s, modelled)
        if k > 0 and drafting > 0:
            modelled = self.cost.draft(drafting, k)
            self.draft_scales[k] = update(("draft", k), self.draft_scales.get(k, self.draft_scale), draft_s, modelled)
            self.draft_scale = update(("draft",), self.draft_scale, draft_s, modelled)

    def observe(self, request: AcceptanceEstimate | None, num_proposed: int, num_accepted: int) -> None:
        """One row's verify outcome (the depth it asked for along its path, drafts accepted) updates its and the
        engine's rates (module docstring); a row that drafted nothing ages its request's counts."""
        if num_proposed <= 0:
            if request is not None:
                request.age()
                self._end_run(request)
            return
        if request is not None and request.resuming:
            self._accepted_resumed += num_accepted
        else:
            self._accepted += num_accepted
        self.engine.observe(num_proposed, num_accepted)
        if request is not None:
            request.observe(num_proposed, num_accepted)
            if request.start_left is not None:
                request.drafted += num_accepted + 1
            if request.resuming and not self._probing:  # a probe tries one step: it is not a run
                request.run = 0
            if request.run is not None:
                request.run += num_accepted + 1
            if request.confidence is not None:
                b = _bin(request.confidence)
                c = self.calibration
                c.tried[b] = c.decay * c.tried[b] + 1.0
                c.accepted[b] = c.decay * c.accepted[b] + float(num_accepted > 0)
                request.confidence = None

    def finish(self, request: AcceptanceEstimate | None) -> None:
        """A request ended: if its drafter started, the tokens its drafting steps emitted since, over those it could
        still emit then, update ``horizon`` (module docstring)."""
        if request is None:
            return
        self._end_run(request)
        if not request.start_left:
            return
        sums = self._horizon_sums
        sums[0] = HORIZON_DECAY * sums[0] + min(request.drafted, request.start_left)
        sums[1] = HORIZON_DECAY * sums[1] + request.start_left
        request.start_left = None  # counted once
        self.horizon = max((sums[0] + HORIZON_PRIOR) / (sums[1] + HORIZON_PRIOR), 1.0 / START_HORIZON)

    def _end_run(self, request: AcceptanceEstimate) -> None:
        """The drafting run ``request`` resumed (if any) ended, at a plain step or its end: its tokens update
        ``run_tokens`` (module docstring)."""
        if request.run is None:
            return
        sums = self._run_sums
        sums[0] = RUN_DECAY * sums[0] + request.run
        sums[1] = RUN_DECAY * sums[1] + 1.0
        request.run = None
        self.run_tokens = (sums[0] + RUN_PRIOR * RUN_PRIOR_TOKENS) / (sums[1] + RUN_PRIOR)


_ROW_DEFAULTS = (None, 0, None, 0)  # a row's (confidence, start positions, tokens left, catch-up positions) unsaid


class _Rows:
    """A batch's rows as priced: cap (most drafts), start positions and tokens left (at most ``START_HORIZON``; at
    least cap + 1) per row; and ``groups``, the rows that share one rates list, cap and whether they resume after
    plain steps (every request that has not drafted yet shares the engine's), each as (E(d) for d = 0..cap, cap,
    rows, sum of start positions / tokens left, sum of catch-up seconds, resumed): pricing every k is
    O(groups x k), one pass over each group's rates, not O(rows x k^2). ``catch_up``: seconds of a catch-up over
    so many positions (None: catch-ups cost nothing)."""

    def __init__(self, rows: Sequence[tuple], prefixes: bool = True, catch_up=None):
        self.caps = [max(0, row[1]) for row in rows]
        catches = [(row[4] or 0) if len(row) > 4 else 0 for row in rows]
        self.starts = [(row[2] or 0) if len(row) > 2 else 0 for row in rows]
        self.lefts = [
            max(cap + 1, min(row[3] if len(row) > 3 and row[3] is not None else cap + 1, START_HORIZON))
            for row, cap in zip(rows, self.caps)
        ]
        self.drafting = sum(1 for cap in self.caps if cap > 0)
        groups: dict[tuple[int, int], list] = {}
        members: dict[tuple[int, int], list[int]] = {}
        if prefixes:
            for b, (row, cap, start, left, catch) in enumerate(zip(rows, self.caps, self.starts, self.lefts, catches)):
                key = (id(row[0]), cap, catch > 0)
                group = groups.get(key)
                if group is None:
                    group = groups[key] = [_prefix(row[0], cap), cap, 0, 0.0, 0.0, catch > 0]
                    members[key] = []
                group[2] += 1
                group[3] += start / left
                if catch > 0 and catch_up is not None:
                    group[4] += catch_up(catch)
                members[key].append(b)
        self.groups = list(groups.values())
        self.members = list(members.values())  #: per group, its rows' indices


def _prefix(rates: Sequence[float], cap: int) -> list[float]:
    """[E(0), E(1), .., E(cap)] (``expected_tokens`` at each depth; a depth past the rates adds nothing)."""
    out, total, reach = [1.0], 1.0, 1.0
    for i in range(cap):
        reach *= rates[i] if i < len(rates) else 0.0
        total += reach
        out.append(total)
    return out


def _bucket(b: int) -> int:
    """The power of two at or below ``b`` (>= 1): the batch sizes that share a verify scale."""
    return 1 << (max(int(b), 1).bit_length() - 1)


def _bin(confidence: float) -> int:
    return min(max(int(confidence * CONFIDENCE_BINS), 0), CONFIDENCE_BINS - 1)
