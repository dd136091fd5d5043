"""Draft vocabulary map: the Vd most frequent supervised target tokens, as EAGLE-3's d2t/t2d.

Convention (SafeAILab/EAGLE ``eagle/traineagle3/cnets.py``, SGLang ``llama_eagle3.py``):
  d2t [Vd] int64 holds offsets:  target_id = draft_id + d2t[draft_id]
  t2d [V]  bool marks target ids present in the draft vocab.
Draft ids are assigned in increasing target-id order, so offsets are non-negative and the map is
monotone. When Vd == V the map is the identity and no d2t/t2d is shipped.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass

import torch


@dataclass
class VocabMap:
    """d2t [Vd] int64 offsets, t2d [V] bool, and the token counts [V] int64 they were built from."""

    d2t: torch.Tensor
    t2d: torch.Tensor
    counts: torch.Tensor

    @property
    def draft_vocab_size(self) -> int:
        return int(self.d2t.numel())

    @property
    def vocab_size(self) -> int:
        return int(self.t2d.numel())

    def draft_ids_in_target(self) -> torch.Tensor:
        """Target ids [Vd] of the draft vocabulary, in draft-id order."""
        return torch.arange(self.draft_vocab_size) + self.d2t

    def sha256(self) -> str:
        """Hash of d2t (the map's identity, recorded in metadata and checkpoints)."""
        return hashlib.sha256(self.d2t.to(torch.int64).numpy().tobytes()).hexdigest()

    def to_tensors(self) -> dict[str, torch.Tensor]:
        return {"d2t": self.d2t, "t2d": self.t2d, "counts": self.counts}

    @classmethod
    def from_tensors(cls, t: dict[str, torch.Tensor]) -> "VocabMap":
        m = cls(t["d2t"].long(), t["t2d"].bool(), t["counts"].long())
        validate_vocab_map(m.d2t, m.t2d)
        return m


def count_tokens(token_ids: list[torch.Tensor], masks: list[torch.Tensor], vocab_size: int) -> torch.Tensor:
    """Counts [V] int64 of supervised tokens (where mask is True) over sequences of ids [T] / mask [T]."""
    counts = torch.zeros(vocab_size, dtype=torch.long)
    for ids, mask in zip(token_ids, masks):
        sel = ids[mask.bool()]
        if sel.numel() and int(sel.max()) >= vocab_size:
            raise ValueError(f"token id {int(sel.max())} is outside the target vocab of {vocab_size}")
        counts += torch.bincount(sel, minlength=vocab_size)
    return counts


def build_vocab_map(counts: torch.Tensor, draft_vocab_size: int, always_include: list[int] | tuple = ()) -> VocabMap:
    """Top-``draft_vocab_size`` tokens by count (ties by lower id) -> VocabMap.

    ``always_include`` (e.g. EOS / end-of-turn ids) are kept whatever their count. Raises ValueError
    if Vd exceeds V or fewer tokens than needed were ever seen and Vd < V."""
    v = counts.numel()
    if not 0 < draft_vocab_size <= v:
        raise ValueError(f"draft_vocab_size {draft_vocab_size} must be in 1..{v} (the target vocab size)")
    score = counts.double().clone()
    score[list(always_include)] = float("inf")
    order = torch.sort(-score, stable=True).indices[:draft_vocab_size]  # count desc, ties by id asc
    chosen = torch.sort(order).values
    d2t = chosen - torch.arange(draft_vocab_size)
    t2d = torch.zeros(v, dtype=torch.bool)
    t2d[chosen] = True
    return VocabMap(d2t, t2d, counts.long().clone())


def validate_vocab_map(d2t: torch.Tensor, t2d: torch.Tensor) -> None:
    """Raise ValueError unless every draft id maps to a distinct in-range target id marked in t2d (on any device:
    the check runs on CPU copies)."""
    d2t, t2d = d2t.detach().cpu(), t2d.detach().cpu()
    target = torch.arange(d2t.numel()) + d2t
    if target.numel() and (int(target.min()) < 0 or int(target.max()) >= t2d.numel()):
        raise ValueError(f"d2t maps draft ids outside the target vocab 0..{t2d.numel() - 1}")
    if torch.unique(target).numel() != target.numel():
        raise ValueError("d2t maps two draft ids to the same target id; rebuild the vocab map")
    if not bool(t2d[target].all()) or int(t2d.sum()) != d2t.numel():
        raise ValueError("t2d does not mark exactly the target ids of d2t; rebuild the vocab map")
