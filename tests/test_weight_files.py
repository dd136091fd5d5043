"""Every weight file of an export gets the tensor checks its layout implies, not only its hash.

The files below are written as a converter would write them, their sha256 recorded in draftsmith.json so
the hash check passes: only the tensor checks can refuse them, and the refusal names the file and the
field."""

import json

import pytest
import torch
from safetensors.torch import load_file, save_file

from draftsmith.data_pipeline.vocab import build_vocab_map
from draftsmith.drafters.eagle3.check import check_head, load_eagle3
from draftsmith.drafters.eagle3.export import export_eagle3
from draftsmith.drafters.eagle3.head import Eagle3Config, Eagle3Head
from draftsmith.export.metadata import HeadMismatchError
from draftsmith.identity import file_sha256, target_identity

SPEC = "speculators/model.safetensors"


@pytest.fixture
def exported_all(tiny_llama, word_tokenizer, tmp_path):
    """(target, tokenizer, head_dir): a reduced-vocab head (Vd = 48 of 96) in every format."""
    target, tok = tiny_llama(seed=1), word_tokenizer()
    torch.manual_seed(0)
    head = Eagle3Head(Eagle3Config.from_target(target.config, draft_vocab_size=48))
    vm = build_vocab_map(torch.randint(0, 100, (96,)), 48)
    head.set_vocab_map(vm.d2t, vm.t2d)
    return (
        target,
        tok,
        export_eagle3(head, tmp_path / "head", target_identity(target, tok, "tiny"), target.config, formats=("all",)),
    )


def convert(head_dir, rel, mutate):
    """Rewrite weight file ``rel`` through ``mutate(sd)`` and record its new sha256, as a converter would."""
    path = head_dir / rel
    sd = load_file(path)
    mutate(sd)
    path.parent.mkdir(parents=True, exist_ok=True)
    save_file(sd, str(path), metadata={"format": "pt"})
    meta = json.loads((head_dir / "draftsmith.json").read_text())
    meta["weights"][rel] = file_sha256(path)
    (head_dir / "draftsmith.json").write_text(json.dumps(meta))


def refused_everywhere(head_dir, target, tok, field, *words):
    """check (root and format dir) and both loaders refuse, naming ``field`` and ``words``."""
    calls = (
        lambda: check_head(head_dir, target, tok),
        lambda: check_head(head_dir, None),
        lambda: load_eagle3(head_dir, target_model=target, tokenizer=tok),
        lambda: load_eagle3(head_dir / "speculators", target_model=target, tokenizer=tok),
    )
    for call in calls:
        with pytest.raises(HeadMismatchError) as err:
            call()
        msg = str(err.value)
        assert err.value.field == field and "Fix:" in msg, msg
        for w in words:
            assert w in msg, (w, msg)
    return msg


def test_speculators_file_without_lm_head(exported_all):
    target, tok, head_dir = exported_all
    convert(head_dir, SPEC, lambda sd: sd.pop("lm_head.weight"))
    refused_everywhere(head_dir, target, tok, "weights", SPEC, "lm_head.weight", "missing")


def test_speculators_file_with_an_embedding(exported_all):
    target, tok, head_dir = exported_all
    convert(head_dir, SPEC, lambda sd: sd.update({"embed_tokens.weight": torch.zeros(96, 32)}))
    refused_everywhere(head_dir, target, tok, "weights", SPEC, "embed_tokens.weight", "unexpected")


def test_speculators_file_with_an_index_style_d2t(exported_all):
    """d2t holding the draft vocab's target ids (d2t[i] = target id) instead of offsets (i + d2t[i])."""
    target, tok, head_dir = exported_all

    def index_style(sd):
        sd["d2t"] = torch.arange(48) + sd["d2t"]

    convert(head_dir, SPEC, index_style)
    refused_everywhere(head_dir, target, tok, "d2t", SPEC, "index", "offsets")


def test_speculators_file_named_for_the_research_layout(exported_all):
    target, tok, head_dir = exported_all
    convert(
        head_dir,
        SPEC,
        lambda sd: sd.update(
            {k.replace("layers.0.", "midlayer."): sd.pop(k) for k in [k for k in sd if k.startswith("layers.0.")]}
        ),
    )
    refused_everywhere(head_dir, target, tok, "weights", SPEC, "layers.0.")


def test_speculators_file_holding_another_head(exported_all):
    target, tok, head_dir = exported_all
    convert(head_dir, SPEC, lambda sd: sd.update({"fc.weight": sd["fc.weight"] * 2}))
    refused_everywhere(head_dir, target, tok, "weights", SPEC, "fc.weight", "model.safetensors")


def test_root_file_checked_when_a_format_dir_is_loaded(exported_all):
    target, tok, head_dir = exported_all
    convert(head_dir, "model.safetensors", lambda sd: sd.pop("norm.weight"))
    with pytest.raises(HeadMismatchError) as err:
        load_eagle3(head_dir / "speculators", target_model=target, tokenizer=tok)
    assert err.value.field == "weights" and "norm.weight" in str(err.value)
    assert f"{head_dir / 'model.safetensors'}: weights" in str(err.value)


def test_a_weight_file_the_layout_does_not_have(exported_all):
    target, tok, head_dir = exported_all
    (head_dir / "extra").mkdir()
    save_file({"fc.weight": torch.zeros(2, 2)}, str(head_dir / "extra" / "model.safetensors"))
    meta = json.loads((head_dir / "draftsmith.json").read_text())
    meta["weights"]["extra/model.safetensors"] = file_sha256(head_dir / "extra" / "model.safetensors")
    (head_dir / "draftsmith.json").write_text(json.dumps(meta))
    with pytest.raises(HeadMismatchError) as err:
        check_head(head_dir, target, tok)
    assert err.value.field == "weights" and "extra/model.safetensors" in str(err.value)


# ----------------------------------------------------------------------------------------- MLP speculator
def test_mlp_speculator_checks_every_listed_file(tiny_llama, word_tokenizer, tmp_path):
    from draftsmith.drafters.mlp_speculator.export import check_mlp_speculator, export_mlp_speculator
    from draftsmith.drafters.mlp_speculator.head import MLPSpeculator, MLPSpeculatorConfig

    target, tok = tiny_llama(seed=3), word_tokenizer()
    head = MLPSpeculator(MLPSpeculatorConfig.from_target(target.config, n_predict=2))
    out = export_mlp_speculator(head, tmp_path / "mlp", target_identity(target, tok, "tiny"))
    check_mlp_speculator(out, target, tok)
    meta = json.loads((out / "draftsmith.json").read_text())
    meta["weights"]["stage2.safetensors"] = "0" * 64  # listed, absent: never even looked at today
    (out / "draftsmith.json").write_text(json.dumps(meta))
    with pytest.raises(HeadMismatchError) as err:
        check_mlp_speculator(out, target, tok)
    assert err.value.field == "weights" and "stage2.safetensors" in str(err.value) and "Fix:" in str(err.value)
    del meta["weights"]["stage2.safetensors"]
    (out / "draftsmith.json").write_text(json.dumps(meta))
    convert(out, "model.safetensors", lambda sd: sd.update({"emb.0.bias": torch.zeros(32)}))
    with pytest.raises(HeadMismatchError) as err:
        check_mlp_speculator(out, target, tok)
    assert err.value.field == "weights" and "emb.0.bias" in str(err.value) and "model.safetensors" in str(err.value)


# ----------------------------------------------------------------------------------------- draft model
@pytest.fixture
def draft_dir(tiny_llama, word_tokenizer, tmp_path):
    """(dir, target, tokenizer): a 1-layer draft LM of the tiny target's vocabulary, exported untrained."""
    from draftsmith.drafters.draft_model.export import export_draft_model

    target, tok = tiny_llama(seed=7), word_tokenizer()
    draft = tiny_llama(seed=8, num_hidden_layers=1)
    return export_draft_model(draft, tok, tmp_path / "draft", target_identity(target, tok, "tiny")), target, tok


@pytest.mark.parametrize(
    "mutate, words",
    [
        (lambda sd: sd.pop("model.norm.weight"), ("model.norm.weight", "missing")),
        (lambda sd: sd.update({"model.layers.0.mlp.up_proj.bias": torch.zeros(64)}), ("up_proj.bias", "unexpected")),
        (lambda sd: sd.update({"lm_head.weight": torch.zeros(95, 32)}), ("lm_head.weight", "(95, 32)")),
    ],
)
def test_draft_model_weights_are_checked_against_its_config(draft_dir, mutate, words):
    """transformers would load such a file with a warning (a missing tensor randomly initialised)."""
    from draftsmith.drafters.draft_model.export import check_draft_model, load_draft_model

    out, target, tok = draft_dir
    check_draft_model(out, target, tok)
    convert(out, "model.safetensors", mutate)
    for call in (lambda: check_draft_model(out, target, tok), lambda: load_draft_model(out, target, tok)):
        with pytest.raises(HeadMismatchError) as err:
            call()
        msg = str(err.value)
        assert err.value.field == "weights" and "model.safetensors" in msg and "Fix:" in msg, msg
        for w in words:
            assert w in msg, (w, msg)


def test_sharded_draft_model_checks_every_shard_and_the_index(draft_dir):
    from draftsmith.drafters.draft_model.export import check_draft_model

    out, target, tok = draft_dir
    model = __import__("transformers").AutoModelForCausalLM.from_pretrained(out)
    (out / "model.safetensors").unlink()
    model.save_pretrained(out, max_shard_size="20KB")
    shards = sorted(p.name for p in out.glob("model-*.safetensors"))
    assert len(shards) > 1 and (out / "model.safetensors.index.json").is_file()
    meta = json.loads((out / "draftsmith.json").read_text())
    meta["weights"] = {name: file_sha256(out / name) for name in shards}
    (out / "draftsmith.json").write_text(json.dumps(meta))
    check_draft_model(out, target, tok)
    index = json.loads((out / "model.safetensors.index.json").read_text())
    per_shard = {s: [n for n, f in index["weight_map"].items() if f == s] for s in shards}
    name, where = next((n, f) for n, f in index["weight_map"].items() if len(per_shard[f]) > 1)
    index["weight_map"][name] = next(s for s in shards if s != where)  # the loader would look in another shard
    (out / "model.safetensors.index.json").write_text(json.dumps(index))
    with pytest.raises(HeadMismatchError) as err:
        check_draft_model(out, target, tok)
    assert err.value.field == "weights" and name in str(err.value) and "index" in str(err.value)
    index["weight_map"][name] = where
    (out / "model.safetensors.index.json").write_text(json.dumps(index))
    convert(out, shards[-1], lambda sd: sd.pop(next(iter(sd))))
    with pytest.raises(HeadMismatchError) as err:
        check_draft_model(out, target, tok)
    assert err.value.field == "weights" and shards[-1] in str(err.value)


def test_draft_model_config_must_describe_the_recorded_draft(draft_dir):
    """draftsmith.json records the draft's geometry; a config.json describing another one is refused."""
    from draftsmith.drafters.draft_model.export import check_draft_model

    out, target, tok = draft_dir
    config = json.loads((out / "config.json").read_text())
    (out / "config.json").write_text(json.dumps({**config, "max_position_embeddings": 64}))
    with pytest.raises(HeadMismatchError) as err:
        check_draft_model(out, target, tok)
    assert err.value.field == "head_config" and "max_position_embeddings: draftsmith.json 512, config.json 64" in str(
        err.value
    )


# ----------------------------------------------------------------------------------------- recorded copies
@pytest.mark.parametrize("field, value", [("draft_vocab_size", 50), ("ttt_steps", 3), ("aux_layer_ids", [1, 2, 3])])
def test_eagle3_top_level_copies_must_equal_head_config(exported_all, field, value):
    """draftsmith.json restates draft_vocab_size, ttt_steps and aux_layer_ids beside head_config; the card and
    the runtime read the top level, the loader head_config: two values would be two heads."""
    target, tok, head_dir = exported_all
    meta = json.loads((head_dir / "draftsmith.json").read_text())
    if meta[field] == value:
        value = [0, 1, 2]
    meta[field] = value
    (head_dir / "draftsmith.json").write_text(json.dumps(meta))
    with pytest.raises(HeadMismatchError) as err:
        check_head(head_dir, target, tok)
    assert err.value.field == field and repr(value) in str(err.value) and "Fix:" in str(err.value)


def test_mlp_speculator_recorded_draft_vocab_must_be_its_vocab(tiny_llama, word_tokenizer, tmp_path):
    from draftsmith.drafters.mlp_speculator.export import check_mlp_speculator, export_mlp_speculator
    from draftsmith.drafters.mlp_speculator.head import MLPSpeculator, MLPSpeculatorConfig

    target, tok = tiny_llama(seed=3), word_tokenizer()
    out = export_mlp_speculator(
        MLPSpeculator(MLPSpeculatorConfig.from_target(target.config, n_predict=2)),
        tmp_path / "mlp",
        target_identity(target, tok, "tiny"),
    )
    meta = json.loads((out / "draftsmith.json").read_text())
    meta["draft_vocab_size"] = 64
    (out / "draftsmith.json").write_text(json.dumps(meta))
    with pytest.raises(HeadMismatchError) as err:
        check_mlp_speculator(out, target, tok)
    assert err.value.field == "draft_vocab_size" and "64" in str(err.value) and "96" in str(err.value)
