"""Common mistakes get one line, ``draftsmith VERB: error: <problem>; <fix>``, a non-zero exit, and no traceback
(issue 13, fault 6); what can be checked without torch is reported before torch is imported.

Most tests run ``cli.main`` in this process (capsys); two run a subprocess: the no-torch check (many mistakes in
one interpreter) and one end-to-end run of ``python -m draftsmith.cli``.
"""

from __future__ import annotations

import dataclasses
import errno
import json
import os
import socket
import subprocess
import sys
from pathlib import Path
from typing import Literal

import pytest

from draftsmith import cli
from draftsmith.config import ConfigError, from_dict, load_config

REPO = Path(__file__).resolve().parents[1]


def fails(capsys, argv, status=1) -> str:
    """Run ``draftsmith ARGV``; assert exit ``status`` and ONE line on stderr, no traceback; return that line."""
    try:
        rc = cli.main(argv)
    except SystemExit as e:  # argparse's own errors exit
        rc = e.code
    err = capsys.readouterr().err
    assert rc == status, (rc, err)
    assert "Traceback" not in err, err
    lines = [line for line in err.splitlines() if line.strip()]
    assert len(lines) == 1, err
    assert lines[0].startswith(f"draftsmith {argv[0]}: "), err
    return lines[0]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory, tiny_llama, word_tokenizer):
    """A plain draft-model folder (tiny Llama + word tokenizer), saved by transformers."""
    root = tmp_path_factory.mktemp("plain")
    tiny_llama(num_hidden_layers=1).save_pretrained(root / "model")
    word_tokenizer().save_pretrained(root / "model")
    return root / "model"


@pytest.fixture
def offline(monkeypatch):
    """HF_HUB_OFFLINE=1 as huggingface_hub reads it (whatever this process was started with)."""
    from huggingface_hub import constants

    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)


def copy_folder(src: Path, dst: Path) -> Path:
    dst.mkdir()
    for f in src.iterdir():
        (dst / f.name).write_bytes(f.read_bytes())
    return dst


# --- recipes: files, YAML syntax, the boolean trap ------------------------------------------------------------


def test_recipe_yaml_syntax_error_names_file_and_line(tmp_path, capsys):
    bad = tmp_path / "bad.yaml"
    bad.write_text("name: x\ntrain:\n  lr: [1, 2\n")
    line = fails(capsys, ["prepare", str(bad)])
    assert str(bad) in line and "YAML syntax error" in line and "line 3" in line and "close brackets" in line


def test_recipe_file_missing_directory_unreadable_not_utf8(tmp_path, capsys, monkeypatch):
    assert "does not exist; check the path" in fails(capsys, ["train", str(tmp_path / "none.yaml")])
    assert "is a directory, not a YAML file" in fails(capsys, ["capture", str(tmp_path)])
    latin = tmp_path / "latin.yaml"
    latin.write_bytes("name: caf\xe9\n".encode("latin-1"))
    assert "is not UTF-8 text" in fails(capsys, ["prepare", str(latin)])
    locked = tmp_path / "locked.yaml"
    locked.write_text("name: x\n")

    def denied(self, *a, **k):
        raise PermissionError(errno.EACCES, "Permission denied", str(self))

    monkeypatch.setattr(Path, "read_text", denied)  # root reads a chmod 000 file, so simulate it
    line = fails(capsys, ["prepare", str(locked)])
    assert "cannot be read (Permission denied)" in line and "fix its permissions" in line


def test_override_yaml_and_shape_errors(capsys):
    assert "must look like key.path=value" in fails(capsys, ["prepare", str(cli.DEFAULT_RECIPE), "train.lr"])
    line = fails(capsys, ["prepare", "train.lr=[1"])  # the first positional is an override here
    assert "override 'train.lr=[1'" in line and "not valid YAML" in line


@dataclasses.dataclass
class Precision:
    mixed_precision: Literal["auto", "no", "bf16", "fp16"] = "auto"
    strategy: Literal["auto", "single"] = "auto"
    name: str = "x"
    revision: str | None = None
    out_dir: Path = Path("runs")


def test_unquoted_no_reads_as_the_option_no():
    """YAML 1.1 reads ``mixed_precision: no`` as False: a Literal with option "no" takes it as "no"."""
    assert from_dict(Precision, {"mixed_precision": False}).mixed_precision == "no"
    assert load_config(Precision, None, ["mixed_precision=no"]).mixed_precision == "no"
    assert load_config(Precision, None, ["mixed_precision=off"]).mixed_precision == "no"


@pytest.mark.parametrize(
    "override, expect",
    [
        ("strategy=no", "this key takes one of 'auto', 'single'"),
        ("name=no", 'quote it, e.g. name: "no"'),
        ("revision=on", 'quote it, e.g. revision: "yes"'),
        ("revision=2024", 'revision: "2024"'),
        ("out_dir=off", 'out_dir: "no"'),
    ],
)
def test_unquoted_boolean_or_number_for_a_string_says_quote_it(override, expect):
    with pytest.raises(ConfigError) as err:
        load_config(Precision, None, [override])
    msg = str(err.value)
    assert "YAML read an unquoted" in msg and expect in msg and "expected str" not in msg, msg


def test_boolean_key_and_misspelt_key():
    with pytest.raises(ConfigError, match="YAML read the key True"):
        from_dict(Precision, {True: 1})
    with pytest.raises(ConfigError, match="did you mean mixed_precision"):
        from_dict(Precision, {"mixed_precison": "no"})


def test_recipe_boolean_trap_through_the_cli(tmp_path, capsys):
    recipe = tmp_path / "no.yaml"
    recipe.write_text("name: no\n")
    line = fails(capsys, ["prepare", str(recipe)])
    assert 'name: "no"' in line and "expected str" not in line
    assert "name='\"no\"'" in fails(capsys, ["prepare", "name=off"])


def test_recipe_target_and_dtype_checked_before_loading(capsys, monkeypatch):
    import draftsmith.pipeline.stages as pipeline

    monkeypatch.setattr(pipeline, "load_target", lambda *a, **k: pytest.fail("loaded a model"))
    line = fails(capsys, ["train", "target.name_or_path=/nonexistent"])
    assert "target '/nonexistent' is neither a local folder nor a Hub id" in line and "`reference`" in line
    assert "target.dtype 'float99'" in fails(capsys, ["prepare", "target.dtype=float99"])
    line = fails(capsys, ["demo", 'eval.drafters={"x": {"method": "eagle3", "model": "/nope"}}'])
    assert "eval.drafters.x: eagle3 model '/nope' does not exist" in line
    assert "method eagle3 needs a head directory (--head DIR)" in fails(capsys, ["eval"])


# --- targets, draft models, heads -----------------------------------------------------------------------------


def test_target_nonexistent_and_offline_hub_id(capsys, offline):
    line = fails(capsys, ["generate", "--target", "/nonexistent", "--prompt", "hi"])
    assert "target '/nonexistent' is neither a local folder nor a Hub id" in line and "pass a model folder" in line
    line = fails(capsys, ["serve", "--target", "draftsmith-tests/no-such-model"])
    assert "reachable offline (HF_HUB_OFFLINE=1): pass a model folder or `reference`" in line


def test_load_causal_lm_names_the_problem(tmp_path, tiny_llama, offline):
    from draftsmith.models import load_causal_lm
    from draftsmith.sources import ModelSourceError

    with pytest.raises(ModelSourceError, match=r"target '/nonexistent' is neither a local folder nor a Hub id"):
        load_causal_lm("/nonexistent", role="target")
    with pytest.raises(ModelSourceError, match="reachable offline"):
        load_causal_lm("draftsmith-tests/no-such-model")
    no_tokenizer = tmp_path / "no-tokenizer"
    tiny_llama(num_hidden_layers=1).save_pretrained(no_tokenizer)
    with pytest.raises(ModelSourceError, match=r"draft model '.*no-tokenizer' could not be loaded: .*; "):
        load_causal_lm(str(no_tokenizer), role="draft model")  # transformers' error, one line with a fix


def test_truncated_safetensors_in_a_plain_draft_model_folder(tmp_path, model_dir, capsys):
    trunc = copy_folder(model_dir, tmp_path / "trunc")
    weights = trunc / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[: weights.stat().st_size // 2])
    spec = json.dumps({"method": "draft_model", "model": str(trunc), "num_speculative_tokens": 3})
    line = fails(capsys, ["generate", "--prompt", "hi", "--speculative-config", spec])
    assert f"{weights} is truncated" in line and "re-download it" in line
    line = fails(capsys, ["generate", "--target", str(trunc), "--prompt", "hi"])
    assert f"target '{trunc}'" in line and "is truncated" in line


def test_safetensors_header_checks(tmp_path, model_dir):
    from draftsmith.sources import ModelSourceError, check_safetensors_file

    data = (model_dir / "model.safetensors").read_bytes()
    check_safetensors_file(model_dir / "model.safetensors")
    for name, content, expect in (
        ("padded", data + b"xx", "2 bytes past its last tensor"),
        ("tiny", data[:5], "too short for its header"),
        ("garbage", data[:8] + b"{" * (len(data) - 8), "corrupted safetensors header"),
    ):
        (tmp_path / name).write_bytes(content)
        with pytest.raises(ModelSourceError, match=expect):
            check_safetensors_file(tmp_path / name)


def test_model_folder_problems(tmp_path, model_dir, capsys):
    empty = tmp_path / "empty"
    empty.mkdir()
    assert "folder without config.json" in fails(capsys, ["generate", "--target", str(empty), "--prompt", "hi"])
    no_weights = copy_folder(model_dir, tmp_path / "no-weights")
    (no_weights / "model.safetensors").unlink()
    assert "no weights" in fails(capsys, ["serve", "--target", str(no_weights)])
    bad_config = copy_folder(model_dir, tmp_path / "bad-config")
    (bad_config / "config.json").write_text("[")
    line = fails(capsys, ["generate", "--target", str(bad_config), "--prompt", "hi"])
    assert "config.json is not valid JSON" in line
    line = fails(capsys, ["generate", "--target", str(model_dir / "config.json"), "--prompt", "hi"])
    assert "is a file, not a model folder" in line


def test_eagle3_model_that_is_missing_or_not_a_head(tmp_path, model_dir, capsys):
    for model in (str(model_dir), str(tmp_path / "nothere")):
        spec = json.dumps({"method": "eagle3", "model": model, "num_speculative_tokens": 3})
        line = fails(capsys, ["generate", "--prompt", "hi", "--speculative-config", spec])
        assert f"eagle3 model '{model}'" in line and "use method draft_model" in line and "export one" in line
        assert "Errno" not in line


def test_head_arguments(tmp_path, model_dir, capsys):
    assert "is not an exported head (no draftsmith.json)" in fails(capsys, ["check", str(model_dir)])
    assert "does not exist" in fails(capsys, ["push", str(tmp_path / "x"), "--repo-id", "a/b", "--dry-run"])
    assert "is a file, not a head directory" in fails(capsys, ["eval", "--head", str(model_dir / "config.json")])
    broken = tmp_path / "broken"
    broken.mkdir()
    (broken / "draftsmith.json").write_text("{oops")
    assert "draftsmith.json is not valid JSON" in fails(capsys, ["check", str(broken)])
    line = fails(capsys, ["export", str(model_dir), "--out", str(tmp_path / "o")])
    assert "neither an exported head" in line and "train/checkpoint/state.json" in line
    head = tmp_path / "head"
    head.mkdir()
    (head / "draftsmith.json").write_text("{}")
    assert "is not a Hub repo id; pass ORG/NAME" in fails(capsys, ["push", str(head), "--repo-id", "a b"])
    (tmp_path / "o").write_text("")
    assert "--out" in fails(capsys, ["export", str(head), "--out", str(tmp_path / "o")])


# --- argument values ------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "argv, expect",
    [
        (["serve", "--dtype", "float99"], "argument --dtype: 'float99' is not a dtype draftsmith loads; pass one of"),
        (["serve", "--port", "99999"], "argument --port: 99999 is not a TCP port; pass a number in 1-65535"),
        (["serve", "--api-key", ""], "argument --api-key: is empty; pass a value, or leave the flag out"),
        (["serve", "--max-request-bytes", "0"], "argument --max-request-bytes: 0 is below 1"),
        (["generate", "--prompt", "x", "--speculative-config", "{bad"], "is not JSON"),
        (["generate", "--prompt", "x", "--speculative-config", "[1]"], "JSON but not an object"),
        (["eval", "--drafter", "x=3"], "the part after '=' must be a JSON object"),
        (["eval", "--k", "0"], "argument --k: 0 is below 1"),
        (["eval", "--tasks", "poetry"], "invalid choice: 'poetry'"),
        (["generate", "--prompt", "x", "--temperature", "-1"], "out of range"),
        (["check", "h", "--tensor-parallel-size", "zero"], "'zero' is not an integer"),
        (["bench", "--num-prompts", "0"], "argument --num-prompts: 0 is below 1"),
        (["bench", "--url", "localhost:8000"], "is not a server URL"),
    ],
)
def test_bad_argument_values_get_one_line(argv, expect, capsys):
    line = fails(capsys, argv, status=2)
    assert expect in line and f"see `draftsmith {argv[0]} --help`" in line, line


def test_port_in_use_and_bad_host(capsys, monkeypatch):
    import draftsmith.models as models

    monkeypatch.setattr(models, "load_causal_lm", lambda *a, **k: pytest.fail("loaded a model"))
    with socket.socket() as held:
        held.bind(("127.0.0.1", 0))
        held.listen()
        port = held.getsockname()[1]
        line = fails(capsys, ["serve", "--port", str(port)])
    assert f"cannot listen on 127.0.0.1:{port}" in line and "pass another --port" in line
    assert "does not resolve" in fails(capsys, ["serve", "--host", "no-such-host.invalid"])
    line = fails(capsys, ["serve", "--speculative-config", '{"method": "ngram", "num_speculative_tokens": 0}'])
    assert "num_speculative_tokens" in line and ">= 1" in line  # checked before the target loads


def test_bench_checks(tmp_path, capsys):
    line = fails(capsys, ["bench", "--methods", "none", "eagle3", "--head", str(tmp_path / "h")])
    assert "--head (method eagle3)" in line and "leave eagle3 out of --methods" in line
    assert "give 256 prompts" in fails(capsys, ["bench", "--methods", "none", "--num-prompts", "1000"])
    line = fails(capsys, ["bench", "--methods", "none", "--prompt-lookup-min", "6", "--prompt-lookup-max", "3"])
    assert "pass min <= max" in line
    (tmp_path / "file").write_text("")
    assert "is a file" in fails(capsys, ["bench", "--methods", "none", "--out", str(tmp_path / "file")])


# --- the boundary: Ctrl+C, operating-system errors, the unexpected ------------------------------------------


def _raising(error):
    def fn(args):
        raise error

    return fn


def test_ctrl_c_is_one_line(capsys, monkeypatch):
    monkeypatch.setattr(cli, "cmd_train", _raising(KeyboardInterrupt()))
    line = fails(capsys, ["train"], status=130)
    assert line == (
        "draftsmith train: interrupted (Ctrl+C); rerun the same command: training resumes from its "
        "last checkpoint (written every train.ckpt_every steps)"
    )


@pytest.mark.parametrize(
    "error, expect",
    [
        (
            PermissionError(errno.EACCES, "Permission denied", "runs/x"),
            "runs/x: permission denied; fix its permissions",
        ),
        (
            IsADirectoryError(errno.EISDIR, "Is a directory", "runs/x"),
            "runs/x: is a directory where a file is expected",
        ),
        (OSError(errno.ENOSPC, "No space left on device", "runs/x"), "no space left on the device of runs/x"),
        (FileNotFoundError(errno.ENOENT, "No such file or directory", "a.jsonl"), "a.jsonl: no such file or directory"),
        (KeyError("unknown held-out task 'x'; known: a, b"), "error: unknown held-out task 'x'; known: a, b"),
        (ValueError("first line\n  - advice"), "error: first line; advice"),
    ],
)
def test_os_and_library_errors_by_kind(error, expect, capsys, monkeypatch):
    monkeypatch.setattr(cli, "cmd_prepare", _raising(error))
    line = fails(capsys, ["prepare"])
    assert expect in line and "Errno" not in line, line


def test_unexpected_error_is_one_line_and_verbose_shows_the_traceback(capsys, monkeypatch):
    monkeypatch.setattr(cli, "cmd_prepare", _raising(ZeroDivisionError("division by zero")))
    line = fails(capsys, ["prepare"])
    assert "ZeroDivisionError: division by zero" in line and "rerun with -v" in line
    for argv, env in ((["prepare", "-v"], None), (["-v", "prepare"], None), (["prepare"], "1")):
        if env:
            monkeypatch.setenv(cli.TRACEBACK_ENV, env)
        assert cli.main(argv) == 1
        err = capsys.readouterr().err
        assert "Traceback" in err and err.strip().splitlines()[-1].startswith("draftsmith prepare: error:")


def test_shared_names_agree():
    """The torch-free copies of names the CLI checks against equal their sources."""
    from draftsmith import arguments, sources
    from draftsmith.export.metadata import METADATA_FILE
    from draftsmith.models import DTYPES

    assert set(arguments.DTYPE_NAMES) == {*DTYPES, "auto"}
    assert sources.METADATA_FILE == METADATA_FILE


# --- subprocesses: no torch for configuration errors; the real entry point ----------------------------------

NO_TORCH_CASES = [
    ["prepare", "{bad}"],
    ["prepare", "{yaml}"],
    ["train", "{dir}"],
    ["serve", "--port", "99999"],
    ["serve", "--dtype", "float99"],
    ["serve", "--api-key", ""],
    ["serve", "--max-request-bytes", "0"],
    ["serve", "--speculative-config", '{{"method": "ngram", "num_draft_tokens": 3}}'],
    ["serve", "--speculative-config", '{{"method": "eagle3", "model": "{dir}/none", "num_speculative_tokens": 3}}'],
    ["generate", "--target", "/nonexistent", "--prompt", "x"],
    ["generate", "--prompt", "x", "--speculative-config", "{{oops"],
    ["generate", "--prompt", "x", "--speculative-config", '{{"method": "eagle3", "model": "{dir}"}}'],
    ["check", "{dir}"],
    ["eval", "--head", "/nonexistent"],
    ["export", "/nonexistent", "--out", "{dir}/o"],
    ["bench", "--methods", "none", "eagle3", "--head", "/nonexistent"],
    ["push", "/nonexistent", "--repo-id", "a/b", "--dry-run"],
]


def test_configuration_errors_do_not_import_torch(tmp_path):
    bad = tmp_path / "bad.yaml"
    bad.write_text("train:\n  lr: [1\n")
    cases = [[a.format(bad=bad, yaml=tmp_path / "none.yaml", dir=tmp_path) for a in argv] for argv in NO_TORCH_CASES]
    script = (
        "import json, sys\n"
        "from draftsmith import cli\n"
        "codes = []\n"
        "for argv in json.loads(sys.argv[1]):\n"
        "    try:\n"
        "        codes.append(cli.main(argv))\n"
        "    except SystemExit as e:\n"
        "        codes.append(e.code)\n"
        "heavy = sorted(m for m in ('torch', 'transformers', 'safetensors.torch') if m in sys.modules)\n"
        "print(json.dumps({'codes': codes, 'heavy': heavy}))\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", script, json.dumps(cases)],
        capture_output=True,
        text=True,
        timeout=300,
        env=os.environ | {"HF_HUB_OFFLINE": "1"},
    )
    result = json.loads(out.stdout.strip().splitlines()[-1])
    assert result["heavy"] == [], result
    assert all(code in (1, 2) for code in result["codes"]), (result, out.stderr)
    errors = [line for line in out.stderr.splitlines() if line.strip()]
    assert len(errors) == len(cases) and all(" error: " in line for line in errors), out.stderr
    assert "Traceback" not in out.stderr


def test_entry_point_prints_one_line_not_a_traceback():
    out = subprocess.run(
        [sys.executable, "-m", "draftsmith.cli", "prepare", "name=no"],
        capture_output=True,
        text=True,
        timeout=300,
        env=os.environ | {"HF_HUB_OFFLINE": "1"},
    )
    assert out.returncode == 1 and "Traceback" not in out.stderr, out.stderr
    lines = [line for line in out.stderr.splitlines() if line.strip()]
    assert lines == [lines[0]] and lines[0].startswith("draftsmith prepare: error: name: YAML read an unquoted")
