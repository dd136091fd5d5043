"""Draft trees: their shape, their attention mask and positions, and lossless verification over them.

A tree proposal drafts N nodes after the last emitted token (the root, "node -1"): node i holds a token and
``parents[i]``, the node it follows (-1: the root). Nodes are in topological order (``parents[i] < i``), so a
root-to-node path visits increasing indices. The target reads [root, node 0 .. node N-1] in ONE forward: row 0 is
the root, row i + 1 is node i, each at position ``L + depth`` (L: the root's position) and attending to its
ancestors and itself only (``ancestor_mask``), as SpecInfer (Miao et al. 2024, "tree attention") and EAGLE-2
(Li et al. 2024) verify trees; a chain is the tree with ``parents[i] = i - 1``.

Verification walks down from the root: at each node, the next token (the target's argmax, or a rejection-sampled
token) either matches one of its children, which is then accepted and the walk goes on from it, or it is emitted
as the step's last token. The accepted path is a root-to-node chain; the target's and the drafter's caches keep
its entries only. Counters (``SpecStats``) count one draft of N nodes per step (``num_draft_tokens``: the tokens
the step verified, as vLLM's ``vllm/v1/spec_decode/metrics.py`` counts a draft's tokens), the accepted path's
length as the accepted tokens, and per depth d the steps whose path reached depth d + 1; SGLang reports
``accept_length`` = τ - 1 per step.
"""

from __future__ import annotations

import heapq

import torch

from draftsmith.core.sampling import residual_probs, sample
from draftsmith.core.tree_shape import TreeShape  # noqa: F401 - re-exported: the tree's budget


def check_parents(parents: torch.Tensor, n: int | None = None) -> torch.Tensor:
    """``parents`` as int64 ``[N]`` on the CPU, checked topological: -1 <= parents[i] < i.

    Raises:
        ValueError: not 1-D, another length than ``n``, or a parent that is not an earlier node."""
    parents = torch.as_tensor(parents, dtype=torch.long).cpu()
    if parents.dim() != 1 or (n is not None and parents.numel() != n):
        raise ValueError(f"tree parents must be [N] = [{n}], got shape {tuple(parents.shape)}")
    index = torch.arange(parents.numel())
    if bool(((parents < -1) | (parents >= index)).any()):
        bad = int(((parents < -1) | (parents >= index)).nonzero()[0])
        raise ValueError(
            f"tree parents must be topological (-1 <= parents[i] < i): node {bad} has parent {int(parents[bad])}"
        )
    return parents


def depths(parents: torch.Tensor) -> torch.Tensor:
    """``[N]`` int64: each node's depth (a child of the root: 1)."""
    out = torch.zeros(parents.numel(), dtype=torch.long)
    for i, p in enumerate(parents.tolist()):
        out[i] = 1 if p < 0 else out[p] + 1
    return out


def ancestor_mask(parents: torch.Tensor) -> torch.Tensor:
    """``[N + 1, N + 1]`` bool: row r (0 the root, i + 1 node i) attends to column c when c is r's ancestor or r.

    Built row by row from the parent's row (parents come first), so it costs O(N^2)."""
    n = parents.numel()
    mask = torch.zeros(n + 1, n + 1, dtype=torch.bool)
    mask[:, 0] = True
    for i, p in enumerate(parents.tolist()):
        mask[i + 1] = mask[p + 1]
        mask[i + 1, i + 1] = True
    return mask


def path_tokens(tokens: torch.Tensor, parents: torch.Tensor, node: int) -> list[int]:
    """The tokens on the path root -> ``node`` (``node`` included; -1: the root, no token)."""
    out = []
    while node >= 0:
        out.append(int(tokens[node]))
        node = int(parents[node])
    return out[::-1]


def _children(parents: torch.Tensor) -> dict[int, list[int]]:
    """Node -> its children in index order (-1: the root's)."""
    kids: dict[int, list[int]] = {}
    for i, p in enumerate(parents.tolist()):
        kids.setdefault(p, []).append(i)
    return kids


def verify_tree_greedy(
    tokens: torch.Tensor, parents: torch.Tensor, target_logits: torch.Tensor
) -> tuple[torch.Tensor, list[int]]:
    """Greedy tree verification: follow the child whose token is the target's argmax, as long as there is one.

    Args:
        tokens: ``[N]`` int64 node tokens. parents: ``[N]`` (``check_parents``).
        target_logits: ``[N + 1, V]``: row 0 follows the root, row i + 1 node i (logits or probabilities).

    Returns:
        ``(emitted, path)``: ``path`` the accepted nodes root-down (n = len(path)), ``emitted`` ``[n + 1]`` int64
        their tokens followed by the target's argmax after the last of them. Siblings hold distinct tokens in
        every tree draftsmith drafts; with duplicates the first in index order is followed.

    Raises:
        ValueError: shapes inconsistent with ``[N]`` / ``[N + 1, V]``.
    """
    n = tokens.numel()
    parents = check_parents(parents, n)
    if target_logits.dim() != 2 or target_logits.shape[0] != n + 1:
        raise ValueError(f"target rows must be [N+1, V] = [{n + 1}, V], got shape {tuple(target_logits.shape)}")
    argmax = target_logits.argmax(dim=-1).tolist()  # [N+1]
    kids, toks = _children(parents), tokens.tolist()
    node, path = -1, []
    while True:
        want = argmax[node + 1]
        nxt = next((c for c in kids.get(node, ()) if toks[c] == want), None)
        if nxt is None:
            return torch.tensor([toks[c] for c in path] + [want], dtype=torch.long), path
        path.append(nxt)
        node = nxt


def verify_tree_sampling(
    tokens: torch.Tensor,
    parents: torch.Tensor,
    p: torch.Tensor,
    generator: torch.Generator | None = None,
) -> tuple[torch.Tensor, list[int]]:
    """Tree rejection sampling with deterministic drafts: the emitted tokens follow the target's p exactly.

    The drafts are deterministic (a drafter's top-k children, q one-hot), as SGLang verifies EAGLE trees
    (``tree_speculative_sampling_target_only``). At a node whose target distribution is p_u, its children
    c_1, c_2, ... are tried in order, each by Leviathan et al.'s rule with q = one-hot(c_j): accept c_j with
    probability r(c_j) (r starts as p_u), else r <- norm(max(r - one-hot(c_j), 0)) = r with c_j removed. This
    is SpecInfer's multi-step speculative sampling (Miao et al. 2024, Algorithm 2) for one-hot proposals:
    after the children, the token chosen at the node (an accepted child, or a draw from the last residual r) is
    distributed exactly as p_u. An accepted child's own children are then judged against the target's
    distribution after it, so the whole emitted chunk follows the target.

    Args:
        tokens: ``[N]`` int64. parents: ``[N]``. p: ``[N + 1, V]`` target probabilities (row 0 after the root,
            row i + 1 after node i; temperature / top-k / top-p already applied).
        generator: for the uniforms and the final draw (on p's device).

    Returns:
        ``(emitted [n + 1] int64, path)`` as ``verify_tree_greedy``.

    Raises:
        ValueError: inconsistent shapes.
    """
    n = tokens.numel()
    parents = check_parents(parents, n)
    if p.dim() != 2 or p.shape[0] != n + 1:
        raise ValueError(f"target rows must be [N+1, V] = [{n + 1}, V], got shape {tuple(p.shape)}")
    p = p.float()
    kids, toks = _children(parents), tokens.tolist()
    node, path = -1, []
    while True:
        r = p[node + 1]
        children = kids.get(node, ())
        uniforms = torch.rand(len(children), generator=generator, device=p.device).tolist() if children else []
        nxt = None
        for c, u in zip(children, uniforms):
            if u < float(r[toks[c]]):
                nxt = c
                break
            r = residual_probs(r, torch.nn.functional.one_hot(torch.tensor(toks[c]), r.numel()).to(r))
        if nxt is None:
            last = int(sample(r, generator))
            return torch.tensor([toks[c] for c in path] + [last], dtype=torch.long), path
        path.append(nxt)
        node = nxt


def best_first_tree(logprobs: torch.Tensor, shape: TreeShape) -> tuple[torch.Tensor, torch.Tensor]:
    """A tree from per-position draft distributions that do not depend on the path (a block drafter's marginals:
    DFlash), best first, as DDTree builds draft trees over a block drafter's per-position marginals.

    A node is a path of ranks (r_1 .. r_d): token r_d of position d's top-k, scored sum_i logprobs[i, token]; the
    tree holds the ``shape.num_nodes`` best paths with d <= ``logprobs.shape[0]`` and every r_i < ``shape.topk``.
    They are popped from a heap: a node's first child (rank 0, one position deeper) and its next sibling (rank + 1)
    score no higher than it, so both are pushed when it is popped, and the tree comes out topological with
    siblings in rank order (``path_ranks`` gives the drafter's ranks, as for an EAGLE-2 tree).

    Args:
        logprobs: ``[D, V]`` log-probabilities of positions 1..D (any float dtype; D >= 1).
        shape: topk (children per node), num_draft_tokens - 1 (nodes); its num_steps is the caller's cap on D.

    Returns:
        ``(tokens [N], parents [N])`` int64 on the CPU.
    """
    depth = logprobs.shape[0]
    top_lp, top_ids = logprobs.float().topk(min(shape.topk, logprobs.shape[1]), dim=-1)  # [D, topk]
    top_lp, top_ids = top_lp.tolist(), top_ids.tolist()
    heap = [(-top_lp[0][0], 0, 0, -1, 0.0)]  # (-score, tie, rank, parent node, parent score); depth from parent
    node_depth: list[int] = []
    tokens: list[int] = []
    parents: list[int] = []
    tie = 1
    while heap and len(tokens) < shape.num_nodes:
        neg, _, rank, parent, base = heapq.heappop(heap)
        d = 0 if parent < 0 else node_depth[parent] + 1  # 0-based position of this node
        node = len(tokens)
        tokens.append(top_ids[d][rank])
        parents.append(parent)
        node_depth.append(d)
        if rank + 1 < len(top_lp[d]):  # next sibling
            heapq.heappush(heap, (-(base + top_lp[d][rank + 1]), tie, rank + 1, parent, base))
            tie += 1
        if d + 1 < depth:  # first child
            heapq.heappush(heap, (neg - top_lp[d + 1][0], tie, 0, node, -neg))
            tie += 1
    return torch.tensor(tokens, dtype=torch.long), torch.tensor(parents, dtype=torch.long)


def static_parents(shape: TreeShape, max_depth: int | None = None) -> tuple[list[tuple[int, ...]], torch.Tensor]:
    """A static tree's nodes at most ``max_depth`` deep (its rank paths, breadth-first) and their parents ``[N]``."""
    if shape.paths is None:
        raise ValueError("static_parents needs a static tree (TreeShape.static)")
    paths = [p for p in shape.paths if max_depth is None or len(p) <= max_depth]
    index = {p: i for i, p in enumerate(paths)}
    return paths, torch.tensor([index[p[:-1]] if len(p) > 1 else -1 for p in paths], dtype=torch.long)


def marginal_tree(logprobs: torch.Tensor, shape: TreeShape) -> tuple[torch.Tensor, torch.Tensor]:
    """A tree over per-position draft distributions (``best_first_tree``'s input): a dynamic shape gives the
    best-first tree; a static one (``TreeShape.static``) puts at node (r_1 .. r_d) the rank-r_d token of position d.

    Returns:
        ``(tokens [N], parents [N])`` int64 on the CPU (static nodes deeper than ``logprobs.shape[0]`` dropped)."""
    if shape.paths is None:
        return best_first_tree(logprobs, shape)
    paths, parents = static_parents(shape, logprobs.shape[0])
    top = logprobs.float().topk(min(shape.topk, logprobs.shape[1]), dim=-1).indices.tolist()  # [D, topk]
    return torch.tensor([top[len(p) - 1][p[-1]] for p in paths], dtype=torch.long), parents


def path_ranks(parents: torch.Tensor, path: list[int]) -> tuple[int, ...]:
    """The accepted ``path``'s sibling index at each depth (node c's index among its parent's children, in index
    order). In an EAGLE-2 tree a node's siblings are its parent's top-k in rank order, so these are the drafter's
    ranks: the path as vLLM's ``speculative_token_tree`` names a node (``(0,)`` the top-1 child, ``(0, 1)`` its
    second child, ...)."""
    kids = _children(check_parents(parents))
    return tuple(kids[int(parents[c])].index(c) for c in path)


def best_static_tree(accepted_paths: dict[tuple[int, ...], int], num_nodes: int) -> list[tuple[int, ...]]:
    """The static tree of at most ``num_nodes`` nodes that would have accepted the most tokens on the steps
    counted in ``accepted_paths`` (rank path -> steps whose accepted path went through it; ``SpecStats``): the
    ``num_nodes`` most-passed rank paths. A prefix is passed at least as often as its extensions, and ties keep
    the shorter, so the set is closed under prefixes: a tree. Returned breadth-first, as vLLM's
    ``speculative_token_tree`` lists its nodes. Only paths a drafted tree contained are counted, so the tree's
    expected τ (``static_tree_tau``) is a lower bound on what it would accept."""
    ranked = sorted(accepted_paths, key=lambda path: (-accepted_paths[path], len(path), path))[:num_nodes]
    return sorted(ranked, key=lambda path: (len(path), path))


def static_tree_tau(accepted_paths: dict[tuple[int, ...], int], tree: list[tuple[int, ...]], num_drafts: int) -> float:
    """τ the static ``tree`` would have had on the counted steps: 1 + (paths passed inside it) / drafts."""
    return 1.0 + sum(accepted_paths.get(path, 0) for path in tree) / num_drafts if num_drafts else 1.0


def tree_positions(parents: torch.Tensor, start: int) -> torch.Tensor:
    """``[N + 1]`` int64 positions of [root, nodes]: ``start`` for the root, ``start + depth`` for a node."""
    return torch.cat([torch.zeros(1, dtype=torch.long), depths(parents)]) + start
