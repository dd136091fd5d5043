"""Serving benchmark: the same prompts, at a given concurrency, through the server with and without speculation.

    draftsmith bench --target reference --methods none eagle3 ngram draft_model --k 5 \\
        --head runs/reference-eagle3/head --hf-peer --num-prompts 8 --max-tokens 64 --out runs/bench
    draftsmith bench --target reference --url http://127.0.0.1:8000 --url http://127.0.0.1:8001   # running servers
    python -m draftsmith.bench.serve ...                                                         # same arguments

Steps:
  1. Prompts: the first ``num_prompts`` of the held-out tasks (round robin over tasks), rendered with the
     target's chat template into token ids, so every server and the HF peer read identical ids.
  2. Servers: given ``--url``s (each server's ``/v1/models`` says its speculative method), or one
     in-process server per method on a free loopback port, every engine sharing the one loaded target.
     Before loading, the memory plan (``inference/memory.py``) of every method must fit.
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
The engine serves one sequence at a time (``inference/engine.py``): with concurrency > 1 requests queue,
so TTFT includes the wait. Timings use ``torch.set_num_threads(threads)``; numbers are medians because a
shared machine is noisy. Writes ``report.json``, ``table.md`` and ``bench.png`` to ``--out``.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import logging
import statistics
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Sequence

from tqdm.auto import tqdm

logger = logging.getLogger(__name__)

SPEC_COUNTERS = {"drafts": "draftsmith:spec_decode_num_drafts_total",
                 "draft_tokens": "draftsmith:spec_decode_num_draft_tokens_total",
                 "accepted": "draftsmith:spec_decode_num_accepted_tokens_total"}
BASELINE = "none"
HF_BASELINE = "hf:plain"


@dataclass
class BenchConfig:
    """What ``draftsmith bench`` measures.

    Attributes:
        target: the target's name or path (``reference`` = the embedded one); its tokenizer renders prompts.
        methods: in-process servers to start: 'none' (no speculation), 'ngram', 'eagle3', 'draft_model'.
        urls: running servers to measure instead of starting any (their /v1/models names the method).
        k: num_speculative_tokens. head: exported EAGLE-3 head directory (method eagle3).
        draft_model: draft model name or path (method draft_model and the HF assistant).
        prompt_lookup_min, prompt_lookup_max: n-gram lookup bounds (and HF's max_matching_ngram_size).
        num_prompts, tasks: prompts taken round robin from these held-out tasks.
        max_tokens: completion length asked per request. concurrency: requests in flight per server.
        rounds: repetitions (interleaved across methods); throughput is the median over rounds.
        threads: ``torch.set_num_threads`` for the whole run. dtype, device: of the in-process target.
        max_model_len: the in-process engines' limit (memory plan). hf_peer: also run HF assisted generation.
        out: directory for report.json, table.md, bench.png.
    """

    target: str = "reference"
    methods: list[str] = field(default_factory=lambda: ["none", "eagle3", "ngram", "draft_model"])
    urls: list[str] = field(default_factory=list)
    k: int = 5
    head: str | None = "runs/reference-eagle3/head"
    draft_model: str = "reference-draft"
    prompt_lookup_min: int = 2
    prompt_lookup_max: int = 5
    num_prompts: int = 8
    tasks: list[str] = field(default_factory=lambda: ["code-complete", "code-foreign", "code-edit", "docstring"])
    max_tokens: int = 64
    concurrency: int = 1
    rounds: int = 3
    threads: int = 2
    dtype: str = "float32"
    device: str = "cpu"
    max_model_len: int | None = None
    hf_peer: bool = False
    out: str = "runs/bench"


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
    import numpy as np

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
    per_round = [{"requests_per_s": len(b.records) / b.wall_s,
                  "output_tokens_per_s": sum(r.tokens for r in b.records) / b.wall_s} for b in batches]
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
    head = (f"k={cfg['k']}, concurrency={cfg['concurrency']}, {cfg['num_prompts']} prompts x {cfg['max_tokens']} "
            f"max tokens, {cfg['rounds']} rounds, torch threads={cfg['threads']}, device={cfg['device']}")
    lines = [head, "",
             "| method | req/s | out tok/s | TTFT mean / p50 / p99 (ms) | TPOT mean / p50 / p99 (ms) | accept | τ "
             "| greedy diff | verdict |",
             "|---|---:|---:|---:|---:|---:|---:|---:|---|"]
    for name, row in report["rows"].items():
        ttft, tpot = row["ttft_ms"], row["tpot_ms"]
        lines.append(
            f"| {name} | {row['requests_per_s']:.2f} | {row['output_tokens_per_s']:.1f} "
            f"| {_fmt(ttft['mean'])} / {_fmt(ttft['p50'])} / {_fmt(ttft['p99'])} "
            f"| {_fmt(tpot['mean'])} / {_fmt(tpot['p50'])} / {_fmt(tpot['p99'])} "
            f"| {_fmt(row.get('acceptance_rate'), '.1%')} | {_fmt(row.get('tau'), '.2f')} "
            f"| {row.get('greedy_mismatches', '-')} | {row.get('verdict', '')} |")
    if any(name.startswith("hf:") for name in report["rows"]):
        lines += ["", "hf:* rows: transformers generate, one request at a time; speedup vs hf:plain; their τ is "
                      "tokens per target forward."]
    return "\n".join(lines)


def plot_report(report: dict, path: str | Path) -> None:
    """PNG with three panels per method: output tokens/s, TTFT and TPOT p50 (ms), speedup (1.0 line)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = list(report["rows"])
    rows = [report["rows"][n] for n in names]
    colors = ["#888888" if n in (BASELINE, HF_BASELINE) else ("#4c72b0" if not n.startswith("hf:") else "#dd8452")
              for n in names]
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
    body = {"model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0.0, "stream": True,
            "stream_options": {"include_usage": True}}
    start = time.perf_counter()
    first, text, tokens = None, [], 0
    async with client.stream("POST", "/v1/completions", json=body) as response:
        if response.status_code != 200:
            raise RuntimeError(f"server answered {response.status_code}: {(await response.aread()).decode()[:300]}")
        async for line in response.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            event = json.loads(line[len("data: "):])
            if "error" in event:
                raise RuntimeError(f"server error mid-stream: {event['error']}")
            if event.get("usage"):
                tokens = event["usage"]["completion_tokens"]
            for choice in event.get("choices", ()):
                if choice.get("text"):
                    first = first if first is not None else time.perf_counter()
                    text.append(choice["text"])
    end = time.perf_counter()
    return RequestRecord(ttft_s=(first if first is not None else end) - start, latency_s=end - start, tokens=tokens,
                         text="".join(text))


async def run_batch(url: str, model: str, prompts: Sequence[list[int]], max_tokens: int,
                    concurrency: int) -> BatchResult:
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
    from draftsmith import reference
    from draftsmith.data_pipeline.chat import prompt_ids

    records = reference.tasks(list(tasks))
    prompts = []
    for i in range(num_prompts):
        task = tasks[i % len(tasks)]
        prompts.append(prompt_ids(tokenizer, records[task][i // len(tasks)]["messages"]).tolist())
    return prompts


def speculative_config(method: str, cfg: BenchConfig) -> dict | None:
    """The vLLM-style JSON for a method name ('none' -> None)."""
    if method == BASELINE:
        return None
    if method == "ngram":
        return {"method": "ngram", "num_speculative_tokens": cfg.k, "prompt_lookup_min": cfg.prompt_lookup_min,
                "prompt_lookup_max": cfg.prompt_lookup_max}
    if method == "eagle3":
        if not cfg.head or not Path(cfg.head).is_dir():
            raise FileNotFoundError(f"method eagle3 needs an exported head directory (--head), got {cfg.head!r}; "
                                    f"train one (draftsmith train) or leave eagle3 out of --methods")
        return {"method": "eagle3", "model": cfg.head, "num_speculative_tokens": cfg.k}
    if method == "draft_model":
        return {"method": "draft_model", "model": cfg.draft_model, "num_speculative_tokens": cfg.k}
    raise ValueError(f"unknown method {method!r}; choose from none, ngram, eagle3, draft_model")


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


def hf_peer(model, tokenizer, prompts: Sequence[list[int]], cfg: BenchConfig, eos_token_ids: Sequence[int],
            draft=None) -> dict[str, list[BatchResult]]:
    """transformers ``generate`` on the same ids, one request at a time: plain, prompt lookup, assisted.

    Returns ``{name: [BatchResult per round]}``; ``counters`` hold target forwards ('forwards') so that
    τ = tokens per target forward can be reported."""
    import torch

    variants = {HF_BASELINE: {}, "hf:prompt_lookup": {"prompt_lookup_num_tokens": cfg.k,
                                                      "max_matching_ngram_size": cfg.prompt_lookup_max}}
    if draft is not None:
        gc = draft.generation_config
        gc.num_assistant_tokens, gc.num_assistant_tokens_schedule, gc.assistant_confidence_threshold = cfg.k, \
            "constant", 0.0
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
                        out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=cfg.max_tokens,
                                             do_sample=False, eos_token_id=list(eos_token_ids),
                                             pad_token_id=tokenizer.pad_token_id, streamer=streamer, **kwargs)
                    end = time.perf_counter()
                    new = out[0, ids.shape[1]:].tolist()                 # EOS included, as the server counts
                    records.append(RequestRecord(ttft_s=(streamer.times[0] if streamer.times else end) - t0,
                                                 latency_s=end - t0, tokens=len(new),
                                                 text=tokenizer.decode(new, skip_special_tokens=True)))
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
            order = names[round_index % len(names):] + names[:round_index % len(names)]
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
    import contextlib

    import torch

    from draftsmith.inference.engine import Engine
    from draftsmith.inference.server import BackgroundServer, create_app
    from draftsmith.models import load_causal_lm

    torch.set_num_threads(cfg.threads)
    specs = {} if cfg.urls else {m: speculative_config(m, cfg) for m in cfg.methods}
    if model is None and not cfg.urls:
        from draftsmith.inference.memory import plan_for_engine

        for method, spec in specs.items():
            plan_for_engine(cfg.target, spec, dtype=cfg.dtype, device=cfg.device,
                            max_model_len=cfg.max_model_len).check()
    if model is None and (not cfg.urls or cfg.hf_peer):
        model, tokenizer = load_causal_lm(cfg.target, dtype=cfg.dtype, role="target")
        model.to(cfg.device)
    if tokenizer is None:
        from transformers import AutoTokenizer

        from draftsmith import reference

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
                engines[method] = Engine(model, tokenizer, spec, model_name=cfg.target,
                                         max_model_len=cfg.max_model_len)
                server = stack.enter_context(BackgroundServer(create_app(engines[method])))
                servers[method] = (server.url, cfg.target)
        results = asyncio.run(_measure(servers, prompts, cfg))
    reference_texts = [r.text for r in results[BASELINE][-1].records] if BASELINE in results else None
    rows = {name: summarize(batches, reference_texts) for name, batches in results.items()}
    add_verdicts(rows)
    if cfg.hf_peer:
        from draftsmith.inference.engine import _eos_ids

        eos = _eos_ids(model, tokenizer)
        draft = None
        if cfg.draft_model:
            draft, _ = load_causal_lm(cfg.draft_model, dtype=cfg.dtype, role="draft model")
            draft.to(cfg.device)
        hf_rows = _hf_rows(hf_peer(model, tokenizer, prompts, cfg, eos, draft), reference_texts)
        add_verdicts(hf_rows, baseline=HF_BASELINE, prefix="hf:")
        rows.update(hf_rows)
    config = asdict(cfg) | {"num_prompts": len(prompts), "torch": torch.__version__}
    return {"config": config, "rows": rows}


def build_parser(parser: argparse.ArgumentParser | None = None) -> argparse.ArgumentParser:
    """The bench's arguments (shared by ``draftsmith bench`` and ``python -m draftsmith.bench.serve``); values
    are checked by ``draftsmith.arguments`` types at parse time, the rest by ``check_config``."""
    from draftsmith import arguments as arg
    from draftsmith.reference import TASK_NAMES

    d = BenchConfig()
    p = parser or arg.ArgumentParser(prog="draftsmith bench", description=__doc__.splitlines()[0])
    p.add_argument("--target", default=d.target)
    p.add_argument("--methods", nargs="+", default=d.methods, choices=["none", "ngram", "eagle3", "draft_model"])
    p.add_argument("--url", dest="urls", action="append", default=[], type=arg.url,
                   help="a running server (repeatable)")
    p.add_argument("--k", type=arg.positive_int, default=d.k)
    p.add_argument("--head", default=d.head, help="exported EAGLE-3 head directory")
    p.add_argument("--draft-model", default=d.draft_model)
    p.add_argument("--prompt-lookup-min", type=arg.positive_int, default=d.prompt_lookup_min)
    p.add_argument("--prompt-lookup-max", type=arg.positive_int, default=d.prompt_lookup_max)
    p.add_argument("--num-prompts", type=arg.positive_int, default=d.num_prompts)
    p.add_argument("--tasks", nargs="+", default=d.tasks, choices=TASK_NAMES)
    p.add_argument("--max-tokens", type=arg.positive_int, default=d.max_tokens)
    p.add_argument("--concurrency", type=arg.positive_int, default=d.concurrency)
    p.add_argument("--rounds", type=arg.positive_int, default=d.rounds)
    p.add_argument("--threads", type=arg.positive_int, default=d.threads)
    p.add_argument("--dtype", type=arg.dtype, default=d.dtype, help=", ".join(arg.DTYPE_NAMES))
    p.add_argument("--device", default=d.device)
    p.add_argument("--max-model-len", type=arg.positive_int, default=d.max_model_len)
    p.add_argument("--hf-peer", action="store_true", help="also run transformers assisted generation")
    p.add_argument("--out", default=d.out)
    return p


def check_config(cfg: BenchConfig) -> None:
    """Refuse, before torch is imported, what would fail only after the target is loaded: a target, head or
    draft model that is missing (``draftsmith.sources``), lookup bounds in the wrong order, more prompts than
    the tasks hold, an ``out`` that is a file.

    Raises:
        ModelSourceError (an OSError): a model or head. ValueError: the other values.
    """
    from draftsmith import reference
    from draftsmith.sources import ModelSourceError, check_head_dir, check_model_source

    if cfg.prompt_lookup_min > cfg.prompt_lookup_max:
        raise ValueError(f"--prompt-lookup-min {cfg.prompt_lookup_min} > --prompt-lookup-max {cfg.prompt_lookup_max}; "
                         f"pass min <= max")
    sizes = [sum(1 for _ in (reference.TASKS_DIR / f"{t}.jsonl").open()) for t in cfg.tasks]
    available = next(i for i in range(sum(sizes) + 1)                 # prompt i: task i % n, record i // n
                     if i == sum(sizes) or i // len(sizes) >= sizes[i % len(sizes)])
    if cfg.num_prompts > available:
        raise ValueError(f"--num-prompts {cfg.num_prompts}: tasks {', '.join(cfg.tasks)} give {available} prompts "
                         f"round robin; pass --num-prompts <= {available} or more --tasks")
    if Path(cfg.out).exists() and not Path(cfg.out).is_dir():
        raise ValueError(f"--out {cfg.out!r} is a file; pass a directory for report.json, table.md and bench.png")
    check_model_source(cfg.target, role="target")
    if not cfg.urls and "eagle3" in cfg.methods:
        if not cfg.head:
            raise ModelSourceError("method eagle3 needs an exported head directory (--head DIR); train one "
                                   "(draftsmith train) or leave eagle3 out of --methods")
        check_head_dir(cfg.head, role="--head (method eagle3)",
                       hint="train one (draftsmith train RECIPE) or leave eagle3 out of --methods")
    if cfg.draft_model and (cfg.hf_peer or (not cfg.urls and "draft_model" in cfg.methods)):
        check_model_source(cfg.draft_model, role="--draft-model")


def config_from_args(args: argparse.Namespace) -> BenchConfig:
    """A ``BenchConfig`` from parsed ``build_parser`` arguments."""
    names = {f for f in BenchConfig.__dataclass_fields__}
    return BenchConfig(**{k: v for k, v in vars(args).items() if k in names})


def main(argv=None) -> int:
    """``draftsmith bench ARGS``: run the bench, print the table, write report.json / table.md / bench.png (with
    the CLI's checks and one-line errors, ``draftsmith.cli.main``)."""
    import sys

    from draftsmith.cli import main as cli_main

    return cli_main(["bench", *(sys.argv[1:] if argv is None else argv)])


if __name__ == "__main__":
    raise SystemExit(main())
