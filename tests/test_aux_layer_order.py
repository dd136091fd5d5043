"""Aux layer ids must be ascending: vLLM and SGLang concatenate the aux states in layer order whatever the
config's list order, so a head trained on [3, 2, 1] would get its fc columns fed in another order.

Refused at every place that takes the ids (recipe, head config, capture, runtime target), by `check` /
the loader for an existing export, and the engine read-back reports the order each engine builds."""

import json

import pytest
import torch

from draftsmith.config import load_config
from draftsmith.drafters.eagle3.check import check_head, load_eagle3
from draftsmith.drafters.eagle3.export import export_eagle3
from draftsmith.drafters.eagle3.formats import engine_problems, engine_view, research_config, speculators_config
from draftsmith.drafters.eagle3.head import Eagle3Config, Eagle3Head
from draftsmith.export.metadata import HeadMismatchError
from draftsmith.identity import target_identity

UNSORTED = [3, 2, 1]  # a 4-layer target: HF hidden_states indices 0..3


def test_recipe_and_head_config_refuse_unsorted_ids():
    from draftsmith.drafters.eagle3.config import Section as HeadConfig
    from draftsmith.pipeline.recipe import Recipe

    for make in (
        lambda: HeadConfig(aux_layer_ids=UNSORTED),
        lambda: load_config(Recipe, None, ["drafter.aux_layer_ids=[3, 2, 1]"]),
    ):
        with pytest.raises(ValueError) as err:
            make()
        msg = str(err.value)
        assert "aux_layer_ids" in msg and "ascending" in msg and "[1, 2, 3]" in msg, msg
    with pytest.raises(ValueError, match="ascending"):
        HeadConfig(aux_layer_ids=[1, 1, 3])  # a repeated layer: engines capture it once
    assert HeadConfig(aux_layer_ids=[1, 2, 3]).aux_layer_ids == [1, 2, 3]


def test_head_capture_and_runtime_target_refuse_unsorted_ids(tiny_llama):
    from draftsmith.core.target import TargetModel
    from draftsmith.data_pipeline.capture import capture

    target = tiny_llama()
    with pytest.raises(ValueError, match="ascending"):
        Eagle3Config.from_target(target.config, aux_layer_ids=tuple(UNSORTED))
    with pytest.raises(ValueError, match="ascending"):
        capture(target, torch.tensor([[3, 4, 5]]), UNSORTED)
    with pytest.raises(ValueError, match="ascending"):
        TargetModel(target, aux_layer_ids=UNSORTED)
    aux = capture(target, torch.tensor([[3, 4, 5]]), [1, 2, 3]).aux_hidden
    assert aux.shape == (1, 3, 96)


def head_config(target, ids):
    """A head config dict as ``Eagle3Config.to_dict()`` writes it, with ``ids`` set unchecked."""
    hc = Eagle3Config.from_target(target.config).to_dict()
    hc["aux_layer_ids"] = list(ids)
    return hc


@pytest.mark.parametrize("engine", ["vllm", "sglang", "speculators"])
def test_engines_read_the_ids_in_layer_order(tiny_llama, engine):
    """vLLM (``gpu_model_runner`` + ``llama.py``: ``if idx in aux_hidden_state_layers`` while iterating the
    layers) and SGLang (``llama.py``: ``if i in self.layers_to_capture``) collect the states in layer order."""
    target = tiny_llama()
    hc = head_config(target, UNSORTED)
    target_cfg = target.config.to_dict()
    cfg = (
        speculators_config(hc, target_cfg, {"name_or_path": "tiny"}, 3)
        if engine == "speculators"
        else research_config(hc, target_cfg)
    )
    assert engine_view(engine, cfg).aux_layer_ids == (1, 2, 3)
    problems = engine_problems(engine, cfg, hc, target_num_layers=4)
    assert [f for f, _ in problems] == ["aux_layer_ids"], problems
    assert "(1, 2, 3)" in problems[0][1] and "(3, 2, 1)" in problems[0][1]
    sorted_hc = head_config(target, [1, 2, 3])
    assert engine_problems(engine, cfg, sorted_hc, target_num_layers=4) == []  # what the engine computes


def test_existing_export_with_unsorted_ids_is_refused(tiny_llama, word_tokenizer, tmp_path):
    """A head exported before the refusal: ids [3, 2, 1] consistently in draftsmith.json and both configs."""
    target, tok = tiny_llama(seed=1), word_tokenizer()
    head = Eagle3Head(Eagle3Config.from_target(target.config))
    out = export_eagle3(head, tmp_path / "head", target_identity(target, tok, "tiny"), target.config, formats=("all",))
    meta = json.loads((out / "draftsmith.json").read_text())
    meta["aux_layer_ids"] = meta["head_config"]["aux_layer_ids"] = UNSORTED
    (out / "draftsmith.json").write_text(json.dumps(meta))
    for rel in ("config.json", "speculators/config.json"):
        cfg = json.loads((out / rel).read_text())
        cfg["eagle_aux_hidden_state_layer_ids"] = UNSORTED
        if "eagle_config" in cfg:
            cfg["eagle_config"]["eagle_aux_hidden_state_layer_ids"] = [i - 1 for i in UNSORTED]
        (out / rel).write_text(json.dumps(cfg))
    for call in (
        lambda: check_head(out, target, tok),
        lambda: check_head(out, None),
        lambda: load_eagle3(out, target_model=target, tokenizer=tok),
        lambda: load_eagle3(out / "speculators"),
    ):
        with pytest.raises(HeadMismatchError) as err:
            call()
        msg = str(err.value)
        assert err.value.field == "aux_layer_ids" and "ascending" in msg and "Fix:" in msg, msg
