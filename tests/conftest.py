"""Shared fixtures: tiny models built from configs on CPU (never downloaded)."""
from __future__ import annotations

import pytest
import torch

torch.set_num_threads(1)


def make_tiny_llama(vocab_size: int = 96, hidden_size: int = 32, num_hidden_layers: int = 4, seed: int = 0,
                    num_attention_heads: int = 4, num_key_value_heads: int = 2, arch: str = "llama"):
    """A random tiny causal LM (llama | qwen2 | qwen3 | mistral) in eval mode, float32."""
    import transformers as tf

    cls = {"llama": (tf.LlamaConfig, tf.LlamaForCausalLM), "qwen2": (tf.Qwen2Config, tf.Qwen2ForCausalLM),
           "qwen3": (tf.Qwen3Config, tf.Qwen3ForCausalLM), "mistral": (tf.MistralConfig, tf.MistralForCausalLM)}
    config_cls, model_cls = cls[arch]
    config = config_cls(vocab_size=vocab_size, hidden_size=hidden_size, intermediate_size=2 * hidden_size,
                        num_hidden_layers=num_hidden_layers, num_attention_heads=num_attention_heads,
                        num_key_value_heads=num_key_value_heads, max_position_embeddings=512,
                        tie_word_embeddings=False, eos_token_id=1, pad_token_id=0, bos_token_id=None)
    torch.manual_seed(seed)
    return model_cls(config).eval()


@pytest.fixture(scope="session")
def tiny_llama():
    """Factory fixture: ``tiny_llama(seed=1, vocab_size=64)``."""
    return make_tiny_llama
