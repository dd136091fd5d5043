"""The server's vLLM request fields: each implemented one reaches the decode loop (the response equals the engine's
for the same settings), ``stop_reason`` and ``include_stop_str_in_output`` follow vLLM, out-of-range values and every
refused field get a 400 naming the field, and no-op values of refused fields are accepted.

Fixtures and helpers are ``test_server.py``'s (a tiny random Llama and a word-level tokenizer).
"""

from __future__ import annotations

import pytest

from conftest import make_tiny_llama
from draftsmith.core.generate import GenerationConfig
from draftsmith.serve.engine import Engine
from draftsmith.serve.server import UNSUPPORTED, create_app
from test_server import NGRAM, PROMPT, V, make_tokenizer, sse


@pytest.fixture(scope="module")
def setup():
    from fastapi.testclient import TestClient

    model = make_tiny_llama(seed=0, vocab_size=V)
    model.generation_config.eos_token_id = 90
    tok = make_tokenizer()
    engine = Engine(model, tok, NGRAM, model_name="tiny")
    with TestClient(create_app(engine)) as client:
        yield engine, tok, client
    engine.close()


def post(client, path="/v1/completions", **body):
    base = {"model": "tiny", "max_tokens": 16, "temperature": 0}
    base |= {"prompt": PROMPT} if path == "/v1/completions" else {"messages": [{"role": "user", "content": PROMPT}]}
    return client.post(path, json=base | body)


FIELDS = {
    "repetition_penalty": dict(repetition_penalty=1.8),
    "frequency_presence": dict(frequency_penalty=1.5, presence_penalty=1.0),
    "min_p_sampled": dict(temperature=1.0, min_p=0.3, seed=3),
    "penalties_sampled": dict(temperature=0.8, repetition_penalty=1.3, seed=4),
}


@pytest.mark.parametrize("field", list(FIELDS))
def test_implemented_fields_reach_the_decode_loop(setup, field):
    engine, tok, client = setup
    body = FIELDS[field]
    r = post(client, **body)
    assert r.status_code == 200, r.text
    cfg = GenerationConfig(max_new_tokens=16, eos_token_ids=engine.eos_token_ids, **body)
    want = engine.generate(tok(PROMPT).input_ids, cfg)
    assert r.json()["choices"][0]["text"] == want.text
    if field == "repetition_penalty":
        plain = engine.generate(tok(PROMPT).input_ids, GenerationConfig(max_new_tokens=16))
        assert want.tokens != plain.tokens  # the field changed the output: the check is not vacuous


def test_ignore_eos_and_min_tokens(setup):
    """An EOS / stop id the model emits early: ignore_eos runs to max_tokens, min_tokens pushes the stop past it."""
    engine, tok, client = setup
    ids = tok(PROMPT).input_ids
    base = engine.generate(ids, GenerationConfig(max_new_tokens=16))
    early = base.tokens[1]
    stopped = post(client, stop_token_ids=[early]).json()["choices"][0]
    assert stopped["finish_reason"] == "stop" and stopped["stop_reason"] == early
    late = post(client, stop_token_ids=[early], min_tokens=8).json()
    want = engine.generate(ids, GenerationConfig(max_new_tokens=16, stop_token_ids=(early,), min_tokens=8))
    assert late["usage"]["completion_tokens"] == len(want.tokens) > 8
    assert late["choices"][0]["text"] == want.text
    eos = Engine(engine.target.model, tok, NGRAM, model_name="tiny")
    eos.eos_token_ids = (early,)  # the model's EOS, as far as this engine knows
    from fastapi.testclient import TestClient

    with TestClient(create_app(eos)) as other:
        stop = post(other).json()["choices"][0]
        assert stop["finish_reason"] == "stop" and stop["stop_reason"] is None  # EOS: null, as vLLM
        run_on = post(other, ignore_eos=True).json()
        assert run_on["choices"][0]["finish_reason"] == "length" and run_on["usage"]["completion_tokens"] == 16
    eos.close()


def test_stop_strings_stop_reason_include_and_min_tokens(setup):
    engine, tok, client = setup
    whole = post(client).json()["choices"][0]["text"]
    words = whole.split()
    stop = words[2]
    cut = post(client, stop=[stop]).json()["choices"][0]
    assert cut["text"] == whole[: whole.find(stop)] and cut["stop_reason"] == stop
    kept = post(client, stop=[stop], include_stop_str_in_output=True).json()["choices"][0]
    assert kept["text"] == whole[: whole.find(stop) + len(stop)] and kept["stop_reason"] == stop
    assert words.index(stop) < 6 and stop not in words[6:]  # (this model, this prompt) so that min_tokens matters
    late = post(client, stop=[stop], min_tokens=6).json()["choices"][0]
    assert late["finish_reason"] == "length" and late["stop_reason"] is None  # the only hit ended too early
    events = sse(
        client,
        "/v1/completions",
        {"model": "tiny", "prompt": PROMPT, "max_tokens": 16, "temperature": 0, "stop": [stop], "stream": True},
    )
    assert events[-1]["choices"][0]["stop_reason"] == stop
    assert all(e["choices"][0]["stop_reason"] is None for e in events[:-1])
    chat = post(client, "/v1/chat/completions", stop=[stop]).json()["choices"][0]
    assert "stop_reason" in chat and chat["message"]["role"] == "assistant"


@pytest.mark.parametrize(
    "body, param",
    [
        (dict(min_p=1.5), "min_p"),
        (dict(repetition_penalty=0), "repetition_penalty"),
        (dict(presence_penalty=2.5), "presence_penalty"),
        (dict(frequency_penalty=-3), "frequency_penalty"),
        (dict(min_tokens=-1), "min_tokens"),
        (dict(min_tokens=17), "min_tokens"),
        (dict(ignore_eos="yes"), "ignore_eos"),
    ],
)
def test_out_of_range_values_get_400_naming_the_field(setup, body, param):
    r = post(setup[2], **body)
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == param and param in r.json()["error"]["message"]


CHAT_ONLY = {"chat_template", "chat_template_kwargs", "continue_final_message", "documents"}
CHAT_ONLY |= {"tools", "tool_choice", "functions", "function_call", "reasoning_effort", "mm_processor_kwargs"}
CHAT_ONLY |= {"media_io_kwargs", "top_logprobs", "return_token_ids"}  # completions return them (vLLM's fields)
REFUSED = {  # one value that would change the output, per refused field
    "best_of": 2,
    "echo": True,
    "logprobs": 0,
    "top_logprobs": 2,
    "prompt_logprobs": 1,
    "logprob_token_ids": [5],
    "logit_bias": {"5": 10},
    "suffix": "w9",
    "tools": [{"type": "function", "function": {"name": "f"}}],
    "tool_choice": "auto",
    "functions": [{"name": "f"}],
    "function_call": "auto",
    "response_format": {"type": "json_object"},
    "bad_words": ["w5"],
    "allowed_token_ids": [5, 6],
    "truncate_prompt_tokens": 4,
    "truncation_side": "left",
    "prompt_embeds": "AAAA",
    "structured_outputs": {"regex": "w5"},
    "guided_json": {"type": "object"},
    "guided_regex": "w5",
    "guided_choice": ["w5"],
    "guided_grammar": "root ::= 'w5'",
    "guided_json_object": True,
    "guided_decoding_backend": "xgrammar",
    "guided_whitespace_pattern": " ",
    "chat_template": "{{ messages }}",
    "chat_template_kwargs": {"enable_thinking": False},
    "continue_final_message": True,
    "documents": [{"text": "w5"}],
    "reasoning_effort": "low",
    "thinking_token_budget": 4,
    "mm_processor_kwargs": {"a": 1},
    "media_io_kwargs": {"a": {}},
    "use_beam_search": True,
    "logits_processors": ["x"],
    "repetition_detection": {"min_pattern_size": 2},
    "return_tokens_as_token_ids": True,
    "return_token_ids": True,
    "return_token_offsets": True,
    "priority": 1,
    "watermarking": True,
    "vllm_xargs": {"a": 1},
}


def test_every_unsupported_field_has_a_refused_value():
    assert set(REFUSED) == set(UNSUPPORTED)


@pytest.mark.parametrize("name", sorted(REFUSED) + ["skip_special_tokens", "stream_options.continuous_usage_stats"])
def test_refused_fields_get_400_naming_them(setup, name):
    client = setup[2]
    path = "/v1/chat/completions" if name in CHAT_ONLY else "/v1/completions"
    if name == "skip_special_tokens":
        body = {name: False}
    elif name == "stream_options.continuous_usage_stats":
        body = {"stream": True, "stream_options": {"include_usage": True, "continuous_usage_stats": True}}
    else:
        body = {name: REFUSED[name]}
    r = post(client, path, **body)
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["param"] == name and name in error["message"] and error["code"] == "unsupported_parameter"


@pytest.mark.parametrize(
    "body",
    [
        dict(logprobs=None, echo=False, best_of=1, logit_bias={}, bad_words=[], priority=0),
        dict(tool_choice="none", add_generation_prompt=True, continue_final_message=False, top_logprobs=0),
        dict(skip_special_tokens=True, spaces_between_special_tokens=False, use_beam_search=False, length_penalty=1.0),
    ],
)
def test_no_op_values_are_accepted(setup, body):
    r = post(setup[2], "/v1/chat/completions", **body)
    assert r.status_code == 200, r.text


def test_add_generation_prompt_false_ends_the_prompt_after_the_last_message(setup):
    engine, tok, client = setup
    messages = [{"role": "user", "content": "w5 w6"}]
    text = tok.apply_chat_template(messages, add_generation_prompt=False, tokenize=False)
    ids = tok(text, add_special_tokens=False).input_ids
    r = post(client, "/v1/chat/completions", messages=messages, add_generation_prompt=False)
    assert r.status_code == 200, r.text
    assert r.json()["usage"]["prompt_tokens"] == len(ids)
    want = engine.generate(ids, GenerationConfig(max_new_tokens=16, eos_token_ids=engine.eos_token_ids))
    assert r.json()["choices"][0]["message"]["content"] == want.text
    with_prompt = post(client, "/v1/chat/completions", messages=messages).json()
    assert with_prompt["usage"]["prompt_tokens"] == len(ids) + 2  # "<|im_start|> assistant"
