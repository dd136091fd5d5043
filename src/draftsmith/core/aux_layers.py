"""Which target layers a drafter reads hidden states from: the id convention and the one valid order (torch-free).

Ids are transformers ``output_hidden_states`` indices: id i is the INPUT of decoder layer i (the residual
stream before it), so 0..N-1 are valid for an N-layer target and index N (the final *normed* output in
transformers) is not. vLLM numbers them the same way (``vllm/model_executor/models/llama_eagle3.py``),
SGLang one lower. Imported by the core (``core/target.py``), the capture (``data_pipeline/capture.py``) and
drafter configs, which must refuse bad ids before any model loads.
"""

from __future__ import annotations

#: how ids are numbered, recorded next to them in every export and capture manifest (never a bare list)
AUX_LAYER_CONVENTION = "hf_hidden_states_index"


def aux_layer_order_problem(aux_layer_ids) -> str | None:
    """Why ``aux_layer_ids`` cannot be served as the fc's input order, or None when they can.

    The ids must be strictly ascending (distinct, low -> high), because that is the only order the
    engines build: vLLM collects the aux states while iterating the target's layers
    (``vllm/model_executor/models/llama.py``: ``if idx in self.aux_hidden_state_layers``, the ids set by
    ``v1/worker/gpu_model_runner.py`` ``_get_eagle3_aux_layers_from_config``) and SGLang likewise
    (``python/sglang/srt/models/llama.py``: ``if i in self.layers_to_capture``), so the concatenation
    [T, 3H] is in layer order whatever the list's order, and a repeated id is captured once. A head
    trained on [6, 3, 1] would get its fc columns fed in another order.

    Refused rather than normalised: sorting the ids would have to permute the fc's column blocks in
    the same step everywhere ids and weights meet (capture, shards, checkpoints, export, runtime),
    and one missed place silently serves a wrong head; a refusal at configuration time costs nothing
    (the fix is to write the same layers ascending before training)."""
    ids = [int(i) for i in aux_layer_ids]
    if all(a < b for a, b in zip(ids, ids[1:])):
        return None
    fix = sorted(set(ids))
    return (
        f"aux_layer_ids {ids} are not strictly ascending: vLLM and SGLang concatenate the aux hidden states "
        f"in layer order ({', '.join(map(str, fix))}) whatever the list's order and capture a repeated layer "
        f"once, so the fc would receive its features in another order. Fix: write them ascending, "
        f"{fix}{' (three distinct layers)' if len(fix) != len(ids) else ''}, and train the head on that order"
    )


def check_aux_layer_ids(aux_layer_ids, num_hidden_layers: int) -> tuple[int, ...]:
    """``aux_layer_ids`` as a tuple, checked against a target of ``num_hidden_layers`` layers: at least one id,
    each in 0..N-1 (inputs of decoder layers), strictly ascending (:func:`aux_layer_order_problem`).

    Raises ValueError naming the ids and the fix."""
    ids = tuple(int(i) for i in aux_layer_ids)
    if not ids or not all(0 <= i < num_hidden_layers for i in ids):
        raise ValueError(
            f"aux_layer_ids {ids} must be HF hidden-state indices in 0..{num_hidden_layers - 1} (inputs "
            f"of decoder layers; index {num_hidden_layers} is the final normed output) for this "
            f"{num_hidden_layers}-layer target"
        )
    if (problem := aux_layer_order_problem(ids)) is not None:
        raise ValueError(problem)
    return ids


def default_aux_layer_ids(num_hidden_layers: int) -> tuple[int, int, int]:
    """(2, N//2, N-3) in the HF ``output_hidden_states`` index convention (vLLM ``llama_eagle3.py``).

    For shallow targets the default collapses (N=4 gives 2, 2, 1); then three distinct ids spread over
    the depth are chosen instead, and exports always write them explicitly."""
    n = num_hidden_layers
    ids = (2, n // 2, n - 3)
    if len(set(ids)) == 3 and ids[0] < ids[1] < ids[2]:
        return ids
    if n < 3:
        raise ValueError(f"EAGLE-3 needs a target with at least 3 layers, got {n}")
    return (1, max(2, n // 2), n - 1) if n >= 4 else (0, 1, 2)
