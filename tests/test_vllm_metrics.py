"""The ``vllm:`` series on /metrics (``serve/metrics.py``, ``VllmMetrics``): vLLM's names, labels, buckets and
observation points, so that vLLM's dashboards read a draftsmith server.

- every series vLLM's example Grafana dashboard queries is in a scrape, with the ``model_name`` label;
- request_success has a series per finish reason at 0 from startup (abort included), and the per-position
  spec-decode counter one per position;
- after requests (streamed, plain, a stop string, one cancelled mid-generation): counters equal what the responses
  report, the aborted request is counted with finished_reason abort and its tokens; spec-decode counters equal the
  ``draftsmith:`` ones; one inter-token latency per emitted chunk (fewer than tokens: chunks of accepted drafts);
- bucket boundaries are vLLM's (``vllm/v1/metrics/buckets.py``).
"""

from __future__ import annotations

import re
import threading

import pytest

from conftest import make_tiny_llama
from draftsmith.core.generate import GenerationConfig
from draftsmith.serve.engine import Engine, RequestCancelled
from draftsmith.serve.metrics import (
    VLLM_INTER_TOKEN_LATENCY_BUCKETS,
    VLLM_REQUEST_LATENCY_BUCKETS,
    VLLM_TIME_TO_FIRST_TOKEN_BUCKETS,
)
from draftsmith.serve.server import create_app
from test_server import NGRAM, PROMPT, V, make_tokenizer, sse

# The metric names the PromQL of vLLM's example dashboard queries: examples/observability/prometheus_grafana/
# grafana.json in vllm-project/vllm (commit 4b5c627c23e6690b8987100d1cbf78e34ac14bf9), every "expr", with the
# suffix each query reads.
DASHBOARD = (
    "vllm:e2e_request_latency_seconds_bucket",
    "vllm:e2e_request_latency_seconds_sum",
    "vllm:e2e_request_latency_seconds_count",
    "vllm:prompt_tokens_total",
    "vllm:generation_tokens_total",
    "vllm:inter_token_latency_seconds_bucket",
    "vllm:inter_token_latency_seconds_sum",
    "vllm:inter_token_latency_seconds_count",
    "vllm:num_requests_running",
    "vllm:num_requests_waiting",
    "vllm:time_to_first_token_seconds_bucket",
    "vllm:time_to_first_token_seconds_sum",
    "vllm:time_to_first_token_seconds_count",
    "vllm:kv_cache_usage_perc",
    "vllm:request_prompt_tokens_bucket",
    "vllm:request_generation_tokens_bucket",
    "vllm:request_success_total",
    "vllm:request_queue_time_seconds_sum",
    "vllm:request_prefill_time_seconds_sum",
    "vllm:request_decode_time_seconds_sum",
    "vllm:request_max_num_generation_tokens_sum",
)
SPEC = (
    "vllm:spec_decode_num_drafts_total",
    "vllm:spec_decode_num_draft_tokens_total",
    "vllm:spec_decode_num_accepted_tokens_total",
)
MODEL = {"model_name": "tiny", "engine": "0"}  # the labels of every vllm: series


def scrape(client) -> dict[tuple[str, frozenset], float]:
    """``{(name, labels): value}``; labels as a frozenset of (key, value) pairs."""
    out = {}
    for line in client.get("/metrics").text.splitlines():
        m = re.match(r"^([^#\s{]+)(?:\{([^}]*)\})? (\S+)$", line)
        if m:
            labels = frozenset(re.findall(r'(\w+)="([^"]*)"', m.group(2) or ""))
            out[(m.group(1), labels)] = float(m.group(3))
    return out


def series(metrics: dict, name: str) -> dict[frozenset, float]:
    """The samples of ``name``: labels -> value."""
    return {labels: v for (n, labels), v in metrics.items() if n == name}


def value(metrics: dict, name: str, **labels) -> float:
    """The sample of ``name`` with the model's labels and ``labels`` (KeyError when absent)."""
    return metrics[(name, frozenset((MODEL | labels).items()))]


def buckets(metrics: dict, name: str) -> list[float]:
    """The finite ``le`` boundaries of histogram ``name``."""
    les = [dict(labels)["le"] for labels in series(metrics, name + "_bucket")]
    return sorted(float(le) for le in les if le != "+Inf")


@pytest.fixture(scope="module")
def served():
    from fastapi.testclient import TestClient

    model = make_tiny_llama(seed=0, vocab_size=V)
    model.generation_config.eos_token_id = 90
    tok = make_tokenizer()
    engine = Engine(model, tok, NGRAM, model_name="tiny", max_model_len=512)
    with TestClient(create_app(engine)) as client:
        yield engine, tok, client
    engine.close()


def test_series_exist_at_startup(served):
    engine, _, client = served
    m = scrape(client)
    for reason in ("stop", "length", "abort", "error", "repetition"):
        assert value(m, "vllm:request_success_total", finished_reason=reason) == 0
    for position in range(engine.k):
        value(m, "vllm:spec_decode_num_accepted_tokens_per_pos_total", position=str(position))
    for name in SPEC + ("vllm:num_requests_running", "vllm:num_requests_waiting", "vllm:kv_cache_usage_perc"):
        value(m, name)


def test_a_plain_engine_has_no_spec_decode_series():
    engine = Engine(make_tiny_llama(seed=0, vocab_size=V), make_tokenizer(), model_name="tiny")
    text = engine.metrics.render().decode()
    assert "vllm:spec_decode" not in text and "vllm:request_success_total" in text
    engine.close()


def test_requests_fill_every_dashboard_series(served):
    engine, tok, client = served
    before = scrape(client)
    body = {"model": "tiny", "prompt": PROMPT, "max_tokens": 16, "temperature": 0}
    plain = client.post("/v1/completions", json=body).json()
    streamed = sse(client, "/v1/completions", body | {"stream": True, "stream_options": {"include_usage": True}})
    stop = plain["choices"][0]["text"].split()[3]
    stopped = client.post("/v1/completions", json=body | {"stop": [stop]}).json()
    chat = client.post(
        "/v1/chat/completions",
        json={"model": "tiny", "messages": [{"role": "user", "content": PROMPT}], "max_tokens": 8, "temperature": 0},
    ).json()
    usages = [plain["usage"], streamed[-1]["usage"], stopped["usage"], chat["usage"]]

    cancel, pieces = threading.Event(), []

    def on_text(delta):  # the client goes away after its first piece of text
        pieces.append(delta)
        cancel.set()

    ids = tok(PROMPT).input_ids
    with pytest.raises(RequestCancelled):
        engine.generate(ids, GenerationConfig(max_new_tokens=16), on_text=on_text, cancel=cancel)
    after = scrape(client)
    delta = {k: after[k] - before.get(k, 0.0) for k in after}

    def d(name, **labels):
        return value(delta, name, **labels)

    for name in DASHBOARD:
        assert series(after, name), f"{name} is missing from /metrics"
        assert all(MODEL.items() <= labels for labels in series(after, name)), name
    finished = [plain, [e for e in streamed if e["choices"]][-1], stopped, chat]
    for reason in ("stop", "length"):
        count = sum(r["choices"][0]["finish_reason"] == reason for r in finished)
        assert d("vllm:request_success_total", finished_reason=reason) == count
    assert d("vllm:request_success_total", finished_reason="abort") == 1
    assert delta[("draftsmith:request_success_total", frozenset({("finished_reason", "abort")}))] == 1  # ours too
    # the aborted request read its prompt and made tokens before the cancel was seen (at its next chunk)
    tokens = d("vllm:generation_tokens_total")
    assert tokens - sum(u["completion_tokens"] for u in usages) >= 1
    assert d("vllm:prompt_tokens_total") == sum(u["prompt_tokens"] for u in usages) + len(ids)
    assert d("vllm:e2e_request_latency_seconds_count") == d("vllm:time_to_first_token_seconds_count") == 5
    assert d("vllm:request_generation_tokens_sum") == tokens
    itl = d("vllm:inter_token_latency_seconds_count")
    assert 0 < itl < tokens - 5  # one gap per chunk after the first; accepted drafts make chunks of several
    for name in SPEC:  # every verify step, counted as the draftsmith: counters count them
        assert d(name) == delta[(name.replace("vllm:", "draftsmith:"), frozenset())] > 0
    per_pos = sum(series(delta, "vllm:spec_decode_num_accepted_tokens_per_pos_total").values())
    assert per_pos == d("vllm:spec_decode_num_accepted_tokens_total")
    for phase in ("queue", "prefill", "decode", "inference"):
        assert d(f"vllm:request_{phase}_time_seconds_count") == 5
    prefill_decode = d("vllm:request_prefill_time_seconds_sum") + d("vllm:request_decode_time_seconds_sum")
    assert d("vllm:request_inference_time_seconds_sum") == pytest.approx(prefill_decode, rel=1e-6, abs=1e-9)
    assert value(after, "vllm:num_requests_running") == 0 and 0 <= value(after, "vllm:kv_cache_usage_perc") <= 1


def test_buckets_are_vllms(served):
    m = scrape(served[2])
    assert buckets(m, "vllm:time_to_first_token_seconds") == list(VLLM_TIME_TO_FIRST_TOKEN_BUCKETS)
    assert buckets(m, "vllm:inter_token_latency_seconds") == list(VLLM_INTER_TOKEN_LATENCY_BUCKETS)
    for name in ("e2e_request_latency", "request_queue_time", "request_prefill_time", "request_decode_time"):
        assert buckets(m, f"vllm:{name}_seconds") == list(VLLM_REQUEST_LATENCY_BUCKETS)
    assert buckets(m, "vllm:request_prompt_tokens") == [1, 2, 5, 10, 20, 50, 100, 200, 500]  # 1-2-5 to max_model_len
    assert VLLM_TIME_TO_FIRST_TOKEN_BUCKETS[-3:] == (160.0, 640.0, 2560.0)
    assert VLLM_REQUEST_LATENCY_BUCKETS[:3] == (0.3, 0.5, 0.8) and VLLM_REQUEST_LATENCY_BUCKETS[-1] == 7680.0
