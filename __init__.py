"""draftsmith: train speculative-decoding draft heads (EAGLE-3, draft models) and serve them."""

__version__ = "0.1.0"
