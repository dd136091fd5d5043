"""OpenAI-compatible HTTP server around an ``Engine``: completions, chat completions, SSE streaming, metrics.

    draftsmith serve --target reference --speculative-config '{"method": "ngram", "num_speculative_tokens": 4}'
    curl 127.0.0.1:8000/v1/completions -H 'Content-Type: application/json' \\
        -d '{"model": "reference", "prompt": "def f(", "max_tokens": 32}'

Routes: ``POST /v1/completions``, ``POST /v1/chat/completions`` (both with ``"stream": true``: SSE
``data: {...}`` chunks, then ``data: [DONE]``), ``GET /v1/models``, ``GET /v1/models/{id}``, ``POST /tokenize`` and
``POST /detokenize`` (vLLM's shapes), ``GET /health``, ``GET /version`` (draftsmith's), ``GET /metrics``
(Prometheus text).

Request fields: model, prompt (a string, one-string list or token ids) / messages, max_tokens (chat: or
max_completion_tokens), temperature, top_p, seed, stop (string or list), n (must be 1), stream,
stream_options.include_usage, presence_penalty, frequency_penalty, and vLLM's extensions (``vllm/
sampling_params.py``): top_k, min_p, repetition_penalty, min_tokens, ignore_eos, stop_token_ids,
include_stop_str_in_output, skip_special_tokens (true only), spaces_between_special_tokens (no effect: special
tokens are skipped), add_special_tokens, add_generation_prompt (chat). Every choice has vLLM's ``stop_reason``:
the stop string or stop token id that ended it, null for EOS and length. Fields that would change the output
but are not implemented (``UNSUPPORTED``: logprobs, echo, best_of, logit_bias, suffix, tools / tool_choice /
functions, response_format, bad_words, allowed_token_ids, truncate_prompt_tokens, prompt_logprobs, guided_* /
structured_outputs, chat_template / chat_template_kwargs, continue_final_message, beam search, ...) are refused
with a 400 naming the field when set to anything that changes the output; other unknown fields are ignored, as
vLLM does.
Defaults follow OpenAI / vLLM: temperature 1.0, max_tokens = what is left of the context.

A bad request gets a 4xx JSON body ``{"error": {"message", "type", "code", "param"}}``; a well-typed value out of
range (a seed outside int64, a NaN / infinite float, a stop token id outside the vocabulary, a lone UTF-16
surrogate such as JSON ``"\\ud800"``) is a 400, never a 500. An unexpected failure is a 500 that says only
"internal error" and an error id; the exception goes to the log under that id. Before a body is parsed: a POST
must say ``Content-Type: application/json`` (else 400, as vLLM's ``validate_json_request``; ``curl -d`` sends
``application/x-www-form-urlencoded``), and a body over ``max_request_bytes`` is refused with 413. With an API
key, every ``/v1/*``, ``/tokenize`` and ``/detokenize`` request needs ``Authorization: Bearer <key>`` (else 401,
as vLLM's ``--api-key``); ``/health``, ``/version`` and ``/metrics`` stay open (vLLM guards /v1 only).

Requests are decoded together by the engine's scheduler (continuous batching: ``engine.py``, ``scheduler.py``);
tokenizing (chat template and tokenizer) runs on a thread pool and each request waits for its sequence on a
worker thread, so the event loop stays free for /health and /metrics. When ``max_waiting`` requests already
wait, a new one is answered 429 at once. A client that disconnects, streaming or not, cancels its generation:
its row leaves the batch at the next step. On shutdown (SIGTERM, Ctrl+C: ``serve`` / ``make_server``) the engine
is closed first: queued and running requests are answered 503 (a stream ends with an error event and
``[DONE]``), then uvicorn closes the connections (at most ``SHUTDOWN_GRACE_S`` more).
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import logging
import os
import secrets
import socket
import threading
import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from contextlib import asynccontextmanager
from functools import partial
from typing import Any, Literal

import uvicorn
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from pydantic import BaseModel, ConfigDict, Field
from starlette.datastructures import Headers
from starlette.exceptions import HTTPException as StarletteHTTPException

from draftsmith import __version__
from draftsmith.core.generate import GenerationConfig
from draftsmith.serve import DEFAULT_MAX_REQUEST_BYTES
from draftsmith.serve.engine import Engine, EngineClosed, EngineOverloaded, EngineResult, RequestError

logger = logging.getLogger(__name__)

SHUTDOWN_GRACE_S = 5.0  #: after the engine is closed, how long uvicorn waits for connections to finish
INT64_MIN, INT64_MAX = -(2**63), 2**63 - 1  #: the seed range (vLLM's, torch.long)
#: A temperature in (0, MIN_TEMPERATURE) is raised to it, as vLLM does (``_MAX_TEMP``): smaller ones overflow the
#: float32 logits (logits / 1e-300 is inf, softmax NaN) and would fail the whole batch step.
MIN_TEMPERATURE = 1e-2
MAX_REPORTED_ERRORS = 10  #: validation problems named in one 400 (a body can hold thousands)
MAX_ERROR_CHARS = 1000  #: longest error message
JSON_MEDIA_TYPE = "application/json"

# Request fields that would change the output (or the response) but are not implemented, with the values that
# change nothing (compared with their type: logprobs=0 is not logprobs=False). Any other value is refused with a
# 400 naming the field. vLLM's request fields: vllm/entrypoints/openai/{completion,chat_completion}/protocol.py.
UNSUPPORTED = {
    "best_of": (None, 1),
    "echo": (None, False),
    "logprobs": (None, False),
    "top_logprobs": (None, 0),
    "prompt_logprobs": (None,),
    "logprob_token_ids": (None,),
    "logit_bias": (None, {}),
    "suffix": (None, ""),
    "tools": (None, []),
    "tool_choice": (None, "none"),  # without tools (refused above) only "none" changes nothing
    "functions": (None, []),
    "function_call": (None, "none"),
    "response_format": (None, {"type": "text"}),
    "bad_words": (None, []),
    "allowed_token_ids": (None,),
    "truncate_prompt_tokens": (None,),
    "truncation_side": (None,),
    "prompt_embeds": (None,),
    "structured_outputs": (None,),
    "guided_json": (None,),
    "guided_regex": (None,),
    "guided_choice": (None,),
    "guided_grammar": (None,),
    "guided_json_object": (None, False),
    "guided_decoding_backend": (None,),
    "guided_whitespace_pattern": (None,),
    "chat_template": (None,),
    "chat_template_kwargs": (None, {}),
    "continue_final_message": (None, False),
    "documents": (None, []),
    "reasoning_effort": (None,),
    "thinking_token_budget": (None,),
    "mm_processor_kwargs": (None, {}),
    "media_io_kwargs": (None, {}),
    "use_beam_search": (None, False),
    "logits_processors": (None, []),
    "repetition_detection": (None,),
    "return_tokens_as_token_ids": (None, False),
    "return_token_ids": (None, False),
    "return_token_offsets": (None, False),
    "priority": (None, 0),
    "watermarking": (None, False),
    "vllm_xargs": (None, {}),
}


def _is_noop(value: Any, noops: tuple) -> bool:
    """True when ``value`` equals one of ``noops`` with the same type (``0`` is not ``False``)."""
    return any(value is x or (type(value) is type(x) and value == x) for x in noops)


class APIError(Exception):
    """An error answered as ``{"error": {...}}`` with ``status``."""

    def __init__(
        self, status: int, message: str, code: str, param: str | None = None, type: str = "invalid_request_error"
    ):
        super().__init__(message)
        self.status, self.message, self.code, self.param, self.type = status, message, code, param, type


def _error_body(
    message: str, code: str, param: str | None = None, type: str = "invalid_request_error"
) -> dict[str, dict[str, str | None]]:
    """``{"error": {...}}`` with text that always encodes: a lone surrogate a client sent (echoed in a message or
    a field name) becomes ``\\udXXX``, so rendering the error cannot fail in its turn."""

    def safe(text: str | None) -> str | None:
        return None if text is None else str(text).encode("utf-8", "backslashreplace").decode("utf-8")

    message = safe(message)
    if len(message) > MAX_ERROR_CHARS:
        message = message[:MAX_ERROR_CHARS] + " ...[truncated]"
    return {"error": {"message": message, "type": type, "code": code, "param": safe(param)}}


def _error_response(
    status: int,
    message: str,
    code: str,
    param: str | None = None,
    type: str = "invalid_request_error",
    headers: dict[str, str] | None = None,
) -> JSONResponse:
    return JSONResponse(status_code=status, content=_error_body(message, code, param, type), headers=headers)


class StreamOptions(BaseModel):
    model_config = ConfigDict(strict=True, extra="ignore")
    include_usage: bool = False
    continuous_usage_stats: bool = False  # vLLM's extension: refused when true (not implemented)


class _SamplingRequest(BaseModel):
    """Fields shared by both endpoints; strict types (a string is not a number). vLLM's sampling extensions
    (``vllm/sampling_params.py``) with its ranges: min_p, repetition_penalty, presence / frequency_penalty,
    min_tokens, ignore_eos, include_stop_str_in_output, skip_special_tokens (true only)."""

    model_config = ConfigDict(strict=True, extra="allow")
    model: str | None = None
    max_tokens: int | None = Field(None, ge=1)
    temperature: float | None = Field(None, ge=0.0, allow_inf_nan=False)
    top_p: float | None = Field(None, gt=0.0, le=1.0, allow_inf_nan=False)
    top_k: int | None = Field(None, ge=-1)  # vLLM: -1 or 0 disables
    min_p: float | None = Field(None, ge=0.0, le=1.0)
    repetition_penalty: float | None = Field(None, gt=0.0, allow_inf_nan=False)
    presence_penalty: float | None = Field(None, ge=-2.0, le=2.0)
    frequency_penalty: float | None = Field(None, ge=-2.0, le=2.0)
    min_tokens: int = Field(0, ge=0)
    ignore_eos: bool = False
    seed: int | None = Field(None, ge=INT64_MIN, le=INT64_MAX)
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True  # only shapes special tokens' text, which is always skipped
    n: int = 1
    stream: bool = False
    stream_options: StreamOptions | None = None


class CompletionRequest(_SamplingRequest):
    prompt: str | list[int] | list[str]
    add_special_tokens: bool = True  # vLLM's default for completions
    return_token_ids: bool = False  # vLLM's: the choice also carries prompt_token_ids and token_ids (not streamed)


class TextPart(BaseModel):
    model_config = ConfigDict(strict=True, extra="ignore")
    type: Literal["text"]
    text: str


class ChatMessage(BaseModel):
    model_config = ConfigDict(strict=True, extra="allow")
    role: str
    content: str | list[TextPart] | None = None


class ChatCompletionRequest(_SamplingRequest):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = Field(None, ge=1)
    add_special_tokens: bool = False  # vLLM's default for chat: the template adds them
    add_generation_prompt: bool = True  # False: the template's text ends after the last message (vLLM's field)


def _unsupported(name: str, value: Any) -> APIError:
    return APIError(400, f"{name}={value!r} is not supported by this server", "unsupported_parameter", name)


class TokenizeRequest(BaseModel):
    """vLLM's ``/tokenize`` body: its ``TokenizeCompletionRequest`` (``prompt``) or ``TokenizeChatRequest``
    (``messages``, rendered by the chat template); ``add_special_tokens`` defaults to True for a prompt and to
    False for messages (the template adds them), as vLLM's."""

    model_config = ConfigDict(strict=True, extra="allow")
    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = Field(None, min_length=1)
    add_special_tokens: bool | None = None
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    return_token_strs: bool = False


class DetokenizeRequest(BaseModel):
    """vLLM's ``/detokenize`` body."""

    model_config = ConfigDict(strict=True, extra="allow")
    model: str | None = None
    tokens: list[int]


def _check_model(model: str | None, engine: Engine) -> None:
    """404 for a ``model`` this server does not serve (None: the served one)."""
    if model is not None and model != engine.model_name:
        raise APIError(
            404,
            f"the model {model!r} does not exist; this server serves {engine.model_name!r}",
            "model_not_found",
            "model",
        )


def _check_unicode(value: Any, param: str) -> None:
    """400 for a string holding a lone UTF-16 surrogate (JSON ``"\\ud800"`` without its pair): it is no Unicode
    text, and the tokenizer would fail on it. Walks lists, dicts and request models."""
    if isinstance(value, str):
        try:
            value.encode("utf-8")
        except UnicodeEncodeError as e:
            raise APIError(
                400,
                f"{param} holds a lone UTF-16 surrogate (\\u{ord(value[e.start]):04x} at character {e.start}), which "
                f"is not valid Unicode; send UTF-8 text (a JSON \\ud83d\\ude00 escape must come as the whole pair)",
                "invalid_unicode",
                param,
            ) from None
    elif isinstance(value, BaseModel):
        for name in type(value).model_fields:
            _check_unicode(getattr(value, name), f"{param}.{name}")
    elif isinstance(value, dict):
        for key, item in value.items():
            _check_unicode(item, f"{param}.{key}")
    elif isinstance(value, list) and value and not isinstance(value[0], int):
        for i, item in enumerate(value):
            _check_unicode(item, f"{param}.{i}")


def _check_request_text(req: BaseModel) -> None:
    """``_check_unicode`` over the request's declared fields (unknown fields are ignored, so never read)."""
    for name in type(req).model_fields:
        _check_unicode(getattr(req, name), name)


def _check_common(req: _SamplingRequest, engine: Engine) -> None:
    """Model name, n, the unsupported parameters, stop token ids inside the vocabulary."""
    _check_model(req.model, engine)
    vocab_size = engine.target.vocab_size
    bad = [t for t in req.stop_token_ids or () if not 0 <= t < vocab_size]
    if bad:
        raise APIError(
            400,
            f"stop_token_ids {bad[:5]} are outside the vocabulary [0, {vocab_size})",
            "invalid_request",
            "stop_token_ids",
        )
    if req.n != 1:
        raise APIError(400, f"n must be 1 (one sequence per request), got {req.n}", "unsupported_parameter", "n")
    for name, value in (req.model_extra or {}).items():
        if name in UNSUPPORTED and not _is_noop(value, UNSUPPORTED[name]):
            raise _unsupported(name, value)
    if not req.skip_special_tokens:
        raise _unsupported("skip_special_tokens", False)
    if req.stream_options is not None and req.stream_options.continuous_usage_stats:
        raise _unsupported("stream_options.continuous_usage_stats", True)


def _generation_config(
    req: _SamplingRequest, engine: Engine, prompt_ids: list[int], max_tokens: int | None
) -> GenerationConfig:
    """Decoding settings; max_tokens defaults to what the context leaves (checked by the engine).

    Raises:
        APIError: 400 for a prompt the engine refuses, or settings ``GenerationConfig`` refuses (min_tokens above
            max_tokens, a non-finite penalty), naming the field.
    """
    if max_tokens is None:
        max_tokens = max(1, engine.max_model_len - len(prompt_ids))
    try:
        engine.check_prompt(prompt_ids, max_tokens)
    except RequestError as e:
        raise APIError(400, str(e), e.code, e.param) from None
    if req.min_tokens > max_tokens:
        raise APIError(
            400, f"min_tokens ({req.min_tokens}) must be <= max_tokens ({max_tokens})", "invalid_request", "min_tokens"
        )
    top_k = req.top_k if req.top_k and req.top_k > 0 else None
    try:
        return GenerationConfig(
            max_new_tokens=max_tokens,
            temperature=_temperature(req.temperature),
            top_k=top_k,
            top_p=req.top_p,
            min_p=req.min_p or 0.0,
            repetition_penalty=1.0 if req.repetition_penalty is None else req.repetition_penalty,
            presence_penalty=req.presence_penalty or 0.0,
            frequency_penalty=req.frequency_penalty or 0.0,
            min_tokens=req.min_tokens,
            ignore_eos=req.ignore_eos,
            seed=req.seed,
            eos_token_ids=engine.eos_token_ids,
            stop_token_ids=tuple(req.stop_token_ids or ()),
        )
    except ValueError as e:
        param = next((f for f in ("repetition_penalty", "min_p", "min_tokens") if f in str(e)), None)
        raise APIError(400, str(e), "invalid_request", param) from None


def _temperature(value: float | None) -> float:
    """The request's temperature: 1.0 when unset, 0 (greedy) kept, (0, MIN_TEMPERATURE) raised to it (logged)."""
    if value is None:
        return 1.0
    if 0.0 < value < MIN_TEMPERATURE:
        logger.warning(
            "temperature %g is below %g, which overflows the logits; using %g", value, MIN_TEMPERATURE, MIN_TEMPERATURE
        )
        return MIN_TEMPERATURE
    return value


def _stops(req: _SamplingRequest) -> dict:
    """The engine's text rules (``Engine.generate`` keywords): stop strings and include_stop_str_in_output."""
    stop = (req.stop,) if isinstance(req.stop, str) else tuple(req.stop or ())
    return {"stop": stop, "include_stop_str_in_output": req.include_stop_str_in_output}


def _token_ids(prompt_ids: list[int], result) -> dict:
    """vLLM's ``return_token_ids`` fields of a completion choice: the prompt's and the output's token ids."""
    return {"prompt_token_ids": list(prompt_ids), "token_ids": list(result.tokens)}


def _completion_prompt(req: CompletionRequest, engine: Engine) -> list[int]:
    """The prompt's token ids (a string is tokenized). Slow for a long prompt: run it off the event loop.

    Raises:
        APIError: 400 for a list of several prompts, or text that is not valid Unicode."""
    _check_request_text(req)
    prompt = req.prompt
    if isinstance(prompt, list) and prompt and isinstance(prompt[0], str):
        if len(prompt) != 1:
            raise APIError(
                400, f"one prompt per request (got a list of {len(prompt)})", "unsupported_parameter", "prompt"
            )
        prompt = prompt[0]
    if isinstance(prompt, str):
        return list(engine.tokenizer(prompt, add_special_tokens=req.add_special_tokens).input_ids)
    return list(prompt)


def _chat_prompt(
    req: ChatCompletionRequest | TokenizeRequest,
    engine: Engine,
    add_generation_prompt: bool = True,
    continue_final_message: bool = False,
    add_special_tokens: bool = False,
) -> list[int]:
    """The messages rendered by the tokenizer's chat template, tokenized. Slow for long messages: run it off the
    event loop.

    Raises:
        APIError: 400 without a chat template, for messages the template refuses, or text that is not valid
            Unicode."""
    _check_request_text(req)
    tokenizer = engine.tokenizer
    if not getattr(tokenizer, "chat_template", None):
        raise APIError(
            400, "this model's tokenizer has no chat template; use /v1/completions", "no_chat_template", "messages"
        )
    messages = []
    for m in req.messages:
        content = m.content if not isinstance(m.content, list) else "".join(p.text for p in m.content)
        messages.append({"role": m.role, "content": content or ""})
    try:
        text = tokenizer.apply_chat_template(
            messages,
            add_generation_prompt=add_generation_prompt,
            continue_final_message=continue_final_message,
            tokenize=False,
        )
    except Exception as e:  # noqa: BLE001 - a template's raise_exception (e.g. roles must alternate)
        raise APIError(400, f"the chat template refused the messages: {e}", "invalid_messages", "messages") from None
    return list(tokenizer(text, add_special_tokens=add_special_tokens).input_ids)


def _usage(result: EngineResult) -> dict:
    n = len(result.tokens)
    return {"prompt_tokens": result.prompt_tokens, "completion_tokens": n, "total_tokens": result.prompt_tokens + n}


def _sse(payload: Any) -> str:
    return f"data: {json.dumps(payload)}\n\n"


class _CatchInternalErrors:
    """ASGI middleware inside the error handlers' reach: an exception no handler answered becomes a 500 saying only
    "internal error" and an error id; the exception and its traceback go to the log under that id (never to the
    client: its text may hold paths, tensor shapes, other requests' data)."""

    def __init__(self, app):
        self.app = app

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        started = False

        async def watch(message):
            nonlocal started
            if message["type"] == "http.response.start":
                started = True
            await send(message)

        try:
            await self.app(scope, receive, watch)
        except Exception:  # the last boundary: log, answer without internals
            error_id = uuid.uuid4().hex[:16]
            logger.exception("%s %s failed (error id %s)", scope.get("method"), scope.get("path"), error_id)
            if not started:
                response = _error_response(
                    500,
                    f"internal error (error id {error_id}; the server log has the details)",
                    "internal_error",
                    type="internal_server_error",
                )
                await response(scope, receive, send)


class _RequestGate:
    """ASGI middleware run before a body is parsed: a POST must be ``Content-Type: application/json`` (400 otherwise,
    as vLLM's ``validate_json_request``), and a body over ``max_bytes`` is refused with 413, by its Content-Length
    before reading anything, or once the bytes read pass the limit (chunked uploads). The body is read here and
    handed on whole; after it the app's ``receive`` sees the connection's own messages (a client's disconnect)."""

    def __init__(self, app, max_bytes: int):
        self.app, self.max_bytes = app, max_bytes

    def _too_large(self, size: str) -> JSONResponse:
        return _error_response(
            413,
            f"the request body is {size} bytes, over this server's limit of {self.max_bytes} bytes "
            f"(draftsmith serve --max-request-bytes); send a shorter prompt",
            "request_too_large",
        )

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http" or scope["method"] in ("GET", "HEAD", "OPTIONS"):
            return await self.app(scope, receive, send)
        headers = Headers(scope=scope)
        content_type = headers.get("content-type")
        media_type = (content_type or "").split(";", 1)[0].strip().lower()
        if scope["method"] == "POST" and media_type != JSON_MEDIA_TYPE:
            got = f"Content-Type {content_type!r}" if content_type else "no Content-Type"
            response = _error_response(
                400,
                f"the request body must be JSON sent with Content-Type: application/json (got {got}); "
                f"with curl add -H 'Content-Type: application/json' (-d alone sends application/x-www-form-urlencoded)",
                "unsupported_media_type",
            )
            return await response(scope, receive, send)
        length = headers.get("content-length")
        if length is not None and length.isdigit() and int(length) > self.max_bytes:
            return await self._too_large(length)(scope, receive, send)
        chunks, size = [], 0
        while True:
            message = await receive()
            if message["type"] != "http.request":  # the client went away while sending
                return
            chunks.append(message.get("body", b""))
            size += len(chunks[-1])
            if size > self.max_bytes:
                return await self._too_large(f"at least {size}")(scope, receive, send)
            if not message.get("more_body", False):
                break
        whole = [{"type": "http.request", "body": b"".join(chunks), "more_body": False}]

        async def replay():
            return whole.pop() if whole else await receive()

        await self.app(scope, replay, send)


def _guarded(path: str) -> bool:
    """Paths that need the API key: ``/v1/*`` (as vLLM), ``/tokenize`` and ``/detokenize`` (vLLM leaves those two
    open; here they are guarded too: they tokenize bodies of megabytes on this server's CPU)."""
    return path == "/v1" or path.startswith("/v1/") or path in ("/tokenize", "/detokenize")


class _ApiKeyGate:
    """ASGI middleware: a guarded path (``_guarded``) without ``Authorization: Bearer <key>`` gets 401 (OPTIONS
    preflights pass, as vLLM's ``AuthenticationMiddleware``). Keys are compared as SHA-256 digests in constant time."""

    def __init__(self, app, api_key: str):
        self.app = app
        self.digest = hashlib.sha256(api_key.encode("utf-8")).digest()

    def _authorized(self, headers: Headers) -> bool:
        scheme, _, token = headers.get("authorization", "").partition(" ")
        if scheme.lower() != "bearer":
            return False
        return secrets.compare_digest(hashlib.sha256(token.strip().encode("utf-8", "replace")).digest(), self.digest)

    async def __call__(self, scope, receive, send):
        if (
            scope["type"] == "http"
            and scope.get("method") != "OPTIONS"
            and _guarded(scope["path"].removeprefix(scope.get("root_path", "")))
            and not self._authorized(Headers(scope=scope))
        ):
            response = _error_response(
                401,
                "missing or wrong API key: send the header 'Authorization: Bearer <key>' with the key the server "
                "was started with (--api-key or DRAFTSMITH_API_KEY)",
                "invalid_api_key",
                headers={"WWW-Authenticate": "Bearer"},
            )
            return await response(scope, receive, send)
        await self.app(scope, receive, send)


async def _until_disconnected(request: Request) -> None:
    """Return once the client of ``request`` disconnected (its body already read, as vLLM's
    ``listen_for_disconnect``: every later message of a request is its disconnect)."""
    while (await request.receive())["type"] != "http.disconnect":
        pass


class ClientDisconnected(Exception):
    """The client of a non-streaming request went away before its answer (its generation was cancelled)."""


def create_app(
    engine: Engine, *, api_key: str | None = None, max_request_bytes: int = DEFAULT_MAX_REQUEST_BYTES
) -> FastAPI:
    """The FastAPI app serving ``engine``: every request waits for its sequence on a worker thread while the
    engine's scheduler decodes them together; tokenizing runs on a small thread pool.

    Args:
        engine: what serves the requests. api_key: when set, ``/v1/*``, ``/tokenize`` and ``/detokenize`` need
            ``Authorization: Bearer <api_key>`` (401 otherwise). max_request_bytes: larger bodies get 413.

    Raises:
        ValueError: an empty api_key, or max_request_bytes < 1.

    ``app.state.drain()`` (awaited by ``make_server`` when the server shuts down) closes the engine: queued and
    running requests are answered 503.
    """
    if api_key is not None and not api_key:
        raise ValueError("api_key is empty; pass a key, or None for no authentication")
    if max_request_bytes < 1:
        raise ValueError(f"max_request_bytes must be >= 1, got {max_request_bytes}")
    scheduler = engine.scheduler
    worker = ThreadPoolExecutor(
        max_workers=scheduler.max_waiting + scheduler.decoder.max_num_seqs + 4, thread_name_prefix="draftsmith-request"
    )
    # tokenizers' Rust encode_batch (what tokenizer(text) calls) releases the GIL: a long prompt tokenizes while
    # the event loop answers /health; a few threads so one 4 MB prompt does not hold up every other request
    tokenize_pool = ThreadPoolExecutor(
        max_workers=max(2, min(4, os.cpu_count() or 1)), thread_name_prefix="draftsmith-tokenize"
    )

    async def off_loop(fn, *args, **kwargs):
        """``fn(*args, **kwargs)`` on the tokenizing pool (chat template, tokenizer, prompt checks)."""
        return await asyncio.get_running_loop().run_in_executor(tokenize_pool, partial(fn, *args, **kwargs))

    def overloaded(message: str) -> APIError:
        return APIError(429, message, "too_many_requests", None, "rate_limit_error")

    def shutting_down(message: str = "the server is shutting down; retry the request on another replica") -> APIError:
        return APIError(503, message, "server_shutting_down", None, "service_unavailable_error")

    def check_capacity() -> None:
        """Refuse before any byte is sent (a stream's status is final once it starts)."""
        if scheduler.closed:
            raise shutting_down()
        if scheduler.num_waiting >= scheduler.max_waiting:
            raise overloaded(
                f"the server is at capacity: {scheduler.num_running} requests running and {scheduler.num_waiting} "
                f"waiting (max_waiting={scheduler.max_waiting}); retry later"
            )

    async def drain() -> None:
        if not scheduler.closed and (scheduler.num_running or scheduler.num_waiting):
            logger.warning(
                "shutting down: answering %d running and %d waiting requests with 503",
                scheduler.num_running,
                scheduler.num_waiting,
            )
        await asyncio.get_running_loop().run_in_executor(None, engine.close)

    @asynccontextmanager
    async def lifespan(app):
        yield
        worker.shutdown(wait=False, cancel_futures=True)
        tokenize_pool.shutdown(wait=False, cancel_futures=True)

    app = FastAPI(title="draftsmith", version=__version__, lifespan=lifespan)
    app.state.engine = engine
    app.state.drain = drain
    app.add_middleware(_CatchInternalErrors)
    app.add_middleware(_RequestGate, max_bytes=max_request_bytes)
    if api_key is not None:
        app.add_middleware(_ApiKeyGate, api_key=api_key)

    @app.exception_handler(APIError)
    async def api_error(request: Request, e: APIError):
        return _error_response(e.status, e.message, e.code, e.param, e.type)

    @app.exception_handler(ClientDisconnected)
    async def client_disconnected(request: Request, e: ClientDisconnected):
        # nginx's 499 (client closed request): nobody reads it, the access log shows what happened
        return _error_response(499, "the client disconnected; its generation was cancelled", "client_disconnected")

    @app.exception_handler(RequestValidationError)
    async def validation_error(request: Request, e: RequestValidationError):
        errors = e.errors()
        problems = []
        for err in errors[:MAX_REPORTED_ERRORS]:
            loc = ".".join(str(x) for x in err.get("loc", ()) if x != "body")
            problems.append(f"{loc}: {err.get('msg')}" if loc else str(err.get("msg")))
        if len(errors) > MAX_REPORTED_ERRORS:
            problems.append(f"... {len(errors) - MAX_REPORTED_ERRORS} more")
        first = errors[0].get("loc", ()) if errors else ()
        param = ".".join(str(x) for x in first if x != "body") or None
        return _error_response(400, "; ".join(problems) or "invalid request", "invalid_request", param)

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request: Request, e: StarletteHTTPException):
        return _error_response(e.status_code, str(e.detail), "not_found" if e.status_code == 404 else "http_error")

    async def run(prompt_ids, cfg, stop, on_text=None, cancel=None, request: Request | None = None) -> EngineResult:
        """Generate on a worker thread. With ``request`` (a non-streaming one), a client that disconnects first
        cancels the generation (its row leaves the batch at the next step) and ``ClientDisconnected`` is raised.

        Raises:
            APIError: 429 (queue full), 503 (the engine was closed). ClientDisconnected."""
        cancel = cancel or threading.Event()
        call = partial(
            engine.generate, prompt_ids, cfg, **stop, on_text=on_text, cancel=cancel, arrival=time.perf_counter()
        )
        job = asyncio.get_running_loop().run_in_executor(worker, call)
        try:
            if request is not None:
                gone = asyncio.ensure_future(_until_disconnected(request))
                try:
                    await asyncio.wait({job, gone}, return_when=asyncio.FIRST_COMPLETED)
                finally:
                    gone.cancel()
                if not job.done():
                    job.add_done_callback(lambda f: f.cancelled() or f.exception())  # ends RequestCancelled: dropped
                    raise ClientDisconnected
            return await job
        except EngineOverloaded as e:
            raise overloaded(str(e)) from None
        except EngineClosed as e:
            raise shutting_down(f"the server is shutting down: {e}; retry the request") from None
        finally:
            cancel.set()  # a request whose client went away (the await was cancelled) leaves the batch

    def stream_error(e: BaseException) -> dict:
        """The error event of a stream whose headers are sent: an ``APIError``'s own body, else 'internal error'."""
        if isinstance(e, APIError):
            return _error_body(e.message, e.code, e.param, e.type)
        error_id = uuid.uuid4().hex[:16]
        logger.error("a streamed generation failed (error id %s)", error_id, exc_info=e)
        return _error_body(
            f"internal error (error id {error_id}; the server log has the details)",
            "internal_error",
            type="internal_server_error",
        )

    def stream(prompt_ids, cfg, stop, chunk, first: list | None, include_usage: bool):
        """SSE body: ``chunk(delta_text, finish_reason, stop_reason=...)`` payloads, an optional usage chunk,
        [DONE]."""

        async def events():
            loop = asyncio.get_running_loop()
            queue: asyncio.Queue = asyncio.Queue()
            cancel = threading.Event()
            on_text = engine.to_loop(loop, queue.put_nowait)  # a step's text leaves at its end
            job = asyncio.ensure_future(run(prompt_ids, cfg, stop, on_text, cancel))

            def done(task):
                if not task.cancelled():
                    task.exception()  # retrieved here, reported below (or dropped: client gone)
                queue.put_nowait(None)

            job.add_done_callback(done)
            try:
                for payload in first or ():
                    yield _sse(payload)
                while (delta := await queue.get()) is not None:
                    yield _sse(chunk(delta, None))
                try:
                    result = job.result()
                except Exception as e:  # noqa: BLE001 - headers are sent: report in the stream
                    yield _sse(stream_error(e))
                else:
                    yield _sse(chunk(None, result.finish_reason, stop_reason=result.stop_reason))
                    if include_usage:
                        yield _sse(chunk(None, None, usage=_usage(result)))
                yield "data: [DONE]\n\n"
            finally:
                cancel.set()  # a client that went away stops its generation at the next chunk

        check_capacity()
        return StreamingResponse(events(), media_type="text/event-stream", headers={"Cache-Control": "no-cache"})

    @app.post("/v1/completions")
    async def completions(req: CompletionRequest, request: Request):
        _check_common(req, engine)
        prompt_ids = await off_loop(_completion_prompt, req, engine)
        cfg = await off_loop(_generation_config, req, engine, prompt_ids, req.max_tokens)
        rid, created = f"cmpl-{uuid.uuid4().hex}", int(time.time())
        base = {"id": rid, "object": "text_completion", "created": created, "model": engine.model_name}
        if req.stream and req.return_token_ids:
            raise _unsupported("return_token_ids", "with stream")
        if req.stream:

            def chunk(text, finish_reason, usage=None, stop_reason=None):
                if usage is not None:
                    return base | {"choices": [], "usage": usage}
                choice = {"index": 0, "text": text or "", "logprobs": None, "finish_reason": finish_reason}
                return base | {"choices": [choice | {"stop_reason": stop_reason}]}

            include_usage = bool(req.stream_options and req.stream_options.include_usage)
            return stream(prompt_ids, cfg, _stops(req), chunk, None, include_usage)
        result = await run(prompt_ids, cfg, _stops(req), request=request)
        return base | {
            "choices": [
                {
                    "index": 0,
                    "text": result.text,
                    "logprobs": None,
                    "finish_reason": result.finish_reason,
                    "stop_reason": result.stop_reason,
                    **(
                        {"prompt_token_ids": prompt_ids, "token_ids": list(result.tokens)}
                        if req.return_token_ids
                        else {}
                    ),
                }
            ],
            "usage": _usage(result),
        }

    @app.post("/v1/chat/completions")
    async def chat_completions(req: ChatCompletionRequest, request: Request):
        _check_common(req, engine)
        prompt_ids = await off_loop(_chat_prompt, req, engine, req.add_generation_prompt, False, req.add_special_tokens)
        max_tokens = req.max_completion_tokens if req.max_completion_tokens is not None else req.max_tokens
        cfg = await off_loop(_generation_config, req, engine, prompt_ids, max_tokens)
        rid, created = f"chatcmpl-{uuid.uuid4().hex}", int(time.time())
        if req.stream:
            base = {"id": rid, "object": "chat.completion.chunk", "created": created, "model": engine.model_name}

            def chunk(text, finish_reason, usage=None, stop_reason=None):
                if usage is not None:
                    return base | {"choices": [], "usage": usage}
                delta = {} if text is None else {"content": text}
                choice = {"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish_reason}
                return base | {"choices": [choice | {"stop_reason": stop_reason}]}

            first = [
                base
                | {
                    "choices": [
                        {
                            "index": 0,
                            "delta": {"role": "assistant", "content": ""},
                            "logprobs": None,
                            "finish_reason": None,
                            "stop_reason": None,
                        }
                    ]
                }
            ]
            include_usage = bool(req.stream_options and req.stream_options.include_usage)
            return stream(prompt_ids, cfg, _stops(req), chunk, first, include_usage)
        result = await run(prompt_ids, cfg, _stops(req), request=request)
        return {
            "id": rid,
            "object": "chat.completion",
            "created": created,
            "model": engine.model_name,
            "choices": [
                {
                    "index": 0,
                    "message": {"role": "assistant", "content": result.text},
                    "logprobs": None,
                    "finish_reason": result.finish_reason,
                    "stop_reason": result.stop_reason,
                }
            ],
            "usage": _usage(result),
        }

    def model_card() -> dict:
        spec = engine.spec
        return {
            "id": engine.model_name,
            "object": "model",
            "created": 0,
            "owned_by": "draftsmith",
            "max_model_len": engine.max_model_len,
            "speculative_config": None if spec is None else spec.to_dict(),
        }

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [model_card()]}

    @app.get("/v1/models/{model_id:path}")
    async def model(model_id: str):
        _check_model(model_id, engine)
        return model_card()

    @app.post("/tokenize")
    async def tokenize(req: TokenizeRequest):
        """vLLM's /tokenize: ``{count, max_model_len, tokens, token_strs}`` of a prompt or of chat messages."""
        _check_model(req.model, engine)
        if (req.prompt is None) == (req.messages is None):
            raise APIError(400, "send exactly one of 'prompt' (a string) or 'messages'", "invalid_request", "prompt")
        if req.messages is not None:
            generation = req.add_generation_prompt
            if req.continue_final_message and "add_generation_prompt" not in req.model_fields_set:
                generation = False
            if req.continue_final_message and generation:
                raise APIError(
                    400,
                    "cannot set both continue_final_message and add_generation_prompt to true",
                    "invalid_request",
                    "continue_final_message",
                )
            special = bool(req.add_special_tokens)
            ids = await off_loop(_chat_prompt, req, engine, generation, req.continue_final_message, special)
        else:
            special = req.add_special_tokens is not False

            def encode() -> list[int]:
                _check_request_text(req)
                return list(engine.tokenizer(req.prompt, add_special_tokens=special).input_ids)

            ids = await off_loop(encode)
        strs = await off_loop(engine.tokenizer.convert_ids_to_tokens, ids) if req.return_token_strs else None
        return {"count": len(ids), "max_model_len": engine.max_model_len, "tokens": ids, "token_strs": strs}

    @app.post("/detokenize")
    async def detokenize(req: DetokenizeRequest):
        """vLLM's /detokenize: ``{prompt}``, the text of token ids (special tokens kept, as vLLM's)."""
        _check_model(req.model, engine)
        vocab_size = engine.target.vocab_size
        bad = [t for t in req.tokens if not 0 <= t < vocab_size]
        if bad:
            raise APIError(
                400, f"token ids {bad[:5]} are outside the vocabulary [0, {vocab_size})", "invalid_tokens", "tokens"
            )
        return {"prompt": await off_loop(engine.tokenizer.decode, req.tokens)}

    @app.get("/health")
    async def health():
        if scheduler.closed:
            return JSONResponse(status_code=503, content={"status": "shutting down"})
        return {"status": "ok"}

    @app.get("/version")
    async def version():
        return {"version": __version__}

    @app.get("/metrics")
    async def metrics(request: Request):
        names = request.query_params.getlist("name[]")  # only these samples (prometheus_client's query)
        return Response(engine.metrics.render(names), media_type=engine.metrics.content_type)

    return app


class _DrainingServer(uvicorn.Server):
    """uvicorn's server whose shutdown (SIGTERM, Ctrl+C, ``should_exit``) first awaits ``drain`` (the app's
    ``state.drain``: close the engine, so requests still waiting on it are answered 503), then does uvicorn's."""

    def __init__(self, config: uvicorn.Config, drain):
        super().__init__(config)
        self.drain = drain

    async def shutdown(self, sockets=None) -> None:
        if self.drain is not None:
            try:
                await self.drain()
            except Exception:  # noqa: BLE001 - a failing drain must not keep the process up
                logger.exception("closing the engine failed; shutting down anyway")
        await super().shutdown(sockets)


def make_server(app, host: str = "127.0.0.1", port: int = 8000, log_level: str = "info") -> uvicorn.Server:
    """A uvicorn ``Server`` for ``app`` that shuts down gracefully: on SIGTERM / Ctrl+C / ``should_exit`` it first
    closes the engine (``app.state.drain``: queued and running requests are answered 503, streams end with an error
    event and [DONE]), then stops accepting and waits at most ``SHUTDOWN_GRACE_S`` for connections to finish."""
    config = uvicorn.Config(
        app, host=host, port=port, log_level=log_level, lifespan="on", timeout_graceful_shutdown=SHUTDOWN_GRACE_S
    )
    state = getattr(app, "state", None)
    return _DrainingServer(config, getattr(state, "drain", None))


def serve(
    engine: Engine,
    host: str = "127.0.0.1",
    port: int = 8000,
    log_level: str = "info",
    *,
    api_key: str | None = None,
    max_request_bytes: int = DEFAULT_MAX_REQUEST_BYTES,
) -> None:
    """Run the server with uvicorn until SIGTERM / Ctrl+C (binds 127.0.0.1 unless told otherwise), then shut down
    gracefully (``make_server``). ``api_key``, ``max_request_bytes``: as ``create_app``.

    Raises:
        ValueError: as ``create_app``."""
    app = create_app(engine, api_key=api_key, max_request_bytes=max_request_bytes)
    make_server(app, host=host, port=port, log_level=log_level).run()


class BackgroundServer:
    """uvicorn serving an app on a background thread: for tests and the in-process bench.

        with BackgroundServer(create_app(engine)) as server:     # loopback, a free port
            httpx.get(server.url + "/health")

    Leaving the block shuts the server down as SIGTERM would (``make_server``): the app's engine is closed.

    Args:
        app: the ASGI app. host: bind address (127.0.0.1 by default; loopback only unless told otherwise).
        port: 0 picks a free port (``self.port`` tells which). log_level: uvicorn's.
        startup_timeout_s: how long ``__enter__`` waits for the server to accept connections.

    Raises:
        RuntimeError: the server did not start in time (or its thread died).
    """

    def __init__(
        self, app, host: str = "127.0.0.1", port: int = 0, log_level: str = "warning", startup_timeout_s: float = 60.0
    ):
        self.socket = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self.socket.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self.socket.bind((host, port))
        self.host, self.port = host, self.socket.getsockname()[1]
        self.server = make_server(app, host, self.port, log_level)
        self.thread = threading.Thread(
            target=self.server.run,
            kwargs={"sockets": [self.socket]},
            daemon=True,
            name=f"draftsmith-server-{self.port}",
        )
        self.startup_timeout_s = startup_timeout_s

    @property
    def url(self) -> str:
        """``http://host:port`` of the running server."""
        return f"http://{self.host}:{self.port}"

    def __enter__(self) -> "BackgroundServer":
        self.thread.start()
        deadline = time.monotonic() + self.startup_timeout_s
        while not self.server.started:
            if not self.thread.is_alive() or time.monotonic() > deadline:
                self.server.should_exit = True
                raise RuntimeError(f"the server on {self.url} did not start within {self.startup_timeout_s:.0f} s")
            time.sleep(0.01)
        return self

    def __exit__(self, *exc) -> None:
        self.server.should_exit = True
        self.thread.join(timeout=30)
        self.socket.close()
