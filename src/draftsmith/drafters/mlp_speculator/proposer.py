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
has no stage to draft token n_predict + 1 with. Drafts are drawn by ``core.proposer.Sampling.draw``: greedy
drafts (temperature 0) are argmax with q None; with temperature > 0 each draft is sampled from q =
logits_to_probs(processed stage logits) and q is returned, as rejection sampling requires (the request's
processors, ``core.processors``, read the drafts of the chain so far). ``MLPSpeculatorProposer`` drafts for
one sequence; ``BatchMLPSpeculatorProposer`` runs each stage once for the whole batch.
"""

from __future__ import annotations

import torch

from draftsmith.core.proposer import BatchProposer, Proposal, Proposer, Sampling
from draftsmith.core.sampling import seeded_generator
from draftsmith.drafters.mlp_speculator.head import MLPSpeculator


class MLPSpeculatorProposer(Proposer):
    """Drafts with an ``MLPSpeculator`` whose metadata was already checked against the target.

    Args:
        head: the speculator (eval mode is set), on the device where its drafts are computed.
        temperature: 0 -> argmax drafts (q None); > 0 -> drafts sampled from q = logits_to_probs(...).
        top_k, top_p: applied to the draft distribution when sampling. seed: the sampling generator's seed.
        sampling: a ``core.proposer.Sampling`` instead of temperature / top_k / top_p / seed (min_p and the
            request's processors included).

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
        sampling: Sampling | None = None,
    ):
        self.sampling = sampling if sampling is not None else Sampling(temperature, top_k, top_p, seed)
        if self.sampling.temperature < 0:
            raise ValueError(f"temperature must be >= 0, got {self.sampling.temperature}")
        self.head = head.eval()
        self.device = head.proj[0].weight.device
        self.generator = seeded_generator(self.device, self.sampling.seed)
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

    def _draw(self, logits: torch.Tensor, drafted: list[int]) -> tuple[int, torch.Tensor | None]:
        """One draft from stage logits [V] after this chain's ``drafted`` tokens: (token id, q [V] or None when
        greedy), by ``Sampling.draw``."""
        return self.sampling.draw(logits, self.generator, drafted)

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
            token, q = self._draw(logits[0], tokens)
            tokens.append(token)
            qs.append(q)
        q = None if self.sampling.temperature == 0 else torch.stack(qs).cpu()
        return Proposal(torch.tensor(tokens, dtype=torch.long), q)

    def accept(self, n_accepted: int, emitted: torch.Tensor, target_step) -> None:
        """New root: verify row ``n_accepted`` (it read d_n, or the last token when n = 0) and ``emitted[n]``."""
        self._root(target_step.final_hidden, n_accepted, int(emitted[n_accepted]))


class BatchMLPSpeculatorProposer(BatchProposer):
    """The MLP speculator over a batch: stage i runs ONCE for every row still drafting (``[B', H]`` states), each
    row then draws its token with its own settings and generator, as ``MLPSpeculatorProposer`` does alone.

    Args:
        head: the speculator (eval mode is set), on the device where drafts are computed.

    Raises:
        ValueError: ``propose`` with some k > ``head.config.n_predict``.
    """

    needs_final_hidden = True

    def __init__(self, head: MLPSpeculator):
        self.head = head.eval()
        self.device = head.proj[0].weight.device
        self.rows: dict[int, MLPSpeculatorProposer] = {}  # per-row state, sampling and generator

    def start(self, key, prompt_ids, first_token, target_step, sampling) -> None:
        row = MLPSpeculatorProposer(self.head, sampling=sampling)
        row.start(prompt_ids, first_token, target_step)
        self.rows[key] = row

    @torch.inference_mode()
    def propose(self, keys, ks) -> list[Proposal]:
        n_predict = self.head.config.n_predict
        if max(ks, default=0) > n_predict:
            raise ValueError(
                f"k={max(ks)} drafts asked of an MLP speculator with n_predict={n_predict} stages; use "
                f"num_speculative_tokens <= {n_predict} or train a head with n_predict >= {max(ks)}"
            )
        rows = [self.rows[key] for key in keys]
        drafting = [b for b, k in enumerate(ks) if k > 0]
        tokens: list[list[int]] = [[] for _ in keys]
        qs: list[list[torch.Tensor]] = [[] for _ in keys]
        if drafting:
            state = torch.cat([rows[b].state for b in drafting])  # [B', H]
            last = torch.tensor([rows[b].last_token for b in drafting], device=self.device)
            for i in range(max(ks[b] for b in drafting)):
                state, logits = self.head.step(i, state, last)  # [B', D], [B', V]
                drawn = []
                for j, b in enumerate(drafting):
                    if i < ks[b]:
                        token, q = rows[b]._draw(logits[j], tokens[b])
                        tokens[b].append(token)
                        qs[b].append(q)
                    drawn.append(tokens[b][-1])  # rows already done keep feeding their last draft (unused)
                last = torch.tensor(drawn, device=self.device)
        out = []
        for b in range(len(keys)):
            q = None if rows[b].sampling.temperature == 0 or not qs[b] else torch.stack(qs[b]).cpu()
            out.append(Proposal(torch.tensor(tokens[b], dtype=torch.long), q))
        return out

    def accept(self, keys, n_accepted, emitted, step) -> None:
        for b, key in enumerate(keys):
            self.rows[key].accept(n_accepted[b], emitted[b], step.row(b))

    def stop(self, key) -> None:
        self.rows.pop(key, None)
