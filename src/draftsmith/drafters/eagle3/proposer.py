"""EAGLE-3 proposer: a chain of k drafts from the head, fed with the target's aux states.

Alignment with the target's positions (same picture as ``train/ttt.py``):

    context       x0 .. x_t            (the target has read these; aux states a_0..a_t)
    prefix step   position j <= t:  feature a_j, token x_{j+1} -> head prefix entry j
    draft 1       from the prefix step at t (token x_{t+1} = the token the target just emitted)
    draft i+1     chain step i: feature h_{i-1}, token draft_i, position t + i

After verification the accepted drafts and the target's token extend the context: their n+1 aux rows
(from the verify pass) become new prefix entries; chain entries are dropped. The head's q lives on
the draft vocabulary and is scattered into the target vocabulary through d2t (zero elsewhere) before
verification (DESIGN.md §7). Head steps run in the head's dtype; batch size 1.
"""

from __future__ import annotations

import logging

import torch

from draftsmith.core.proposer import Proposal, Proposer
from draftsmith.core.sampling import logits_to_probs, sample, seeded_generator
from draftsmith.drafters.eagle3.head import Eagle3Head, HeadKV

logger = logging.getLogger(__name__)


def warn_beyond_trained_depth(k: int, ttt_steps: int | None, head: str, knob: str = "num_speculative_tokens") -> bool:
    """Log one warning when k drafts per step exceed the depth an EAGLE-3 head was trained to.

    Training-time test unrolls the head ``ttt_steps`` steps (DESIGN.md §3): chain step i >= ttt_steps was never
    trained, so drafts past position ``ttt_steps`` are rarely accepted and cost a head step each (output stays
    lossless). Call it once per engine / run. ``head`` names the head, ``knob`` the setting that holds k.
    Returns True when it warned (False also when ``ttt_steps`` is unknown)."""
    if ttt_steps is None or k <= ttt_steps:
        return False
    logger.warning(
        "%s=%d exceeds the depth %s was trained for (ttt_steps=%d): drafts past position %d come from "
        "untrained steps and are rarely accepted; use %s <= %d or train with ttt_steps >= %d",
        knob,
        k,
        head,
        ttt_steps,
        ttt_steps,
        knob,
        ttt_steps,
        k,
    )
    return True


class Eagle3Proposer(Proposer):
    """Drafts with an EAGLE-3 head whose metadata was already checked against the target.

    Args:
        head: an ``Eagle3Head`` with the target's embedding bound (``head.bind_embedding``).
        temperature: 0 -> argmax drafts (q None); > 0 -> drafts sampled from q = logits_to_probs(...).
        top_k, top_p: applied to the draft distribution when sampling. seed: the sampling generator's seed.
    """

    needs_aux_hidden = True

    def __init__(
        self,
        head: Eagle3Head,
        *,
        temperature: float = 0.0,
        top_k: int | None = None,
        top_p: float | None = None,
        seed: int | None = None,
    ):
        if temperature < 0:
            raise ValueError(f"temperature must be >= 0, got {temperature}")
        self.head = head.eval()
        self.temperature, self.top_k, self.top_p = temperature, top_k, top_p
        self.generator = seeded_generator(head.fc.weight.device, seed)
        vd = head.config.draft_vocab_size
        self.draft_ids = head.draft_to_target(torch.arange(vd, device=head.fc.weight.device))  # [Vd] target ids
        self.kv = HeadKV()
        self.last_hidden: torch.Tensor | None = None  # [1, 1, H]
        self.last_logits: torch.Tensor | None = None  # [Vd]

    @torch.inference_mode()
    def _extend_prefix(self, aux_hidden: torch.Tensor, next_tokens: torch.Tensor) -> None:
        """Prefix step over new context positions: aux_hidden [n, 3H], next_tokens [n] (token after each)."""
        self.kv.reset_chain()
        dev = self.head.fc.weight.device
        g = self.head.fuse(aux_hidden.to(dev)[None])  # [1, n, H]
        hidden, logits = self.head.step(g, next_tokens.to(dev)[None], self.kv, "prefix")
        self.last_hidden, self.last_logits = hidden[:, -1:], logits[0, -1]

    def start(self, prompt_ids: torch.Tensor, first_token: int, target_step) -> None:
        self.kv = HeadKV()
        next_tokens = torch.cat([prompt_ids[1:].cpu(), torch.tensor([first_token])])  # x_{j+1} for j < T
        self._extend_prefix(target_step.aux_hidden, next_tokens)

    def _draw(self, logits: torch.Tensor) -> tuple[int, torch.Tensor | None]:
        """One draft from draft-vocab logits [Vd]: (target id, q over the target vocab [V] or None)."""
        if self.temperature == 0:
            return int(self.draft_ids[int(logits.argmax())]), None
        q_draft = logits_to_probs(logits.float(), self.temperature, self.top_k, self.top_p)  # [Vd]
        d = int(sample(q_draft, self.generator))
        q = torch.zeros(self.head.config.vocab_size, dtype=q_draft.dtype, device=q_draft.device)
        q[self.draft_ids] = q_draft
        return int(self.draft_ids[d]), q

    @torch.inference_mode()
    def propose(self, k: int) -> Proposal:
        if k == 0:
            return Proposal.empty()
        self.kv.reset_chain()
        tokens, qs = [], []
        hidden, logits = self.last_hidden, self.last_logits
        for i in range(k):
            token, q = self._draw(logits)
            tokens.append(token)
            qs.append(q)
            if i + 1 < k:
                ids = torch.tensor([[token]], device=hidden.device)
                hidden, step_logits = self.head.step(hidden, ids, self.kv, "chain")
                logits = step_logits[0, -1]
        q = None if self.temperature == 0 else torch.stack(qs).cpu()
        return Proposal(torch.tensor(tokens, dtype=torch.long), q)

    def accept(self, n_accepted: int, emitted: torch.Tensor, target_step) -> None:
        # rows 0..n of the verify pass read [last token, d1..dn]; the token after each is emitted[0..n]
        self._extend_prefix(target_step.aux_hidden[: n_accepted + 1], emitted[: n_accepted + 1])
