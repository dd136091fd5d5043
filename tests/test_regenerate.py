"""Regeneration: the three engines agree, a killed run resumes from its journal, the server path over loopback.

The server tests run draftsmith's own server (``serve/server.py``) or a FastAPI stub with uvicorn
on 127.0.0.1 (an OS-chosen port) in a thread; nothing leaves the machine.
"""

import json
import socket
import threading
import time

import pytest

from draftsmith.config import ConfigError, load_config
from draftsmith.data_pipeline import regenerate as regen
from draftsmith.data_pipeline.config import DataConfig
from draftsmith.data_pipeline.prepare import prepare
from draftsmith.data_pipeline.regenerate import (
    Answer,
    RuntimeAnswerer,
    ServerAnswerer,
    ServerError,
    TransformersAnswerer,
    answer_seed,
    make_answerer,
    regenerate,
)

MAX_NEW = 6


@pytest.fixture(scope="module")
def target(tiny_llama, chatml):
    return tiny_llama(seed=5, vocab_size=len(chatml))


def conv(question, *answers):
    messages = [{"role": "user", "content": question}]
    for a in answers:
        messages += [{"role": "assistant", "content": a}, {"role": "user", "content": "more"}]
    return {"messages": messages[:-1], "provenance": {"source": "test"}}


CONVERSATIONS = [
    conv("Hi", "Hello"),
    conv("Add", "def add", "again"),
    conv("How are you?", "fine"),
    conv("x", "y", "z", "w"),
    conv("a", "b"),
    conv("Hello", "there"),
]
NUM_BATCHES = 3 + 1 + 1  # batch_size 2: turn 0 has 6 answers, turn 1 two, turn 2 one
KW = dict(max_new_tokens=MAX_NEW, batch_size=2, seed=0, progress=False)


class Recording:
    """Wraps an answerer; counts answered batches; raises KeyboardInterrupt (a kill) after ``kill_after``."""

    def __init__(self, inner, kill_after=None):
        self.inner, self.kill_after, self.batches = inner, kill_after, []

    def identity(self):
        return self.inner.identity()

    def answer(self, prompts, max_new_tokens, temperature, seeds):
        if self.kill_after is not None and len(self.batches) == self.kill_after:
            raise KeyboardInterrupt("simulated kill")
        self.batches.append(seeds)
        return self.inner.answer(prompts, max_new_tokens, temperature, seeds)


def assistant_texts(convs):
    return [[m["content"] for m in c["messages"] if m["role"] == "assistant"] for c in convs]


def test_transformers_and_runtime_answer_alike(target, chatml):
    hf = regenerate(TransformersAnswerer(target, chatml, "tiny"), CONVERSATIONS, **KW)
    rt = regenerate(RuntimeAnswerer(target, chatml, "tiny"), CONVERSATIONS, **KW)
    assert assistant_texts(hf) == assistant_texts(rt) and len(hf) == len(CONVERSATIONS)
    assert assistant_texts(hf) != assistant_texts(CONVERSATIONS)
    for c, original in zip(rt, CONVERSATIONS):
        assert [m["role"] for m in c["messages"]] == [m["role"] for m in original["messages"]]
        assert [m["content"] for m in c["messages"] if m["role"] != "assistant"] == [
            m["content"] for m in original["messages"] if m["role"] != "assistant"
        ]
        assert c["provenance"]["source"] == "test" and c["provenance"]["unfinished"] in (True, False)
        assert c["provenance"]["regenerated_by"] == {
            "engine": "draftsmith",
            "name_or_path": "tiny",
            "revision": None,
            "max_new_tokens": MAX_NEW,
            "temperature": 0.0,
            "seed": 0,
        }
    assert CONVERSATIONS[1]["messages"][1]["content"] == "def add"  # inputs untouched


def test_greedy_rows_leave_the_batch_and_equal_transformers_generate():
    """The greedy loop that drops stopped rows gives ``generate(do_sample=False)``'s tokens, row by row, on the
    reference target with prompts of different lengths whose answers stop at different steps."""
    import torch

    from draftsmith import reference
    from draftsmith.data_pipeline.chat import render_text

    model, tok = reference.target()
    answerer = TransformersAnswerer(model, tok, "reference")
    records = [r for t in reference.tasks(limit=3).values() for r in t]
    prompts = [[m for m in r["messages"] if m["role"] == "user"][:1] for r in records]
    enc = [tok(render_text(tok, m, add_generation_prompt=True), add_special_tokens=False)["input_ids"] for m in prompts]
    width = max(map(len, enc))
    ids = torch.full((len(enc), width), tok.pad_token_id, dtype=torch.long)
    attn = torch.zeros_like(ids)
    for i, e in enumerate(enc):
        ids[i, width - len(e) :], attn[i, width - len(e) :] = torch.tensor(e), 1
    ours = answerer.greedy(ids, attn, 48)
    theirs = model.generate(
        input_ids=ids,
        attention_mask=attn,
        max_new_tokens=48,
        do_sample=False,
        eos_token_id=list(answerer.eos_token_ids),
        pad_token_id=tok.pad_token_id,
    )
    stops = set(answerer.eos_token_ids)
    lengths = set()
    for row, full in zip(ours, theirs[:, width:].tolist()):
        end = next((i + 1 for i, t in enumerate(full) if t in stops), len(full))
        assert row == full[:end]
        lengths.add(len(row))
    assert len(lengths) > 2 and any(n < 48 for n in lengths)  # rows left the batch at different steps


def test_later_turns_see_earlier_regenerated_answers(target, chatml):
    seen = []

    class Spy(RuntimeAnswerer):
        def answer(self, prompts, *args):
            seen.extend(prompts)
            return super().answer(prompts, *args)

    out = regenerate(Spy(target, chatml, "tiny"), [CONVERSATIONS[3]], **KW)
    answers = assistant_texts(out)[0]
    assert [len(p) for p in seen] == [1, 3, 5]
    assert [p[-2]["content"] for p in seen[1:]] == answers[:2]


def test_sampled_answers_follow_their_own_seed(target, chatml):
    sampled = dict(KW, temperature=1.5)
    a = regenerate(RuntimeAnswerer(target, chatml, "tiny"), CONVERSATIONS, **sampled)
    b = regenerate(RuntimeAnswerer(target, chatml, "tiny"), CONVERSATIONS, **{**sampled, "batch_size": 3})
    c = regenerate(RuntimeAnswerer(target, chatml, "tiny"), CONVERSATIONS, **{**sampled, "seed": 1})
    assert assistant_texts(a) == assistant_texts(b) != assistant_texts(c)
    assert answer_seed(0, 1, 0) != answer_seed(0, 0, 1) and 0 <= answer_seed(7, 3, 2) < 2**31


@pytest.mark.parametrize("engine", ["transformers", "draftsmith"])
def test_resume_after_kill_answers_only_the_missing_batches(target, chatml, tmp_path, engine):
    journal = tmp_path / "regenerate.partial.jsonl"
    answerer = make_answerer(engine, target, chatml, "tiny")
    fresh = regenerate(answerer, CONVERSATIONS, **KW, temperature=1.0)

    killed = Recording(answerer, kill_after=3)
    with pytest.raises(KeyboardInterrupt):
        regenerate(killed, CONVERSATIONS, **KW, temperature=1.0, journal=journal)
    lines = journal.read_text().splitlines()
    assert json.loads(lines[0])["format"] == regen.JOURNAL_FORMAT and len(lines) == 1 + 3 * 2
    with open(journal, "a") as f:
        f.write('{"conversation": 5, "turn": 0, "cont')  # a kill in the middle of a write

    resumed = Recording(answerer)
    out = regenerate(resumed, CONVERSATIONS, **KW, temperature=1.0, journal=journal)
    assert len(resumed.batches) == NUM_BATCHES - 3
    assert out == fresh  # same answers, same seeds, same provenance
    again = Recording(answerer)
    assert regenerate(again, CONVERSATIONS, **KW, temperature=1.0, journal=journal) == fresh and not again.batches

    other = Recording(answerer)  # other settings: the journal is not reused
    regenerate(other, CONVERSATIONS, **{**KW, "max_new_tokens": MAX_NEW + 1}, journal=journal)
    assert len(other.batches) == NUM_BATCHES


def test_empty_answers_drop_the_conversation_and_unfinished_ones_are_marked():
    class Scripted:
        def identity(self):
            return {"engine": "test", "name_or_path": "s", "revision": "r1"}

        def answer(self, prompts, max_new_tokens, temperature, seeds):
            return [Answer("" if p[0]["content"] == "a" else "ok", p[0]["content"] == "Hi") for p in prompts]

    out = regenerate(Scripted(), CONVERSATIONS, **KW)
    assert [c["messages"][0]["content"] for c in out] == ["Hi", "Add", "How are you?", "x", "Hello"]
    assert [c["provenance"]["unfinished"] for c in out] == [False, True, True, True, True]
    assert out[0]["provenance"]["regenerated_by"]["revision"] == "r1"
    kept = regenerate(Scripted(), CONVERSATIONS, **KW, drop_unfinished=True)
    assert [c["messages"][0]["content"] for c in kept] == ["Hi"]
    with pytest.raises(ValueError, match="batch_size"):
        regenerate(Scripted(), CONVERSATIONS, **{**KW, "batch_size": 0})


# --------------------------------------------------------------------------------------------- servers


class Loopback:
    """Serve an ASGI app with uvicorn on 127.0.0.1 (an OS-chosen port) in a daemon thread."""

    def __init__(self, app):
        import uvicorn

        self.sock = socket.socket()
        self.sock.bind(("127.0.0.1", 0))
        self.url = f"http://127.0.0.1:{self.sock.getsockname()[1]}"
        self.server = uvicorn.Server(uvicorn.Config(app, log_level="warning"))
        self.thread = threading.Thread(target=self.server.run, kwargs={"sockets": [self.sock]}, daemon=True)

    def __enter__(self):
        self.thread.start()
        for _ in range(500):  # wait for startup (not a timing assertion)
            if self.server.started:
                return self
            time.sleep(0.01)
        raise RuntimeError("loopback server did not start")

    def __exit__(self, *exc):
        self.server.should_exit = True
        self.thread.join()
        self.sock.close()


@pytest.fixture(scope="module")
def draftsmith_server(target, chatml):
    from draftsmith.serve.engine import Engine
    from draftsmith.serve.server import create_app

    with Loopback(create_app(Engine(target, chatml, model_name="tiny-served"))) as server:
        yield server.url


def test_server_engine_on_draftsmith_serve_equals_the_runtime(target, chatml, draftsmith_server):
    answerer = ServerAnswerer(draftsmith_server + "/v1/", "tiny-served", revision="abc123")
    assert answerer.identity() == {
        "engine": "server",
        "url": draftsmith_server,
        "name_or_path": "tiny-served",
        "root": None,
        "revision": "abc123",
    }
    for temperature in (0.0, 1.5):
        served = regenerate(answerer, CONVERSATIONS, **KW, temperature=temperature)
        local = regenerate(RuntimeAnswerer(target, chatml, "tiny"), CONVERSATIONS, **KW, temperature=temperature)
        assert assistant_texts(served) == assistant_texts(local)
        assert [c["provenance"]["unfinished"] for c in served] == [c["provenance"]["unfinished"] for c in local]
    assert served[0]["provenance"]["regenerated_by"]["engine"] == "server"
    assert served[0]["provenance"]["regenerated_by"]["revision"] == "abc123"


@pytest.fixture(scope="module")
def stub_server():
    """A vLLM-shaped stub: two served models (one with a root path); answers echo the request."""
    from fastapi import FastAPI, Request
    from fastapi.responses import JSONResponse

    app, requests = FastAPI(), []

    @app.get("/v1/models")
    async def models():
        return {
            "object": "list",
            "data": [
                {"id": "served-name", "root": "/models/llama-3.1-8b"},
                {"id": "lora-adapter", "root": "/adapters/x"},
            ],
        }

    @app.post("/v1/chat/completions")
    async def chat(request: Request):
        body = await request.json()
        requests.append(body)
        if body["messages"][0]["content"] == "refuse me":
            return JSONResponse(status_code=400, content={"error": {"message": "prompt too long"}})
        text = f"{body['messages'][-1]['content']}|{body['max_tokens']}|{body['seed']}"
        return {
            "choices": [
                {
                    "index": 0,
                    "message": {"role": "assistant", "content": text},
                    "finish_reason": "length" if body["temperature"] > 0 else "stop",
                }
            ]
        }

    with Loopback(app) as server:
        server.requests = requests
        yield server


def test_server_requests_and_model_choice(stub_server):
    answerer = ServerAnswerer(stub_server.url, "/models/llama-3.1-8b")  # matched by vLLM's root
    assert answerer.model == "served-name" and answerer.root == "/models/llama-3.1-8b"
    stub_server.requests.clear()
    out = regenerate(answerer, CONVERSATIONS[:2], **KW)
    assert assistant_texts(out)[0] == [f"Hi|{MAX_NEW}|{answer_seed(0, 0, 0)}"]
    assert all(
        r["model"] == "served-name" and r["temperature"] == 0.0 and r["max_tokens"] == MAX_NEW and r["n"] == 1
        for r in stub_server.requests
    )
    assert not any(c["provenance"]["unfinished"] for c in out)
    sampled = regenerate(answerer, CONVERSATIONS[:1], **KW, temperature=0.7)
    assert sampled[0]["provenance"]["unfinished"]  # finish_reason "length"

    with pytest.raises(ServerError, match="none is 'other-model'"):
        ServerAnswerer(stub_server.url, "other-model")
    with pytest.raises(ServerError, match="answered 400: .*prompt too long"):
        answerer.answer([[{"role": "user", "content": "refuse me"}]], 4, 0.0, [0])
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    closed = f"http://127.0.0.1:{sock.getsockname()[1]}"  # nothing listens there
    sock.close()
    with pytest.raises(ServerError, match="failed"):
        ServerAnswerer(closed, "x", retries=0)


# --------------------------------------------------------------------------------------------- prepare


def test_data_config_server_fields():
    cfg = load_config(DataConfig, None, ["regenerate_engine=server", "regenerate_url=http://127.0.0.1:8000"])
    assert cfg.regenerate_url == "http://127.0.0.1:8000"
    with pytest.raises(ConfigError, match="regenerate_url"):
        load_config(DataConfig, None, ["regenerate_engine=server"])
    with pytest.raises(ConfigError, match="regenerate_url"):
        load_config(DataConfig, None, ["regenerate_url=http://127.0.0.1:8000"])
    with pytest.raises(ConfigError, match="regenerate_engine"):
        load_config(DataConfig, None, ["regenerate_engine=vllm"])


def test_prepare_resumes_a_killed_regeneration_and_finalises(target, chatml, tmp_path, monkeypatch):
    source = tmp_path / "data.jsonl"
    source.write_text("".join(json.dumps(c) + "\n" for c in CONVERSATIONS))
    cfg = DataConfig(
        source=str(source),
        num_conversations=None,
        heldout_conversations=1,
        max_new_tokens=MAX_NEW,
        batch_size=2,
        max_length=64,
        draft_vocab_size=None,
        regenerate_engine="draftsmith",
    )
    fresh = prepare(cfg, target, chatml, "tiny", tmp_path / "fresh")
    assert not (tmp_path / "fresh" / "regenerate.partial.jsonl").exists()

    real = regen.RuntimeAnswerer.answer
    calls, kill_at = [], [3]

    def dies_on_the_third_batch(self, *args):
        calls.append(1)
        if len(calls) in kill_at:
            kill_at.clear()
            raise KeyboardInterrupt("simulated kill")
        return real(self, *args)

    monkeypatch.setattr(regen.RuntimeAnswerer, "answer", dies_on_the_third_batch)
    out = tmp_path / "killed"
    with pytest.raises(KeyboardInterrupt):
        prepare(cfg, target, chatml, "tiny", out)
    assert (out / "regenerate.partial.jsonl").exists() and not (out / "manifest.json").exists()
    calls.clear()
    resumed = prepare(cfg, target, chatml, "tiny", out)
    assert len(calls) == NUM_BATCHES - 2
    assert resumed.conversations == fresh.conversations and resumed.heldout == fresh.heldout
    assert resumed.manifest["files"] == fresh.manifest["files"]
    assert not (out / "regenerate.partial.jsonl").exists()
    assert all(c["provenance"]["regenerated_by"]["engine"] == "draftsmith" for c in resumed.conversations)


def test_folders_prepared_before_the_engine_fields_stay_valid():
    from draftsmith.data_pipeline.prepare import _key_fields

    assert not {"regenerate_engine", "regenerate_url"} & set(_key_fields(DataConfig()))
    assert _key_fields(DataConfig(regenerate_engine="draftsmith"))["regenerate_engine"] == "draftsmith"
