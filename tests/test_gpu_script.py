"""bench/gpu_demo.py, the prepared run for a CUDA machine, and its two shell scripts.

Without CUDA (the normal suite, seconds): the scripts compile, the arguments become the recipe overrides the
run applies (validated by the recipe's own typed configs), a run refuses to start without CUDA, deadlines
cut a stage and are cleared afterwards, and the closing table names the device, the settings, each stage
and each cut. Opt-in (marker ``gpu``: ``DRAFTSMITH_RUN_GPU=1`` or ``pytest -m gpu``, and CUDA present): the
real run through ``bench/gpu_demo.sh``, about 7 minutes.
"""

from __future__ import annotations

import json
import os
import py_compile
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parent.parent
SCRIPTS = ROOT / "bench"


def _load_script(name: str):
    """A script under bench/ as a module (bench/ holds scripts, not a package)."""
    import importlib.util

    spec = importlib.util.spec_from_file_location(f"bench_{name}", SCRIPTS / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


gpu_demo = _load_script("gpu_demo")


def test_scripts_compile(tmp_path):
    py_compile.compile(str(SCRIPTS / "gpu_demo.py"), cfile=str(tmp_path / "gpu_demo.pyc"), doraise=True)
    for name in ("gpu_demo.sh", "gpu_wheels.sh", "gpu_env.sh", "gpu_checks.sh"):
        done = subprocess.run(["bash", "-n", str(SCRIPTS / name)], capture_output=True, text=True)
        assert done.returncode == 0, f"{name}: {done.stderr}"


def test_arguments_become_recipe_overrides():
    args = gpu_demo.build_parser().parse_args(
        ["--train-steps", "300", "--conversations", "600", "--k", "4", "--target-dtype", "bfloat16", "train.lr=1e-3"]
    )
    overrides = gpu_demo.recipe_overrides(args)
    assert overrides[-1] == "train.lr=1e-3"  # the user's own come last
    recipe, applied = gpu_demo.load_recipe(args)
    assert applied == overrides
    assert (recipe.train.max_steps, recipe.train.mixed_precision, recipe.train.mode, recipe.train.lr) == (
        300,
        "bf16",
        "online",
        1e-3,
    )
    assert (
        recipe.data.num_conversations,
        recipe.data.batch_size,
        recipe.target.dtype,
        recipe.drafter.num_speculative_tokens,
    ) == (600, 256, "bfloat16", 4)


def test_defaults_keep_the_demo_recipe_data_and_eval():
    args = gpu_demo.build_parser().parse_args([])
    recipe, overrides = gpu_demo.load_recipe(args)
    assert recipe.train.max_steps == 400 and recipe.train.mixed_precision == "bf16"
    assert recipe.target.dtype == "float32"  # capture and serving share it
    assert (recipe.data.num_conversations, recipe.data.max_new_tokens) == (2400, 128)
    assert (
        recipe.drafter.method,
        list(recipe.eval.drafters),
        recipe.drafter.num_speculative_tokens,
        recipe.eval.prompts_per_task,
        recipe.eval.max_new_tokens,
    ) == ("eagle3", ["ngram", "draft_model"], 5, 8, 64)
    assert not any(o.startswith(("data.num_conversations", "eval.", "drafter.")) for o in overrides)


def test_dry_run_prints_the_plan_and_bad_overrides_are_refused(capsys):
    assert gpu_demo.main(["--dry-run", "--budget-s", "300", "--started-at", "1000"]) == 0
    plan = capsys.readouterr().out
    assert "train.max_steps=400" in plan and "train.mixed_precision=bf16" in plan
    assert "train    cut at    216 s" in plan  # 0.72 of the budget
    assert gpu_demo.main(["--dry-run", "train.no_such_key=1"]) == 2
    assert "train.no_such_key" in capsys.readouterr().err


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the refusal without CUDA")
def test_without_cuda_the_run_refuses_to_start(tmp_path, capsys):
    assert gpu_demo.main(["--out", str(tmp_path / "out")]) == 2
    assert "no CUDA device" in capsys.readouterr().err
    assert not (tmp_path / "out").exists()  # nothing was started


def test_non_empty_work_dir_is_refused(tmp_path, capsys):
    (tmp_path / "old").mkdir()
    (tmp_path / "old" / "leftover").write_text("x")
    assert gpu_demo.main(["--device", "cpu", "--work-dir", str(tmp_path / "old"), "--out", str(tmp_path)]) == 2
    assert "not empty" in capsys.readouterr().err


def test_deadline_cuts_the_block_and_is_cleared_after():
    with pytest.raises(gpu_demo.StageTimeout, match="slow stage"):
        with gpu_demo.deadline(time.time() + 0.05, "slow stage"):
            for _ in range(500):  # bounded: 5 s at most
                time.sleep(0.01)
    with pytest.raises(gpu_demo.StageTimeout):  # already past: fires inside the block
        with gpu_demo.deadline(time.time() - 1, "late"):
            for _ in range(500):
                time.sleep(0.01)
    with gpu_demo.deadline(time.time() + 0.05, "quick"):
        pass
    for _ in range(10):
        time.sleep(0.01)  # the cleared timer never fires


def test_run_records_a_cut_stage_and_a_failed_one(tmp_path):
    run = gpu_demo.Run(tmp_path, time.time(), 600.0, {"budget_s": 600.0})
    with run.stage("slow", time.time() + 0.05) as rec:
        for _ in range(500):
            time.sleep(0.01)
    assert rec["status"] == "cut"
    with pytest.raises(ValueError):
        with run.stage("broken"):
            raise ValueError("bad input")
    with run.stage("fine") as rec:
        rec["note"] = "all good"
    saved = json.loads((tmp_path / "gpu_demo.json").read_text())
    assert [(s["name"], s["status"]) for s in saved["stages"]] == [
        ("slow", "cut"),
        ("broken", "failed"),
        ("fine", "done"),
    ]
    assert saved["stages"][1]["note"] == "ValueError: bad input" and saved["stages"][2]["note"] == "all good"


def test_an_eval_cut_keeps_the_finished_tasks(tmp_path, monkeypatch):
    """``run_eval_by_task`` under the eval deadline: the task it reaches the deadline in is lost, the ones
    before it stay in the result (stub evaluate: the first task returns at once, the second never ends)."""
    import draftsmith.evaluation.heldout as eval_mod
    import draftsmith.pipeline.stages as pipeline
    from draftsmith import reference
    from draftsmith.evaluation.config import EvalConfig

    tasks = ["code-complete", "code-foreign", "docstring"]

    def evaluate(target, tokenizer, chosen, rows, cfg):
        (task,) = chosen
        if task == "code-foreign" and cfg.max_new_tokens > 16:  # the real run of the second task hangs
            for _ in range(1000):
                time.sleep(0.01)
        return {"config": {"k": 3, "methods": ["ngram"]}, "tasks": {task: {"prompts": len(chosen[task])}}}

    monkeypatch.setattr(eval_mod, "evaluate", evaluate)
    monkeypatch.setattr(pipeline, "build_eval_rows", lambda *a, **k: {})
    monkeypatch.setattr(pipeline, "eval_rows", lambda *a, **k: {})
    monkeypatch.setattr(reference, "tasks", lambda names: {t: [{"messages": []}] * 3 for t in names})
    recipe = type(
        "R",
        (),
        {
            "eval": EvalConfig(tasks=tasks, max_new_tokens=64),
            "drafter": type("D", (), {"method": "ngram"}),
            "target": type("T", (), {"name_or_path": "reference"}),
        },
    )()
    run = gpu_demo.Run(tmp_path, time.time(), 600.0, {"budget_s": 600.0})
    run.deadlines["eval"] = time.time() + 2.0
    with run.stage("eval", run.deadlines["eval"]) as rec:
        gpu_demo.run_eval_by_task(run, recipe, None, None, Path("head"), rec)
    assert rec["status"] == "cut" and rec["running"] == ["code-foreign", "docstring"]
    assert list(run.result["eval"]["tasks"]) == ["code-complete"]
    assert run.result["eval"]["head"] == "head"


def _result(cuts=()):
    """A result record as ``execute`` fills it, with made-up figures (formatting only)."""
    row = {
        "tau": 3.1,
        "acceptance_rate": 0.42,
        "accepted_per_pos": [0.8, 0.6, 0.4, 0.3, 0.2],
        "tokens_per_s": 420.0,
        "speedup": 1.9,
        "draft_ms_per_token": 0.8,
    }
    plain = {"tokens_per_s": 220.0, "ms_per_token": 4.5, "new_tokens": 512, "seconds": 2.3}
    report = {
        "config": {"k": 5, "max_new_tokens": 64, "methods": ["eagle3", "ngram"]},
        "tasks": {
            t: {"prompts": 8, "plain": plain, "eagle3": row, "ngram": row} for t in ("code-complete", "docstring")
        },
    }
    from draftsmith.evaluation.heldout import format_table

    return {
        "device": {"type": "cuda", "name": "NVIDIA H200", "memory_gib": 139.8, "capability": "9.0"},
        "versions": {
            "torch": "2.11.0+cu130",
            "cuda": "13.0",
            "transformers": "5.24.0",
            "accelerate": "1.15.0",
            "draftsmith": {"version": "0.1.0"},
        },
        "settings": {
            "budget_s": 420.0,
            "target_dtype": "float32",
            "train": {"max_steps": 400, "mixed_precision": "bf16", "mode": "online"},
            "eval": {"k": 5, "prompts_per_task": 8, "max_new_tokens": 64},
        },
        "train": {"steps": 350},
        "stages": [
            {"name": "prepare", "seconds": 31.5, "status": "done", "note": "2400 conversations"},
            {"name": "train", "seconds": 80.0, "status": "cut", "note": "350 of 400 steps"},
        ],
        "cuts": list(cuts),
        "table": format_table(report),
        "wall_clock_s": 300.2,
        "peak_gpu_memory_gib": 2.5,
    }


def test_summary_names_the_gpu_settings_stages_and_cuts():
    text = gpu_demo.format_summary(_result(cuts=["training: stopped at its deadline"]))
    first = text.splitlines()[0]
    assert "NVIDIA H200" in first and "139.8 GiB" in first
    assert "float32" in text and "head 350 steps (max 400)" in text and "mixed precision bf16" in text
    assert "code-complete" in text and "docstring" in text and "speedup" in text
    stage_lines = [line for line in text.splitlines() if line.startswith(("prepare", "train "))]
    assert len(stage_lines) == 2 and "cut" in stage_lines[1]
    assert text.splitlines()[-1] == "cuts: training: stopped at its deadline"
    assert gpu_demo.format_summary(_result()).splitlines()[-1] == "cuts: none"


def test_summary_of_a_run_stopped_before_eval():
    res = _result()
    del res["table"], res["wall_clock_s"], res["train"]
    text = gpu_demo.format_summary(res)
    assert "no eval table" in text and "head ? steps (max 400)" in text


@pytest.fixture
def gpu_opted_in(request):
    """Skip unless asked for (DRAFTSMITH_RUN_GPU=1 or ``-m gpu``) and CUDA is present."""
    asked = os.environ.get("DRAFTSMITH_RUN_GPU") == "1" or "gpu" in (
        request.config.getoption("markexpr", default="") or ""
    )
    if not asked:
        pytest.skip("opt-in: DRAFTSMITH_RUN_GPU=1 (or -m gpu)")
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA device")


@pytest.mark.gpu
def test_gpu_demo_runs_for_real(tmp_path, gpu_opted_in):
    out = tmp_path / "out"
    env = {**os.environ, "OUT": str(out), "PYTHON": sys.executable}
    done = subprocess.run(
        ["bash", str(SCRIPTS / "gpu_demo.sh"), "--budget-s", "420"],
        env=env,
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=600,
    )
    print(done.stdout[-6000:])
    assert done.returncode in (0, 4), done.stdout[-3000:] + done.stderr[-3000:]
    res = json.loads((out / "gpu_demo.json").read_text())
    assert res["device"]["type"] == "cuda" and all(c["ok"] for c in res["preflight"])
    assert res["table"].splitlines()[0].startswith("task")
    for task, rows in res["eval"]["tasks"].items():
        for method in res["eval"]["config"]["methods"]:
            assert rows[method]["greedy_mismatches"] == 0, (task, method)  # greedy speculation is lossless


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_cuda_head_warm_starts_from_a_target_on_the_device():
    """The trainer moves the target to the device, then builds the head on the CPU and warm-starts it
    (train/trainer.py, drafters/eagle3/head.py ``init_from_target``): that must work across devices."""
    from draftsmith.models import load_causal_lm

    target, tokenizer = load_causal_lm("reference")
    target.to("cuda")
    assert "warm-starts" in gpu_demo.check_head_warm_start(target, tokenizer)


def test_gpu_checks_runs_its_steps_on_a_cpu_and_packs_what_it_made(tmp_path):
    """bench/gpu_checks.sh with DRAFTSMITH_CHECK_DEVICE=cpu and a budget that leaves room for its first steps only:
    env and dflash_cost run (rc=0), the steps past the budget are skipped, and the logs come back packed."""
    import tarfile

    from draftsmith import drafters, reference

    model, tok = reference.target()
    head = drafters.get("eagle3").example(model, tok, tmp_path / "heads").model
    out = tmp_path / "out"
    env = {
        **os.environ,
        "OUT": str(out),
        "PYTHON": sys.executable,
        "DRAFTSMITH_CHECK_DEVICE": "cpu",
        "DRAFTSMITH_WHEELS": str(tmp_path / "no-wheels"),  # the GPU machine's wheels are not for this one
    }
    env.pop("PYTHONPATH", None)
    done = subprocess.run(
        ["bash", str(SCRIPTS / "gpu_checks.sh"), head, "25"], capture_output=True, text=True, env=env, timeout=300
    )
    assert done.returncode == 0, done.stderr
    assert "== env: rc=0" in done.stdout and "== gpu_demo: skipped" in done.stdout, done.stdout
    with tarfile.open(out / "gpu_checks.tar.gz") as tar:
        assert "./env.log" in tar.getnames()
