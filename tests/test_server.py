"""The serving engine and the OpenAI-compatible server, on a tiny random Llama and a tiny word-level tokenizer.

Greedy output through the server is the same with and without speculation (ngram, draft model, EAGLE-3);
streaming concatenates to the non-streamed text; stop strings cut the text; /metrics shows the exact
counter names and they grow; malformed requests get 4xx JSON errors and leave the server alive.
"""

from __future__ import annotations

import json
import re

import pytest
import torch

from draftsmith.core.generate import GenerationConfig, generate_plain
from draftsmith.core.stops import StopStringFound, TextStream
from draftsmith.drafters.speculative import SpeculativeConfig
from draftsmith.serve.engine import Engine, RequestCancelled, RequestError
from draftsmith.serve.server import create_app

V = 96
CHATML = (
    "{% for m in messages %}<|im_start|>{{ m.role }} {{ m.content }}<|im_end|> {% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant {% endif %}"
)
PROMPT = "w5 w6 w7 w8 w5 w6 w7 w8 w5 w6"  # repetitive: n-gram lookup finds drafts
NGRAM = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 3}
SPEC_COUNTERS = [
    "draftsmith:spec_decode_num_drafts_total",
    "draftsmith:spec_decode_num_draft_tokens_total",
    "draftsmith:spec_decode_num_accepted_tokens_total",
]
PER_POS = "draftsmith:spec_decode_num_accepted_tokens_per_pos_total"


def make_tokenizer(words: int = 89):
    """Word-level tokenizer: w0..w{words-1}, then ChatML specials, role words, <unk>, <pad> (96 ids)."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    names = [f"w{i}" for i in range(words)] + [
        "<|im_start|>",
        "<|im_end|>",
        "user",
        "assistant",
        "system",
        "<unk>",
        "<pad>",
    ]
    backend = Tokenizer(models.WordLevel({t: i for i, t in enumerate(names)}, unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok = PreTrainedTokenizerFast(
        tokenizer_object=backend,
        eos_token="<|im_end|>",
        unk_token="<unk>",
        pad_token="<pad>",
        additional_special_tokens=["<|im_start|>"],
    )
    tok.chat_template = CHATML
    return tok


@pytest.fixture(scope="module")
def target(tiny_llama):
    model = tiny_llama(seed=0, vocab_size=V)
    model.generation_config.eos_token_id = 90  # <|im_end|>, as the tokenizer says
    return model


@pytest.fixture(scope="module")
def tokenizer():
    return make_tokenizer()


def client_for(engine):
    from fastapi.testclient import TestClient

    return TestClient(create_app(engine))


@pytest.fixture(scope="module")
def plain_client(target, tokenizer):
    with client_for(Engine(target, tokenizer, model_name="tiny")) as client:
        yield client


@pytest.fixture(scope="module")
def ngram_client(target, tokenizer):
    with client_for(Engine(target, tokenizer, NGRAM, model_name="tiny")) as client:
        yield client


def complete(client, **body):
    r = client.post(
        "/v1/completions", json={"model": "tiny", "prompt": PROMPT, "max_tokens": 16, "temperature": 0} | body
    )
    assert r.status_code == 200, r.text
    return r.json()


def sse(client, path, body) -> list:
    """The payloads of an SSE response, checking the framing and the final [DONE]."""
    with client.stream("POST", path, json=body) as r:
        assert r.status_code == 200
        assert r.headers["content-type"].startswith("text/event-stream")
        lines = [line for line in r.iter_lines() if line]
    assert all(line.startswith("data: ") for line in lines)
    assert lines[-1] == "data: [DONE]"
    return [json.loads(line[len("data: ") :]) for line in lines[:-1]]


def scrape(client) -> dict[str, float]:
    """``{"name{labels}": value}`` from /metrics."""
    r = client.get("/metrics")
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/plain")
    out = {}
    for line in r.text.splitlines():
        m = re.match(r"^([^#\s][^\s{]*(?:\{[^}]*\})?) (\S+)$", line)
        if m:
            out[m.group(1)] = float(m.group(2))
    return out


# --- completions and chat ---------------------------------------------------------------------------------


def test_completion_matches_generate(plain_client, target, tokenizer):
    body = complete(plain_client)
    ids = tokenizer(PROMPT).input_ids
    ref = generate_plain(
        Engine(target, tokenizer).target, ids, GenerationConfig(max_new_tokens=16, eos_token_ids=(90,))
    )
    choice = body["choices"][0]
    assert body["object"] == "text_completion" and body["model"] == "tiny"
    assert choice["text"] == tokenizer.decode(ref.tokens, skip_special_tokens=True)
    assert choice["finish_reason"] == ref.finish_reason
    assert body["usage"] == {
        "prompt_tokens": len(ids),
        "completion_tokens": len(ref.tokens),
        "total_tokens": len(ids) + len(ref.tokens),
    }


def test_completion_token_ids_prompt_and_sampling(plain_client, tokenizer):
    ids = tokenizer(PROMPT).input_ids
    assert complete(plain_client, prompt=ids)["choices"][0]["text"] == complete(plain_client)["choices"][0]["text"]
    a = complete(plain_client, temperature=0.9, top_p=0.9, top_k=20, seed=7)
    b = complete(plain_client, temperature=0.9, top_p=0.9, top_k=20, seed=7)
    assert a["choices"][0]["text"] == b["choices"][0]["text"]  # seeded sampling is reproducible


def test_completion_streaming_concatenates(plain_client):
    whole = complete(plain_client)["choices"][0]
    events = sse(
        plain_client,
        "/v1/completions",
        {
            "model": "tiny",
            "prompt": PROMPT,
            "max_tokens": 16,
            "temperature": 0,
            "stream": True,
            "stream_options": {"include_usage": True},
        },
    )
    chunks = [e for e in events if e["choices"]]
    assert all(e["object"] == "text_completion" for e in events)
    assert "".join(c["choices"][0]["text"] for c in chunks) == whole["text"]
    assert [c["choices"][0]["finish_reason"] for c in chunks][-1] == whole["finish_reason"]
    assert all(c["choices"][0]["finish_reason"] is None for c in chunks[:-1])
    assert events[-1]["usage"]["completion_tokens"] == complete(plain_client)["usage"]["completion_tokens"]


def test_chat_and_chat_streaming(plain_client, target, tokenizer):
    messages = [{"role": "user", "content": "w5 w6 w7"}]
    r = plain_client.post(
        "/v1/chat/completions", json={"model": "tiny", "messages": messages, "max_tokens": 12, "temperature": 0}
    )
    assert r.status_code == 200, r.text
    body = r.json()
    ids = tokenizer(
        tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False), add_special_tokens=False
    ).input_ids
    assert ids[-2:] == [89, 92]  # ends with "<|im_start|> assistant"
    ref = generate_plain(
        Engine(target, tokenizer).target, ids, GenerationConfig(max_new_tokens=12, eos_token_ids=(90,))
    )
    assert body["object"] == "chat.completion"
    assert body["choices"][0]["message"] == {
        "role": "assistant",
        "content": tokenizer.decode(ref.tokens, skip_special_tokens=True),
    }
    assert body["usage"]["prompt_tokens"] == len(ids)
    events = sse(
        plain_client,
        "/v1/chat/completions",
        {"model": "tiny", "messages": messages, "max_tokens": 12, "temperature": 0, "stream": True},
    )
    assert events[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    assert all(e["object"] == "chat.completion.chunk" for e in events)
    text = "".join(e["choices"][0]["delta"].get("content", "") for e in events)
    assert text == body["choices"][0]["message"]["content"]
    assert events[-1]["choices"][0]["finish_reason"] == body["choices"][0]["finish_reason"]


def test_models_and_health(plain_client):
    assert plain_client.get("/health").status_code == 200
    data = plain_client.get("/v1/models").json()["data"]
    assert [m["id"] for m in data] == ["tiny"] and data[0]["max_model_len"] == 512


# --- stop strings -----------------------------------------------------------------------------------------


def test_stop_string_cuts_text_and_tokens(target, tokenizer):
    engine = Engine(target, tokenizer, NGRAM)
    ids = tokenizer(PROMPT).input_ids
    full = engine.generate(ids, GenerationConfig(max_new_tokens=16))
    assert len(full.tokens) > 4
    stop = " " + tokenizer.decode(full.tokens[3:5])  # spans two tokens
    cut = engine.generate(ids, GenerationConfig(max_new_tokens=16), stop=["never there", stop])
    assert cut.finish_reason == "stop"
    assert cut.text == full.text[: full.text.find(stop)]
    assert cut.tokens == full.tokens[: len(cut.tokens)]
    assert stop in tokenizer.decode(cut.tokens) and stop not in tokenizer.decode(cut.tokens[:-1])
    assert cut.stats.num_drafts <= full.stats.num_drafts


def test_stop_string_streaming(plain_client):
    whole = complete(plain_client)["choices"][0]["text"]
    stop = whole.split()[2]
    stopped = complete(plain_client, stop=stop)["choices"][0]
    assert stopped["finish_reason"] == "stop" and stopped["text"] == whole[: whole.find(stop)]
    events = sse(
        plain_client,
        "/v1/completions",
        {"model": "tiny", "prompt": PROMPT, "max_tokens": 16, "temperature": 0, "stop": [stop], "stream": True},
    )
    assert "".join(e["choices"][0]["text"] for e in events) == stopped["text"]
    assert events[-1]["choices"][0]["finish_reason"] == "stop"


def test_text_stream_holds_back_stop_prefixes():
    class Chars:
        """Each token id is one character."""

        def decode(self, ids, skip_special_tokens=True, clean_up_tokenization_spaces=None):
            return "".join(chr(i) for i in ids)

    sent = []
    stream = TextStream(Chars(), stop=["xyz"], on_text=sent.append)
    stream.add([ord("a"), ord("x")])
    assert sent == ["a"]  # "x" may start "xyz"
    stream.add([ord("y"), ord("b")])
    assert sent == ["a", "xyb"]
    stream.add([ord("x"), ord("y")])
    with pytest.raises(StopStringFound):
        stream.add([ord("z"), ord("c")])
    assert "".join(sent) == "axyb" and stream.text == "axyb" and len(stream.tokens) == 7


# --- speculation through the server -----------------------------------------------------------------------


def test_ngram_greedy_equals_plain_and_metrics_grow(plain_client, ngram_client):
    before = scrape(ngram_client)
    for name in SPEC_COUNTERS:
        assert name in before and not name.endswith("_total_total")
    assert PER_POS + '{position="0"}' in before and PER_POS + '{position="2"}' in before
    for prompt in (PROMPT, "w9 w9 w9 w9", "w1 w2 w3 w4 w1 w2"):
        spec = complete(ngram_client, prompt=prompt, max_tokens=20)
        plain = complete(plain_client, prompt=prompt, max_tokens=20)
        assert spec["choices"][0]["text"] == plain["choices"][0]["text"]
    after = scrape(ngram_client)
    assert after["draftsmith:spec_decode_num_drafts_total"] > before["draftsmith:spec_decode_num_drafts_total"]
    assert (
        after["draftsmith:spec_decode_num_draft_tokens_total"] > before["draftsmith:spec_decode_num_draft_tokens_total"]
    )
    per_pos = sum(v for k, v in after.items() if k.startswith(PER_POS + "{"))
    assert per_pos == after["draftsmith:spec_decode_num_accepted_tokens_total"]
    for histogram in ("time_to_first_token_seconds", "time_per_output_token_seconds", "e2e_request_latency_seconds"):
        name = f"draftsmith:{histogram}_count"
        assert after[name] == before[name] + 3
    assert after["draftsmith:generation_tokens_total"] > before["draftsmith:generation_tokens_total"]
    assert after["draftsmith:prompt_tokens_total"] > before["draftsmith:prompt_tokens_total"]


def test_metrics_name_query_renders_those_samples_only(ngram_client):
    """``/metrics?name[]=...`` (prometheus_client's query) renders the named samples only: what a poller asks for
    (the bench's gauge watcher); a plain scrape has them among every other series."""
    full = scrape(ngram_client)
    names = ["draftsmith:num_requests_running", "draftsmith:spec_decode_num_drafts_total"]
    r = ngram_client.get("/metrics", params={"name[]": names})
    assert r.status_code == 200
    samples = [line.split(" ")[0] for line in r.text.splitlines() if line and not line.startswith("#")]
    assert sorted(samples) == sorted(names) and all(name in full for name in names) and len(full) > 10 * len(names)


def test_engine_stats_match_generate(target, tokenizer):
    """The engine's counted stats are the loop's own SpecStats."""
    from draftsmith.core.generate import generate_speculative
    from draftsmith.drafters.ngram.proposer import NgramProposer

    engine = Engine(target, tokenizer, NGRAM)
    ids = tokenizer(PROMPT).input_ids
    cfg = GenerationConfig(max_new_tokens=20)
    ref = generate_speculative(engine.target, NgramProposer(1, 3), ids, cfg, 3)
    got = engine.generate(ids, cfg)
    assert got.tokens == ref.tokens and got.stats == ref.stats
    assert got.num_target_forwards == ref.num_target_forwards


def test_draft_model_and_eagle3_greedy_equal_plain(target, tokenizer, tiny_llama, tmp_path):
    from draftsmith.drafters.eagle3.export import export_eagle3
    from draftsmith.drafters.eagle3.head import Eagle3Config, Eagle3Head
    from draftsmith.identity import target_identity

    draft_dir = tmp_path / "draft"
    tiny_llama(seed=1, vocab_size=V, num_hidden_layers=1).save_pretrained(draft_dir)
    tokenizer.save_pretrained(draft_dir)
    torch.manual_seed(0)
    head = Eagle3Head(Eagle3Config.from_target(target.config))
    head_dir = export_eagle3(head, tmp_path / "head", target_identity(target, tokenizer, "tiny"), target.config)

    ids = tokenizer(PROMPT).input_ids
    cfg = GenerationConfig(max_new_tokens=12, eos_token_ids=(90,))
    plain = Engine(target, tokenizer).generate(ids, cfg)
    for spec in (
        {"method": "draft_model", "model": str(draft_dir), "num_speculative_tokens": 3},
        {"model": str(head_dir), "num_speculative_tokens": 3},
    ):  # method inferred: eagle3
        engine = Engine(target, tokenizer, spec)
        result = engine.generate(ids, cfg)
        assert result.tokens == plain.tokens and result.stats.num_drafts > 0
    assert engine.spec.method == "eagle3" and engine.target.aux_layer_ids == head.config.aux_layer_ids


def test_engine_refuses_foreign_head_and_draft(target, tokenizer, tiny_llama, tmp_path):
    from draftsmith.drafters.eagle3.export import export_eagle3
    from draftsmith.drafters.eagle3.head import Eagle3Config, Eagle3Head
    from draftsmith.export.check import HeadMismatchError
    from draftsmith.identity import target_identity

    other = tiny_llama(seed=2, vocab_size=V, hidden_size=64)
    head_dir = export_eagle3(
        Eagle3Head(Eagle3Config.from_target(other.config)),
        tmp_path / "head",
        target_identity(other, tokenizer, "other"),
        other.config,
    )
    with pytest.raises(HeadMismatchError, match="hidden_size"):
        Engine(target, tokenizer, {"method": "eagle3", "model": str(head_dir), "num_speculative_tokens": 3})
    draft_dir = tmp_path / "draft"
    tiny_llama(seed=1, vocab_size=V, num_hidden_layers=1).save_pretrained(draft_dir)
    make_tokenizer(words=88).save_pretrained(draft_dir)  # ids shifted by one
    with pytest.raises(ValueError, match="tokenizer"):
        Engine(target, tokenizer, {"method": "draft_model", "model": str(draft_dir), "num_speculative_tokens": 3})


# --- speculative config -----------------------------------------------------------------------------------


def test_speculative_config_keys(target, tokenizer):
    with pytest.raises(ValueError, match="unknown key.*'num_draft_tokens'"):
        Engine(target, tokenizer, '{"method": "ngram", "num_draft_tokens": 3}')
    assert SpeculativeConfig.parse(json.dumps(NGRAM)) == SpeculativeConfig(
        "ngram", None, 3, {"prompt_lookup_min": 1, "prompt_lookup_max": 3}
    )
    bad = [
        ({"method": "medusa", "num_speculative_tokens": 2}, "not a drafter"),
        ({"method": "ngram"}, "num_speculative_tokens"),
        ({"method": "ngram", "num_speculative_tokens": 0}, ">= 1"),
        ({"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_min": 4, "prompt_lookup_max": 2}, "min"),
        ({"method": "eagle3", "num_speculative_tokens": 2}, "needs 'model'"),
        ({"method": "draft_model", "model": "x", "num_speculative_tokens": 2, "prompt_lookup_max": 2}, "ngram"),
        ("{not json", "JSON"),
        ("[1]", "object"),
    ]
    for value, match in bad:
        with pytest.raises(ValueError, match=match):
            SpeculativeConfig.parse(value)


# --- malformed requests -----------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "path,body,status,code",
    [
        ("/v1/completions", {"model": "tiny", "max_tokens": 4}, 400, "invalid_request"),  # no prompt
        ("/v1/completions", {"prompt": "w5", "max_tokens": "four"}, 400, "invalid_request"),
        ("/v1/completions", {"prompt": "w5", "max_tokens": 0}, 400, "invalid_request"),
        ("/v1/completions", {"prompt": "w5", "temperature": "hot"}, 400, "invalid_request"),
        ("/v1/completions", {"prompt": "w5", "top_p": 1.5}, 400, "invalid_request"),
        ("/v1/completions", {"prompt": "w5", "model": "gpt-4"}, 404, "model_not_found"),
        ("/v1/completions", {"prompt": "w5 " * 600, "max_tokens": 4}, 400, "context_length_exceeded"),
        ("/v1/completions", {"prompt": "w5 " * 500, "max_tokens": 100}, 400, "context_length_exceeded"),
        ("/v1/completions", {"prompt": [5, 6, 1000]}, 400, "invalid_prompt"),
        ("/v1/completions", {"prompt": ""}, 400, "invalid_prompt"),
        ("/v1/completions", {"prompt": "w5", "n": 2}, 400, "unsupported_parameter"),
        ("/v1/completions", {"prompt": "w5", "logprobs": 3}, 400, "unsupported_parameter"),
        ("/v1/completions", {"prompt": ["w5", "w6"]}, 400, "unsupported_parameter"),
        ("/v1/chat/completions", {"model": "tiny"}, 400, "invalid_request"),  # no messages
        ("/v1/chat/completions", {"messages": [{"content": "w5"}]}, 400, "invalid_request"),  # no role
        ("/v1/chat/completions", {"messages": "w5"}, 400, "invalid_request"),
        (
            "/v1/chat/completions",
            {"messages": [{"role": "user", "content": "w5"}], "stream": "yes"},
            400,
            "invalid_request",
        ),
        ("/v1/nothing", {}, 404, "not_found"),
    ],
)
def test_malformed_requests_get_4xx(plain_client, path, body, status, code):
    r = plain_client.post(path, json=body)
    assert r.status_code == status, r.text
    error = r.json()["error"]
    assert error["code"] == code and error["message"] and error["type"]


def test_server_survives_bad_requests(plain_client):
    for raw in (b"{not json", b"[1, 2]", b""):
        r = plain_client.post("/v1/completions", content=raw, headers={"content-type": "application/json"})
        assert r.status_code == 400 and "error" in r.json()
    assert plain_client.get("/health").status_code == 200
    assert complete(plain_client, max_tokens=2)["usage"]["completion_tokens"] >= 1


def test_engine_queues_and_cancels(target, tokenizer):
    import threading

    engine = Engine(target, tokenizer, NGRAM)
    ids = tokenizer(PROMPT).input_ids
    cfg = GenerationConfig(max_new_tokens=10, temperature=0.8, seed=3)
    alone = engine.generate(ids, cfg).tokens
    results = [None] * 3
    threads = [
        threading.Thread(target=lambda i=i: results.__setitem__(i, engine.generate(ids, cfg).tokens)) for i in range(3)
    ]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert results == [alone] * 3  # decoded together, each as alone (seeded: the same draws)
    cancel = threading.Event()
    cancel.set()
    with pytest.raises(RequestCancelled):
        engine.generate(ids, cfg, cancel=cancel)


def test_concurrent_clients_get_what_each_gets_alone(target, tokenizer):
    """Eight clients at once (different prompts, lengths, one sampled): each response equals the one served alone;
    the running / waiting gauges are exported and back at 0 afterwards."""
    from concurrent.futures import ThreadPoolExecutor

    engine = Engine(target, tokenizer, NGRAM, model_name="tiny", max_num_seqs=4)
    words = PROMPT.split()
    bodies = [
        {"prompt": " ".join(words[: 3 + i]), "max_tokens": 6 + 2 * i, "temperature": 0 if i % 4 else 0.9, "seed": i}
        for i in range(8)
    ]
    with client_for(engine) as client:
        alone = [complete(client, **b)["choices"][0]["text"] for b in bodies]
        with ThreadPoolExecutor(8) as pool:
            together = list(pool.map(lambda b: complete(client, **b)["choices"][0]["text"], bodies))
        metrics = scrape(client)
    assert together == alone
    assert metrics["draftsmith:num_requests_running"] == 0 and metrics["draftsmith:num_requests_waiting"] == 0


def test_full_waiting_queue_answers_429(target, tokenizer):
    """With max_waiting requests already waiting, a new one is refused at once with 429 and a message saying
    why, streaming or not; the queued one still completes."""
    import threading

    from draftsmith.core.batch import BatchSequence

    engine = Engine(target, tokenizer, model_name="tiny", max_waiting=1)
    gate = threading.Event()
    step = engine.scheduler.decoder.step
    engine.scheduler.decoder.step = lambda: (gate.wait(30), step())[1]  # hold the scheduler mid-step
    job = engine.scheduler.submit(BatchSequence(tokenizer(PROMPT).input_ids, GenerationConfig(max_new_tokens=4)))
    with client_for(engine) as client:
        for stream in (False, True):
            body = {"model": "tiny", "prompt": PROMPT, "max_tokens": 4, "stream": stream}
            r = client.post("/v1/completions", json=body)
            assert r.status_code == 429, r.text
            error = r.json()["error"]
            assert error["code"] == "too_many_requests" and "retry later" in error["message"]
        gate.set()
        assert job.wait(30) and job.seq.result is not None and len(job.seq.result.tokens) == 4
        assert complete(client)["choices"][0]["text"]  # served again once the queue drained
    engine.close()


def test_engine_check_prompt(target, tokenizer):
    engine = Engine(target, tokenizer)
    with pytest.raises(RequestError, match="maximum context length is 512"):
        engine.generate([5] * 510, GenerationConfig(max_new_tokens=3))


# --- 32 concurrent clients on a real loopback server ------------------------------------------------------


def _concurrent_bodies() -> list[tuple[str, dict]]:
    """32 different requests: completions and chat, greedy and seeded sampling, streamed or not, stop strings."""
    prompts = [
        PROMPT,
        "w9 w9 w9 w9",
        "w1 w2 w3 w4 w1 w2",
        "w30 w31 w30 w31 w30",
        "w7",
        "w3 w4 w5 w3 w4 w5 w3 w4",
        "w50 w51 w52 w53",
        "w11 w12 w11 w12 w11 w12",
    ]
    bodies = []
    for i in range(32):
        body = {
            "model": "tiny",
            "max_tokens": 4 + i % 13,
            "temperature": 0.0 if i % 3 else 0.9,
            "seed": i,
            "stream": i % 4 == 1,
        }
        if body["stream"]:
            body["stream_options"] = {"include_usage": True}
        if i % 8 == 5:
            body["stop"] = ["w5 w6"]
        if i % 2:
            bodies.append(("/v1/chat/completions", body | {"messages": [{"role": "user", "content": prompts[i % 8]}]}))
        else:
            bodies.append(("/v1/completions", body | {"prompt": prompts[i % 8]}))
    return bodies


async def _send(client, path: str, body: dict) -> dict:
    """(text, finish_reason, usage) of one request, streamed or not."""
    if not body["stream"]:
        r = await client.post(path, json=body)
        assert r.status_code == 200, r.text
        choice, usage = r.json()["choices"][0], r.json()["usage"]
        text = choice["text"] if path == "/v1/completions" else choice["message"]["content"]
        return {"text": text, "finish_reason": choice["finish_reason"], "usage": usage}
    text, finish_reason, usage = "", None, None
    async with client.stream("POST", path, json=body) as r:
        assert r.status_code == 200
        async for line in r.aiter_lines():
            if not line or line == "data: [DONE]":
                continue
            event = json.loads(line[len("data: ") :])
            if event.get("usage"):
                usage = event["usage"]
            for choice in event["choices"]:
                text += choice.get("text") or choice.get("delta", {}).get("content") or ""
                finish_reason = choice["finish_reason"] or finish_reason
    return {"text": text, "finish_reason": finish_reason, "usage": usage}


def _scrape_text(text: str) -> dict[str, float]:
    out = {}
    for line in text.splitlines():
        m = re.match(r"^([^#\s][^\s{]*(?:\{[^}]*\})?) (\S+)$", line)
        if m:
            out[m.group(1)] = float(m.group(2))
    return out


def test_32_concurrent_clients_match_serial_and_metrics_add_up(target, tokenizer):
    """Every concurrent response equals the same request served alone; /metrics deltas equal the sums of
    what the responses report (usage) and of each request's own spec-decode counters."""
    import asyncio

    import httpx

    from draftsmith.serve.server import BackgroundServer

    engine = Engine(target, tokenizer, NGRAM, model_name="tiny")
    bodies = _concurrent_bodies()

    async def main(url: str):
        limits = httpx.Limits(max_connections=32, max_keepalive_connections=32)
        async with httpx.AsyncClient(base_url=url, timeout=120.0, limits=limits) as client:

            async def metrics():
                return _scrape_text((await client.get("/metrics")).text)

            alone, own = [], []
            for path, body in bodies:  # one at a time: nothing else in flight
                before = await metrics()
                alone.append(await _send(client, path, body))
                after = await metrics()
                own.append({name: after[name] - before[name] for name in SPEC_COUNTERS})
            before = await metrics()
            gate = asyncio.Semaphore(32)  # bounded: at most 32 requests in flight

            async def bounded(path, body):
                async with gate:
                    return await _send(client, path, body)

            together = await asyncio.wait_for(asyncio.gather(*(bounded(p, b) for p, b in bodies)), timeout=600)
            after = await metrics()
            return alone, own, together, before, after

    with BackgroundServer(create_app(engine)) as server:
        assert server.host == "127.0.0.1"
        alone, own, together, before, after = asyncio.run(main(server.url))
        assert httpx.get(server.url + "/health").json() == {"status": "ok"}

    assert together == alone
    delta = {name: after.get(name, 0.0) - before.get(name, 0.0) for name in after}
    assert delta["draftsmith:generation_tokens_total"] == sum(r["usage"]["completion_tokens"] for r in together)
    assert delta["draftsmith:prompt_tokens_total"] == sum(r["usage"]["prompt_tokens"] for r in together)
    for reason in ("stop", "length"):
        name = f'draftsmith:request_success_total{{finished_reason="{reason}"}}'
        assert delta.get(name, 0.0) == sum(r["finish_reason"] == reason for r in together)
    for histogram in ("time_to_first_token_seconds", "e2e_request_latency_seconds"):
        assert delta[f"draftsmith:{histogram}_count"] == 32
    assert delta["draftsmith:time_per_output_token_seconds_count"] == sum(
        r["usage"]["completion_tokens"] > 1 for r in together
    )
    for name in SPEC_COUNTERS:  # each request's own counters, summed
        assert delta[name] == sum(o[name] for o in own)
        assert delta[name] >= 0
    assert delta["draftsmith:spec_decode_num_drafts_total"] > 0
    assert (
        0
        < delta["draftsmith:spec_decode_num_accepted_tokens_total"]
        <= delta["draftsmith:spec_decode_num_draft_tokens_total"]
    )
    per_pos = sum(v for k, v in delta.items() if k.startswith(PER_POS + "{"))
    assert per_pos == delta["draftsmith:spec_decode_num_accepted_tokens_total"]
    assert {r["finish_reason"] for r in together} == {"stop", "length"}  # both kinds were served
    assert any(r["usage"]["completion_tokens"] > 1 for r in together)


def test_stop_token_inside_a_chunk_trims_tokens_text_and_usage(ngram_client, target, tokenizer):
    """A stop token id as the 3rd token of an accepted n-gram chunk: tokens and usage end there; the text leaves the
    stop token out unless include_stop_str_in_output, and stop_reason names it (vLLM's rules)."""
    engine = Engine(target, tokenizer, NGRAM)
    ids = tokenizer(PROMPT).input_ids
    full = engine.generate(ids, GenerationConfig(max_new_tokens=16))
    stop_id = full.tokens[2]
    assert stop_id not in full.tokens[:2] and full.stats.num_accepted_tokens > 0
    cut = engine.generate(ids, GenerationConfig(max_new_tokens=16, stop_token_ids=(stop_id,)))
    assert (cut.tokens, cut.finish_reason, cut.stop_reason) == (full.tokens[:3], "stop", stop_id)
    assert cut.text == tokenizer.decode(full.tokens[:2], skip_special_tokens=True)
    body = complete(ngram_client, stop_token_ids=[stop_id])
    want = {"index": 0, "text": cut.text, "logprobs": None, "finish_reason": "stop", "stop_reason": stop_id}
    assert body["choices"][0] == want
    assert body["usage"]["completion_tokens"] == 3
    body = complete(ngram_client, stop_token_ids=[stop_id], include_stop_str_in_output=True)
    assert body["choices"][0]["text"] == tokenizer.decode(full.tokens[:3], skip_special_tokens=True)


@pytest.mark.parametrize("max_tokens", [1, 2])
def test_ngram_server_returns_exactly_max_tokens(ngram_client, max_tokens):
    body = complete(ngram_client, max_tokens=max_tokens)
    assert body["usage"]["completion_tokens"] == max_tokens
    assert body["choices"][0]["finish_reason"] == "length"


def test_a_steps_text_leaves_at_its_end_one_wake_up_per_loop():
    """``Handoff``: what the scheduler's thread sends is held until the step's flush and then reaches each loop
    in order through one ``call_soon_threadsafe`` per loop; from another thread it goes at once; a closed loop
    drops what was held for it."""
    import asyncio
    import threading

    from draftsmith.serve.scheduler import Handoff

    class Loop:
        def __init__(self):
            self.calls, self.closed = [], False

        def call_soon_threadsafe(self, fn, *args):
            if self.closed:
                raise RuntimeError("Event loop is closed")
            self.calls.append((fn, args))

        def run(self):
            for fn, args in self.calls:
                fn(*args)

    handoff, got = Handoff(), {"a": [], "b": []}
    a, b, gone = Loop(), Loop(), Loop()
    to_a, to_b, to_gone = (
        handoff.to_loop(a, got["a"].append),
        handoff.to_loop(b, got["b"].append),
        handoff.to_loop(gone, print),
    )
    handoff.thread_id = threading.get_ident()  # this thread plays the scheduler's
    for piece in ("x", "y", "z"):
        to_a(piece)
    to_b("1")
    to_gone("lost")
    gone.closed = True
    assert a.calls == [] and b.calls == []  # held during the step
    handoff.flush()
    assert len(a.calls) == 1 and len(b.calls) == 1
    a.run(), b.run()
    assert got == {"a": ["x", "y", "z"], "b": ["1"]}
    handoff.flush()
    assert len(a.calls) == 1  # nothing left to send
    other = threading.Thread(target=lambda: to_a("w"))  # the request's own thread (its text's end)
    other.start(), other.join()
    assert len(a.calls) == 2 and a.calls[1][1] == ("w",)
    loop = asyncio.new_event_loop()  # and a real loop runs what arrives
    try:
        seen = []
        handoff.to_loop(loop, seen.append)("v")
        handoff.flush()
        loop.run_until_complete(asyncio.sleep(0))
        assert seen == ["v"]
    finally:
        loop.close()
