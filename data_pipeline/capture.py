"""Online capture of what EAGLE-3 training needs from the frozen target.

For a batch of rendered conversations the target runs once without grad and yields:
  aux_hidden    [B, T, 3H]  residual-stream states low -> mid -> high, taken BEFORE the final norm:
                            ``outputs.hidden_states[i]`` for i in aux_layer_ids, i.e. the inputs of
                            decoder layers i (HF ``output_hidden_states`` index, the convention vLLM's
                            ``llama_eagle3.py`` uses; SGLang numbers the same layers one lower)
  target_logits [B, T, V]   the target's next-token logits (position t predicts token t+1)
Offline shards (``draftsmith capture``) store the same tensors.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class Captured:
    """One captured batch; shapes in the module docstring."""

    aux_hidden: torch.Tensor
    target_logits: torch.Tensor


def check_aux_layer_ids(aux_layer_ids, num_hidden_layers: int) -> tuple[int, int, int]:
    """Validate HF-index aux layer ids against a target of ``num_hidden_layers`` layers.

    Index N would be the final *normed* output in transformers, so valid ids are 0..N-1; the ids must be
    strictly ascending, the one order vLLM and SGLang concatenate them in
    (``heads.eagle3.aux_layer_order_problem``)."""
    from draftsmith.heads.eagle3 import aux_layer_order_problem

    ids = tuple(int(i) for i in aux_layer_ids)
    if len(ids) != 3 or not all(0 <= i < num_hidden_layers for i in ids):
        raise ValueError(f"aux_layer_ids {ids} must be 3 HF hidden-state indices in 0..{num_hidden_layers - 1} "
                         f"(inputs of decoder layers) for a {num_hidden_layers}-layer target")
    if (problem := aux_layer_order_problem(ids)) is not None:
        raise ValueError(problem)
    return ids


@torch.no_grad()
def capture(target, input_ids: torch.Tensor, aux_layer_ids, attention_mask: torch.Tensor | None = None) -> Captured:
    """Run the frozen ``target`` (HF causal LM) on input_ids [B, T]; return aux states and logits."""
    ids = check_aux_layer_ids(aux_layer_ids, target.config.get_text_config().num_hidden_layers)
    out = target(input_ids=input_ids, attention_mask=attention_mask, output_hidden_states=True, use_cache=False)
    aux = torch.cat([out.hidden_states[i] for i in ids], dim=-1)   # [B, T, 3H]
    return Captured(aux_hidden=aux, target_logits=out.logits)
