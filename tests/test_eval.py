"""``draftsmith eval``: the recipe's drafter and labelled rows side by side, each at its own k, decoded for real."""

import pytest
import torch

from draftsmith import reference
from draftsmith.arguments import drafter as drafter_arg
from draftsmith.config import load_config
from draftsmith.core.generate import GenerationConfig, generate_plain
from draftsmith.core.target import TargetModel
from draftsmith.evaluation.heldout import format_table, plot_acceptance
from draftsmith.pipeline.recipe import Recipe
from draftsmith.pipeline.stages import eval_rows, run_eval


def recipe_with(tmp_path, *overrides):
    return load_config(
        Recipe,
        None,
        [
            f"out_dir={tmp_path}",
            "name=ev",
            "eval.tasks=[code-complete]",
            "eval.prompts_per_task=2",
            "eval.max_new_tokens=12",
            "eval.threads=1",
            *overrides,
        ],
    )


def test_rows_take_the_recipe_drafters_k_unless_their_own(tmp_path):
    recipe = recipe_with(
        tmp_path,
        "drafter.num_speculative_tokens=3",
        "eval.drafters={sibling: {method: draft_model, model: reference-draft}, "
        "long: {method: ngram, prompt_lookup_max: 8, num_speculative_tokens: 4}}",
    )
    rows = eval_rows(recipe, None)  # no head: the recipe's own EAGLE-3 row needs one
    assert list(rows) == ["sibling", "long"]
    assert rows["sibling"].to_dict() == {
        "method": "draft_model",
        "model": "reference-draft",
        "num_speculative_tokens": 3,
    }
    assert rows["long"].num_speculative_tokens == 4 and rows["long"].options["prompt_lookup_max"] == 8
    assert {r.num_speculative_tokens for r in eval_rows(recipe, None, k=2).values()} == {2}  # --k: every row
    picked = eval_rows(recipe, None, ["long", "ngram", "draft_model"])  # --methods
    assert list(picked) == ["long", "ngram", "draft_model"] and picked["draft_model"].model == "reference-draft"
    with pytest.raises(ValueError, match="already a row"):
        eval_rows(recipe_with(tmp_path, "drafter.method=ngram", "eval.drafters={ngram: {method: ngram}}"), None)
    with pytest.raises(ValueError, match="needs a model"):
        eval_rows(recipe, None, ["eagle3"])
    with pytest.raises(ValueError, match="neither a row"):
        eval_rows(recipe, None, ["nope"])


def test_a_k_sweep_makes_a_row_per_value(tmp_path):
    recipe = recipe_with(tmp_path, "drafter.num_speculative_tokens=3", "eval.drafters={long: {method: ngram}}")
    rows = eval_rows(recipe, None, ["long"], [1, 3, "auto"])
    assert list(rows) == ["long@k1", "long@k3", "long@auto"]
    assert rows["long@auto"].adaptive and rows["long@k3"].num_speculative_tokens == 3
    assert list(eval_rows(recipe, None, ["long"], ["auto"])) == ["long"] and eval_rows(recipe, None, ["long"], "auto")


def test_drafter_cli_argument():
    import argparse

    assert drafter_arg('d={"method": "draft_model", "model": "x"}') == ("d", {"method": "draft_model", "model": "x"})
    for bad in ("d", "d=[1]", "={}", "d={oops"):
        with pytest.raises(argparse.ArgumentTypeError, match="LABEL="):
            drafter_arg(bad)


def test_eval_decodes_each_row_at_its_own_k_with_draft_cost(tmp_path):
    """Rows are decoded, not only configured: a row at k=4 and one at k=2 each draft at most their k per step, and
    every greedy output equals plain decoding."""
    target, tok = reference.target()
    recipe = recipe_with(
        tmp_path,
        "drafter.num_speculative_tokens=4",
        "eval.drafters={sibling: {method: draft_model, model: reference-draft}, "
        "short: {method: ngram, prompt_lookup_min: 1, num_speculative_tokens: 2}}",
    )
    report = run_eval(recipe, None, target, tok)
    rows = report["tasks"]["code-complete"]
    assert report["config"]["methods"] == ["sibling", "short"] and report["config"]["ks"] == {"sibling": 4, "short": 2}
    assert report["config"]["onednn"] == "auto"  # the kernels draftsmith serve runs (core.onednn), recorded
    assert report["config"]["packed_linears"] == (57 if torch.backends.mkldnn.is_available() else 0)
    for label, k in (("sibling", 4), ("short", 2)):
        row = rows[label]
        assert row["greedy_mismatches"] == 0 and len(row["accepted_per_pos"]) == k
        assert 0 < row["num_draft_tokens"] <= k * row["num_drafts"]
    assert rows["sibling"]["num_draft_tokens"] > 2 * rows["sibling"]["num_drafts"]  # k=4 drafts, not 2
    sibling = rows["sibling"]
    assert sibling["draft_ms_per_token"] > 0 and 0 < sibling["draft_seconds"] < sibling["seconds"]
    assert rows["plain"]["ms_per_token"] > 0
    table = format_table(report)
    assert "draft ms/tok" in table.splitlines()[0] and "sibling" in table
    plot_acceptance(report, tmp_path / "acceptance.png")
    assert (tmp_path / "acceptance.png").stat().st_size > 0


def test_eval_stops_where_serving_stops(tmp_path):
    """An end-of-turn id the generation config adds (not the tokenizer's EOS) ends eval's decoding as it ends a
    served request (``core.stops.stop_token_ids``): the rows stop at it too."""
    target, tok = reference.target()
    prompt = reference.tasks(["code-complete"], limit=1)["code-complete"][0]["messages"]
    from draftsmith.data_pipeline.chat import prompt_ids

    ids = prompt_ids(tok, prompt)
    free = generate_plain(TargetModel(target), ids, GenerationConfig(max_new_tokens=12)).tokens
    stop = free[3]  # a token the target emits: make it an end-of-turn id
    target.generation_config.eos_token_id = [tok.eos_token_id, stop]
    try:
        report = run_eval(
            recipe_with(tmp_path, "drafter.method=ngram", "drafter.prompt_lookup_min=1", "eval.prompts_per_task=1"),
            None,
            target,
            tok,
        )
    finally:
        target.generation_config.eos_token_id = tok.eos_token_id
    rows = report["tasks"]["code-complete"]
    first = free.index(stop) + 1  # tokens up to and including the end-of-turn id
    assert rows["plain"]["new_tokens"] == rows["ngram"]["new_tokens"] == first < 12


def test_batched_eval_reports_the_counters_of_one_prompt_at_a_time(tmp_path):
    """``eval.batch_size=3`` decodes the task's prompts together; τ, acceptance and every counter equal those of
    one prompt at a time, for a drafter with a batched proposer (draft model) and a per-row one (n-gram)."""
    target, tok = reference.target()
    overrides = (
        "eval.prompts_per_task=4",
        "drafter.num_speculative_tokens=3",
        "eval.drafters={sibling: {method: draft_model, model: reference-draft}, lookup: {method: ngram}}",
    )
    one = run_eval(recipe_with(tmp_path / "one", *overrides), None, target, tok)["tasks"]["code-complete"]
    batched = run_eval(recipe_with(tmp_path / "b", *overrides, "eval.batch_size=3"), None, target, tok)
    rows = batched["tasks"]["code-complete"]
    counters = ("tau", "acceptance_rate", "accepted_per_pos", "num_drafts", "num_draft_tokens", "new_tokens")
    for label in ("sibling", "lookup"):
        assert {c: rows[label][c] for c in counters} == {c: one[label][c] for c in counters}, label
        assert rows[label]["greedy_mismatches"] == 0 and rows[label]["num_drafts"] > 0
        assert 0 < rows[label]["draft_seconds"] < rows[label]["seconds"]
    assert rows["plain"]["new_tokens"] == one["plain"]["new_tokens"]
