"""Benchmarks: ``serve.py`` (``draftsmith bench``: with vs without speculation through the server),
``draft_cost.py`` (cost of one draft step), ``vllm_referee.py`` (vLLM decodes as draftsmith does)."""
