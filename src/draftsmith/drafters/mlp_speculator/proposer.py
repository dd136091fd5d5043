"""MLP speculator proposer: a chain of up to n_predict drafts, stage i feeding stage i+1.

Paper: Wertheimer et al. 2024 (arXiv:2404.19124); stage arithmetic in ``drafters/mlp_speculator/head.py``.
What it reads from the target (the loop asks every forward for ``final_hidden``, the lm_head input):

    context       x0 .. x_t            (the target has read these; final hidden states h_0..h_t)
    last token    x_{t+1}              the target's own token after x_t (emitted, not yet read by it)
    draft 1       stage 0: state h_t,             token x_{t+1}
    draft i+1     stage i: state s_{i-1} (stage i-1's output), token draft_i

After verification of [x_{t+1}, d1..dk'] with n accepted, the verify row n read d_n (x_{t+1} when
n = 0) and the target's token t' follows it: the next chain starts from (final_hidden[n], t') —
``emitted[n]``. Nothing else is kept: no cache, no rollback. vLLM's MLP speculator does the same
(``generate_proposals``: ``previous_hidden_states`` of the last accepted position, the sampled token).

k larger than n_predict is refused (ValueError), as vLLM's ``generate_proposals`` refuses it: the head
has no stage to draft token n_predict + 1 with. Greedy drafts (temperature 0) are argmax with q None;
with temperature > 0 each draft is sampled from q = logits_to_probs(stage logits) and q is returned,
as rejection sampling requires. Batch size 1.
"""

from __future__ import annotations

import torch

from draftsmith.core.proposer import Proposal, Proposer
from draftsmith.core.sampling import logits_to_probs, sample, seeded_generator
from draftsmith.drafters.mlp_speculator.head import MLPSpeculator


class MLPSpeculatorProposer(Proposer):
    """Drafts with an ``MLPSpeculator`` whose metadata was already checked against the target.

    Args:
        head: the speculator (eval mode is set), on the device where its drafts are computed.
        temperature: 0 -> argmax drafts (q None); > 0 -> drafts sampled from q = logits_to_probs(...).
        top_k, top_p: applied to the draft distribution when sampling. seed: the sampling generator's seed.

    Raises:
        ValueError: a negative temperature; ``propose(k)`` with k > ``head.config.n_predict``.
    """

    needs_final_hidden = True

    def __init__(
        self,
        head: MLPSpeculator,
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
        self.device = head.proj[0].weight.device
        self.generator = seeded_generator(self.device, seed)
        self.state: torch.Tensor | None = None  # [1, H] stage-0 state (final hidden of the last verified row)
        self.last_token: int | None = None  # the target's token after that row

    def _root(self, final_hidden: torch.Tensor | None, row: int, token: int) -> None:
        if final_hidden is None:
            raise ValueError(
                "MLPSpeculatorProposer needs target_step.final_hidden: run the target forward with "
                "final_hidden=True (generate_speculative does when proposer.needs_final_hidden)"
            )
        self.state = self.head.input_state(final_hidden[row].to(self.device))[None]  # [1, H]
        self.last_token = int(token)

    def start(self, prompt_ids: torch.Tensor, first_token: int, target_step) -> None:
        """Chain root: the prefill's last row (it read the last prompt token) and the first token."""
        self._root(target_step.final_hidden, -1, first_token)

    def _draw(self, logits: torch.Tensor) -> tuple[int, torch.Tensor | None]:
        """One draft from stage logits [V]: (token id, q [V] or None when greedy)."""
        if self.temperature == 0:
            return int(logits.argmax()), None
        q = logits_to_probs(logits.float(), self.temperature, self.top_k, self.top_p)  # [V]
        return int(sample(q, self.generator)), q

    @torch.inference_mode()
    def propose(self, k: int) -> Proposal:
        """Draft ``k`` <= n_predict tokens: stage i reads stage i-1's state and draft."""
        n_predict = self.head.config.n_predict
        if k > n_predict:
            raise ValueError(
                f"k={k} drafts asked of an MLP speculator with n_predict={n_predict} stages; use "
                f"num_speculative_tokens <= {n_predict} or train a head with n_predict >= {k}"
            )
        if k <= 0:
            return Proposal.empty()
        if self.state is None:
            raise RuntimeError("MLPSpeculatorProposer.propose before start()")
        state, token = self.state, self.last_token
        tokens, qs = [], []
        for i in range(k):
            state, logits = self.head.step(i, state, torch.tensor([token], device=self.device))  # [1, D], [1, V]
            token, q = self._draw(logits[0])
            tokens.append(token)
            qs.append(q)
        q = None if self.temperature == 0 else torch.stack(qs).cpu()
        return Proposal(torch.tensor(tokens, dtype=torch.long), q)

    def accept(self, n_accepted: int, emitted: torch.Tensor, target_step) -> None:
        """New root: verify row ``n_accepted`` (it read d_n, or the last token when n = 0) and ``emitted[n]``."""
        self._root(target_step.final_hidden, n_accepted, int(emitted[n_accepted]))
