"""`check_head` / `load_eagle3`: every refusal names its field; overrides and warnings are explicit."""

import json
import logging

import pytest
import torch
from safetensors.torch import load_file, save_file

from draftsmith.data_pipeline.vocab import build_vocab_map
from draftsmith.drafters.eagle3.check import check_head, load_eagle3
from draftsmith.drafters.eagle3.export import export_eagle3
from draftsmith.drafters.eagle3.head import Eagle3Config, Eagle3Head
from draftsmith.export.check import HeadMismatchError
from draftsmith.identity import file_sha256, target_identity, tensor_sha256

V = 96


@pytest.fixture
def exported(tiny_llama, tmp_path, word_tokenizer):
    """(target, tokenizer, head_dir) for a head with a reduced vocab (Vd = 48)."""
    target, tok = tiny_llama(seed=1), word_tokenizer()
    torch.manual_seed(0)
    head = Eagle3Head(Eagle3Config.from_target(target.config, draft_vocab_size=48))
    vm = build_vocab_map(torch.randint(0, 100, (V,)), 48)
    head.set_vocab_map(vm.d2t, vm.t2d)
    ident = target_identity(target, tok, "tiny/llama", revision="r1")
    return target, tok, export_eagle3(head, tmp_path / "head", ident, target.config)


def rewrite(head_dir, mutate_weights=None, mutate_meta=None):
    """Edit a head dir as a bad exporter would, keeping the recorded hashes consistent with it."""
    path, meta_path = head_dir / "model.safetensors", head_dir / "draftsmith.json"
    meta = json.loads(meta_path.read_text())
    if mutate_weights:
        sd = load_file(path)
        mutate_weights(sd)
        save_file(sd, str(path), metadata={"format": "pt"})
        meta["weights"]["model.safetensors"] = file_sha256(path)
        meta["d2t_sha256"] = tensor_sha256(sd["d2t"]) if "d2t" in sd else None
    if mutate_meta:
        mutate_meta(meta)
    meta_path.write_text(json.dumps(meta))


def refusal(head_dir, target, tok, field, *words, **kw):
    """Both entry points refuse with ``field`` named in the message (plus ``words``)."""
    for call in (
        lambda: check_head(head_dir, target.config, tok, **kw),
        lambda: load_eagle3(head_dir, target_model=target, tokenizer=tok, **kw),
    ):
        with pytest.raises(HeadMismatchError) as err:
            call()
        assert err.value.field == field and field in str(err.value), str(err.value)
        assert "Fix:" in str(err.value)
        for w in words:
            assert w in str(err.value), (w, str(err.value))
    return str(err.value)


def test_matching_target_passes(exported):
    target, tok, head_dir = exported
    report = check_head(head_dir, target, tok)
    assert report.overridden == [] and report.warnings == []
    assert "OK" in report.summary()
    head, meta = load_eagle3(head_dir, target_model=target, tokenizer=tok)
    assert isinstance(head, Eagle3Head) and meta.target["name_or_path"] == "tiny/llama"


def test_other_hidden_size(exported, tiny_llama):
    _, tok, head_dir = exported
    msg = refusal(head_dir, tiny_llama(hidden_size=48), tok, "hidden_size")
    assert "32" in msg and "48" in msg and "allow_mismatch" in msg


def test_other_vocab(exported, tiny_llama):
    _, tok, head_dir = exported
    msg = refusal(head_dir, tiny_llama(vocab_size=80), tok, "vocab_size")
    assert "96" in msg and "80" in msg


def test_other_layer_count_and_architecture(exported, tiny_llama):
    _, tok, head_dir = exported
    refusal(head_dir, tiny_llama(num_hidden_layers=6), tok, "num_hidden_layers")
    refusal(head_dir, tiny_llama(arch="qwen2"), tok, "model_type", "qwen2")
    msg = refusal(head_dir, tiny_llama(num_attention_heads=8, num_key_value_heads=4), tok, "architecture_sha256")
    assert "num_attention_heads: 4 vs 8" in msg


def test_other_tokenizer_refused_then_overridden(exported, caplog, word_tokenizer):
    target, _, head_dir = exported
    other = word_tokenizer(rename={40: "zz"})
    refusal(head_dir, target, other, "tokenizer_sha256", "tiny/llama")
    with caplog.at_level(logging.WARNING, logger="draftsmith.export.check"):
        report = check_head(head_dir, target, other, allow_mismatch=("tokenizer_sha256",))
    assert report.overridden == ["tokenizer_sha256"]
    assert "overriding tokenizer_sha256" in caplog.text
    load_eagle3(head_dir, target_model=target, tokenizer=other, allow_mismatch=("tokenizer_sha256",))
    with pytest.raises(ValueError, match="unknown field"):
        check_head(head_dir, target, other, allow_mismatch=("weights",))


def test_all_mismatches_listed_together(exported, tiny_llama, word_tokenizer):
    _, _, head_dir = exported
    with pytest.raises(HeadMismatchError) as err:
        check_head(head_dir, tiny_llama(vocab_size=80, hidden_size=48), word_tokenizer(rename={3: "q"}))
    assert all(f in str(err.value) for f in ("hidden_size", "vocab_size", "tokenizer_sha256"))


def test_revision_and_chat_template_only_warn(exported, caplog, word_tokenizer):
    target, _, head_dir = exported
    with caplog.at_level(logging.WARNING, logger="draftsmith.export.check"):
        report = check_head(
            head_dir, target.config, word_tokenizer(template="{{ messages }}"), name_or_path="tiny/llama"
        )
    assert any("chat_template_sha256" in w for w in report.warnings)
    assert "chat_template_sha256" in caplog.text
    target.config._commit_hash = "r2"
    report = check_head(head_dir, target.config, word_tokenizer())
    assert any("revision" in w and "r1" in w and "r2" in w for w in report.warnings)
    report = check_head(head_dir, target.config, None)
    assert any("tokenizer" in w for w in report.warnings)


def test_corrupted_weight_file(exported):
    target, tok, head_dir = exported
    path = head_dir / "model.safetensors"
    data = bytearray(path.read_bytes())
    data[-5] ^= 0x01
    path.write_bytes(bytes(data))
    refusal(head_dir, target, tok, "weights", "model.safetensors", "sha256", "corrupted")


def test_missing_weight_file_and_missing_tensor(exported):
    target, tok, head_dir = exported
    rewrite(head_dir, mutate_weights=lambda sd: sd.pop("norm.weight"))
    refusal(head_dir, target, tok, "weights", "norm.weight")
    (head_dir / "model.safetensors").unlink()
    refusal(head_dir, target, tok, "weights", "missing")


def test_newer_format_version(exported):
    target, tok, head_dir = exported
    rewrite(head_dir, mutate_meta=lambda m: m.update(format_version=2))
    refusal(head_dir, target, tok, "format_version", "upgrade draftsmith")


def test_reduced_vocab_without_d2t(exported):
    target, tok, head_dir = exported
    rewrite(head_dir, mutate_weights=lambda sd: (sd.pop("d2t"), sd.pop("t2d")))
    refusal(head_dir, target, tok, "d2t", "draft_vocab_size 48", "vocab_size 96")


def test_duplicate_and_out_of_range_d2t(exported):
    target, tok, head_dir = exported

    def duplicate(sd):
        d2t = sd["d2t"].clone()
        d2t[1] = d2t[0] - 1  # draft ids 0 and 1 -> the same target id
        sd["d2t"] = d2t

    rewrite(head_dir, mutate_weights=duplicate)
    refusal(head_dir, target, tok, "d2t", "same target id")

    def out_of_range(sd):
        d2t = torch.arange(48) * 0
        d2t[-1] = 500
        sd["d2t"] = d2t

    rewrite(head_dir, mutate_weights=out_of_range)
    refusal(head_dir, target, tok, "d2t", "outside")


def test_aux_layers_out_of_range_or_unknown_convention(exported):
    target, tok, head_dir = exported

    def far(m):
        m["aux_layer_ids"] = m["head_config"]["aux_layer_ids"] = [1, 2, 7]

    rewrite(head_dir, mutate_meta=far)
    refusal(head_dir, target, tok, "aux_layer_ids", "[0, 3]")
    rewrite(head_dir, mutate_meta=lambda m: m.update(aux_layer_convention="sglang"))
    refusal(head_dir, target, tok, "aux_layer_convention", "sglang")


def test_not_a_head_dir(tmp_path, tiny_llama):
    with pytest.raises(FileNotFoundError, match="draftsmith.json"):
        check_head(tmp_path, tiny_llama().config)


def test_integrity_only_without_target(exported):
    _, _, head_dir = exported
    report = check_head(head_dir, None)
    assert any("no target" in w for w in report.warnings) and "intact" in report.summary()
    head, _ = load_eagle3(head_dir)
    assert head.config.draft_vocab_size == 48


# --- engine configs, norm flags, missing weights, tensor parallel, overrides in the eval record -----
def edit_config(head_dir, rel="config.json", **changes):
    """Edit an exported engine config as a careless hand (or another tool) would; None deletes a key."""
    path = head_dir / rel
    cfg = json.loads(path.read_text())
    for key, value in changes.items():
        if value is None:
            cfg.pop(key, None)
        else:
            cfg[key] = value
    path.write_text(json.dumps(cfg))


@pytest.fixture
def exported_all(tiny_llama, tmp_path, word_tokenizer):
    """(target, tokenizer, head_dir) exported in every format (speculators/ included)."""
    target, tok = tiny_llama(seed=1), word_tokenizer()
    torch.manual_seed(0)
    head = Eagle3Head(Eagle3Config.from_target(target.config, draft_vocab_size=48))
    vm = build_vocab_map(torch.randint(0, 100, (V,)), 48)
    head.set_vocab_map(vm.d2t, vm.t2d)
    ident = target_identity(target, tok, "tiny/llama", revision="r1")
    return target, tok, export_eagle3(head, tmp_path / "head", ident, target.config, formats=("all",))


def test_method_in_config_disagrees_with_metadata(exported_all):
    target, tok, head_dir = exported_all
    edit_config(head_dir, architectures=["LlamaForCausalLMEagle"])  # an EAGLE-1 drafter's class
    refusal(head_dir, target, tok, "method", "'eagle'", "'eagle3'", "config.json")
    edit_config(head_dir, architectures=["LlamaForCausalLMEagle3"])
    check_head(head_dir, target, tok)
    edit_config(head_dir, "speculators/config.json", speculators_model_type="eagle")
    refusal(head_dir, target, tok, "method", "speculators/config.json")


def test_unknown_norm_flag(exported_all):
    target, tok, head_dir = exported_all
    edit_config(head_dir, norm_after_fc=True)
    refusal(head_dir, target, tok, "norm_flags", "norm_after_fc=True")
    edit_config(head_dir, norm_after_fc=None)
    rewrite(head_dir, mutate_meta=lambda m: m["head_config"].update(pre_norm_fc=True))
    refusal(head_dir, target, tok, "norm_flags", "pre_norm_fc=True", "upgrade draftsmith")


def test_unsupported_norm_flag(exported_all):
    target, tok, head_dir = exported_all
    edit_config(head_dir, norm_before_residual=True)  # vLLM would serve another layer
    refusal(head_dir, target, tok, "norm_before_residual", "True", "False")
    edit_config(head_dir, norm_before_residual=False, fc_norm=True)
    refusal(head_dir, target, tok, "fc_norm")
    edit_config(head_dir, fc_norm=False)
    edit_config(head_dir, "speculators/config.json", norm_before_residual=None)  # vLLM's default there is true
    refusal(head_dir, target, tok, "norm_before_residual", "default to true")
    edit_config(head_dir, "speculators/config.json", norm_before_residual=False)
    rewrite(head_dir, mutate_meta=lambda m: m["head_config"].update(norm_before_residual=True))
    refusal(head_dir, target, tok, "norm_before_residual", "implements only False")


def test_config_aux_layers_disagree_with_metadata(exported_all):
    target, tok, head_dir = exported_all
    cfg = json.loads((head_dir / "config.json").read_text())
    hf_ids = cfg["eagle_aux_hidden_state_layer_ids"]
    edit_config(head_dir, eagle_config={"eagle_aux_hidden_state_layer_ids": hf_ids, "use_aux_hidden_state": True})
    msg = refusal(head_dir, target, tok, "aux_layer_ids", "SGLang")  # written in the wrong numbering
    assert str(tuple(i + 1 for i in hf_ids)) in msg
    edit_config(head_dir, eagle_config=cfg["eagle_config"], eagle_aux_hidden_state_layer_ids=None)
    msg = refusal(head_dir, target, tok, "aux_layer_ids", "vLLM")  # vLLM falls back unconverted
    assert "eagle_config.eagle_aux_hidden_state_layer_ids" in msg


def test_missing_config_json(exported):
    target, tok, head_dir = exported
    (head_dir / "config.json").unlink()
    refusal(head_dir, target, tok, "config", "vLLM and SGLang")


def test_missing_lm_head(exported):
    target, tok, head_dir = exported
    rewrite(head_dir, mutate_weights=lambda sd: sd.pop("lm_head.weight"))
    refusal(head_dir, target, tok, "weights", "lm_head.weight", "missing")


def test_format_subdir_loads_its_own_weights_checked(exported_all):
    target, tok, head_dir = exported_all
    head, _ = load_eagle3(head_dir / "speculators", target_model=target, tokenizer=tok)
    root, _ = load_eagle3(head_dir, target_model=target, tokenizer=tok)
    assert all(torch.equal(a, b) for a, b in zip(head.export_state_dict().values(), root.export_state_dict().values()))
    path = head_dir / "speculators" / "model.safetensors"
    data = bytearray(path.read_bytes())
    data[-3] ^= 0x01
    path.write_bytes(bytes(data))
    refusal(head_dir / "speculators", target, tok, "weights", "speculators/model.safetensors", "sha256")
    refusal(head_dir, target, tok, "weights", "speculators/model.safetensors")  # the root lists it too


def test_tensor_parallel_layout(exported):
    target, tok, head_dir = exported  # 4 heads, 2 KV heads, intermediate 64 (head and target)
    assert check_head(head_dir, target, tok, tensor_parallel_size=2).tensor_parallel_size == 2
    with pytest.raises(HeadMismatchError) as err:
        check_head(head_dir, target, tok, tensor_parallel_size=3)
    msg = str(err.value)
    assert err.value.field == "tensor_parallel_size" and "Fix:" in msg
    for what in (
        "head: num_attention_heads 4",
        "head: num_key_value_heads 2",
        "head: intermediate_size 64",
        "target: num_attention_heads 4",
    ):
        assert what in msg, (what, msg)


def test_cli_check_refuses_and_names_field(exported, monkeypatch, capsys):
    from huggingface_hub import constants

    import draftsmith.models as models
    from draftsmith.cli import main

    target, tok, head_dir = exported
    monkeypatch.setattr(models, "load_causal_lm", lambda *a, **k: (target, tok))
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", False)  # offline, the CLI refuses a Hub id not in the cache
    assert main(["check", str(head_dir), "--target", "tiny/llama", "--tensor-parallel-size", "2"]) == 0
    assert "shard over 2 ranks" in capsys.readouterr().out
    assert main(["check", str(head_dir), "--target", "tiny/llama", "--tensor-parallel-size", "3"]) == 1
    assert "tensor_parallel_size 3" in capsys.readouterr().err


def test_override_is_logged_and_written_into_the_eval_record(exported, tmp_path, caplog, word_tokenizer):
    """`draftsmith eval --allow-mismatch tokenizer_sha256`: the report's head_check names the field and both hashes."""
    from draftsmith.pipeline.recipe import Recipe
    from draftsmith.pipeline.stages import run_eval

    target, _, head_dir = exported
    other = word_tokenizer(rename={40: "zz"})
    recipe = Recipe(name="ovr", out_dir=tmp_path)
    recipe.target.name_or_path = "tiny/llama"
    recipe.eval.tasks, recipe.drafter.num_speculative_tokens = ["code-complete"], 2
    recipe.eval.prompts_per_task, recipe.eval.max_new_tokens = 1, 4
    with pytest.raises(HeadMismatchError, match="tokenizer_sha256"):
        run_eval(recipe, head_dir, target, other)
    with caplog.at_level(logging.WARNING, logger="draftsmith.export.check"):
        report = run_eval(recipe, head_dir, target, other, allow_mismatch=("tokenizer_sha256",))
    assert "overriding tokenizer_sha256" in caplog.text
    saved = json.loads((tmp_path / "ovr" / "eval" / "report.json").read_text())
    for record in (report["head_check"], saved["head_check"]):
        assert record["allow_mismatch"] == ["tokenizer_sha256"]
        (entry,) = record["overridden"]
        assert entry["field"] == "tokenizer_sha256"
        assert entry["head"] == target_identity(target, word_tokenizer())["tokenizer_sha256"]
        assert entry["target"] == target_identity(target, other)["tokenizer_sha256"]
