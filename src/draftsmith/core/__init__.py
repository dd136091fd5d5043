"""The verification core: the target wrapper and its KV cache, sampling, verification, the decode loop and the
``Proposer`` contract. It imports nothing of draftsmith above it (tests/test_layers.py)."""
