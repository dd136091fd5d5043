"""`check_head` / `load_eagle3`: every refusal names its field; overrides and warnings are explicit."""
import json
import logging

import pytest
import torch
from safetensors.torch import load_file, save_file

from draftsmith.export.check import HeadMismatchError, check_head, load_eagle3
from draftsmith.export.identity import file_sha256, target_identity, tensor_sha256
from draftsmith.export.writer import export_eagle3
from draftsmith.heads.eagle3 import Eagle3Config, Eagle3Head
from draftsmith.heads.vocab import build_vocab_map

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
    for call in (lambda: check_head(head_dir, target.config, tok, **kw),
                 lambda: load_eagle3(head_dir, target_model=target, tokenizer=tok, **kw)):
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
        report = check_head(head_dir, target.config, word_tokenizer(template="{{ messages }}"),
                            name_or_path="tiny/llama")
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
        d2t[1] = d2t[0] - 1                    # draft ids 0 and 1 -> the same target id
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
