"""DFlash proposer: up to k drafts from ONE drafter forward per verify step.

What it keeps and reads (as vLLM's ``v1/spec_decode/dflash.py`` does; picture in ``head.py``):

    context       x0 .. x_p            the target has read these; their aux states, fused, are the drafter's
                                       context keys/values (one cache per draft layer, only ever appended to)
    block         [x_{p+1}, m × k]     x_{p+1}: the token the target emitted last; positions p+1 .. p+1+k
    drafts        d_j = output at block index j (1..k)

After verification of [x_{p+1}, d1..dk'] with n accepted, verify rows 0..n read x_{p+1}, d1..dn: their aux states
become context entries p+1 .. p+1+n, and the new block starts with the target's token ``emitted[n]``. Rejected
drafts never enter the context, so nothing is ever cropped.

Drafts at temperature 0 are the argmax of each position's logits (q None), taken for the whole block at once (one
device-to-host copy). With temperature > 0 each draft is drawn from its position's q = logits_to_probs(processed
logits) (``core.proposer.Sampling.draw``) and q is returned:
rejection sampling only needs each d_j to be drawn from the q_j it is verified with (Leviathan et al. 2023), and
q_j here depends on the context alone, not on d_1..d_{j-1}, which is still a valid proposal. k past the trained
block (block_size - 1) is refused, as the drafter has no trained position for it.

``DFlashProposer`` drafts for one sequence; ``BatchDFlashProposer`` drafts every row of a batch in one forward.
"""

from __future__ import annotations

import torch

from draftsmith.core.proposer import BatchProposer, Proposal, Proposer, Sampling
from draftsmith.core.sampling import seeded_generator
from draftsmith.core.tree import marginal_tree
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
        if self.sampling.plain_greedy:  # every position's argmax at once: one device-to-host copy, not k
            return Proposal(logits.argmax(-1).cpu())
        tokens, qs = [], []
        for j in range(k):
            token, q = self.sampling.draw(logits[j], self.generator, tokens)
            tokens.append(token)
            qs.append(q)
        q = None if self.sampling.temperature == 0 else torch.stack(qs).float().cpu()
        return Proposal(torch.tensor(tokens, dtype=torch.long), q)

    @torch.inference_mode()
    def propose_tree(self, shape, max_depth: int) -> Proposal:
        """A best-first tree (``core.tree.best_first_tree``, DDTree), or the static tree ``shape`` names
        (``core.tree.marginal_tree``), over the per-position distributions of ONE block forward of depth
        min(num_steps, max_depth, block_size - 1); the drafts are top-k, q None."""
        depth = min(shape.num_steps, max_depth, self.head.config.max_k)
        if depth <= 0:
            return Proposal.empty()
        if self.last_token is None or not self.kv:
            raise RuntimeError("DFlashProposer.propose_tree before start()")
        ids = torch.full((1, depth + 1), self.head.config.mask_token_id, dtype=torch.long, device=self.device)
        ids[0, 0] = self.last_token
        positions = torch.arange(self.length, self.length + depth + 1, device=self.device)[None]
        logits = self.head.logits(self.head.block(ids, positions, [tuple(e) for e in self.kv])[0, 1:])  # [D, V]
        tokens, parents = marginal_tree(torch.log_softmax(logits.float(), dim=-1), shape)
        return Proposal(tokens, parents=parents)

    def accept(self, n_accepted: int, emitted: torch.Tensor, target_step) -> None:
        """Verify rows 0..n become context; the next block starts with ``emitted[n]``."""
        self._extend(target_step.aux_hidden, n_accepted + 1, int(emitted[n_accepted]))


class BatchDFlashProposer(BatchProposer):
    """DFlash over a batch: ONE drafter forward per step for every row still drafting. Row b's block is
    [last token, mask × k_b] at its own positions over its own context (rows' contexts differ in length: padded to
    the longest and masked, as are block keys past k_b + 1, so each row sees exactly the block it sees alone);
    each row then draws with its own settings and generator, as ``DFlashProposer`` does alone.

    Args:
        head: the drafter (eval mode is set), on the device where drafts are computed.

    Raises:
        ValueError: ``propose`` with some k > block_size - 1.
    """

    needs_aux_hidden = True

    def __init__(self, head: DFlashHead):
        self.head = head.eval()
        self.device = head.fc.weight.device
        self.rows: dict[int, DFlashProposer] = {}  # per-row context cache, sampling and generator

    def start(self, key, prompt_ids, first_token, target_step, sampling) -> None:
        row = DFlashProposer(self.head, sampling=sampling)
        row.start(prompt_ids, first_token, target_step)
        self.rows[key] = row

    @torch.inference_mode()
    def propose(self, keys, ks) -> list[Proposal]:
        rows = [self.rows[key] for key in keys]
        drafting = [b for b, k in enumerate(ks) if k > 0]
        out = [Proposal.empty() for _ in keys]
        if len(drafting) == 1:  # nothing to batch: the row's own forward, unpadded
            b = drafting[0]
            out[b] = rows[b].propose(ks[b])
            return out
        if not drafting:
            return out
        max_k = self.head.config.max_k
        if max(ks) > max_k:
            raise ValueError(
                f"k={max(ks)} drafts asked of a DFlash drafter trained with block_size={self.head.config.block_size}"
                f" (at most {max_k} per block); use num_speculative_tokens <= {max_k} or train a larger block"
            )
        dev, c = self.device, self.head.config
        active = [rows[b] for b in drafting]
        k_b = torch.tensor([ks[b] for b in drafting], device=dev)  # [B']
        lengths = torch.tensor([r.length for r in active], device=dev)  # [B']
        q_len, ctx_len = int(k_b.max()) + 1, int(lengths.max())
        ids = torch.full((len(active), q_len), c.mask_token_id, dtype=torch.long, device=dev)
        ids[:, 0] = torch.tensor([r.last_token for r in active], device=dev)
        positions = lengths[:, None] + torch.arange(q_len, device=dev)  # [B', Q]
        ctx_kv = []
        for layer in range(c.num_hidden_layers):
            k_pad = active[0].kv[layer][0].new_zeros(len(active), c.num_key_value_heads, ctx_len, c.head_dim)
            v_pad = torch.zeros_like(k_pad)
            for i, r in enumerate(active):
                k_pad[i, :, : r.length] = r.kv[layer][0][0]
                v_pad[i, :, : r.length] = r.kv[layer][1][0]
            ctx_kv.append((k_pad, v_pad))
        sees_ctx = torch.arange(ctx_len, device=dev)[None] < lengths[:, None]  # [B', C]
        sees_block = torch.arange(q_len, device=dev)[None] <= k_b[:, None]  # [B', Q]
        mask = torch.cat([sees_ctx, sees_block], dim=1)[:, None, None, :].expand(-1, 1, q_len, -1)
        logits = self.head.logits(self.head.block(ids, positions, ctx_kv, mask)[:, 1:])  # [B', Q-1, V]
        greedy = logits.argmax(-1).cpu() if any(r.sampling.plain_greedy for r in active) else None  # [B', Q-1]
        for i, b in enumerate(drafting):
            row, tokens, qs = rows[b], [], []
            if row.sampling.plain_greedy:
                out[b] = Proposal(greedy[i, : ks[b]].clone())
                continue
            for j in range(ks[b]):
                token, q = row.sampling.draw(logits[i, j], row.generator, tokens)
                tokens.append(token)
                qs.append(q)
            q = None if row.sampling.temperature == 0 else torch.stack(qs).float().cpu()
            out[b] = Proposal(torch.tensor(tokens, dtype=torch.long), q)
        return out

    def propose_tree(self, keys, shape, max_depths) -> list[Proposal]:
        """A DDTree per row (``DFlashProposer.propose_tree``: one block forward each)."""
        return [self.rows[key].propose_tree(shape, d) for key, d in zip(keys, max_depths)]

    def accept(self, keys, n_accepted, emitted, step) -> None:
        for b, key in enumerate(keys):
            self.rows[key].accept(n_accepted[b], emitted[b], step.row(b))

    def stop(self, key) -> None:
        self.rows.pop(key, None)
