"""What one training micro-batch holds, where it comes from, and which rank gets which micro-batch.

Two sources yield the same ``TrainBatch`` for the same sequences, so one trainer and one loss serve both
modes (tests/test_train.py checks the losses agree):

  online   ``OnlineSource``: rendered conversations; the frozen target runs inside the step
           (``data_pipeline.capture.capture``) -> aux states and logits.
  offline  ``OfflineSource``: shards of ``draftsmith capture`` (``data_pipeline.shards.ShardReader``);
           logits are recomputed as lm_head(final hidden state), the target never runs.
Both fill only the fields the drafter asks for (``fields``, a subset of ``BATCH_FIELDS``): a draft
model reads logits alone, so the online target then runs without hidden-state output.

Batches are right-padded. Position ids are then 0..len-1 for every real token (the target's default,
the head's default) and padding only sits after real tokens: causal attention keeps it invisible to
them, the loss never scores it (``train.ttt``), and offline padding (zeros) gives the same loss as
online padding (the target's states on pad tokens). Packing is not implemented.

Schedule (``StepSchedule``): optimiser step s reads global batch s of ``batches_for_epoch`` (a pure
function of seed and epoch, so a checkpoint's step number is its data position). Its ``batch_size``
sequences are cut into ``parts = batch_size / micro_batch_size`` contiguous micro-batches; rank r of
W processes takes micro-batches r*A .. r*A+A-1 (A = parts / W gradient accumulation steps). The parts
do not depend on W, so 1 process x 2 accumulation steps and 2 processes x 1 step see the same
micro-batches and average the same gradients. With parts > 1 the short last batch of an epoch is cut
down to a multiple of parts sequences (dropped when shorter than parts).
"""

from __future__ import annotations

import math
import random
from dataclasses import dataclass

import torch

from draftsmith.core.aux_layers import check_aux_layer_ids
from draftsmith.data_pipeline.capture import capture
from draftsmith.data_pipeline.dataset import RenderedDataset, pad_batch

#: optional ``TrainBatch`` fields a drafter may ask for (``DrafterSpec.batch_fields``)
BATCH_FIELDS = ("aux_hidden", "target_logits", "final_hidden")
DEFAULT_FIELDS = frozenset({"aux_hidden", "target_logits"})  # what EAGLE-3 reads


@dataclass
class TrainBatch:
    """One right-padded micro-batch: what a drafter's objective reads (``train.ttt.ttt_loss``, ...).

    input_ids [B, T] int64, attention_mask [B, T] (1 = real token), loss_mask [B, T] bool (assistant
    tokens); when asked for: aux_hidden [B, T, 3H], target_logits [B, T, V] (position t predicts
    token t+1), final_hidden [B, T, H] (the target's last hidden state after its final norm)."""

    input_ids: torch.Tensor
    attention_mask: torch.Tensor
    loss_mask: torch.Tensor
    aux_hidden: torch.Tensor | None = None
    target_logits: torch.Tensor | None = None
    final_hidden: torch.Tensor | None = None

    @property
    def num_tokens(self) -> int:
        """Real (non-padding) tokens."""
        return int(self.attention_mask.sum())

    def inputs(self, fields) -> dict[str, torch.Tensor]:
        """Keyword arguments of an objective's forward: the three masks/ids plus ``fields``.

        Raises ValueError when a field was asked for but the source did not fill it."""
        out = {"input_ids": self.input_ids, "attention_mask": self.attention_mask, "loss_mask": self.loss_mask}
        for name in sorted(fields):
            value = getattr(self, name)
            if value is None:
                raise ValueError(f"the batch holds no {name}; the source was built without it")
            out[name] = value
        return out


@torch.no_grad()
def run_target(target, input_ids: torch.Tensor, attention_mask: torch.Tensor, aux_layer_ids, fields) -> dict:
    """The frozen target on input_ids [B, T]: the ``fields`` asked for, and nothing else computed.

    Hidden-state output is requested only for ``aux_hidden`` / ``final_hidden``; logits-only drafters
    get a plain forward. The logits are always computed (the causal LM's forward makes them)."""
    if "aux_hidden" in fields and "final_hidden" not in fields:  # EAGLE-3: the capture module's path
        cap = capture(target, input_ids, aux_layer_ids, attention_mask=attention_mask)
        out = {"aux_hidden": cap.aux_hidden, "target_logits": cap.target_logits}
        return {k: v for k, v in out.items() if k in fields}
    hidden = "final_hidden" in fields or "aux_hidden" in fields
    res = target(input_ids=input_ids, attention_mask=attention_mask, output_hidden_states=hidden, use_cache=False)
    out = {"target_logits": res.logits}  # [B, T, V]
    if "aux_hidden" in fields:
        ids = check_aux_layer_ids(aux_layer_ids, target.config.get_text_config().num_hidden_layers)
        out["aux_hidden"] = torch.cat([res.hidden_states[i] for i in ids], dim=-1)  # [B, T, 3H]
    if "final_hidden" in fields:
        out["final_hidden"] = res.hidden_states[-1]  # [B, T, H], after the final norm
    return {k: v for k, v in out.items() if k in fields}


class OnlineSource:
    """Rendered conversations; each batch runs the frozen ``target`` once without grad.

    ``aux_layer_ids`` is needed only when ``fields`` holds ``aux_hidden``."""

    mode = "online"

    def __init__(self, data: RenderedDataset, target, pad_id: int, aux_layer_ids, fields=DEFAULT_FIELDS):
        self.fields = frozenset(fields)
        if "aux_hidden" in self.fields and aux_layer_ids is None:
            raise ValueError("aux_hidden needs aux_layer_ids")
        self.data, self.target, self.pad_id = data, target, pad_id
        self.aux_layer_ids = tuple(aux_layer_ids) if aux_layer_ids is not None else None

    def __len__(self) -> int:
        return len(self.data)

    def lengths(self) -> list[int]:
        """Tokens per sequence."""
        return [len(x) for x in self.data.input_ids]

    def batch(self, indices: list[int], device) -> TrainBatch:
        """The sequences ``indices``, padded and captured on ``device``."""
        ids, attn, mask = pad_batch(
            [self.data.input_ids[i] for i in indices], [self.data.loss_mask[i] for i in indices], self.pad_id
        )
        ids, attn, mask = ids.to(device), attn.to(device), mask.to(device)
        return TrainBatch(ids, attn, mask, **run_target(self.target, ids, attn, self.aux_layer_ids, self.fields))


def pad_rows(rows: list[torch.Tensor], length: int) -> torch.Tensor:
    """Right-pad [T_i, D] tensors with zeros to [B, length, D]."""
    out = rows[0].new_zeros((len(rows), length, rows[0].shape[-1]))
    for b, r in enumerate(rows):
        out[b, : r.shape[0]] = r
    return out


class OfflineSource:
    """Sequences of a capture folder (``ShardReader``); the target's ``lm_head`` turns stored final
    hidden states into logits. Raises ValueError when ``fields`` holds ``aux_hidden`` and the shards
    were captured at other aux layers (a drafter without aux states reads any capture)."""

    mode = "offline"

    def __init__(self, reader, lm_head, pad_id: int, aux_layer_ids, fields=DEFAULT_FIELDS):
        self.fields = frozenset(fields)
        if "aux_hidden" in self.fields and tuple(reader.aux_layer_ids) != tuple(aux_layer_ids or ()):
            raise ValueError(
                f"{reader.folder} was captured at aux layers {tuple(reader.aux_layer_ids)}, the head "
                f"reads {tuple(aux_layer_ids or ())}; set head.aux_layer_ids to the capture's or "
                "capture again"
            )
        self.reader, self.lm_head, self.pad_id = reader, lm_head, pad_id

    def __len__(self) -> int:
        return len(self.reader)

    def lengths(self) -> list[int]:
        """Tokens per stored sequence (read from the shard headers, no tensor data)."""
        return self.reader.lengths()

    def batch(self, indices: list[int], device) -> TrainBatch:
        """The stored sequences ``indices``, zero-padded, logits = lm_head(final hidden), on ``device``."""
        seqs = [self.reader[i] for i in indices]
        ids, attn, mask = pad_batch([s.input_ids for s in seqs], [s.loss_mask for s in seqs], self.pad_id)
        t = ids.shape[1]
        out = {}
        if "aux_hidden" in self.fields:
            out["aux_hidden"] = pad_rows([s.aux_hidden for s in seqs], t).to(device)  # [B, T, 3H]
        final = pad_rows([s.final_hidden for s in seqs], t).to(device)  # [B, T, H]
        if "target_logits" in self.fields:
            out["target_logits"] = type(self.reader).target_logits(self.lm_head, final)  # [B, T, V]
        if "final_hidden" in self.fields:
            out["final_hidden"] = final
        return TrainBatch(ids.to(device), attn.to(device), mask.to(device), **out)


def batches_for_epoch(
    n: int, batch_size: int, seed: int, epoch: int, lengths: list[int] | None = None, megabatch: int = 32
) -> list[list[int]]:
    """Shuffled index batches of epoch ``epoch``; a pure function of its arguments.

    With ``lengths`` (tokens per example) batches are grouped by length the way transformers'
    ``LengthGroupedSampler`` does: the shuffled order is cut into mega-batches of ``megabatch``
    batches, each sorted by length (longest first) and cut into batches, and the batches are shuffled.
    Right padding then wastes little compute while the epoch still visits every example once."""
    rng = random.Random(seed * 7919 + epoch)
    order = list(range(n))
    rng.shuffle(order)
    if lengths is None:
        return [order[i : i + batch_size] for i in range(0, n, batch_size)]
    span = batch_size * megabatch
    batches = []
    for m in range(0, n, span):
        group = sorted(order[m : m + span], key=lambda i: -lengths[i])
        batches += [group[i : i + batch_size] for i in range(0, len(group), batch_size)]
    rng.shuffle(batches)
    return batches


def split_batch(batch: list[int], parts: int) -> list[list[int]] | None:
    """``batch`` cut into ``parts`` equal contiguous micro-batches (the remainder dropped); None if too short."""
    size = len(batch) // parts
    if size == 0:
        return None
    return [batch[j * size : (j + 1) * size] for j in range(parts)]


class StepSchedule:
    """Which sequences each rank reads at each optimiser step (rules in the module docstring).

    Raises ValueError when batch_size is not a multiple of micro_batch_size * world_size."""

    def __init__(
        self,
        n: int,
        batch_size: int,
        micro_batch_size: int,
        world_size: int,
        seed: int,
        lengths: list[int] | None = None,
    ):
        if micro_batch_size < 1 or batch_size % (micro_batch_size * world_size):
            raise ValueError(
                f"batch_size {batch_size} must be a multiple of micro_batch_size {micro_batch_size} x "
                f"{world_size} processes (gradient accumulation = batch_size / (micro x processes))"
            )
        self.n, self.batch_size, self.seed, self.lengths = n, batch_size, seed, lengths
        self.parts = batch_size // micro_batch_size
        self.world_size = world_size
        self.grad_accum = self.parts // world_size
        self._epoch: tuple[int, list[list[list[int]]]] | None = None
        self.steps_per_epoch = len(self.epoch_steps(0))
        if self.steps_per_epoch == 0:
            raise ValueError(
                f"{n} sequences make no step of {self.parts} micro-batches; lower batch_size or micro_batch_size"
            )

    def epoch_steps(self, epoch: int) -> list[list[list[int]]]:
        """Epoch ``epoch`` as steps, each a list of ``parts`` micro-batches (cached for the current epoch)."""
        if self._epoch is None or self._epoch[0] != epoch:
            batches = batches_for_epoch(self.n, self.batch_size, self.seed, epoch, self.lengths)
            steps = [s for s in (split_batch(b, self.parts) for b in batches) if s is not None]
            self._epoch = (epoch, steps)
        return self._epoch[1]

    def micro_batches(self, step: int, rank: int) -> list[list[int]]:
        """Rank ``rank``'s micro-batches (``grad_accum`` of them) at optimiser step ``step`` (0-based)."""
        epoch, within = divmod(step, self.steps_per_epoch)
        parts = self.epoch_steps(epoch)[within]
        return parts[rank * self.grad_accum : (rank + 1) * self.grad_accum]

    def total_steps(self, epochs: int, max_steps: int | None) -> int:
        """Optimiser steps of a run: ``epochs`` epochs, capped by ``max_steps``."""
        return min(max_steps or self.steps_per_epoch * epochs, self.steps_per_epoch * epochs)


def micro_batch_size(batch_size: int, micro: int | None, world_size: int) -> int:
    """Sequences per forward per rank: ``micro`` or, when None, batch_size / world_size (no accumulation)."""
    return micro if micro else max(1, math.ceil(batch_size / world_size))
