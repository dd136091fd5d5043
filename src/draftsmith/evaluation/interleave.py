"""Two servers on one device, step by step: the bench's interleaved measurement (``BenchConfig.interleave``).

A shared machine's speed drifts over seconds (on the 2-core AMD EPYC this project measures on, one thread: the
ratio of consecutive 6-second windows of a fixed matmul loop has a standard deviation of 5.8%, and the fastest and
slowest of ten such windows differ by 15%), so two batches run one after the other meet different machines, and a
speedup of one batch over the plain batches around it cannot resolve the few percent that issue 19's bar asks
about. Run at once instead, a method's batch and a plain batch meet the same machine: their schedulers step in
turn through a ``Turnstile`` (``serve.scheduler.StepGate``), each step going to the waiting scheduler that has
spent the fewest seconds stepping since the pair began (``reset``), and each batch is timed by its own seconds:
its wall time less the seconds its scheduler waited for the other's steps (``waited``). The event loop, the
client and the HTTP streams of both keep running on the other core meanwhile, as they do for one; what they cost
is in both batches' seconds. ``interleave_steps`` is the same rule for decoders stepped by one thread, without
a server (``bench/adaptive_closed.py --interleave``).
"""

from __future__ import annotations

import threading
import time
from typing import Sequence

from draftsmith.core.batch import BatchDecoder


class Turnstile:
    """Lets schedulers step one at a time (``serve.scheduler.StepGate``; module docstring).

    ``enter`` blocks while another holds the device, or while another waiting scheduler has spent fewer seconds
    stepping since ``reset``; ``leave`` frees it. Each wait is kept as a (start, end) interval in
    ``time.perf_counter()`` seconds per owner, for ``waited``."""

    def __init__(self):
        self._cond = threading.Condition()
        self._busy = False
        self._spent: dict[int, float] = {}  # id(owner) -> seconds stepped since reset
        self._waiting: set[int] = set()
        self._waits: dict[int, list[tuple[float, float]]] = {}

    def reset(self) -> None:
        """Forget the seconds stepped and the waits (a new pair of batches begins)."""
        with self._cond:
            self._spent.clear()
            self._waits.clear()

    def enter(self, owner: object) -> float:
        """Block until ``owner`` may step; returns the seconds it waited."""
        key, t0 = id(owner), time.perf_counter()
        with self._cond:
            self._waiting.add(key)
            while self._busy or key != min(self._waiting, key=lambda k: (self._spent.get(k, 0.0), k)):
                self._cond.wait()
            self._waiting.discard(key)
            self._busy = True
            t1 = time.perf_counter()
            self._waits.setdefault(key, []).append((t0, t1))
        return t1 - t0

    def leave(self, owner: object, seconds: float) -> None:
        """``owner``'s step is over and took ``seconds``: the next waiting scheduler may step."""
        with self._cond:
            self._spent[id(owner)] = self._spent.get(id(owner), 0.0) + seconds
            self._busy = False
            self._cond.notify_all()

    def spent(self, owner: object) -> float:
        """Seconds ``owner`` stepped since ``reset``."""
        with self._cond:
            return self._spent.get(id(owner), 0.0)

    def waited(self, owner: object, start: float, end: float) -> float:
        """Seconds ``owner`` waited to step within [start, end] (``time.perf_counter()`` seconds)."""
        with self._cond:
            waits = list(self._waits.get(id(owner), ()))
        return sum(max(0.0, min(b, end) - max(a, start)) for a, b in waits)


def interleave_steps(decoders: Sequence[BatchDecoder]) -> list[float]:
    """Step ``decoders`` from this thread until none has work, each step going to the one with work that has
    stepped the fewest seconds so far (``Turnstile``'s rule); returns each one's seconds. Each step is left out of
    the others' ``between_s`` (``BatchDecoder.exclude``): auto prices the time between ITS steps."""
    spent = [0.0] * len(decoders)
    while any(d.has_work for d in decoders):
        i = min((j for j, d in enumerate(decoders) if d.has_work), key=lambda j: spent[j])
        t0 = time.perf_counter()
        decoders[i].step()
        took = time.perf_counter() - t0
        spent[i] += took
        for j, other in enumerate(decoders):
            if j != i:
                other.exclude(took)
    return spent
