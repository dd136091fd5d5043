"""EAGLE-2 dynamic draft trees from an EAGLE-3 head (Li et al. 2024, "EAGLE-2: Faster Inference of Language
Models with Dynamic Draft Trees"; served so by SGLang, ``sglang/srt/speculative/eagle_worker.py`` ``draft_forward``
with ``eagle_utils.select_top_k_tokens`` / ``organize_draft_results``).

Expansion, for a ``core.tree.TreeShape`` (topk, num_steps, num_draft_tokens):

    depth 1       the topk likeliest tokens of the head's distribution after the context (the prefix step's
                  logits): the first frontier; a node's score is its path's summed draft log-probability
    depth d + 1   ONE head step over the topk frontier nodes (each fed its parent's head output and its own
                  token at position L - 1 + d, attending to the context prefix and to its own ancestors'
                  keys only), topk children each: topk^2 candidates, scored parent score + log q(child);
                  the topk best become the next frontier (their ancestors' keys reordered to them, as a
                  beam search reorders its cache)
    selection     the ``num_draft_tokens - 1`` best-scored candidates of all depths; a child never scores
                  above its parent (log q <= 0) and ties keep the earlier (the parent), so the selection is
                  closed under ancestors: a tree

The drafts are the head's top-k, not samples, at every temperature: tree verification is then lossless with
one-hot q (``core.tree.verify_tree_sampling``), as SGLang's ``tree_speculative_sampling_target_only``. The
scores use the head's raw distribution (temperature 1, no request processors); verification applies the
request's settings.
"""

from __future__ import annotations

import torch

from draftsmith.core.proposer import Proposal
from draftsmith.core.tree import TreeShape
from draftsmith.drafters.eagle3.head import Eagle3Head, HeadKV


@torch.inference_mode()
def eagle2_tree(
    head: Eagle3Head,
    kv: HeadKV,
    hidden: torch.Tensor,
    logits: torch.Tensor,
    shape: TreeShape,
    max_depth: int,
    draft_ids: torch.Tensor,
) -> Proposal:
    """One EAGLE-2 tree after a context of L positions (module docstring).

    Args:
        head: the EAGLE-3 head (eval mode, the target's embedding bound).
        kv: the head's memory of ONE sequence: its prefix of L entries (a batch dimension of 1; ``HeadKV`` or a
            one-row ``RaggedHeadKV``), no chain (``reset_chain``); the chain it adds is dropped before returning.
        hidden: ``[H]`` (or ``[1, 1, H]``) the head's output at the last prefix entry; logits: ``[Vd]`` its
            draft-vocab logits (depth 1 is drawn from them).
        shape: the tree's budget. max_depth: the row's depth limit (0: an empty proposal).
        draft_ids: ``[Vd]`` the target id of each draft-vocab column (``head.draft_to_target``).

    Returns:
        ``Proposal(tokens [N], parents=[N])``, N <= ``shape.num_nodes``, nodes ordered by creation (depth first
        expanded first), so parents precede children; q None.

    Raises:
        RuntimeError: a selection that is not closed under ancestors (cannot happen for finite scores).
    """
    depth_limit = min(shape.num_steps, max_depth)
    if depth_limit <= 0:
        return Proposal.empty()
    device = logits.device
    topk = min(shape.topk, logits.numel())
    hidden = hidden.reshape(1, 1, -1)
    scores, columns = torch.log_softmax(logits.float(), dim=-1).topk(topk)  # [topk]
    tokens, parents, all_scores = [columns], [torch.full((topk,), -1, device=device)], [scores]
    frontier = torch.arange(topk, device=device)  # candidate index of each frontier node
    frontier_cols, frontier_scores = columns, scores
    frontier_hidden = hidden.expand(topk, 1, hidden.shape[-1])
    count = topk
    kv.reset_chain()
    try:
        for depth in range(1, depth_limit):
            position = torch.full((frontier.numel(), 1), kv.length - 1 + depth, device=device)
            out, _ = head.step(
                frontier_hidden,
                draft_ids[frontier_cols][:, None],
                kv,
                "chain",
                position_ids=position,
                with_logits=False,
            )
            child_scores, child_cols = torch.log_softmax(head.logits(out[:, 0]).float(), dim=-1).topk(topk)
            total = (frontier_scores[:, None] + child_scores).reshape(-1)  # [F * topk]
            tokens.append(child_cols.reshape(-1))
            parents.append(frontier.repeat_interleave(topk))
            all_scores.append(total)
            best = total.topk(min(topk, total.numel())).indices  # the next frontier, by score
            rows = best // topk  # their parents' frontier rows
            kv.chain = [(k.index_select(0, rows), v.index_select(0, rows)) for k, v in kv.chain]
            frontier_hidden = out.index_select(0, rows)
            frontier = count + best
            frontier_cols, frontier_scores = child_cols.reshape(-1)[best], total[best]
            count += total.numel()
    finally:
        kv.reset_chain()
    cols, par, sc = torch.cat(tokens), torch.cat(parents).long(), torch.cat(all_scores)
    keep = torch.sort(sc, descending=True, stable=True).indices[: shape.num_nodes]  # ties: the earlier first
    keep = torch.sort(keep).values  # creation order: parents before children
    new_index = torch.full((cols.numel() + 1,), -2, dtype=torch.long, device=device)  # slot 0: the root (-1)
    new_index[0] = -1
    new_index[keep + 1] = torch.arange(keep.numel(), device=device)
    node_parents = new_index[par[keep] + 1]
    if bool((node_parents == -2).any()):
        raise RuntimeError("EAGLE-2 selection is not closed under ancestors (non-finite draft scores?)")
    return Proposal(draft_ids[cols[keep]].cpu().long(), parents=node_parents.cpu())
