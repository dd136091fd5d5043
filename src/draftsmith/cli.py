"""``draftsmith <verb>``: the command line over the pipeline stages.

    draftsmith demo                                   # the main job on the reference target
    draftsmith drafters                               # the registered drafters
    draftsmith prepare RECIPE [key=value ...]         # conversations + vocab map -> runs/NAME/data
    draftsmith capture RECIPE [key=value ...]         # offline hidden-state shards -> runs/NAME/capture
    draftsmith train RECIPE [key=value ...]           # prepare, train, export the drafter -> runs/NAME/head
    draftsmith export RUN_DIR|HEAD --out DIR [--format draftsmith|vllm|sglang|speculators|all ...]
    draftsmith check HEAD --target T [--dtype D] [--allow-mismatch FIELD ...] [--tensor-parallel-size N]
    draftsmith push HEAD --repo-id ORG/NAME [--private] [--revision BRANCH] [--dry-run]
    draftsmith eval --head HEAD [--target T] [--methods ...] [--drafter LABEL=JSON ...] [--k 5] [--tasks ...]
    draftsmith generate --target T [--speculative-config JSON] --prompt TEXT
    draftsmith serve --target T [--speculative-config JSON] [--host 127.0.0.1] [--port 8000] [--api-key KEY]
    draftsmith bench --target T [--methods none eagle3 ngram draft_model] [--k 5] [--head HEAD] [--hf-peer]
                     [--concurrency 1 4 16 32]

RECIPE defaults to the packaged ``recipes/reference/eagle3.yaml``; overrides are dotted
(``train.lr=1e-4``). Every recipe file starts with its exact launch command.

Errors: every verb answers a mistake with one line on stderr, ``draftsmith VERB: error: <problem>; <fix>``,
and exit status 1 (2 for a malformed argument, 130 after Ctrl+C); ``-v`` (before or after the verb) or
``DRAFTSMITH_TRACEBACK=1`` also prints the traceback. The messages are made where the error is raised;
``main`` only catches them and, for an operating-system error that carries no message of ours, names the
path and the fix by its kind. What can be checked without torch is checked before any verb imports it
(``check_args``): argument values (``draftsmith.arguments``), the recipe file and its YAML
(``config.read_config_data``), local targets, draft models and head directories (``draftsmith.sources``),
the serving port.
"""

from __future__ import annotations

import argparse
import ipaddress
import json
import logging
import os
import sys
from pathlib import Path

from draftsmith import arguments as arg
from draftsmith import drafters
from draftsmith.config import from_dict, read_config_data
from draftsmith.core.tree_shape import TreeShape
from draftsmith.drafters.speculative import check_speculative_models
from draftsmith.evaluation.bench_config import build_parser as bench_parser
from draftsmith.evaluation.bench_config import check_config, config_from_args
from draftsmith.pipeline.recipe import Recipe
from draftsmith.reference import TASK_NAMES
from draftsmith.serve import API_KEY_ENV, DEFAULT_MAX_REQUEST_BYTES
from draftsmith.sources import ModelSourceError, check_head_dir, check_model_source, is_head_dir

PACKAGE_DIR = Path(__file__).resolve().parent
DEFAULT_RECIPE = PACKAGE_DIR / "recipes" / "reference" / "eagle3.yaml"
TRACEBACK_ENV = arg.TRACEBACK_ENV  #: set to 1 to print the traceback of an error (as -v does)
#: After Ctrl+C: what rerunning a verb does.
_TRAIN_RESUMES = (
    "rerun the same command: training resumes from its last checkpoint (written every train.ckpt_every steps)"
)
RESUME = {
    "capture": "rerun the same command: finished shards are verified and kept, the capture resumes",
    "train": _TRAIN_RESUMES,
    "demo": _TRAIN_RESUMES,
    "serve": "the server stopped (requests still queued or running were answered 503)",
}


def _recipe(args, check: bool = True):
    """The verb's recipe: ``args.recipe_data`` (read and overridden by ``check_args``, torch-free) as a typed
    ``Recipe``; the models it names are checked (``check_recipe_models``) before anything is loaded, unless
    ``check`` is False (the caller changes the recipe first, then checks)."""

    recipe = from_dict(Recipe, args.recipe_data)
    if check:
        check_recipe_models(recipe, args.verb)
    return recipe


def check_recipe_models(recipe, verb: str) -> None:
    """The models a verb will load from ``recipe`` exist (``draftsmith.sources``): the target (and its dtype
    name); the models the drafter section names (``DrafterSection.models``: a draft model's ``init_from``;
    train, demo); for demo and eval, every ``eval.drafters`` entry.

    Raises:
        ModelSourceError: a model that is not there, naming the recipe key. ValueError: an unknown dtype name.
    """

    if recipe.target.dtype not in arg.DTYPE_NAMES:
        raise ValueError(
            f"target.dtype {recipe.target.dtype!r} is not a dtype draftsmith loads; use one of "
            f"{', '.join(arg.DTYPE_NAMES)}"
        )
    check_model_source(recipe.target.name_or_path, recipe.target.revision, role="target")
    if verb in ("train", "demo"):
        for role, name in recipe.drafter.models().items():
            check_model_source(name, role=role)
    if verb in ("demo", "eval"):
        for label, spec in recipe.eval.drafters.items():
            check_speculative_models(spec, where=f"eval.drafters.{label}")


def cmd_demo(args) -> int:
    from draftsmith.pipeline.demo import demo

    demo(_recipe(args))
    return 0


def cmd_prepare(args) -> int:
    from draftsmith.pipeline.stages import run_prepare

    data = run_prepare(_recipe(args))
    print(json.dumps({k: v for k, v in data.manifest.items() if k not in ("key", "files")}, indent=1))
    return 0


def cmd_capture(args) -> int:
    from draftsmith.pipeline.stages import run_capture

    manifest = run_capture(_recipe(args))
    print(json.dumps({k: v for k, v in manifest.items() if k not in ("key", "shards", "target")}, indent=1))
    return 0


def cmd_train(args) -> int:
    from draftsmith.pipeline.stages import run_train

    print(f"head exported to {run_train(_recipe(args))}")
    return 0


def cmd_export(args) -> int:
    from draftsmith.pipeline.stages import export_run

    print(f"head exported to {export_run(Path(args.run_dir), Path(args.out), args.format)}")
    return 0


def cmd_drafters(args) -> int:
    """``draftsmith drafters``: the registry, one line per drafter (name, trainable, export formats, summary)."""
    for drafter in drafters.all_drafters():
        trains = "trains" if drafter.trainable else "no training"
        formats = ", ".join(drafter.formats) or "no export"
        print(f"{drafter.name:<16}{trains:<13}{formats:<38}{drafter.summary}")
    return 0


def cmd_check(args) -> int:
    from draftsmith.drafters.directory import check_export
    from draftsmith.models import load_causal_lm

    target, tokenizer = load_causal_lm(args.target, args.revision, args.dtype, role="target")
    report = check_export(
        args.head,
        target,
        tokenizer,
        args.target,
        allow_mismatch=tuple(args.allow_mismatch),
        tensor_parallel_size=args.tensor_parallel_size,
    )
    print(report.summary())
    if args.tensor_parallel_size:
        print(f"tensor parallel: head and target shard over {args.tensor_parallel_size} ranks")
    return 0


def cmd_certify(args) -> int:
    from draftsmith.evaluation.certify import certify, make_trace, write_trace

    if args.write_trace:
        from draftsmith.models import load_causal_lm

        target, tokenizer = load_causal_lm(args.target, args.revision, args.dtype, role="target")
        trace = make_trace(
            args.head,
            target,
            tokenizer,
            k=args.k,
            num_prompts=args.num_prompts,
            max_tokens=args.max_tokens,
            tree=args.tree,
        )
        path = write_trace(args.head, trace)
        print(
            f"trace: {path} ({len(trace['prompts'])} prompts x {trace['max_tokens']} tokens, k = "
            f"{trace['speculative_config']['num_speculative_tokens']})"
        )
    if args.server is None:
        return 0
    result = certify(args.head, args.server, tolerance=args.tolerance, api_key=args.api_key)
    print(result.summary())
    return 0 if result.ok else 1


def _serve_elsewhere(args) -> int:
    """``serve --engine vllm | sglang`` (``pipeline.engines``): check the head, then launch vLLM or print SGLang's
    command."""
    from draftsmith.drafters.speculative import SpeculativeConfig
    from draftsmith.pipeline import engines

    spec = SpeculativeConfig.parse(args.speculative_config)
    if args.engine == "sglang":
        command = engines.sglang_command(args.target, spec, args.host, args.port)  # refuses what SGLang lacks
        if spec is not None:
            engines.check_drafter(
                args.target, spec, revision=args.revision, dtype=args.dtype, allow_mismatch=args.allow_mismatch
            )
        print(" ".join(command + list(args.engine_args)))
        return 0
    return engines.serve_with_vllm(
        args.target,
        spec,
        host=args.host,
        port=args.port,
        served_model_name=args.served_model_name,
        dtype=args.dtype,
        revision=args.revision,
        max_model_len=args.max_model_len,
        allow_mismatch=args.allow_mismatch,
        extra=args.engine_args,
    )


def cmd_push(args) -> int:
    from draftsmith.pipeline.hub import push_head

    plan = push_head(args.head, args.repo_id, revision=args.revision, private=args.private, dry_run=args.dry_run)
    print(("would upload " if args.dry_run else "uploaded ") + plan.summary())
    return 0


def _tree_shape(text: str) -> TreeShape:
    """An argparse type for ``--tree topk=4,num_steps=5,num_draft_tokens=32`` (``core.tree_shape.TreeShape``)."""
    try:
        return TreeShape.parse(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def cmd_eval(args) -> int:
    from draftsmith.evaluation.heldout import format_table
    from draftsmith.pipeline.stages import eval_rows, run_eval

    recipe = _recipe(args, check=False)
    recipe.target.name_or_path = args.target or recipe.target.name_or_path
    if args.tasks:
        recipe.eval.tasks = args.tasks
    for label, spec in args.drafter:  # parsed by arguments.drafter
        recipe.eval.drafters[label] = spec
    if args.prompts_per_task is not None or not args.recipe:  # without a recipe: whole tasks
        recipe.eval.prompts_per_task = args.prompts_per_task
    recipe.eval.max_new_tokens = args.max_new_tokens or recipe.eval.max_new_tokens
    recipe.eval.onednn = args.onednn or recipe.eval.onednn
    check_recipe_models(recipe, "eval")
    head = Path(args.head) if args.head else None
    own = recipe.drafter.method
    if head is None and not args.methods and drafters.config_module(own).RULES.needs_model:
        raise ValueError(
            f"method {own} needs a head directory (--head DIR): an exported {own} head, e.g. "
            f"{recipe.run_dir / 'head'} after `draftsmith train`; or pick other rows with --methods"
        )
    eval_rows(recipe, head, args.methods, args.k, args.tree)  # every row is a valid speculative config, first
    report = run_eval(
        recipe, head, allow_mismatch=tuple(args.allow_mismatch), labels=args.methods, k=args.k, tree=args.tree
    )
    print(format_table(report))
    print(f"report: {recipe.run_dir / 'eval' / 'report.json'}")
    if report.get("recorded_in"):
        print(f"recorded in {report['recorded_in']} (its held-out acceptance: where `auto` starts from)")
    return 0


def cmd_generate(args) -> int:
    from draftsmith.core.generate import GenerationConfig
    from draftsmith.data_pipeline.chat import prompt_ids
    from draftsmith.serve.engine import Engine

    engine = Engine.from_pretrained(
        args.target,
        args.speculative_config,
        allow_mismatch=args.allow_mismatch,
        max_model_len=args.max_model_len,
        max_num_seqs=1,  # one prompt (an "auto" cost model is measured for batch size 1)
    )
    ids = prompt_ids(engine.tokenizer, [{"role": "user", "content": args.prompt}])
    gen = GenerationConfig(
        max_new_tokens=args.max_tokens, temperature=args.temperature, seed=args.seed, eos_token_ids=engine.eos_token_ids
    )
    out = engine.generate(ids, gen)
    print(out.text)
    if out.stats is not None:
        print(
            f"\n[{engine.spec.method}] τ={out.stats.acceptance_length:.2f} acceptance={out.stats.acceptance_rate:.1%} "
            f"target forwards={out.num_target_forwards} tokens={len(out.tokens)}"
            + (f" mean k={out.stats.mean_chosen_k:.2f} (auto)" if out.stats.mean_chosen_k is not None else ""),
            file=sys.stderr,
        )
    return 0


def cmd_serve(args) -> int:
    if args.engine != "draftsmith":
        return _serve_elsewhere(args)
    from draftsmith.serve.engine import Engine
    from draftsmith.serve.server import serve

    engine = Engine.from_pretrained(
        args.target,
        args.speculative_config,
        dtype=args.dtype,
        revision=args.revision,
        served_model_name=args.served_model_name,
        allow_mismatch=args.allow_mismatch,
        max_model_len=args.max_model_len,
        max_num_seqs=args.max_num_seqs,
        max_num_batched_tokens=args.max_num_batched_tokens,
        max_waiting=args.max_waiting_requests,
        onednn=args.onednn,
    )
    serve(engine, host=args.host, port=args.port, api_key=args.api_key, max_request_bytes=args.max_request_bytes)
    return 0


def cmd_bench(args) -> int:
    from draftsmith.evaluation.bench import format_table, run_bench, write_report

    cfg = config_from_args(args)
    report = run_bench(cfg)
    paths = write_report(report, cfg.out)
    print(format_table(report))
    print(f"\nreport: {paths['json']}  table: {paths['table']}  plot: {paths['plot']}")
    return 0


def _add_recipe(p) -> None:
    p.add_argument("recipe", nargs="?", default=None, help=f"YAML recipe (default: {DEFAULT_RECIPE.name})")
    p.add_argument("overrides", nargs="*", help="dotted overrides, e.g. train.lr=1e-4")


def _verb(sub, name: str, help_: str, **kwargs) -> argparse.ArgumentParser:
    """A verb's sub-parser; ``-v`` works after the verb too (SUPPRESS keeps the top-level value otherwise).
    ``kwargs`` go to ``add_parser`` (a formatter_class, a description)."""
    p = sub.add_parser(name, help=help_, **kwargs)
    p.add_argument(
        "-v",
        "--verbose",
        action="store_true",
        default=argparse.SUPPRESS,
        help=f"INFO logging, and the traceback of an error (also: {TRACEBACK_ENV}=1)",
    )
    return p


def build_parser() -> argparse.ArgumentParser:
    parser = arg.ArgumentParser(prog="draftsmith", description=__doc__.splitlines()[0])
    parser.add_argument(
        "-v",
        "--verbose",
        action="store_true",
        help=f"INFO logging, and the traceback of an error (also: {TRACEBACK_ENV}=1)",
    )
    sub = parser.add_subparsers(dest="verb", required=True)
    for name, fn, help_ in (
        ("demo", cmd_demo, "run the main job end to end"),
        ("prepare", cmd_prepare, "build training conversations and the vocab map"),
        ("capture", cmd_capture, "capture the target's hidden states to offline shards"),
        ("train", cmd_train, "prepare, train and export the recipe's drafter (its method)"),
    ):
        p = _verb(sub, name, help_)
        _add_recipe(p)
        p.set_defaults(fn=fn)
    p = _verb(sub, "export", "export a trained run's checkpoint (or a head, in other formats) as a head directory")
    p.add_argument("run_dir", help="RUN_DIR (runs/NAME) or an exported head directory")
    p.add_argument("--out", required=True)
    p.add_argument(
        "--format",
        nargs="+",
        default=["all"],
        help="the drafter's formats, or all: draftsmith (always written); EAGLE-3 also vllm / sglang (the "
        "research config.json at DIR) and speculators (DIR/speculators, for `vllm serve`)",
    )
    p.set_defaults(fn=cmd_export)
    p = _verb(sub, "drafters", "list the registered drafters (recipe drafter.method, --speculative-config method)")
    p.set_defaults(fn=cmd_drafters)
    p = _verb(sub, "check", "check a head against a target; exit 1 on mismatch")
    p.add_argument("head")
    p.add_argument("--target", default="reference")
    p.add_argument("--revision", default=None)
    p.add_argument("--allow-mismatch", nargs="*", default=[], metavar="FIELD")
    p.add_argument(
        "--tensor-parallel-size", type=arg.positive_int, default=None, help="also check sharding over N ranks"
    )
    p.add_argument(
        "--dtype",
        default="float32",
        type=arg.dtype,
        help="the dtype the target will serve in (warns when the head was trained on another one)",
    )
    p.set_defaults(fn=cmd_check)
    p = _verb(sub, "certify", "replay a head's golden trace through a running server; exit 1 on mismatch")
    p.add_argument("head")
    p.add_argument("--server", type=arg.url, default=None, help="an OpenAI-compatible server (vLLM, draftsmith, ...)")
    p.add_argument("--tolerance", type=arg.non_negative_float, default=0.05, help="relative, on accepted tokens")
    p.add_argument("--api-key", default=None)
    p.add_argument("--write-trace", action="store_true", help="(re)write HEAD/trace.json with draftsmith's runtime")
    p.add_argument("--target", default=None, help="the target, for --write-trace")
    p.add_argument("--revision", default=None)
    p.add_argument("--dtype", default="float32", type=arg.dtype)
    p.add_argument("--k", type=arg.positive_int, default=None, help="for --write-trace (default: the head's)")
    p.add_argument("--num-prompts", type=arg.positive_int, default=4)
    p.add_argument("--max-tokens", type=arg.positive_int, default=32)
    p.add_argument(
        "--tree", type=_tree_shape, default=None, help="for --write-trace: trace a draft tree (draftsmith servers)"
    )
    p.set_defaults(fn=cmd_certify)
    p = _verb(sub, "push", "upload a checked head directory to the Hugging Face Hub")
    p.add_argument("head")
    p.add_argument("--repo-id", required=True, help="ORG/NAME")
    p.add_argument("--revision", default=None, help="branch (created if absent)")
    p.add_argument("--private", action="store_true")
    p.add_argument("--dry-run", action="store_true", help="list what would be uploaded; send nothing")
    p.set_defaults(fn=cmd_push)
    p = _verb(sub, "eval", "acceptance of each method on the held-out tasks")
    p.add_argument("--recipe", default=None)
    p.add_argument("--head", default=None, help="an exported drafter directory (its row is labelled by its method)")
    p.add_argument("--target", default=None)
    p.add_argument(
        "--methods",
        nargs="+",
        default=None,
        metavar="ROW",
        help="rows to run, in this order: the head's method, eval.drafters labels, or drafter names "
        f"({', '.join(drafters.names())}) with their default model",
    )
    p.add_argument(
        "--drafter",
        action="append",
        default=[],
        metavar="LABEL=JSON",
        type=arg.drafter,
        help="an extra row: a labelled speculative config, e.g. "
        '\'distilled={"method": "draft_model", "model": "runs/reference-draft-model/head"}\' '
        "(repeatable; added to the recipe's eval.drafters)",
    )
    p.add_argument("--tasks", nargs="+", default=None, choices=TASK_NAMES)
    p.add_argument(
        "--k",
        type=arg.k_value,
        nargs="+",
        default=None,
        help="num_speculative_tokens of every chain row: an integer or auto (adaptive); several values make a "
        "row per value (ROW@k3, ROW@auto)",
    )
    p.add_argument(
        "--tree",
        type=_tree_shape,
        default=None,
        metavar="topk=T,num_steps=D,num_draft_tokens=N",
        help="also evaluate each row that drafts trees (eagle3) with an EAGLE-2 draft tree of this shape "
        "(SGLang's names), labelled ROW+tree, next to its chain",
    )
    p.add_argument(
        "--prompts-per-task",
        type=arg.positive_int,
        default=None,
        help="default: the recipe's eval.prompts_per_task (no --recipe: the whole task)",
    )
    p.add_argument("--max-new-tokens", type=arg.positive_int, default=None)
    p.add_argument(
        "--allow-mismatch",
        nargs="*",
        default=[],
        metavar="FIELD",
        help="target fields the head may differ in; logged and written into the eval report",
    )
    p.add_argument(
        "--onednn",
        choices=["auto", "on", "off"],
        default=None,
        help="the float32 CPU linears of target and drafters through oneDNN with packed weights, as draftsmith "
        "serve runs them (core/onednn.py), or MKL (off); default: the recipe's eval.onednn (auto)",
    )
    p.set_defaults(fn=cmd_eval, overrides=[])
    p = _verb(sub, "generate", "decode one prompt, with or without speculation")
    p.add_argument("--target", default="reference")
    p.add_argument("--prompt", required=True)
    p.add_argument(
        "--speculative-config", default=None, type=arg.json_object, help='JSON, as vLLM: {"method": "ngram", ...}'
    )
    p.add_argument("--max-tokens", type=arg.positive_int, default=128)
    p.add_argument("--temperature", type=arg.non_negative_float, default=0.0)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--allow-mismatch", nargs="*", default=[], metavar="FIELD")
    p.add_argument(
        "--max-model-len", type=arg.positive_int, default=None, help="longest prompt + completion (memory plan)"
    )
    p.set_defaults(fn=cmd_generate)
    p = _verb(
        sub,
        "serve",
        "OpenAI-compatible server (/v1/completions, /v1/chat/completions, /metrics)",
        formatter_class=arg.HelpWithDefaults,
        description="Serve --target with or without speculation: an OpenAI-compatible HTTP API (/v1/completions, "
        "/v1/chat/completions, /v1/models, /tokenize, /detokenize, /health, /version, /metrics) around a "
        "continuous-batching engine. SIGTERM or Ctrl+C shuts it down: requests still queued or running are "
        "answered 503, then the process exits.",
    )
    p.add_argument(
        "--target",
        metavar="MODEL",
        default="reference",
        help="the model served: a Hub id, a local folder, or reference (bundled)",
    )
    p.add_argument(
        "--speculative-config",
        metavar="JSON",
        default=None,
        type=arg.json_object,
        help='JSON with vLLM\'s keys, e.g. {"method": "eagle3", "model": HEAD, "num_speculative_tokens": 5} '
        "(default: none, plain decoding)",
    )
    p.add_argument(
        "--engine",
        choices=["draftsmith", "vllm", "sglang"],
        default="draftsmith",
        help="vllm: check the head as draftsmith does, then start vLLM's server from the referee's venv and certify "
        "it with the head's trace; sglang: check, then print SGLang's command",
    )
    p.add_argument(
        "engine_args", nargs="*", metavar="-- ENGINE_FLAGS", help="flags after -- go to vLLM / SGLang as given"
    )
    p.add_argument(
        "--host",
        metavar="HOST",
        default="127.0.0.1",
        help="address to listen on; 0.0.0.0 listens on every interface (then pass --api-key: a warning says so)",
    )
    p.add_argument("--port", metavar="PORT", type=arg.port, default=8000, help="TCP port to listen on")
    p.add_argument(
        "--dtype",
        metavar="DTYPE",
        type=arg.dtype,
        default="float32",
        help=f"weights dtype: {', '.join(arg.DTYPE_NAMES)}",
    )
    p.add_argument(
        "--revision", metavar="REV", default=None, help="the target's Hub revision (default: the main branch)"
    )
    p.add_argument(
        "--served-model-name",
        metavar="NAME",
        default=None,
        help="the model name clients send and /v1/models shows (default: --target)",
    )
    p.add_argument(
        "--allow-mismatch",
        nargs="*",
        default=[],
        metavar="FIELD",
        help="target identity fields the drafter's export may differ in (default: none)",
    )
    p.add_argument(
        "--max-model-len",
        metavar="TOKENS",
        type=arg.positive_int,
        default=None,
        help="longest prompt + completion served, in tokens (default: the target's max_position_embeddings)",
    )
    p.add_argument(
        "--max-num-seqs",
        metavar="N",
        type=arg.positive_int,
        default=64,
        help="most sequences decoded together (as vLLM's)",
    )
    p.add_argument(
        "--max-num-batched-tokens",
        metavar="TOKENS",
        type=arg.positive_int,
        default=2048,
        help="most tokens one step reads, decode rows and prefill chunks together (as vLLM's)",
    )
    p.add_argument(
        "--max-waiting-requests",
        metavar="N",
        type=arg.positive_int,
        default=1024,
        help="requests allowed to wait for a batch slot; past it new requests get HTTP 429",
    )
    p.add_argument(
        "--onednn",
        choices=["auto", "on", "off"],
        default="auto",
        help="run the float32 linear layers of the target and the drafter on the CPU through oneDNN with prepacked "
        "weights (a verify step then costs about a one-token step; core/onednn.py); auto: when the packed copies "
        "fit in half the free memory",
    )
    p.add_argument(
        "--api-key",
        metavar="KEY",
        type=arg.non_empty,
        default=None,
        help=f"require 'Authorization: Bearer KEY' on /v1/*, /tokenize and /detokenize (401 without it; /health, "
        f"/version and /metrics stay open); ${API_KEY_ENV} is read when the flag is absent and keeps the key out "
        f"of the process list (default: ${API_KEY_ENV}, else no key)",
    )
    p.add_argument(
        "--max-request-bytes",
        metavar="BYTES",
        type=arg.positive_int,
        default=DEFAULT_MAX_REQUEST_BYTES,
        help="largest request body; larger ones get HTTP 413 before they are parsed (8 MiB holds a 128k-token "
        "prompt many times over)",
    )
    p.set_defaults(fn=cmd_serve)

    p = _verb(sub, "bench", "serving benchmark with vs without speculation (table, JSON, PNG)")
    bench_parser(p).set_defaults(fn=cmd_bench)
    return parser


# --- checks before dispatch (no torch) -----------------------------------------------------------------------


def _read_recipe(args) -> None:
    """``args.recipe_data``: the recipe file (default: DEFAULT_RECIPE) read as YAML with the overrides applied.
    A first positional holding '=' that names no file is an override (``draftsmith train train.lr=1e-4``)."""

    overrides = list(getattr(args, "overrides", []) or [])
    if args.recipe and "=" in args.recipe and not Path(args.recipe).exists():
        args.recipe, overrides = None, [args.recipe, *overrides]
    args.overrides = overrides
    args.recipe_data = read_config_data(args.recipe or DEFAULT_RECIPE, overrides)


def _check_export(args) -> None:

    run = Path(args.run_dir)
    if not is_head_dir(run) and not (run / "train" / "checkpoint" / "state.json").is_file():
        what = (
            "does not exist"
            if not run.exists()
            else "is neither an exported head (no draftsmith.json) nor a trained run (no train/checkpoint/state.json)"
        )
        raise ModelSourceError(
            f"{args.run_dir!r} {what}; pass runs/NAME after `draftsmith train RECIPE`, or an exported head directory"
        )
    if Path(args.out).exists() and not Path(args.out).is_dir():
        raise ValueError(f"--out {args.out!r} is a file; pass a directory path for the head")


def _check_head_and_target(args) -> None:

    if getattr(args, "head", None) is not None:
        check_head_dir(args.head, role="head")
    if getattr(args, "target", None) is not None:
        check_model_source(args.target, getattr(args, "revision", None), role="target")


def _check_certify(args) -> None:

    check_head_dir(args.head, role="head")
    if args.write_trace and args.target is None:
        raise ValueError("--write-trace needs --target (the model the trace is decoded with)")
    if not args.write_trace and args.server is None:
        raise ValueError("pass --server URL (a running server to certify) or --write-trace --target TARGET")
    if args.target is not None:
        check_model_source(args.target, args.revision, role="target")


def _check_push(args) -> None:
    from huggingface_hub.utils import HFValidationError, validate_repo_id

    check_head_dir(args.head, role="head")
    try:
        validate_repo_id(args.repo_id)
    except HFValidationError:
        raise ValueError(
            f"--repo-id {args.repo_id!r} is not a Hub repo id; pass ORG/NAME (letters, digits, '-', '_', '.')"
        ) from None


def _check_eval(args) -> None:

    _check_head_and_target(args)
    for label, spec in args.drafter:
        check_speculative_models(spec, where=f"--drafter {label}")


def _check_engine(args) -> None:

    _check_head_and_target(args)
    if args.speculative_config is not None:
        check_speculative_models(args.speculative_config, where="--speculative-config")
    if args.speculative_config is not None:
        from draftsmith.drafters.speculative import SpeculativeConfig

        SpeculativeConfig.parse(args.speculative_config)  # unknown keys, bad values: before the target loads
    if args.verb == "serve" and args.engine_args and args.engine == "draftsmith":
        raise ValueError(
            f"unexpected arguments {' '.join(args.engine_args)}: flags after -- go to --engine vllm or sglang"
        )
    if args.verb == "serve" and args.engine == "vllm":
        from draftsmith.evaluation.vllm_venv import vllm_python

        if not vllm_python().exists():
            raise FileNotFoundError(
                f"--engine vllm runs vLLM from {vllm_python()}, which does not exist: create the venv with "
                "`python bench/vllm_referee.py --setup` (or set DRAFTSMITH_VLLM_VENV)"
            )
    if args.verb == "serve" and args.engine != "sglang":
        check_listen(args.host, args.port)
        if args.api_key is None:
            args.api_key = os.environ.get(API_KEY_ENV) or None
        warn_if_exposed(args.host, args.api_key)


def _check_bench(args) -> None:

    check_config(config_from_args(args))


CHECKS = {
    "check": _check_head_and_target,
    "certify": _check_certify,
    "push": _check_push,
    "export": _check_export,
    "eval": _check_eval,
    "generate": _check_engine,
    "serve": _check_engine,
    "bench": _check_bench,
}


def check_args(args) -> None:
    """Everything about a parsed command line that can be checked without torch, before the verb runs: the
    recipe (file, YAML syntax, overrides), then the verb's ``CHECKS`` (target and draft folders or offline Hub
    ids, head directories, the serving port).

    Raises:
        ConfigError: the recipe. ModelSourceError (an OSError): a model or head. ValueError: other values.
    """
    if hasattr(args, "recipe"):
        _read_recipe(args)
    CHECKS.get(args.verb, lambda _: None)(args)


def check_listen(host: str, port: int) -> None:
    """Refuse (ValueError) a host that does not resolve or a port that cannot be bound there (in use, or
    privileged), before the target is loaded. The socket is closed again at once."""
    import socket

    try:
        family, kind, proto, _, address = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0]
    except socket.gaierror as e:
        raise ValueError(
            f"--host {host!r} does not resolve ({e.strerror}); pass an address such as 127.0.0.1 "
            f"(this machine) or 0.0.0.0 (every interface)"
        ) from None
    with socket.socket(family, kind, proto) as probe:
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as uvicorn binds
        try:
            probe.bind(address)
        except OSError as e:
            raise ValueError(
                f"cannot listen on {host}:{port} ({e.strerror}); stop what holds the port, or pass another --port"
            ) from None


def warn_if_exposed(host: str, api_key: str | None) -> bool:
    """Log a warning (and return True) when ``host`` is not a loopback address and no API key is set: anyone who
    reaches the port can then generate, at the cost of this machine's accelerator."""
    import socket

    if api_key:
        return False
    try:
        addresses = {info[4][0] for info in socket.getaddrinfo(host, None, type=socket.SOCK_STREAM)}
        loopback = all(ipaddress.ip_address(a.split("%", 1)[0]).is_loopback for a in addresses)
    except (OSError, ValueError):
        loopback = False
    if loopback:
        return False
    logging.getLogger("draftsmith.serve").warning(
        "serving on %s without an API key: anyone who can reach this port can use the server; pass --api-key "
        "(or set %s), or listen on 127.0.0.1",
        host,
        API_KEY_ENV,
    )
    return True


def main(argv=None) -> int:
    """Parse, check (``check_args``), run the verb; any error ends as one line on stderr (module docstring,
    ``arguments.run_guarded``)."""
    args = build_parser().parse_args(argv)
    logging.basicConfig(
        level=logging.INFO if args.verbose else logging.WARNING, format="%(levelname)s %(name)s: %(message)s"
    )

    def run() -> int:
        check_args(args)
        return args.fn(args)

    return arg.run_guarded(
        f"draftsmith {args.verb}", run, verbose=args.verbose, interrupted=RESUME.get(args.verb, "rerun the command")
    )


if __name__ == "__main__":
    sys.exit(main())
