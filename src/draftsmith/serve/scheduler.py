"""The engine's scheduler: one thread steps a ``core.batch.BatchDecoder``; requests join and leave between steps.

    scheduler = Scheduler(decoder, metrics, max_waiting=1024)
    job = scheduler.submit(seq, cancel=threading.Event())    # from any thread; raises EngineOverloaded when full
    job.wait()                                               # seq.done; seq.result or seq.error

Continuous batching as vLLM's scheduler does it (``vllm/v1/core/sched/scheduler.py``): every step runs the
rows that are running plus as much prefill of newcomers as the token budget leaves (``BatchDecoder``:
``max_num_seqs``, ``max_num_batched_tokens``, chunked prefill of long prompts). Requests beyond
``max_num_seqs`` wait; beyond ``max_waiting`` waiting requests a new one is refused at once
(``EngineOverloaded``; the server answers 429, as TGI does past ``--max-concurrent-requests``) rather than
queued for minutes. A cancelled request (its ``cancel`` event set: the client went away) leaves at the next
step, waiting or running. Callbacks of a sequence (tokens, text, stops) run on the scheduler thread. A step that
raises fails every request the scheduler holds (each ends with that error; none is left waiting). ``close()``
(the server shutting down) ends what is queued or running with ``EngineClosed`` (HTTP 503).

A ``gate`` (``StepGate``, None by default) makes the scheduler ask before each step whether it may step now: a
bench that serves two engines on one device step by step (``evaluation/interleave.py``) sets it; the seconds the
scheduler waited there are left out of the decoder's ``between_s`` (``BatchDecoder.exclude``).

What a step's callbacks send to a server's event loops (``Handoff``) leaves once the step is over, one wake-up per
loop, before any request that ended in the step is told so: a wake-up per chunk, in the middle of the step, let the
loop's thread take the GIL from the decoder at every row (on the reference target, a median 0.28-0.46 ms of each
chunk's emission, 1-6 ms a step at c = 8-32).
"""

from __future__ import annotations

import logging
import threading
import time
from collections import deque
from typing import Protocol

from draftsmith.core.batch import BatchDecoder, BatchSequence
from draftsmith.serve.metrics import EngineMetrics

logger = logging.getLogger(__name__)


class StepGate(Protocol):
    """What a scheduler asks around each step while it shares its device with others (module docstring)."""

    def enter(self, owner: object) -> float:
        """Block until ``owner`` (the scheduler) may step; returns the seconds it waited."""

    def leave(self, owner: object, seconds: float) -> None:
        """``owner``'s step is over; it took ``seconds``."""


class EngineOverloaded(Exception):
    """The waiting queue is full: the request was not queued (HTTP 429)."""


class RequestCancelled(Exception):
    """The request's ``cancel`` event was set (e.g. the client went away)."""


class EngineClosed(RuntimeError):
    """The scheduler was closed (the server is shutting down): the request was refused, or ended unfinished
    (HTTP 503)."""


def _run_all(items: list) -> None:
    for fn, value in items:
        fn(value)


class Handoff:
    """Values the scheduler's thread sends to asyncio event loops, held until the end of the step and then sent
    with one ``call_soon_threadsafe`` per loop (module docstring); from any other thread a value goes at once.
    Values for one loop keep their order, and a step's values leave before its ended requests are told.
    """

    def __init__(self):
        self.thread_id: int | None = None  #: the scheduler thread's ident (set when it starts)
        self._pending: dict = {}  # loop -> [(fn, value)], touched by the scheduler thread only

    def to_loop(self, loop, fn):
        """A callable sending its one argument to ``fn`` on ``loop`` (``fn`` runs on the loop's thread)."""

        def send(value) -> None:
            if threading.get_ident() == self.thread_id:
                self._pending.setdefault(loop, []).append((fn, value))
            else:
                loop.call_soon_threadsafe(fn, value)

        return send

    def flush(self) -> None:
        """Send what the step held (the scheduler thread, after each step). A loop already closed (its server
        gone) drops its values."""
        pending, self._pending = self._pending, {}
        for loop, items in pending.items():
            try:
                loop.call_soon_threadsafe(_run_all, items)
            except RuntimeError:  # the loop is closed
                logger.debug("dropped %d values for a closed event loop", len(items))


class Job:
    """A submitted sequence: ``wait()`` blocks until it ended (``seq.result`` or ``seq.error``)."""

    def __init__(self, seq: BatchSequence, cancel: threading.Event | None):
        self.seq, self.cancel = seq, cancel
        self.ended = threading.Event()

    def wait(self, timeout: float | None = None) -> bool:
        """True once the sequence ended (within ``timeout`` seconds)."""
        return self.ended.wait(timeout)


class Scheduler:
    """Runs ``decoder`` on a daemon thread (started at the first submit) until ``close()``.

    Args:
        decoder: the batch decoder (its target, proposer, k, max_num_seqs, max_num_batched_tokens).
        metrics: where the running / waiting gauges go (``EngineMetrics.set_queue``).
        max_waiting: most requests waiting (queued or being prefilled) before new ones are refused.
        kv_capacity: tokens of KV cache the engine plans for (max_num_seqs x max_model_len); the gauge
            ``vllm:kv_cache_usage_perc`` is the running rows' cached tokens over it (None: not set).

    Raises:
        ValueError: max_waiting < 1.
    """

    def __init__(
        self,
        decoder: BatchDecoder,
        metrics: EngineMetrics | None = None,
        max_waiting: int = 1024,
        kv_capacity: int | None = None,
    ):
        if max_waiting < 1:
            raise ValueError(f"max_waiting must be >= 1, got {max_waiting}")
        self.decoder, self.metrics, self.max_waiting = decoder, metrics, max_waiting
        self.kv_capacity = kv_capacity
        self._inbox: deque[Job] = deque()
        self._jobs: dict[int, Job] = {}  # key -> job, for every sequence in the decoder
        self._wake = threading.Condition()
        self._thread: threading.Thread | None = None
        self._closed = False
        self.handoff = Handoff()  #: what callbacks send to event loops leaves at the end of each step
        self.gate: StepGate | None = None  #: asked around each step (module docstring); None: step at once

    @property
    def num_waiting(self) -> int:
        """Requests submitted and not yet running."""
        return len(self._inbox) + len(self.decoder.waiting)

    @property
    def num_running(self) -> int:
        """Sequences in the running batch."""
        return len(self.decoder.running)

    def kv_cache_usage(self) -> float | None:
        """Tokens in the running rows' KV cache over ``kv_capacity`` (None without a capacity)."""
        if not self.kv_capacity:
            return None
        return min(1.0, sum(self.decoder.cache.lengths) / self.kv_capacity)

    def submit(self, seq: BatchSequence, cancel: threading.Event | None = None) -> Job:
        """Queue ``seq`` for the next step.

        Raises:
            EngineOverloaded: ``max_waiting`` requests are already waiting.
            EngineClosed (a RuntimeError): the scheduler was closed.
        """
        job = Job(seq, cancel)
        if seq.queued_s is None:
            seq.queued_s = time.perf_counter()  # the inbox is part of the waiting queue
        with self._wake:
            if self._closed:
                raise EngineClosed("the engine is closed; the request was not run")
            if self.num_waiting >= self.max_waiting:
                raise EngineOverloaded(
                    f"the server is at capacity: {self.num_running} requests running and {self.num_waiting} "
                    f"waiting (--max-waiting-requests {self.max_waiting}); retry later"
                )
            self._inbox.append(job)
            if self._thread is None:
                self._thread = threading.Thread(target=self._loop, name="draftsmith-scheduler", daemon=True)
                self._thread.start()
            self._wake.notify()
        return job

    @property
    def closed(self) -> bool:
        """True once ``close()`` was called: no request is taken any more."""
        return self._closed

    def close(self, timeout: float = 30.0) -> None:
        """Stop the thread after its current step (waiting at most ``timeout`` seconds for it); sequences still
        queued or running end with ``EngineClosed``. Idempotent."""
        with self._wake:
            self._closed = True
            self._wake.notify()
        if self._thread is not None:
            self._thread.join(timeout)

    def _step(self) -> list[BatchSequence]:
        """One decoder step, through the gate when there is one (module docstring)."""
        gate = self.gate
        if gate is None:
            return self.decoder.step()
        self.decoder.exclude(gate.enter(self))
        t0 = time.perf_counter()
        try:
            return self.decoder.step()
        finally:
            gate.leave(self, time.perf_counter() - t0)

    def _loop(self) -> None:
        decoder = self.decoder
        self.handoff.thread_id = threading.get_ident()
        while True:
            with self._wake:
                while not self._closed and not self._inbox and not decoder.has_work:
                    self._wake.wait()
                if self._closed:
                    break
                arrivals = list(self._inbox)
                self._inbox.clear()
            for job in arrivals:
                try:
                    decoder.add(job.seq)
                except Exception as e:  # noqa: BLE001 - a request the decoder refuses ends alone
                    job.seq.error, job.seq.done = e, True
                    job.ended.set()
                    continue
                self._jobs[job.seq.key] = job
            for job in list(self._jobs.values()):
                if job.cancel is not None and job.cancel.is_set() and not job.seq.done:
                    decoder.cancel(job.seq, RequestCancelled())
            try:
                ended = self._step()
            except Exception as e:  # noqa: BLE001 - a fault of the batch: every request in it fails, loudly
                logger.exception("a batch step failed; failing its %d requests", len(self._jobs))
                ended = decoder.abort(e)
                for job in self._jobs.values():  # also a sequence the step had taken out of the queues
                    if not job.seq.done:
                        job.seq.error, job.seq.done = e, True
                ended = [job.seq for job in self._jobs.values()]
            self.handoff.flush()  # before any ended request is told: its text arrives before its end
            for seq in ended:
                job = self._jobs.pop(seq.key, None)
                if job is not None:
                    job.ended.set()
            if self.metrics is not None:
                self.metrics.set_queue(self.num_running, self.num_waiting, self.kv_cache_usage())
        for job in list(self._jobs.values()) + list(self._inbox):
            shut = EngineClosed("the engine was closed before the request finished")
            job.seq.error, job.seq.done = job.seq.error or shut, True
            job.ended.set()
