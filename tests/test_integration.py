"""End to end on the reference target: prepare -> train -> export -> check -> lossless decoding.

Marked slow (minutes on 2 CPU cores); part of `make test`."""

import pytest
import torch

from draftsmith import reference
from draftsmith.config import load_config
from draftsmith.core.generate import GenerationConfig, generate_plain, generate_speculative
from draftsmith.core.target import TargetModel
from draftsmith.data_pipeline.chat import prompt_ids
from draftsmith.drafters.eagle3.check import check_head, load_eagle3
from draftsmith.export.metadata import HeadMismatchError
from draftsmith.pipeline.recipe import Recipe
from draftsmith.pipeline.stages import build_eval_rows, eval_rows, run_train

pytestmark = pytest.mark.slow
NUM_PROMPTS = 20
MAX_NEW = 32


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """A briefly trained head (losslessness holds for any head; a few steps keep it quick)."""
    torch.set_num_threads(2)
    out = tmp_path_factory.mktemp("runs")
    recipe = load_config(
        Recipe,
        None,
        [
            f"out_dir={out}",
            "name=it",
            "data.num_conversations=24",
            "data.heldout_conversations=0",
            "data.regenerate=false",
            "data.max_length=256",
            "data.draft_vocab_size=1024",
            "train.max_steps=4",
            "train.batch_size=6",
            "train.epochs=1",
        ],
    )
    target, tok = reference.target()
    head_dir = run_train(recipe, target, tok)
    return target, tok, head_dir


@pytest.fixture(scope="module")
def prompts(trained):
    _, tok, _ = trained
    tasks = reference.tasks()
    picked = [r for name in reference.TASK_NAMES for r in tasks[name][: NUM_PROMPTS // 4]]
    return [prompt_ids(tok, r["messages"]) for r in picked]


@pytest.fixture(scope="module")
def plain_outputs(trained, prompts):
    target, tok, _ = trained
    cfg = GenerationConfig(max_new_tokens=MAX_NEW, eos_token_ids=[tok.eos_token_id])
    return [generate_plain(TargetModel(target), p, cfg).tokens for p in prompts]


def test_the_trained_head_is_lossless_greedy(trained, prompts, plain_outputs):
    """The head the pipeline trained and exported, served as eval serves it (every drafter's untrained example is
    held to the same in tests/test_contract.py)."""
    target, tok, head_dir = trained
    recipe = load_config(Recipe, None, [])
    cfg = GenerationConfig(max_new_tokens=MAX_NEW, eos_token_ids=[tok.eos_token_id])
    accepted = 0
    for k in (1, 3, 5):
        [row] = build_eval_rows(eval_rows(recipe, head_dir, ["eagle3"], k=k), target, tok).values()
        for p, expected in zip(prompts, plain_outputs):
            out = generate_speculative(row.target, row.make_proposer(), p, cfg, k)
            assert out.tokens == expected, f"k={k} diverged from plain greedy"
            accepted += out.stats.num_accepted_tokens
    assert accepted > 0


def test_exported_head_reloads_bit_identically(trained):
    target, tok, head_dir = trained
    a, _ = load_eagle3(head_dir, target, tok)
    b, _ = load_eagle3(head_dir, target, tok)
    for (name, x), y in zip(a.state_dict().items(), b.state_dict().values()):
        assert torch.equal(x, y), name
    ids = torch.randint(3, 8000, (1, 12), generator=torch.Generator().manual_seed(0))
    aux = torch.randn(1, 12, 3 * target.config.hidden_size, generator=torch.Generator().manual_seed(1))
    from draftsmith.drafters.eagle3.head import HeadKV

    la = a.step(a.fuse(aux), ids, HeadKV(), "prefix")[1]
    lb = b.step(b.fuse(aux), ids, HeadKV(), "prefix")[1]
    assert torch.equal(la, lb)


def test_head_is_refused_on_another_target(trained, tmp_path):
    _, _, head_dir = trained
    draft, draft_tok = reference.draft()
    with pytest.raises(HeadMismatchError, match="hidden_size"):
        check_head(head_dir, draft.config, draft_tok, "reference-draft")
    with pytest.raises(HeadMismatchError):
        load_eagle3(head_dir, draft, draft_tok)


def test_cli_check_exit_codes(trained, capsys):
    from draftsmith.cli import main

    _, _, head_dir = trained
    assert main(["check", str(head_dir), "--target", "reference"]) == 0
    assert main(["check", str(head_dir), "--target", "reference-draft"]) == 1
    assert "hidden_size" in capsys.readouterr().err


def test_the_heads_metadata_records_the_training_precision_and_why(trained):
    from draftsmith.export.metadata import read_metadata
    from draftsmith.precision import dtype_speed

    _, _, head_dir = trained
    recorded = read_metadata(head_dir).training["precision"]
    native = dtype_speed(torch.bfloat16).fast
    assert recorded["requested"] == "auto" and recorded["value"] == ("bf16" if native else "no")
    assert "matmul took" in recorded["reason"]


def test_the_export_carries_a_golden_trace_our_server_reproduces(trained):
    """Every export gets ``trace.json`` (``export.trace``); replayed through draftsmith's own server it certifies
    'identical' (``draftsmith certify``)."""
    from draftsmith.evaluation.certify import certify, read_trace
    from draftsmith.serve.engine import Engine
    from draftsmith.serve.server import BackgroundServer, create_app

    target, tok, head_dir = trained
    trace = read_trace(head_dir)
    assert trace["head_type"] == "eagle3" and len(trace["prompts"]) == 4 and trace["max_tokens"] == 32
    k = trace["speculative_config"]["num_speculative_tokens"]
    spec = {"method": "eagle3", "model": str(head_dir), "num_speculative_tokens": k}
    with BackgroundServer(create_app(Engine(target, tok, spec, model_name="reference"))) as server:
        result = certify(head_dir, server.url)
    assert result.verdict == "identical", result.summary()


def test_eval_of_the_runs_own_head_is_recorded_in_it_and_no_other(trained, tmp_path):
    """``run_eval`` records its held-out acceptance in the run's own export (what ``auto`` starts a served head
    from: ``serve.costs.recorded_acceptance``); a head from elsewhere is read, never written."""
    import shutil

    from draftsmith.export.metadata import read_metadata
    from draftsmith.pipeline.stages import run_eval
    from draftsmith.serve.costs import recorded_acceptance

    target, tok, head_dir = trained
    overrides = ["eval.tasks=[code-complete]", "eval.prompts_per_task=1", "eval.max_new_tokens=8", "eval.threads=1"]
    own = load_config(Recipe, None, [f"out_dir={tmp_path}", "name=own", *overrides])
    shutil.copytree(head_dir, own.run_dir / "head")
    other = shutil.copytree(head_dir, tmp_path / "elsewhere")
    report = run_eval(own, own.run_dir / "head", target, tok)
    rates = recorded_acceptance(own.run_dir / "head", "eagle3")
    assert report["recorded_in"] == str(own.run_dir / "head" / "draftsmith.json")
    assert rates and len(rates) == len(report["tasks"]["code-complete"]["eagle3"]["accepted_per_pos"])
    before = read_metadata(other).eval
    report = run_eval(own, other, target, tok)
    assert "recorded_in" not in report and read_metadata(other).eval == before
