"""The serving bench's report code on made-up measurements over several concurrencies (no timing assertions),
its client against a server that fails on purpose, and two small end-to-end runs."""

from __future__ import annotations

import asyncio
import json

import pytest
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, PlainTextResponse, StreamingResponse

from draftsmith.evaluation.bench import (
    SCHEDULER_GAUGES,
    BatchResult,
    RequestRecord,
    add_verdicts,
    build_report,
    distribution,
    format_table,
    method_verdict,
    parse_metrics,
    requests_for,
    round_speedups,
    run_batch,
    run_bench,
    scaling,
    summarize,
    verdict,
    write_report,
)
from draftsmith.evaluation.bench_config import BenchConfig, build_parser, config_from_args
from draftsmith.serve.server import BackgroundServer


def bench_script(name: str):
    """``bench/NAME.py`` loaded as a module (the bench scripts are not a package)."""
    import importlib.util
    from pathlib import Path

    path = Path(__file__).resolve().parents[1] / "bench" / f"{name}.py"
    spec = importlib.util.spec_from_file_location(f"bench_{name}", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _batch(wall_s, tokens, counters=None, ttft=0.1, latency=1.0, texts=None, concurrency=1, errors=None):
    texts = texts or [f"t{i}" for i in range(len(tokens))]
    errors = errors or [None] * len(tokens)
    records = [
        RequestRecord(ttft, latency, 0 if e else n, "" if e else text, error=e)
        for n, text, e in zip(tokens, texts, errors)
    ]
    return BatchResult(records, wall_s, counters or {}, concurrency=concurrency)


def test_distribution():
    d = distribution([1.0, 2.0, 3.0, 4.0, 100.0])
    assert d["mean"] == pytest.approx(22.0) and d["p50"] == 3.0
    assert d["p99"] == pytest.approx(4.0 + 0.96 * 96.0)  # numpy's linear interpolation
    assert distribution([]) == {"mean": None, "p50": None, "p99": None}


def test_concurrency_config_and_flag():
    assert BenchConfig().concurrency == (1,)
    assert BenchConfig(concurrency=4).concurrency == (4,)  # a single int still works
    assert BenchConfig(concurrency=[16, 1, 4, 4, 32]).concurrency == (1, 4, 16, 32)  # sorted, unique
    for bad in (0, [1, 0], [], [1.5], [True]):
        with pytest.raises(ValueError, match="concurrency"):
            BenchConfig(concurrency=bad)
    parser = build_parser()
    assert config_from_args(parser.parse_args(["--concurrency", "32", "1", "16", "4"])).concurrency == (1, 4, 16, 32)
    assert config_from_args(parser.parse_args(["--concurrency", "8"])).concurrency == (8,)
    assert config_from_args(parser.parse_args([])).concurrency == (1,)
    assert requests_for([[1], [2], [3]], 2) == [[1], [2], [3]]
    assert requests_for([[1], [2]], 5) == [[1], [2], [1], [2], [1]]  # c > prompts: prompts cycle


def test_summarize_medians_percentiles_acceptance_failures_and_mismatches():
    counters = {"drafts": 10.0, "draft_tokens": 50.0, "accepted": 20.0}
    batches = [
        _batch(2.0, [10, 10], counters, concurrency=2),
        _batch(4.0, [10, 10], counters, concurrency=2),
        _batch(1.0, [10, 10], counters, concurrency=2),
    ]
    row = summarize(batches, reference_texts=["t0", "different"])
    assert row["concurrency"] == 2 and row["failed"] == 0 and row["errors"] == []
    assert row["output_tokens_per_s_rounds"] == [10.0, 5.0, 20.0]
    assert row["output_tokens_per_s"] == 10.0 and row["requests_per_s"] == 1.0  # medians over rounds
    assert row["requests"] == 6 and row["output_tokens"] == 60
    assert row["acceptance_rate"] == pytest.approx(60 / 150) and row["tau"] == pytest.approx(1 + 60 / 30)
    assert row["ttft_ms"]["p50"] == pytest.approx(100.0)
    assert row["tpot_ms"]["mean"] == pytest.approx(900.0 / 9)  # (1.0 - 0.1) / (10 - 1)
    assert row["greedy_mismatches"] == 3 and row["greedy_checked"] == 6  # every round is checked
    assert row["baseline_mismatches"] is None
    plain = summarize([_batch(1.0, [1, 5])])
    assert plain["acceptance_rate"] is None and plain["tau"] is None  # nothing drafted
    assert plain["tpot_ms"]["mean"] == pytest.approx(900.0 / 4)  # 1-token requests skipped
    assert plain["greedy_mismatches"] is None  # no reference

    # c=4 over 2 prompts: requests 2 and 3 are prompts 0 and 1 again; a failure is counted, not timed or compared
    texts = ["a", "b", "a", "B"]
    failing = _batch(2.0, [4, 4, 4, 4], texts=texts, concurrency=4, errors=[None, "HTTP 429", None, None])
    base = _batch(1.0, [4, 4, 4, 4], texts=["a", "b", "a", "b"], concurrency=4)
    row = summarize([failing], reference_texts=["a", None], baseline_batches=[base])
    assert row["failed"] == 1 and row["errors"] == ["HTTP 429"] and row["output_tokens"] == 12
    assert row["output_tokens_per_s"] == 6.0 and row["requests_per_s"] == 1.5
    assert row["greedy_checked"] == 2 and row["greedy_mismatches"] == 0  # prompt 1 has no reference (None)
    assert row["baseline_mismatches"] == 1  # "B" vs "b"


def test_verdicts_pair_rounds_and_say_not_worth_enabling():
    rows = {
        "none": summarize([_batch(1.0, [10]), _batch(2.0, [10])]),  # 10, 5 tok/s
        "fast": summarize([_batch(0.5, [10]), _batch(1.0, [10])]),  # 20, 10 tok/s
        "slow": summarize([_batch(2.0, [10]), _batch(4.0, [10])]),
    }  # 5, 2.5 tok/s
    add_verdicts(rows)
    assert rows["none"]["verdict"] == "baseline" and rows["none"]["speedup"] == 1.0
    assert rows["fast"]["speedup"] == 2.0 and rows["fast"]["verdict"] == "2.00x: worth enabling"
    assert rows["slow"]["speedup"] == 0.5 and rows["slow"]["verdict"] == "0.50x: not worth enabling"
    assert verdict(0.999).endswith("not worth enabling") and verdict(1.0).endswith(": worth enabling")
    assert verdict(0.998) == "0.998x: not worth enabling" and verdict(1.004) == "1.004x: worth enabling"
    assert verdict(None) == "n/a"
    lonely = {"ngram": summarize([_batch(1.0, [3])])}
    add_verdicts(lonely)
    assert lonely["ngram"]["speedup"] is None and "no baseline" in lonely["ngram"]["verdict"]


def test_paired_measurement_brackets_every_batch_and_cancels_drift(monkeypatch):
    """baseline_every = 1: plain runs first and after every other batch, the others rotating per round; on a
    machine that slows by 10% per batch, a method twice as fast as plain reads exactly 2.0 paired, while
    comparing with plain's batch of the same round (unpaired) reads the drift as the method's."""
    from draftsmith.evaluation import bench

    calls = []
    true_speed = {"none": 100.0, "a": 200.0, "b": 200.0}

    async def fake_run_batch(url, model, prompts, max_tokens, concurrency):
        calls.append(url)
        drift = 0.9 ** len(calls)
        return _batch(1.0, [int(round(true_speed[url] * drift * 1000))], concurrency=concurrency)

    monkeypatch.setattr(bench, "run_batch", fake_run_batch)
    servers = {name: (name, "m") for name in true_speed}
    cfg = BenchConfig(methods=list(true_speed), concurrency=(1,), rounds=2, baseline_every=1)
    results, alone = asyncio.run(bench._measure(servers, [[1, 2]], cfg))
    assert alone is None and calls[:3] == ["none", "a", "b"]  # warm-up
    assert calls[3:] == ["none", "a", "none", "b", "none"] + ["none", "b", "none", "a", "none"]
    assert [len(results[n][1]) for n in ("none", "a", "b")] == [6, 2, 2]
    rows = {
        name: summarize(results[name][1], baseline_batches=results["none"][1] if name != "none" else None)
        for name in true_speed
    }
    add_verdicts(rows)
    assert rows["a"]["speedup"] == pytest.approx(2.0, rel=1e-3) and rows["b"]["speedup"] == pytest.approx(2.0, rel=1e-3)
    assert rows["a"]["baseline_mismatches"] == 0 and rows["none"]["speedup"] == 1.0

    calls.clear()
    unpaired = BenchConfig(methods=list(true_speed), concurrency=(1,), rounds=2, baseline_every=0)
    results, _ = asyncio.run(bench._measure(servers, [[1, 2]], unpaired))
    assert calls[3:] == ["none", "a", "b", "a", "b", "none"]  # one plain batch per round, in the rotation
    rows = {name: summarize(results[name][1]) for name in true_speed}
    add_verdicts(rows)
    assert all(abs(rows[n]["speedup"] - 2.0) > 0.05 for n in "ab")  # drift read as the methods' own effect
    with pytest.raises(ValueError, match="baseline_every"):
        BenchConfig(baseline_every=-1)


def test_every_server_warms_up_on_the_requests_of_the_highest_level(monkeypatch):
    """The warm-up batch of each server is the highest level's requests at that level (every batch size a measured
    round meets), short; measured batches keep the asked max_tokens."""
    from draftsmith.evaluation import bench

    calls = []

    async def fake_run_batch(url, model, prompts, max_tokens, concurrency):
        calls.append((url, len(prompts), max_tokens, concurrency))
        return _batch(1.0, [100], concurrency=concurrency)

    monkeypatch.setattr(bench, "run_batch", fake_run_batch)
    servers = {name: (name, "m") for name in ("none", "a")}
    cfg = BenchConfig(methods=list(servers), concurrency=(1, 8), rounds=1, baseline_every=1, max_tokens=64)
    asyncio.run(bench._measure(servers, [[1, 2], [3], [4, 5, 6]], cfg))
    assert calls[:2] == [("none", 8, bench.WARMUP_TOKENS, 8), ("a", 8, bench.WARMUP_TOKENS, 8)]
    assert all(max_tokens == 64 for _, _, max_tokens, _ in calls[2:])
    assert [(n, c) for _, n, _, c in calls[2:5]] == [(3, 1), (3, 1), (3, 1)]  # c = 1: each prompt once


LEVELS = (1, 4, 16, 32)
TOKENS_PER_S = {  # two rounds per level: the second round at half the speed (a noisy machine), ratios unchanged
    "none": [10, 30, 80, 100],
    "eagle3": [15, 36, 72, 80],  # 1.5, 1.2, 0.9, 0.8: pays at low concurrency only
    "ngram": [12, 33, 88, 110],  # >= 1.0 everywhere
}


def _synthetic_results(methods=TOKENS_PER_S, levels=LEVELS):
    return {
        name: {
            c: [_batch(1.0, [tps], concurrency=c), _batch(2.0, [tps], concurrency=c)]
            for c, tps in zip(levels, per_c)
            if c in levels
        }
        for name, per_c in methods.items()
    }


def test_method_verdict_names_the_concurrencies_and_scaling():
    report = build_report({}, _synthetic_results(), reference_texts=["t0"])
    assert report["concurrency"] == [1, 4, 16, 32]
    eagle3, ngram, none = (report["methods"][n] for n in ("eagle3", "ngram", "none"))
    assert [r["concurrency"] for r in eagle3["per_concurrency"]] == [1, 4, 16, 32]
    assert [r["speedup"] for r in eagle3["per_concurrency"]] == pytest.approx([1.5, 1.2, 0.9, 0.8])
    assert eagle3["not_worth_enabling_at"] == [16, 32] and eagle3["worth_enabling_at"] == [1, 4]
    assert eagle3["verdict"] == "not worth enabling at c=16, 32 (0.90x, 0.80x); worth enabling at c=1, 4 (1.50x, 1.20x)"
    assert ngram["not_worth_enabling_at"] == []
    assert ngram["verdict"].startswith("worth enabling at every measured concurrency (c=1, 4, 16, 32: 1.20x")
    assert none["verdict"] == "baseline" and none["per_concurrency"][2]["verdict"] == "baseline"
    assert eagle3["scaling"] == pytest.approx(80 / 15) and (eagle3["scaling_from"], eagle3["scaling_to"]) == (1, 32)
    assert none["scaling"] == pytest.approx(10.0)
    assert (
        eagle3["per_concurrency"][0]["baseline_mismatches"] == 0
        and none["per_concurrency"][0]["baseline_mismatches"] is None
    )
    assert (
        eagle3["per_concurrency"][0]["greedy_mismatches"] == 0 and eagle3["per_concurrency"][0]["greedy_checked"] == 2
    )

    slow = method_verdict([{"concurrency": 1, "speedup": 0.7}, {"concurrency": 8, "speedup": 0.5}])
    assert slow["verdict"] == "not worth enabling at c=1, 8 (0.70x, 0.50x)"
    gap = method_verdict([{"concurrency": 1, "speedup": 1.1}, {"concurrency": 8, "speedup": None}])
    assert gap["verdict"] == "worth enabling at c=1 (1.10x); n/a at c=8 (baseline made no tokens)"
    no_base = build_report({}, {"ngram": _synthetic_results()["ngram"]})
    assert no_base["methods"]["ngram"]["verdict"] == "n/a (no baseline run)"
    single = scaling([{"concurrency": 4, "output_tokens_per_s": 9.0}])
    assert single == {"scaling": None, "scaling_from": 4, "scaling_to": 4}


def test_table_json_and_plot_over_concurrency(tmp_path):
    hf = {
        "hf:plain": [_batch(1.0, [10])],
        "hf:prompt_lookup": [_batch(0.8, [10], {"forwards": 4.0})],
    }
    hf["hf:plain"][0].counters["forwards"] = 10.0
    config = BenchConfig(num_prompts=1, rounds=2, concurrency=LEVELS).__dict__ | {"num_prompts": 1}
    reference = {"method": "none", "concurrency": 1, "available": True, "separate_run": False, "failed": 0}
    report = build_report(config, _synthetic_results(), ["t0"], reference, hf)
    assert list(report["methods"]) == ["none", "eagle3", "ngram", "hf:plain", "hf:prompt_lookup"]
    assert [r["concurrency"] for r in report["methods"]["hf:plain"]["per_concurrency"]] == [1]  # c=1 only
    assert (
        report["methods"]["hf:prompt_lookup"]["kind"] == "hf"
        and "one request at a time" in (report["methods"]["hf:prompt_lookup"]["note"])
    )
    assert report["methods"]["hf:prompt_lookup"]["per_concurrency"][0]["tau"] == pytest.approx(2.5)
    assert report["methods"]["hf:prompt_lookup"]["verdict"].startswith("worth enabling at every measured")

    table = format_table(report)
    lines = table.splitlines()
    assert "concurrency=1, 4, 16, 32" in lines[0]
    assert lines[2].startswith("| method | c | req/s | out tok/s | TTFT") and lines[2].endswith("verdict |")
    body = [line for line in lines[4:] if line.startswith("| ")]
    assert sum(line.startswith("| eagle3 | ") for line in body) == 4 + 1  # a row per c, then its scaling row
    assert "| eagle3 | 32 |" in table and "| hf:plain | 1 |" in table and "| hf:plain | 4 |" not in table
    assert "0.80x: not worth enabling" in table and "5.33x (c=1→32)" in table
    assert "not worth enabling at c=16, 32" in table and "speedup vs hf:plain" in table

    paths = write_report(report, tmp_path / "out")
    data = json.loads(paths["json"].read_text())
    assert data["concurrency"] == [1, 4, 16, 32] and data["config"]["concurrency"] == [1, 4, 16, 32]
    eagle3 = data["methods"]["eagle3"]
    assert [r["concurrency"] for r in eagle3["per_concurrency"]] == [1, 4, 16, 32]
    assert eagle3["not_worth_enabling_at"] == [16, 32] and eagle3["scaling"] == pytest.approx(80 / 15)
    for key in ("output_tokens_per_s", "requests_per_s", "ttft_ms", "tpot_ms", "acceptance_rate", "tau", "failed"):
        assert key in eagle3["per_concurrency"][0], key
    assert paths["table"].read_text().strip() == table
    assert paths["plot"].read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert sorted(p.name for p in (tmp_path / "out").iterdir()) == ["bench.png", "report.json", "table.md"]


def test_parse_metrics():
    text = (
        "# HELP draftsmith:spec_decode_num_drafts_total x\n# TYPE draftsmith:spec_decode_num_drafts_total counter\n"
        "draftsmith:spec_decode_num_drafts_total 3.0\n"
        'draftsmith:spec_decode_num_accepted_tokens_per_pos_total{position="1"} 2.0\n'
    )
    assert parse_metrics(text) == {
        "draftsmith:spec_decode_num_drafts_total": 3.0,
        'draftsmith:spec_decode_num_accepted_tokens_per_pos_total{position="1"}': 2.0,
    }


def test_run_batch_counts_failures_without_raising():
    """A server answering 429, an error event, a stream cut before [DONE], and one good stream."""
    app = FastAPI()
    asked = []  # each scrape's name[] query

    @app.get("/metrics")
    async def metrics(request: Request):
        asked.append(request.query_params.getlist("name[]"))
        return PlainTextResponse("draftsmith:num_requests_running 2.0\ndraftsmith:num_requests_waiting 0.0\n")

    def sse(*events):
        return StreamingResponse((f"data: {e}\n\n" for e in events), media_type="text/event-stream")

    @app.post("/v1/completions")
    async def completions(request: Request):
        first = (await request.json())["prompt"][0]
        if first == 1:
            return JSONResponse({"error": {"message": "queue full"}}, status_code=429)
        if first == 2:
            return sse(json.dumps({"error": {"message": "boom"}}))
        text = json.dumps({"choices": [{"text": "hi"}]})
        if first == 3:
            return sse(text)  # no [DONE]
        return sse(text, json.dumps({"choices": [], "usage": {"completion_tokens": 1}}), "[DONE]")

    with BackgroundServer(app) as server:
        batch = asyncio.run(run_batch(server.url, "m", [[1], [2], [3], [4]], 4, 2))
    assert batch.concurrency == 2 and batch.peaks == {"running": 2.0, "waiting": 0.0}
    # the counters' scrapes before and after read everything; the polls in between ask for the two gauges only
    assert asked[0] == asked[-1] == [] and len(asked) >= 3
    assert all(names == list(SCHEDULER_GAUGES.values()) for names in asked[1:-1])
    assert [r.ok for r in batch.records] == [False, False, False, True], [r.error for r in batch.records]
    assert "429" in batch.records[0].error and "boom" in batch.records[1].error
    assert "[DONE]" in batch.records[2].error
    assert batch.records[3].text == "hi" and batch.records[3].tokens == 1
    row = summarize([batch])
    assert row["failed"] == 3 and row["output_tokens"] == 1 and row["peak_running"] == 2.0


def test_tiny_end_to_end(tiny_llama, tmp_path):
    """In-process servers for none and ngram at c = 2, 4 (4 > 3 prompts: they cycle) plus the HF peer on a
    tiny model: the plumbing, not the speed. 1 is not a level, so the baseline runs once alone for reference."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    names = [f"w{i}" for i in range(93)] + ["<unk>", "<eos>", "<pad>"]
    backend = Tokenizer(models.WordLevel({t: i for i, t in enumerate(names)}, unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=backend, eos_token="<eos>", unk_token="<unk>", pad_token="<pad>"
    )
    model = tiny_llama(seed=0)
    model.generation_config.eos_token_id = 94
    prompts = [[5, 6, 7, 8, 5, 6, 7], [9, 9, 9, 9], [20, 21, 22, 20, 21]]
    cfg = BenchConfig(
        target="tiny",
        methods=["none", "ngram"],
        k=3,
        prompt_lookup_min=1,
        max_tokens=6,
        concurrency=(2, 4),
        rounds=(2, 3),  # one per level: 2 rounds at c = 2, 3 at c = 4
        threads=1,
        hf_peer=True,
        draft_model="",
        control=True,
        out=str(tmp_path),
    )
    report = run_bench(cfg, model=model, tokenizer=tokenizer, prompts=prompts)
    methods = report["methods"]
    assert list(methods) == ["none", "none-control", "ngram", "hf:plain", "hf:prompt_lookup"]
    assert methods["none-control"]["verdict"].startswith("A/A control")
    assert methods["none-control"]["per_concurrency"][0]["counters"]["draft_tokens"] == 0  # a plain server
    assert report["reference"]["separate_run"] and report["reference"]["failed"] == 0
    assert report["config"]["requests_per_batch"] == [3, 4]
    for name, per_round in (("none", 3), ("none-control", 1), ("ngram", 1)):  # paired: plain around each batch
        assert [r["concurrency"] for r in methods[name]["per_concurrency"]] == [2, 4]
        assert [r["requests"] for r in methods[name]["per_concurrency"]] == [6 * per_round, 12 * per_round]
        assert [r["rounds"] for r in methods[name]["per_concurrency"]] == [2 * per_round, 3 * per_round]
        assert methods[name]["scaling"] is not None and (
            methods[name]["scaling_from"],
            methods[name]["scaling_to"],
        ) == (2, 4)
    for name, method in methods.items():
        for row in method["per_concurrency"]:
            assert row["failed"] == 0 and row["output_tokens"] > 0 and row["greedy_mismatches"] == 0, name
            assert row["ttft_ms"]["p50"] is not None and row["speedup"] is not None
    for row in methods["ngram"]["per_concurrency"]:
        assert row["counters"]["draft_tokens"] > 0 and 0 <= row["acceptance_rate"] <= 1 and row["tau"] >= 1
        assert row["baseline_mismatches"] == 0
    assert methods["none"]["per_concurrency"][0]["tau"] is None
    assert [r["concurrency"] for r in methods["hf:plain"]["per_concurrency"]] == [1]
    assert methods["hf:plain"]["per_concurrency"][0]["tau"] == pytest.approx(1.0, abs=0.5)
    assert "| ngram | 4 |" in format_table(report)


def test_reference_target_end_to_end(tmp_path):
    """The bundled reference target, none + ngram at c = 1, 2 over 2 prompts: every request succeeds and every
    greedy response equals the one served alone."""
    cfg = BenchConfig(
        target="reference",
        methods=["none", "ngram"],
        head=None,
        k=3,
        num_prompts=2,
        max_tokens=8,
        concurrency=[2, 1],
        rounds=1,
        threads=1,
        out=str(tmp_path / "bench"),
    )
    report = run_bench(cfg)
    paths = write_report(report, cfg.out)
    data = json.loads(paths["json"].read_text())
    assert data["concurrency"] == [1, 2] and list(data["methods"]) == ["none", "ngram"]
    assert data["reference"] == {
        "method": "none",
        "concurrency": 1,
        "available": True,
        "separate_run": False,
        "failed": 0,
    }
    for name, method in data["methods"].items():
        assert method["kind"] == "server" and [r["concurrency"] for r in method["per_concurrency"]] == [1, 2]
        assert method["scaling"] is not None and isinstance(method["verdict"], str)
        for row in method["per_concurrency"]:
            assert row["requests"] == (4 if name == "none" else 2) and row["failed"] == 0, (name, row["errors"])
            assert row["greedy_checked"] == row["requests"] and row["greedy_mismatches"] == 0, name
            assert row["output_tokens"] > 0 and row["speedup"] is not None
    assert data["methods"]["ngram"]["per_concurrency"][1]["baseline_mismatches"] == 0
    assert paths["plot"].read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_rounds_are_one_value_or_one_per_level():
    from draftsmith.evaluation.bench_config import rounds_at

    cfg = BenchConfig(concurrency=(32, 1, 8), rounds=[2, 5, 4])  # per level, ascending: 1, 8, 32
    assert [rounds_at(cfg, c) for c in (1, 8, 32)] == [2, 5, 4]
    assert BenchConfig(rounds=[3]).rounds == 3 and rounds_at(BenchConfig(concurrency=(1, 4), rounds=3), 4) == 3
    with pytest.raises(ValueError, match="one per concurrency level"):
        BenchConfig(concurrency=(1, 8, 32), rounds=[2, 4])
    with pytest.raises(ValueError, match="integers >= 1"):
        BenchConfig(rounds=0)


def test_the_aa_control_is_a_second_plain_server_measured_as_a_method(monkeypatch):
    """``control``: a second no-speculation server (``none-control``) rotates with the methods and is paired with the
    baseline like them, so on a machine whose speed drifts it reads 1.0 (what a method equal to plain reads); it
    gets no drafter config and no enable/disable verdict; it needs the baseline and in-process servers."""
    from draftsmith.evaluation import bench
    from draftsmith.evaluation.bench_config import CONTROL, bench_methods, speculative_config

    cfg = BenchConfig(methods=["none", "ngram"], k=[3, "auto"], control=True)
    assert bench_methods(cfg) == ["none", CONTROL, "ngram@k3", "ngram@auto"]
    assert speculative_config(CONTROL, cfg) is None
    with pytest.raises(ValueError, match="add none to --methods"):
        bench_methods(BenchConfig(methods=["ngram"], control=True))
    with pytest.raises(ValueError, match="--url"):
        BenchConfig(urls=["http://127.0.0.1:1"], control=True)
    assert config_from_args(build_parser().parse_args(["--control"])).control

    calls = []
    true_speed = {"none": 100.0, CONTROL: 100.0, "a": 150.0}

    async def fake_run_batch(url, model, prompts, max_tokens, concurrency):
        calls.append(url)
        return _batch(1.0, [int(round(true_speed[url] * 0.95 ** len(calls) * 1000))], concurrency=concurrency)

    monkeypatch.setattr(bench, "run_batch", fake_run_batch)
    servers = {name: (name, "m") for name in true_speed}
    results, _ = asyncio.run(bench._measure(servers, [[1, 2]], BenchConfig(methods=list(true_speed), rounds=2)))
    assert calls[3:8] == ["none", CONTROL, "none", "a", "none"]
    report = build_report({}, results)
    control = report["methods"][CONTROL]
    assert control["per_concurrency"][0]["speedup"] == pytest.approx(1.0, rel=1e-3)
    assert report["methods"]["a"]["per_concurrency"][0]["speedup"] == pytest.approx(1.5, rel=1e-3)
    assert control["verdict"].startswith("A/A control") and control["not_worth_enabling_at"] == []
    assert "A/A control" in control["per_concurrency"][0]["verdict"]


def test_the_grid_counts_the_aa_controls_cells_below_the_bar():
    """The grid reads the control once per (task, c) and says how many of auto's cells a method identical to plain
    would put below the bar at the control's rate, next to auto's own count."""
    grid_mod = bench_script("adaptive_grid")

    def row(speedup, rounds=(100.0, 104.0)):
        return {"speedup": speedup, "output_tokens_per_s_rounds": list(rounds), "mean_chosen_k": 0.5}

    def report(control, auto):  # one task, c = 1 and 8; drafters x and y at k = 1 and auto
        methods = {"none": {"per_concurrency": [row(1.0), row(1.0)]}, "none-control": {"per_concurrency": control}}
        for d in ("x", "y"):
            methods[f"{d}@k1"] = {"per_concurrency": [row(1.1), row(0.9)]}
            methods[f"{d}@auto"] = {"per_concurrency": auto}
        return {"concurrency": [1, 8], "methods": methods}

    reports = {"t": report([row(0.95), row(1.01)], [row(1.2), row(0.96)])}
    cells = grid_mod.cells(reports, [1], ["x", "y"])
    assert [c["control"] for c in cells] == [0.95, 1.01, 0.95, 1.01]
    result = grid_mod.summary(cells, [1])
    assert result["control_cells"] == 2 and result["control_below_bar"] == [("t", 1, 0.95)]
    assert result["expected_below_bar_if_plain"] == 2.0  # 1 of 2 control cells x 4 auto cells
    assert len(result["auto_below_bar"]) == 2 and result["control_range"] == [0.95, 1.01]
    text = grid_mod.table(cells, [1], result)
    assert "A/A control" in text and "in 2.0 of auto's 4 cells" in text


def test_the_grid_names_cells_below_the_bar_in_every_round_and_resummarises_saved_reports(tmp_path, capsys):
    """A cell's per-round speedups are its rounds' tokens/s over their paired plain batches; the grid lists the
    cells below the bar in every round (auto's and the control's) apart from those whose median alone is, and
    ``--from-reports`` rebuilds the grid from the saved reports with the run's own settings."""
    grid_mod = bench_script("adaptive_grid")

    def row(rounds, paired=(100.0, 100.0, 100.0)):
        ratios = sorted(a / b for a, b in zip(rounds, paired))
        return {
            "speedup": ratios[len(ratios) // 2],
            "output_tokens_per_s_rounds": list(rounds),
            "paired_baseline_tokens_per_s": list(paired),
            "mean_chosen_k": 0.0,
        }

    plain = row((100.0, 100.0, 100.0))
    methods = {
        "none": {"per_concurrency": [plain]},
        "none-control": {"per_concurrency": [row((96.0, 90.0, 99.0))]},  # median 0.96, one round above
        "x@k3": {"per_concurrency": [row((110.0, 108.0, 112.0))]},
        "x@auto": {"per_concurrency": [row((95.0, 93.0, 96.0))]},  # below in every round
        "ngram@k3": {"per_concurrency": [row((101.0, 99.0, 100.0))]},
        "ngram@auto": {"per_concurrency": [row((96.0, 99.0, 95.0))]},  # median 0.96, one round above
    }
    assert round_speedups(methods["x@auto"]["per_concurrency"][0], plain) == [0.95, 0.93, 0.96]
    assert not grid_mod.below_every_round([0.9]) and grid_mod.below_every_round([0.95, 0.96])
    report = {"concurrency": [8], "methods": methods}
    cells = grid_mod.cells({"t": report}, [3], ["x", "ngram"])
    result = grid_mod.summary(cells, [3])
    assert [c[:3] for c in result["auto_below_bar"]] == [("t", "x", 8), ("t", "ngram", 8)]
    assert result["auto_below_every_round"] == [("t", "x", 8, [0.95, 0.93, 0.96])]
    assert result["control_below_every_round"] == []
    text = grid_mod.table(cells, [3], result)
    assert "in every one of its rounds: auto in 1 of 2 cells" in text and "the A/A control in 0 of 1" in text

    config = {
        "methods": ["none", "ngram"],
        "k": [3, "auto"],
        "num_prompts": 2,
        "max_tokens": 16,
        "concurrency": [8],
        "rounds": [3],
        "baseline_every": 2,
        "threads": 1,
        "device": "cpu",
        "torch": "x",
    }
    methods = {name: m for name, m in methods.items() if not name.startswith("x@")}
    (tmp_path / "t").mkdir()
    (tmp_path / "t" / "report.json").write_text(json.dumps({**report, "methods": methods, "config": config}))
    argv = ["--tasks", "t", "--from-reports", "--out", str(tmp_path)]
    assert grid_mod.main(argv) == 0
    saved = json.loads((tmp_path / "grid.json").read_text())
    assert [c["drafter"] for c in saved["cells"]] == ["ngram"] and saved["summary"]["auto_below_every_round"] == []
    assert "rounds [3]" in (tmp_path / "grid.md").read_text() and (tmp_path / "grid.png").is_file()
    assert grid_mod.main(["--tasks", "u", "--from-reports", "--out", str(tmp_path)]) == 2
    assert "no bench report for ['u']" in capsys.readouterr().out


def test_the_grid_confirms_the_cells_below_the_bar_by_pooling_more_paired_rounds(tmp_path):
    """``--confirm``: the (task, c) with auto or the control below the bar are re-measured (only those drafters,
    the control only where it read below); each confirmed cell's speedup is the median over all its rounds, first
    and confirming, and ``--from-reports`` folds the saved confirmations in again."""
    grid_mod = bench_script("adaptive_grid")

    def row(rounds):
        return {"output_tokens_per_s_rounds": list(rounds), "paired_baseline_tokens_per_s": [100.0] * len(rounds)}

    def speedup(r):
        return {**r, "speedup": sorted(a / 100.0 for a in r["output_tokens_per_s_rounds"])[1]}

    plain = row((100.0, 100.0, 100.0))
    first = {
        "none": {"per_concurrency": [plain, plain]},
        "none-control": {"per_concurrency": [speedup(row((99.0, 100.0, 101.0))), speedup(row((95.0, 96.0, 99.0)))]},
        "draft_model@auto": {
            "per_concurrency": [speedup(row((95.0, 96.0, 99.0))), speedup(row((101.0, 102.0, 103.0)))]
        },
        "ngram@auto": {"per_concurrency": [speedup(row((101.0, 100.0, 99.0))), speedup(row((100.0, 101.0, 99.0)))]},
        "draft_model@k3": {"per_concurrency": [speedup(row((99.0, 100.0, 101.0)))] * 2},
        "ngram@k3": {"per_concurrency": [speedup(row((99.0, 100.0, 101.0)))] * 2},
    }
    report = {"concurrency": [1, 8], "methods": first}
    grid = grid_mod.cells({"t": report}, [3], ["draft_model", "ngram"])
    assert [(c["drafter"], c["concurrency"], c["auto"]) for c in grid] == [
        ("draft_model", 1, 0.96),
        ("draft_model", 8, 1.02),
        ("ngram", 1, 1.0),
        ("ngram", 8, 1.0),
    ]
    # the draft model at c = 1 (auto below), the control at c = 8; nothing else
    assert grid_mod.to_confirm(grid) == {
        ("t", 1): {"drafters": ["draft_model"], "control": False},
        ("t", 8): {"drafters": [], "control": True},
    }

    def confirmation(methods, control_rounds=None):
        rows = {"none": {"per_concurrency": [row((100.0,) * 4)]}}
        rows |= {m: {"per_concurrency": [row((99.0, 98.0, 100.0, 101.0))]} for m in methods}  # k = auto alone
        if control_rounds:
            rows["none-control"] = {"per_concurrency": [row(control_rounds)]}
        return {"config": {"methods": ["none", *methods], "k": "auto"}, "methods": rows}

    confirmations = {("t", 1): confirmation(["draft_model"]), ("t", 8): confirmation([], (97.0, 99.0, 100.0, 98.0))}
    grid_mod.pool(grid, confirmations)
    x1 = grid[0]
    assert x1["auto_rounds"] == [0.95, 0.96, 0.99, 0.99, 0.98, 1.0, 1.01] and x1["auto"] == 0.99
    assert x1["confirm_rounds"] == 4 and "confirm_rounds" not in grid[1] and grid[2]["auto"] == 1.0
    assert [c["control"] for c in grid] == [1.0, 0.98, 1.0, 0.98]  # c = 8: median of 95 96 99 97 99 100 98
    result = grid_mod.summary(grid, [3])
    assert result["auto_below_bar"] == [] and result["confirmed"] == [("t", "draft_model", 1, 7, 0.99)]
    assert "confirmed (--confirm, pooled over every round of the cell): 1 cells" in grid_mod.table(grid, [3], result)

    # saved as the grid saves them, they are folded in again by --from-reports
    config = {"methods": ["none", "draft_model", "ngram"], "k": [3, "auto"], "num_prompts": 2, "max_tokens": 16}
    config |= {"concurrency": [1, 8], "rounds": [3], "baseline_every": 1, "threads": 1, "device": "cpu", "torch": "x"}
    (tmp_path / "t").mkdir()
    (tmp_path / "t" / "report.json").write_text(json.dumps({**report, "config": config}))
    for (task, c), saved in confirmations.items():
        where = grid_mod.confirm_dir(tmp_path, task, c)
        where.mkdir(parents=True)
        (where / "report.json").write_text(json.dumps(saved))
    assert grid_mod.main(["--tasks", "t", "--from-reports", "--out", str(tmp_path)]) == 0
    summary = json.loads((tmp_path / "grid.json").read_text())["summary"]
    assert summary["auto_below_bar"] == [] and summary["confirmed"] == [["t", "draft_model", 1, 7, 0.99]]


def test_the_closed_batch_bench_forces_the_choice_after_auto_prices_it():
    """bench/adaptive_closed.py's ``forceN``: auto's pricing runs, the step drafts N per row (capped by the rows'
    own caps and k_max), and the histogram counts the forced k, not the one auto would have chosen."""
    from draftsmith.core.adaptive import AdaptivePolicy, CostModel

    closed = bench_script("adaptive_closed")

    ts, ks = list(range(1, 10)), list(range(1, 9))
    dear = CostModel([1, 4], ts, [[0.01 + 0.005 * t for t in ts]] * 2, ks, [[0.01 * k for k in ks]] * 2)
    auto = AdaptivePolicy(dear, 4, prior=[0.05] * 4)  # drafting never pays: auto chooses plain
    assert auto.choose([(auto.new_request(), 4), (auto.new_request(), 4)]).k == 0
    forced = closed.ForcedPolicy(auto, 3)
    assert (forced.cost, forced.k_max, forced.prior) == (auto.cost, auto.k_max, auto.prior)
    rows = [(forced.new_request(), 4), (forced.new_request(), 2)]
    assert forced.choose(rows).k == 3 and forced.histogram[3] == 1 and sum(forced.histogram) == 1
    assert forced.choose([(forced.new_request(), 2)]).k == 2  # no row may draft 3
    assert closed.ForcedPolicy(auto, 9).choose(rows).k == 4  # k_max
    assert closed.ForcedPolicy(auto, 0).choose(rows).k == 0


def test_the_closed_batch_bench_runs_end_to_end(tmp_path, capsys):
    """bench/adaptive_closed.py on the reference target with n-gram drafts (no head to train): every variant runs
    paired with plain, its greedy tokens equal plain's (checked by the script), and the JSON holds each variant's
    seconds and speedups; force0 decodes every step plain through auto's engine."""

    closed = bench_script("adaptive_closed")
    out = tmp_path / "closed.json"
    args = ["--method", "ngram", "--task", "code-edit", "--num-prompts", "2", "--max-tokens", "4", "--rounds", "2"]
    assert closed.main([*args, "--variants", "control", "auto", "force0", "k2", "--out", str(out)]) in (0, None)
    report = json.loads(out.read_text())
    assert list(report["variants"]) == ["control", "auto", "force0", "k2"] and report["rounds"] == 2
    for row in report["variants"].values():
        assert len(row["seconds"]) == len(row["plain_seconds"]) == 2 and row["speedup_median"] > 0
    histogram = report["variants"]["force0"]["chosen_k_histogram"]
    assert histogram[0] > 0 and sum(histogram[1:]) == 0
    assert report["variants"]["control"]["chosen_k_histogram"] is None
    status = closed.run_guarded("adaptive_closed.py", lambda: closed.main([*args, "--variants", "k0x"]))
    assert status == 1 and "unknown variant 'k0x'" in capsys.readouterr().err  # one line, no traceback


def test_the_closed_batch_bench_interleaves_a_pair_step_by_step(tmp_path):
    """bench/adaptive_closed.py ``--interleave``: each variant's batch and its plain batch run at once, the next step
    going to the decoder that has spent less; tokens still equal plain's, and a decoder's ``between_s`` leaves
    the other's steps out (``BatchDecoder.exclude``)."""
    from draftsmith.core.batch import BatchDecoder, BatchSequence
    from draftsmith.core.generate import GenerationConfig
    from draftsmith.core.target import TargetModel
    from draftsmith.evaluation.interleave import interleave_steps
    from draftsmith.models import load_causal_lm

    closed = bench_script("adaptive_closed")
    out = tmp_path / "closed.json"
    args = ["--method", "ngram", "--task", "code-edit", "--num-prompts", "2", "--max-tokens", "4", "--rounds", "1"]
    assert closed.main([*args, "--variants", "control", "auto", "--interleave", "--out", str(out)]) in (0, None)
    report = json.loads(out.read_text())
    assert report["interleaved"] is True and list(report["variants"]) == ["control", "auto"]

    model, tok = load_causal_lm("reference", role="target")
    target = TargetModel(model, tok)
    decoders = [BatchDecoder(target, None) for _ in range(2)]
    for d, n in zip(decoders, (3, 9)):  # the second decodes three times the tokens
        d.add(BatchSequence([1, 2, 3], GenerationConfig(max_new_tokens=n, temperature=0.0)))
    marks = []
    exclude = decoders[0].exclude
    decoders[0].exclude = lambda s: (marks.append((decoders[0]._mark, s)), exclude(s))
    spent = interleave_steps(decoders)
    assert not any(d.has_work for d in decoders) and all(s > 0 for s in spent)
    assert any(mark is not None and s > 0 for mark, s in marks)  # the other's steps were left out of its between_s
    decoders[0]._mark = 10.0
    exclude(0.5)
    assert decoders[0]._mark == 10.5
