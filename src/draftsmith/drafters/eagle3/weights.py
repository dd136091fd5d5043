"""The tensors of an exported EAGLE-3 head: names and shapes for a geometry, and the vocab map's rules.

Shared by the check (``check.py``), the export (``export.py``) and the engine read-back (``formats.py``).
"""

from __future__ import annotations

import torch

from draftsmith.data_pipeline.vocab import validate_vocab_map as validate_map
from draftsmith.export.metadata import HeadMismatchError


def expected_weight_shapes(head_config: dict) -> dict[str, tuple[int, ...]]:
    """Tensor name -> shape of an exported EAGLE-3 head (names of DESIGN §6; d2t/t2d only if Vd < V)."""
    c = head_config
    h, i, hd = c["hidden_size"], c["intermediate_size"], c["head_dim"]
    q, kv = c["num_attention_heads"] * hd, c["num_key_value_heads"] * hd
    shapes = {
        "fc.weight": (h, 3 * h),
        "midlayer.input_layernorm.weight": (h,),
        "midlayer.hidden_norm.weight": (h,),
        "midlayer.self_attn.q_proj.weight": (q, 2 * h),
        "midlayer.self_attn.k_proj.weight": (kv, 2 * h),
        "midlayer.self_attn.v_proj.weight": (kv, 2 * h),
        "midlayer.self_attn.o_proj.weight": (h, q),
        "midlayer.post_attention_layernorm.weight": (h,),
        "midlayer.mlp.gate_proj.weight": (i, h),
        "midlayer.mlp.up_proj.weight": (i, h),
        "midlayer.mlp.down_proj.weight": (h, i),
        "norm.weight": (h,),
        "lm_head.weight": (c["draft_vocab_size"], h),
    }
    if c["draft_vocab_size"] != c["vocab_size"]:
        shapes["d2t"] = (c["draft_vocab_size"],)
        shapes["t2d"] = (c["vocab_size"],)
    return shapes


def validate_state_dict(sd: dict[str, torch.Tensor], head_config: dict, where: str) -> None:
    """Names and shapes against the geometry, then the vocab map (raises HeadMismatchError)."""
    expected = expected_weight_shapes(head_config)
    vd, v = head_config["draft_vocab_size"], head_config["vocab_size"]
    if vd < v and "d2t" not in sd:
        raise HeadMismatchError(
            "d2t",
            f"{where}: draft_vocab_size {vd} < target vocab_size {v} but no d2t "
            f"tensor: draft ids cannot be mapped to target ids. Fix: re-export the head "
            f"with its vocab map (d2t/t2d from training).",
        )
    missing = sorted(set(expected) - set(sd))
    if missing:
        raise HeadMismatchError(
            "weights",
            f"{where}: weights: missing tensor(s) {', '.join(missing)}. "
            f"Fix: re-export the head; the file is incomplete.",
        )
    unexpected = sorted(set(sd) - set(expected))
    if unexpected:
        raise HeadMismatchError(
            "weights",
            f"{where}: weights: unexpected tensor(s) {', '.join(unexpected)} for "
            f"an EAGLE-3 head (no biases, no embedding, no model. prefix). Fix: re-export "
            f"with draftsmith.",
        )
    for name, shape in expected.items():
        if tuple(sd[name].shape) != shape:
            raise HeadMismatchError(
                "weights",
                f"{where}: weights: {name} has shape {tuple(sd[name].shape)}, the "
                f"head's geometry needs {shape}. Fix: re-export the head; config and weights "
                f"disagree.",
            )
    validate_vocab_map(sd.get("d2t"), sd.get("t2d"), vd, v, where)


def validate_vocab_map(
    d2t: torch.Tensor | None, t2d: torch.Tensor | None, draft_vocab_size: int, vocab_size: int, where: str = "head"
) -> None:
    """d2t [Vd] int64 offsets (target_id = draft_id + d2t[draft_id]) into [0, V), no two draft ids on
    one target id, and t2d [V] bool marking exactly those target ids (``heads.vocab``)."""
    if draft_vocab_size > vocab_size:
        raise HeadMismatchError(
            "draft_vocab_size",
            f"{where}: draft_vocab_size {draft_vocab_size} > target "
            f"vocab_size {vocab_size}. Fix: the draft vocab must be a subset of the target's.",
        )
    if draft_vocab_size == vocab_size and d2t is None:
        return
    if d2t is None or t2d is None:
        name = "d2t" if d2t is None else "t2d"
        raise HeadMismatchError(
            name,
            f"{where}: draft_vocab_size {draft_vocab_size} < vocab_size {vocab_size} "
            f"and no {name}. Fix: re-export the head with its vocab map (d2t/t2d).",
        )
    if d2t.dtype != torch.int64 or tuple(d2t.shape) != (draft_vocab_size,):
        raise HeadMismatchError(
            "d2t",
            f"{where}: d2t must be int64 of shape ({draft_vocab_size},), got "
            f"{d2t.dtype} {tuple(d2t.shape)}. Fix: re-export the head's vocab map.",
        )
    if t2d.dtype != torch.bool or tuple(t2d.shape) != (vocab_size,):
        raise HeadMismatchError(
            "t2d",
            f"{where}: t2d must be bool of shape ({vocab_size},), got "
            f"{t2d.dtype} {tuple(t2d.shape)}. Fix: re-export the head's vocab map.",
        )
    try:
        validate_map(d2t, t2d)
    except ValueError as e:
        if _is_index_map(d2t, t2d):
            raise HeadMismatchError(
                "d2t",
                f"{where}: d2t holds target ids (index style, target_id = d2t[draft_id]) "
                f"where vLLM and SGLang read offsets (target_id = draft_id + d2t[draft_id]): every "
                f"draft token would be served as another token. Fix: convert it to offsets "
                f"(d2t - arange({draft_vocab_size})) and re-export.",
            ) from None
        name = "t2d" if str(e).startswith("t2d") else "d2t"
        raise HeadMismatchError(
            name, f"{where}: {e} (field {name}). Fix: rebuild the vocab map for this target and re-export."
        ) from None


def _is_index_map(d2t: torch.Tensor, t2d: torch.Tensor) -> bool:
    """Whether ``d2t`` read as target ids (not offsets) is the map ``t2d`` marks: the index-style d2t some
    converters write (distinct in-range ids, exactly those of t2d)."""
    ids = d2t.long()
    return bool(
        ids.numel()
        and int(ids.min()) >= 0
        and int(ids.max()) < t2d.numel()
        and torch.unique(ids).numel() == ids.numel()
        and bool(t2d[ids].all())
        and int(t2d.sum()) == ids.numel()
    )
