"""Position limits are checked up front, never found as an IndexError mid-request (issue 13, fault 4).

A draft model with a learned position table (GPT-2 ``n_positions``, OPT ``max_position_embeddings``) shorter than
max_model_len is refused when the engine starts, naming both lengths and ``--max-model-len``; a RoPE draft declaring
fewer positions is served with a warning. The same kind elsewhere: the draft-model proposer drafts only what fits
its table; the decoding loops and eval refuse a prompt + max_new_tokens past the target's limit before any forward.
"""

from __future__ import annotations

import logging

import pytest
import torch

from draftsmith.core.generate import GenerationConfig, generate_plain, generate_speculative
from draftsmith.core.target import TargetModel, has_learned_positions, position_limit
from draftsmith.drafters.draft_model.proposer import DraftModelProposer
from draftsmith.serve.engine import Engine

V = 96
SHORT = 64  # the drafts' positions; the tiny target has 512


def gpt2(n_positions: int = SHORT, seed: int = 1):
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(seed)
    config = GPT2Config(
        vocab_size=V, n_positions=n_positions, n_embd=32, n_layer=1, n_head=2, bos_token_id=1, eos_token_id=1
    )
    return GPT2LMHeadModel(config).eval()


def opt(max_position_embeddings: int = SHORT):
    from transformers import OPTConfig, OPTForCausalLM

    torch.manual_seed(2)
    config = OPTConfig(
        vocab_size=V,
        max_position_embeddings=max_position_embeddings,
        hidden_size=32,
        ffn_dim=64,
        word_embed_proj_dim=32,
        num_hidden_layers=1,
        num_attention_heads=2,
        bos_token_id=1,
        eos_token_id=1,
        pad_token_id=0,
    )
    return OPTForCausalLM(config).eval()


@pytest.fixture(scope="module")
def target(tiny_llama):
    return tiny_llama(seed=0, vocab_size=V)


@pytest.fixture(scope="module")
def tokenizer(word_tokenizer):
    return word_tokenizer(V)


def saved(model, tokenizer, path):
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    return str(path)


def long_prompt(n: int = SHORT + 26) -> list[int]:
    return [3 + (i * 7) % 50 for i in range(n)]


def test_limits_are_read_as_each_config_spells_them(tiny_llama):
    assert position_limit(gpt2().config) == ("n_positions", SHORT)
    assert position_limit(opt().config) == ("max_position_embeddings", SHORT)
    assert position_limit(tiny_llama().config) == ("max_position_embeddings", 512)
    assert has_learned_positions(gpt2()) and has_learned_positions(opt())
    assert not has_learned_positions(tiny_llama())  # RoPE: no table to run past


@pytest.mark.parametrize("make, key", [(gpt2, "n_positions"), (opt, "max_position_embeddings")])
def test_engine_refuses_a_draft_with_learned_positions_shorter_than_max_model_len(
    target, tokenizer, tmp_path, make, key
):
    spec = {"method": "draft_model", "model": saved(make(), tokenizer, tmp_path / "draft"), "num_speculative_tokens": 3}
    with pytest.raises(ValueError) as e:
        Engine(target, tokenizer, spec)
    message = str(e.value)
    assert f"{key}={SHORT}" in message and "max_model_len=512" in message and f"--max-model-len {SHORT}" in message
    engine = Engine(target, tokenizer, spec, max_model_len=SHORT)  # the fix the message names
    prompt, cfg = long_prompt(SHORT - 8), GenerationConfig(max_new_tokens=8)
    assert engine.generate(prompt, cfg).tokens == Engine(target, tokenizer).generate(prompt, cfg).tokens


def test_from_pretrained_refuses_the_draft_before_loading_the_target(tmp_path, monkeypatch):
    import draftsmith.models
    from draftsmith import reference

    tokenizer = reference.target()[1]
    draft = gpt2()
    draft.resize_token_embeddings(len(tokenizer))
    spec = {"method": "draft_model", "model": saved(draft, tokenizer, tmp_path / "draft"), "num_speculative_tokens": 3}
    monkeypatch.setattr(draftsmith.models, "load_causal_lm", lambda *a, **k: pytest.fail("loaded weights"))
    with pytest.raises(ValueError, match=f"n_positions={SHORT} tokens, fewer than max_model_len=2048.*--max-model-len"):
        Engine.from_pretrained("reference", spec, check_memory=False)


def test_the_memory_plan_reads_the_limit_of_any_config(tiny_llama):
    from transformers import BloomConfig

    from draftsmith.serve.memory import plan_memory

    assert plan_memory(gpt2().config, free_bytes=2**40).max_model_len == SHORT  # n_positions
    alibi = BloomConfig(vocab_size=V, hidden_size=32, n_layer=1, n_head=2)  # declares no limit
    with pytest.raises(ValueError, match="pass max_model_len"):
        plan_memory(alibi, free_bytes=2**40)
    assert plan_memory(alibi, max_model_len=128, free_bytes=2**40).max_model_len == 128


def test_a_rope_draft_declaring_fewer_positions_is_served_with_a_warning(
    target, tokenizer, tiny_llama, tmp_path, caplog
):
    draft = tiny_llama(seed=1, vocab_size=V, num_hidden_layers=1)
    draft.config.max_position_embeddings = SHORT
    spec = {"method": "draft_model", "model": saved(draft, tokenizer, tmp_path / "draft"), "num_speculative_tokens": 3}
    with caplog.at_level(logging.WARNING, logger="draftsmith.serve.engine"):
        engine = Engine(target, tokenizer, spec)
    assert [r for r in caplog.records if f"max_position_embeddings={SHORT}" in r.getMessage()]
    prompt, cfg = long_prompt(), GenerationConfig(max_new_tokens=8)
    assert engine.generate(prompt, cfg).tokens == Engine(target, tokenizer).generate(prompt, cfg).tokens


def test_the_draft_model_proposer_drafts_only_what_fits_its_position_table(target):
    """Context past the draft's table: no IndexError, the target decodes alone there; output is plain greedy."""
    tm = TargetModel(target)
    cfg = GenerationConfig(max_new_tokens=20)
    for prompt in (long_prompt(SHORT - 6), long_prompt()):  # crosses the limit / starts past it
        proposer = DraftModelProposer(gpt2(), V)
        result = generate_speculative(tm, proposer, prompt, cfg, k=4)
        assert result.tokens == generate_plain(tm, prompt, cfg).tokens
        assert len(proposer._cached) <= SHORT  # never read a position >= 64


def test_decoding_loops_refuse_a_request_past_the_targets_limit():
    tm = TargetModel(gpt2())
    cfg = GenerationConfig(max_new_tokens=10)
    for run in (
        lambda: generate_plain(tm, long_prompt(60), cfg),
        lambda: generate_speculative(tm, DraftModelProposer(gpt2(seed=3), V), long_prompt(60), cfg, k=3),
    ):
        with pytest.raises(ValueError, match=r"70 exceeds the target's n_positions \(64\).*max_new_tokens <= 4"):
            run()
    assert len(generate_plain(tm, long_prompt(54), cfg).tokens) == 10  # 54 + 10 fits


def test_eval_refuses_long_prompts_before_running(tokenizer):
    from draftsmith.core.target import TargetModel
    from draftsmith.drafters.ngram.proposer import NgramProposer
    from draftsmith.evaluation.config import EvalConfig
    from draftsmith.evaluation.heldout import EvalRow, evaluate

    target = gpt2()
    tasks = {
        "t": [
            {"id": "short", "messages": [{"role": "user", "content": "w5 w6"}]},
            {"id": "long", "messages": [{"role": "user", "content": " ".join(["w7"] * 70)}]},
        ]
    }
    called = []
    with pytest.raises(ValueError, match=r"n_positions \(64\): t/long \(7\d tokens\); leave them out"):
        evaluate(
            target,
            tokenizer,
            tasks,
            {"ngram": EvalRow(lambda: called.append(1) or NgramProposer(), 3, TargetModel(target))},
            EvalConfig(max_new_tokens=8),
        )
    assert not called  # refused before any decoding
