"""DFlash proposer: up to k drafts from ONE drafter forward per verify step.

What it keeps and reads (as vLLM's ``v1/spec_decode/dflash.py`` does; picture in ``head.py``):

    context       x0 .. x_p            the target has read these; their aux states, fused, are the drafter's
                                       context keys/values (one cache per draft layer, only ever appended to)
    block         [x_{p+1}, m × k]     x_{p+1}: the token the target emitted last; positions p+1 .. p+1+k
    drafts        d_j = output at block index j (1..k)

After verification of [x_{p+1}, d1..dk'] with n accepted, verify rows 0..n read x_{p+1}, d1..dn: their aux states
become context entries p+1 .. p+1+n, and the new block starts with the target's token ``emitted[n]``. Rejected
drafts never enter the context, so nothing is ever cropped.

Drafts at temperature 0 are the argmax of each position's logits (q None). With temperature > 0 each draft is drawn
from its position's q = logits_to_probs(processed logits) (``core.proposer.Sampling.draw``) and q is returned:
rejection sampling only needs each d_j to be drawn from the q_j it is verified with (Leviathan et al. 2023), and
q_j here depends on the context alone, not on d_1..d_{j-1}, which is still a valid proposal. k past the trained
block (block_size - 1) is refused, as the drafter has no trained position for it.
"""

from __future__ import annotations

import torch

from draftsmith.core.proposer import Proposal, Proposer, Sampling
from draftsmith.core.sampling import seeded_generator
from draftsmith.drafters.dflash.head import DFlashHead


class DFlashProposer(Proposer):
    """Drafts with a ``DFlashHead`` (target embedding and lm_head bound) whose metadata was checked against the
    target.

    Args:
        head: the drafter, on the device where drafts are computed (eval mode is set).
        sampling: the request's ``core.proposer.Sampling`` (default: greedy).

    Raises:
        ValueError: a negative temperature; ``propose(k)`` with k > block_size - 1; a target step without
        ``aux_hidden``.
    """

    needs_aux_hidden = True

    def __init__(self, head: DFlashHead, *, sampling: Sampling | None = None):
        self.sampling = sampling if sampling is not None else Sampling()
        if self.sampling.temperature < 0:
            raise ValueError(f"temperature must be >= 0, got {self.sampling.temperature}")
        self.head = head.eval()
        self.device = head.fc.weight.device
        self.generator = seeded_generator(self.device, self.sampling.seed)
        self.kv: list[list[torch.Tensor]] = []  # per layer [K, V], [1, nkv, L, hd]
        self.length = 0  # context entries L = positions the target has read
        self.last_token: int | None = None  # x_{p+1}, the first query of the next block

    @torch.inference_mode()
    def _extend(self, aux_hidden: torch.Tensor | None, rows: int, token: int) -> None:
        """Append the first ``rows`` rows of ``aux_hidden`` [>= rows, n·H] as context entries; next block's token."""
        if aux_hidden is None:
            raise ValueError(
                "DFlashProposer needs target_step.aux_hidden: build the target with the drafter's aux_layer_ids "
                "(the runtime does when proposer.needs_aux_hidden)"
            )
        if rows > 0:
            c = self.head.context(aux_hidden[:rows].to(self.device)[None])  # [1, n, H]
            positions = torch.arange(self.length, self.length + rows, device=self.device)[None]
            new = self.head.context_kv(c, positions)
            if not self.kv:
                self.kv = [[k, v] for k, v in new]
            else:
                for entry, (k, v) in zip(self.kv, new):
                    entry[0] = torch.cat([entry[0], k], dim=2)
                    entry[1] = torch.cat([entry[1], v], dim=2)
            self.length += rows
        self.last_token = int(token)

    def start(self, prompt_ids: torch.Tensor, first_token: int, target_step) -> None:
        """Context: the prompt's T aux rows; first block starts with ``first_token`` at position T."""
        self.kv, self.length = [], 0
        self._extend(target_step.aux_hidden, int(prompt_ids.numel()), first_token)

    @torch.inference_mode()
    def propose(self, k: int) -> Proposal:
        """Draft ``k`` <= block_size - 1 tokens from one block forward [last token, mask × k]."""
        max_k = self.head.config.max_k
        if k > max_k:
            raise ValueError(
                f"k={k} drafts asked of a DFlash drafter trained with block_size={self.head.config.block_size} "
                f"(at most {max_k} per block); use num_speculative_tokens <= {max_k} or train a larger block"
            )
        if k <= 0:
            return Proposal.empty()
        if self.last_token is None or not self.kv:
            raise RuntimeError("DFlashProposer.propose before start()")
        ids = torch.full((1, k + 1), self.head.config.mask_token_id, dtype=torch.long, device=self.device)
        ids[0, 0] = self.last_token
        positions = torch.arange(self.length, self.length + k + 1, device=self.device)[None]
        hidden = self.head.block(ids, positions, [tuple(e) for e in self.kv])  # [1, k+1, H]
        logits = self.head.logits(hidden[0, 1:])  # [k, V]
        tokens, qs = [], []
        for j in range(k):
            token, q = self.sampling.draw(logits[j], self.generator, tokens)
            tokens.append(token)
            qs.append(q)
        q = None if self.sampling.temperature == 0 else torch.stack(qs).float().cpu()
        return Proposal(torch.tensor(tokens, dtype=torch.long), q)

    def accept(self, n_accepted: int, emitted: torch.Tensor, target_step) -> None:
        """Verify rows 0..n become context; the next block starts with ``emitted[n]``."""
        self._extend(target_step.aux_hidden, n_accepted + 1, int(emitted[n_accepted]))
