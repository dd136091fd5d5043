"""Every shipped recipe loads into its typed config and starts with its launch command."""
from pathlib import Path

import pytest

from draftsmith.config import ConfigError, load_config
from draftsmith.pipeline import Recipe
from draftsmith.reference.pretrain import PretrainConfig

RECIPES = Path(__file__).resolve().parents[1] / "recipes"
KINDS = {"pretrain_": PretrainConfig}


def recipe_files():
    return sorted(p for p in RECIPES.rglob("*.yaml") if "accelerate" not in p.parts)


@pytest.mark.parametrize("path", recipe_files(), ids=lambda p: str(p.relative_to(RECIPES)))
def test_recipe_loads(path):
    first = path.read_text().splitlines()[0]
    assert first.startswith("# ") and ("draftsmith" in first or "python -m" in first), \
        f"{path} must start with its exact launch command"
    cls = next((c for prefix, c in KINDS.items() if path.name.startswith(prefix)), Recipe)
    load_config(cls, path)


def test_unknown_key_rejected(tmp_path):
    bad = tmp_path / "bad.yaml"
    bad.write_text("train:\n  learning_rate: 1e-4\n")
    with pytest.raises(ConfigError, match="train.learning_rate"):
        load_config(Recipe, bad)


def test_dotted_overrides_are_typed():
    r = load_config(Recipe, None, ["train.lr=2e-4", "eval.k=3", "head.aux_layer_ids=[1, 3, 5]", "data.draft_vocab_size=null"])
    assert r.train.lr == 2e-4 and r.eval.k == 3 and r.head.aux_layer_ids == [1, 3, 5] and r.data.draft_vocab_size is None
    with pytest.raises(ConfigError):
        load_config(Recipe, None, ["eval.k=three"])
