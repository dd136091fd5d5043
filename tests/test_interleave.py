"""The bench's interleaved measurement: a turnstile that lets engines step in turn, the least-stepped first, and
the in-process bench that runs each batch at once with a plain one, each timed by its own seconds."""

import threading
import time

import pytest

from draftsmith.evaluation.bench import run_bench
from draftsmith.evaluation.bench_config import BenchConfig, bench_methods
from draftsmith.evaluation.interleave import Turnstile


def _wait_until(condition, timeout=10.0):
    end = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < end, "timed out"
        time.sleep(0.001)


def test_the_turnstile_lets_the_least_stepped_waiter_go_first_and_keeps_each_wait():
    turnstile = Turnstile()
    a, b, c = object(), object(), object()
    for owner, seconds in ((b, 0.5), (c, 0.2)):  # b has stepped more than c since the reset
        assert turnstile.enter(owner) >= 0.0
        turnstile.leave(owner, seconds)
    turnstile.enter(a)  # a holds the device: b and c queue
    order = []

    def step(owner, name):
        turnstile.enter(owner)
        order.append(name)
        turnstile.leave(owner, 0.01)

    threads = [threading.Thread(target=step, args=(o, n)) for o, n in ((b, "b"), (c, "c"))]
    for t in threads:
        t.start()
    _wait_until(lambda: len(turnstile._waiting) == 2)
    start = time.perf_counter()
    turnstile.leave(a, 1.0)
    for t in threads:
        t.join(10)
    assert order == ["c", "b"]  # the fewest seconds stepped goes first
    assert turnstile.spent(c) == pytest.approx(0.21) and turnstile.spent(a) == pytest.approx(1.0)
    assert turnstile.waited(b, 0.0, time.perf_counter()) > 0.0  # it queued behind a and c
    assert turnstile.waited(b, 0.0, start - 10.0) == 0.0  # nothing before the window's end
    turnstile.reset()
    assert turnstile.spent(b) == 0.0 and turnstile.waited(b, 0.0, time.perf_counter()) == 0.0


def test_a_scheduler_steps_through_its_gate_and_leaves_the_wait_out_of_between(monkeypatch):
    """Every step of an engine with a gate enters and leaves it once, and the decoder excludes what it waited."""
    from draftsmith.core.batch import BatchDecoder
    from draftsmith.core.generate import GenerationConfig
    from draftsmith.models import load_causal_lm
    from draftsmith.serve.engine import Engine

    class Gate:
        def __init__(self):
            self.entered, self.left = 0, []

        def enter(self, owner):
            self.entered += 1
            return 0.25

        def leave(self, owner, seconds):
            self.left.append(seconds)

    excluded = []
    exclude = BatchDecoder.exclude
    monkeypatch.setattr(BatchDecoder, "exclude", lambda self, s: (excluded.append(s), exclude(self, s)))
    model, tok = load_causal_lm("reference", role="target")
    engine = Engine(model, tok, None, model_name="reference")
    gate = engine.scheduler.gate = Gate()
    try:
        result = engine.generate([1, 2, 3], GenerationConfig(max_new_tokens=5, temperature=0.0))
    finally:
        engine.close()
    assert len(result.tokens) == 5 and gate.entered == len(gate.left) >= 4  # the first step prefills and decodes
    assert all(s > 0 for s in gate.left) and excluded == [0.25] * gate.entered


def test_the_interleaved_bench_runs_each_batch_at_once_with_a_plain_batch(tmp_path):
    """``--interleave`` on the reference target: each method's batch is paired with the plain batch run at once
    (its before and after), both are timed by their own seconds (wall time less the other's steps), responses still
    equal plain's, and a config that cannot interleave is refused."""
    from draftsmith.evaluation import bench

    seen = []
    measure = bench._measure

    async def spy(servers, prompts, cfg, gates=None):
        results, alone = await measure(servers, prompts, cfg, gates)
        seen.append((results, gates))
        return results, alone

    cfg = BenchConfig(
        target="reference",
        methods=["none", "ngram"],
        head=None,
        k=3,
        num_prompts=2,
        max_tokens=8,
        concurrency=[2],
        rounds=2,
        threads=1,
        control=True,
        interleave=True,
        out=str(tmp_path / "bench"),
    )
    original, bench._measure = bench._measure, spy
    try:
        report = run_bench(cfg)
    finally:
        bench._measure = original
    ((results, gates),) = seen
    assert set(gates) == {"none", "none-control", "ngram"} and len({id(s.gate) for s in gates.values()}) == 1
    plain = results["none"][2]
    assert len(plain) == 4  # one plain batch per other batch, run at once with it
    for name in ("none-control", "ngram"):
        for batch in results[name][2]:
            assert batch.before is batch.after and any(batch.before is p for p in plain)
            assert abs(batch.started_s - batch.before.started_s) < 1.0  # they started together
    assert any(b.waited_s > 0 for b in plain) and all(b.own_s <= b.wall_s for b in plain)
    assert report["config"]["interleave"] is True
    for method in report["methods"].values():
        row = method["per_concurrency"][0]
        assert row["failed"] == 0 and row["greedy_mismatches"] == 0 and row["speedup"] is not None
    with pytest.raises(ValueError, match="--interleave"):
        BenchConfig(interleave=True, urls=["http://127.0.0.1:1"])
    with pytest.raises(ValueError, match="add none"):
        bench_methods(BenchConfig(methods=["ngram"], interleave=True))
