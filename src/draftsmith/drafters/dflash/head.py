"""The DFlash block drafter: a few decoder layers whose keys/values include the target's context features and
whose queries are one block [last token, mask, ..., mask]; every block position is predicted in ONE forward.

Paper: Chen et al., "DFlash: Block Diffusion for Flash Speculative Decoding" (2026). The geometry and every
tensor name are the ones vLLM builds (``vllm/model_executor/models/qwen3_dflash.py``, ``DFlashQwen3Model``):

  context c_j  = hidden_norm(fc(concat_i hidden_states[target_layer_ids[i] + 1][j]))      [C, H]
  layer l:       K_ctx = k_norm(k_proj_l(c)) with RoPE at the context positions; V_ctx = v_proj_l(c)
                 (``precompute_and_store_context_kv``: the context skips input_layernorm and is the same
                 for every layer)
                 queries x: pre-norm Qwen3 layer (input_layernorm, q/k/v_proj, per-head q_norm / k_norm, RoPE,
                 attention over [K_ctx; K_block], o_proj, residual, post_attention_layernorm, SwiGLU MLP)
  output:        logits = lm_head(norm(h)), lm_head and embedding the TARGET's (vLLM shares both when the
                 checkpoint holds none: ``llm_base_proposer._maybe_share_embeddings`` / ``_maybe_share_lm_head``)

Block layout (``v1/spec_decode/dflash.py`` and ``copy_and_expand_dflash_inputs_kernel``): after the target read
x_0..x_p, the queries are [x_{p+1}, m, ..., m] (x_{p+1} the token the target just emitted, m = mask_token_id) at
positions p+1 .. p+1+k; the output at block index j >= 1 is the draft of x_{p+1+j} (no shift: index j predicts the
token AT its own position). Attention is non-causal: every block query sees every context key and every key of
its block (``dflash_has_any_non_causal``: no ``causal`` / ``layer_types`` in the config).

``target_layer_ids`` follow DFlash's convention (the 0-based target layer whose OUTPUT is read; vLLM adds 1:
``eagle3_utils.get_eagle3_aux_layers_from_config``); ``aux_layer_ids`` = ids + 1 is draftsmith's HF
``hidden_states`` index (``core.aux_layers``).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn
from transformers import LlamaConfig
from transformers.models.llama.modeling_llama import LlamaMLP, LlamaRMSNorm, LlamaRotaryEmbedding, rotate_half

from draftsmith.core.aux_layers import aux_layer_order_problem
from draftsmith.core.onednn import PackedLinear
from draftsmith.drafters.dflash.config import default_target_layer_ids  # noqa: F401 - re-exported


@dataclass
class DFlashConfig:
    """Geometry of one DFlash drafter. H = hidden_size equals the target's (the embedding and lm_head are its).

    Raises ValueError for target_layer_ids that are not strictly ascending, a block_size < 2, or a mask token
    outside the vocabulary."""

    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int  #: draft decoder layers
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    vocab_size: int  #: the target's vocabulary V (the lm_head is the target's: no draft vocabulary)
    target_layer_ids: tuple[int, ...]  #: DFlash convention: 0-based target layers whose output is read
    block_size: int  #: trained block length: 1 real token + block_size - 1 mask tokens
    mask_token_id: int  #: the id fed at masked block positions (embedded by the target's embedding)
    num_target_layers: int  #: the target's depth (recorded as z-lab's configs do)
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    rope_scaling: dict | None = None  #: the target's non-default RoPE parameters, if any
    max_position_embeddings: int = 2048
    hidden_act: str = "silu"

    def __post_init__(self):
        self.target_layer_ids = tuple(int(i) for i in self.target_layer_ids)
        if not self.target_layer_ids:
            raise ValueError("target_layer_ids must name at least one target layer")
        if (problem := aux_layer_order_problem(self.target_layer_ids)) is not None:
            raise ValueError(problem.replace("aux_layer_ids", "target_layer_ids"))
        if self.block_size < 2:
            raise ValueError(f"block_size must be >= 2 (one real token and at least one mask), got {self.block_size}")
        if not 0 <= self.mask_token_id < self.vocab_size:
            raise ValueError(f"mask_token_id {self.mask_token_id} is outside the vocabulary 0..{self.vocab_size - 1}")

    @property
    def aux_layer_ids(self) -> tuple[int, ...]:
        """The target hidden states read, as draftsmith numbers them (HF ``hidden_states`` index = id + 1)."""
        return tuple(i + 1 for i in self.target_layer_ids)

    @property
    def max_k(self) -> int:
        """Drafts per forward the drafter was trained for: block_size - 1."""
        return self.block_size - 1

    @classmethod
    def from_target(
        cls,
        target_config,
        *,
        num_hidden_layers: int,
        target_layer_ids,
        block_size: int,
        mask_token_id: int,
        intermediate_size: int | None = None,
    ) -> "DFlashConfig":
        """Draft geometry matching a transformers target config (attention shape and RoPE from the target, as
        z-lab's drafters copy them)."""
        c = target_config.get_text_config() if hasattr(target_config, "get_text_config") else target_config
        rope = dict(getattr(c, "rope_parameters", None) or {})
        theta = float(rope.pop("rope_theta", getattr(c, "rope_theta", 10000.0)))
        scaling = rope if rope.get("rope_type", "default") != "default" else None
        heads = c.num_attention_heads
        return cls(
            hidden_size=c.hidden_size,
            intermediate_size=int(intermediate_size or c.intermediate_size),
            num_hidden_layers=int(num_hidden_layers),
            num_attention_heads=heads,
            num_key_value_heads=getattr(c, "num_key_value_heads", None) or heads,
            head_dim=getattr(c, "head_dim", None) or c.hidden_size // heads,
            vocab_size=c.vocab_size,
            target_layer_ids=tuple(target_layer_ids),
            block_size=int(block_size),
            mask_token_id=int(mask_token_id),
            num_target_layers=int(c.num_hidden_layers),
            rms_norm_eps=getattr(c, "rms_norm_eps", 1e-6),
            rope_theta=theta,
            rope_scaling=scaling,
            max_position_embeddings=c.max_position_embeddings,
            hidden_act=getattr(c, "hidden_act", "silu"),
        )

    def to_dict(self) -> dict:
        d = dataclasses.asdict(self)
        d["target_layer_ids"] = list(self.target_layer_ids)
        return d

    @classmethod
    def from_dict(cls, d: dict) -> "DFlashConfig":
        """The config of ``to_dict``; raises ValueError naming unknown fields (a newer draftsmith wrote them)."""
        unknown = set(d) - {f.name for f in dataclasses.fields(cls)}
        if unknown:
            raise ValueError(f"unknown DFlashConfig field(s) {sorted(unknown)}; written by a newer draftsmith?")
        return cls(**d)

    def llama_config(self) -> LlamaConfig:
        """The LlamaConfig whose rotary embedding (neox layout, as vLLM's ``is_neox_style`` default) and SwiGLU MLP
        the layers reuse."""
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


def rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """RoPE of ONE tensor x [B, heads, T, hd] with cos, sin [B, T, hd] (neox layout): the ops, and so the bits, of
    transformers' ``apply_rotary_pos_emb(x, ...)[0]``, which also rotates its second argument (twice the work when
    the same tensor is passed as both)."""
    cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)
    return (x * cos) + (rotate_half(x) * sin)


class DFlashAttention(nn.Module):
    """Qwen3 attention (per-head q_norm / k_norm) whose keys are the context's followed by the block's."""

    def __init__(self, c: DFlashConfig):
        super().__init__()
        self.n_heads, self.n_kv, self.head_dim = c.num_attention_heads, c.num_key_value_heads, c.head_dim
        self.q_proj = nn.Linear(c.hidden_size, self.n_heads * c.head_dim, bias=False)
        self.k_proj = nn.Linear(c.hidden_size, self.n_kv * c.head_dim, bias=False)
        self.v_proj = nn.Linear(c.hidden_size, self.n_kv * c.head_dim, bias=False)
        self.o_proj = nn.Linear(self.n_heads * c.head_dim, c.hidden_size, bias=False)
        self.q_norm = LlamaRMSNorm(c.head_dim, eps=c.rms_norm_eps)
        self.k_norm = LlamaRMSNorm(c.head_dim, eps=c.rms_norm_eps)

    def _kv(self, x: torch.Tensor, cos, sin) -> tuple[torch.Tensor, torch.Tensor]:
        b, t, _ = x.shape
        k = self.k_norm(self.k_proj(x).view(b, t, self.n_kv, self.head_dim)).transpose(1, 2)  # [B, nkv, T, hd]
        v = self.v_proj(x).view(b, t, self.n_kv, self.head_dim).transpose(1, 2)
        k = rotate(k, cos, sin)
        return k, v

    def context_kv(self, context: torch.Tensor, cos, sin) -> tuple[torch.Tensor, torch.Tensor]:
        """Keys and values of the context c [B, C, H] (already ``hidden_norm``-ed): ``[B, nkv, C, hd]`` each."""
        return self._kv(context, cos, sin)

    def forward(self, x, cos, sin, ctx_k, ctx_v, mask: torch.Tensor | None) -> torch.Tensor:
        """Block queries x [B, Q, H] over keys [ctx_k; block]; ``mask`` [B, 1, Q, C + Q] bool (True = attend) or
        None (every query sees every key: the runtime's one block)."""
        b, t, _ = x.shape
        q = self.q_norm(self.q_proj(x).view(b, t, self.n_heads, self.head_dim)).transpose(1, 2)  # [B, nh, Q, hd]
        q = rotate(q, cos, sin)
        k, v = self._kv(x, cos, sin)
        k, v = torch.cat([ctx_k.to(k.dtype), k], dim=2), torch.cat([ctx_v.to(v.dtype), v], dim=2)
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=self.n_heads != self.n_kv)
        return self.o_proj(out.transpose(1, 2).reshape(b, t, -1))


class DFlashLayer(nn.Module):
    """One pre-norm Qwen3 decoder layer (``DFlashQwen3DecoderLayer``) over the block, attending to the context."""

    def __init__(self, c: DFlashConfig):
        super().__init__()
        self.input_layernorm = LlamaRMSNorm(c.hidden_size, eps=c.rms_norm_eps)
        self.self_attn = DFlashAttention(c)
        self.post_attention_layernorm = LlamaRMSNorm(c.hidden_size, eps=c.rms_norm_eps)
        self.mlp = LlamaMLP(c.llama_config())

    def forward(self, h, cos, sin, ctx_k, ctx_v, mask) -> torch.Tensor:
        h = h + self.self_attn(self.input_layernorm(h), cos, sin, ctx_k, ctx_v, mask)
        return h + self.mlp(self.post_attention_layernorm(h))


class DFlashHead(nn.Module):
    """DFlash drafter (module docstring): ``fc`` [H, n·H], ``hidden_norm``, ``layers``, ``norm``; the target's
    embedding and lm_head are bound (``bind_target``), frozen and outside this module's state.

    Contract used by the trainer and the proposer:
      context(aux [B, C, n·H]) -> c [B, C, H]
      context_kv(c, positions [B, C]) -> per layer (K, V) [B, nkv, C, hd]
      block(input_ids [B, Q], positions [B, Q], ctx_kv, mask) -> h [B, Q, H] (before ``norm``)
      logits(h [..., H]) -> [..., V]
    """

    def __init__(self, config: DFlashConfig):
        super().__init__()
        c = self.config = config
        self.fc = nn.Linear(len(c.target_layer_ids) * c.hidden_size, c.hidden_size, bias=False)
        self.hidden_norm = LlamaRMSNorm(c.hidden_size, eps=c.rms_norm_eps)
        self.layers = nn.ModuleList(DFlashLayer(c) for _ in range(c.num_hidden_layers))
        self.norm = LlamaRMSNorm(c.hidden_size, eps=c.rms_norm_eps)
        self.rotary = LlamaRotaryEmbedding(c.llama_config())
        self._target: tuple[nn.Module, nn.Module] | tuple = ()

    def bind_target(self, embedding: nn.Module, lm_head: nn.Module) -> None:
        """Use the target's input embedding [V, H] and lm_head [V, H] (frozen, not saved with the drafter).

        Raises ValueError when their shapes are not (vocab_size, hidden_size)."""
        want = (self.config.vocab_size, self.config.hidden_size)
        for name, m in (("embedding", embedding), ("lm_head", lm_head)):
            if tuple(m.weight.shape) != want:
                raise ValueError(f"the target's {name} is {tuple(m.weight.shape)}; the drafter needs {want}")
        self._target = (embedding, lm_head)

    def _bound(self) -> tuple[nn.Module, nn.Module]:
        if not self._target:
            raise RuntimeError("call head.bind_target(target.get_input_embeddings(), target.get_output_embeddings())")
        return self._target

    @property
    def dtype(self) -> torch.dtype:
        return self.fc.weight.dtype

    def context(self, aux_hidden: torch.Tensor) -> torch.Tensor:
        """c = hidden_norm(fc(aux)): [B, C, n·H] -> [B, C, H]."""
        return self.hidden_norm(self.fc(aux_hidden.to(self.dtype)))

    def context_kv(self, context: torch.Tensor, positions: torch.Tensor) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """Every layer's context (K, V) [B, nkv, C, hd] for c [B, C, H] at ``positions`` [B, C]."""
        cos, sin = self.rotary(context, positions)
        return [layer.self_attn.context_kv(context, cos, sin) for layer in self.layers]

    def block(self, input_ids, positions, ctx_kv, mask: torch.Tensor | None = None) -> torch.Tensor:
        """Hidden states [B, Q, H] of the block queries ``input_ids`` [B, Q] at ``positions`` [B, Q] over the
        context keys ``ctx_kv`` (``context_kv``) and the block's own; ``mask`` as ``DFlashAttention.forward``."""
        embedding, _ = self._bound()
        with torch.no_grad():
            h = embedding(input_ids).to(self.dtype)
        cos, sin = self.rotary(h, positions)
        for layer, (k, v) in zip(self.layers, ctx_kv):
            h = layer(h, cos, sin, k, v, mask)
        return h

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Target-vocabulary logits: lm_head(norm(h)), [..., H] -> [..., V] (gradients flow to h, not lm_head)."""
        _, lm_head = self._bound()
        normed = self.norm(hidden).to(lm_head.weight.dtype)
        if type(lm_head) is PackedLinear and lm_head.bias is None and not lm_head.weight.requires_grad:
            return lm_head(normed)  # the served target's packed lm_head (core.onednn): the block's largest read
        return F.linear(normed, lm_head.weight.detach())

    @torch.no_grad()
    def init_from_target(self, target) -> None:
        """Start ``norm`` from the target's final norm (the output goes through the target's lm_head)."""
        final_norm = getattr(getattr(target, "model", None), "norm", None)
        if final_norm is not None and final_norm.weight.shape == self.norm.weight.shape:
            self.norm.weight.copy_(final_norm.weight.to(self.norm.weight))

    # -- export names (vLLM's DFlashQwen3Model parameter names, after its ``model.`` prefix) ----------------------
    def export_state_dict(self) -> dict[str, torch.Tensor]:
        """Weights under their exported names (``layers.{i}.self_attn.q_proj.weight``, ``fc.weight``, ...);
        no embedding and no lm_head (the target's)."""
        return {k: v.detach().contiguous() for k, v in self.state_dict().items() if not k.startswith("rotary.")}

    def load_export_state_dict(self, sd: dict[str, torch.Tensor]) -> None:
        """Load weights written by ``export_state_dict``; raises KeyError naming missing/unexpected tensors."""
        expected = set(self.export_state_dict())
        missing, unexpected = sorted(expected - set(sd)), sorted(set(sd) - expected)
        if missing or unexpected:
            raise KeyError(f"weights do not match DFlashHead: missing {missing}, unexpected {unexpected}")
        with torch.no_grad():
            for k, v in self.state_dict().items():
                if k in sd:
                    v.copy_(sd[k])


def expected_weight_shapes(c: DFlashConfig) -> dict[str, tuple[int, ...]]:
    """Every exported tensor's name and shape for geometry ``c`` (built on the meta device)."""
    with torch.device("meta"):
        head = DFlashHead(c)
    return {k: tuple(v.shape) for k, v in head.export_state_dict().items()}
