"""Serving: the engine (checks a drafter, decodes requests), the OpenAI-compatible server, metrics, the memory plan."""
