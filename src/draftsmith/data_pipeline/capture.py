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

from draftsmith.core.aux_layers import check_aux_layer_ids


@dataclass
class Captured:
    """One captured batch; shapes in the module docstring."""

    aux_hidden: torch.Tensor
    target_logits: torch.Tensor


@torch.no_grad()
def capture(target, input_ids: torch.Tensor, aux_layer_ids, attention_mask: torch.Tensor | None = None) -> Captured:
    """Run the frozen ``target`` (HF causal LM) on input_ids [B, T]; return aux states and logits."""
    ids = check_aux_layer_ids(aux_layer_ids, target.config.get_text_config().num_hidden_layers)
    out = target(input_ids=input_ids, attention_mask=attention_mask, output_hidden_states=True, use_cache=False)
    aux = torch.cat([out.hidden_states[i] for i in ids], dim=-1)  # [B, T, 3H]
    return Captured(aux_hidden=aux, target_logits=out.logits)
