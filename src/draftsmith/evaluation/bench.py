"""Serving benchmark: the same prompts, at one or more concurrencies, through the server with and without
speculation.

    draftsmith bench --target reference --methods none eagle3 ngram draft_model --k 5 \\
        --head runs/reference-eagle3/head --hf-peer --num-prompts 8 --max-tokens 64 --concurrency 1 4 16 32 \\
        --out runs/bench
    draftsmith bench --target reference --url http://127.0.0.1:8000 --url http://127.0.0.1:8001   # running servers

Steps:
  1. Prompts: the first ``num_prompts`` of the held-out tasks (round robin over tasks), rendered with the
     target's chat template into token ids, so every server and the HF peer read identical ids.
  2. Servers: given ``--url``s (each server's ``/v1/models`` says its speculative method), or one
     in-process server per method on a free loopback port, every engine sharing the one loaded target and
     keeping ``Engine``'s batching defaults (``max_num_seqs`` 64, ``max_num_batched_tokens`` 2048,
     ``max_waiting`` 1024, as ``draftsmith serve``): above 64 in flight, requests wait in its queue.
     Before loading, the memory plan (``serve/memory.py``) of every method must fit.
  3. Warm-up: a few short requests per server. Then ``rounds`` rounds; a round runs, for each concurrency c
     (ascending), one batch on each server in turn (the server order rotates per round), and the
     no-speculation server's batches between them (``baseline_every``: one first, then one after every N
     other batches, so each batch is bracketed by plain batches run just before and after). A batch at c sends
     ``max(num_prompts, c)`` requests, request i being prompt ``i mod num_prompts``, with at most c in
     flight (a semaphore over streamed ``/v1/completions``, temperature 0, ``stream_options.include_usage``):
     so c requests start together even when c > num_prompts; in-flight count falls to 0 as the batch drains.
     ``/metrics`` is scraped before and after every batch, and polled every 0.1 s during it for the
     ``num_requests_running`` / ``num_requests_waiting`` gauges only (their peaks show what really ran together;
     ``run_batch``: a full scrape during the batch would slow the server it measures).
     A request answered with an HTTP error, a mid-stream error event, a broken stream or no ``[DONE]`` is a
     failure: counted, left out of the timings, never raised.
  4. Per (method, c): request throughput and output tokens/s of the successful requests (median over
     rounds); TTFT = send -> first streamed text, TPOT = (latency - TTFT) / (tokens - 1), each as mean, p50
     and p99 over all successful requests of all rounds; acceptance rate = Δaccepted / Δdraft tokens and
     τ = 1 + Δaccepted / Δdrafts from the ``/metrics`` deltas; ``greedy_mismatches`` = responses (every
     round) whose text differs from the same prompt's no-speculation response served alone (c = 1: the
     baseline's c = 1 batch, or one extra c = 1 batch when 1 is not among the levels); ``baseline_mismatches``
     = responses that differ from the no-speculation server's response to the same request at the same c in
     the same round (speculation's own effect, batching aside). Per method, ``scaling`` = tokens/s at the
     highest c ÷ tokens/s at c = 1 (the lowest measured c when 1 is not measured; ``scaling_from``/``_to``).
  5. HF peer (``--hf-peer``): transformers ``generate`` on the same ids, one request at a time, so measured
     at c = 1 only: plain greedy, prompt lookup (``prompt_lookup_num_tokens=k``) and, with a draft model,
     assisted generation with ``num_assistant_tokens=k``, ``num_assistant_tokens_schedule="constant"``,
     ``assistant_confidence_threshold=0`` on the draft's generation_config. TTFT/TPOT come from a streamer;
     its τ is tokens per target forward (HF does not count drafts).
  6. Verdict: at each c, speedup = median over rounds of (method tokens/s / the geometric mean of the
     bracketing no-speculation batches' tokens/s; unpaired: no-speculation's batch at the same c in the same
     round); per method, the verdict names the concurrencies where the speedup is below
     1.0 ("not worth enabling at c=16, 32") or says it pays at every measured concurrency (acceptance alone
     is not the verdict). HF peers are compared with HF plain generate.
  7. Interleaved (``--interleave``, in-process servers): instead of bracketing, each batch runs AT ONCE with a
     plain batch of the same requests, the two engines stepping in turn (``evaluation/interleave.py``: the next
     step goes to the one that has stepped the fewest seconds so far), and each batch's tokens/s is over its own
     seconds (its wall time less the seconds its engine waited for the other's steps), so both meet the machine
     over the same seconds: its speedup is over that plain batch. TTFT and TPOT then include the other's steps.
  8. A/A control (``--control``): a second no-speculation server, ``none-control``, is measured as a method. Its
     speedup is 1.0 in truth, so what it reads is the bench's resolution: on a shared 2-core CPU at c = 32 single
     paired batches of plain against plain read 0.91-1.05x (8 rounds), wider than the few percent a method's
     bookkeeping costs, so a one-batch speedup a few percent below 1.0 says nothing on its own.
Timings use ``torch.set_num_threads(threads)``; numbers are medians because a shared machine is noisy. The
client shares the process (and the GIL) with in-process servers. Writes ``report.json`` (per method a list
over concurrency), ``table.md`` and ``bench.png`` (throughput and speedup vs concurrency) to ``--out``, each
through a temporary file and a rename.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import math
import os
import statistics
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Callable, Sequence

import numpy as np
import torch
from tqdm.auto import tqdm
from transformers import AutoTokenizer

from draftsmith import reference
from draftsmith.core.stops import stop_token_ids
from draftsmith.data_pipeline.chat import prompt_ids
from draftsmith.evaluation.bench_config import (
    BASELINE,
    CONTROL,
    HF_BASELINE,
    K_MARK,
    BenchConfig,
    bench_methods,
    fixed_k,
    rounds_at,
    speculative_config,
)
from draftsmith.evaluation.interleave import Turnstile
from draftsmith.models import load_causal_lm
from draftsmith.serve.engine import Engine
from draftsmith.serve.memory import plan_for_engine
from draftsmith.serve.server import BackgroundServer, create_app

logger = logging.getLogger(__name__)

SPEC_COUNTERS = {
    "drafts": "draftsmith:spec_decode_num_drafts_total",
    "draft_tokens": "draftsmith:spec_decode_num_draft_tokens_total",
    "accepted": "draftsmith:spec_decode_num_accepted_tokens_total",
    "chosen_k_sum": "draftsmith:spec_decode_chosen_k_sum",  # adaptive speculation only (absent: 0)
    "chosen_k_count": "draftsmith:spec_decode_chosen_k_count",
}
SCHEDULER_GAUGES = {
    "running": "draftsmith:num_requests_running",
    "waiting": "draftsmith:num_requests_waiting",
}
HF_NOTE = "transformers generate, one request at a time: measured at c=1 only"
WARMUP_TOKENS = 8  #: tokens per warm-up request (``_measure``)
CONTROL_VERDICT = (
    "A/A control: a second no-speculation server; its speedups are what this bench reads for a method equal to plain "
    "(the resolution of the others)"
)


@dataclass
class RequestRecord:
    """One streamed request as the client saw it (seconds; tokens from the server's usage).

    ``error`` is None for a success; for a failure it says why, ``tokens`` is 0 and ``text`` empty."""

    ttft_s: float
    latency_s: float
    tokens: int
    text: str = ""
    error: str | None = None

    @property
    def ok(self) -> bool:
        """The request succeeded."""
        return self.error is None

    @property
    def tpot_s(self) -> float | None:
        """(latency - TTFT) / (tokens - 1); None for a single-token completion."""
        return (self.latency_s - self.ttft_s) / (self.tokens - 1) if self.tokens > 1 else None


@dataclass
class BatchResult:
    """One batch sent to one server: per-request records (request order: request i is prompt
    ``i mod num_prompts``), wall time (s), /metrics counter deltas, the concurrency it ran at and the peaks of
    the scheduler gauges seen while polling (``{"running": n, "waiting": n}``, empty when never seen).

    Paired measurement (``BenchConfig.baseline_every`` > 0) sets, on a batch of a speculative server, the
    no-speculation batches run just before and after it at the same concurrency (``before``, ``after``; the
    latter None when the round ended first); interleaved (``BenchConfig.interleave``), both are the plain batch
    run at once with it. ``started_s``: ``time.perf_counter()`` at its start; ``waited_s``: seconds of its wall
    time its engine waited for another engine's steps (interleaved; 0 otherwise)."""

    records: list[RequestRecord]
    wall_s: float
    counters: dict[str, float] = field(default_factory=dict)
    concurrency: int = 1
    peaks: dict[str, float] = field(default_factory=dict)
    before: "BatchResult | None" = field(default=None, repr=False)
    after: "BatchResult | None" = field(default=None, repr=False)
    started_s: float = 0.0
    waited_s: float = 0.0

    @property
    def own_s(self) -> float:
        """Its seconds: wall time less what its engine waited for another's steps (interleaved)."""
        return max(self.wall_s - self.waited_s, 1e-9)

    @property
    def output_tokens_per_s(self) -> float:
        """Output tokens of the successful requests ÷ its own seconds (``own_s``)."""
        return sum(r.tokens for r in self.records if r.ok) / self.own_s

    @property
    def baseline_tokens_per_s(self) -> float | None:
        """Paired: the geometric mean of the bracketing plain batches' tokens/s (one when only one ran; None
        unpaired, or when a bracketing batch made no tokens)."""
        rates = [b.output_tokens_per_s for b in (self.before, self.after) if b is not None]
        if not rates or min(rates) <= 0:
            return None
        return math.prod(rates) ** (1.0 / len(rates))


# --- numbers -------------------------------------------------------------------------------------------------


def distribution(values: Sequence[float]) -> dict[str, float | None]:
    """mean, p50 and p99 (numpy's linear-interpolated percentiles) of ``values``; all None when empty."""

    if not values:
        return {"mean": None, "p50": None, "p99": None}
    arr = np.asarray(values, dtype=float)
    return {"mean": float(arr.mean()), "p50": float(np.percentile(arr, 50)), "p99": float(np.percentile(arr, 99))}


def reference_texts_of(batch: BatchResult) -> list[str | None]:
    """Per prompt, the text a c = 1 batch gave (None where that request failed): the greedy reference."""
    return [r.text if r.ok else None for r in batch.records]


def summarize(
    batches: Sequence[BatchResult],
    reference_texts: Sequence[str | None] | None = None,
    baseline_batches: Sequence[BatchResult] | None = None,
) -> dict:
    """One (method, concurrency) row from its rounds' batches (all at the same concurrency).

    Throughput (requests/s, output tokens/s) counts successful requests and is the median over rounds;
    TTFT/TPOT distributions (ms) pool the successful requests of all rounds. Acceptance rate and τ come from
    the summed counter deltas (None when nothing was drafted, e.g. no speculation).

    Args:
        batches: one per round. reference_texts: per prompt, the no-speculation text served alone (None entries
            are not compared); request i is checked against entry ``i mod len``: ``greedy_mismatches`` counts
            the differing successful responses of all rounds (``greedy_checked`` how many were compared).
        baseline_batches: the no-speculation server's batches at the same concurrency, same rounds:
            ``baseline_mismatches`` counts responses differing from its response to the same request (in the
            plain batch just before, when the measurement was paired).

    Returns:
        The row dict (``greedy_mismatches`` / ``baseline_mismatches`` None without their references).
    """
    records = [r for b in batches for r in b.records]
    good = [r for r in records if r.ok]
    per_round = [
        {
            "requests_per_s": sum(r.ok for r in b.records) / b.own_s,
            "output_tokens_per_s": b.output_tokens_per_s,
        }
        for b in batches
    ]
    counters = {name: sum(b.counters.get(name, 0.0) for b in batches) for name in SPEC_COUNTERS}
    drafts, draft_tokens, accepted = counters["drafts"], counters["draft_tokens"], counters["accepted"]
    errors = list(dict.fromkeys(r.error for r in records if not r.ok))
    row = {
        "concurrency": batches[0].concurrency,
        "rounds": len(batches),
        "requests": len(records),
        "failed": len(records) - len(good),
        "errors": errors[:3],
        "output_tokens": sum(r.tokens for r in good),
        "requests_per_s": statistics.median(x["requests_per_s"] for x in per_round),
        "output_tokens_per_s": statistics.median(x["output_tokens_per_s"] for x in per_round),
        "output_tokens_per_s_rounds": [x["output_tokens_per_s"] for x in per_round],
        "paired_baseline_tokens_per_s": [b.baseline_tokens_per_s for b in batches],
        "ttft_ms": distribution([1e3 * r.ttft_s for r in good]),
        "tpot_ms": distribution([1e3 * r.tpot_s for r in good if r.tpot_s is not None]),
        "acceptance_rate": accepted / draft_tokens if draft_tokens else None,
        "tau": 1.0 + accepted / drafts if drafts else None,
        "mean_chosen_k": counters["chosen_k_sum"] / counters["chosen_k_count"] if counters["chosen_k_count"] else None,
        "counters": counters,
        "peak_running": max((b.peaks["running"] for b in batches if "running" in b.peaks), default=None),
        "peak_waiting": max((b.peaks["waiting"] for b in batches if "waiting" in b.peaks), default=None),
        "greedy_mismatches": None,
        "greedy_checked": 0,
        "baseline_mismatches": None,
    }
    if reference_texts:
        pairs = [
            (r.text, reference_texts[i % len(reference_texts)])
            for b in batches
            for i, r in enumerate(b.records)
            if r.ok
        ]
        pairs = [(text, ref) for text, ref in pairs if ref is not None]
        row["greedy_mismatches"], row["greedy_checked"] = sum(a != b for a, b in pairs), len(pairs)
    if baseline_batches is not None:
        paired = all(b.before is not None for b in batches)
        row["baseline_mismatches"] = sum(
            r.text != s.text
            for b, base in zip(batches, [b.before for b in batches] if paired else baseline_batches)
            for r, s in zip(b.records, base.records)
            if r.ok and s.ok
        )
    return row


def format_speedup(speedup: float) -> str:
    """'1.23x'; three decimals when two would round a value across 1.0 (0.998 -> '0.998x', not '1.00x')."""
    digits = 3 if round(speedup, 2) == 1.0 and speedup != 1.0 else 2
    return f"{speedup:.{digits}f}x"


def verdict(speedup: float | None) -> str:
    """'1.23x: worth enabling' / '0.87x: not worth enabling' (below 1.0) / 'n/a' without a baseline."""
    if speedup is None:
        return "n/a"
    return format_speedup(speedup) + ": " + ("worth enabling" if speedup >= 1.0 else "not worth enabling")


def round_speedups(row: dict, base: dict) -> list[float]:
    """``row``'s speedup in each round over the ``base`` (plain) row: its tokens/s ÷ the plain batches bracketing
    it when the measurement was paired (``paired_baseline_tokens_per_s``), else ÷ the base's batch of the same
    round (rounds beyond the shorter list, and rounds where the base made no tokens, are left out)."""
    paired = row.get("paired_baseline_tokens_per_s") or []
    bases = paired if paired and None not in paired else base.get("output_tokens_per_s_rounds") or []
    return [a / b for a, b in zip(row.get("output_tokens_per_s_rounds") or [], bases) if b and b > 0]


def add_verdicts(rows: dict[str, dict], baseline: str = BASELINE, prefix: str = "") -> None:
    """Set ``speedup`` and ``verdict`` on every row whose name starts with ``prefix`` (baseline included, 1.0).

    ``rows``: ``{method: row}`` at one concurrency. speedup = median over rounds of row tokens/s ÷ baseline
    tokens/s: the plain batches bracketing that batch when the measurement was paired
    (``paired_baseline_tokens_per_s``), else the baseline's batch of the same round (rounds beyond the shorter
    list, and rounds where the baseline made no tokens, are ignored)."""
    base = rows.get(baseline)
    for name, row in rows.items():
        if not name.startswith(prefix):
            continue
        if base is None:
            row["speedup"], row["verdict"] = None, "n/a (no baseline run)"
            continue
        ratios = round_speedups(row, base)
        row["speedup"] = statistics.median(ratios) if ratios else None
        if name == baseline:
            row["verdict"] = "baseline"
        elif name == CONTROL:  # not a method to enable: its speedup is the bench's resolution
            shown = "" if row["speedup"] is None else format_speedup(row["speedup"]) + ": "
            row["verdict"] = shown + "A/A control"
        else:
            row["verdict"] = verdict(row["speedup"])


def _levels(values: Sequence[int]) -> str:
    return ", ".join(str(c) for c in values)


def method_verdict(per_concurrency: Sequence[dict], is_baseline: bool = False) -> dict:
    """One method's verdict over its concurrency rows (each with ``concurrency`` and ``speedup``).

    Returns:
        ``{"verdict": str, "not_worth_enabling_at": [c, ...], "worth_enabling_at": [c, ...]}``: the verdict
        names the concurrencies with speedup < 1.0 ("not worth enabling at c=16, 32 (0.93x, 0.81x); worth
        enabling at c=1, 4") or says "worth enabling at every measured concurrency (c=...)"; concurrencies
        without a speedup (no baseline tokens) are named as n/a.
    """
    if is_baseline:
        return {"verdict": "baseline", "not_worth_enabling_at": [], "worth_enabling_at": []}
    known = [(r["concurrency"], r["speedup"]) for r in per_concurrency if r.get("speedup") is not None]
    unknown = [r["concurrency"] for r in per_concurrency if r.get("speedup") is None]
    bad = [(c, s) for c, s in known if s < 1.0]
    good = [(c, s) for c, s in known if s >= 1.0]
    out = {"not_worth_enabling_at": [c for c, _ in bad], "worth_enabling_at": [c for c, _ in good]}
    if not known:
        no_run = any(str(r.get("verdict", "")).startswith("n/a (no baseline") for r in per_concurrency)
        return out | {"verdict": "n/a (no baseline run)" if no_run else "n/a (the baseline made no tokens)"}

    def speedups(pairs) -> str:
        return ", ".join(format_speedup(s) for _, s in pairs)

    def levels(pairs) -> str:
        return _levels([c for c, _ in pairs])

    if not bad and not unknown:
        return out | {"verdict": f"worth enabling at every measured concurrency (c={levels(good)}: {speedups(good)})"}
    parts = [f"not worth enabling at c={levels(bad)} ({speedups(bad)})"] if bad else []
    parts += [f"worth enabling at c={levels(good)} ({speedups(good)})"] if good else []
    if unknown:
        parts.append(f"n/a at c={_levels(unknown)} (baseline made no tokens)")
    return out | {"verdict": "; ".join(parts)}


def scaling(per_concurrency: Sequence[dict]) -> dict:
    """tokens/s at the highest concurrency ÷ tokens/s at the lowest (c = 1 when measured).

    Returns ``{"scaling": x or None, "scaling_from": c_lo, "scaling_to": c_hi}``; None with a single level or
    no tokens at the lowest."""
    rows = sorted(per_concurrency, key=lambda r: r["concurrency"])
    lo, hi = rows[0], rows[-1]
    value = (
        hi["output_tokens_per_s"] / lo["output_tokens_per_s"] if len(rows) > 1 and lo["output_tokens_per_s"] else None
    )
    return {"scaling": value, "scaling_from": lo["concurrency"], "scaling_to": hi["concurrency"]}


def build_report(
    config: dict,
    results: dict[str, dict[int, list[BatchResult]]],
    reference_texts: Sequence[str | None] | None = None,
    reference_info: dict | None = None,
    hf_results: dict[str, list[BatchResult]] | None = None,
) -> dict:
    """The report from the measurements.

    Args:
        config: the run's settings (``asdict(BenchConfig)`` plus extras). results: ``{method: {c: [BatchResult
            per round]}}`` of the servers. reference_texts: per prompt, the no-speculation text served alone.
        reference_info: how that reference was obtained (kept as ``report["reference"]``).
        hf_results: ``{hf:name: [BatchResult per round]}`` from ``hf_peer`` (c = 1; counters hold 'forwards').

    Returns:
        ``{"config", "concurrency": [c, ...], "reference", "methods": {name: {"kind": "server" | "hf",
        "per_concurrency": [row per c, ascending], "scaling", "scaling_from", "scaling_to", "verdict",
        "not_worth_enabling_at", "worth_enabling_at"}}}`` (rows as ``summarize`` plus speedup / verdict).
    """
    levels = sorted({c for per_c in results.values() for c in per_c})
    rows: dict[str, dict[int, dict]] = {}
    for name, per_c in results.items():
        rows[name] = {}
        for c, batches in sorted(per_c.items()):
            base = results.get(BASELINE, {}).get(c) if name != BASELINE else None
            rows[name][c] = summarize(batches, reference_texts, base)
    for c in levels:
        add_verdicts({name: per_c[c] for name, per_c in rows.items() if c in per_c})
    methods = {}
    for name, per_c in rows.items():
        ordered = [per_c[c] for c in sorted(per_c)]
        methods[name] = {"kind": "server", "per_concurrency": ordered, **scaling(ordered)}
        methods[name] |= method_verdict(ordered, is_baseline=name == BASELINE)
        if name == CONTROL:  # not a method to enable: its speedups are the bench's resolution
            methods[name] |= {"verdict": CONTROL_VERDICT, "not_worth_enabling_at": [], "worth_enabling_at": []}
    if hf_results:
        hf_rows = {}
        for name, batches in hf_results.items():
            row = summarize(batches, reference_texts)
            forwards = sum(b.counters.get("forwards", 0.0) for b in batches)
            row["acceptance_rate"] = None
            row["tau"] = row["output_tokens"] / forwards if forwards else None
            hf_rows[name] = row
        add_verdicts(hf_rows, baseline=HF_BASELINE, prefix="hf:")
        for name, row in hf_rows.items():
            methods[name] = {"kind": "hf", "note": HF_NOTE, "per_concurrency": [row], **scaling([row])}
            methods[name] |= method_verdict([row], is_baseline=name == HF_BASELINE)
    return {"config": config, "concurrency": levels, "reference": reference_info or {}, "methods": methods}


# --- the report ----------------------------------------------------------------------------------------------


def _fmt(value, spec: str = ".1f", none: str = "-") -> str:
    return none if value is None else format(value, spec)


def format_table(report: dict) -> str:
    """Markdown: a row per method × concurrency (servers, then HF peers at c = 1), then a row per method with
    its scaling and verdict, then notes."""
    cfg = report["config"]
    levels = report["concurrency"]
    head = (
        f"k={cfg['k']}, concurrency={_levels(levels)}, {cfg['num_prompts']} prompts (max(prompts, c) requests "
        f"per batch) x {cfg['max_tokens']} max tokens, {cfg['rounds']} rounds, torch threads={cfg['threads']}, "
        f"device={cfg['device']}"
    )
    lines = [
        head,
        "",
        "| method | c | req/s | out tok/s | TTFT mean / p50 / p99 (ms) | TPOT mean / p50 / p99 (ms) | accept | τ "
        "| mean k (auto) | failed | peak running | greedy diff alone / none | speedup | verdict |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---|",
    ]
    for name, method in report["methods"].items():
        for row in method["per_concurrency"]:
            ttft, tpot = row["ttft_ms"], row["tpot_ms"]
            diff = f"{_fmt(row.get('greedy_mismatches'), 'd')} / {_fmt(row.get('baseline_mismatches'), 'd')}"
            speedup = row.get("speedup")
            lines.append(
                f"| {name} | {row['concurrency']} | {row['requests_per_s']:.2f} | {row['output_tokens_per_s']:.1f} "
                f"| {_fmt(ttft['mean'])} / {_fmt(ttft['p50'])} / {_fmt(ttft['p99'])} "
                f"| {_fmt(tpot['mean'])} / {_fmt(tpot['p50'])} / {_fmt(tpot['p99'])} "
                f"| {_fmt(row.get('acceptance_rate'), '.1%')} | {_fmt(row.get('tau'), '.2f')} "
                f"| {_fmt(row.get('mean_chosen_k'), '.2f')} | {row['failed']} "
                f"| {_fmt(row.get('peak_running'), '.0f')} | {diff} "
                f"| {'-' if speedup is None else format_speedup(speedup)} "
                f"| {row.get('verdict', '')} |"
            )
    lines += ["", "| method | scaling (out tok/s, highest c ÷ lowest) | verdict |", "|---|---:|---|"]
    for name, method in report["methods"].items():
        value = method["scaling"]
        if value is not None:
            shown = f"{value:.2f}x (c={method['scaling_from']}→{method['scaling_to']})"
        else:
            single = method["scaling_from"] == method["scaling_to"]
            shown = "- (one request at a time)" if method["kind"] == "hf" else ("- (one level)" if single else "-")
        lines.append(f"| {name} | {shown} | {method['verdict']} |")
    ref = report.get("reference") or {}
    alone = (
        "no reference (no 'none' server)"
        if not ref.get("available")
        else ("an extra c=1 batch" if ref.get("separate_run") else "its c=1 batch of the last round")
    )
    lines += [
        "",
        f"greedy diff: responses of all rounds whose text differs from the same prompt's none response served "
        f"alone ({alone}) / from none's response to the same request at the same c and round. peak running: "
        f"most sequences the server's num_requests_running gauge showed (/metrics polled every 0.1 s).",
    ]
    if any(m["kind"] == "hf" for m in report["methods"].values()):
        lines.append(f"hf:* rows: {HF_NOTE}; speedup vs hf:plain; their τ is tokens per target forward.")
    return "\n".join(lines)


def plot_report(report: dict, path: str | Path) -> None:
    """PNG, two panels over concurrency (log2 x axis): output tokens/s (a line per method) and speedup vs
    no speculation (1.0 line); hf:* peers are single points at c = 1 (their speedup vs hf:plain)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.ticker import NullLocator

    levels = report["concurrency"] or [1]
    fig, (ax_tps, ax_speedup) = plt.subplots(1, 2, figsize=(13, 4.5))
    for name, method in report["methods"].items():
        rows = method["per_concurrency"]
        xs = [r["concurrency"] for r in rows]
        hf = method["kind"] == "hf"
        style = {"marker": "s" if hf else "o", "ls": "none" if hf else "-", "label": name}
        if name in (BASELINE, HF_BASELINE):
            style["color"] = "#555555"
        ax_tps.plot(xs, [r["output_tokens_per_s"] for r in rows], **style)
        if name not in (BASELINE, HF_BASELINE):
            ax_speedup.plot(xs, [math.nan if r.get("speedup") is None else r["speedup"] for r in rows], **style)
    ax_speedup.axhline(1.0, color="black", lw=1, ls="--")
    ax_tps.set_title("output tokens/s (median over rounds)")
    ax_speedup.set_title("speedup vs none at the same c (hf:* vs hf:plain); < 1: not worth enabling")
    for ax in (ax_tps, ax_speedup):
        ax.set_xscale("log", base=2)
        ax.set_xticks(levels, [str(c) for c in levels])
        ax.xaxis.set_minor_locator(NullLocator())
        ax.set_xlim(min(levels) / 1.5, max(levels) * 1.5)
        ax.set_xlabel("concurrency (requests in flight)")
        ax.grid(alpha=0.3)
        if ax.get_legend_handles_labels()[0]:
            ax.legend(fontsize=8)
    cfg = report["config"]
    fig.suptitle(f"draftsmith bench: {cfg['target']}, k={cfg['k']}, {cfg['num_prompts']} prompts x {cfg['max_tokens']}")
    fig.tight_layout()
    fig.savefig(path, dpi=110, format="png")
    plt.close(fig)


def _write_atomic(path: Path, write: Callable[[Path], None]) -> None:
    """``write(tmp)`` into a temporary file next to ``path``, then rename it over ``path``."""
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    try:
        write(tmp)
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)


def write_report(report: dict, out: str | Path) -> dict[str, Path]:
    """report.json, table.md and bench.png under ``out`` (each written atomically); returns their paths."""
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    paths = {"json": out / "report.json", "table": out / "table.md", "plot": out / "bench.png"}
    _write_atomic(paths["json"], lambda p: p.write_text(json.dumps(report, indent=1)))
    _write_atomic(paths["table"], lambda p: p.write_text(format_table(report) + "\n"))
    _write_atomic(paths["plot"], lambda p: plot_report(report, p))
    return paths


# --- the client ----------------------------------------------------------------------------------------------


def parse_metrics(text: str) -> dict[str, float]:
    """``{sample name{labels}: value}`` from a Prometheus text exposition (prometheus_client's parser)."""
    from prometheus_client.parser import text_string_to_metric_families

    out = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            labels = ",".join(f'{k}="{v}"' for k, v in sorted(sample.labels.items()))
            out[sample.name + (f"{{{labels}}}" if labels else "")] = sample.value
    return out


async def _scrape(client, names: Sequence[str] = ()) -> dict[str, float]:
    """The server's /metrics (only the samples ``names`` when given: the ``name[]`` query), parsed; {} when it
    cannot be read (the bench goes on without counters)."""
    try:
        response = await client.get("/metrics", params={"name[]": list(names)} if names else None)
        response.raise_for_status()
        return parse_metrics(response.text)
    except Exception as e:  # noqa: BLE001 - a metrics hiccup must not end the bench
        logger.warning("could not read /metrics: %s", e)
        return {}


async def _stream_one(client, model: str, prompt: list[int], max_tokens: int) -> RequestRecord:
    body = {
        "model": model,
        "prompt": prompt,
        "max_tokens": max_tokens,
        "temperature": 0.0,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    start = time.perf_counter()
    first, text, tokens, done = None, [], 0, False
    async with client.stream("POST", "/v1/completions", json=body) as response:
        if response.status_code != 200:
            raise RuntimeError(f"server answered {response.status_code}: {(await response.aread()).decode()[:300]}")
        async for line in response.aiter_lines():
            if line == "data: [DONE]":
                done = True
            if not line.startswith("data: ") or done:
                continue
            event = json.loads(line[len("data: ") :])
            if "error" in event:
                raise RuntimeError(f"server error mid-stream: {event['error']}")
            if event.get("usage"):
                tokens = event["usage"]["completion_tokens"]
            for choice in event.get("choices", ()):
                if choice.get("text"):
                    first = first if first is not None else time.perf_counter()
                    text.append(choice["text"])
    if not done:
        raise RuntimeError("the stream ended without data: [DONE]")
    end = time.perf_counter()
    return RequestRecord(
        ttft_s=(first if first is not None else end) - start, latency_s=end - start, tokens=tokens, text="".join(text)
    )


async def run_batch(
    url: str, model: str, prompts: Sequence[list[int]], max_tokens: int, concurrency: int, poll_s: float = 0.1
) -> BatchResult:
    """Send every prompt once to ``url`` with at most ``concurrency`` requests in flight.

    A failed request (HTTP error status, error event, broken or unfinished stream) becomes a record with
    ``error`` set; nothing is raised. ``/metrics`` is polled every ``poll_s`` seconds meanwhile for the
    scheduler gauges' peaks, asking for those two gauges only (``name[]``, ~0.1 ms). A full scrape costs the
    server 3-5 ms to render and the bench 8-11 ms to parse (AMD EPYC, 490 lines for plain decoding, 680 for a
    draft model with ``auto``), all of it holding the interpreter that an in-process server decodes with: at 10
    polls a second that slowed the longer exposition's server more, and made ``auto`` read ~0.9x plain where it
    drafted nothing (issue 19).

    Returns:
        Records in prompt order, the batch's wall time, the spec-decode counter deltas (a counter missing
        from either scrape is left out), ``concurrency`` and the gauge peaks.
    """
    import httpx

    limits = httpx.Limits(max_connections=concurrency, max_keepalive_connections=concurrency)
    async with (
        httpx.AsyncClient(base_url=url, timeout=httpx.Timeout(600.0), limits=limits) as client,
        httpx.AsyncClient(base_url=url, timeout=httpx.Timeout(60.0)) as probe,
    ):
        before = await _scrape(probe)
        gate = asyncio.Semaphore(concurrency)
        peaks: dict[str, float] = {}

        async def bounded(prompt):
            async with gate:
                t0 = time.perf_counter()
                try:
                    return await _stream_one(client, model, prompt, max_tokens)
                except Exception as e:  # noqa: BLE001 - a failed request is counted, never raised
                    elapsed = time.perf_counter() - t0
                    return RequestRecord(elapsed, elapsed, 0, "", error=f"{type(e).__name__}: {e}"[:300])

        async def watch():
            while True:
                sample = await _scrape(probe, list(SCHEDULER_GAUGES.values()))
                for key, metric in SCHEDULER_GAUGES.items():
                    if metric in sample:
                        peaks[key] = max(peaks.get(key, 0.0), sample[metric])
                await asyncio.sleep(poll_s)

        watcher = asyncio.create_task(watch())
        start = time.perf_counter()
        try:
            records = await asyncio.gather(*(bounded(p) for p in prompts))
        finally:
            wall = time.perf_counter() - start
            watcher.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await watcher
        after = await _scrape(probe)
    counters = {
        name: after[metric] - before[metric]
        for name, metric in SPEC_COUNTERS.items()
        if metric in after and metric in before
    }
    return BatchResult(
        records=list(records), wall_s=wall, counters=counters, concurrency=concurrency, peaks=peaks, started_s=start
    )


def describe_server(url: str) -> tuple[str, str]:
    """(method label, served model name) from a server's ``/v1/models``: 'none' without speculation."""
    import httpx

    data = httpx.get(url.rstrip("/") + "/v1/models", timeout=30).json()["data"][0]
    spec = data.get("speculative_config") or {}
    return spec.get("method", BASELINE), data["id"]


# --- prompts, servers, the HF peer ---------------------------------------------------------------------------


def load_prompts(tokenizer, num_prompts: int, tasks: Sequence[str]) -> list[list[int]]:
    """The first ``num_prompts`` held-out prompts (round robin over ``tasks``) as chat-templated token ids."""

    records = reference.tasks(list(tasks))
    prompts = []
    for i in range(num_prompts):
        task = tasks[i % len(tasks)]
        prompts.append(prompt_ids(tokenizer, records[task][i // len(tasks)]["messages"]).tolist())
    return prompts


def requests_for(prompts: Sequence[list[int]], concurrency: int) -> list[list[int]]:
    """The requests of one batch at ``concurrency``: ``max(len(prompts), concurrency)`` of them, request i
    being prompt ``i mod len(prompts)`` (so c requests can be in flight even when c > the number of prompts)."""
    return [prompts[i % len(prompts)] for i in range(max(len(prompts), concurrency))]


class _TimingStreamer:
    """A transformers streamer recording when generated tokens arrive (the first ``put`` is the prompt)."""

    def __init__(self):
        self.times: list[float] = []
        self.calls = 0

    def put(self, value) -> None:
        self.calls += 1
        if self.calls > 1:
            self.times.append(time.perf_counter())

    def end(self) -> None:
        pass


def hf_peer(
    model, tokenizer, prompts: Sequence[list[int]], cfg: BenchConfig, eos_token_ids: Sequence[int], draft=None
) -> dict[str, list[BatchResult]]:
    """transformers ``generate`` on the same ids, one request at a time: plain, prompt lookup, assisted.

    Returns ``{name: [BatchResult per round]}``; ``counters`` hold target forwards ('forwards') so that
    τ = tokens per target forward can be reported."""

    variants = {
        HF_BASELINE: {},
        "hf:prompt_lookup": {
            "prompt_lookup_num_tokens": fixed_k(cfg),
            "max_matching_ngram_size": cfg.prompt_lookup_max,
        },
    }
    if draft is not None:
        gc = draft.generation_config
        gc.num_assistant_tokens, gc.num_assistant_tokens_schedule, gc.assistant_confidence_threshold = (
            fixed_k(cfg),
            "constant",
            0.0,
        )
        variants["hf:assisted_draft_model"] = {"assistant_model": draft}
    forwards = [0]
    hook = model.register_forward_hook(lambda *_: forwards.__setitem__(0, forwards[0] + 1))
    results: dict[str, list[BatchResult]] = {name: [] for name in variants}
    progress = tqdm(total=rounds_at(cfg, 1) * len(variants), desc="bench HF peer", unit="batch")
    try:
        for _ in range(rounds_at(cfg, 1)):
            for name, kwargs in variants.items():
                records, counted = [], forwards[0]
                start = time.perf_counter()
                for prompt in prompts:
                    ids = torch.tensor([prompt], device=model.device)
                    streamer = _TimingStreamer()
                    t0 = time.perf_counter()
                    with torch.inference_mode():
                        out = model.generate(
                            ids,
                            attention_mask=torch.ones_like(ids),
                            max_new_tokens=cfg.max_tokens,
                            do_sample=False,
                            eos_token_id=list(eos_token_ids),
                            pad_token_id=tokenizer.pad_token_id,
                            streamer=streamer,
                            **kwargs,
                        )
                    end = time.perf_counter()
                    new = out[0, ids.shape[1] :].tolist()  # EOS included, as the server counts
                    records.append(
                        RequestRecord(
                            ttft_s=(streamer.times[0] if streamer.times else end) - t0,
                            latency_s=end - t0,
                            tokens=len(new),
                            text=tokenizer.decode(new, skip_special_tokens=True),
                        )
                    )
                wall = time.perf_counter() - start
                results[name].append(BatchResult(records, wall, {"forwards": forwards[0] - counted}))
                progress.set_postfix_str(f"{name}: {sum(r.tokens for r in records) / wall:.1f} tok/s")
                progress.update()
    finally:
        hook.remove()
        progress.close()
    return results


async def _measure(
    servers: dict[str, tuple[str, str]], prompts, cfg: BenchConfig, gates: dict | None = None
) -> tuple[dict[str, dict[int, list[BatchResult]]], BatchResult | None]:
    """Warm-up (every server serves the requests of the highest level once, ``WARMUP_TOKENS`` each: a server's
    first batch at a batch size pays one-time costs (allocations, kernels for new shapes; ``auto``'s first
    acceptance estimates) that measured rounds must not count: without it each server's first round at c = 32
    read ~5% below its later ones (mean over 9 servers' first rounds, 7 of them below), against a baseline that
    had served before), the c = 1 reference batch of the baseline when 1 is not a level, then ``cfg.rounds``
    rounds: each round, for each concurrency (ascending) that has rounds left (``rounds_at``), one batch per server (the
    order rotates per round). Paired (``cfg.baseline_every`` > 0, a baseline among the servers): the baseline is
    left out of the rotation and runs first and after every ``baseline_every`` other batches (and last), each
    other batch keeping the plain batches just before and after it (``BatchResult.before`` / ``after``); the
    baseline's list then holds all its batches.

    Interleaved (``gates``: ``{label: its engine's scheduler}``, all sharing one ``interleave.Turnstile`` as their
    gate): the baseline is left out of the rotation and each other batch runs at once with a plain batch
    (module docstring, step 7), which becomes its ``before`` and ``after``.

    ``servers``: ``{label: (url, model name)}``. Returns ``({label: {c: [BatchResult per round]}}, the extra
    reference batch or None)``."""
    names = list(servers)
    top = max(cfg.concurrency)
    for name in names:  # the requests of the highest level, short: every shape a measured batch meets
        url, model = servers[name]
        await run_batch(url, model, requests_for(prompts, top), min(cfg.max_tokens, WARMUP_TOKENS), top)
    alone = None
    if 1 not in cfg.concurrency and BASELINE in servers:
        alone = await run_batch(*servers[BASELINE], prompts, cfg.max_tokens, 1)
    results: dict[str, dict[int, list[BatchResult]]] = {name: {c: [] for c in cfg.concurrency} for name in names}
    together = gates is not None and BASELINE in servers and len(names) > 1
    paired = together or (cfg.baseline_every > 0 and BASELINE in servers and len(names) > 1)
    rotated = [n for n in names if n != BASELINE] if paired else names
    if together:
        plain_per_round = len(rotated)
    else:
        plain_per_round = 1 + math.ceil(len(rotated) / cfg.baseline_every) if paired else 0
    per_round = len(rotated) + plain_per_round
    total = sum(rounds_at(cfg, c) for c in cfg.concurrency) * per_round
    with tqdm(total=total, desc="bench servers", unit="batch") as progress:

        def done(name: str, batch: BatchResult) -> None:
            failed = sum(not r.ok for r in batch.records)
            progress.set_postfix_str(
                f"{name} c={batch.concurrency}: {batch.output_tokens_per_s:.1f} tok/s"
                + (f", {failed} failed" if failed else "")
            )
            progress.update()

        async def one(name: str, requests, c: int, report: bool = True) -> BatchResult:
            url, model = servers[name]
            batch = await run_batch(url, model, requests, cfg.max_tokens, c)
            results[name][c].append(batch)
            if report:
                done(name, batch)
            return batch

        async def at_once(name: str, requests, c: int) -> None:
            """``name``'s batch and a plain one at once, each timed by its own seconds (module docstring); the
            progress bar shows their tokens/s once the waits are known."""
            turnstile = gates[name].gate
            turnstile.reset()
            plain, batch = await asyncio.gather(
                one(BASELINE, requests, c, report=False), one(name, requests, c, report=False)
            )
            for b, label in ((plain, BASELINE), (batch, name)):
                b.waited_s = turnstile.waited(gates[label], b.started_s, b.started_s + b.wall_s)
                done(label, b)
            batch.before = batch.after = plain

        for round_index in range(max(rounds_at(cfg, c) for c in cfg.concurrency)):
            shift = round_index % len(rotated)
            order = rotated[shift:] + rotated[:shift]
            for c in [c for c in cfg.concurrency if round_index < rounds_at(cfg, c)]:
                requests = requests_for(prompts, c)
                if together:
                    for name in order:
                        await at_once(name, requests, c)
                    continue
                if not paired:
                    for name in order:
                        await one(name, requests, c)
                    continue
                before = await one(BASELINE, requests, c)
                for start in range(0, len(order), cfg.baseline_every):
                    bracketed = [await one(name, requests, c) for name in order[start : start + cfg.baseline_every]]
                    after = await one(BASELINE, requests, c)
                    for batch in bracketed:
                        batch.before, batch.after = before, after
                    before = after
    return results, alone


def run_bench(cfg: BenchConfig, model=None, tokenizer=None, prompts: Sequence[list[int]] | None = None) -> dict:
    """Measure every server (started in-process unless ``cfg.urls``) at every ``cfg.concurrency`` and,
    optionally, the HF peer (c = 1 only).

    Args:
        cfg: what to measure. model, tokenizer: an already loaded target (else loaded from ``cfg.target``).
        prompts: token-id prompts (else ``load_prompts`` from the held-out tasks).

    Returns:
        The report dict of ``build_report``: ``{"config", "concurrency", "reference", "methods": {name:
        {"kind", "per_concurrency": [row per c], "scaling", "verdict", ...}}}``.

    Raises:
        MemoryPlanError: an in-process method does not fit. ValueError / FileNotFoundError: a bad method.
    """

    torch.set_num_threads(cfg.threads)
    specs = {} if cfg.urls else {m: speculative_config(m, cfg) for m in bench_methods(cfg)}
    if model is None and not cfg.urls:
        for method, spec in specs.items():
            plan_for_engine(
                cfg.target, spec, dtype=cfg.dtype, device=cfg.device, max_model_len=cfg.max_model_len
            ).check()
    if model is None and (not cfg.urls or cfg.hf_peer):
        model, tokenizer = load_causal_lm(cfg.target, dtype=cfg.dtype, role="target")
        model.to(cfg.device)
    if tokenizer is None:
        tokenizer = AutoTokenizer.from_pretrained(reference.resolve(cfg.target))
    prompts = list(prompts) if prompts is not None else load_prompts(tokenizer, cfg.num_prompts, cfg.tasks)

    with contextlib.ExitStack() as stack:
        servers: dict[str, tuple[str, str]] = {}
        engines, skipped = {}, {}
        if cfg.urls:
            for url in cfg.urls:
                label, name = describe_server(url)
                servers[label if label not in servers else f"{label}@{url}"] = (url.rstrip("/"), name)
        else:
            for method, spec in specs.items():
                try:
                    engines[method] = Engine(
                        model,
                        tokenizer,
                        spec,
                        model_name=cfg.target,
                        max_model_len=cfg.max_model_len,
                        onednn=cfg.onednn,  # the first engine packs the shared target, each its drafter
                    )
                except ValueError as e:  # a k sweep past what this drafter drafts (an MLP speculator's n_predict)
                    if K_MARK not in method or "num_speculative_tokens" not in str(e):
                        raise
                    skipped[method] = str(e)
                    logger.warning("bench: %s left out: %s", method, e)
                    continue
                server = stack.enter_context(BackgroundServer(create_app(engines[method])))
                servers[method] = (server.url, cfg.target)
        gates = None
        if cfg.interleave:
            turnstile = Turnstile()
            gates = {name: engine.scheduler for name, engine in engines.items()}
            for scheduler in gates.values():
                scheduler.gate = turnstile
        results, alone = asyncio.run(_measure(servers, prompts, cfg, gates))
    reference_batch = alone if alone is not None else (results[BASELINE][1][-1] if BASELINE in results else None)
    reference_texts = reference_texts_of(reference_batch) if reference_batch is not None else None
    reference_info = {
        "method": BASELINE,
        "concurrency": 1,
        "available": reference_batch is not None,
        "separate_run": alone is not None,
        "failed": sum(not r.ok for r in reference_batch.records) if reference_batch is not None else None,
    }
    hf_results = None
    if cfg.hf_peer:
        eos = stop_token_ids(model, tokenizer)
        draft = None
        if cfg.draft_model:
            draft, _ = load_causal_lm(cfg.draft_model, dtype=cfg.dtype, role="draft model")
            draft.to(cfg.device)
        hf_results = hf_peer(model, tokenizer, prompts, cfg, eos, draft)
    config = asdict(cfg) | {
        "num_prompts": len(prompts),
        "requests_per_batch": [max(len(prompts), c) for c in cfg.concurrency],
        "torch": torch.__version__,
    }
    report = build_report(config, results, reference_texts, reference_info, hf_results)
    report["skipped"] = skipped
    return report
