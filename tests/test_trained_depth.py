"""k above the depth an EAGLE-3 head was trained for warns once (issue 13, fault 7).

``num_speculative_tokens`` larger than the head's ``ttt_steps`` (draftsmith.json) runs drafts from untrained
steps: the engine says so once when it starts (not per request); the trainer once per run when its in-loop τ
drafts more than it unrolls (``train.acceptance.k``). Eval and bench build their drafters with the engine.
"""

from __future__ import annotations

import logging

import pytest

from draftsmith.core.generate import GenerationConfig
from draftsmith.serve.engine import Engine

V = 96


def conversations(n: int, offset: int = 0) -> list[dict]:
    words = ["def", "add", "(a, b)", "return", "a + b", "Hello", "there", "how", "are", "you", "?", ":"]
    return [
        {
            "messages": [
                {"role": "user", "content": " ".join(words[(i + offset) % 12 :][:3])},
                {"role": "assistant", "content": " ".join(words[(2 * i + offset) % 12 :][:6])},
            ]
        }
        for i in range(n)
    ]


def depth_warnings(caplog) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING and "ttt_steps" in r.getMessage()]


@pytest.fixture(scope="module")
def target(tiny_llama):
    return tiny_llama(seed=0, vocab_size=V)


@pytest.fixture(scope="module")
def head_dir(target, word_tokenizer, tmp_path_factory):
    from draftsmith.drafters.eagle3.export import export_eagle3
    from draftsmith.drafters.eagle3.head import Eagle3Config, Eagle3Head
    from draftsmith.identity import target_identity

    head = Eagle3Head(Eagle3Config.from_target(target.config, ttt_steps=2))
    return str(
        export_eagle3(
            head,
            tmp_path_factory.mktemp("depth") / "head",
            target_identity(target, word_tokenizer(V), "tiny"),
            target.config,
        )
    )


def test_engine_warns_once_when_k_exceeds_the_heads_ttt_steps(target, word_tokenizer, head_dir, caplog):
    tokenizer = word_tokenizer(V)
    with caplog.at_level(logging.WARNING):
        engine = Engine(target, tokenizer, {"method": "eagle3", "model": head_dir, "num_speculative_tokens": 5})
        for prompt in ([5, 6, 7, 8], [9, 10, 11]):
            assert engine.generate(prompt, GenerationConfig(max_new_tokens=8)).stats.num_drafts > 0
    (message,) = depth_warnings(caplog)
    assert "num_speculative_tokens=5" in message and "ttt_steps=2" in message and head_dir in message
    caplog.clear()
    with caplog.at_level(logging.WARNING):
        Engine(target, tokenizer, {"method": "eagle3", "model": head_dir, "num_speculative_tokens": 2})
    assert depth_warnings(caplog) == []


def test_training_warns_once_when_inloop_k_exceeds_ttt_steps(tiny_llama, chatml, tmp_path, caplog):
    from conftest import train_eagle3
    from draftsmith.data_pipeline.dataset import render_dataset
    from draftsmith.data_pipeline.vocab import build_vocab_map, count_tokens
    from draftsmith.drafters.eagle3.config import Section as HeadConfig
    from draftsmith.train.config import AcceptanceConfig, TrainConfig

    target = tiny_llama(seed=3, vocab_size=len(chatml))
    data = render_dataset(chatml, conversations(4), 48)
    vmap = build_vocab_map(
        count_tokens(data.input_ids, data.loss_mask, len(chatml)), 128, always_include=[chatml.eos_token_id]
    )
    cfg = TrainConfig(
        max_steps=2,
        batch_size=4,
        lr=3e-3,
        warmup_steps=1,
        log_every=1,
        acceptance=AcceptanceConfig(every=1, prompts=1, k=4, max_new_tokens=6),
    )
    with caplog.at_level(logging.WARNING):
        result = train_eagle3(
            target,
            data,
            vmap,
            HeadConfig(ttt_steps=2, aux_layer_ids=[1, 2, 3]),
            cfg,
            tmp_path,
            pad_id=chatml.pad_token_id,
            heldout=conversations(2, offset=5),
            tokenizer=chatml,
        )
    assert len([e for e in result.log if "tau" in e]) == 2  # measured twice, warned once
    (message,) = depth_warnings(caplog)
    assert "train.acceptance.k=4" in message and "ttt_steps=2" in message
