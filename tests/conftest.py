"""Shared fixtures: tiny models built from configs on CPU (never downloaded)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

torch.set_num_threads(1)
# subprocesses the tests start (accelerate launch, the CLI) import this checkout's package, as pytest does
# (pyproject.toml pythonpath), whatever draftsmith the interpreter has installed
SRC = str(Path(__file__).resolve().parents[1] / "src")
os.environ["PYTHONPATH"] = os.pathsep.join([SRC, *filter(None, [os.environ.get("PYTHONPATH")])])
# adaptive speculation's cost models (serve/costs.py) are cached per test session, never in the user's home
if "DRAFTSMITH_CACHE" not in os.environ:
    import tempfile

    os.environ["DRAFTSMITH_CACHE"] = tempfile.mkdtemp(prefix="draftsmith-test-cache-")


def make_tiny_llama(
    vocab_size: int = 96,
    hidden_size: int = 32,
    num_hidden_layers: int = 4,
    seed: int = 0,
    num_attention_heads: int = 4,
    num_key_value_heads: int = 2,
    arch: str = "llama",
):
    """A random tiny causal LM (llama | qwen2 | qwen3 | mistral) in eval mode, float32."""
    import transformers as tf

    cls = {
        "llama": (tf.LlamaConfig, tf.LlamaForCausalLM),
        "qwen2": (tf.Qwen2Config, tf.Qwen2ForCausalLM),
        "qwen3": (tf.Qwen3Config, tf.Qwen3ForCausalLM),
        "mistral": (tf.MistralConfig, tf.MistralForCausalLM),
    }
    config_cls, model_cls = cls[arch]
    config = config_cls(
        vocab_size=vocab_size,
        hidden_size=hidden_size,
        intermediate_size=2 * hidden_size,
        num_hidden_layers=num_hidden_layers,
        num_attention_heads=num_attention_heads,
        num_key_value_heads=num_key_value_heads,
        max_position_embeddings=512,
        tie_word_embeddings=False,
        eos_token_id=1,
        pad_token_id=0,
        bos_token_id=None,
    )
    torch.manual_seed(seed)
    return model_cls(config).eval()


@pytest.fixture(scope="session")
def tiny_llama():
    """Factory fixture: ``tiny_llama(seed=1, vocab_size=64)``."""
    return make_tiny_llama


def make_word_tokenizer(
    vocab_size: int = 96,
    rename: dict | None = None,
    template: str | None = "{% for m in messages %}<{{ m.role }}>{{ m.content }}{% endfor %}",
):
    """A word-level tokenizer built in memory (``w0`` pad, ``w1`` eos, ``w2`` unk); ``rename={id: token}``
    gives a different tokenizer of the same size."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {f"w{i}": i for i in range(vocab_size)}
    for i, tok in (rename or {}).items():
        vocab = {k: v for k, v in vocab.items() if v != i} | {tok: i}
    backend = Tokenizer(models.WordLevel(vocab, unk_token="w2"))
    backend.pre_tokenizer = pre_tokenizers.Whitespace()
    tok = PreTrainedTokenizerFast(tokenizer_object=backend, pad_token="w0", eos_token="w1", unk_token="w2")
    tok.chat_template = template
    return tok


@pytest.fixture(scope="session")
def word_tokenizer():
    """Factory fixture: ``word_tokenizer(rename={40: "zz"})`` (see ``make_word_tokenizer``)."""
    return make_word_tokenizer


def make_chatml_tokenizer(vocab_size: int = 300):
    """A small byte-level BPE tokenizer with the reference target's ChatML template and special tokens,
    trained in memory on two code/chat lines (never downloaded)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    from draftsmith.reference import CHAT_TEMPLATE, SPECIAL_TOKENS

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    bpe = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=SPECIAL_TOKENS,
        show_progress=False,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    tok.train_from_iterator(["def add(a, b):\n    return a + b\n", "Hello there, how are you?"] * 20, bpe)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|im_end|>", pad_token="<|endoftext|>")
    fast.chat_template = CHAT_TEMPLATE
    fast.name_or_path = "tiny-chatml"  # what error messages name the template by
    return fast


@pytest.fixture(scope="module")
def chatml():
    """``make_chatml_tokenizer()``: 300 tokens, ChatML template (a fresh one per test module)."""
    return make_chatml_tokenizer()


@pytest.fixture(scope="session")
def chatml_tokenizer():
    """Factory fixture: ``chatml_tokenizer(vocab_size=400)`` (see ``make_chatml_tokenizer``)."""
    return make_chatml_tokenizer


def pytest_addoption(parser):
    parser.addoption(
        "--run-vllm",
        action="store_true",
        default=False,
        help="run the opt-in vLLM referee tests (needs .venv-vllm; see bench/vllm_referee.py)",
    )


def train_eagle3(target, data, vocab_map, section, cfg, out_dir, pad_id, **kw):
    """Train an EAGLE-3 head the way ``pipeline.stages.train_drafter`` does (the argument order tests use)."""
    from draftsmith.pipeline.stages import train_drafter

    return train_drafter(section, target, data, cfg, out_dir, pad_id, vocab_map=vocab_map, **kw)


def train_draft_model(target, data, section, cfg, out_dir, pad_id, **kw):
    """Distil a draft model (``pipeline.stages.train_drafter``)."""
    from draftsmith.pipeline.stages import train_drafter

    return train_drafter(section, target, data, cfg, out_dir, pad_id, **kw)


def train_mlp_speculator(target, data, section, cfg, out_dir, pad_id, **kw):
    """Train an MLP speculator (``pipeline.stages.train_drafter``)."""
    from draftsmith.pipeline.stages import train_drafter

    return train_drafter(section, target, data, cfg, out_dir, pad_id, **kw)
