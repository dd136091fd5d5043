"""The main job as stages over one recipe (prepare, capture, train, export, check, eval) and the demo."""
