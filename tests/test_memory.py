"""The memory plan on tiny configs: exact counts, advice that works, and a refusal before anything is loaded."""

from __future__ import annotations

import sys

import pytest
import torch

from draftsmith.serve import memory
from draftsmith.serve.memory import MemoryPlanError, kv_bytes_per_token, plan_memory

MIB = 2**20


def _tokenizer():
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    names = [f"w{i}" for i in range(93)] + ["<unk>", "<eos>", "<pad>"]
    backend = Tokenizer(models.WordLevel({t: i for i, t in enumerate(names)}, unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok = PreTrainedTokenizerFast(tokenizer_object=backend, eos_token="<eos>", unk_token="<unk>", pad_token="<pad>")
    tok.chat_template = "{% for m in messages %}{{ m.content }} {% endfor %}"
    return tok


@pytest.fixture(scope="module")
def folders(tiny_llama, tmp_path_factory):
    """Saved tiny target, tiny draft (same tokenizer) and an exported EAGLE-3 head."""
    from draftsmith.drafters.eagle3.export import export_eagle3
    from draftsmith.drafters.eagle3.head import Eagle3Config, Eagle3Head
    from draftsmith.identity import target_identity

    root = tmp_path_factory.mktemp("memory")
    target = tiny_llama(seed=0)
    tokenizer = _tokenizer()
    target.save_pretrained(root / "target")
    tokenizer.save_pretrained(root / "target")
    tiny_llama(seed=1, num_hidden_layers=1).save_pretrained(root / "draft")
    tokenizer.save_pretrained(root / "draft")
    head = Eagle3Head(Eagle3Config.from_target(target.config))
    export_eagle3(head, root / "head", target_identity(target, tokenizer, "tiny"), target.config)
    return {"root": root, "target": target, "head": head}


def test_weights_and_kv_are_counted_exactly(folders):
    target = folders["target"]
    c = target.config
    plan = plan_memory(c, dtype="float32", max_model_len=100, free_bytes=2**40)
    assert plan.items["target weights"] == sum(p.numel() for p in target.parameters()) * 4
    assert kv_bytes_per_token(c, "float32") == 2 * 4 * 2 * (32 // 4) * 4  # K,V x layers x kv heads x hd x b
    assert plan.items["target KV cache"] == 100 * kv_bytes_per_token(c, "float32")
    bf16 = plan_memory(c, dtype="bfloat16", max_model_len=100, free_bytes=2**40)
    assert bf16.items["target weights"] * 2 == plan.items["target weights"]
    assert plan.fits and plan.advice == [] and plan.max_model_len == 100
    assert plan_memory(c, free_bytes=2**40).max_model_len == c.max_position_embeddings
    # the KV cache of a real run after 100 tokens takes what the plan says per token
    from draftsmith.core.target import TargetModel

    wrapped = TargetModel(target)
    cache = wrapped.new_cache()
    wrapped.forward(torch.arange(100) % 90, cache)
    real = sum(t.numel() * t.element_size() for layer in cache.hf.layers for t in (layer.keys, layer.values))
    assert real == plan.items["target KV cache"]


def _items(method: str, model=None, dtype: str = "float32", c=None):
    """The memory items of a drafter, as ``serve.memory.plan_for_engine`` gets them from the registry."""
    from draftsmith import drafters
    from draftsmith.drafters.speculative import SpeculativeConfig

    spec = SpeculativeConfig.from_dict(
        {"method": method, "num_speculative_tokens": 3, **({"model": str(model)} if model is not None else {})}
    )
    return drafters.get(method).memory(spec, c, dtype)


def test_drafters_are_counted(folders):
    from draftsmith.drafters.speculative import SpeculativeConfig

    root, c = folders["root"], folders["target"].config
    draft = plan_memory(c, max_model_len=64, drafter=_items("draft_model", root / "draft", c=c), free_bytes=2**40)
    assert draft.items["draft model KV cache"] == 64 * 2 * 1 * 2 * 8 * 4  # one layer
    assert draft.items["draft model weights"] > 0
    eagle = plan_memory(c, max_model_len=64, drafter=_items("eagle3", root / "head", c=c), free_bytes=2**40)
    head_params = sum(p.numel() for p in folders["head"].parameters())
    assert eagle.items["EAGLE-3 head weights"] >= head_params * 4 * 0.9  # the exported tensors
    assert eagle.items["EAGLE-3 head KV cache"] == 64 * 2 * 2 * 8 * 4
    ngram = plan_memory(c, max_model_len=64, drafter=_items("ngram", c=c), free_bytes=2**40)
    assert set(ngram.items) == {"target weights", "target KV cache", "prefill activations", "margin (10%)"}
    with pytest.raises(ValueError, match="model"):
        SpeculativeConfig.from_dict({"method": "draft_model", "num_speculative_tokens": 3})


def test_small_free_memory_stops_with_advice_that_works(folders):
    root, c = folders["root"], folders["target"].config
    same = _items("draft_model", root / "target", c=c)  # a draft as large as the target
    full = plan_memory(c, max_model_len=512, drafter=same, free_bytes=2**40)
    weights = full.items["target weights"] + full.items["draft model weights"]
    free = weights * 1.1 + (full.total_bytes - weights * 1.1) // 4  # room for about a quarter of the length
    plan = plan_memory(c, max_model_len=512, drafter=same, free_bytes=int(free))
    assert not plan.fits
    with pytest.raises(MemoryPlanError) as e:
        plan.check()
    message = str(e.value)
    assert "does NOT fit" in message and "free" in message and "draft model KV cache" in message
    assert "--max-model-len" in message and "bfloat16" in message and "smaller draft model" in message
    suggested = int(message.split("--max-model-len ")[1].split()[0])
    assert 16 <= suggested < 512
    assert plan_memory(c, max_model_len=suggested, drafter=same, free_bytes=int(free)).fits
    tiny = plan_memory(c, max_model_len=512, free_bytes=MIB // 8)  # not even the weights
    assert "a shorter max length will not do" in "\n".join(tiny.advice)


def test_engine_refuses_before_loading(folders, monkeypatch):
    from draftsmith import models
    from draftsmith.serve.engine import Engine

    root = folders["root"]

    def must_not_load(*args, **kwargs):
        raise AssertionError("weights were loaded before the memory plan refused")

    monkeypatch.setattr(memory, "free_memory_bytes", lambda device: 64 * 1024)  # a fake, tiny free memory
    monkeypatch.setattr(models, "load_causal_lm", must_not_load)
    for spec in (
        None,
        {"method": "draft_model", "model": str(root / "draft"), "num_speculative_tokens": 3},
        {"method": "eagle3", "model": str(root / "head"), "num_speculative_tokens": 3},
    ):
        with pytest.raises(MemoryPlanError, match="does NOT fit"):
            Engine.from_pretrained(str(root / "target"), spec, device="cpu")
    monkeypatch.undo()
    engine = Engine.from_pretrained(str(root / "target"), device="cpu", max_model_len=64)  # real free memory
    assert engine.max_model_len == 64
    from draftsmith.core.generate import GenerationConfig
    from draftsmith.serve.engine import RequestError

    with pytest.raises(RequestError, match="maximum context length is 64"):
        engine.generate([5] * 60, GenerationConfig(max_new_tokens=8))
    with pytest.raises(ValueError, match="max_model_len"):
        Engine(folders["target"], _tokenizer(), max_model_len=10_000)


def test_cli_prints_the_advice(folders, monkeypatch, capsys):
    from draftsmith.cli import main

    monkeypatch.setattr(memory, "free_memory_bytes", lambda device: 64 * 1024)
    assert main(["generate", "--target", str(folders["root"] / "target"), "--prompt", "w1 w2"]) == 1
    err = capsys.readouterr().err
    assert "memory plan" in err and "does NOT fit" in err and "close other programs" in err


def test_free_memory_bytes_on_cpu(monkeypatch):
    assert memory.free_memory_bytes("cpu") > 0
    monkeypatch.setitem(sys.modules, "psutil", None)  # no psutil: /proc/meminfo
    assert memory.free_memory_bytes("cpu") > 0
