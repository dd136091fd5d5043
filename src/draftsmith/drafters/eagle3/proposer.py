"""EAGLE-3 proposer: a chain of k drafts from the head, fed with the target's aux states.

Alignment with the target's positions (same picture as ``train/ttt.py``):

    context       x0 .. x_t            (the target has read these; aux states a_0..a_t)
    prefix step   position j <= t:  feature a_j, token x_{j+1} -> head prefix entry j
    draft 1       from the prefix step at t (token x_{t+1} = the token the target just emitted)
    draft i+1     chain step i: feature h_{i-1}, token draft_i, position t + i

After verification the accepted drafts and the target's token extend the context: their n+1 aux rows
(from the verify pass) become new prefix entries; chain entries are dropped. The head's q lives on
the draft vocabulary and is scattered into the target vocabulary through d2t (zero elsewhere) before
verification (DESIGN.md §7). Head steps run in the head's dtype.

``Eagle3Proposer`` drafts for one sequence (batch size 1). ``BatchEagle3Proposer`` drafts for the rows of a
batch: their prefixes (different lengths) live in one slot pool (``head.RaggedHeadKV``), so each chain step
is ONE head forward over every row still drafting, and each accept ONE prefix step over every row (its
n_b + 1 new entries padded to the longest); each row draws with its own settings and generator, exactly
as ``Eagle3Proposer`` does alone.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import torch

from draftsmith.core.proposer import BatchProposer, Proposal, Proposer, Sampling
from draftsmith.core.sampling import seeded_generator
from draftsmith.drafters.eagle3.head import Eagle3Head, HeadKV, RaggedHeadKV
from draftsmith.drafters.eagle3.tree import draft_tree

logger = logging.getLogger(__name__)


def warn_beyond_trained_depth(k: int, ttt_steps: int | None, head: str, knob: str = "num_speculative_tokens") -> bool:
    """Log one warning when k drafts per step exceed the depth an EAGLE-3 head was trained to.

    Training-time test unrolls the head ``ttt_steps`` steps (DESIGN.md §3): chain step i >= ttt_steps was never
    trained, so drafts past position ``ttt_steps`` are rarely accepted and cost a head step each (output stays
    lossless). Call it once per engine / run. ``head`` names the head, ``knob`` the setting that holds k.
    Returns True when it warned (False also when ``ttt_steps`` is unknown)."""
    if ttt_steps is None or k <= ttt_steps:
        return False
    logger.warning(
        "%s=%d exceeds the depth %s was trained for (ttt_steps=%d): drafts past position %d come from "
        "untrained steps and are rarely accepted; use %s <= %d or train with ttt_steps >= %d",
        knob,
        k,
        head,
        ttt_steps,
        ttt_steps,
        knob,
        ttt_steps,
        k,
    )
    return True


def draw_draft(
    logits: torch.Tensor,
    sampling: Sampling,
    generator: torch.Generator,
    draft_ids: torch.Tensor,
    vocab_size: int,
    drafted: list[int] = (),
) -> tuple[int, torch.Tensor | None]:
    """One draft from draft-vocab logits [Vd] after this step's ``drafted`` tokens (target ids): (target id, q [V]
    float32 over the target vocab, or None).

    ``Sampling.draw`` over the draft vocabulary, whose columns are the target ids ``draft_ids`` [Vd]
    (``head.draft_to_target``): the request's processors read the target ids. Temperature 0: the argmax, q None.
    Else a token sampled with ``generator`` from q_draft = logits_to_probs(processed logits, temperature, top_k,
    top_p, min_p) [Vd], scattered into the target vocabulary through ``draft_ids``, zero elsewhere.
    ``sampling.seed`` is not read (the generator was seeded already)."""
    d, q_draft = sampling.draw(logits, generator, drafted, ids=draft_ids, vocab_size=vocab_size)
    if q_draft is None:
        return int(draft_ids[d]), None
    q = torch.zeros(vocab_size, dtype=q_draft.dtype, device=q_draft.device)
    q[draft_ids] = q_draft
    return int(draft_ids[d]), q


class Eagle3Proposer(Proposer):
    """Drafts with an EAGLE-3 head whose metadata was already checked against the target.

    Args:
        head: an ``Eagle3Head`` with the target's embedding bound (``head.bind_embedding``).
        temperature: 0 -> argmax drafts (q None); > 0 -> drafts sampled from q = logits_to_probs(...).
        top_k, top_p: applied to the draft distribution when sampling. seed: the sampling generator's seed.
        sampling: a ``core.proposer.Sampling`` instead of temperature / top_k / top_p / seed (min_p and the
            request's processors included).
    """

    needs_aux_hidden = True
    has_confidence = True

    def __init__(
        self,
        head: Eagle3Head,
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
        self.generator = seeded_generator(head.fc.weight.device, self.sampling.seed)
        vd = head.config.draft_vocab_size
        self.draft_ids = head.draft_to_target(torch.arange(vd, device=head.fc.weight.device))  # [Vd] target ids
        self.kv = HeadKV()
        self.last_hidden: torch.Tensor | None = None  # [1, 1, H]
        self.last_logits: torch.Tensor | None = None  # [Vd]

    @torch.inference_mode()
    def _extend_prefix(self, aux_hidden: torch.Tensor, next_tokens: torch.Tensor) -> None:
        """Prefix step over new context positions: aux_hidden [n, 3H], next_tokens [n] (token after each)."""
        self.kv.reset_chain()
        dev = self.head.fc.weight.device
        g = self.head.fuse(aux_hidden.to(dev)[None])  # [1, n, H]
        hidden, logits = self.head.step(g, next_tokens.to(dev)[None], self.kv, "prefix")
        self.last_hidden, self.last_logits = hidden[:, -1:], logits[0, -1]

    def start(self, prompt_ids: torch.Tensor, first_token: int, target_step) -> None:
        self.kv = HeadKV()
        next_tokens = torch.cat([prompt_ids[1:].cpu(), torch.tensor([first_token])])  # x_{j+1} for j < T
        self._extend_prefix(target_step.aux_hidden, next_tokens)

    def _draw(self, logits: torch.Tensor, drafted: list[int]) -> tuple[int, torch.Tensor | None]:
        """One draft from draft-vocab logits [Vd] after ``drafted``: (target id, q over the target vocab [V] or
        None)."""
        return draw_draft(logits, self.sampling, self.generator, self.draft_ids, self.head.config.vocab_size, drafted)

    @torch.inference_mode()
    def propose(self, k: int) -> Proposal:
        if k == 0:
            return Proposal.empty()
        self.kv.reset_chain()
        tokens, qs = [], []
        hidden, logits = self.last_hidden, self.last_logits
        for i in range(k):
            token, q = self._draw(logits, tokens)
            tokens.append(token)
            qs.append(q)
            if i + 1 < k:
                ids = torch.tensor([[token]], device=hidden.device)
                hidden, step_logits = self.head.step(hidden, ids, self.kv, "chain")
                logits = step_logits[0, -1]
        q = None if self.sampling.temperature == 0 else torch.stack(qs).cpu()
        return Proposal(torch.tensor(tokens, dtype=torch.long), q)

    def confidence(self) -> float | None:
        """The head's top probability after the context (its next-token logits, held since the last accept)."""
        return None if self.last_logits is None else float(torch.softmax(self.last_logits.float(), -1).max())

    def propose_tree(self, shape, max_depth: int) -> Proposal:
        """An EAGLE-2 dynamic tree, or the static tree ``shape`` names (``drafters.eagle3.tree.draft_tree``), after
        the current context."""
        return draft_tree(self.head, self.kv, self.last_hidden, self.last_logits, shape, max_depth, self.draft_ids)

    def accept(self, n_accepted: int, emitted: torch.Tensor, target_step) -> None:
        # rows 0..n of the verify pass read [last token, d1..dn]; the token after each is emitted[0..n]
        self._extend_prefix(target_step.aux_hidden[: n_accepted + 1], emitted[: n_accepted + 1])


@dataclass(eq=False)
class _Row:
    """One sequence of a ``BatchEagle3Proposer``: how it draws, its prefix length, its last prefix step's output."""

    sampling: Sampling
    generator: torch.Generator
    length: int = 0  #: prefix entries (context positions the head has read)
    hidden: torch.Tensor | None = None  #: [H] pre-norm head output at the last prefix entry
    logits: torch.Tensor | None = None  #: [Vd] its draft-vocab logits (draft 1 is drawn from them)


class BatchEagle3Proposer(BatchProposer):
    """EAGLE-3 drafts for every row of a batch, drafting per row exactly what ``Eagle3Proposer`` drafts alone.

    State: one slot per row in a pool ``[S, nkv, capacity, hd]`` of prefix keys / values (slot order = join
    order, compacted when rows leave, so the decode loop's rows are consecutive slots and attend to a slice of
    the pool; any other order gathers a copy), the row's prefix length, and the head's output at its last
    prefix entry (``_Row``).

    - ``start``: one prefix step over the prompt's T aux rows (``[1, T, 3H]``), as ``Eagle3Proposer.start``.
    - ``propose``: rows with ks[b] > 0 draft; chain step i is ONE head step over the B' rows still drafting
      (``[B', 1, H]`` hidden, ``[B', 1]`` tokens, per-row positions L_b + i), each row attending to its own
      prefix and chain keys (``RaggedHeadKV``); rows whose ks[b] is reached leave the chain. Greedy rows take
      the argmax of the batch at once; sampling rows draw one by one with their own generator (``draw_draft``).
    - ``accept``: ONE prefix step over every row of the verify step: row b's n_b + 1 aux rows
      (``step.aux_hidden[b, :n_b + 1]``) and tokens ``emitted[b]``, padded to T = max n_b + 1 (the padding is
      zeroed, written past the row's length and never attended to).

    Args:
        head: an ``Eagle3Head`` with the target's embedding bound (eval mode is set).

    Raises:
        ValueError: ``start`` with a negative temperature or without ``target_step.aux_hidden``; ``accept``
            without ``step.aux_hidden`` or with another number of rows than keys.
    """

    needs_aux_hidden = True
    has_confidence = True

    def __init__(self, head: Eagle3Head):
        self.head = head.eval()
        self.device = head.fc.weight.device
        c = head.config
        self.draft_ids = head.draft_to_target(torch.arange(c.draft_vocab_size, device=self.device))  # [Vd]
        self.rows: dict[int, _Row] = {}
        self.order: list[int] = []  # row keys by slot (stopped rows stay until _compact)
        self.slot: dict[int, int] = {}
        self.pool_k: torch.Tensor | None = None  # [S, nkv, capacity, hd]
        self.pool_v: torch.Tensor | None = None
        self._stale = False  # some slot belongs to a stopped row

    # -- the slot pool ---------------------------------------------------------------------------
    def _compact(self) -> None:
        """Drop the slots of stopped rows, keeping the others' order (slots 0..n-1)."""
        if not self._stale:
            return
        self._stale = False
        alive = [key for key in self.order if key in self.rows]
        old = [self.slot[key] for key in alive]
        self.order, self.slot = alive, {key: s for s, key in enumerate(alive)}
        if not alive:
            self.pool_k = self.pool_v = None
        elif old != list(range(len(old))):
            index = torch.tensor(old, device=self.device)
            self.pool_k[: len(old)] = self.pool_k.index_select(0, index)
            self.pool_v[: len(old)] = self.pool_v.index_select(0, index)

    def _reserve(self, slots: int, entries: int) -> None:
        """Grow the pool (doubling) to at least ``slots`` slots of ``entries`` entries."""
        have_s, have_e = (0, 0) if self.pool_k is None else (self.pool_k.shape[0], self.pool_k.shape[2])
        if slots <= have_s and entries <= have_e:
            return
        s = have_s if slots <= have_s else max(slots, 2 * have_s, 4)
        e = have_e if entries <= have_e else max(entries, 2 * have_e, 64)
        c = self.head.config
        pools = []
        for old in (self.pool_k, self.pool_v):
            new = torch.zeros(
                s, c.num_key_value_heads, e, c.head_dim, dtype=self.head.fc.weight.dtype, device=self.device
            )
            if old is not None:
                new[:have_s, :, :have_e] = old
            pools.append(new)
        self.pool_k, self.pool_v = pools

    def _extend(self, keys, aux_hidden: torch.Tensor, next_tokens: torch.Tensor, counts: list[int]) -> None:
        """One prefix step for rows ``keys``: aux_hidden [B, T, 3H] and next_tokens [B, T] (the token after each
        position), of which row b's first ``counts[b]`` are real (the rest padding, finite)."""
        rows = [self.rows[key] for key in keys]
        b, t = next_tokens.shape
        lengths = [row.length for row in rows]
        self._reserve(len(self.order), max(lengths) + t)
        kv = RaggedHeadKV(self.pool_k, self.pool_v, [self.slot[key] for key in keys], lengths)
        dev = self.device
        positions = torch.tensor(lengths, device=dev)[:, None] + torch.arange(t, device=dev)  # [B, T]
        g = self.head.fuse(aux_hidden.to(dev))  # [B, T, H]
        hidden, _ = self.head.step(g, next_tokens.to(dev), kv, "prefix", position_ids=positions, with_logits=False)
        last = hidden[torch.arange(b, device=dev), torch.tensor(counts, device=dev) - 1]  # [B, H]
        logits = self.head.logits(last)  # [B, Vd]
        for j, (row, n) in enumerate(zip(rows, counts)):
            row.length += n
            row.hidden, row.logits = last[j], logits[j]

    # -- the contract ----------------------------------------------------------------------------
    @torch.inference_mode()
    def start(self, key, prompt_ids, first_token, target_step, sampling) -> None:
        """Row ``key`` joins: a slot, its generator (``sampling.seed``) and one prefix step over the prompt's
        ``target_step.aux_hidden`` [T, 3H] with tokens prompt_ids[1:] + first_token [T]."""
        if sampling.temperature < 0:
            raise ValueError(f"temperature must be >= 0, got {sampling.temperature}")
        if target_step.aux_hidden is None:
            raise ValueError("BatchEagle3Proposer needs the prefill's aux_hidden: build the target with aux_layer_ids")
        self.stop(key)  # a key that starts again begins afresh
        self._compact()
        self.rows[key] = _Row(sampling, seeded_generator(self.device, sampling.seed))
        self.slot[key] = len(self.order)
        self.order.append(key)
        next_tokens = torch.cat([prompt_ids[1:].cpu(), torch.tensor([first_token])])  # x_{j+1} for j < T
        self._extend([key], target_step.aux_hidden[None], next_tokens[None].long(), [next_tokens.numel()])

    def _draw(
        self, logits: torch.Tensor, rows: list[_Row], qs: list[list[torch.Tensor]], drafted: list[list[int]]
    ) -> torch.Tensor:
        """One draft per row from logits [B', Vd] after each row's ``drafted`` tokens: target ids [B'] on the head's
        device; sampling rows append their q [V] to ``qs[j]``."""
        ids = self.draft_ids[logits.argmax(-1)]  # plain greedy rows (all at once)
        for j, row in enumerate(rows):
            if not row.sampling.plain_greedy:
                token, q = draw_draft(
                    logits[j], row.sampling, row.generator, self.draft_ids, self.head.config.vocab_size, drafted[j]
                )
                ids[j] = token
                if q is not None:
                    qs[j].append(q)
        return ids

    @torch.inference_mode()
    def propose(self, keys, ks) -> list[Proposal]:
        """ks[b] drafts for row keys[b] (tokens [ks[b]], q [ks[b], V] when it samples); chain steps batched."""
        self._compact()
        drafting = [b for b, k in enumerate(ks) if k > 0]
        tokens: list[list[int]] = [[] for _ in keys]
        qs: list[list[torch.Tensor]] = [[] for _ in keys]
        if drafting:
            rows = [self.rows[keys[b]] for b in drafting]
            kv = RaggedHeadKV(
                self.pool_k, self.pool_v, [self.slot[keys[b]] for b in drafting], [r.length for r in rows]
            )
            hidden = torch.stack([r.hidden for r in rows])[:, None]  # [B', 1, H]
            logits = torch.stack([r.logits for r in rows])  # [B', Vd]
            positions = torch.tensor([r.length for r in rows], device=self.device)  # chain step i at L_b + i
            active, drawn = drafting, []
            made: list[list[int]] = [[] for _ in keys]  # each row's drafts so far (its processors read them)
            track = any(self.rows[keys[b]].sampling.processors is not None for b in drafting)
            for i in range(max(ks[b] for b in drafting)):
                ids = self._draw(
                    logits, [self.rows[keys[b]] for b in active], [qs[b] for b in active], [made[b] for b in active]
                )  # [B']
                if track:  # a host copy per chain step only where some row's processors read its drafts
                    for b, token in zip(active, ids.tolist()):
                        made[b].append(token)
                drawn.append((active, ids))
                keep = [j for j, b in enumerate(active) if ks[b] > i + 1]
                if not keep:
                    break
                if len(keep) < len(active):  # rows whose ks[b] is reached leave the chain
                    index = torch.tensor(keep, device=self.device)
                    kv, hidden, ids, positions = kv.select(keep), hidden[index], ids[index], positions[index]
                    active = [active[j] for j in keep]
                hidden, _ = self.head.step(
                    hidden, ids[:, None], kv, "chain", position_ids=(positions + i)[:, None], with_logits=False
                )
                logits = self.head.logits(hidden[:, 0])
            flat = iter(torch.cat([ids for _, ids in drawn]).tolist())
            for rows_i, _ in drawn:
                for b in rows_i:
                    tokens[b].append(next(flat))
        out = []
        for b, key in enumerate(keys):
            greedy = ks[b] <= 0 or self.rows[key].sampling.temperature == 0
            out.append(
                Proposal(torch.tensor(tokens[b], dtype=torch.long), None if greedy else torch.stack(qs[b]).cpu())
            )
        return out

    @torch.inference_mode()
    def confidence(self, keys) -> list[float | None]:
        """Per row, the head's top probability after its context (the logits of its last prefix entry), for all
        rows at once."""
        if not keys:
            return []
        logits = torch.stack([self.rows[key].logits for key in keys]).float()
        return torch.softmax(logits, -1).amax(-1).tolist()

    @torch.inference_mode()
    def propose_tree(self, keys, shape, max_depths) -> list[Proposal]:
        """An EAGLE-2 (or static) tree per row (``draft_tree``: one head step per depth over the row's frontier
        nodes), row by row; each row's memory is its own slot of the pool."""
        self._compact()
        out = []
        for key, depth in zip(keys, max_depths):
            row = self.rows[key]
            kv = RaggedHeadKV(self.pool_k, self.pool_v, [self.slot[key]], [row.length])
            out.append(draft_tree(self.head, kv, row.hidden, row.logits, shape, depth, self.draft_ids))
        return out

    @torch.inference_mode()
    def accept(self, keys, n_accepted, emitted, step) -> None:
        """Extend every row's prefix by its n_b + 1 verified positions (``step.aux_hidden`` [B, T, 3H]) in one
        prefix step."""
        if not keys:
            return
        if step.aux_hidden is None or step.aux_hidden.shape[0] != len(keys):
            raise ValueError(
                "BatchEagle3Proposer.accept needs the verify step's aux_hidden, one row per key: "
                f"got {None if step.aux_hidden is None else tuple(step.aux_hidden.shape)} for {len(keys)} keys"
            )
        self._compact()
        counts = [int(n) + 1 for n in n_accepted]
        t = max(counts)
        aux = step.aux_hidden[:, :t]  # [B, T, 3H]; row b's rows 0..n_b read [last token, d1..dn]
        pad = torch.arange(t)[None] >= torch.tensor(counts)[:, None]  # [B, T]
        aux = aux.masked_fill(pad.to(aux.device)[..., None], 0)
        next_tokens = torch.zeros(len(keys), t, dtype=torch.long)
        for b, (out, n) in enumerate(zip(emitted, counts)):
            next_tokens[b, :n] = out[:n].cpu()  # the token after each row: emitted[0..n]
        self._extend(keys, aux, next_tokens, counts)

    def stop(self, key) -> None:
        """Drop row ``key``; its slot is reclaimed (the pool compacted) at the next call."""
        if self.rows.pop(key, None) is not None:
            self._stale = True
