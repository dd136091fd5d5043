"""``draftsmith serve --engine vllm | sglang``: the head is checked as draftsmith's runtime checks it before any
engine starts; vLLM gets the speculative config in its keys, SGLang's command is built from the head's k or tree.
The run against a real vLLM server is opt-in (``tests/test_vllm_referee.py::test_certify_a_real_vllm_server``)."""

from __future__ import annotations

import pytest

from draftsmith import drafters, reference
from draftsmith.cli import main
from draftsmith.drafters.speculative import SpeculativeConfig
from draftsmith.evaluation import vllm_venv
from draftsmith.pipeline.engines import sglang_command, vllm_speculative_config


def test_vllm_gets_vllms_keys_and_no_tree():
    spec = SpeculativeConfig("ngram", None, 4, {"prompt_lookup_max": 3})
    assert vllm_speculative_config(spec) == spec.to_dict()  # draftsmith's keys are vLLM's
    assert vllm_speculative_config(spec)["prompt_lookup_max"] == 3
    tree = SpeculativeConfig("eagle3", "runs/HEAD", None, {}, "topk=2,num_steps=3,num_draft_tokens=6")
    with pytest.raises(ValueError, match="chains only"):
        vllm_speculative_config(tree)
    auto = SpeculativeConfig("ngram", None, "auto")
    for engine in (vllm_speculative_config, lambda s: sglang_command("t", s)):
        with pytest.raises(ValueError, match="takes an integer k"):
            engine(auto)


def test_sglang_command_for_chains_trees_and_what_it_does_not_serve():
    chain = sglang_command("meta-llama/Llama-3.1-8B-Instruct", SpeculativeConfig("eagle3", "HEAD", 5), port=30001)
    assert chain[:5] == ["python", "-m", "sglang.launch_server", "--model-path", "meta-llama/Llama-3.1-8B-Instruct"]
    text = " ".join(chain)
    assert "--speculative-algorithm EAGLE3 --speculative-draft-model-path HEAD" in text
    assert "--speculative-num-steps 5 --speculative-eagle-topk 1 --speculative-num-draft-tokens 6" in text
    assert "--port 30001" in text and "--host 127.0.0.1" in text
    tree = SpeculativeConfig("eagle3", "HEAD", None, {}, "topk=4,num_steps=5,num_draft_tokens=32")
    assert " ".join(sglang_command("T", tree)).endswith(
        "--speculative-algorithm EAGLE3 --speculative-draft-model-path HEAD --speculative-num-steps 5 "
        "--speculative-eagle-topk 4 --speculative-num-draft-tokens 32"
    )
    with pytest.raises(ValueError, match="does not serve method 'mlp_speculator'"):
        sglang_command("T", SpeculativeConfig("mlp_speculator", "HEAD", 3))
    static = SpeculativeConfig.from_dict({"method": "eagle3", "model": "H", "speculative_token_tree": "[(0,), (1,)]"})
    with pytest.raises(ValueError, match="dynamic trees only"):
        sglang_command("T", static)
    assert sglang_command("T", None)[-4:] == ["--host", "127.0.0.1", "--port", "30000"]


@pytest.fixture(scope="module")
def heads(tmp_path_factory):
    """An EAGLE-3 head for the reference target and one recorded for a tiny random target."""
    from conftest import make_tiny_llama, make_word_tokenizer

    model, tok = reference.target()
    good = drafters.get("eagle3").example(model, tok, tmp_path_factory.mktemp("good")).model
    tiny = make_tiny_llama(seed=1, num_hidden_layers=8)
    other = drafters.get("eagle3").example(tiny, make_word_tokenizer(96), tmp_path_factory.mktemp("other")).model
    return good, other


def test_serve_engine_sglang_checks_the_head_then_prints_the_command(heads, capsys):
    good, other = heads
    spec = f'{{"method": "eagle3", "model": "{good}", "num_speculative_tokens": 3}}'
    assert main(["serve", "--engine", "sglang", "--target", "reference", "--speculative-config", spec]) == 0
    out = capsys.readouterr().out
    assert out.startswith("python -m sglang.launch_server --model-path reference") and good in out
    wrong = f'{{"method": "eagle3", "model": "{other}", "num_speculative_tokens": 3}}'
    assert main(["serve", "--engine", "sglang", "--target", "reference", "--speculative-config", wrong]) == 1
    assert "sglang.launch_server" not in capsys.readouterr().out  # refused: no command printed


def test_serve_engine_vllm_refuses_a_mismatched_head_before_vllm_starts(heads, tmp_path, monkeypatch, capsys):
    _, other = heads
    fake = tmp_path / "venv"
    (fake / "bin").mkdir(parents=True)
    marker = tmp_path / "vllm-started"
    (fake / "bin" / "python").write_text(f"#!/bin/sh\ntouch {marker}\n")
    (fake / "bin" / "python").chmod(0o755)
    monkeypatch.setattr(vllm_venv, "VLLM_VENV", fake)
    wrong = f'{{"method": "eagle3", "model": "{other}", "num_speculative_tokens": 3}}'
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = str(s.getsockname()[1])
    code = main(["serve", "--engine", "vllm", "--target", "reference", "--speculative-config", wrong, "--port", port])
    err = capsys.readouterr().err
    assert code == 1 and "draftsmith serve: error:" in err and not marker.exists(), err


def test_serve_engine_vllm_without_the_venv_says_how_to_make_it(tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(vllm_venv, "VLLM_VENV", tmp_path / "none")
    assert main(["serve", "--engine", "vllm", "--target", "reference"]) == 1
    assert "vllm_referee.py --setup" in capsys.readouterr().err


def test_flags_after_the_double_dash_need_another_engine(capsys):
    assert main(["serve", "--target", "reference", "--", "--gpu-memory-utilization", "0.9"]) in (1, 2)
    assert "--engine vllm or sglang" in capsys.readouterr().err
