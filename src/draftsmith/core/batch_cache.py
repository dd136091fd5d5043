"""KV cache of a batch of sequences, each with its own length: slots, a validity mask, per-row rollback.

The single-sequence cache (``cache.py``) rolls back by cropping. A batch cannot crop one row, so here the
cache is a grid of slots, one tensor per layer ``[B, kv_heads, S, head_dim]``, and a boolean ``valid [B, S]``
says which slots hold a token of that row:

    slot           0    1    2    3    4    5    6    7
    row 0 (seq a)  x0   x1   x2   t1   d1   d2   ·    ·      · = a hole: padding, or a rejected draft
    row 1 (seq b)  y0   y1   ·    ·    t1   d1   d2   d3

A forward over ``T`` new tokens per row writes slots ``S..S+T-1`` of every row (rows with fewer tokens are
padded); a row's attention reads its valid slots only (``attention_mask``); RoPE positions are per row
(``positions``: the row's token count, not the slot index). Rolling a row back marks its slots invalid
(``commit``); slots invalid in every row at the end are cut (``trim``), so a batch of one never has a hole and
runs with no mask at all, exactly as the single-sequence path. When holes exceed half of the slots, ``compact``
moves each row's tokens to the left. Rows join (``merge``, from a newcomer prefilled in its own one-row cache:
``add_empty_row``, then forwards) and leave (``remove_rows``: the last row fills the hole) between steps; both
copy the rows that move only.

Layers write in place into buffers with spare row and slot capacity (``_SlotLayer``), where transformers'
``DynamicLayer`` concatenates the whole cache at every forward.

Supported: full-attention layers, and sliding-window layers, whose window is applied in the mask (all keys are
kept; ``attention_mask`` returns one mask per layer type). Linear-attention (recurrent) layers cannot be rolled
back per row and are refused.
"""

from __future__ import annotations

from typing import Sequence

import torch
from transformers.cache_utils import Cache, DynamicLayer

from draftsmith.core.tree import ancestor_mask, tree_positions


class _SlotLayer(DynamicLayer):
    """One layer's keys/values in buffers ``[row capacity, kv_heads, slot capacity, D]``: the first ``rows`` rows and
    ``filled`` slots are in use (``keys`` / ``values`` are views of them). ``update`` writes slots ``S..S+T-1`` in
    place; rows join by ``append_rows`` (one copy of the new rows) and leave by ``swap_remove`` (the last row moves
    into the hole: one row copied), so a batch's membership changes without copying the whole cache."""

    is_sliding = False  # the window (if any) lives in the mask; all slots are kept

    def __init__(self):
        super().__init__()
        self.filled = 0
        self.rows = 0
        self.k_buf: torch.Tensor | None = None
        self.v_buf: torch.Tensor | None = None

    def _reserve(self, like_k: torch.Tensor, like_v: torch.Tensor, rows: int, slots: int) -> None:
        """Capacity for ``rows`` x ``slots`` (grown by doubling; the used part is copied)."""
        have_rows = 0 if self.k_buf is None else self.k_buf.shape[0]
        have_slots = 0 if self.k_buf is None else self.k_buf.shape[2]
        if rows <= have_rows and slots <= have_slots:
            return
        new_rows = have_rows if rows <= have_rows else max(rows, 2 * have_rows)
        new_slots = have_slots if slots <= have_slots else max(slots, 2 * have_slots, 64)
        bufs = []
        for old, like in ((self.k_buf, like_k), (self.v_buf, like_v)):
            buf = like.new_empty(new_rows, like.shape[1], new_slots, like.shape[3])
            if old is not None and self.rows and self.filled:
                buf[: self.rows, :, : self.filled] = old[: self.rows, :, : self.filled]
            bufs.append(buf)
        self.k_buf, self.v_buf = bufs

    def set(self, keys: torch.Tensor, values: torch.Tensor) -> None:
        """Replace the contents by ``keys`` / ``values`` ``[B, kv_heads, S, D]`` (room for S / 2 + 64 more slots)."""
        self.k_buf = self.v_buf = None
        self.rows = self.filled = 0
        self.is_initialized = True
        self.device, self.dtype = keys.device, keys.dtype
        self._reserve(keys, values, keys.shape[0], keys.shape[2] * 3 // 2 + 64)
        self.k_buf[: keys.shape[0], :, : keys.shape[2]] = keys
        self.v_buf[: values.shape[0], :, : values.shape[2]] = values
        self.rows, self.filled = keys.shape[0], keys.shape[2]
        self._views()

    def _views(self) -> None:
        self.keys = self.k_buf[: self.rows, :, : self.filled]
        self.values = self.v_buf[: self.rows, :, : self.filled]

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        if not self.is_initialized or self.k_buf is None:
            self.is_initialized = True
            self.device, self.dtype = key_states.device, key_states.dtype
            self.rows = key_states.shape[0]
        if key_states.shape[0] != self.rows:
            raise ValueError(f"a forward over {key_states.shape[0]} rows on a cache of {self.rows}")
        t = key_states.shape[2]
        self._reserve(key_states, value_states, self.rows, self.filled + t)
        self.k_buf[: self.rows, :, self.filled : self.filled + t] = key_states
        self.v_buf[: self.rows, :, self.filled : self.filled + t] = value_states
        self.filled += t
        self._views()
        return self.keys, self.values

    def append_rows(self, keys: torch.Tensor, values: torch.Tensor) -> None:
        """Add rows ``keys`` / ``values`` ``[n, kv_heads, S', D]`` (S' <= the filled slots; the rest are zeroed)."""
        n, s = keys.shape[0], keys.shape[2]
        if s > self.filled:
            raise ValueError(f"rows of {s} slots cannot join a cache of {self.filled} (pad the cache first)")
        self._reserve(keys, values, self.rows + n, self.filled)
        for buf, new in ((self.k_buf, keys), (self.v_buf, values)):
            buf[self.rows : self.rows + n, :, :s] = new
            buf[self.rows : self.rows + n, :, s : self.filled] = 0  # holes hold finite values
        self.rows += n
        self._views()

    def swap_remove(self, row: int) -> None:
        """Drop ``row``: the last row takes its place."""
        last = self.rows - 1
        if row != last:
            self.k_buf[row, :, : self.filled] = self.k_buf[last, :, : self.filled]
            self.v_buf[row, :, : self.filled] = self.v_buf[last, :, : self.filled]
        self.rows -= 1
        self._views()

    def get_seq_length(self) -> int:
        return self.filled

    def crop(self, tokens_to_remove: int) -> None:
        if tokens_to_remove > 0:
            raise ValueError("crop takes a negative count (tokens to drop from the end)")
        self.filled = max(0, self.filled + tokens_to_remove)
        if self.k_buf is not None:
            self._views()

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        """Keep the rows ``indices``, in that order (transformers' API; the runtime uses ``swap_remove``)."""
        if self.k_buf is not None:
            self.set(self.keys[indices], self.values[indices])


def _layer_windows(config) -> list[int | None]:
    """Per decoder layer: its sliding window (tokens), or None for full attention.

    Raises:
        ValueError: a layer type that is neither full nor sliding attention (linear attention / recurrent)."""
    c = config.get_text_config() if hasattr(config, "get_text_config") else config
    n = int(c.num_hidden_layers)
    window = getattr(c, "sliding_window", None)
    types = getattr(c, "layer_types", None)
    if types is None:
        return [window if window else None] * n
    out = []
    for kind in types[:n]:
        if kind == "full_attention":
            out.append(None)
        elif kind in ("sliding_attention", "chunked_attention") and window:
            out.append(int(window))
        else:
            raise ValueError(
                f"layer type {kind!r} cannot be rolled back per row: the batched runtime serves attention-only "
                "targets (full or sliding-window attention)"
            )
    return out


class BatchKVCache:
    """KV cache of B sequences of different lengths (module docstring).

    Args:
        config: the model's ``PretrainedConfig`` (layer count and types; sliding windows).

    Attributes:
        hf: the transformers ``Cache`` to pass as ``model(..., cache=...)``.
        valid: ``[B, S]`` bool, slots holding a token of the row. slot_pos: ``[B, S]`` int64, each slot's position.
        lengths: ``[B]`` tokens per row (the position of its next token).

    Raises:
        ValueError: a layer type that cannot be rolled back per row (``_layer_windows``).
    """

    def __init__(self, config):
        self.windows = _layer_windows(config)
        self.hf = Cache(layer_class_to_replicate=_SlotLayer)
        self.valid = torch.zeros(0, 0, dtype=torch.bool)
        self.slot_pos = torch.zeros(0, 0, dtype=torch.long)
        self.lengths: list[int] = []
        self._pending: tuple[int, list[int]] | None = None

    # -- shape ------------------------------------------------------------------------------------------
    @property
    def batch_size(self) -> int:
        """B, the rows."""
        return len(self.lengths)

    @property
    def slots(self) -> int:
        """S, slots per row (valid or not)."""
        return int(self.valid.shape[1])

    def has_holes(self) -> bool:
        """True when some row has an invalid slot (the forward then needs ``attention_mask``)."""
        return bool(self.valid.numel()) and not bool(self.valid.all())

    # -- rows join and leave ----------------------------------------------------------------------------
    def add_empty_row(self) -> int:
        """Append a row with no tokens yet (its prefill is the next forward); returns its row index.

        Raises:
            ValueError: the cache already holds tokens (rows join through ``merge``, from their own prefill)."""
        if self.slots:
            raise ValueError("add empty rows to an empty cache only; merge a prefilled cache instead")
        self.lengths.append(0)
        self.valid = torch.zeros(self.batch_size, 0, dtype=torch.bool)
        self.slot_pos = torch.zeros(self.batch_size, 0, dtype=torch.long)
        return self.batch_size - 1

    def merge(self, other: "BatchKVCache") -> list[int]:
        """Append ``other``'s rows (e.g. a newcomer prefilled in its own cache); returns their row indices.

        Raises:
            ValueError: ``other`` has a row with no token, or another layer count."""
        if min(other.lengths, default=1) < 1:
            raise ValueError("cannot merge a row with no tokens (prefill it first)")
        if not self.batch_size:
            self.hf, self.valid, self.slot_pos, self.lengths = (
                other.hf,
                other.valid,
                other.slot_pos,
                list(other.lengths),
            )
            other._reset()
            return list(range(self.batch_size))
        if len(other.hf.layers) != len(self.hf.layers):
            raise ValueError(f"cannot merge caches of {len(other.hf.layers)} and {len(self.hf.layers)} layers")
        s = max(self.slots, other.slots)
        self._pad_slots(s)
        for dst, src in zip(self.hf.layers, other.hf.layers):
            dst.append_rows(src.keys, src.values)
        first, extra = self.batch_size, s - other.slots
        self.valid = torch.cat([self.valid, torch.nn.functional.pad(other.valid, (0, extra))])
        self.slot_pos = torch.cat([self.slot_pos, torch.nn.functional.pad(other.slot_pos, (0, extra))])
        self.lengths += other.lengths
        other._reset()
        return list(range(first, self.batch_size))

    def remove_rows(self, rows: list[int]) -> list[int]:
        """Drop the rows ``rows`` (indices): each hole is filled by the batch's last row (one row copied, not the
        cache). Returns the new row order as old indices: row i now holds what was row ``order[i]``.

        Raises:
            IndexError: a row index outside the batch."""
        order = list(range(self.batch_size))
        for row in sorted(set(rows), reverse=True):  # descending: the last row is always one that stays
            if not 0 <= row < len(order):
                raise IndexError(f"row {row} is not in a batch of {len(order)}")
            last = len(order) - 1
            for layer in self.hf.layers:
                if layer.k_buf is not None:
                    layer.swap_remove(row)
            if row != last:
                self.valid[row], self.slot_pos[row] = self.valid[last], self.slot_pos[last]
                self.lengths[row], order[row] = self.lengths[last], order[last]
            order.pop()
            self.lengths.pop()
        self.valid, self.slot_pos = self.valid[: len(order)], self.slot_pos[: len(order)]
        if not order:
            self._reset()
        else:
            self.trim()
        return order

    def _reset(self) -> None:
        self.hf = Cache(layer_class_to_replicate=_SlotLayer)
        self.valid = torch.zeros(0, 0, dtype=torch.bool)
        self.slot_pos = torch.zeros(0, 0, dtype=torch.long)
        self.lengths = []

    def _pad_slots(self, s: int) -> None:
        """Grow every row to ``s`` slots (holes at the end)."""
        extra = s - self.slots
        if extra <= 0 or not self.batch_size:
            if not self.batch_size:
                self.valid = torch.zeros(0, s, dtype=torch.bool)
                self.slot_pos = torch.zeros(0, s, dtype=torch.long)
            return
        for layer in self.hf.layers:
            layer.update(
                layer.keys.new_zeros(layer.keys.shape[0], layer.keys.shape[1], extra, layer.keys.shape[3]),
                layer.values.new_zeros(layer.values.shape[0], layer.values.shape[1], extra, layer.values.shape[3]),
            )
        b = self.batch_size
        self.valid = torch.cat([self.valid, torch.zeros(b, extra, dtype=torch.bool)], dim=1)
        self.slot_pos = torch.cat([self.slot_pos, torch.zeros(b, extra, dtype=torch.long)], dim=1)

    # -- a forward over new tokens ----------------------------------------------------------------------
    def begin(
        self, counts: list[int], trees: "Sequence[torch.Tensor | None] | None" = None
    ) -> tuple[torch.Tensor, torch.Tensor | dict | None]:
        """Prepare a forward that reads ``counts[b]`` (>= 1) new tokens of row b, padded to T = max(counts).

        ``trees[b]`` (optional): row b's new tokens are [root, N tree nodes] with node i following node
        ``trees[b][i]`` (``core.tree``; -1 the root, counts[b] = N + 1): they read at positions
        ``lengths[b] + depth`` and attend to the row's cache, their ancestors and themselves
        (``core.tree.ancestor_mask``) instead of every earlier new token.

        Returns:
            ``(position_ids [B, T], attention_mask)``: the mask is None when no row has a hole and every row
            reads T tokens in a chain (transformers builds the causal mask itself, as for one sequence); else a
            4D mask ``[B, 1, T, S+T]`` (bool: True attends), or a dict of them by layer type when the model mixes
            full and sliding-window layers. The new slots are marked valid (``commit`` then rolls back what is
            not kept).

        Raises:
            ValueError: ``counts`` does not have one entry >= 1 per row, or a tree of another size than its count.
        """
        if len(counts) != self.batch_size or min(counts, default=1) < 1:
            raise ValueError(f"need one count >= 1 per row ({self.batch_size} rows), got {counts}")
        trees = list(trees) if trees is not None else [None] * self.batch_size
        if len(trees) != self.batch_size:
            raise ValueError(f"need one tree (or None) per row ({self.batch_size} rows), got {len(trees)}")
        b, t, s = self.batch_size, max(counts), self.slots
        lengths = torch.tensor(self.lengths, dtype=torch.long)
        positions = lengths[:, None] + torch.arange(t)[None]  # [B, T]
        blocks = None
        if any(tree is not None for tree in trees):
            blocks = torch.ones(t, t, dtype=torch.bool).tril().repeat(b, 1, 1)  # [B, T, T] new-token attention
            for row, tree in enumerate(trees):
                if tree is None:
                    continue
                n = tree.numel() + 1
                if n != counts[row]:
                    raise ValueError(f"row {row}: a tree of {n - 1} nodes reads {n} tokens, not {counts[row]}")
                positions[row, :n] = tree_positions(tree, self.lengths[row])
                blocks[row, :n, :n] = ancestor_mask(tree)
        ragged = min(counts) != t
        need_mask = self.has_holes() or ragged or blocks is not None or any(w is not None for w in self.windows)
        mask = self._mask(positions, blocks) if need_mask else None
        self.valid = torch.cat([self.valid, torch.ones(b, t, dtype=torch.bool)], dim=1)
        self.slot_pos = torch.cat([self.slot_pos, positions], dim=1)
        self._pending = (s, list(counts))
        return positions, mask

    def _mask(self, positions: torch.Tensor, blocks: torch.Tensor | None = None):
        """The attention mask of a forward at ``positions`` [B, T]; ``blocks`` [B, T, T]: which new tokens each
        new token reads (default causal)."""
        b, t = positions.shape
        s = self.slots
        new_valid = torch.ones(b, t, dtype=torch.bool)
        key_valid = torch.cat([self.valid, new_valid], dim=1)  # [B, S+T]
        key_pos = torch.cat([self.slot_pos, positions], dim=1)  # [B, S+T]
        if blocks is None:
            causal = torch.ones(t, s + t, dtype=torch.bool).tril(diagonal=s)[None]  # query i reads slots <= s+i
        else:
            causal = torch.cat([torch.ones(b, t, s, dtype=torch.bool), blocks], dim=2)  # [B, T, S+T]
        base = key_valid[:, None, :] & causal  # [B, T, S+T]
        masks = {}
        for window in sorted(set(self.windows), key=lambda w: -1 if w is None else w):
            m = base
            if window is not None:  # transformers' sliding window: q_pos - k_pos < window
                m = base & (positions[:, :, None] - key_pos[:, None, :] < window)
            masks[window] = m[:, None]  # [B, 1, T, S+T]
        if len(masks) == 1:
            return next(iter(masks.values()))
        full = masks.get(None)
        sliding = next(m for w, m in masks.items() if w is not None)
        return {"full_attention": full if full is not None else sliding, "sliding_attention": sliding}

    def commit(self, kept: "list[int | Sequence[int]]") -> None:
        """After the forward prepared by ``begin``: row b keeps its first ``kept[b]`` (1..counts[b]) new tokens,
        or, when ``kept[b]`` is a list, the new tokens at those indices (ascending, starting at 0: a tree's root
        and its accepted path, whose positions are consecutive); the rest (rejected drafts, padding) are rolled
        back; then ``trim``.

        Raises:
            ValueError: no forward is pending, or a count / index list outside 1..counts[b]."""
        if self._pending is None:
            raise ValueError("commit() without a pending forward (call begin() first)")
        start, counts = self._pending
        if len(kept) != len(counts):
            raise ValueError(f"rows read {counts} new tokens; cannot keep {kept}")
        for row, (n, c) in enumerate(zip(kept, counts)):
            if isinstance(n, int):
                if not 1 <= n <= c:
                    raise ValueError(f"rows read {counts} new tokens; cannot keep {kept}")
                self.valid[row, start + n :] = False
                self.lengths[row] += n
                continue
            index = [int(i) for i in n]
            if not index or index[0] != 0 or index != sorted(set(index)) or index[-1] >= c:
                raise ValueError(f"row {row} read {c} new tokens; cannot keep indices {index} (ascending, from 0)")
            keep = torch.zeros(self.slots - start, dtype=torch.bool)
            keep[index] = True
            self.valid[row, start:] &= keep
            self.lengths[row] += len(index)
        self._pending = None
        self.trim()

    def truncate(self, row: int, length: int) -> None:
        """Crop row ``row`` to its first ``length`` tokens, the per-row ``KVCache.crop(length)``: its slots holding
        positions >= ``length`` become holes and ``lengths[row] = length`` (its next token is read at position
        ``length``); the other rows are untouched; then ``trim``. For a drafter rolling back rejected drafts
        between forwards (``commit`` rolls back within the forward it follows only).

        Args:
            row: the row index, 0..B-1. length: tokens it keeps, 0..lengths[row] (``lengths[row]``: nothing to do).

        Raises:
            ValueError: a forward is pending (``begin`` without ``commit``), ``row`` outside 0..B-1, or ``length``
                outside 0..lengths[row].
        """
        if self._pending is not None:
            raise ValueError("truncate() during a pending forward: commit() it first")
        if not 0 <= row < self.batch_size:
            raise ValueError(f"row {row} outside 0..{self.batch_size - 1}")
        if not 0 <= length <= self.lengths[row]:
            raise ValueError(f"row {row} holds {self.lengths[row]} tokens; cannot truncate it to {length}")
        if length == self.lengths[row]:
            return
        # a row's valid slots hold its positions 0..lengths[row]-1, each once, in order (``begin`` / ``commit``)
        self.valid[row] &= self.slot_pos[row] < length
        self.lengths[row] = length
        self.trim()

    def trim(self) -> None:
        """Cut trailing slots invalid in every row; ``compact`` when holes exceed half of the slots."""
        if not self.batch_size:
            return
        any_valid = self.valid.any(dim=0)
        used = int(any_valid.nonzero().max()) + 1 if bool(any_valid.any()) else 0
        if used < self.slots:
            for layer in self.hf.layers:
                layer.crop(-(self.slots - used))
            self.valid, self.slot_pos = self.valid[:, :used], self.slot_pos[:, :used]
        if self.slots > 2 * max(self.lengths) + 16:
            self.compact()

    def compact(self) -> None:
        """Move each row's valid slots to the left (order kept); S becomes the longest row."""
        s = max(self.lengths)
        order = torch.sort((~self.valid).to(torch.int8), dim=1, stable=True).indices[:, :s]  # valid first
        for layer in self.hf.layers:
            idx = order.to(layer.keys.device)[:, None, :, None]
            layer.set(
                layer.keys.gather(2, idx.expand(-1, layer.keys.shape[1], -1, layer.keys.shape[3])),
                layer.values.gather(2, idx.expand(-1, layer.values.shape[1], -1, layer.values.shape[3])),
            )
        self.valid = self.valid.gather(1, order)
        self.slot_pos = self.slot_pos.gather(1, order)

    def __repr__(self) -> str:
        return f"BatchKVCache(rows={self.batch_size}, slots={self.slots}, lengths={self.lengths})"
