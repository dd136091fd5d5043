"""``draftsmith bench``'s settings, command line and checks (torch-free: the CLI refuses bad arguments, missing
models and heads before torch is imported). ``evaluation.bench`` runs the benchmark."""

from __future__ import annotations

import argparse
from dataclasses import dataclass, field
from pathlib import Path

from draftsmith import arguments as arg
from draftsmith import drafters, reference
from draftsmith.core.tree_shape import TreeShape
from draftsmith.drafters.speculative import recorded_head_type
from draftsmith.reference import TASK_NAMES
from draftsmith.sources import ModelSourceError, check_head_dir, check_model_source

BASELINE = "none"
#: an A/A control: a second no-speculation server, measured as a method (``BenchConfig.control``)
CONTROL = "none-control"
TREE_SUFFIX = "+tree"  #: a method drafting trees of ``BenchConfig.tree``: ``eagle3+tree``
K_MARK = "@"  #: a k sweep's method names: ``eagle3@k3``, ``eagle3@auto`` (``BenchConfig.k`` with several values)


HF_BASELINE = "hf:plain"


@dataclass
class BenchConfig:
    """What ``draftsmith bench`` measures.

    Attributes:
        target: the target's name or path (``reference`` = the embedded one); its tokenizer renders prompts.
        methods: in-process servers to start: 'none' (no speculation) and drafter names; None = 'none', the
            head's drafter (when ``head`` is an export) and every drafter that needs no trained export.
        urls: running servers to measure instead of starting any (their /v1/models names the method).
        k: num_speculative_tokens: an integer, ``"auto"`` (adaptive speculation), or several of them: each method
            then runs once per value, named ``METHOD@kK`` / ``METHOD@auto`` (a tree twin: ``METHOD+tree`` at its own
            depth, and ``METHOD+tree@auto`` when ``auto`` is swept).
        tree: a draft tree (``core.tree_shape.TreeShape`` text, e.g. ``topk=4,num_steps=5,num_draft_tokens=32``):
            each method that drafts trees also runs as ``METHOD+tree`` with it (None: chains only).
        head: an exported drafter directory, or several (one per drafter: each is the row of the method its
            draftsmith.json records).
        draft_model: the model of drafters that draft with a plain causal LM, and the HF assistant.
        prompt_lookup_min, prompt_lookup_max: n-gram lookup bounds (and HF's max_matching_ngram_size).
        num_prompts, tasks: prompts taken round robin from these held-out tasks.
        max_tokens: completion length asked per request.
        concurrency: the levels of requests in flight per server, sorted and unique, each >= 1 (an int is taken
            as one level); at level c a batch sends ``max(num_prompts, c)`` requests (prompts cycled).
        rounds: repetitions (interleaved across methods); throughput is the median over rounds. One value for
            every level, or one per level in ascending order of concurrency (a short batch at high concurrency
            is noisier than a long one at c = 1 and costs less to repeat: ``rounds_at``).
        baseline_every: the no-speculation server's batches interleaved with the others (paired measurement):
            in each round at each level, one plain batch first and one more after every ``baseline_every`` batches
            of the other servers; each such batch's speedup is its tokens/s ÷ the geometric mean of the plain
            batches just before and after it, so a shared machine's slow drift cancels. 1 (default) brackets
            every batch (plain runs about as many batches as all the others together); 0: plain runs once per
            round in the rotation, and a batch is compared with plain's batch of the same round.
        threads: ``torch.set_num_threads`` for the whole run. dtype, device: of the in-process target.
        onednn: the in-process engines' linear kernels (``serve.engine.Engine``, ``core.onednn``): auto (as
            ``draftsmith serve``), on, or off (MKL).
        max_model_len: the in-process engines' limit (memory plan). hf_peer: also run HF assisted generation.
        control: also serve ``CONTROL``, a second no-speculation engine measured as a method (an A/A test): its
            speedup over the baseline is what this bench reads for a method equal to plain decoding, so its spread
            is the resolution of every other speedup in the run (in-process servers only).
        interleave: each batch runs at once with a plain batch of the same requests, the two in-process engines
            stepping in turn, and each is timed by its own seconds (``evaluation/interleave.py``): the pair meets
            the machine over the same seconds, where bracketing batches meet it seconds apart (in-process
            servers only; ``baseline_every`` is then unused).
        out: directory for report.json, table.md, bench.png.
    """

    target: str = "reference"
    methods: list[str] | None = None
    urls: list[str] = field(default_factory=list)
    k: "int | str | list" = 5
    tree: str | None = None
    head: str | list[str] | None = "runs/reference-eagle3/head"
    draft_model: str = "reference-draft"
    prompt_lookup_min: int = 2
    prompt_lookup_max: int = 5
    num_prompts: int = 8
    tasks: list[str] = field(default_factory=lambda: list(TASK_NAMES))
    max_tokens: int = 64
    concurrency: tuple[int, ...] = (1,)
    rounds: "int | tuple[int, ...]" = 3
    baseline_every: int = 1
    threads: int = 2
    dtype: str = "float32"
    device: str = "cpu"
    onednn: str = "auto"
    max_model_len: int | None = None
    hf_peer: bool = False
    control: bool = False
    interleave: bool = False
    out: str = "runs/bench"

    def __post_init__(self):
        self.concurrency = normalize_concurrency(self.concurrency)
        values = self.k if isinstance(self.k, (list, tuple)) else [self.k]
        if not values or any(v != "auto" and (isinstance(v, bool) or not isinstance(v, int) or v < 1) for v in values):
            raise ValueError(f"k {self.k!r}: pass integers >= 1 or 'auto', e.g. --k 1 3 5 8 auto")
        self.k = values[0] if len(values) == 1 else list(dict.fromkeys(values))
        rounds = [self.rounds] if isinstance(self.rounds, int) else list(self.rounds)
        if not rounds or any(isinstance(r, bool) or not isinstance(r, int) or r < 1 for r in rounds):
            raise ValueError(f"rounds {self.rounds!r}: pass integers >= 1, e.g. --rounds 3")
        if len(rounds) not in (1, len(self.concurrency)):
            raise ValueError(
                f"rounds {rounds}: give one value, or one per concurrency level ({len(self.concurrency)}: "
                f"{list(self.concurrency)}, ascending)"
            )
        self.rounds = rounds[0] if len(rounds) == 1 else tuple(rounds)
        if isinstance(self.baseline_every, bool) or not isinstance(self.baseline_every, int) or self.baseline_every < 0:
            raise ValueError(
                f"baseline_every {self.baseline_every!r}: pass an integer >= 0 (1: a plain batch between every two "
                f"batches; 0: one plain batch per round)"
            )
        if self.tree is not None:
            self.tree = str(TreeShape.parse(self.tree))  # refuses a bad shape now
        if self.onednn not in ("auto", "on", "off"):
            raise ValueError(f"onednn {self.onednn!r}: pass auto, on or off")
        if self.control and self.urls:
            raise ValueError("--control starts a second in-process plain server; it cannot measure --url servers")
        if self.interleave and self.urls:
            raise ValueError(
                "--interleave steps in-process engines in turn; it cannot measure --url servers (drop one of the two)"
            )


def rounds_at(cfg: BenchConfig, concurrency: int) -> int:
    """Rounds measured at ``concurrency`` (one of ``cfg.concurrency``; another level gets the most rounds)."""
    if isinstance(cfg.rounds, int):
        return cfg.rounds
    return dict(zip(cfg.concurrency, cfg.rounds)).get(concurrency, max(cfg.rounds))


def swept_ks(cfg: BenchConfig) -> list:
    """The k values of a sweep (``cfg.k`` a list), else []."""
    return list(cfg.k) if isinstance(cfg.k, list) else []


def fixed_k(cfg: BenchConfig) -> int:
    """An integer k for what cannot adapt (the HF peer): ``cfg.k``, a sweep's first integer, else 5."""
    values = swept_ks(cfg) or [cfg.k]
    return next((v for v in values if isinstance(v, int)), 5)


def method_k(method: str, cfg: BenchConfig) -> "int | str":
    """The k a bench method runs with: its ``@kK`` / ``@auto`` mark, else ``cfg.k``."""
    if K_MARK in method:
        mark = method.split(K_MARK, 1)[1]
        return "auto" if mark == "auto" else int(mark.removeprefix("k"))
    return cfg.k


def base_method(method: str) -> str:
    """The drafter a bench method runs (``eagle3+tree`` / ``eagle3@k3`` -> ``eagle3``; the A/A control -> none)."""
    if method == CONTROL:
        return BASELINE
    return method.split(K_MARK, 1)[0].removesuffix(TREE_SUFFIX)


def bench_methods(cfg: BenchConfig) -> list[str]:
    """The in-process servers: ``cfg.methods`` (default ``default_methods``), each tree-drafting one followed by its
    ``+tree`` twin when ``cfg.tree`` is set; the A/A control after the baseline with ``cfg.control``.

    Raises:
        ValueError: ``cfg.tree`` set but no method drafts trees; ``cfg.control`` or ``cfg.interleave`` without the
            baseline."""
    out = []
    sweep = swept_ks(cfg)
    methods = cfg.methods or default_methods(cfg)
    if cfg.control and BASELINE not in methods:
        raise ValueError(f"--control is measured against the baseline: add {BASELINE} to --methods")
    if cfg.interleave and BASELINE not in methods:
        raise ValueError(f"--interleave runs each batch at once with the baseline's: add {BASELINE} to --methods")
    for method in methods:
        if method == BASELINE:
            out += [BASELINE, CONTROL] if cfg.control else [BASELINE]
        elif not sweep:
            out.append(method)
        else:
            out += [f"{method}{K_MARK}{'auto' if k == 'auto' else f'k{k}'}" for k in sweep]
        if cfg.tree and method != BASELINE and drafters.config_module(method).RULES.drafts_trees:
            out.append(method + TREE_SUFFIX)
            if "auto" in sweep:
                out.append(f"{method}{TREE_SUFFIX}{K_MARK}auto")
    if cfg.tree and not any(m.endswith(TREE_SUFFIX) for m in out):
        tree_methods = [n for n in drafters.names() if drafters.config_module(n).RULES.drafts_trees]
        raise ValueError(
            f"--tree: none of the methods drafts trees ({', '.join(out)}); add {' or '.join(tree_methods)}"
        )
    return out


def normalize_concurrency(value) -> tuple[int, ...]:
    """``value`` (an int or ints) as a sorted tuple of unique ints >= 1.

    Raises:
        ValueError: empty, not integers, or a level below 1.
    """
    levels = [value] if isinstance(value, int) else list(value)
    if not levels or any(isinstance(c, bool) or not isinstance(c, int) for c in levels):
        raise ValueError(f"concurrency {value!r}: pass one or more integers, e.g. --concurrency 1 4 16 32")
    if min(levels) < 1:
        raise ValueError(f"concurrency {value!r}: every level must be >= 1 (requests in flight)")
    return tuple(sorted(set(levels)))


def heads(cfg: BenchConfig) -> list[str]:
    """The exported directories ``cfg.head`` names (none, one or several)."""
    if not cfg.head:
        return []
    return [cfg.head] if isinstance(cfg.head, str) else list(cfg.head)


def head_for(cfg: BenchConfig, method: str) -> str | None:
    """The head among ``cfg.head`` whose recorded drafter is ``method`` (None: none is)."""
    return next((h for h in heads(cfg) if recorded_head_type(h) == method), None)


def default_methods(cfg: BenchConfig) -> list[str]:
    """'none', the heads' drafters (of ``cfg.head`` exports) and every drafter needing no trained export."""
    rows = [BASELINE]
    for head in heads(cfg):
        head_type = recorded_head_type(head)
        if head_type and head_type not in rows:
            rows.append(head_type)
    for name in drafters.names():
        rules = drafters.config_module(name).RULES
        if name not in rows and (not rules.needs_model or rules.model_kind == "model"):
            rows.append(name)
    return rows


def speculative_config(method: str, cfg: BenchConfig) -> dict | None:
    """The vLLM-style JSON for a method name ('none' -> None): the head when it is that drafter's export, else
    ``cfg.draft_model`` for drafters of a plain causal LM; the drafter's own keys from the bench's flags.

    Raises FileNotFoundError for a drafter that needs an export ``cfg.head`` is not; ValueError for an unknown
    method."""
    if base_method(method) == BASELINE:
        return None
    k = method_k(method, cfg)
    if TREE_SUFFIX in method:
        spec = speculative_config(base_method(method), cfg)
        spec.pop("num_speculative_tokens")
        return {
            **spec,
            "tree": TreeShape.parse(cfg.tree).to_dict(),
            **({"num_speculative_tokens": k} if k == "auto" else {}),
        }
    method = base_method(method)
    drafters.check_name(method, "bench method")
    rules = drafters.config_module(method).RULES
    spec = {
        "method": method,
        "num_speculative_tokens": k,
        **{key: getattr(cfg, key) for key in rules.options if getattr(cfg, key, None) is not None},
    }
    if not rules.needs_model:
        return spec
    head = head_for(cfg, method)
    if head:
        return {**spec, "model": head}
    if rules.model_kind == "model":
        return {**spec, "model": cfg.draft_model}
    raise FileNotFoundError(
        f"method {method} needs its exported directory (--head), got {cfg.head!r}; train one "
        f"(draftsmith train) or leave {method} out of --methods"
    )


def build_parser(parser: argparse.ArgumentParser | None = None) -> argparse.ArgumentParser:
    """The bench's arguments (``draftsmith bench``); values
    are checked by ``draftsmith.arguments`` types at parse time, the rest by ``check_config``."""

    d = BenchConfig()
    p = parser or arg.ArgumentParser(
        prog="draftsmith bench", description="serving benchmark with vs without speculation"
    )
    p.add_argument("--target", default=d.target)
    p.add_argument(
        "--methods",
        nargs="+",
        default=d.methods,
        choices=[BASELINE, *drafters.names()],
        help="servers to start: none (no speculation) and drafters (default: none, the head's drafter and "
        "every drafter needing no trained export)",
    )
    p.add_argument(
        "--url", dest="urls", action="append", default=[], type=arg.url, help="a running server (repeatable)"
    )
    p.add_argument(
        "--k",
        nargs="+",
        type=arg.k_value,
        default=[d.k],
        help="num_speculative_tokens: an integer or auto (adaptive); several values run each method once per "
        "value (METHOD@k3, METHOD@auto)",
    )
    p.add_argument(
        "--tree",
        type=_tree,
        default=d.tree,
        metavar="topk=T,num_steps=D,num_draft_tokens=N",
        help="also run each tree-drafting method (eagle3, dflash) as METHOD+tree with this EAGLE-2 / DDTree shape",
    )
    p.add_argument(
        "--head", nargs="+", default=d.head, help="exported drafter directories (one per trained method: eagle3, ...)"
    )
    p.add_argument("--draft-model", default=d.draft_model)
    p.add_argument("--prompt-lookup-min", type=arg.positive_int, default=d.prompt_lookup_min)
    p.add_argument("--prompt-lookup-max", type=arg.positive_int, default=d.prompt_lookup_max)
    p.add_argument("--num-prompts", type=arg.positive_int, default=d.num_prompts)
    p.add_argument("--tasks", nargs="+", default=d.tasks, choices=TASK_NAMES)
    p.add_argument("--max-tokens", type=arg.positive_int, default=d.max_tokens)
    p.add_argument(
        "--concurrency",
        nargs="+",
        type=arg.positive_int,
        default=list(d.concurrency),
        help="requests in flight per server, one or more levels (e.g. 1 4 16 32); each level sends "
        "max(--num-prompts, c) requests, cycling the prompts",
    )
    p.add_argument(
        "--rounds",
        nargs="+",
        type=arg.positive_int,
        default=[d.rounds],
        help="repetitions per concurrency level: one value, or one per level in ascending order (e.g. 2 5 4 "
        "with --concurrency 1 8 32)",
    )
    p.add_argument(
        "--baseline-every",
        type=arg.int_at_least(0),
        default=d.baseline_every,
        help="a no-speculation batch after every N batches of the other servers (paired speedups; default 1: "
        "every batch between two plain ones); 0: one plain batch per round",
    )
    p.add_argument("--threads", type=arg.positive_int, default=d.threads)
    p.add_argument("--dtype", type=arg.dtype, default=d.dtype, help=", ".join(arg.DTYPE_NAMES))
    p.add_argument("--device", default=d.device)
    p.add_argument(
        "--onednn",
        choices=["auto", "on", "off"],
        default=d.onednn,
        help="the in-process engines' float32 CPU linears through oneDNN with packed weights, as draftsmith serve "
        "(default auto), or MKL (off)",
    )
    p.add_argument("--max-model-len", type=arg.positive_int, default=d.max_model_len)
    p.add_argument("--hf-peer", action="store_true", help="also run transformers assisted generation")
    p.add_argument(
        "--control",
        action="store_true",
        help=f"also serve a second plain server, {CONTROL}, measured as a method (an A/A test): its speedup is "
        "what the bench reads for a method equal to plain, the resolution of the other speedups",
    )
    p.add_argument(
        "--interleave",
        action="store_true",
        help="run each batch at once with a plain batch, the in-process engines stepping in turn, each timed by "
        "its own seconds (a paired speedup over the same seconds of a drifting machine)",
    )
    p.add_argument("--out", default=d.out)
    return p


def _tree(text: str) -> str:
    """An argparse type: a tree shape (``TreeShape.parse``), kept as its text."""
    try:
        return str(TreeShape.parse(text))
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def check_config(cfg: BenchConfig) -> None:
    """Refuse, before torch is imported, what would fail only after the target is loaded: a target, head or
    draft model that is missing (``draftsmith.sources``), lookup bounds in the wrong order, more prompts than
    the tasks hold, an ``out`` that is a file.

    Raises:
        ModelSourceError (an OSError): a model or head. ValueError: the other values.
    """

    if cfg.prompt_lookup_min > cfg.prompt_lookup_max:
        raise ValueError(
            f"--prompt-lookup-min {cfg.prompt_lookup_min} > --prompt-lookup-max {cfg.prompt_lookup_max}; "
            f"pass min <= max"
        )
    sizes = [sum(1 for _ in (reference.TASKS_DIR / f"{t}.jsonl").open()) for t in cfg.tasks]
    available = next(
        i
        for i in range(sum(sizes) + 1)  # prompt i: task i % n, record i // n
        if i == sum(sizes) or i // len(sizes) >= sizes[i % len(sizes)]
    )
    if cfg.num_prompts > available:
        raise ValueError(
            f"--num-prompts {cfg.num_prompts}: tasks {', '.join(cfg.tasks)} give {available} prompts "
            f"round robin; pass --num-prompts <= {available} or more --tasks"
        )
    if Path(cfg.out).exists() and not Path(cfg.out).is_dir():
        raise ValueError(f"--out {cfg.out!r} is a file; pass a directory for report.json, table.md and bench.png")
    check_model_source(cfg.target, role="target")
    methods = [] if cfg.urls else [base_method(m) for m in bench_methods(cfg)]
    exports = [
        m
        for m in methods
        if m != BASELINE
        and drafters.config_module(m).RULES.model_kind == "export"
        and drafters.config_module(m).RULES.needs_model
    ]
    for head in heads(cfg) if exports else []:
        check_head_dir(
            head,
            role=f"--head (method {', '.join(exports)})",
            hint=f"train one (draftsmith train RECIPE) or leave {' / '.join(exports)} out of --methods",
        )
    for method in exports:
        if head_for(cfg, method) is None:
            raise ModelSourceError(
                f"method {method} needs its exported directory (--head DIR; given: {heads(cfg) or 'none'}); "
                f"train one (draftsmith train) or leave {method} out of --methods"
            )
    plain_lm = [m for m in methods if m != BASELINE and drafters.config_module(m).RULES.model_kind == "model"]
    if cfg.draft_model and (cfg.hf_peer or plain_lm):
        check_model_source(cfg.draft_model, role="--draft-model")


def config_from_args(args: argparse.Namespace) -> BenchConfig:
    """A ``BenchConfig`` from parsed ``build_parser`` arguments."""
    names = {f for f in BenchConfig.__dataclass_fields__}
    return BenchConfig(**{k: v for k, v in vars(args).items() if k in names})
