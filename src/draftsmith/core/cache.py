"""The one KV-cache rollback mechanism of the runtime: a small adapter over transformers' ``DynamicCache``.

Speculative decoding writes the keys/values of k drafted tokens, then keeps only the accepted ones.
Everything in the runtime rolls back through ``KVCache.crop(length)`` (keep the first ``length``
tokens), so the transformers cache API is touched here and nowhere else.

Facts about transformers 5.24 this adapter relies on (read in ``transformers/cache_utils.py`` and
``models/llama/modeling_llama.py``):
  * ``DynamicCache.crop(n)`` raises ``ValueError`` for n > 0 (the old "crop to absolute length" path
    is gone); ``crop(-n)`` drops the last n tokens; ``crop(0)`` is a no-op for full-attention layers
    and trims sliding-window layers back to their window.
  * The model kwarg is ``cache=`` (``past_key_values=`` is deprecated, removal announced for 5.40).
  * ``get_seq_length()`` counts tokens seen, including for sliding-window layers.
  * A sliding-window layer that has reached its window can only be rolled back if past recording was
    activated first; this adapter activates it when it creates the cache.
  * Linear-attention (SSM/hybrid) layers cannot be rolled back in general (``is_croppable`` False):
    ``crop`` then raises ``RuntimeError``; such targets are not supported by the speculative runtime.

Run the tests: ``python -m pytest tests/test_cache.py -q``.
"""

from __future__ import annotations

from transformers import DynamicCache


class KVCache:
    """KV cache of ONE sequence (batch size 1) with a crop-to-length rollback.

    Args:
        config: the model's ``PretrainedConfig``; used by ``DynamicCache`` to pick per-layer cache
            types (full / sliding window). ``None`` gives lazily created full-attention layers.

    Attributes:
        hf: the underlying ``transformers.DynamicCache``; pass it as ``model(..., cache=kv.hf)`` (or
            use ``model_kwargs()``).
    """

    def __init__(self, config=None):
        self.hf = DynamicCache(config=config)
        # Sliding-window layers may only be rolled back past their window while recording the past.
        self.hf.activate_past_recording()

    @property
    def length(self) -> int:
        """Number of tokens whose keys/values are cached (positions 0..length-1)."""
        return int(self.hf.get_seq_length())

    def crop(self, length: int) -> None:
        """Keep the first ``length`` cached tokens and drop the rest.

        Raises:
            ValueError: ``length`` is negative or larger than ``self.length``.
            RuntimeError: the cache holds layers transformers cannot roll back (linear attention).
        """
        current = self.length
        if not 0 <= length <= current:
            raise ValueError(f"cannot crop a KV cache of {current} tokens to length {length}")
        if length < current and not self.hf.is_croppable:
            raise RuntimeError(
                "this model's cache (linear-attention / recurrent layers) cannot be rolled back; "
                "the speculative runtime supports attention-only targets and drafts"
            )
        # transformers >= 5.2x: crop(-n) drops the last n tokens; crop(0) re-trims sliding windows.
        self.hf.crop(-(current - length))

    def model_kwargs(self) -> dict:
        """Keyword arguments that make a transformers forward read and extend this cache."""
        return {"cache": self.hf, "use_cache": True}

    def __repr__(self) -> str:
        return f"KVCache(length={self.length})"
