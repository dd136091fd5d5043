"""Runs written by draftsmith 0.1 (``tests/data/legacy-v0.1``: before the drafter registry and the ``src/`` layout)
still work: the recipe stored in each checkpoint is migrated (``pipeline.recipe.Recipe.migrate``), the
checkpoint re-exports to the weights 0.1 exported, training resumes from it, and the 0.1 exports are served."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import yaml
from safetensors.torch import load_file

from draftsmith.config import from_dict, load_config
from draftsmith.pipeline.recipe import Recipe

LEGACY = Path(__file__).parent / "data" / "legacy-v0.1"
RUNS = ("eagle3", "draft_model", "mlp_speculator")


@pytest.fixture
def legacy(tmp_path, monkeypatch):
    """A copy of the legacy folder, made the working directory (its recipes name ``target`` and ``runs``)."""
    root = tmp_path / "legacy"
    shutil.copytree(LEGACY, root)
    monkeypatch.chdir(root)
    return root


def stored_recipe(root: Path, name: str) -> dict:
    return json.loads((root / "runs" / name / "train" / "checkpoint" / "state.json").read_text())["extra"]["config"]


@pytest.mark.parametrize("name", RUNS)
def test_stored_recipes_migrate_to_one_drafter_section(legacy, name, tmp_path):
    old = stored_recipe(legacy, name)
    assert "method" in old and "drafter" not in old  # the 0.1 schema
    recipe = from_dict(Recipe, old)
    assert recipe.drafter.method == name
    assert recipe.drafter.num_speculative_tokens == old["eval"]["k"]  # 0.1's eval.k: the one k now
    if name == "eagle3":
        assert recipe.drafter.ttt_steps == old["head"]["ttt_steps"] == 3
        assert recipe.drafter.aux_layer_ids == [1, 2, 3]
    if name == "mlp_speculator":
        assert recipe.drafter.n_predict == old["mlp_speculator"]["n_predict"]
    labels = set(recipe.eval.drafters)
    assert "ngram" in labels and name not in labels  # 0.1's eval.methods become rows
    path = tmp_path / f"{name}.yaml"  # the same recipe as a 0.1 YAML file
    path.write_text(yaml.safe_dump(old))
    assert load_config(Recipe, path) == recipe


@pytest.mark.parametrize("name", RUNS)
def test_checkpoint_reexports_to_the_weights_01_exported(legacy, name):
    from draftsmith.pipeline.stages import export_run

    head = legacy / "runs" / name / "head"
    out = export_run(legacy / "runs" / name, legacy / "again", ["draftsmith"])
    old, new = load_file(head / "model.safetensors"), load_file(out / "model.safetensors")
    assert set(old) == set(new)
    for key in old:
        assert old[key].equal(new[key]), key
    assert json.loads((out / "draftsmith.json").read_text())["head_type"] == name


@pytest.mark.parametrize("name", RUNS)
def test_training_resumes_from_a_01_checkpoint(legacy, name):
    from draftsmith.pipeline.stages import run_train

    recipe = from_dict(Recipe, stored_recipe(legacy, name))
    recipe.train.max_steps = 3
    head = run_train(recipe)
    meta = json.loads((head / "draftsmith.json").read_text())
    assert meta["training"]["steps"] == 3 and meta["head_type"] == name
    log = json.loads((legacy / "runs" / name / "train" / "train_log.json").read_text())
    steps = [e["step"] for e in (log if isinstance(log, list) else log["log"])]
    assert steps[-1] == 3 and steps.count(1) == 1  # steps 1-2 from 0.1, step 3 resumed


@pytest.mark.parametrize("name", RUNS)
def test_01_exports_are_checked_and_served(legacy, name):
    from draftsmith.core.generate import GenerationConfig
    from draftsmith.serve.engine import Engine

    engine = Engine.from_pretrained("target", {"model": f"runs/{name}/head", "num_speculative_tokens": 2})
    assert engine.spec.method == name
    out = engine.generate([5, 6, 7, 8], GenerationConfig(max_new_tokens=6))
    assert len(out.tokens) == 6 and out.stats.num_drafts > 0
