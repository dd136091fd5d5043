"""``draftsmith eval``: every drafter side by side (labelled extra drafters, draft cost per token)."""
import pytest

from draftsmith import reference
from draftsmith.arguments import drafter as drafter_arg
from draftsmith.inference.eval import EvalConfig, evaluate, format_table, plot_acceptance
from draftsmith.pipeline import build_proposers, drafter_specs


def test_drafter_specs_rows_and_labels():
    cfg = EvalConfig(k=3, drafters={"sibling": {"method": "draft_model", "model": "reference-draft"},
                                    "long": {"method": "ngram", "prompt_lookup_max": 8, "num_speculative_tokens": 4}})
    specs = drafter_specs(["ngram", "draft_model"], cfg, None)
    assert list(specs) == ["ngram", "draft_model", "sibling", "long"]
    assert specs["sibling"] == {"num_speculative_tokens": 3, "method": "draft_model", "model": "reference-draft"}
    assert specs["long"]["num_speculative_tokens"] == 4            # a drafter's own k wins over eval.k
    with pytest.raises(ValueError, match="already a row"):
        drafter_specs(["ngram"], EvalConfig(drafters={"ngram": {"method": "ngram"}}), None)
    with pytest.raises(ValueError, match="head directory"):
        drafter_specs(["eagle3"], EvalConfig(), None)


def test_drafter_cli_argument():
    import argparse

    assert drafter_arg('d={"method": "draft_model", "model": "x"}') == ("d", {"method": "draft_model", "model": "x"})
    for bad in ("d", "d=[1]", "={}", "d={oops"):
        with pytest.raises(argparse.ArgumentTypeError, match="LABEL="):
            drafter_arg(bad)


def test_eval_reports_labelled_drafters_with_draft_cost(tmp_path):
    target, tok = reference.target()
    cfg = EvalConfig(tasks=["code-complete"], methods=["ngram"], k=3, prompts_per_task=2, max_new_tokens=12,
                     threads=1, drafters={"sibling": {"method": "draft_model", "model": "reference-draft"}})
    factories, aux = build_proposers(cfg.methods, cfg, target, tok, None)
    report = evaluate(target, tok, reference.tasks(cfg.tasks), factories, cfg, aux_layer_ids=aux)
    rows = report["tasks"]["code-complete"]
    assert report["config"]["methods"] == ["ngram", "sibling"]
    sibling = rows["sibling"]
    assert sibling["greedy_mismatches"] == 0 and rows["ngram"]["greedy_mismatches"] == 0
    assert sibling["num_draft_tokens"] > 0 and sibling["draft_ms_per_token"] > 0
    assert 0 < sibling["draft_seconds"] < sibling["seconds"]       # drafting is part of the method's time
    assert rows["plain"]["ms_per_token"] > 0
    table = format_table(report)
    assert "draft ms/tok" in table.splitlines()[0] and "sibling" in table
    plot_acceptance(report, tmp_path / "acceptance.png")
    assert (tmp_path / "acceptance.png").stat().st_size > 0
