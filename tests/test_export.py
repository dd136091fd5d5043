"""Export of an EAGLE-3 head: weights, engine configs, metadata, atomic writes, target identity."""
import json

import pytest
import torch
from safetensors.torch import load_file

from draftsmith.export.check import load_eagle3
from draftsmith.export.identity import file_sha256, target_identity
from draftsmith.export.metadata import FORMAT_VERSION, read_metadata, update_metadata
from draftsmith.export.writer import export_eagle3
from draftsmith.heads.eagle3 import Eagle3Config, Eagle3Head, HeadKV
from draftsmith.heads.vocab import build_vocab_map

V = 96


TEMPLATE = "{% for m in messages %}<{{ m.role }}>{{ m.content }}{% endfor %}"


def make_head(target, draft_vocab_size=48, seed=0):
    """A head for ``target`` with random weights (norms too) and, when Vd < V, a vocab map."""
    cfg = Eagle3Config.from_target(target.config, draft_vocab_size=draft_vocab_size)
    torch.manual_seed(seed)
    head = Eagle3Head(cfg)
    with torch.no_grad():
        for p in head.parameters():
            p.normal_(0, 0.2)
    if draft_vocab_size < cfg.vocab_size:
        vm = build_vocab_map(torch.randint(0, 100, (cfg.vocab_size,)), draft_vocab_size, always_include=[1])
        head.set_vocab_map(vm.d2t, vm.t2d)
    return head


@pytest.fixture
def setup(tiny_llama, tmp_path, word_tokenizer):
    target = tiny_llama(seed=1)
    tok = word_tokenizer()
    head = make_head(target)
    ident = target_identity(target, tok, "tiny/llama", revision="r1")
    out = export_eagle3(head, tmp_path / "head", ident, target.config, training={"tokens": 123},
                        formats=("draftsmith", "speculators"))
    return target, tok, head, ident, out


def _keys(obj):
    """Every key of a nested JSON object."""
    if isinstance(obj, dict):
        for k, v in obj.items():
            yield k
            yield from _keys(v)
    elif isinstance(obj, list):
        for v in obj:
            yield from _keys(v)


def test_reload_is_bit_identical(setup):
    target, tok, head, _, out = setup
    loaded, meta = load_eagle3(out, target_model=target, tokenizer=tok)
    want, got = head.export_state_dict(), loaded.export_state_dict()
    assert set(want) == set(got)
    for name in want:
        assert want[name].dtype == got[name].dtype and torch.equal(want[name], got[name]), name
    assert meta.head_config == head.config.to_dict()
    # same logits, bit for bit, on the same input
    torch.manual_seed(3)
    ids = torch.randint(2, V, (1, 9))
    aux = torch.randn(1, 9, 3 * target.config.hidden_size)
    logits = []
    for h in (head.eval(), loaded):
        h.bind_embedding(target.get_input_embeddings())
        kv = HeadKV()
        with torch.no_grad():
            hidden, lg = h.step(h.fuse(aux), ids, kv, "prefix")
            _, lg2 = h.step(hidden, ids, kv, "chain")
        logits.append((lg, lg2))
    assert torch.equal(logits[0][0], logits[1][0]) and torch.equal(logits[0][1], logits[1][1])
    assert torch.equal(head.draft_to_target(torch.arange(48)), loaded.draft_to_target(torch.arange(48)))


def test_weight_names(setup):
    _, _, head, _, out = setup
    sd = load_file(out / "model.safetensors")
    assert set(sd) == set(head.export_state_dict())
    assert {"fc.weight", "norm.weight", "lm_head.weight", "d2t", "t2d", "midlayer.hidden_norm.weight",
            "midlayer.self_attn.q_proj.weight", "midlayer.mlp.down_proj.weight"} <= set(sd)
    assert not [k for k in sd if k.startswith("model.") or k.endswith(".bias") or "embed" in k]
    assert sd["d2t"].dtype == torch.int64 and sd["t2d"].dtype == torch.bool
    assert sd["midlayer.self_attn.q_proj.weight"].shape[1] == 2 * 32 and sd["fc.weight"].shape == (32, 96)


def test_engine_config(setup):
    target, _, head, _, out = setup
    cfg = json.loads((out / "config.json").read_text())
    assert cfg["architectures"] == ["LlamaForCausalLMEagle3"] and cfg["model_type"] == "llama"
    assert cfg["num_hidden_layers"] == 1 and cfg["tie_word_embeddings"] is False
    assert cfg["vocab_size"] == V and cfg["draft_vocab_size"] == 48
    assert cfg["hidden_size"] == 32 and cfg["target_hidden_size"] == 32
    assert cfg["num_attention_heads"] == 4 and cfg["num_key_value_heads"] == 2 and cfg["head_dim"] == 8
    assert cfg["intermediate_size"] == 64 and cfg["rms_norm_eps"] == target.config.rms_norm_eps
    assert cfg["max_position_embeddings"] >= target.config.max_position_embeddings
    assert cfg["rope_theta"] == target.config.rope_parameters["rope_theta"] and cfg["rope_scaling"] is None
    assert cfg["norm_before_residual"] is False
    assert "bias" not in set(_keys(cfg))
    assert None not in (cfg.get("target_hidden_size"), cfg.get("draft_vocab_size"))
    vllm_ids = cfg["eagle_aux_hidden_state_layer_ids"]
    assert vllm_ids == list(head.config.aux_layer_ids)
    assert cfg["eagle_config"]["eagle_aux_hidden_state_layer_ids"] == [i - 1 for i in vllm_ids]
    # transformers (5.x) reads it back as a Llama config with the same geometry and RoPE
    from transformers import AutoConfig

    back = AutoConfig.from_pretrained(out)
    assert back.hidden_size == 32 and back.num_hidden_layers == 1
    assert back.rope_parameters["rope_theta"] == target.config.rope_parameters["rope_theta"]


def test_speculators_format(setup):
    target, _, head, ident, out = setup
    spec = json.loads((out / "speculators" / "config.json").read_text())
    assert spec["speculators_model_type"] == "eagle3" and spec["architectures"] == ["Eagle3Speculator"]
    sc = spec["speculators_config"]
    assert sc["algorithm"] == "eagle3" and sc["default_proposal_method"] == "greedy"
    assert sc["proposal_methods"] == [{"proposal_type": "greedy", "speculative_tokens": head.config.ttt_steps,
                                       "verifier_accept_k": 1, "accept_tolerance": 0.0}]
    assert sc["verifier"] == {"name_or_path": "tiny/llama", "architectures": ident["architectures"]}
    assert spec["norm_before_residual"] is False and spec["norm_before_fc"] is False
    assert spec["draft_vocab_size"] == 48 and spec["target_hidden_size"] == 32
    assert spec["eagle_aux_hidden_state_layer_ids"] == list(head.config.aux_layer_ids)
    layer = spec["transformer_layer_config"]
    assert layer["vocab_size"] == V and layer["num_hidden_layers"] == 1 and layer["hidden_size"] == 32
    assert "bias" not in set(_keys(spec))
    plain, renamed = load_file(out / "model.safetensors"), load_file(out / "speculators" / "model.safetensors")
    assert set(renamed) == {k.replace("midlayer.", "layers.0.") for k in plain}
    assert torch.equal(renamed["layers.0.self_attn.k_proj.weight"], plain["midlayer.self_attn.k_proj.weight"])


def test_metadata(setup):
    target, tok, head, ident, out = setup
    import draftsmith

    meta = read_metadata(out)
    raw = json.loads((out / "draftsmith.json").read_text())
    assert raw["format_version"] == FORMAT_VERSION == 1 and list(raw)[0] == "format_version"
    assert meta.toolkit["name"] == "draftsmith" and meta.toolkit["version"] == draftsmith.__version__
    assert "git_sha" in meta.toolkit
    assert meta.head_type == "eagle3" and meta.head_config == head.config.to_dict()
    assert meta.ttt_steps == head.config.ttt_steps
    assert meta.aux_layer_ids == list(head.config.aux_layer_ids)
    assert meta.aux_layer_convention == "hf_hidden_states_index"
    assert meta.draft_vocab_size == 48
    d2t = head.export_state_dict()["d2t"]
    from draftsmith.heads.vocab import VocabMap

    assert meta.d2t_sha256 == VocabMap(d2t, head.t2d, torch.zeros(V)).sha256()  # one hash definition
    assert meta.target == ident and meta.target["revision"] == "r1"
    assert meta.training == {"tokens": 123} and meta.eval == {}
    assert meta.weights == {"model.safetensors": file_sha256(out / "model.safetensors"),
                            "speculators/model.safetensors": file_sha256(out / "speculators" / "model.safetensors")}


def test_update_metadata_merges_eval(setup):
    target, tok, _, _, out = setup
    update_metadata(out, eval={"code": {"tau": 2.5}})
    update_metadata(out, eval={"prose": {"tau": 1.9}})
    meta = read_metadata(out)
    assert meta.eval == {"code": {"tau": 2.5}, "prose": {"tau": 1.9}}
    load_eagle3(out, target_model=target, tokenizer=tok)  # still loads: weights untouched


def test_full_vocab_ships_no_vocab_map(tiny_llama, tmp_path):
    target = tiny_llama(seed=1)
    head = make_head(target, draft_vocab_size=V)
    out = export_eagle3(head, tmp_path / "h", target_identity(target, None, "t"), target.config)
    sd = load_file(out / "model.safetensors")
    assert "d2t" not in sd and "t2d" not in sd
    assert read_metadata(out).d2t_sha256 is None
    assert not (out / "speculators").exists()
    assert json.loads((out / "config.json").read_text())["draft_vocab_size"] == V
    loaded, _ = load_eagle3(out, target_model=target)
    assert torch.equal(loaded.lm_head.weight, head.lm_head.weight)


def test_export_replaces_a_head_and_is_atomic(setup, tmp_path, monkeypatch):
    target, tok, _, ident, out = setup
    head2 = make_head(target, seed=5)
    export_eagle3(head2, out, ident, target.config)                       # replaces the previous export
    assert not (out / "speculators").exists()
    assert torch.equal(load_file(out / "model.safetensors")["fc.weight"], head2.fc.weight)
    foreign = tmp_path / "notes"
    foreign.mkdir()
    (foreign / "todo.txt").write_text("mine")
    with pytest.raises(FileExistsError, match="not a draftsmith head"):
        export_eagle3(head2, foreign, ident, target.config)
    assert (foreign / "todo.txt").read_text() == "mine"

    import draftsmith.export.writer as writer

    def boom(*a, **k):
        raise RuntimeError("disk full")
    monkeypatch.setattr(writer, "write_metadata", boom)
    with pytest.raises(RuntimeError, match="disk full"):
        export_eagle3(head2, tmp_path / "fresh", ident, target.config)
    assert not (tmp_path / "fresh").exists()
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".")]   # no temp dirs left behind
    with pytest.raises(RuntimeError):
        export_eagle3(make_head(target, seed=6), out, ident, target.config)
    assert torch.equal(load_file(out / "model.safetensors")["fc.weight"], head2.fc.weight)  # old head intact


def test_export_refuses_head_of_another_target(tiny_llama, tmp_path):
    target, other = tiny_llama(seed=1), tiny_llama(hidden_size=48, seed=1)
    with pytest.raises(ValueError, match="hidden_size"):
        export_eagle3(make_head(target), tmp_path / "h", target_identity(other, None, "o"), other.config)
    with pytest.raises(ValueError, match="formats"):
        export_eagle3(make_head(target), tmp_path / "h", target_identity(target, None, "t"), target.config,
                      formats=("vllm",))


def test_target_identity(tiny_llama, tmp_path, word_tokenizer):
    target = tiny_llama(seed=1)
    tok = word_tokenizer()
    from_model = target_identity(target, tok, "t")
    target.config.save_pretrained(tmp_path)
    from_json = target_identity(json.loads((tmp_path / "config.json").read_text()), tok, "t")
    assert from_model["architecture_sha256"] == target_identity(target.config, tok, "t")["architecture_sha256"]
    assert from_model["architecture_sha256"] == from_json["architecture_sha256"]
    assert from_model["architectures"] == ["LlamaForCausalLM"]
    assert (from_model["hidden_size"], from_model["num_hidden_layers"], from_model["vocab_size"]) == (32, 4, V)
    assert from_model["tokenizer_sha256"] == target_identity(target, word_tokenizer(), "t")["tokenizer_sha256"]
    assert from_model["tokenizer_sha256"] != target_identity(target, word_tokenizer(rename={50: "zz"}), "t")[
        "tokenizer_sha256"]
    assert target_identity(target, word_tokenizer(template=None), "t")["chat_template_sha256"] is None
    other_heads = tiny_llama(seed=1, num_attention_heads=8, num_key_value_heads=4)
    assert target_identity(other_heads, tok, "t")["architecture_sha256"] != from_model["architecture_sha256"]


def test_bfloat16_round_trip(tiny_llama, tmp_path):
    target = tiny_llama(seed=1)
    head = make_head(target).to(torch.bfloat16)
    out = export_eagle3(head, tmp_path / "h", target_identity(target, None, "t"), target.config)
    assert json.loads((out / "config.json").read_text())["torch_dtype"] == "bfloat16"
    loaded, _ = load_eagle3(out, target_model=target)
    assert loaded.fc.weight.dtype == torch.bfloat16 and loaded.d2t.dtype == torch.int64
    for name, t in head.export_state_dict().items():
        assert torch.equal(t, loaded.export_state_dict()[name]), name
