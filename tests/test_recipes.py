"""Every shipped recipe loads into its typed config and starts with its launch command."""

import importlib.util
import sys
from pathlib import Path

import pytest

from draftsmith.config import ConfigError, load_config
from draftsmith.pipeline.recipe import Recipe

ROOT = Path(__file__).resolve().parents[1]
RECIPES = ROOT / "recipes"  # the checkout's link to src/draftsmith/recipes
TOOLS = ROOT / "tools" / "reference"  # the reference target's build scripts and their recipes


def pretrain_config():
    """``PretrainConfig`` of tools/reference/pretrain.py (a script, not part of the package)."""
    spec = importlib.util.spec_from_file_location("reference_pretrain", TOOLS / "pretrain.py")
    module = sys.modules.get(spec.name) or importlib.util.module_from_spec(spec)
    if spec.name not in sys.modules:
        sys.modules[spec.name] = module  # dataclasses resolve string annotations through sys.modules
        spec.loader.exec_module(module)
    return module.PretrainConfig


def recipe_files():
    return sorted(p for p in RECIPES.rglob("*.yaml") if "accelerate" not in p.parts) + sorted(TOOLS.glob("*.yaml"))


@pytest.mark.parametrize("path", recipe_files(), ids=lambda p: str(p.relative_to(ROOT)))
def test_recipe_loads(path):
    first = path.read_text().splitlines()[0]
    assert first.startswith("# ") and ("draftsmith" in first or "python " in first), (
        f"{path} must start with its exact launch command"
    )
    load_config(pretrain_config() if path.parent == TOOLS else Recipe, path)


def test_unknown_key_rejected(tmp_path):
    bad = tmp_path / "bad.yaml"
    bad.write_text("train:\n  learning_rate: 1e-4\n")
    with pytest.raises(ConfigError, match="train.learning_rate"):
        load_config(Recipe, bad)


def test_dotted_overrides_are_typed():
    r = load_config(
        Recipe,
        None,
        [
            "train.lr=2e-4",
            "drafter.num_speculative_tokens=3",
            "drafter.aux_layer_ids=[1, 3, 5]",
            "data.draft_vocab_size=null",
        ],
    )
    assert r.train.lr == 2e-4 and r.drafter.num_speculative_tokens == 3 and r.drafter.aux_layer_ids == [1, 3, 5]
    assert r.data.draft_vocab_size is None
    with pytest.raises(ConfigError):
        load_config(Recipe, None, ["drafter.num_speculative_tokens=three"])


# ------------------------------------------------------------------ accelerate configs and launch headers

ACCELERATE = RECIPES / "accelerate"
STRATEGY_OF = {"NO": "single", "MULTI_GPU": "ddp", "FSDP": "fsdp"}  # DEEPSPEED: zero{stage}
#: decoder layers of the real targets (from their Hub config.json; nothing is downloaded here)
REAL_TARGET_LAYERS = {
    "meta-llama/Llama-3.1-8B-Instruct": 32,
    "meta-llama/Llama-3.3-70B-Instruct": 80,
    "Qwen/Qwen3-8B": 36,
}


def accelerate_strategy(path) -> str:
    from accelerate.commands.config.config_args import load_config_from_file

    cfg = load_config_from_file(str(path))
    kind = cfg.distributed_type.value if hasattr(cfg.distributed_type, "value") else str(cfg.distributed_type)
    if kind == "DEEPSPEED":
        return f"zero{cfg.deepspeed_config['zero_stage']}"
    return STRATEGY_OF[kind]


@pytest.mark.parametrize("name", ["single", "ddp", "fsdp", "zero2", "zero3"])
def test_accelerate_config_names_its_strategy(name):
    """Each file loads with accelerate's own loader, is the strategy its name says, and starts with
    the launch command that asks the trainer to check exactly that strategy."""
    import yaml

    path = ACCELERATE / f"{name}.yaml"
    first = path.read_text().splitlines()[0]
    assert first.startswith(f"# accelerate launch --config_file recipes/accelerate/{name}.yaml ")
    assert f"train.strategy={name}" in first and "-m draftsmith.cli train" in first
    assert accelerate_strategy(path) == name
    raw = yaml.safe_load(path.read_text())
    if name == "fsdp":
        assert raw["fsdp_config"]["fsdp_version"] == 2  # the trainer applies FSDP2 itself
    if name.startswith("zero"):
        assert raw["deepspeed_config"]["zero3_init_flag"] is False  # the target loads whole, replicated
        assert raw["deepspeed_config"]["offload_optimizer_device"] == "none"


def launch_recipes():
    return sorted(
        p
        for p in RECIPES.rglob("*.yaml")
        if "accelerate" not in p.parts and p.read_text().startswith("# accelerate launch")
    )


def test_real_target_recipes_are_shipped():
    names = {load_config(Recipe, p).target.name_or_path for p in launch_recipes()}
    assert set(REAL_TARGET_LAYERS) <= names


@pytest.mark.parametrize("path", launch_recipes(), ids=lambda p: str(p.relative_to(RECIPES)))
def test_launch_header_agrees_with_the_recipe(path):
    """The header's `accelerate launch` parses with accelerate's parser, names a shipped config whose
    strategy and process count are the recipe's (what the trainer checks at start), and trains this file;
    batch sizes divide; the target is a Hub name with aux layers valid for its depth."""
    import re
    import shlex

    from accelerate.commands.launch import launch_command_parser

    from draftsmith.core.aux_layers import check_aux_layer_ids, default_aux_layer_ids
    from draftsmith.drafters.dflash.config import default_target_layer_ids

    line = path.read_text().splitlines()[0][2:]
    line = re.sub(r"\$\{(\w+)\}", lambda m: {"NODE_RANK": "0", "MASTER_ADDR": "10.0.0.1"}[m.group(1)], line)
    argv = shlex.split(line)
    assert argv[:2] == ["accelerate", "launch"]
    args = launch_command_parser().parse_args(argv[2:])
    assert args.module and args.training_script == "draftsmith.cli"
    assert args.training_script_args[:2] == ["train", str(path.relative_to(RECIPES.parent))]
    config = RECIPES.parent / args.config_file
    assert config.parent == ACCELERATE and config.exists()
    recipe = load_config(Recipe, path)
    t = recipe.train
    assert t.strategy == accelerate_strategy(config)
    assert t.num_processes == args.num_processes
    assert t.num_processes % (args.num_machines or 1) == 0
    assert t.batch_size % ((t.micro_batch_size or 1) * t.num_processes) == 0
    assert t.target_sharding == "replicated" or t.strategy == "fsdp"
    name = recipe.target.name_or_path
    assert name in REAL_TARGET_LAYERS and not Path(name).exists()
    n = REAL_TARGET_LAYERS[name]
    drafter = recipe.drafter
    if drafter.method == "eagle3":
        assert tuple(drafter.aux_layer_ids) == default_aux_layer_ids(n)
    if drafter.method == "dflash":  # z-lab's spread over the target, written explicitly
        assert tuple(drafter.target_layer_ids) == default_target_layer_ids(n, drafter.num_hidden_layers)
    check_aux_layer_ids(drafter.aux_layers(n), n)
    assert recipe.data.max_length >= 2048 and recipe.train.acceptance.every > 0
