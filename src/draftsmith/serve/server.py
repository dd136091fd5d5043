"""OpenAI-compatible HTTP server around an ``Engine``: completions, chat completions, SSE streaming, metrics.

    draftsmith serve --target reference --speculative-config '{"method": "ngram", "num_speculative_tokens": 4}'
    curl 127.0.0.1:8000/v1/completions -d '{"model": "reference", "prompt": "def f(", "max_tokens": 32}'

Routes: ``POST /v1/completions``, ``POST /v1/chat/completions`` (both with ``"stream": true``: SSE
``data: {...}`` chunks, then ``data: [DONE]``), ``GET /v1/models``, ``GET /health``, ``GET /metrics``
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

A bad request gets a 4xx JSON body ``{"error": {"message", "type", "code", "param"}}``. Requests are decoded
together by the engine's scheduler (continuous batching: ``engine.py``, ``scheduler.py``); each waits on a
worker thread, so the event loop stays free for /health and /metrics. When ``max_waiting`` requests already
wait, a new one is answered 429 at once. A streaming client that disconnects cancels its generation.
"""

from __future__ import annotations

import asyncio
import json
import socket
import threading
import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from contextlib import asynccontextmanager
from functools import partial
from typing import Any, Literal

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from pydantic import BaseModel, ConfigDict, Field
from starlette.exceptions import HTTPException as StarletteHTTPException

from draftsmith.core.generate import GenerationConfig
from draftsmith.serve.engine import Engine, EngineOverloaded, EngineResult, RequestError

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


def _error_response(
    status: int, message: str, code: str, param: str | None = None, type: str = "invalid_request_error"
) -> JSONResponse:
    return JSONResponse(
        status_code=status, content={"error": {"message": message, "type": type, "code": code, "param": param}}
    )


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
    temperature: float | None = Field(None, ge=0.0)
    top_p: float | None = Field(None, gt=0.0, le=1.0)
    top_k: int | None = Field(None, ge=-1)  # vLLM: -1 or 0 disables
    min_p: float | None = Field(None, ge=0.0, le=1.0)
    repetition_penalty: float | None = Field(None, gt=0.0, allow_inf_nan=False)
    presence_penalty: float | None = Field(None, ge=-2.0, le=2.0)
    frequency_penalty: float | None = Field(None, ge=-2.0, le=2.0)
    min_tokens: int = Field(0, ge=0)
    ignore_eos: bool = False
    seed: int | None = None
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


def _check_common(req: _SamplingRequest, engine: Engine) -> None:
    """Model name, n, and the unsupported parameters (``UNSUPPORTED``, skip_special_tokens false, vLLM's
    continuous usage stats): each refused with a 400 naming it."""
    if req.model is not None and req.model != engine.model_name:
        raise APIError(
            404,
            f"the model {req.model!r} does not exist; this server serves {engine.model_name!r}",
            "model_not_found",
            "model",
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
            temperature=1.0 if req.temperature is None else req.temperature,
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


def _stops(req: _SamplingRequest) -> dict:
    """The engine's text rules (``Engine.generate`` keywords): stop strings and include_stop_str_in_output."""
    stop = (req.stop,) if isinstance(req.stop, str) else tuple(req.stop or ())
    return {"stop": stop, "include_stop_str_in_output": req.include_stop_str_in_output}


def _completion_prompt(req: CompletionRequest, engine: Engine) -> list[int]:
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


def _chat_prompt(req: ChatCompletionRequest, engine: Engine) -> list[int]:
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
        text = tokenizer.apply_chat_template(messages, add_generation_prompt=req.add_generation_prompt, tokenize=False)
    except Exception as e:  # noqa: BLE001 - a template's raise_exception (e.g. roles must alternate)
        raise APIError(400, f"the chat template refused the messages: {e}", "invalid_messages", "messages") from None
    return list(tokenizer(text, add_special_tokens=req.add_special_tokens).input_ids)


def _usage(result: EngineResult) -> dict:
    n = len(result.tokens)
    return {"prompt_tokens": result.prompt_tokens, "completion_tokens": n, "total_tokens": result.prompt_tokens + n}


def _sse(payload: Any) -> str:
    return f"data: {json.dumps(payload)}\n\n"


def create_app(engine: Engine) -> FastAPI:
    """The FastAPI app serving ``engine``: every request waits for its sequence on a worker thread while the
    engine's scheduler decodes them together."""
    scheduler = engine.scheduler
    worker = ThreadPoolExecutor(
        max_workers=scheduler.max_waiting + scheduler.decoder.max_num_seqs + 4, thread_name_prefix="draftsmith-request"
    )

    def overloaded(message: str) -> APIError:
        return APIError(429, message, "too_many_requests", None, "rate_limit_error")

    def check_capacity() -> None:
        """Refuse before any byte is sent (a stream's status is final once it starts)."""
        if scheduler.num_waiting >= scheduler.max_waiting:
            raise overloaded(
                f"the server is at capacity: {scheduler.num_running} requests running and {scheduler.num_waiting} "
                f"waiting (max_waiting={scheduler.max_waiting}); retry later"
            )

    @asynccontextmanager
    async def lifespan(app):
        yield
        worker.shutdown(wait=False, cancel_futures=True)

    app = FastAPI(title="draftsmith", lifespan=lifespan)
    app.state.engine = engine

    @app.exception_handler(APIError)
    async def api_error(request: Request, e: APIError):
        return _error_response(e.status, e.message, e.code, e.param, e.type)

    @app.exception_handler(RequestValidationError)
    async def validation_error(request: Request, e: RequestValidationError):
        problems = []
        for err in e.errors():
            loc = ".".join(str(x) for x in err.get("loc", ()) if x != "body")
            problems.append(f"{loc}: {err.get('msg')}" if loc else str(err.get("msg")))
        first = e.errors()[0].get("loc", ()) if e.errors() else ()
        param = ".".join(str(x) for x in first if x != "body") or None
        return _error_response(400, "; ".join(problems) or "invalid request", "invalid_request", param)

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request: Request, e: StarletteHTTPException):
        return _error_response(e.status_code, str(e.detail), "not_found" if e.status_code == 404 else "http_error")

    @app.exception_handler(Exception)
    async def internal_error(request: Request, e: Exception):
        return _error_response(
            500, f"internal error: {type(e).__name__}: {e}", "internal_error", type="internal_server_error"
        )

    async def run(prompt_ids, cfg, stop: dict, on_text=None, cancel=None) -> EngineResult:
        cancel = cancel or threading.Event()
        call = partial(
            engine.generate, prompt_ids, cfg, **stop, on_text=on_text, cancel=cancel, arrival=time.perf_counter()
        )
        try:
            return await asyncio.get_running_loop().run_in_executor(worker, call)
        except EngineOverloaded as e:
            raise overloaded(str(e)) from None
        finally:
            cancel.set()  # a request whose client went away (the await was cancelled) leaves the batch

    def stream(prompt_ids, cfg, stop, chunk, first: list | None, include_usage: bool):
        """SSE body: ``chunk(delta_text, finish_reason, stop_reason=...)`` payloads, an optional usage chunk,
        [DONE]."""

        async def events():
            loop = asyncio.get_running_loop()
            queue: asyncio.Queue = asyncio.Queue()
            cancel = threading.Event()
            on_text = lambda delta: loop.call_soon_threadsafe(queue.put_nowait, delta)  # noqa: E731
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
                    yield _sse(
                        {
                            "error": {
                                "message": f"{type(e).__name__}: {e}",
                                "type": "internal_server_error",
                                "code": "internal_error",
                                "param": None,
                            }
                        }
                    )
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
    async def completions(req: CompletionRequest):
        _check_common(req, engine)
        prompt_ids = _completion_prompt(req, engine)
        cfg = _generation_config(req, engine, prompt_ids, req.max_tokens)
        rid, created = f"cmpl-{uuid.uuid4().hex}", int(time.time())
        base = {"id": rid, "object": "text_completion", "created": created, "model": engine.model_name}
        if req.stream:

            def chunk(text, finish_reason, usage=None, stop_reason=None):
                if usage is not None:
                    return base | {"choices": [], "usage": usage}
                choice = {"index": 0, "text": text or "", "logprobs": None, "finish_reason": finish_reason}
                return base | {"choices": [choice | {"stop_reason": stop_reason}]}

            include_usage = bool(req.stream_options and req.stream_options.include_usage)
            return stream(prompt_ids, cfg, _stops(req), chunk, None, include_usage)
        result = await run(prompt_ids, cfg, _stops(req))
        return base | {
            "choices": [
                {
                    "index": 0,
                    "text": result.text,
                    "logprobs": None,
                    "finish_reason": result.finish_reason,
                    "stop_reason": result.stop_reason,
                }
            ],
            "usage": _usage(result),
        }

    @app.post("/v1/chat/completions")
    async def chat_completions(req: ChatCompletionRequest):
        _check_common(req, engine)
        prompt_ids = _chat_prompt(req, engine)
        max_tokens = req.max_completion_tokens if req.max_completion_tokens is not None else req.max_tokens
        cfg = _generation_config(req, engine, prompt_ids, max_tokens)
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
        result = await run(prompt_ids, cfg, _stops(req))
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

    @app.get("/v1/models")
    async def models():
        spec = engine.spec
        return {
            "object": "list",
            "data": [
                {
                    "id": engine.model_name,
                    "object": "model",
                    "created": 0,
                    "owned_by": "draftsmith",
                    "max_model_len": engine.max_model_len,
                    "speculative_config": None if spec is None else spec.to_dict(),
                }
            ],
        }

    @app.get("/health")
    async def health():
        return {"status": "ok"}

    @app.get("/metrics")
    async def metrics():
        return Response(engine.metrics.render(), media_type=engine.metrics.content_type)

    return app


def serve(engine: Engine, host: str = "127.0.0.1", port: int = 8000, log_level: str = "info") -> None:
    """Run the server with uvicorn until interrupted (binds 127.0.0.1 unless told otherwise)."""
    import uvicorn

    uvicorn.run(create_app(engine), host=host, port=port, log_level=log_level)


class BackgroundServer:
    """uvicorn serving an app on a background thread: for tests and the in-process bench.

        with BackgroundServer(create_app(engine)) as server:     # loopback, a free port
            httpx.get(server.url + "/health")

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

        import uvicorn

        self.socket = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self.socket.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self.socket.bind((host, port))
        self.host, self.port = host, self.socket.getsockname()[1]
        self.server = uvicorn.Server(uvicorn.Config(app, log_level=log_level, lifespan="on"))
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
