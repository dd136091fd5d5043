"""``draftsmith <verb>``: the command line over the pipeline stages.

    draftsmith demo                                   # the main job on the reference target
    draftsmith prepare RECIPE [key=value ...]         # conversations + vocab map -> runs/NAME/data
    draftsmith capture RECIPE [key=value ...]         # offline hidden-state shards -> runs/NAME/capture
    draftsmith train RECIPE [key=value ...]           # prepare, train, export the drafter -> runs/NAME/head
    draftsmith export RUN_DIR|HEAD --out DIR [--format draftsmith|vllm|sglang|speculators|all ...]
    draftsmith check HEAD --target T [--dtype D] [--allow-mismatch FIELD ...] [--tensor-parallel-size N]
    draftsmith push HEAD --repo-id ORG/NAME [--private] [--revision BRANCH] [--dry-run]
    draftsmith eval --head HEAD [--target T] [--methods ...] [--drafter LABEL=JSON ...] [--k 5] [--tasks ...]
    draftsmith generate --target T [--speculative-config JSON] --prompt TEXT
    draftsmith serve --target T [--speculative-config JSON] [--host 127.0.0.1] [--port 8000]
    draftsmith bench --target T [--methods none eagle3 ngram draft_model] [--k 5] [--head HEAD] [--hf-peer]

RECIPE defaults to the packaged ``recipes/reference/eagle3.yaml``; overrides are dotted
(``train.lr=1e-4``). Every recipe file starts with its exact launch command.
"""
from __future__ import annotations

import argparse
import json
import logging
import sys
from pathlib import Path

PACKAGE_DIR = Path(__file__).resolve().parent
DEFAULT_RECIPE = PACKAGE_DIR / "recipes" / "reference" / "eagle3.yaml"


def _recipe(args):
    from draftsmith.config import load_config
    from draftsmith.pipeline import Recipe

    return load_config(Recipe, args.recipe or DEFAULT_RECIPE, args.overrides)


def cmd_demo(args) -> int:
    from draftsmith.pipeline import demo

    demo(_recipe(args))
    return 0


def cmd_prepare(args) -> int:
    from draftsmith.pipeline import run_prepare

    data = run_prepare(_recipe(args))
    print(json.dumps({k: v for k, v in data.manifest.items() if k not in ("key", "files")}, indent=1))
    return 0


def cmd_capture(args) -> int:
    from draftsmith.pipeline import run_capture

    manifest = run_capture(_recipe(args))
    print(json.dumps({k: v for k, v in manifest.items() if k not in ("key", "shards", "target")}, indent=1))
    return 0


def cmd_train(args) -> int:
    from draftsmith.pipeline import run_train

    print(f"head exported to {run_train(_recipe(args))}")
    return 0


def cmd_export(args) -> int:
    from draftsmith.pipeline import export_run

    print(f"head exported to {export_run(Path(args.run_dir), Path(args.out), args.format)}")
    return 0


def cmd_check(args) -> int:
    from draftsmith.export.check import check_head
    from draftsmith.models import load_causal_lm

    target, tokenizer = load_causal_lm(args.target, args.revision, args.dtype)
    report = check_head(args.head, target, tokenizer, args.target, allow_mismatch=tuple(args.allow_mismatch),
                        tensor_parallel_size=args.tensor_parallel_size)
    print(report.summary())
    if args.tensor_parallel_size:
        print(f"tensor parallel: head and target shard over {args.tensor_parallel_size} ranks")
    return 0


def cmd_push(args) -> int:
    from draftsmith.export.hub import push_head

    plan = push_head(args.head, args.repo_id, revision=args.revision, private=args.private, dry_run=args.dry_run)
    print(("would upload " if args.dry_run else "uploaded ") + plan.summary())
    return 0


def _drafter_arg(item: str) -> tuple[str, dict]:
    """``LABEL=JSON`` of ``draftsmith eval --drafter`` -> (label, speculative config mapping)."""
    label, sep, raw = item.partition("=")
    try:
        spec = json.loads(raw) if sep else None
    except json.JSONDecodeError as e:
        raise SystemExit(f"--drafter {item!r}: the part after '=' is not JSON ({e})") from None
    if not label or not isinstance(spec, dict):
        raise SystemExit(f"--drafter {item!r} must look like LABEL='{{\"method\": ..., \"model\": ...}}'")
    return label, spec


def cmd_eval(args) -> int:
    from draftsmith.pipeline import run_eval
    from draftsmith.inference.eval import format_table

    recipe = _recipe(args)
    recipe.target.name_or_path = args.target or recipe.target.name_or_path
    for name in ("methods", "tasks"):
        if getattr(args, name):
            setattr(recipe.eval, name, getattr(args, name))
    for item in args.drafter:
        label, spec = _drafter_arg(item)
        recipe.eval.drafters[label] = spec
    recipe.eval.k = args.k if args.k is not None else recipe.eval.k
    if args.prompts_per_task is not None or not args.recipe:     # without a recipe: whole tasks
        recipe.eval.prompts_per_task = args.prompts_per_task
    recipe.eval.max_new_tokens = args.max_new_tokens or recipe.eval.max_new_tokens
    report = run_eval(recipe, Path(args.head) if args.head else None, allow_mismatch=tuple(args.allow_mismatch))
    print(format_table(report))
    print(f"report: {recipe.run_dir / 'eval' / 'report.json'}")
    return 0


def cmd_generate(args) -> int:
    from draftsmith.data_pipeline.chat import prompt_ids
    from draftsmith.inference.engine import Engine
    from draftsmith.inference.generate import GenerationConfig

    engine = Engine.from_pretrained(args.target, args.speculative_config, allow_mismatch=args.allow_mismatch,
                                    max_model_len=args.max_model_len)
    ids = prompt_ids(engine.tokenizer, [{"role": "user", "content": args.prompt}])
    gen = GenerationConfig(max_new_tokens=args.max_tokens, temperature=args.temperature, seed=args.seed,
                           eos_token_ids=engine.eos_token_ids)
    out = engine.generate(ids, gen)
    print(out.text)
    if out.stats is not None:
        print(f"\n[{engine.spec.method}] τ={out.stats.acceptance_length:.2f} acceptance={out.stats.acceptance_rate:.1%} "
              f"target forwards={out.num_target_forwards} tokens={len(out.tokens)}", file=sys.stderr)
    return 0


def cmd_serve(args) -> int:
    from draftsmith.inference.engine import Engine
    from draftsmith.inference.server import serve

    engine = Engine.from_pretrained(args.target, args.speculative_config, dtype=args.dtype, revision=args.revision,
                                    served_model_name=args.served_model_name, allow_mismatch=args.allow_mismatch,
                                    max_model_len=args.max_model_len)
    serve(engine, host=args.host, port=args.port)
    return 0


def cmd_bench(args) -> int:
    from draftsmith.bench.serve import config_from_args, format_table, run_bench, write_report

    cfg = config_from_args(args)
    report = run_bench(cfg)
    paths = write_report(report, cfg.out)
    print(format_table(report))
    print(f"\nreport: {paths['json']}  table: {paths['table']}  plot: {paths['plot']}")
    return 0


def _add_recipe(p) -> None:
    p.add_argument("recipe", nargs="?", default=None, help=f"YAML recipe (default: {DEFAULT_RECIPE.name})")
    p.add_argument("overrides", nargs="*", help="dotted overrides, e.g. train.lr=1e-4")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="draftsmith", description=__doc__.splitlines()[0])
    parser.add_argument("-v", "--verbose", action="store_true")
    sub = parser.add_subparsers(dest="verb", required=True)
    for name, fn, help_ in (("demo", cmd_demo, "run the main job end to end"),
                            ("prepare", cmd_prepare, "build training conversations and the vocab map"),
                            ("capture", cmd_capture, "capture the target's hidden states to offline shards"),
                            ("train", cmd_train, "prepare, train and export the recipe's drafter (its method)")):
        p = sub.add_parser(name, help=help_)
        _add_recipe(p)
        p.set_defaults(fn=fn)
    p = sub.add_parser("export", help="export a trained run's checkpoint (or a head, in other formats) as a head "
                                      "directory")
    p.add_argument("run_dir", help="RUN_DIR (runs/NAME) or an exported head directory")
    p.add_argument("--out", required=True)
    p.add_argument("--format", nargs="+", default=["all"],
                   choices=["draftsmith", "vllm", "sglang", "speculators", "all"],
                   help="draftsmith (always written), vllm / sglang (the research config.json at DIR), "
                        "speculators (DIR/speculators, for `vllm serve`), all")
    p.set_defaults(fn=cmd_export)
    p = sub.add_parser("check", help="check a head against a target; exit 1 on mismatch")
    p.add_argument("head")
    p.add_argument("--target", default="reference")
    p.add_argument("--revision", default=None)
    p.add_argument("--allow-mismatch", nargs="*", default=[], metavar="FIELD")
    p.add_argument("--tensor-parallel-size", type=int, default=None, help="also check sharding over N ranks")
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"],
                   help="the dtype the target will serve in (warns when the head was trained on another one)")
    p.set_defaults(fn=cmd_check)
    p = sub.add_parser("push", help="upload a checked head directory to the Hugging Face Hub")
    p.add_argument("head")
    p.add_argument("--repo-id", required=True, help="ORG/NAME")
    p.add_argument("--revision", default=None, help="branch (created if absent)")
    p.add_argument("--private", action="store_true")
    p.add_argument("--dry-run", action="store_true", help="list what would be uploaded; send nothing")
    p.set_defaults(fn=cmd_push)
    p = sub.add_parser("eval", help="acceptance of each method on the held-out tasks")
    p.add_argument("--recipe", default=None)
    p.add_argument("--head", default=None, help="exported head directory (for methods eagle3 and mlp_speculator)")
    p.add_argument("--target", default=None)
    p.add_argument("--methods", nargs="+", default=None)
    p.add_argument("--drafter", action="append", default=[], metavar="LABEL=JSON",
                   help="an extra row: a labelled speculative config, e.g. "
                        "'distilled={\"method\": \"draft_model\", \"model\": \"runs/reference-draft-model/head\"}' "
                        "(repeatable; added to the recipe's eval.drafters)")
    p.add_argument("--tasks", nargs="+", default=None)
    p.add_argument("--k", type=int, default=None)
    p.add_argument("--prompts-per-task", type=int, default=None,
                   help="default: the recipe's eval.prompts_per_task (no --recipe: the whole task)")
    p.add_argument("--max-new-tokens", type=int, default=None)
    p.add_argument("--allow-mismatch", nargs="*", default=[], metavar="FIELD",
                   help="target fields the head may differ in; logged and written into the eval report")
    p.set_defaults(fn=cmd_eval, overrides=[])
    p = sub.add_parser("generate", help="decode one prompt, with or without speculation")
    p.add_argument("--target", default="reference")
    p.add_argument("--prompt", required=True)
    p.add_argument("--speculative-config", default=None, help='JSON, as vLLM: {"method": "ngram", ...}')
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--allow-mismatch", nargs="*", default=[], metavar="FIELD")
    p.add_argument("--max-model-len", type=int, default=None, help="longest prompt + completion (memory plan)")
    p.set_defaults(fn=cmd_generate)
    p = sub.add_parser("serve", help="OpenAI-compatible server (/v1/completions, /v1/chat/completions, /metrics)")
    p.add_argument("--target", default="reference")
    p.add_argument("--speculative-config", default=None,
                   help='JSON with vLLM\'s keys: {"method": "eagle3", "model": HEAD, "num_speculative_tokens": 5}')
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--dtype", default="float32")
    p.add_argument("--revision", default=None)
    p.add_argument("--served-model-name", default=None)
    p.add_argument("--allow-mismatch", nargs="*", default=[], metavar="FIELD")
    p.add_argument("--max-model-len", type=int, default=None,
                   help="longest prompt + completion served (default: the target's max_position_embeddings)")
    p.set_defaults(fn=cmd_serve)
    from draftsmith.bench.serve import build_parser as bench_parser

    p = sub.add_parser("bench", help="serving benchmark with vs without speculation (table, JSON, PNG)")
    bench_parser(p).set_defaults(fn=cmd_bench)
    return parser


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=logging.INFO if args.verbose else logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    from draftsmith.config import ConfigError
    from draftsmith.export.metadata import HeadMismatchError

    try:
        return args.fn(args)
    except (ConfigError, HeadMismatchError, FileNotFoundError, ValueError) as e:
        print(f"draftsmith {args.verb}: error: {e}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
