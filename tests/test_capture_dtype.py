"""The capture dtype (the dtype of the target states a drafter was trained on) is recorded in draftsmith.json
and compared with the dtype the serving target runs in: a difference warns, naming both, as a different
revision does; a record without it (older exports) is still served, with a note."""

import copy
import json
import logging

import pytest
import torch

from draftsmith.drafters.eagle3.check import check_head
from draftsmith.identity import target_dtype, target_identity


def test_identity_records_the_dtype_the_target_runs_in(tiny_llama):
    target = tiny_llama()
    assert target_identity(target)["dtype"] == "float32"
    assert target_identity(copy.deepcopy(target).to(torch.bfloat16))["dtype"] == "bfloat16"
    assert target_dtype({"torch_dtype": "float16"}) == target_dtype({"dtype": "float16"}) == "float16"
    assert target_dtype({"dtype": "auto"}) is None and target_dtype(target.config) is None  # unknown: in memory


def export_each(kind, target, tok, out, tiny_llama):
    """An untrained drafter of ``kind`` for ``target``, exported with the target's identity."""
    ident = target_identity(target, tok, "tiny")
    if kind == "eagle3":
        from draftsmith.drafters.eagle3.export import export_eagle3
        from draftsmith.drafters.eagle3.head import Eagle3Config, Eagle3Head

        return export_eagle3(Eagle3Head(Eagle3Config.from_target(target.config)), out, ident, target.config)
    if kind == "mlp_speculator":
        from draftsmith.drafters.mlp_speculator.export import export_mlp_speculator
        from draftsmith.drafters.mlp_speculator.head import MLPSpeculator, MLPSpeculatorConfig

        return export_mlp_speculator(
            MLPSpeculator(MLPSpeculatorConfig.from_target(target.config, n_predict=2)), out, ident
        )
    from draftsmith.drafters.draft_model.export import export_draft_model

    return export_draft_model(tiny_llama(seed=8, num_hidden_layers=1), tok, out, ident)


@pytest.mark.parametrize("kind", ["eagle3", "mlp_speculator", "draft_model"])
def test_a_target_in_another_dtype_warns_naming_both(kind, tiny_llama, word_tokenizer, tmp_path, caplog):
    target, tok = tiny_llama(seed=1), word_tokenizer()
    out = export_each(kind, target, tok, tmp_path / kind, tiny_llama)
    assert json.loads((out / "draftsmith.json").read_text())["target"]["dtype"] == "float32"
    assert not [w for w in check_head(out, target, tok).warnings if "dtype" in w]
    served = copy.deepcopy(target).to(torch.bfloat16)
    with caplog.at_level(logging.WARNING, logger="draftsmith.export.check"):
        report = check_head(out, served, tok)  # a warning, never a refusal
    (warning,) = [w for w in report.warnings if "dtype" in w]
    assert "'float32'" in warning and "'bfloat16'" in warning and "capture dtype" in warning, warning
    assert warning in caplog.text and warning in report.summary() and warning in report.record()["warnings"]


def test_an_export_without_a_recorded_dtype_still_checks(tiny_llama, word_tokenizer, tmp_path):
    target, tok = tiny_llama(seed=1), word_tokenizer()
    out = export_each("eagle3", target, tok, tmp_path / "old", tiny_llama)
    meta = json.loads((out / "draftsmith.json").read_text())
    del meta["target"]["dtype"]  # written before the field existed
    (out / "draftsmith.json").write_text(json.dumps(meta))
    report = check_head(out, copy.deepcopy(target).to(torch.bfloat16), tok)
    assert any("records no capture dtype" in w and "'bfloat16'" in w for w in report.warnings), report.warnings


def test_cli_check_loads_the_target_in_the_dtype_asked(tiny_llama, word_tokenizer, tmp_path, monkeypatch, capsys):
    import draftsmith.models as models
    from draftsmith.cli import main

    target, tok = tiny_llama(seed=1), word_tokenizer()
    out = export_each("eagle3", target, tok, tmp_path / "head", tiny_llama)
    asked = []
    target.save_pretrained(tmp_path / "tiny")  # the CLI checks that the target exists before loading
    tok.save_pretrained(tmp_path / "tiny")

    def load(name, revision=None, dtype="float32", role="model"):
        asked.append(dtype)
        return copy.deepcopy(target).to(models.DTYPES[dtype]), tok

    monkeypatch.setattr(models, "load_causal_lm", load)
    tiny = str(tmp_path / "tiny")
    assert main(["check", str(out), "--target", tiny, "--dtype", "bfloat16"]) == 0
    assert asked == ["bfloat16"] and "dtype differs" in capsys.readouterr().out
    assert main(["check", str(out), "--target", tiny]) == 0
    assert asked[-1] == "float32" and "dtype differs" not in capsys.readouterr().out
