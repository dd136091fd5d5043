"""Export of an EAGLE-3 head: weights, engine configs, metadata, atomic writes, target identity."""

import json

import pytest
import torch
from safetensors.torch import load_file

from draftsmith.data_pipeline.vocab import build_vocab_map
from draftsmith.drafters.eagle3.check import load_eagle3
from draftsmith.drafters.eagle3.export import export_eagle3
from draftsmith.drafters.eagle3.head import Eagle3Config, Eagle3Head, HeadKV
from draftsmith.export.metadata import FORMAT_VERSION, read_metadata, update_metadata
from draftsmith.identity import file_sha256, target_identity

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
    out = export_eagle3(
        head, tmp_path / "head", ident, target.config, training={"tokens": 123}, formats=("draftsmith", "speculators")
    )
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
    assert {
        "fc.weight",
        "norm.weight",
        "lm_head.weight",
        "d2t",
        "t2d",
        "midlayer.hidden_norm.weight",
        "midlayer.self_attn.q_proj.weight",
        "midlayer.mlp.down_proj.weight",
    } <= set(sd)
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
    assert sc["proposal_methods"] == [
        {
            "proposal_type": "greedy",
            "speculative_tokens": head.config.ttt_steps,
            "verifier_accept_k": 1,
            "accept_tolerance": 0.0,
        }
    ]
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
    from draftsmith.data_pipeline.vocab import VocabMap

    assert meta.d2t_sha256 == VocabMap(d2t, head.t2d, torch.zeros(V)).sha256()  # one hash definition
    assert meta.target == ident and meta.target["revision"] == "r1"
    assert meta.training == {"tokens": 123} and meta.eval == {}
    assert meta.weights == {
        "model.safetensors": file_sha256(out / "model.safetensors"),
        "speculators/model.safetensors": file_sha256(out / "speculators" / "model.safetensors"),
    }


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
    export_eagle3(head2, out, ident, target.config)  # replaces the previous export
    assert not (out / "speculators").exists()
    assert torch.equal(load_file(out / "model.safetensors")["fc.weight"], head2.fc.weight)
    foreign = tmp_path / "notes"
    foreign.mkdir()
    (foreign / "todo.txt").write_text("mine")
    with pytest.raises(FileExistsError, match="not a draftsmith head"):
        export_eagle3(head2, foreign, ident, target.config)
    assert (foreign / "todo.txt").read_text() == "mine"

    import draftsmith.drafters.eagle3.export as eagle3_export

    def boom(*a, **k):
        raise RuntimeError("disk full")

    monkeypatch.setattr(eagle3_export, "write_metadata", boom)
    with pytest.raises(RuntimeError, match="disk full"):
        export_eagle3(head2, tmp_path / "fresh", ident, target.config)
    assert not (tmp_path / "fresh").exists()
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".")]  # no temp dirs left behind
    with pytest.raises(RuntimeError):
        export_eagle3(make_head(target, seed=6), out, ident, target.config)
    assert torch.equal(load_file(out / "model.safetensors")["fc.weight"], head2.fc.weight)  # old head intact


def test_export_refuses_head_of_another_target(tiny_llama, tmp_path):
    target, other = tiny_llama(seed=1), tiny_llama(hidden_size=48, seed=1)
    with pytest.raises(ValueError, match="hidden_size"):
        export_eagle3(make_head(target), tmp_path / "h", target_identity(other, None, "o"), other.config)
    with pytest.raises(ValueError, match="formats"):
        export_eagle3(
            make_head(target), tmp_path / "h", target_identity(target, None, "t"), target.config, formats=("tensorrt",)
        )


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
    assert (
        from_model["tokenizer_sha256"]
        != target_identity(target, word_tokenizer(rename={50: "zz"}), "t")["tokenizer_sha256"]
    )
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


# --- formats: draftsmith | vllm | sglang | speculators | all ---------------------------------------
def _logits(head, target, seed=3):
    """Head logits on a fixed input: a prefix step and one chain step (bit-comparable)."""
    torch.manual_seed(seed)
    ids = torch.randint(2, V, (1, 9))
    aux = torch.randn(1, 9, 3 * target.config.hidden_size)
    head = head.eval()
    head.bind_embedding(target.get_input_embeddings())
    kv = HeadKV()
    with torch.no_grad():
        hidden, lg = head.step(head.fuse(aux), ids, kv, "prefix")
        _, lg2 = head.step(hidden, ids, kv, "chain")
    return lg, lg2, head.draft_to_target(torch.arange(head.config.draft_vocab_size))


def _head_from(hc: dict, sd: dict):
    head = Eagle3Head(Eagle3Config.from_dict(hc)).to(sd["fc.weight"].dtype)
    head.load_export_state_dict(sd)
    return head


@pytest.fixture
def all_formats(tiny_llama, tmp_path, word_tokenizer):
    target, tok = tiny_llama(seed=1), word_tokenizer()
    head = make_head(target)
    ident = target_identity(target, tok, "tiny/llama", revision="r1")
    out = export_eagle3(head, tmp_path / "all", ident, target.config, formats=("all",), speculative_tokens=4)
    return target, tok, head, out


def test_expand_formats():
    from draftsmith.drafters.eagle3.formats import expand_formats

    assert expand_formats(["all"]) == ("draftsmith", "vllm", "sglang", "speculators")
    assert expand_formats(["speculators"]) == ("draftsmith", "speculators")  # draftsmith always
    assert expand_formats(["sglang", "draftsmith"]) == ("draftsmith", "sglang")
    with pytest.raises(ValueError, match="tensorrt"):
        expand_formats(["tensorrt"])


def test_every_format_reloads_to_bit_identical_logits(all_formats):
    """Each format read back the way its reader reads it -- draftsmith's loader (root and speculators/),
    and vLLM's / SGLang's reading rules on the research config -- gives the trained head's logits, bit for bit."""
    from draftsmith.drafters.eagle3.formats import read_engine_dir

    target, tok, head, out = all_formats
    want = _logits(head, target)
    heads = {
        "draftsmith": load_eagle3(out, target_model=target, tokenizer=tok)[0],
        "draftsmith:speculators/": load_eagle3(out / "speculators", target_model=target, tokenizer=tok)[0],
    }
    for name, path, engine in (
        ("vllm", out, "vllm"),
        ("sglang", out, "sglang"),
        ("speculators", out / "speculators", "speculators"),
    ):
        hc, sd = read_engine_dir(path, engine)
        assert hc["aux_layer_ids"] == list(head.config.aux_layer_ids), name
        heads[name] = _head_from(hc, sd)
    assert read_engine_dir(out / "speculators", "speculators")[0]["ttt_steps"] == 4  # k from proposal_methods
    for name, h in heads.items():
        got = _logits(h, target)
        assert all(torch.equal(a, b) for a, b in zip(want, got)), name


def test_all_formats_layout(all_formats):
    _, _, _, out = all_formats
    assert sorted(p.name for p in out.iterdir()) == [
        "config.json",
        "draftsmith.json",
        "model.safetensors",
        "speculators",
    ]
    assert sorted(p.name for p in (out / "speculators").iterdir()) == ["config.json", "model.safetensors"]
    assert set(read_metadata(out).weights) == {"model.safetensors", "speculators/model.safetensors"}


GOLDEN_RESEARCH_KEYS = {
    "architectures",
    "model_type",
    "num_hidden_layers",
    "hidden_size",
    "intermediate_size",
    "num_attention_heads",
    "num_key_value_heads",
    "head_dim",
    "hidden_act",
    "rms_norm_eps",
    "vocab_size",
    "max_position_embeddings",
    "rope_theta",
    "rope_scaling",
    "rope_parameters",
    "tie_word_embeddings",
    "attention_bias",
    "mlp_bias",
    "torch_dtype",
    "draft_vocab_size",
    "target_hidden_size",
    "norm_before_residual",
    "norm_before_fc",
    "fc_norm",
    "norm_output",
    "eagle_aux_hidden_state_layer_ids",
    "eagle_config",
}
GOLDEN_SPECULATORS_KEYS = {
    "architectures",
    "speculators_model_type",
    "transformer_layer_config",
    "draft_vocab_size",
    "target_hidden_size",
    "norm_before_residual",
    "norm_before_fc",
    "fc_norm",
    "norm_output",
    "embed_requires_grad",
    "eagle_aux_hidden_state_layer_ids",
    "speculators_config",
    "torch_dtype",
}


def test_research_config_golden(all_formats):
    """vLLM (llama_eagle3.py, gpu_model_runner.py) and SGLang (llama_eagle3.py, model_runner.py) keys."""
    _, _, head, out = all_formats
    cfg = json.loads((out / "config.json").read_text())
    assert set(cfg) == GOLDEN_RESEARCH_KEYS
    aux = list(head.config.aux_layer_ids)
    assert cfg["eagle_aux_hidden_state_layer_ids"] == aux  # vLLM: HF index
    assert cfg["eagle_config"] == {
        "eagle_aux_hidden_state_layer_ids": [i - 1 for i in aux],  # SGLang: one lower
        "use_aux_hidden_state": True,
    }
    assert {
        k: cfg[k]
        for k in (
            "norm_before_residual",
            "norm_before_fc",
            "fc_norm",
            "norm_output",
            "tie_word_embeddings",
            "attention_bias",
            "mlp_bias",
        )
    } == dict.fromkeys(
        (
            "norm_before_residual",
            "norm_before_fc",
            "fc_norm",
            "norm_output",
            "tie_word_embeddings",
            "attention_bias",
            "mlp_bias",
        ),
        False,
    )
    assert (cfg["architectures"], cfg["model_type"], cfg["num_hidden_layers"]) == (
        ["LlamaForCausalLMEagle3"],
        "llama",
        1,
    )
    assert (cfg["draft_vocab_size"], cfg["vocab_size"], cfg["target_hidden_size"]) == (48, V, 32)
    assert cfg["rope_parameters"] == {"rope_type": "default", "rope_theta": cfg["rope_theta"]}


def test_speculators_config_golden(all_formats):
    """vLLM configs/speculators/{base,algos}.py keys; every norm flag explicit (algos.py defaults one to true)."""
    _, _, head, out = all_formats
    spec = json.loads((out / "speculators" / "config.json").read_text())
    assert set(spec) == GOLDEN_SPECULATORS_KEYS
    assert set(spec["transformer_layer_config"]) == (
        GOLDEN_RESEARCH_KEYS
        - {
            "draft_vocab_size",
            "target_hidden_size",
            "norm_before_residual",
            "norm_before_fc",
            "fc_norm",
            "norm_output",
            "eagle_aux_hidden_state_layer_ids",
            "eagle_config",
        }
    )
    assert spec["transformer_layer_config"]["architectures"] == ["LlamaForCausalLM"]
    assert set(spec["speculators_config"]) == {"algorithm", "proposal_methods", "default_proposal_method", "verifier"}
    assert spec["speculators_config"]["proposal_methods"][0]["speculative_tokens"] == 4
    assert all(spec[k] is False for k in ("norm_before_residual", "norm_before_fc", "fc_norm", "norm_output"))


def test_engine_reading_rules_catch_one_engine_configs(all_formats):
    """A config written for one engine alone is misread by the other, and engine_problems says so."""
    from draftsmith.drafters.eagle3.formats import engine_problems

    _, _, head, out = all_formats
    hc = head.config.to_dict()
    cfg = json.loads((out / "config.json").read_text())
    assert engine_problems("vllm", cfg, hc) == [] and engine_problems("sglang", cfg, hc) == []
    vllm_only = {k: v for k, v in cfg.items() if k != "eagle_config"}
    fields = [f for f, _ in engine_problems("sglang", vllm_only, hc, target_num_layers=4)]
    assert fields == ["aux_layer_ids"]  # SGLang's default (2, 2, 1) instead of ours
    sglang_only = {k: v for k, v in cfg.items() if k != "eagle_aux_hidden_state_layer_ids"}
    problems = engine_problems("vllm", sglang_only, hc)
    assert [f for f, _ in problems] == ["aux_layer_ids"]  # vLLM takes eagle_config's ids unconverted
    assert "eagle_config.eagle_aux_hidden_state_layer_ids" in problems[0][1]
    assert [f for f, _ in engine_problems("sglang", {**cfg, "bias": True}, hc)] == ["fc_bias", "attention_bias"]
    assert [f for f, _ in engine_problems("sglang", {**cfg, "target_hidden_size": None}, hc)][0] == "target_hidden_size"
    assert "draft_vocab_size" in [f for f, _ in engine_problems("sglang", {**cfg, "draft_vocab_size": None}, hc)]
    assert [f for f, _ in engine_problems("sglang", {**cfg, "tie_word_embeddings": True}, hc)] == [
        "tie_word_embeddings"
    ]
    spec = json.loads((out / "speculators" / "config.json").read_text())
    del spec["norm_before_residual"]
    problems = engine_problems("speculators", spec, hc)
    assert [f for f, _ in problems] == ["norm_before_residual"] and "default to true" in problems[0][1]


def test_sglang_drops_speculators_weight_names(all_formats, tmp_path):
    """SGLang loads midlayer.* only: a research config over layers.0.* weights is refused, not half-loaded."""
    import shutil

    from draftsmith.drafters.eagle3.formats import read_engine_dir
    from draftsmith.export.metadata import HeadMismatchError

    _, _, _, out = all_formats
    mixed = tmp_path / "mixed"
    mixed.mkdir()
    shutil.copy(out / "config.json", mixed / "config.json")
    shutil.copy(out / "speculators" / "model.safetensors", mixed / "model.safetensors")
    with pytest.raises(HeadMismatchError, match="drop") as err:
        read_engine_dir(mixed, "sglang")
    assert err.value.field == "weights"
    read_engine_dir(mixed, "vllm")  # vLLM maps both prefixes


def test_reexport_head_keeps_bytes_metadata_and_verdicts(setup, tmp_path):
    from draftsmith.drafters.eagle3.export import reexport_head
    from draftsmith.export.metadata import update_metadata as update

    target, tok, head, _, out = setup
    update(
        out,
        eval={
            "k": 3,
            "tasks": {"code": {"eagle3": {"tau": 2.5, "acceptance_rate": 0.5, "accepted_per_pos": [0.8, 0.5, 0.2]}}},
        },
        referee={
            "vllm/research/k3": {
                "engine": "vllm",
                "version": "0.32.0",
                "format": "research",
                "k": 3,
                "prompts": 20,
                "match": True,
                "weights": {"model.safetensors": file_sha256(out / "model.safetensors")},
            },
            "vllm/speculators/k3": {
                "engine": "vllm",
                "format": "speculators",
                "k": 3,
                "match": True,
                "weights": {"speculators/model.safetensors": "0" * 64},
            },
        },
    )
    again = reexport_head(out, tmp_path / "again", formats=("all",))
    assert (again / "model.safetensors").read_bytes() == (out / "model.safetensors").read_bytes()
    meta, old = read_metadata(again), read_metadata(out)
    assert meta.target == old.target and meta.training == old.training and meta.eval == old.eval
    assert list(meta.referee) == ["vllm/research/k3"]  # a verdict about other bytes is dropped
    spec = json.loads((again / "speculators" / "config.json").read_text())
    assert spec["speculators_config"]["proposal_methods"][0]["speculative_tokens"] == 3  # eval's k
    card = (again / "README.md").read_text()
    assert "| code | eagle3 | 2.50 | 50.0% | 80% | 50% | 20% |" in card and "0.32.0" in card
    loaded, _ = load_eagle3(again, target_model=target, tokenizer=tok)
    assert all(torch.equal(a, b) for a, b in zip(_logits(head, target), _logits(loaded, target)))
    with pytest.raises(ValueError, match="onto itself"):
        reexport_head(out, out)


def test_cli_export_head_dir_all_formats(setup, tmp_path, capsys):
    from draftsmith.cli import main

    _, _, _, _, out = setup
    assert main(["export", str(out), "--out", str(tmp_path / "cli"), "--format", "sglang", "speculators"]) == 0
    assert (tmp_path / "cli" / "speculators" / "config.json").is_file()
    capsys.readouterr()
    assert main(["export", str(out), "--out", str(tmp_path / "bad"), "--format", "tensorrt"]) == 1
    err = capsys.readouterr().err
    assert "tensorrt" in err and "sglang" in err and not (tmp_path / "bad").exists()


def test_card_verified_section_follows_referee_verdicts(setup):
    from draftsmith.drafters.directory import write_card
    from draftsmith.export.card import refresh_verified_section

    _, _, _, _, out = setup
    write_card(out)
    assert "## Verified with" not in (out / "README.md").read_text()
    update_metadata(
        out,
        referee={
            "vllm/speculators/k5": {
                "engine": "vllm",
                "version": "0.32.0",
                "format": "speculators",
                "k": 5,
                "prompts": 20,
                "match": True,
                "checked_at": "2026-01-01T00:00:00Z",
            }
        },
    )
    refresh_verified_section(out)
    refresh_verified_section(out)  # idempotent: the section is replaced, not appended
    card = (out / "README.md").read_text()
    assert card.count("## Verified with") == 1 and "| vllm | 0.32.0 | speculators | 5 | 20 | yes |" in card
    assert card.startswith("---\nlibrary_name: draftsmith") and "## Serve" in card
