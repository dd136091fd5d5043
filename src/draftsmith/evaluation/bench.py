"""Serving benchmark: the same prompts, at a given concurrency, through the server with and without speculation.

    draftsmith bench --target reference --methods none eagle3 ngram draft_model --k 5 \\
        --head runs/reference-eagle3/head --hf-peer --num-prompts 8 --max-tokens 64 --out runs/bench
    draftsmith bench --target reference --url http://127.0.0.1:8000 --url http://127.0.0.1:8001   # running servers

Steps:
  1. Prompts: the first ``num_prompts`` of the held-out tasks (round robin over tasks), rendered with the
     target's chat template into token ids, so every server and the HF peer read identical ids.
  2. Servers: given ``--url``s (each server's ``/v1/models`` says its speculative method), or one
     in-process server per method on a free loopback port, every engine sharing the one loaded target.
     Before loading, the memory plan (``serve/memory.py``) of every method must fit.
  3. One warm-up request per server, then ``rounds`` rounds; a round sends all prompts to each server in
     turn (the order rotates per round) at ``concurrency`` requests in flight: streamed
     ``/v1/completions``, temperature 0, ``stream_options.include_usage``. ``/metrics`` is scraped before
     and after every batch.
  4. Per method: request throughput and output tokens/s (median over rounds); TTFT = send -> first streamed
     text, TPOT = (latency - TTFT) / (tokens - 1), each as mean, p50 and p99 over all requests of all
     rounds; acceptance rate = Δaccepted / Δdraft tokens and τ = 1 + Δaccepted / Δdrafts from the
     ``/metrics`` deltas; greedy mismatches = completions that differ from the no-speculation text.
  5. HF peer (``--hf-peer``): transformers ``generate`` on the same ids, one request at a time: plain
     greedy, prompt lookup (``prompt_lookup_num_tokens=k``) and, with a draft model, assisted generation
     with ``num_assistant_tokens=k``, ``num_assistant_tokens_schedule="constant"``,
     ``assistant_confidence_threshold=0`` on the draft's generation_config. TTFT/TPOT come from a streamer;
     its τ is tokens per target forward (HF does not count drafts).
  6. Verdict per method: speedup = median over rounds of (method tokens/s / no-speculation tokens/s in the
     same round); "not worth enabling" when below 1.0 (acceptance alone is not the verdict). HF peers are
     compared with HF plain generate.
The engine serves one sequence at a time (``serve/engine.py``): with concurrency > 1 requests queue,
so TTFT includes the wait. Timings use ``torch.set_num_threads(threads)``; numbers are medians because a
shared machine is noisy. Writes ``report.json``, ``table.md`` and ``bench.png`` to ``--out``.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import statistics
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Sequence

import numpy as np
import torch
from tqdm.auto import tqdm
from transformers import AutoTokenizer

from draftsmith import reference
from draftsmith.core.stops import stop_token_ids
from draftsmith.data_pipeline.chat import prompt_ids
from draftsmith.evaluation.bench_config import (
    BASELINE,
    HF_BASELINE,
    BenchConfig,
    default_methods,
    speculative_config,
)
from draftsmith.models import load_causal_lm
from draftsmith.serve.engine import Engine
from draftsmith.serve.memory import plan_for_engine
from draftsmith.serve.server import BackgroundServer, create_app

logger = logging.getLogger(__name__)

SPEC_COUNTERS = {
    "drafts": "draftsmith:spec_decode_num_drafts_total",
    "draft_tokens": "draftsmith:spec_decode_num_draft_tokens_total",
    "accepted": "draftsmith:spec_decode_num_accepted_tokens_total",
}


@dataclass
class RequestRecord:
    """One streamed request as the client saw it (seconds; tokens from the server's usage)."""

    ttft_s: float
    latency_s: float
    tokens: int
    text: str = ""

    @property
    def tpot_s(self) -> float | None:
        """(latency - TTFT) / (tokens - 1); None for a single-token completion."""
        return (self.latency_s - self.ttft_s) / (self.tokens - 1) if self.tokens > 1 else None


@dataclass
class BatchResult:
    """All prompts sent once to one server: per-request records, wall time, and /metrics counter deltas."""

    records: list[RequestRecord]
    wall_s: float
    counters: dict[str, float] = field(default_factory=dict)


# --- numbers -------------------------------------------------------------------------------------------------


def distribution(values: Sequence[float]) -> dict[str, float | None]:
    """mean, p50 and p99 (numpy's linear-interpolated percentiles) of ``values``; all None when empty."""

    if not values:
        return {"mean": None, "p50": None, "p99": None}
    arr = np.asarray(values, dtype=float)
    return {"mean": float(arr.mean()), "p50": float(np.percentile(arr, 50)), "p99": float(np.percentile(arr, 99))}


def summarize(batches: Sequence[BatchResult], reference_texts: Sequence[str] | None = None) -> dict:
    """One method's row from its rounds: medians of throughput, TTFT/TPOT distributions (ms), acceptance.

    Acceptance rate and τ are computed from the summed counter deltas (None when nothing was drafted, e.g.
    no speculation). ``reference_texts`` (the no-speculation completions, in prompt order) gives the greedy
    mismatch count of the last round."""
    records = [r for b in batches for r in b.records]
    per_round = [
        {
            "requests_per_s": len(b.records) / b.wall_s,
            "output_tokens_per_s": sum(r.tokens for r in b.records) / b.wall_s,
        }
        for b in batches
    ]
    counters = {name: sum(b.counters.get(name, 0.0) for b in batches) for name in SPEC_COUNTERS}
    drafts, draft_tokens, accepted = counters["drafts"], counters["draft_tokens"], counters["accepted"]
    row = {
        "rounds": len(batches),
        "requests": len(records),
        "output_tokens": sum(r.tokens for r in records),
        "requests_per_s": statistics.median(x["requests_per_s"] for x in per_round),
        "output_tokens_per_s": statistics.median(x["output_tokens_per_s"] for x in per_round),
        "output_tokens_per_s_rounds": [x["output_tokens_per_s"] for x in per_round],
        "ttft_ms": distribution([1e3 * r.ttft_s for r in records]),
        "tpot_ms": distribution([1e3 * r.tpot_s for r in records if r.tpot_s is not None]),
        "acceptance_rate": accepted / draft_tokens if draft_tokens else None,
        "tau": 1.0 + accepted / drafts if drafts else None,
        "counters": counters,
    }
    if reference_texts is not None:
        row["greedy_mismatches"] = sum(r.text != t for r, t in zip(batches[-1].records, reference_texts))
    return row


def verdict(speedup: float | None) -> str:
    """'1.23x: worth enabling' / '0.87x: not worth enabling' (below 1.0) / 'n/a' without a baseline.

    Two decimals, three when two would round a value across 1.0 (0.998 -> '0.998x', not '1.00x')."""
    if speedup is None:
        return "n/a"
    digits = 3 if round(speedup, 2) == 1.0 and speedup != 1.0 else 2
    return f"{speedup:.{digits}f}x: " + ("worth enabling" if speedup >= 1.0 else "not worth enabling")


def add_verdicts(rows: dict[str, dict], baseline: str = BASELINE, prefix: str = "") -> None:
    """Set ``speedup`` and ``verdict`` on every row whose name starts with ``prefix`` (baseline included, 1.0).

    speedup = median over rounds of row tokens/s ÷ baseline tokens/s in the same round (paired; rounds
    beyond the shorter list are ignored)."""
    base = rows.get(baseline)
    for name, row in rows.items():
        if not name.startswith(prefix):
            continue
        if base is None:
            row["speedup"], row["verdict"] = None, "n/a (no baseline run)"
            continue
        ratios = [a / b for a, b in zip(row["output_tokens_per_s_rounds"], base["output_tokens_per_s_rounds"]) if b > 0]
        row["speedup"] = statistics.median(ratios) if ratios else None
        row["verdict"] = "baseline" if name == baseline else verdict(row["speedup"])


def _fmt(value, spec: str = ".1f", none: str = "-") -> str:
    return none if value is None else format(value, spec)


def format_table(report: dict) -> str:
    """Markdown table: one row per method (servers, then HF peers), ending with the verdict column."""
    cfg = report["config"]
    head = (
        f"k={cfg['k']}, concurrency={cfg['concurrency']}, {cfg['num_prompts']} prompts x {cfg['max_tokens']} "
        f"max tokens, {cfg['rounds']} rounds, torch threads={cfg['threads']}, device={cfg['device']}"
    )
    lines = [
        head,
        "",
        "| method | req/s | out tok/s | TTFT mean / p50 / p99 (ms) | TPOT mean / p50 / p99 (ms) | accept | τ "
        "| greedy diff | verdict |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---|",
    ]
    for name, row in report["rows"].items():
        ttft, tpot = row["ttft_ms"], row["tpot_ms"]
        lines.append(
            f"| {name} | {row['requests_per_s']:.2f} | {row['output_tokens_per_s']:.1f} "
            f"| {_fmt(ttft['mean'])} / {_fmt(ttft['p50'])} / {_fmt(ttft['p99'])} "
            f"| {_fmt(tpot['mean'])} / {_fmt(tpot['p50'])} / {_fmt(tpot['p99'])} "
            f"| {_fmt(row.get('acceptance_rate'), '.1%')} | {_fmt(row.get('tau'), '.2f')} "
            f"| {row.get('greedy_mismatches', '-')} | {row.get('verdict', '')} |"
        )
    if any(name.startswith("hf:") for name in report["rows"]):
        lines += [
            "",
            "hf:* rows: transformers generate, one request at a time; speedup vs hf:plain; their τ is "
            "tokens per target forward.",
        ]
    return "\n".join(lines)


def plot_report(report: dict, path: str | Path) -> None:
    """PNG with three panels per method: output tokens/s, TTFT and TPOT p50 (ms), speedup (1.0 line)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = list(report["rows"])
    rows = [report["rows"][n] for n in names]
    colors = [
        "#888888" if n in (BASELINE, HF_BASELINE) else ("#4c72b0" if not n.startswith("hf:") else "#dd8452")
        for n in names
    ]
    fig, axes = plt.subplots(1, 3, figsize=(15, 4))
    axes[0].bar(names, [r["output_tokens_per_s"] for r in rows], color=colors)
    axes[0].set_title("output tokens/s (median over rounds)")
    x = range(len(names))
    axes[1].bar([i - 0.2 for i in x], [r["ttft_ms"]["p50"] or 0 for r in rows], width=0.4, label="TTFT p50")
    axes[1].bar([i + 0.2 for i in x], [r["tpot_ms"]["p50"] or 0 for r in rows], width=0.4, label="TPOT p50")
    axes[1].set_xticks(list(x), names)
    axes[1].set_title("latency (ms)")
    axes[1].legend()
    axes[2].bar(names, [r.get("speedup") or 0 for r in rows], color=colors)
    axes[2].axhline(1.0, color="black", lw=1, ls="--")
    axes[2].set_title("speedup vs none (hf:* vs hf:plain); < 1: not worth enabling")
    for ax in axes:
        ax.tick_params(axis="x", rotation=30)
        ax.grid(axis="y", alpha=0.3)
    cfg = report["config"]
    fig.suptitle(f"draftsmith bench: {cfg['target']}, k={cfg['k']}, concurrency={cfg['concurrency']}")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def write_report(report: dict, out: str | Path) -> dict[str, Path]:
    """report.json, table.md and bench.png under ``out``; returns their paths."""
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    paths = {"json": out / "report.json", "table": out / "table.md", "plot": out / "bench.png"}
    paths["json"].write_text(json.dumps(report, indent=1))
    paths["table"].write_text(format_table(report) + "\n")
    plot_report(report, paths["plot"])
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
    first, text, tokens = None, [], 0
    async with client.stream("POST", "/v1/completions", json=body) as response:
        if response.status_code != 200:
            raise RuntimeError(f"server answered {response.status_code}: {(await response.aread()).decode()[:300]}")
        async for line in response.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
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
    end = time.perf_counter()
    return RequestRecord(
        ttft_s=(first if first is not None else end) - start, latency_s=end - start, tokens=tokens, text="".join(text)
    )


async def run_batch(
    url: str, model: str, prompts: Sequence[list[int]], max_tokens: int, concurrency: int
) -> BatchResult:
    """Send every prompt once to ``url`` with at most ``concurrency`` requests in flight.

    Returns records in prompt order, the wall time of the batch and the spec-decode counter deltas."""
    import httpx

    limits = httpx.Limits(max_connections=concurrency, max_keepalive_connections=concurrency)
    async with httpx.AsyncClient(base_url=url, timeout=httpx.Timeout(600.0), limits=limits) as client:
        before = parse_metrics((await client.get("/metrics")).text)
        gate = asyncio.Semaphore(concurrency)

        async def bounded(prompt):
            async with gate:
                return await _stream_one(client, model, prompt, max_tokens)

        start = time.perf_counter()
        records = await asyncio.gather(*(bounded(p) for p in prompts))
        wall = time.perf_counter() - start
        after = parse_metrics((await client.get("/metrics")).text)
    counters = {name: after.get(metric, 0.0) - before.get(metric, 0.0) for name, metric in SPEC_COUNTERS.items()}
    return BatchResult(records=list(records), wall_s=wall, counters=counters)


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
        "hf:prompt_lookup": {"prompt_lookup_num_tokens": cfg.k, "max_matching_ngram_size": cfg.prompt_lookup_max},
    }
    if draft is not None:
        gc = draft.generation_config
        gc.num_assistant_tokens, gc.num_assistant_tokens_schedule, gc.assistant_confidence_threshold = (
            cfg.k,
            "constant",
            0.0,
        )
        variants["hf:assisted_draft_model"] = {"assistant_model": draft}
    forwards = [0]
    hook = model.register_forward_hook(lambda *_: forwards.__setitem__(0, forwards[0] + 1))
    results: dict[str, list[BatchResult]] = {name: [] for name in variants}
    progress = tqdm(total=cfg.rounds * len(variants), desc="bench HF peer", unit="batch")
    try:
        for _ in range(cfg.rounds):
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


def _hf_rows(results: dict[str, list[BatchResult]], reference_texts) -> dict[str, dict]:
    rows = {}
    for name, batches in results.items():
        row = summarize(batches, reference_texts)
        forwards = sum(b.counters["forwards"] for b in batches)
        row["acceptance_rate"] = None
        row["tau"] = row["output_tokens"] / forwards if forwards else None
        rows[name] = row
    return rows


async def _measure(servers: dict[str, tuple[str, str]], prompts, cfg: BenchConfig) -> dict[str, list[BatchResult]]:
    """Warm-up, then ``cfg.rounds`` interleaved rounds over the servers ({label: (url, model name)})."""
    names = list(servers)
    for name in names:
        url, model = servers[name]
        await run_batch(url, model, prompts[:1], min(cfg.max_tokens, 8), 1)
    results: dict[str, list[BatchResult]] = {name: [] for name in names}
    with tqdm(total=cfg.rounds * len(names), desc="bench servers", unit="batch") as progress:
        for round_index in range(cfg.rounds):
            order = names[round_index % len(names) :] + names[: round_index % len(names)]
            for name in order:
                url, model = servers[name]
                batch = await run_batch(url, model, prompts, cfg.max_tokens, cfg.concurrency)
                results[name].append(batch)
                progress.set_postfix_str(f"{name}: {sum(r.tokens for r in batch.records) / batch.wall_s:.1f} tok/s")
                progress.update()
    return results


def run_bench(cfg: BenchConfig, model=None, tokenizer=None, prompts: Sequence[list[int]] | None = None) -> dict:
    """Measure every server (started in-process unless ``cfg.urls``) and, optionally, the HF peer.

    Args:
        cfg: what to measure. model, tokenizer: an already loaded target (else loaded from ``cfg.target``).
        prompts: token-id prompts (else ``load_prompts`` from the held-out tasks).

    Returns:
        The report dict: ``{"config", "rows": {method: row}}`` (rows as ``summarize`` + speedup/verdict).

    Raises:
        MemoryPlanError: an in-process method does not fit. ValueError / FileNotFoundError: a bad method.
    """

    torch.set_num_threads(cfg.threads)
    specs = {} if cfg.urls else {m: speculative_config(m, cfg) for m in (cfg.methods or default_methods(cfg))}
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
        engines = {}
        if cfg.urls:
            for url in cfg.urls:
                label, name = describe_server(url)
                servers[label if label not in servers else f"{label}@{url}"] = (url.rstrip("/"), name)
        else:
            for method, spec in specs.items():
                engines[method] = Engine(model, tokenizer, spec, model_name=cfg.target, max_model_len=cfg.max_model_len)
                server = stack.enter_context(BackgroundServer(create_app(engines[method])))
                servers[method] = (server.url, cfg.target)
        results = asyncio.run(_measure(servers, prompts, cfg))
    reference_texts = [r.text for r in results[BASELINE][-1].records] if BASELINE in results else None
    rows = {name: summarize(batches, reference_texts) for name, batches in results.items()}
    add_verdicts(rows)
    if cfg.hf_peer:
        eos = stop_token_ids(model, tokenizer)
        draft = None
        if cfg.draft_model:
            draft, _ = load_causal_lm(cfg.draft_model, dtype=cfg.dtype, role="draft model")
            draft.to(cfg.device)
        hf_rows = _hf_rows(hf_peer(model, tokenizer, prompts, cfg, eos, draft), reference_texts)
        add_verdicts(hf_rows, baseline=HF_BASELINE, prefix="hf:")
        rows.update(hf_rows)
    config = asdict(cfg) | {"num_prompts": len(prompts), "torch": torch.__version__}
    return {"config": config, "rows": rows}
