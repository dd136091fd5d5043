"""The server under clients that misbehave, and around its edges: a non-streaming client that goes away, long
prompts (tokenized off the event loop), oversized bodies, a missing Content-Type, bad values of the right type
(fuzzed: never a 5xx), the API key, shutdown with requests queued, /tokenize, /detokenize, /version, `serve --help`.

The tiny random Llama and word-level tokenizer of ``test_server.py``; the real-socket tests run uvicorn on a
background thread (``BackgroundServer``), the rest FastAPI's TestClient.
"""

from __future__ import annotations

import json
import logging
import random
import threading
import time

import httpx
import pytest
import torch

from draftsmith import __version__, cli
from draftsmith.core.generate import GenerationConfig
from draftsmith.core.sampling import logits_to_probs
from draftsmith.serve.engine import Engine, EngineClosed, RequestCancelled
from draftsmith.serve.server import BackgroundServer, create_app
from test_server import PROMPT, V, make_tokenizer

CHAT = [{"role": "user", "content": PROMPT}]


@pytest.fixture(scope="module")
def target(tiny_llama):
    model = tiny_llama(seed=0, vocab_size=V)
    model.generation_config.eos_token_id = 90
    return model


@pytest.fixture(scope="module")
def tokenizer():
    return make_tokenizer()


def make_client(app, **kwargs):
    from fastapi.testclient import TestClient

    return TestClient(app, **kwargs)


@pytest.fixture(scope="module")
def client(target, tokenizer):
    with make_client(create_app(Engine(target, tokenizer, model_name="tiny"))) as c:
        yield c


def slow_steps(engine: Engine, seconds: float) -> None:
    """Every scheduler step takes at least ``seconds`` (a slow model), so a request stays in the batch a while."""
    step = engine.scheduler.decoder.step
    engine.scheduler.decoder.step = lambda: (time.sleep(seconds), step())[1]


def submitted(engine: Engine) -> list:
    """The sequences the engine's scheduler receives from now on."""
    seqs, submit = [], engine.scheduler.submit

    def record(seq, cancel=None):
        seqs.append(seq)
        return submit(seq, cancel)

    engine.scheduler.submit = record
    return seqs


def wait_for(condition, timeout: float = 10.0) -> float:
    """Seconds until ``condition()`` held; fails after ``timeout``."""
    t0 = time.monotonic()
    while not condition():
        assert time.monotonic() - t0 < timeout, "timed out"
        time.sleep(0.01)
    return time.monotonic() - t0


# --- a non-streaming client that disconnects --------------------------------------------------------------


@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions"])
def test_non_streaming_client_that_disconnects_leaves_the_batch(target, tokenizer, path):
    engine = Engine(target, tokenizer, model_name="tiny")
    slow_steps(engine, 0.02)  # 400 tokens would take >= 8 s
    seqs = submitted(engine)
    body = {"max_tokens": 400, "temperature": 0} | ({"prompt": PROMPT} if "chat" not in path else {"messages": CHAT})
    with BackgroundServer(create_app(engine)) as server:
        with pytest.raises(httpx.ReadTimeout):
            httpx.post(server.url + path, json=body, timeout=0.5)
        gone_after = wait_for(lambda: seqs and seqs[0].done and engine.scheduler.num_running == 0, timeout=5)
        assert httpx.get(server.url + "/health").status_code == 200
    seq = seqs[0]
    assert isinstance(seq.error, RequestCancelled)
    assert gone_after < 2.0 and len(seq.tokens) < 100  # far fewer than the 400 asked for
    assert engine.scheduler.num_running == 0 and engine.scheduler.num_waiting == 0


# --- tokenizing off the event loop, the body limit, Content-Type -------------------------------------------


class SlowTokenizer:
    """The tokenizer, taking ``seconds`` to encode (time.sleep releases the GIL, as tokenizers' Rust encode does)."""

    def __init__(self, tokenizer, seconds: float):
        self._tokenizer, self._seconds = tokenizer, seconds

    def __call__(self, *args, **kwargs):
        time.sleep(self._seconds)
        return self._tokenizer(*args, **kwargs)

    def __getattr__(self, name):
        return getattr(self._tokenizer, name)


def test_tokenizing_does_not_block_the_event_loop(target, tokenizer):
    engine = Engine(target, tokenizer, model_name="tiny")
    engine.tokenizer = SlowTokenizer(tokenizer, 2.0)
    with BackgroundServer(create_app(engine)) as server:
        results = {}
        slow = threading.Thread(
            target=lambda: results.setdefault(
                "r", httpx.post(server.url + "/v1/completions", json={"prompt": PROMPT, "max_tokens": 2}, timeout=30)
            )
        )
        slow.start()
        time.sleep(0.3)  # the request is tokenizing now
        t0 = time.monotonic()
        assert httpx.get(server.url + "/health", timeout=5).status_code == 200
        health_s = time.monotonic() - t0
        slow.join()
    assert health_s < 0.5, health_s
    assert results["r"].status_code == 200


def test_body_over_the_limit_gets_413_before_parsing(target, tokenizer):
    engine = Engine(target, tokenizer, model_name="tiny")
    with BackgroundServer(create_app(engine, max_request_bytes=1000)) as server:
        big = json.dumps({"prompt": "w5 " * 1000, "max_tokens": 2})
        r = httpx.post(server.url + "/v1/completions", content=big, headers={"content-type": "application/json"})
        assert r.status_code == 413, r.text
        error = r.json()["error"]
        assert error["code"] == "request_too_large" and "1000 bytes" in error["message"]
        assert "--max-request-bytes" in error["message"]

        def chunks():  # no Content-Length: counted while read
            for _ in range(10):
                yield b" " * 300

        r = httpx.post(server.url + "/v1/completions", content=chunks(), headers={"content-type": "application/json"})
        assert r.status_code == 413 and r.json()["error"]["code"] == "request_too_large"
        small = {"prompt": PROMPT, "max_tokens": 2}
        assert httpx.post(server.url + "/v1/completions", json=small).status_code == 200
        assert httpx.get(server.url + "/health").status_code == 200


def test_post_without_json_content_type_gets_400_saying_so(client):
    body = json.dumps({"prompt": PROMPT, "max_tokens": 2})
    for headers in ({"content-type": "application/x-www-form-urlencoded"}, {}, {"content-type": "text/plain"}):
        r = client.post("/v1/completions", content=body, headers=headers)
        assert r.status_code == 400, r.text
        error = r.json()["error"]
        assert error["code"] == "unsupported_media_type"
        assert "Content-Type: application/json" in error["message"]
    ok = client.post("/v1/completions", content=body, headers={"content-type": "application/json; charset=utf-8"})
    assert ok.status_code == 200
    assert client.post("/tokenize", content=b'{"prompt": "w5"}').status_code == 400


# --- bad values of the right type --------------------------------------------------------------------------


def post_raw(client, path: str, body: dict, **kwargs):
    """POST ``body`` as JSON as Python writes it: NaN / Infinity literals, lone surrogates as \\ud800 escapes."""
    raw = json.dumps(body, allow_nan=True)
    return client.post(path, content=raw, headers={"content-type": "application/json"}, **kwargs)


@pytest.mark.parametrize(
    "extra,param",
    [
        ({"seed": 2**63}, "seed"),
        ({"seed": -(2**63) - 1}, "seed"),
        ({"seed": 2**64, "stream": True}, "seed"),  # refused before the stream starts
        ({"temperature": float("inf")}, "temperature"),
        ({"temperature": float("nan")}, "temperature"),
        ({"top_p": float("nan")}, "top_p"),
        ({"stop_token_ids": [-1]}, "stop_token_ids"),
        ({"stop_token_ids": [V]}, "stop_token_ids"),
        ({"stop_token_ids": [2**70]}, "stop_token_ids"),
        ({"prompt": "w5 \ud800 w6"}, "prompt"),
        ({"prompt": ["\udfff"]}, "prompt.0"),
        ({"prompt": "w5", "stream": True, "stop": ["\ud800"]}, "stop.0"),
        ({"max_tokens": 10**30}, "max_tokens"),
    ],
)
def test_out_of_range_values_get_400(client, extra, param):
    r = post_raw(client, "/v1/completions", {"prompt": PROMPT, "max_tokens": 2} | extra)
    assert r.status_code == 400, r.text
    assert r.headers["content-type"] == "application/json"
    assert r.json()["error"]["param"] == param


def test_lone_surrogates_in_messages_get_400(client):
    for messages in (
        [{"role": "user", "content": "w5 \ud800"}],
        [{"role": "\ud800", "content": "w5"}],
        [{"role": "user", "content": [{"type": "text", "text": "\udc00"}]}],
    ):
        r = post_raw(client, "/v1/chat/completions", {"messages": messages, "max_tokens": 2})
        assert r.status_code == 400 and r.json()["error"]["code"] == "invalid_unicode", r.text
    r = post_raw(client, "/v1/completions", {"prompt": "w5", "model": "\ud800"})  # echoed, escaped
    assert r.status_code == 404 and "\\ud800" in r.json()["error"]["message"]


def test_tiny_temperature_and_top_p_do_not_fail_the_batch(client):
    greedy = post_raw(client, "/v1/completions", {"prompt": PROMPT, "max_tokens": 8, "temperature": 0}).json()
    for extra in ({"temperature": 1e-300}, {"temperature": 5e-324}, {"top_p": 1e-300, "seed": 1}):
        r = post_raw(client, "/v1/completions", {"prompt": PROMPT, "max_tokens": 8} | extra)
        assert r.status_code == 200, r.text
    nucleus = post_raw(client, "/v1/completions", {"prompt": PROMPT, "max_tokens": 8, "top_p": 1e-300, "seed": 1})
    assert nucleus.json()["choices"][0]["text"] == greedy["choices"][0]["text"]  # only the top token is left


def test_logits_to_probs_keeps_the_top_token_for_a_top_p_below_float32():
    logits = torch.tensor([[0.5, 3.0, -1.0, 2.9]])
    assert logits_to_probs(logits, top_p=1e-300).tolist() == [[0.0, 1.0, 0.0, 0.0]]


def test_a_failed_step_ends_every_request_it_held(target, tokenizer):
    """A seed torch cannot take fails the step after the sequence left the waiting queue; the request still ends
    (it used to wait forever) and the engine serves the next one."""
    engine = Engine(target, tokenizer)
    ids = tokenizer(PROMPT).input_ids
    outcome = {}

    def bad():
        try:
            engine.generate(ids, GenerationConfig(max_new_tokens=2, temperature=0.7, seed=2**64))
        except Exception as e:  # noqa: BLE001
            outcome["error"] = e

    thread = threading.Thread(target=bad, daemon=True)
    thread.start()
    thread.join(30)
    assert not thread.is_alive() and isinstance(outcome.get("error"), ValueError)
    assert len(engine.generate(ids, GenerationConfig(max_new_tokens=2)).tokens) == 2


def test_internal_errors_say_only_internal_error(target, tokenizer, caplog):
    engine = Engine(target, tokenizer, model_name="tiny")

    def broken(*args, **kwargs):
        raise RuntimeError("secret /srv/weights/internal.bin shape [4096, 128]")

    engine.generate = broken
    with make_client(create_app(engine), raise_server_exceptions=False) as c, caplog.at_level(logging.ERROR):
        r = c.post("/v1/completions", json={"prompt": PROMPT, "max_tokens": 2})
        assert r.status_code == 500
        error = r.json()["error"]
        assert error["code"] == "internal_error" and "error id" in error["message"] and "secret" not in r.text
        error_id = error["message"].split("error id ")[1].split(";")[0]
        with c.stream("POST", "/v1/completions", json={"prompt": PROMPT, "max_tokens": 2, "stream": True}) as s:
            lines = [line for line in s.iter_lines() if line]
        assert lines[-1] == "data: [DONE]" and "secret" not in "".join(lines)
        assert json.loads(lines[-2][len("data: ") :])["error"]["code"] == "internal_error"
        assert c.get("/health").status_code == 200
    logged = "\n".join(f"{r.getMessage()} {r.exc_text or ''}" for r in caplog.records)
    assert error_id in logged and "secret" in logged


def test_validation_errors_are_bounded(client):
    r = client.post("/v1/completions", json={"prompt": [{"x": i} for i in range(5000)]})
    assert r.status_code == 400 and len(r.json()["error"]["message"]) < 1100


# --- the fuzz ----------------------------------------------------------------------------------------------

BAD_VALUES = [
    None,
    True,
    False,
    0,
    -1,
    1,
    3,
    2**31,
    2**63 - 1,
    2**63,
    2**64,
    -(2**63) - 1,
    10**30,
    0.5,
    1e-300,
    5e-324,
    1e300,
    float("nan"),
    float("inf"),
    float("-inf"),
    "",
    " ",
    "w5",
    "\ud800",
    "w5 \udfff w6",
    "\x00",
    "é😀",
    "w5 " * 3000,
    [],
    [1],
    [-1],
    [2**70],
    [V],
    ["w5"],
    [""],
    ["\ud800"],
    ["w5", "w6"],
    [[1]],
    [None],
    {},
    {"a": 1},
    {"include_usage": True},
    {"include_usage": "yes"},
    [{"type": "text", "text": "w5"}],
    [{"type": "image_url", "image_url": {"url": "x"}}],
    [{"role": "user", "content": "w5"}],
    [{"role": "user", "content": None}],
    [{"role": 1, "content": "w5"}],
]
FIELDS = [
    "model",
    "prompt",
    "messages",
    "max_tokens",
    "max_completion_tokens",
    "temperature",
    "top_p",
    "top_k",
    "seed",
    "stop",
    "stop_token_ids",
    "n",
    "stream",
    "stream_options",
    "logprobs",
    "echo",
    "best_of",
    "presence_penalty",
    "logit_bias",
    "suffix",
    "tools",
    "response_format",
    "user",
    "\ud800",
]
RAW_BODIES = [
    b"",
    b"{",
    b"null",
    b"[]",
    b'"w5"',
    b"3",
    b"\xff\xfe{}",
    b'{"prompt": "w5", "max_tokens": 2}\x00',
    b'{"prompt": "\xc3\x28", "max_tokens": 2}',  # invalid UTF-8
    b'{"prompt": "w5", "max_tokens": 1' + b"0" * 5000 + b"}",  # past Python's int digits limit
    b"[" * 30_000 + b"]" * 30_000,  # deeper than the JSON parser recurses
    b'{"prompt": "w5", "max_tokens": NaN}',
    b'{"prompt": "w5", "temperature": -Infinity}',
    b'{"prompt": "w5", "seed": 1e400}',
    b'{"prompt": "w5", "prompt": 3}',
    b'{"messages": [{"role": "user", "content": "w5"}], "max_tokens": 2, "stop": {"a": []}}',
]


def fuzz_requests(n: int, seed: int = 0) -> list[tuple[str, bytes]]:
    """``n`` (path, body) pairs: a valid request with one to three fields set to a bad value (a wrong type, an
    out-of-range number, a bad string), raw bodies that are not the JSON expected, and a few too large."""
    rng = random.Random(seed)
    out = []
    for i in range(n):
        path = rng.choice(["/v1/completions", "/v1/chat/completions"])
        if i % 10 == 0:
            out.append((path, rng.choice(RAW_BODIES)))
            continue
        body = {"model": "tiny", "max_tokens": 3, "temperature": 0}
        body |= {"prompt": PROMPT} if path == "/v1/completions" else {"messages": [dict(m) for m in CHAT]}
        body["stream"] = rng.random() < 0.4
        for _ in range(rng.randint(1, 3)):
            messages = body.get("messages")
            if isinstance(messages, list) and messages and isinstance(messages[0], dict) and rng.random() < 0.3:
                messages[0][rng.choice(["role", "content", "name", "\ud800"])] = rng.choice(BAD_VALUES)
            else:
                body[rng.choice(FIELDS)] = rng.choice(BAD_VALUES)
        if i % 25 == 1:
            body["prompt" if path == "/v1/completions" else "user"] = "w5 " * 30_000  # over the 64 KiB limit
        out.append((path, json.dumps(body, allow_nan=True).encode()))
    return out


def test_fuzzed_bad_requests_never_get_a_5xx(target, tokenizer, capsys):
    """A few hundred bad requests over both endpoints, streamed and not: no 5xx (a stream's error event neither),
    every error a JSON body, and the server serves normally afterwards."""
    engine = Engine(target, tokenizer, model_name="tiny", max_model_len=64)  # an omitted max_tokens stays short
    counts = {"2xx": 0, "4xx": 0, "5xx": 0}
    problems = []
    with make_client(create_app(engine, max_request_bytes=64 * 1024), raise_server_exceptions=False) as c:
        requests = fuzz_requests(600)
        for path, raw in requests:
            with c.stream("POST", path, content=raw, headers={"content-type": "application/json"}) as r:
                text = "".join(r.iter_text())
            counts[f"{r.status_code // 100}xx"] += 1
            if r.status_code >= 500:
                problems.append((path, raw[:200], r.status_code, text[:300]))
            elif r.status_code >= 400:
                assert set(json.loads(text)["error"]) == {"message", "type", "code", "param"}
            elif r.headers["content-type"].startswith("text/event-stream"):
                assert text.rstrip().endswith("data: [DONE]"), text[-300:]
                if '"internal_error"' in text:
                    problems.append((path, raw[:200], "stream", text[-300:]))
        assert c.get("/health").status_code == 200
        ok = c.post("/v1/completions", json={"prompt": PROMPT, "max_tokens": 3, "temperature": 0})
        assert ok.status_code == 200 and ok.json()["usage"]["completion_tokens"] == 3
    assert engine.scheduler.num_running == 0 and engine.scheduler.num_waiting == 0
    with capsys.disabled():
        print(f"\nfuzz: {len(requests)} requests, 2xx={counts['2xx']} 4xx={counts['4xx']} 5xx={counts['5xx']}")
    assert not problems, problems[:5]
    assert counts["2xx"] > 20 and counts["4xx"] > 300  # both kinds were exercised


# --- the API key ---------------------------------------------------------------------------------------------


def test_api_key_guards_v1_and_tokenize_not_health_or_metrics(target, tokenizer):
    engine = Engine(target, tokenizer, model_name="tiny")
    with make_client(create_app(engine, api_key="s3cret")) as c:
        for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": "s3cret"}, {"X-Api-Key": "s3cret"}):
            for method, path in (("GET", "/v1/models"), ("POST", "/v1/completions"), ("POST", "/tokenize")):
                r = c.request(method, path, json={"prompt": PROMPT}, headers=headers)
                assert r.status_code == 401, (path, headers, r.text)
                assert r.json()["error"]["code"] == "invalid_api_key" and r.headers["www-authenticate"] == "Bearer"
        # the key is checked first: a form-encoded POST without it is a 401, not a 400
        assert c.post("/v1/completions", content=b"prompt=w5").status_code == 401
        for path in ("/health", "/metrics", "/version"):
            assert c.get(path).status_code == 200
        key = {"Authorization": "Bearer s3cret"}
        assert c.get("/v1/models", headers=key).status_code == 200
        body = {"prompt": PROMPT, "max_tokens": 2, "ignore_eos": True}  # sampled: an early EOS is not this test's
        r = c.post("/v1/completions", json=body, headers=key)
        assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 2
        assert (
            c.post("/tokenize", json={"prompt": PROMPT}, headers={"authorization": "bearer s3cret"}).status_code == 200
        )
    with pytest.raises(ValueError, match="empty"):
        create_app(engine, api_key="")


def test_serve_reads_the_api_key_env_and_warns_when_exposed(monkeypatch, caplog, free_tcp_port):
    port = str(free_tcp_port)
    args = cli.build_parser().parse_args(["serve", "--port", port])
    monkeypatch.setenv("DRAFTSMITH_API_KEY", "from-env")
    cli.check_args(args)
    assert args.api_key == "from-env"
    args = cli.build_parser().parse_args(["serve", "--port", port, "--api-key", "from-flag"])
    cli.check_args(args)
    assert args.api_key == "from-flag"  # the flag wins, as vLLM's --api-key over VLLM_API_KEY
    with caplog.at_level(logging.WARNING, logger="draftsmith.serve"):
        assert cli.warn_if_exposed("0.0.0.0", None)
        assert not cli.warn_if_exposed("0.0.0.0", "key")
        assert not cli.warn_if_exposed("127.0.0.1", None) and not cli.warn_if_exposed("localhost", None)
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1 and "without an API key" in warnings[0] and "--api-key" in warnings[0]


# --- shutdown with requests queued ---------------------------------------------------------------------------


def test_shutdown_answers_queued_and_running_requests_503(target, tokenizer):
    """With 1 request running and 6 queued (2 of them streams), a shutdown (what SIGTERM sets) closes the engine:
    the plain requests get 503 saying the server is shutting down, the streams an error event then [DONE], and
    the server is gone within seconds."""
    engine = Engine(target, tokenizer, model_name="tiny", max_num_seqs=1)
    slow_steps(engine, 0.02)
    server = BackgroundServer(create_app(engine)).__enter__()
    answers = [None] * 7

    def send(i: int):
        body = {"prompt": PROMPT, "max_tokens": 400, "temperature": 0, "stream": i in (3, 5)}
        with httpx.stream("POST", server.url + "/v1/completions", json=body, timeout=30) as r:
            answers[i] = (r.status_code, r.read().decode())

    threads = [threading.Thread(target=send, args=(i,), daemon=True) for i in range(7)]
    for t in threads:
        t.start()
    wait_for(lambda: engine.scheduler.num_running == 1 and engine.scheduler.num_waiting == 6)
    t0 = time.monotonic()
    server.server.should_exit = True  # uvicorn's SIGTERM / Ctrl+C handler does exactly this
    server.thread.join(timeout=30)
    exit_s = time.monotonic() - t0
    server.socket.close()
    for t in threads:
        t.join(timeout=5)
    assert not server.thread.is_alive() and exit_s < 10, exit_s
    for i, (status, text) in enumerate(answers):
        if i in (3, 5):
            events = [line[len("data: ") :] for line in text.splitlines() if line.startswith("data: ")]
            assert status == 200 and events[-1] == "[DONE]", text
            assert json.loads(events[-2])["error"]["code"] == "server_shutting_down"
        else:
            assert status == 503, text
            error = json.loads(text)["error"]
            assert error["code"] == "server_shutting_down" and "shutting down" in error["message"]
    assert engine.scheduler.closed
    with pytest.raises(EngineClosed):
        engine.generate(tokenizer(PROMPT).input_ids, GenerationConfig(max_new_tokens=2))


# --- endpoints: models, version, tokenize, detokenize ---------------------------------------------------------


def test_model_by_id_and_version(client):
    card = client.get("/v1/models/tiny")
    assert card.status_code == 200 and card.json()["id"] == "tiny" and card.json()["max_model_len"] == 512
    r = client.get("/v1/models/org/other-model")
    assert r.status_code == 404 and r.json()["error"]["code"] == "model_not_found"
    assert client.get("/version").json() == {"version": __version__}


def test_tokenize_and_detokenize_as_vllm(client, tokenizer):
    ids = tokenizer(PROMPT).input_ids
    r = client.post("/tokenize", json={"model": "tiny", "prompt": PROMPT})
    assert r.json() == {"count": len(ids), "max_model_len": 512, "tokens": ids, "token_strs": None}
    strs = client.post("/tokenize", json={"prompt": PROMPT, "return_token_strs": True}).json()["token_strs"]
    assert strs == PROMPT.split()
    chat = client.post("/tokenize", json={"messages": CHAT}).json()
    served = client.post("/v1/chat/completions", json={"messages": CHAT, "max_tokens": 1}).json()
    assert chat["count"] == served["usage"]["prompt_tokens"]  # what the chat endpoint feeds the model
    bare = client.post("/tokenize", json={"messages": CHAT, "add_generation_prompt": False}).json()
    assert bare["count"] < chat["count"] and chat["tokens"][: bare["count"]] == bare["tokens"]
    cont = client.post("/tokenize", json={"messages": CHAT, "continue_final_message": True})
    assert cont.status_code == 200, cont.text
    back = client.post("/detokenize", json={"model": "tiny", "tokens": ids})
    assert back.json() == {"prompt": tokenizer.decode(ids)}
    for path, body, code in [
        ("/tokenize", {}, "invalid_request"),
        ("/tokenize", {"prompt": "w5", "messages": CHAT}, "invalid_request"),
        ("/tokenize", {"messages": CHAT, "continue_final_message": True, "add_generation_prompt": True}, None),
        ("/tokenize", {"prompt": "\ud800"}, "invalid_unicode"),
        ("/tokenize", {"prompt": 5}, "invalid_request"),
        ("/tokenize", {"prompt": "w5", "model": "other"}, "model_not_found"),
        ("/detokenize", {"tokens": [V]}, "invalid_tokens"),
        ("/detokenize", {"tokens": [-1]}, "invalid_tokens"),
        ("/detokenize", {"tokens": [2**70]}, "invalid_tokens"),
        ("/detokenize", {"tokens": "w5"}, "invalid_request"),
    ]:
        r = post_raw(client, path, body)
        assert 400 <= r.status_code < 500, (body, r.text)
        assert code is None or r.json()["error"]["code"] == code, (body, r.text)


# --- the command line ---------------------------------------------------------------------------------------


def test_serve_help_gives_every_flag_a_text_and_its_default(capsys):
    with pytest.raises(SystemExit) as e:
        cli.main(["serve", "--help"])
    assert e.value.code == 0
    text = capsys.readouterr().out
    parser = cli.build_parser()
    serve = next(a for a in parser._subparsers._group_actions[0].choices.items() if a[0] == "serve")[1]
    flags = [a for a in serve._actions if a.option_strings and a.dest not in ("help", "verbose")]
    assert len(flags) >= 14
    for action in flags:
        assert action.help, action.dest
        assert "default" in serve.formatter_class(prog="x")._get_help_string(action), action.dest
    assert "(default: 8000)" in text and "(default: 8388608)" in text and "--api-key KEY" in text
