"""The serving bench's report code on made-up measurements (no timing assertions), and one tiny end-to-end run."""

from __future__ import annotations

import json

import pytest

from draftsmith.evaluation.bench import (
    BatchResult,
    RequestRecord,
    add_verdicts,
    distribution,
    format_table,
    parse_metrics,
    run_bench,
    summarize,
    verdict,
    write_report,
)
from draftsmith.evaluation.bench_config import BenchConfig


def _batch(wall_s: float, tokens: list[int], counters=None, ttft=0.1, latency=1.0, texts=None) -> BatchResult:
    texts = texts or [f"t{i}" for i in range(len(tokens))]
    return BatchResult(
        [RequestRecord(ttft, latency, n, text) for n, text in zip(tokens, texts)], wall_s, counters or {}
    )


def test_distribution():
    d = distribution([1.0, 2.0, 3.0, 4.0, 100.0])
    assert d["mean"] == pytest.approx(22.0) and d["p50"] == 3.0
    assert d["p99"] == pytest.approx(4.0 + 0.96 * 96.0)  # numpy's linear interpolation
    assert distribution([]) == {"mean": None, "p50": None, "p99": None}


def test_summarize_medians_percentiles_and_acceptance():
    counters = {"drafts": 10.0, "draft_tokens": 50.0, "accepted": 20.0}
    batches = [_batch(2.0, [10, 10], counters), _batch(4.0, [10, 10], counters), _batch(1.0, [10, 10], counters)]
    row = summarize(batches, reference_texts=["t0", "different"])
    assert row["output_tokens_per_s_rounds"] == [10.0, 5.0, 20.0]
    assert row["output_tokens_per_s"] == 10.0 and row["requests_per_s"] == 1.0  # medians over rounds
    assert row["requests"] == 6 and row["output_tokens"] == 60
    assert row["acceptance_rate"] == pytest.approx(60 / 150) and row["tau"] == pytest.approx(1 + 60 / 30)
    assert row["ttft_ms"]["p50"] == pytest.approx(100.0)
    assert row["tpot_ms"]["mean"] == pytest.approx(900.0 / 9)  # (1.0 - 0.1) / (10 - 1)
    assert row["greedy_mismatches"] == 1
    plain = summarize([_batch(1.0, [1, 5])])
    assert plain["acceptance_rate"] is None and plain["tau"] is None  # nothing drafted
    assert plain["tpot_ms"]["mean"] == pytest.approx(900.0 / 4)  # 1-token requests skipped


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


def test_table_json_and_plot(tmp_path):
    rows = {
        "none": summarize([_batch(1.0, [10])]),
        "eagle3": summarize([_batch(0.8, [10], {"drafts": 4.0, "draft_tokens": 20.0, "accepted": 6.0})]),
        "hf:plain": summarize([_batch(1.0, [10])]),
        "hf:prompt_lookup": summarize([_batch(1.25, [10])]),
    }
    add_verdicts(rows)
    add_verdicts(rows, baseline="hf:plain", prefix="hf:")
    report = {"config": BenchConfig(num_prompts=1, rounds=1).__dict__, "rows": rows}
    table = format_table(report)
    lines = table.splitlines()
    assert lines[2].startswith("| method | req/s | out tok/s | TTFT") and lines[2].endswith("verdict |")
    assert "| eagle3 |" in table and "30.0%" in table and "2.50" in table  # acceptance and τ
    assert "1.25x: worth enabling" in table and "0.80x: not worth enabling" in table
    assert "speedup vs hf:plain" in table
    paths = write_report(report, tmp_path / "out")
    assert json.loads(paths["json"].read_text())["rows"]["eagle3"]["tau"] == pytest.approx(2.5)
    assert paths["table"].read_text().strip() == table
    assert paths["plot"].read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


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


def test_tiny_end_to_end(tiny_llama, tmp_path):
    """In-process servers for none and ngram plus the HF peer on a tiny model: the plumbing, not the speed."""
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
        concurrency=2,
        rounds=2,
        threads=1,
        hf_peer=True,
        draft_model="",
        out=str(tmp_path),
    )
    report = run_bench(cfg, model=model, tokenizer=tokenizer, prompts=prompts)
    rows = report["rows"]
    assert list(rows) == ["none", "ngram", "hf:plain", "hf:prompt_lookup"]
    for name, row in rows.items():
        assert row["requests"] == 6 and row["output_tokens"] > 0 and row["greedy_mismatches"] == 0, name
        assert row["ttft_ms"]["p50"] is not None and row["speedup"] is not None
    assert rows["ngram"]["counters"]["draft_tokens"] > 0 and 0 <= rows["ngram"]["acceptance_rate"] <= 1
    assert rows["ngram"]["tau"] >= 1 and rows["none"]["tau"] is None
    assert rows["hf:plain"]["tau"] == pytest.approx(1.0, abs=0.5)
    assert "ngram" in format_table(report)
