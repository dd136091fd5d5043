"""Measuring drafters: acceptance on held-out tasks, the vLLM referee, the serving benchmark."""
