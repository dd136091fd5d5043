"""The EAGLE-3 draft head: one Llama-style decoder layer fed with the target's low/mid/high states.

Paper: Li et al., "EAGLE-3: Scaling up Inference Acceleration of Large Language Models via
Training-Time Test" (2025). Tensor names follow the research/SGLang export (DESIGN.md §6).

Contract used by the trainer and the runtime (STYLE.md: embed, fuse, backbone, logits):
  fuse(aux [B,T,3H]) -> g [B,T,H]
  step(hidden [B,T,H], input_ids [B,T], kv, mode) -> (hidden_out [B,T,H], logits [B,T,Vd])
  draft_to_target(draft_ids) -> target ids (through d2t offsets)

Attention memory (``HeadKV``) is kept as a *prefix* of keys written by step 0 for real positions
(one per target position) plus a *chain* of per-step keys, instead of a full mask. The T queries of
a call are rooted at the last T prefix entries: query t sees prefix keys 0..L-T+t and, in chain
mode, the chain keys of its own row t (the "diagonal" of training-time test):

  prefix mode (step 0): append T new keys to the prefix, then attend   (train: T = seq, L = T)
  chain mode (step i):  append 1 key per query to the chain, attend    (runtime: T = 1, root = L-1)

Positions: step 0 at prefix index t uses position t; chain step i rooted at t uses position t + i
(the drafted tokens' positions, as vLLM's EAGLE proposer increments them).

Batched runtime (``RaggedHeadKV``): rows with prefixes of different lengths L_b share one slot pool
[S, nkv, capacity, hd]; the same rule holds per row (query t of row b is rooted at its own entry
L_b - T + t, keys past it masked), so a chain step of B rows is one head forward of [B, 1, ·] inputs.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field

import torch
from torch import nn
from transformers import LlamaConfig
from transformers.models.llama.modeling_llama import (
    LlamaMLP,
    LlamaRMSNorm,
    LlamaRotaryEmbedding,
    apply_rotary_pos_emb,
)

from draftsmith.core.aux_layers import aux_layer_order_problem, default_aux_layer_ids


@dataclass
class Eagle3Config:
    """Geometry of one EAGLE-3 head; H = hidden_size equals the target's hidden size."""

    hidden_size: int
    intermediate_size: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    vocab_size: int  #: target vocabulary V
    draft_vocab_size: int  #: draft vocabulary Vd (== V means no d2t/t2d)
    aux_layer_ids: tuple[int, int, int]  #: HF output_hidden_states indices, strictly ascending (low -> high)
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    rope_scaling: dict | None = None  #: the target's non-default RoPE parameters, if any
    max_position_embeddings: int = 2048
    hidden_act: str = "silu"
    norm_before_residual: bool = False  #: the original EAGLE-3 layout; the only one SGLang serves
    ttt_steps: int = 7

    def __post_init__(self):
        self.aux_layer_ids = tuple(int(i) for i in self.aux_layer_ids)
        if len(self.aux_layer_ids) != 3:
            raise ValueError(f"aux_layer_ids must hold 3 layer ids, got {self.aux_layer_ids}")
        if (problem := aux_layer_order_problem(self.aux_layer_ids)) is not None:
            raise ValueError(problem)
        if self.norm_before_residual:
            raise ValueError(
                "norm_before_residual=True is not supported: draftsmith heads use the original "
                "EAGLE-3 layout (residual = fused features), which every engine serves"
            )
        if not 0 < self.draft_vocab_size <= self.vocab_size:
            raise ValueError(f"draft_vocab_size {self.draft_vocab_size} must be in 1..vocab_size {self.vocab_size}")

    @classmethod
    def from_target(
        cls,
        target_config,
        draft_vocab_size: int | None = None,
        aux_layer_ids: tuple[int, int, int] | None = None,
        ttt_steps: int = 7,
    ) -> "Eagle3Config":
        """Head geometry matching a transformers target config (Llama, Qwen2/3, Mistral, ...)."""
        c = target_config.get_text_config() if hasattr(target_config, "get_text_config") else target_config
        rope = dict(getattr(c, "rope_parameters", None) or {})
        theta = float(rope.pop("rope_theta", getattr(c, "rope_theta", 10000.0)))
        scaling = rope if rope.get("rope_type", "default") != "default" else None
        heads = c.num_attention_heads
        return cls(
            hidden_size=c.hidden_size,
            intermediate_size=c.intermediate_size,
            num_attention_heads=heads,
            num_key_value_heads=getattr(c, "num_key_value_heads", None) or heads,
            head_dim=getattr(c, "head_dim", None) or c.hidden_size // heads,
            vocab_size=c.vocab_size,
            draft_vocab_size=draft_vocab_size or c.vocab_size,
            aux_layer_ids=tuple(aux_layer_ids or default_aux_layer_ids(c.num_hidden_layers)),
            rms_norm_eps=getattr(c, "rms_norm_eps", 1e-6),
            rope_theta=theta,
            rope_scaling=scaling,
            max_position_embeddings=c.max_position_embeddings,
            hidden_act=getattr(c, "hidden_act", "silu"),
            ttt_steps=ttt_steps,
        )

    def to_dict(self) -> dict:
        d = dataclasses.asdict(self)
        d["aux_layer_ids"] = list(self.aux_layer_ids)
        return d

    @classmethod
    def from_dict(cls, d: dict) -> "Eagle3Config":
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = set(d) - known
        if unknown:
            raise ValueError(f"unknown Eagle3Config field(s) {sorted(unknown)}; written by a newer draftsmith?")
        return cls(**d)

    def llama_config(self) -> LlamaConfig:
        """The LlamaConfig whose rotary embedding and MLP the head reuses."""
        rope = {"rope_type": "default", **(self.rope_scaling or {}), "rope_theta": self.rope_theta}
        return LlamaConfig(
            hidden_size=self.hidden_size,
            intermediate_size=self.intermediate_size,
            num_attention_heads=self.num_attention_heads,
            num_key_value_heads=self.num_key_value_heads,
            head_dim=self.head_dim,
            rms_norm_eps=self.rms_norm_eps,
            max_position_embeddings=self.max_position_embeddings,
            hidden_act=self.hidden_act,
            rope_parameters=rope,
            vocab_size=self.vocab_size,
        )


@dataclass
class HeadKV:
    """The head's attention memory for a batch: prefix K/V [B, nkv, L, hd] and per-step chain K/V.

    Runtime: one HeadKV per sequence; accepted positions extend the prefix, ``reset_chain`` drops the chain of
    the previous draft (rejected drafts never enter the prefix, so nothing is ever cropped)."""

    prefix_k: torch.Tensor | None = None
    prefix_v: torch.Tensor | None = None
    chain: list[tuple[torch.Tensor, torch.Tensor]] = field(default_factory=list)

    @property
    def length(self) -> int:
        """Prefix entries L (the longest row's for ``RaggedHeadKV``)."""
        return 0 if self.prefix_k is None else self.prefix_k.shape[2]

    def reset_chain(self) -> None:
        """Drop the chain keys (before the next prefix step or the next draft)."""
        self.chain = []

    def append_prefix(self, k: torch.Tensor, v: torch.Tensor) -> None:
        """Prefix mode: append T new entries k, v [B, nkv, T, hd] after the L entries of every row."""
        self.prefix_k = k if self.prefix_k is None else torch.cat([self.prefix_k, k], dim=2)
        self.prefix_v = v if self.prefix_v is None else torch.cat([self.prefix_v, v], dim=2)

    def prefix_heads(self, rep: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Prefix K, V with each of the nkv heads repeated ``rep`` times: [B, nkv * rep, L, hd] (grouped queries)."""
        return self.prefix_k.repeat_interleave(rep, dim=1), self.prefix_v.repeat_interleave(rep, dim=1)

    def visible(self, t: int) -> torch.Tensor:
        """Which prefix keys the T queries of a call see: [T, L] bool, query t rooted at entry L - T + t."""
        L = self.length
        roots = torch.arange(L - t, L, device=self.prefix_k.device)[:, None]  # [T, 1]
        return torch.arange(L, device=self.prefix_k.device)[None, :] <= roots


class RaggedHeadKV(HeadKV):
    """Attention memory of B rows whose prefixes differ in length, kept in a slot pool (the batched runtime).

    Row b owns pool slot ``slots[b]``: its prefix is ``pool_k[slots[b], :, :lengths[b]]``; entries past it are
    padding (finite, never seen). ``prefix_k`` / ``prefix_v`` are the rows' view ``[B, nkv, L, hd]``, L = the
    longest row's length (a slice of the pool when the slots are consecutive, else a gathered copy). The
    module docstring's rule holds per row: query t of a call over T queries is rooted at the row's entry
    ``lengths[b] - T + t`` (``visible``), so each row attends to its own prefix and its own chain keys only.

    Args:
        pool_k, pool_v: ``[S, nkv, capacity, hd]``, written in place by prefix steps (``append_prefix``).
        slots: the B rows' slots (distinct). lengths: their prefix entries (``lengths[b] <= capacity``).
    """

    def __init__(self, pool_k: torch.Tensor, pool_v: torch.Tensor, slots: list[int], lengths: list[int]):
        super().__init__()
        self.pool_k, self.pool_v = pool_k, pool_v
        self.slots, self.lengths = list(slots), list(lengths)
        self._view()

    def _view(self) -> None:
        """Refresh ``prefix_k`` / ``prefix_v`` [B, nkv, L, hd] from the pool."""
        self._heads: tuple[int, torch.Tensor, torch.Tensor] | None = None
        L, first = max(self.lengths), self.slots[0]
        if self.slots == list(range(first, first + len(self.slots))):
            self.prefix_k = self.pool_k[first : first + len(self.slots), :, :L]
            self.prefix_v = self.pool_v[first : first + len(self.slots), :, :L]
        else:
            index = torch.tensor(self.slots, device=self.pool_k.device)
            self.prefix_k = self.pool_k[:, :, :L].index_select(0, index)
            self.prefix_v = self.pool_v[:, :, :L].index_select(0, index)

    def append_prefix(self, k: torch.Tensor, v: torch.Tensor) -> None:
        """Write k, v [B, nkv, T, hd] at entries ``lengths[b] .. lengths[b] + T - 1`` of each row's slot (rows
        that need fewer than T entries get padding there, overwritten by their next prefix step).

        Raises:
            RuntimeError: some row would go past the pool's capacity."""
        b, _, t, _ = k.shape
        if max(self.lengths) + t > self.pool_k.shape[2]:
            raise RuntimeError(f"RaggedHeadKV: {max(self.lengths)} + {t} entries exceed the pool's capacity")
        dev = self.pool_k.device
        slots = torch.tensor(self.slots, device=dev)[:, None]  # [B, 1]
        entries = torch.tensor(self.lengths, device=dev)[:, None] + torch.arange(t, device=dev)  # [B, T]
        self.pool_k[slots, :, entries] = k.transpose(1, 2)  # indexed [B, T, nkv, hd]
        self.pool_v[slots, :, entries] = v.transpose(1, 2)
        self.lengths = [n + t for n in self.lengths]
        self._view()

    def prefix_heads(self, rep: int) -> tuple[torch.Tensor, torch.Tensor]:
        """As ``HeadKV.prefix_heads`` (the same values), computed once until the prefix changes: the chain steps
        of one draft share it."""
        if self._heads is None or self._heads[0] != rep:
            b, nkv, L, hd = self.prefix_k.shape
            k, v = (
                x[:, :, None].expand(b, nkv, rep, L, hd).reshape(b, nkv * rep, L, hd)
                for x in (self.prefix_k, self.prefix_v)
            )
            self._heads = (rep, k, v)
        return self._heads[1], self._heads[2]

    def visible(self, t: int) -> torch.Tensor:
        """[B, 1, T, L] bool: query t of row b sees the row's prefix entries 0 .. lengths[b] - T + t."""
        dev = self.prefix_k.device
        roots = torch.tensor(self.lengths, device=dev)[:, None] - t + torch.arange(t, device=dev)  # [B, T]
        return (torch.arange(self.length, device=dev) <= roots[..., None])[:, None]

    def select(self, rows: list[int]) -> "RaggedHeadKV":
        """The memory of a subset of the rows (indices into this batch), chain keys included."""
        out = RaggedHeadKV(self.pool_k, self.pool_v, [self.slots[b] for b in rows], [self.lengths[b] for b in rows])
        index = torch.tensor(rows, device=self.pool_k.device)
        out.chain = [(k.index_select(0, index), v.index_select(0, index)) for k, v in self.chain]
        return out


class Eagle3Attention(nn.Module):
    """Self-attention over the concatenation [embed(token), hidden_norm(g)] (width 2H in, H out)."""

    def __init__(self, c: Eagle3Config):
        super().__init__()
        self.n_heads, self.n_kv, self.head_dim = c.num_attention_heads, c.num_key_value_heads, c.head_dim
        self.q_proj = nn.Linear(2 * c.hidden_size, self.n_heads * c.head_dim, bias=False)
        self.k_proj = nn.Linear(2 * c.hidden_size, self.n_kv * c.head_dim, bias=False)
        self.v_proj = nn.Linear(2 * c.hidden_size, self.n_kv * c.head_dim, bias=False)
        self.o_proj = nn.Linear(self.n_heads * c.head_dim, c.hidden_size, bias=False)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, kv: HeadKV, mode: str) -> torch.Tensor:
        b, t, _ = x.shape
        q = self.q_proj(x).view(b, t, self.n_heads, self.head_dim).transpose(1, 2)  # [B, nh, T, hd]
        k = self.k_proj(x).view(b, t, self.n_kv, self.head_dim).transpose(1, 2)  # [B, nkv, T, hd]
        v = self.v_proj(x).view(b, t, self.n_kv, self.head_dim).transpose(1, 2)
        q, k = apply_rotary_pos_emb(q, k, cos, sin)
        if mode == "prefix":
            if kv.chain:
                raise RuntimeError("prefix step after chain steps: call kv.reset_chain() first")
            kv.append_prefix(k, v)
        elif mode == "chain":
            if kv.prefix_k is None or kv.length < t:
                raise RuntimeError("chain step needs a prefix of at least T entries (run step 0 first)")
            kv.chain.append((k, v))
        else:
            raise ValueError(f"mode must be 'prefix' or 'chain', got {mode!r}")
        out = attend(q, kv)  # [B, nh, T, hd]
        return self.o_proj(out.transpose(1, 2).reshape(b, t, -1))


def attend(q: torch.Tensor, kv: HeadKV) -> torch.Tensor:
    """Attention of queries q [B, nh, T, hd] rooted at the last T prefix entries of each row (module docstring).

    Scores over prefix keys (causal by root) and the query's own chain keys share one softmax."""
    b, nh, t, hd = q.shape
    rep = nh // kv.prefix_k.shape[1]
    scale = 1.0 / math.sqrt(hd)
    pk, pv = kv.prefix_heads(rep)  # [B, nh, L, hd]
    L = pk.shape[2]
    scores = torch.matmul(q, pk.transpose(-1, -2)) * scale  # [B, nh, T, L]
    scores = scores.masked_fill(~kv.visible(t), float("-inf"))  # [T, L] (one prefix) or [B, 1, T, L] (ragged)
    chain_v = []
    if kv.chain:
        ck = torch.stack([k.repeat_interleave(rep, dim=1) for k, _ in kv.chain], dim=-2)  # [B, nh, T, S, hd]
        chain_v = torch.stack([v.repeat_interleave(rep, dim=1) for _, v in kv.chain], dim=-2)
        chain_scores = (q.unsqueeze(-2) * ck).sum(-1) * scale  # [B, nh, T, S]
        scores = torch.cat([scores, chain_scores], dim=-1)
    probs = torch.softmax(scores.float(), dim=-1).to(q.dtype)
    out = torch.matmul(probs[..., :L], pv)  # [B, nh, T, hd]
    if kv.chain:
        out = out + (probs[..., L:].unsqueeze(-1) * chain_v).sum(-2)
    return out


class Eagle3DecoderLayer(nn.Module):
    """``midlayer``: attention over [input_layernorm(embed), hidden_norm(g)], residual g, then MLP."""

    def __init__(self, c: Eagle3Config):
        super().__init__()
        self.input_layernorm = LlamaRMSNorm(c.hidden_size, eps=c.rms_norm_eps)
        self.hidden_norm = LlamaRMSNorm(c.hidden_size, eps=c.rms_norm_eps)
        self.self_attn = Eagle3Attention(c)
        self.post_attention_layernorm = LlamaRMSNorm(c.hidden_size, eps=c.rms_norm_eps)
        self.mlp = LlamaMLP(c.llama_config())

    def forward(self, embeds, hidden, cos, sin, kv: HeadKV, mode: str) -> torch.Tensor:
        x = torch.cat([self.input_layernorm(embeds), self.hidden_norm(hidden)], dim=-1)  # [B, T, 2H], embed first
        h = hidden + self.self_attn(x, cos, sin, kv, mode)
        return h + self.mlp(self.post_attention_layernorm(h))


class Eagle3Head(nn.Module):
    """EAGLE-3 head: ``fc`` fuses [T, 3H] aux states, one decoder layer, ``norm``, ``lm_head`` [Vd, H].

    The token embedding is the target's (frozen, not a parameter of the head): ``bind_embedding``.
    Buffers: ``d2t`` [Vd] int64 offsets (target_id = draft_id + d2t[draft_id]), ``t2d`` [V] bool."""

    def __init__(self, config: Eagle3Config):
        super().__init__()
        c = self.config = config
        self.fc = nn.Linear(3 * c.hidden_size, c.hidden_size, bias=False)
        self.midlayer = Eagle3DecoderLayer(c)
        self.norm = LlamaRMSNorm(c.hidden_size, eps=c.rms_norm_eps)
        self.lm_head = nn.Linear(c.hidden_size, c.draft_vocab_size, bias=False)
        self.rotary = LlamaRotaryEmbedding(c.llama_config())
        self.register_buffer("d2t", torch.zeros(c.draft_vocab_size, dtype=torch.long))
        self.register_buffer("t2d", torch.zeros(c.vocab_size, dtype=torch.bool))
        self.t2d[: c.draft_vocab_size] = True
        self._embedding: tuple[nn.Module, ...] = ()

    # -- contract -------------------------------------------------------------------------------
    def bind_embedding(self, embedding: nn.Module) -> None:
        """Use the target's input embedding (kept frozen and outside this module's state)."""
        if embedding.weight.shape != (self.config.vocab_size, self.config.hidden_size):
            raise ValueError(
                f"embedding shape {tuple(embedding.weight.shape)} does not match the head's "
                f"(vocab_size, hidden_size) = ({self.config.vocab_size}, {self.config.hidden_size})"
            )
        self._embedding = (embedding,)

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        """Target embedding of ``input_ids`` [B, T] -> [B, T, H] (no grad)."""
        if not self._embedding:
            raise RuntimeError("call head.bind_embedding(target.get_input_embeddings()) before use")
        with torch.no_grad():
            return self._embedding[0](input_ids).to(self.fc.weight.dtype)

    def fuse(self, aux_hidden: torch.Tensor) -> torch.Tensor:
        """g = fc(aux) : [B, T, 3H] -> [B, T, H]."""
        return self.fc(aux_hidden.to(self.fc.weight.dtype))

    def step(
        self,
        hidden: torch.Tensor,
        input_ids: torch.Tensor,
        kv: HeadKV,
        mode: str,
        position_ids: torch.Tensor | None = None,
        with_logits: bool = True,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """One draft step. hidden [B, T, H] (g at step 0, previous hidden after), input_ids [B, T].

        position_ids [B, T] default to the queries' root indices plus the chain depth after the call.
        Returns (hidden_out [B, T, H] pre-norm, logits [B, T, Vd] over the draft vocab, or None when
        ``with_logits`` is False: the trainer then calls :meth:`logits` on the positions it scores)."""
        b, t, _ = hidden.shape
        if position_ids is None:
            after = kv.length + t if mode == "prefix" else kv.length
            depth = len(kv.chain) + 1 if mode == "chain" else 0
            position_ids = torch.arange(after - t, after, device=hidden.device)[None].expand(b, t) + depth
        cos, sin = self.rotary(hidden, position_ids)
        out = self.midlayer(self.embed(input_ids), hidden, cos, sin, kv, mode)
        return out, self.logits(out) if with_logits else None

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Draft-vocab logits of head hiddens: [..., H] -> [..., Vd]."""
        return self.lm_head(self.norm(hidden))

    def draft_to_target(self, draft_ids: torch.Tensor) -> torch.Tensor:
        """Map draft-vocab ids to target ids: ``draft_ids + d2t[draft_ids]``."""
        return draft_ids + self.d2t[draft_ids]

    def set_vocab_map(self, d2t: torch.Tensor, t2d: torch.Tensor) -> None:
        """Install the vocab map (see ``heads.vocab``); shapes [Vd] int64 and [V] bool."""
        if d2t.shape != self.d2t.shape or t2d.shape != self.t2d.shape:
            raise ValueError(
                f"vocab map shapes d2t {tuple(d2t.shape)}, t2d {tuple(t2d.shape)} do not match "
                f"the head's ({self.config.draft_vocab_size},), ({self.config.vocab_size},)"
            )
        self.d2t.copy_(d2t)
        self.t2d.copy_(t2d)

    @torch.no_grad()
    def init_from_target(self, target) -> None:
        """Start ``lm_head`` from the target's output rows of the draft vocab and ``norm`` from its final norm.

        A warm start (not part of the paper's recipe) that shortens CPU training; call after set_vocab_map."""
        out = target.get_output_embeddings().weight  # may live on another device (cuda)
        ids = self.draft_to_target(torch.arange(self.config.draft_vocab_size, device=self.d2t.device))
        self.lm_head.weight.copy_(out[ids.to(out.device)].to(self.lm_head.weight))
        final_norm = getattr(getattr(target, "model", None), "norm", None)
        if final_norm is not None and final_norm.weight.shape == self.norm.weight.shape:
            self.norm.weight.copy_(final_norm.weight.to(self.norm.weight))

    # -- export names (DESIGN.md §6) ------------------------------------------------------------
    def export_state_dict(self) -> dict[str, torch.Tensor]:
        """Weights under their exported names; d2t/t2d omitted when Vd == V. No embedding, no biases."""
        sd = {
            k: v.detach().contiguous()
            for k, v in self.state_dict().items()
            if not k.startswith("rotary.") and k not in ("d2t", "t2d")
        }
        if self.config.draft_vocab_size != self.config.vocab_size:
            sd["d2t"], sd["t2d"] = self.d2t.clone(), self.t2d.clone()
        return sd

    def load_export_state_dict(self, sd: dict[str, torch.Tensor]) -> None:
        """Load weights written by ``export_state_dict``; raises KeyError naming missing/unexpected tensors."""
        expected = set(self.export_state_dict())
        missing, unexpected = sorted(expected - set(sd)), sorted(set(sd) - expected)
        if missing or unexpected:
            raise KeyError(f"head weights do not match Eagle3Head: missing {missing}, unexpected {unexpected}")
        with torch.no_grad():
            for k, v in self.state_dict().items():
                if k in sd:
                    v.copy_(sd[k])
