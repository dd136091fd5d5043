"""Two bars of `draftsmith serve`, measured on a real server process (`python -m draftsmith.cli serve`):

    health    8 streams decoding, then one 4 MB prompt: how long /health takes while that prompt is read,
              tokenized and refused (bar: under 1 s; tokenizing runs off the event loop)
    shutdown  SIGTERM with 16 requests queued behind the running ones: seconds until the process exits, and what
              each client got (bar: exit within 10 s; every request answered 503 or a stream's error + [DONE])

Run: python bench/serve_robustness.py [health|shutdown|both] [--target reference] [--threads 1]
The server runs with OMP_NUM_THREADS=--threads and this process's niceness; it prints one JSON line per bar.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx

from draftsmith.arguments import ArgumentParser, positive_int, run_guarded

SRC = Path(__file__).resolve().parents[1] / "src"
PROMPT = "def reverse(items):\n    "


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Server:
    """``draftsmith serve`` in a subprocess on a free loopback port; ``url``, ``proc``."""

    def __init__(self, target: str, threads: int, *flags: str):
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        env = os.environ | {
            "OMP_NUM_THREADS": str(threads),
            "PYTHONPATH": os.pathsep.join([str(SRC), *filter(None, [os.environ.get("PYTHONPATH")])]),
            "HF_HUB_OFFLINE": "1",
        }
        cmd = [sys.executable, "-m", "draftsmith.cli", "serve", "--target", target, "--port", str(self.port), *flags]
        self.proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        self.log: list[str] = []
        threading.Thread(target=lambda: self.log.extend(self.proc.stdout), daemon=True).start()

    def wait_ready(self, timeout: float = 300.0) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError("the server exited while starting:\n" + "".join(self.log[-30:]))
            try:
                if httpx.get(self.url + "/health", timeout=1).status_code == 200:
                    return
            except httpx.TransportError:
                pass
            time.sleep(0.2)
        raise RuntimeError(f"the server did not answer /health within {timeout:.0f} s")

    def gauges(self) -> tuple[float, float]:
        """(running, waiting) from /metrics."""
        text = httpx.get(self.url + "/metrics", timeout=10).text
        values = {}
        for line in text.splitlines():
            for name in ("num_requests_running", "num_requests_waiting"):
                if line.startswith(f"draftsmith:{name} "):
                    values[name] = float(line.split()[1])
        return values.get("num_requests_running", 0.0), values.get("num_requests_waiting", 0.0)

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                self.proc.kill()


def stream_worker(url: str, body: dict, out: list, i: int) -> None:
    """POST ``body``; ``out[i]`` = (status, last SSE data lines or the JSON body)."""
    try:
        with httpx.stream("POST", url + "/v1/completions", json=body, timeout=600) as r:
            text = r.read().decode()
        if body.get("stream"):
            data = [line[6:] for line in text.splitlines() if line.startswith("data: ")]
            out[i] = (r.status_code, data[-2:])
        else:
            out[i] = (r.status_code, text[:300])
    except httpx.HTTPError as e:
        out[i] = ("transport error", repr(e))


def wait_for(condition, timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            raise RuntimeError(f"timed out waiting for {what}")
        time.sleep(0.05)


def bench_health(target: str, threads: int, streams: int = 8, prompt_mb: float = 4.0) -> dict:
    server = Server(target, threads)
    try:
        server.wait_ready()
        out = [None] * streams
        done = threading.Event()
        body = {"prompt": PROMPT, "max_tokens": 1500, "temperature": 0.8, "stream": True}

        def keep_streaming(i: int) -> None:  # a stream that ends (EOS) is followed by the next one
            while not done.is_set():
                stream_worker(server.url, body | {"seed": i}, out, i)

        workers = [threading.Thread(target=keep_streaming, args=(i,), daemon=True) for i in range(streams)]
        for w in workers:
            w.start()
        wait_for(lambda: server.gauges()[0] == streams, 120, f"{streams} running streams")
        baseline = []
        for _ in range(20):
            t0 = time.perf_counter()
            httpx.get(server.url + "/health", timeout=30)
            baseline.append(time.perf_counter() - t0)
            time.sleep(0.05)
        src = (SRC / "draftsmith" / "serve" / "server.py").read_text()
        size = int(prompt_mb * 1e6)
        big = {"prompt": (src * (size // len(src) + 1))[:size], "max_tokens": 16}
        result = {}

        def send_big():
            t0 = time.perf_counter()
            r = httpx.post(server.url + "/v1/completions", json=big, timeout=600)
            result.update(status=r.status_code, seconds=time.perf_counter() - t0, code=r.json()["error"]["code"])

        sender = threading.Thread(target=send_big)
        sender.start()
        during = []
        while sender.is_alive():
            t0 = time.perf_counter()
            httpx.get(server.url + "/health", timeout=30)
            during.append(time.perf_counter() - t0)
            time.sleep(0.02)
        sender.join()
        still_running = server.gauges()[0]
        done.set()
        return {
            "bar": "health under a 4 MB prompt",
            "streams": streams,
            "prompt_bytes": size,
            "big_request": result,
            "streams_running_after": still_running,
            "health_polls_during": len(during),
            "health_max_s": round(max(during), 4),
            "health_median_s": round(statistics.median(during), 4),
            "health_baseline_max_s": round(max(baseline), 4),
            "ok": max(during) < 1.0,
        }
    finally:
        server.stop()


def bench_shutdown(target: str, threads: int, queued: int = 16, running: int = 2) -> dict:
    server = Server(target, threads, "--max-num-seqs", str(running))
    try:
        server.wait_ready()
        n = queued + running
        out = [None] * n
        workers = []
        for i in range(n):
            body = {"prompt": PROMPT, "max_tokens": 1500, "temperature": 0.8, "seed": i, "stream": i % 3 == 0}
            workers.append(threading.Thread(target=stream_worker, args=(server.url, body, out, i), daemon=True))
            workers[-1].start()
        wait_for(lambda: server.gauges() == (running, queued), 120, f"{running} running and {queued} waiting")
        t0 = time.perf_counter()
        server.proc.send_signal(signal.SIGTERM)
        server.proc.wait(60)
        exit_s = time.perf_counter() - t0
        for w in workers:
            w.join(30)
        answered = {"503": 0, "stream error + [DONE]": 0, "completed": 0, "other": []}
        for status, detail in out:
            if status == 503 and "server_shutting_down" in detail:
                answered["503"] += 1
            elif status == 200 and isinstance(detail, list) and detail[-1] == "[DONE]":
                answered["stream error + [DONE]" if "server_shutting_down" in detail[0] else "completed"] += 1
            elif status == 200:
                answered["completed"] += 1  # ended (EOS) before the signal
            else:
                answered["other"].append((status, detail))
        return {
            "bar": "SIGTERM with queued requests",
            "running": running,
            "queued": queued,
            "exit_s": round(exit_s, 3),
            "returncode": server.proc.returncode,
            "answered": answered,
            "ok": exit_s < 10 and not answered["other"],
        }
    finally:
        server.stop()


def main(argv=None) -> None:
    p = ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("which", nargs="?", choices=["health", "shutdown", "both"], default="both")
    p.add_argument("--target", default="reference")
    p.add_argument("--threads", type=positive_int, default=1, help="the server's OMP_NUM_THREADS")
    a = p.parse_args(argv)
    if a.which in ("health", "both"):
        print(json.dumps(bench_health(a.target, a.threads)), flush=True)
    if a.which in ("shutdown", "both"):
        print(json.dumps(bench_shutdown(a.target, a.threads)), flush=True)


if __name__ == "__main__":
    sys.exit(run_guarded("bench/serve_robustness.py", main))
