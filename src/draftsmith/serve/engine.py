"""The serving engine: one target, its tokenizer, an optional speculative config; many requests per step.

    engine = Engine.from_pretrained("reference", '{"method": "ngram", "num_speculative_tokens": 4}')
    result = engine.generate(engine.tokenizer("def f(").input_ids, GenerationConfig(max_new_tokens=32))
    result.text, result.tokens, result.finish_reason, result.stats

The speculative config takes vLLM's ``--speculative-config`` keys (``drafters.speculative``; each drafter's
further keys in its ``config.py``); any other key is refused.

Startup:
  0. ``from_pretrained`` only: the drafter's checks that need no weights (``Drafter.check_before_loading``:
     a draft model's position table), then the memory plan (``serve/memory.py``) of weights + KV caches of the
     target and the drafter for ``max_model_len``, from their configs, before loading anything; it stops with
     advice (``MemoryPlanError``) when they exceed the device's free memory;
  1. parse the speculative config (unknown keys, bad values -> ValueError);
  2. the drafter loads itself (``Drafter.load``): checks its export's metadata against the target and
     tokenizer (a mismatch raises ``HeadMismatchError``: the engine does not start), loads its weights ONCE on
     the target's device, refuses a k it cannot draft and warns once past its trained depth; the target is
     wrapped with the hidden-state layers the drafter reads;
  3. max_model_len (default: the target's declared position limit) must fit what the drafter reads
     (``LoadedDrafter.check_max_model_len``: a draft's learned position table refuses, RoPE only warns);
  4. per request: a fresh proposer from the loaded drafter (proposers hold per-sequence state).

Requests are decoded together: ``generate`` (callable from many threads at once) submits the request to the
engine's scheduler (``serve/scheduler.py``), whose thread steps a ``core.batch.BatchDecoder``: continuous
batching with at most ``max_num_seqs`` rows and ``max_num_batched_tokens`` tokens per step, chunked prefill,
and a bounded waiting queue (``max_waiting``; a full queue refuses with ``EngineOverloaded``). Each request keeps
its own sampling settings, seed and stops. Stop ids are ``core.stops.stop_token_ids`` (as eval's); stop strings
are found on the decoded text that is final (``core.stops.TextStream``), token by token whatever the chunking,
so plain and speculative decoding stop at the same token. Spec-decode counters come from the decode loop's
observer hook (``on_step``), so they count every verify step even when a stop string ends generation.
"""

from __future__ import annotations

import logging
import threading
import time
from dataclasses import dataclass
from typing import Callable, Sequence

import torch
from transformers import AutoConfig

from draftsmith import drafters, reference
from draftsmith.core.batch import BatchDecoder, BatchSequence
from draftsmith.core.generate import GenerationConfig, GenerationResult, SpecStats, VerifyStep
from draftsmith.core.onednn import ONEDNN_MODES, pack_linears, packed_bytes
from draftsmith.core.proposer import Proposer
from draftsmith.core.rms_norm import fuse_rms_norms
from draftsmith.core.sampling import draft_seed
from draftsmith.core.stops import StopStringFound, TextStream, stop_token_ids
from draftsmith.core.target import TargetModel, resolve_max_model_len
from draftsmith.drafters.speculative import SpeculativeConfig
from draftsmith.models import load_causal_lm, resolve_model_dtype
from draftsmith.serve.costs import adaptive_policy
from draftsmith.serve.memory import plan_for_engine
from draftsmith.serve.metrics import EngineMetrics
from draftsmith.serve.scheduler import EngineClosed, EngineOverloaded, RequestCancelled, Scheduler
from draftsmith.sizes import free_memory_bytes

__all__ = ["Engine", "EngineClosed", "EngineOverloaded", "EngineResult", "RequestCancelled", "RequestError"]

logger = logging.getLogger(__name__)


class RequestError(ValueError):
    """A request the engine cannot serve as asked (the server answers 4xx).

    Attributes:
        code: a short machine-readable reason ('context_length_exceeded', 'invalid_prompt', ...).
        param: the request field at fault, when there is one.
    """

    def __init__(self, message: str, code: str = "invalid_request", param: str | None = None):
        super().__init__(message)
        self.code, self.param = code, param


@dataclass
class EngineResult(GenerationResult):
    """A ``GenerationResult`` (tokens cut at a stop string) plus what a server reports.

    Attributes:
        text: the decoded completion (special tokens skipped), cut before the first stop string (``Engine.
            generate``: vLLM's text rules).
        prompt_tokens: prompt length. ttft_s: arrival to first token (None when no token was made).
        latency_s: arrival to the end of generation.
        stop_reason: vLLM's: the stop string or the stop token id (not EOS) that ended generation, else None.
    """

    text: str = ""
    prompt_tokens: int = 0
    ttft_s: float | None = None
    latency_s: float = 0.0
    stop_reason: str | int | None = None


class Engine:
    """Serves one target to many requests at once (continuous batching), with or without speculation.

    Args:
        model: a transformers causal LM in eval mode (on its serving device).
        tokenizer: the target's tokenizer (decoding, chat template, stop strings).
        speculative_config: a ``SpeculativeConfig``, its dict or JSON string, or None (plain decoding).
        model_name: the name clients send as ``model`` (``/v1/models``).
        allow_mismatch: target identity fields a checked export may differ in (``export.check``; CLI
            ``--allow-mismatch``).
        max_model_len: longest prompt + completion served, in tokens (default and upper bound: the target's
            declared position limit, ``max_position_embeddings`` or ``n_positions``; as vLLM's ``--max-model-len``).
        max_num_seqs: most sequences decoded together (vLLM ``--max-num-seqs``).
        max_num_batched_tokens: most tokens one step reads, decode and prefill (vLLM ``--max-num-batched-tokens``).
        max_waiting: most requests waiting to run; more are refused with ``EngineOverloaded`` (HTTP 429).
        onednn: run the float32 CPU linears of the target and of the drafter (``LoadedDrafter.modules``) through
            oneDNN over weights packed once (``core.onednn``; ``_pack``): ``off`` (default here: the model passed
            in is the caller's), ``on``, or ``auto`` (when the packed copies fit in half the free memory;
            ``from_pretrained``'s default). Packing changes the ``nn.Linear`` modules in place into
            ``PackedLinear`` (same parameters and state_dict). Unless ``off``, the RMSNorms whose fused form
            (``F.rms_norm``) gives bitwise their own output run fused too (``core.rms_norm``; on any device).

    Attributes:
        drafter: the ``LoadedDrafter`` (None without speculation). target: the wrapped target.

    Raises:
        ValueError: a bad speculative config or max_model_len, or whatever the drafter refuses while loading
            (``Drafter.load``; ``HeadMismatchError``, a ValueError, for an export that does not fit the target).
    """

    def __init__(
        self,
        model,
        tokenizer,
        speculative_config=None,
        *,
        model_name: str = "draftsmith",
        allow_mismatch: Sequence[str] = (),
        max_model_len: int | None = None,
        max_num_seqs: int = 64,
        max_num_batched_tokens: int = 2048,
        max_waiting: int = 1024,
        onednn: str = "off",
    ):
        if onednn not in ONEDNN_MODES:
            raise ValueError(f"onednn must be one of {', '.join(ONEDNN_MODES)}, got {onednn!r}")
        self.spec = SpeculativeConfig.parse(speculative_config)
        self.tokenizer, self.model_name = tokenizer, model_name
        self.drafter = (
            drafters.get(self.spec.method).load(self.spec, model, tokenizer, allow_mismatch)
            if self.spec is not None
            else None
        )
        modules = (model, *(self.drafter.modules if self.drafter is not None else ()))
        self.packed_linears = self._pack(modules, onednn)  # before the cost profile measures the forwards
        # torch's fused RMSNorm where it gives the same bits (core.rms_norm): part of the serving kernels
        self.fused_norms = 0 if onednn == "off" else sum(fuse_rms_norms(m) for m in modules)
        aux_layer_ids = self.drafter.aux_layer_ids if self.drafter is not None else None
        self.target = TargetModel(model, tokenizer, aux_layer_ids=aux_layer_ids)
        self.k = self.spec.depth if self.spec is not None else 0  # a tree's counters run over its depths
        self.policy = None
        if self.spec is not None and self.spec.adaptive:  # measured (or cached) before the first request
            self.policy = adaptive_policy(self.target, self.drafter, self.spec, max_num_seqs)
            self.k = self.policy.k_max
        self.max_model_len = resolve_max_model_len(self.target.position_limit, max_model_len)
        if self.drafter is not None:
            self.drafter.check_max_model_len(self.max_model_len)
        self.eos_token_ids = stop_token_ids(model, tokenizer)
        self.metrics = EngineMetrics(
            self.k, model_name=model_name, max_model_len=self.max_model_len, speculative=self.spec is not None
        )
        if self.policy is not None:
            self.metrics.set_cost_model(self.policy.cost, self.k, self.policy)
        decoder = BatchDecoder(
            self.target,
            self.drafter.new_batch_proposer() if self.drafter is not None else None,
            self.k,
            max_num_seqs=max_num_seqs,
            max_num_batched_tokens=max_num_batched_tokens,
            tree=self.spec.tree if self.spec is not None else None,
            policy=self.policy,
        )
        self.scheduler = Scheduler(
            decoder, self.metrics, max_waiting=max_waiting, kv_capacity=max_num_seqs * self.max_model_len
        )

    def _pack(self, modules, onednn: str) -> int:
        """Pack the linear layers of ``modules`` (the target, then the drafter's) for oneDNN (``core.onednn``) as
        ``onednn`` says: ``on`` always (where oneDNN runs the weights), ``auto`` when the packed copies take at
        most half of the free memory, ``off`` never. Returns the number of layers packed; logs the choice."""
        if onednn == "off":
            return 0
        extra = sum(packed_bytes(m) for m in modules)
        if extra == 0:
            return 0
        free = free_memory_bytes("cpu")
        if onednn == "auto" and extra > free // 2:
            logger.info("oneDNN linears: not packed (%.1f GiB of copies, %.1f GiB free)", extra / 2**30, free / 2**30)
            return 0
        n = sum(pack_linears(m) for m in modules)
        logger.info("oneDNN linears: %d packed (%.0f MiB of copies)", n, extra / 2**20)
        return n

    def to_loop(self, loop, fn):
        """An ``on_text`` for ``generate`` that sends each piece to ``fn`` on the asyncio ``loop``: what a step
        emits leaves at the end of the step, one wake-up of the loop per step (``serve.scheduler.Handoff``)."""
        return self.scheduler.handoff.to_loop(loop, fn)

    def close(self) -> None:
        """Stop the scheduler thread after its current step; requests still queued or running end with
        ``EngineClosed`` (the server answers 503). The engine serves no more; calling it again does nothing."""
        self.scheduler.close()

    @classmethod
    def from_pretrained(
        cls,
        target: str,
        speculative_config=None,
        *,
        revision: str | None = None,
        dtype: str = "float32",
        device: str | None = None,
        served_model_name: str | None = None,
        allow_mismatch: Sequence[str] = (),
        max_model_len: int | None = None,
        check_memory: bool = True,
        onednn: str = "auto",
        **batching,
    ) -> "Engine":
        """Load ``target`` (a Hub id, a folder, or ``reference``) on ``device`` (default: cuda when
        available) and build the engine; ``served_model_name`` defaults to ``target``.

        Before loading, the drafter checks what it can from configs (``Drafter.check_before_loading``), and
        ``serve.memory.plan_for_engine`` estimates weights + KV caches of the target and the drafter for
        ``max_model_len`` and compares them with the device's free memory (``check_memory=False`` skips it).
        ``batching``: ``max_num_seqs``, ``max_num_batched_tokens``, ``max_waiting`` (as ``Engine``).
        ``onednn``: pack the CPU linear layers for oneDNN (``core.onednn``; ``Engine._pack``): auto | on | off.

        Raises:
            MemoryPlanError (a ValueError): the plan does not fit; the message says what to change.
            ValueError: as ``Engine`` (a draft's learned position table shorter than max_model_len, ...).
        """

        device = device or ("cuda" if torch.cuda.is_available() else "cpu")
        dtype = resolve_model_dtype(target, dtype, revision, device)  # 'auto' -> what the device runs fast
        spec = SpeculativeConfig.parse(speculative_config)
        if spec is not None:
            target_config = AutoConfig.from_pretrained(reference.resolve(target), revision=revision)
            drafters.get(spec.method).check_before_loading(spec, target_config, max_model_len)
        if check_memory:
            plan = plan_for_engine(
                target, spec, dtype=dtype, device=device, max_model_len=max_model_len, revision=revision
            )
            logger.info("%s", plan.summary())
            plan.check()
        model, tokenizer = load_causal_lm(target, revision=revision, dtype=dtype, role="target")
        model.to(device)
        return cls(
            model,
            tokenizer,
            spec,
            model_name=served_model_name or target,
            allow_mismatch=allow_mismatch,
            max_model_len=max_model_len,
            onednn=onednn,
            **batching,
        )

    def check_prompt(self, prompt_ids: Sequence[int], max_new_tokens: int) -> None:
        """Refuse (``RequestError``) an empty prompt, ids outside the vocabulary, or prompt + max_new_tokens
        beyond ``max_model_len``."""
        n = len(prompt_ids)
        if n == 0:
            raise RequestError("the prompt is empty (0 tokens)", "invalid_prompt", "prompt")
        vocab_size = self.target.vocab_size
        bad = [t for t in prompt_ids if not 0 <= int(t) < vocab_size]
        if bad:
            raise RequestError(
                f"prompt token ids {bad[:5]} are outside the vocabulary [0, {vocab_size})", "invalid_prompt", "prompt"
            )
        if n + max_new_tokens > self.max_model_len:
            raise RequestError(
                f"this model's maximum context length is {self.max_model_len} tokens, but "
                f"{n + max_new_tokens} were requested ({n} in the prompt, {max_new_tokens} for the "
                f"completion); shorten the prompt or lower max_tokens",
                "context_length_exceeded",
                "max_tokens" if n < self.max_model_len else "prompt",
            )

    def new_proposer(self, cfg: GenerationConfig) -> Proposer | None:
        """A fresh proposer for one sequence, drafting with the request's settings (None: plain decoding)."""
        if self.drafter is None:
            return None
        return self.drafter.new_proposer(cfg.draft_sampling(draft_seed(cfg.seed)))

    def generate(
        self,
        prompt_ids: Sequence[int],
        cfg: GenerationConfig,
        *,
        stop: Sequence[str] = (),
        include_stop_str_in_output: bool = False,
        on_text: Callable[[str], None] | None = None,
        cancel: threading.Event | None = None,
        arrival: float | None = None,
    ) -> EngineResult:
        """Generate one sequence in the engine's running batch (blocks until it ended), record its metrics.

        Text follows vLLM (``vllm/v1/engine/detokenizer.py``): a stop string cuts the text before it (after it
        with ``include_stop_str_in_output``); the stop token id that ended generation (EOS or a stop id) is in
        ``tokens`` but not in ``text`` unless ``include_stop_str_in_output``; with ``cfg.min_tokens`` a stop
        string counts only after the first min_tokens tokens.

        Args:
            prompt_ids: ``[T]`` token ids. cfg: decoding settings (EOS ids are the caller's to set;
                ``self.eos_token_ids`` are the model's).
            stop: stop strings, found on the decoded text. include_stop_str_in_output: as above.
            on_text: called with each new piece of text (on the scheduler's thread).
            cancel: when set, the request leaves the batch at the next step with ``RequestCancelled``.
            arrival: ``time.perf_counter()`` when the request arrived (TTFT and latency count from it;
                default: now).

        Raises:
            RequestError: the prompt fails ``check_prompt``. RequestCancelled: ``cancel`` was set (counted as
                finished_reason 'abort' in the ``vllm:`` metrics).
            EngineOverloaded: the waiting queue is full. EngineClosed: the engine was closed before or while the
                sequence ran.
        """
        arrival = time.perf_counter() if arrival is None else arrival
        prompt = [int(t) for t in prompt_ids]
        self.check_prompt(prompt, cfg.max_new_tokens)
        stats = SpecStats(k=self.k) if self.drafter is not None else None
        text = TextStream(
            self.tokenizer, stop, on_text, include_stop=include_stop_str_in_output, min_tokens=cfg.min_tokens
        )
        vllm = self.metrics.vllm
        seq: BatchSequence | None = None

        def on_step(step: VerifyStep) -> None:  # counted before the step's tokens can stop generation
            if stats is not None:
                stats.record(step.proposed, step.accepted)
            if step.k is not None:
                self.metrics.record_choice(step.k)
                if stats is not None:
                    stats.record_choice(step.k)
            if vllm is not None:
                vllm.record_step(step.proposed, step.accepted)

        last_chunk_at: float | None = None  # when the previous chunk was emitted (the decoder's timestamps)

        def on_tokens(chunk: list[int]) -> None:
            nonlocal last_chunk_at
            now = seq.last_token_s
            if vllm is not None and last_chunk_at is None:
                vllm.record_first_token(len(prompt), now - arrival)
            gap = None if last_chunk_at is None else now - last_chunk_at
            last_chunk_at = now
            before = len(text.tokens)
            try:
                if cancel is not None and cancel.is_set():
                    raise RequestCancelled
                if seq.out.finish_reason == "stop" and not include_stop_str_in_output:
                    text.add(chunk[:-1])  # vLLM leaves the stop token's text out
                    text.add_hidden(chunk[-1])
                else:
                    text.add(chunk)
            finally:
                if vllm is not None:
                    vllm.record_tokens(len(text.tokens) - before, gap)

        seq = BatchSequence(
            prompt,
            cfg,
            cfg.draft_sampling(draft_seed(cfg.seed)),
            on_tokens=on_tokens,
            on_step=on_step if stats is not None or vllm is not None else None,
        )
        finished_reason = "error"
        try:
            job = self.scheduler.submit(seq, cancel)
            try:
                job.wait()
            finally:
                if not seq.done and cancel is not None:
                    cancel.set()
                if stats is not None:
                    self.metrics.record_spec(stats)
            error = seq.error
            if isinstance(error, StopStringFound):
                finish_reason = "stop"
            elif error is not None:
                if isinstance(error, RequestCancelled):
                    finished_reason = "abort"
                raise error
            else:
                finish_reason = seq.result.finish_reason
            forwards = seq.forwards
            text.finish()
            if text.stopped:  # found in the tail that only the end of generation made final
                finish_reason = "stop"
            finished_reason = finish_reason
        except EngineOverloaded:
            finished_reason = None  # never queued (vLLM counts admission rejections apart)
            raise
        finally:
            end = time.perf_counter()
            if finished_reason in ("abort", "error"):  # the draftsmith: series count what ended badly too
                first = seq.first_token_s - arrival if seq.first_token_s is not None else None
                self.metrics.record_request(len(prompt), len(text.tokens), finished_reason, first, end - arrival)
            if vllm is not None and finished_reason is not None:
                vllm.record_finished(
                    finished_reason,
                    len(prompt) if seq.first_token_s is not None else seq.prefilled,
                    len(text.tokens),
                    cfg.max_new_tokens,
                    end - arrival,
                    seq.queued_s if seq.queued_s is not None else arrival,
                    seq.scheduled_s,
                    seq.first_token_s,
                    seq.last_token_s,
                    seq.finished_s if seq.finished_s is not None else end,
                )
        latency = end - arrival
        ttft = seq.first_token_s - arrival if seq.first_token_s is not None else None
        stop_reason = text.stop_reason if text.stopped else seq.stop_reason if finish_reason == "stop" else None
        self.metrics.record_request(len(prompt), len(text.tokens), finish_reason, ttft, latency)
        return EngineResult(
            tokens=text.tokens,
            finish_reason=finish_reason,
            stats=stats,
            num_target_forwards=forwards,
            text=text.text,
            prompt_tokens=len(prompt),
            ttft_s=ttft,
            latency_s=latency,
            stop_reason=stop_reason,
        )
