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

A static tree (``TreeShape.static``, vLLM's ``speculative_token_tree``) is expanded the same way level by level,
every node with children being fed (``static_tree``): node (r_1 .. r_d) holds the rank-r_d token of the head's
distribution after its parent. ``draft_tree`` picks the one the shape asks for.
"""

from __future__ import annotations

import torch

from draftsmith.core.proposer import Proposal
from draftsmith.core.tree import TreeShape, static_parents
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


@torch.inference_mode()
def static_tree(
    head: Eagle3Head,
    kv: HeadKV,
    hidden: torch.Tensor,
    logits: torch.Tensor,
    shape: TreeShape,
    max_depth: int,
    draft_ids: torch.Tensor,
) -> Proposal:
    """The static tree ``shape.paths`` (rank paths, breadth-first) after a context of L positions: each node at
    depth d takes the rank its path names in its parent's distribution; then ONE head step over the nodes at depth d
    that have children (fed their parents' head outputs and their own tokens at position L - 1 + d, attending to
    the prefix and their ancestors) gives the distributions of depth d + 1. Arguments as ``eagle2_tree``; nodes
    deeper than ``max_depth`` are left out.

    Raises:
        ValueError: a rank past the draft vocabulary."""
    paths, parents = static_parents(shape, max_depth)
    if not paths:
        return Proposal.empty()
    if shape.topk > logits.numel():
        raise ValueError(f"static tree ranks up to {shape.topk - 1}, past the draft vocabulary of {logits.numel()}")
    device = logits.device
    index = {p: i for i, p in enumerate(paths)}
    has_children = {p[:-1] for p in paths}
    cols = torch.zeros(len(paths), dtype=torch.long, device=device)
    level: list[tuple[int, ...]] = [()]  # the paths whose head outputs are the rows of level_hidden
    level_hidden, level_logits = hidden.reshape(1, 1, -1), logits.reshape(1, -1)
    kv.reset_chain()
    try:
        for depth in range(1, max(len(p) for p in paths) + 1):
            nodes = [p for p in paths if len(p) == depth]
            row = {p: r for r, p in enumerate(level)}
            top = level_logits.topk(max(p[-1] for p in nodes) + 1, dim=-1).indices  # [R, ranks]
            for p in nodes:
                cols[index[p]] = top[row[p[:-1]], p[-1]]
            expand = [p for p in nodes if p in has_children]
            if not expand:
                break
            rows = torch.tensor([row[p[:-1]] for p in expand], device=device)
            kv.chain = [(k.index_select(0, rows), v.index_select(0, rows)) for k, v in kv.chain]
            ids = draft_ids[cols[torch.tensor([index[p] for p in expand], device=device)]][:, None]
            position = torch.full((len(expand), 1), kv.length - 1 + depth, device=device)
            out, _ = head.step(
                level_hidden.index_select(0, rows), ids, kv, "chain", position_ids=position, with_logits=False
            )
            level, level_hidden, level_logits = expand, out, head.logits(out[:, 0])
    finally:
        kv.reset_chain()
    return Proposal(draft_ids[cols].cpu().long(), parents=parents)


def draft_tree(head, kv, hidden, logits, shape: TreeShape, max_depth: int, draft_ids) -> Proposal:
    """``static_tree`` for a static shape, else ``eagle2_tree`` (same arguments)."""
    build = static_tree if shape.is_static else eagle2_tree
    return build(head, kv, hidden, logits, shape, max_depth, draft_ids)
