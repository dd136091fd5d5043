"""The target model as the runtime sees it: one forward over new tokens of one sequence or of a batch, with a KV cache.

``TargetModel`` wraps any transformers causal LM (Llama, Qwen2/3, Mistral, ...). ``forward`` reads new tokens of
ONE sequence: 1-D token ids ``[T_new]``, 2-D outputs ``[T_new, ·]``; positions are taken from the cache length,
so a forward after ``cache.crop(L)`` continues at position L. ``forward_batch`` reads ragged new tokens of B
sequences in one call over a ``BatchKVCache`` (``batch_cache.py``): per-row positions, per-row rollback.

``aux_hidden`` follows the design (DESIGN.md §3) and ``data_pipeline/capture.py``: the concatenation
low→mid→high of ``outputs.hidden_states[i]`` for i in ``aux_layer_ids``, in transformers'
``output_hidden_states`` index convention, where ``hidden_states[i]`` is the INPUT of decoder layer i
(the convention of vLLM's ``llama_eagle3.py``). Index N (N = number of layers) is the final *normed*
output in transformers, so valid ids are 0..N-1. They are read with a forward pre-hook on each of those decoder
layers (its input), registered for the call only, as vLLM reads them (the residual stream at those layers only):
``output_hidden_states=True`` keeps all N + 1 states [B, T, H] until the call returns, so a long prefill held
N + 1 layers' states where 3 are read (an 8B Llama, 32 layers, an 8k-token prompt in bf16: 2.2 GB against
0.2 GB). Per decode step the two cost the same within what this machine resolves (8 rows x 1 token on the
reference target: +0.03 / +0.07 ms over no capture, of 17 ms; AMD EPYC, AVX512, one thread). A model whose decoder
has no ``layers`` list of N modules falls back to ``output_hidden_states``; tests/test_capture_parity.py checks
the two agree exactly.

``final_hidden`` (asked per forward, for the MLP speculator) is the input of the model's output
embedding (lm_head), i.e. the last layer's output AFTER the final norm: what vLLM hands an MLP
speculator as ``previous_hidden_states``. For Llama/Qwen it equals ``outputs.hidden_states[-1]``
(tests/test_mlp_speculator.py checks both); it is read with a pre-hook on lm_head only when asked.
"""

from __future__ import annotations

import contextlib
import os
from dataclasses import dataclass
from typing import Sequence

import torch

from draftsmith.core.aux_layers import check_aux_layer_ids
from draftsmith.core.batch_cache import BatchKVCache
from draftsmith.core.cache import KVCache

#: config keys that bound a model's positions, as vLLM's ``_get_and_verify_max_len`` reads them (the smallest wins)
POSITION_LIMIT_KEYS = (
    "max_position_embeddings",
    "n_positions",
    "max_seq_len",
    "seq_length",
    "max_sequence_length",
    "max_seq_length",
    "seq_len",
)


def position_limit(config) -> tuple[str, int] | None:
    """The most positions a model's config declares: ``(key, value)`` with the key as config.json spells it
    (GPT-2 ``n_positions``, Llama / OPT ``max_position_embeddings``, MPT ``max_seq_len``); None when it declares
    none (e.g. BLOOM's ALiBi). Several keys: the smallest, as vLLM (``vllm/config/model.py``)."""
    c = config.get_text_config() if hasattr(config, "get_text_config") else config
    stored = c.to_dict()
    found = [(key, int(stored[key])) for key in POSITION_LIMIT_KEYS if isinstance(stored.get(key), int)]
    return min(found, key=lambda kv: kv[1]) if found else None


def has_learned_positions(model) -> bool:
    """True when ``model`` holds a learned absolute-position table (GPT-2 / GPT-BigCode ``wpe``, OPT / BioGPT
    ``embed_positions``): an ``nn.Embedding`` other than the token embedding with as many rows as the declared
    position limit (OPT: 2 more). Past it a forward fails with IndexError; RoPE and ALiBi models have no such
    table and run past their declared limit (untrained there)."""
    limit = position_limit(model.config)
    if limit is None:
        return False
    tokens = model.get_input_embeddings()
    return any(
        isinstance(m, torch.nn.Embedding) and m is not tokens and limit[1] <= m.num_embeddings <= limit[1] + 2
        for m in model.modules()
    )


@dataclass
class TargetStep:
    """What one target forward over ``T_new`` tokens returns.

    Attributes:
        logits: ``[T_new, V]`` float32; row t is the next-token logits after reading token t (None in what a
            proposer's ``accept`` gets: ``BatchTargetStep``).
        aux_hidden: ``[T_new, len(aux_layer_ids) * H]`` (``[T_new, 3H]`` for EAGLE-3) in the model's
            dtype, low→mid→high; ``None`` when the target was built without ``aux_layer_ids``.
        final_hidden: ``[T_new, H]`` in the model's dtype, the lm_head input (post final norm) of each row;
            ``None`` unless the forward was asked for it (``final_hidden=True``).
    """

    logits: torch.Tensor | None
    aux_hidden: torch.Tensor | None = None
    final_hidden: torch.Tensor | None = None


@dataclass
class BatchTargetStep:
    """What one target forward over a batch returns: row b read ``counts[b]`` new tokens (padded to T).

    Attributes:
        logits: ``[B, T, V]`` float32; ``logits[b, t]`` follows row b's token t (rows past counts[b]: padding). None
            in what a proposer's ``accept`` gets (``core.batch`` defers accepts and keeps no logits: no proposer
            reads them there).
        aux_hidden: ``[B, T, 3H]`` or None; final_hidden: ``[B, T, H]`` or None (as ``TargetStep``).
        counts: ``[B]`` rows of logits / final_hidden per sequence (its new tokens; 1 after a ``last_only``
            forward). aux_counts: ``[B]`` rows of aux_hidden per sequence (default: ``counts``).
    """

    logits: torch.Tensor | None
    aux_hidden: torch.Tensor | None
    final_hidden: torch.Tensor | None
    counts: list[int]
    aux_counts: list[int] | None = None

    def gather(self, index: Sequence[Sequence[int]]) -> "BatchTargetStep":
        """The rows ``index[b]`` of each sequence b (e.g. a tree's root and accepted path), left-aligned and padded
        to the longest list (padding repeats the row's first entry): what a proposer's ``accept`` reads after a
        tree step, laid out as after a chain.

        Raises:
            ValueError: not one non-empty index list per sequence, or an index past its rows."""
        if len(index) != len(self.counts) or any(not ix for ix in index):
            raise ValueError(f"need one non-empty index list per sequence ({len(self.counts)}), got {index}")
        aux_counts = self.aux_counts or self.counts
        for b, ix in enumerate(index):
            if max(ix) >= min(self.counts[b], aux_counts[b]):
                raise ValueError(f"sequence {b} has {self.counts[b]} rows; cannot gather {list(ix)}")
        t = max(len(ix) for ix in index)
        grid = torch.tensor([list(ix) + [ix[0]] * (t - len(ix)) for ix in index], dtype=torch.long)  # [B, t]

        def take(x: torch.Tensor | None) -> torch.Tensor | None:
            if x is None:
                return None
            g = grid.to(x.device)
            return x.gather(1, g[..., None].expand(-1, -1, x.shape[-1]))

        counts = [len(ix) for ix in index]
        return BatchTargetStep(take(self.logits), take(self.aux_hidden), take(self.final_hidden), counts)

    def row(self, b: int) -> TargetStep:
        """Row b as a one-sequence ``TargetStep`` (views: ``counts[b]`` rows, aux ``aux_counts[b]``)."""
        n = self.counts[b]
        n_aux = n if self.aux_counts is None else self.aux_counts[b]
        return TargetStep(
            logits=None if self.logits is None else self.logits[b, :n],
            aux_hidden=None if self.aux_hidden is None else self.aux_hidden[b, :n_aux],
            final_hidden=None if self.final_hidden is None else self.final_hidden[b, :n],
        )


class TargetModel:
    """A transformers causal LM + (optional) tokenizer + the aux layers an EAGLE-3 proposer reads.

    Args:
        model: a transformers ``*ForCausalLM`` in eval mode (it is not copied or modified).
        tokenizer: kept for callers (stop strings, chat templates); unused by ``forward``.
        aux_layer_ids: HF ``output_hidden_states`` indices, strictly ascending, each in 0..N-1; ``None`` skips
            hidden-state output (cheaper) and makes ``TargetStep.aux_hidden`` None.

    Attributes:
        position_limit: ``(config key, positions)`` the model declares (``position_limit``), or None.
        learned_positions: True when the model has a learned position table (``has_learned_positions``): no
            forward may read a position >= ``position_limit``.

    Raises:
        ValueError: an aux layer id is outside 0..N-1 or repeated, or the ids are not ascending.
    """

    def __init__(self, model, tokenizer=None, aux_layer_ids: Sequence[int] | None = None):
        self.model = model
        self.tokenizer = tokenizer
        self.config = model.config.get_text_config()
        n = int(self.config.num_hidden_layers)
        if aux_layer_ids is not None:
            aux_layer_ids = check_aux_layer_ids(aux_layer_ids, n)
        self.aux_layer_ids: tuple[int, ...] | None = aux_layer_ids
        self.position_limit = position_limit(self.config)
        self.learned_positions = has_learned_positions(model)
        self._aux_layers = _decoder_layers(model, n) if aux_layer_ids is not None else None

    @property
    def vocab_size(self) -> int:
        """V: rows of the output embedding (the logits' last dimension)."""
        return int(self.model.get_output_embeddings().weight.shape[0])

    @property
    def device(self) -> torch.device:
        """Device of the model's parameters; inputs are moved there."""
        return next(self.model.parameters()).device

    def new_cache(self) -> KVCache:
        """An empty KV cache for one sequence of this model."""
        return KVCache(self.model.config)

    @torch.no_grad()  # not inference_mode: an EAGLE head may reuse aux_hidden in autograd-aware code
    def forward(self, input_ids: torch.Tensor, cache: KVCache, final_hidden: bool = False) -> TargetStep:
        """Read ``input_ids`` ``[T_new]`` (int64) at positions ``cache.length ..`` and extend ``cache``.

        ``final_hidden``: also return the lm_head input ``[T_new, H]`` (no extra forward work: a pre-hook
        on the output embedding keeps its input).

        Returns:
            ``TargetStep`` with logits ``[T_new, V]`` float32, aux_hidden ``[T_new, 3H]`` or None,
            final_hidden ``[T_new, H]`` or None.

        Raises:
            ValueError: ``input_ids`` is not a non-empty 1-D tensor (the runtime decodes one sequence).
        """
        input_ids = torch.as_tensor(input_ids, dtype=torch.long)
        if input_ids.dim() != 1 or input_ids.numel() == 0:
            raise ValueError(f"input_ids must be a non-empty 1-D tensor [T_new], got shape {tuple(input_ids.shape)}")
        device = self.device
        start = cache.length
        positions = torch.arange(start, start + input_ids.numel(), device=device)
        logits, aux, final = self._run(input_ids.to(device)[None], positions[None], None, cache.hf, final_hidden)
        if cache.length != start + input_ids.numel():
            raise RuntimeError(
                f"{type(self.model).__name__} did not extend the KV cache ({start} -> {cache.length} "
                f"tokens after reading {input_ids.numel()}): this transformers release ignores the "
                f"`cache=` argument; install transformers>=5.24 (pyproject.toml)"
            )
        return TargetStep(
            logits=logits[0],
            aux_hidden=None if aux is None else aux[0],
            final_hidden=None if final is None else final[0],
        )

    @torch.no_grad()
    def forward_batch(
        self,
        input_ids: Sequence[torch.Tensor],
        cache: BatchKVCache,
        final_hidden: bool = False,
        last_only: bool = False,
        trees: Sequence[torch.Tensor | None] | None = None,
    ) -> BatchTargetStep:
        """Read ``input_ids[b]`` (``[T_b]`` int64, T_b >= 1) after row b of ``cache``; ONE forward for the batch.

        Rows are padded to T = max T_b; each row reads at its own positions (``cache.lengths[b] ..``) and
        attends to its own valid slots only. The caller then calls ``cache.commit(kept)`` to keep the first
        ``kept[b]`` tokens of each row (rejected drafts and padding are rolled back there).

        ``last_only`` (a prefill): the output embedding runs on each row's last new token only (transformers'
        ``logits_to_keep``): logits and final_hidden then have ONE row per sequence (``counts`` all 1 in the
        result); aux_hidden keeps every row.

        ``trees[b]`` (a verify step over draft trees): row b reads [root, N nodes] of the tree whose parents are
        ``trees[b]`` (``core.tree``), each node at position ``lengths[b] + depth`` attending to its ancestors only
        (``BatchKVCache.begin``); None: a chain.

        Returns:
            ``BatchTargetStep`` (logits ``[B, T, V]`` float32, aux ``[B, T, 3H]`` / final ``[B, T, H]`` or None).

        Raises:
            ValueError: not one non-empty 1-D tensor per row of ``cache``.
        """
        rows = [torch.as_tensor(x, dtype=torch.long).reshape(-1) for x in input_ids]
        counts = [int(x.numel()) for x in rows]
        if len(rows) != cache.batch_size or min(counts, default=0) < 1:
            raise ValueError(f"need one non-empty token list per cached row ({cache.batch_size}), got lengths {counts}")
        device = self.device
        t = max(counts)
        ids = torch.zeros(len(rows), t, dtype=torch.long)
        for b, x in enumerate(rows):
            ids[b, : x.numel()] = x.cpu()
        positions, mask = cache.begin(counts, trees)
        if mask is not None and self.model.config._attn_implementation not in ("sdpa", "flex_attention"):
            mask = _additive(mask, next(self.model.parameters()).dtype)
        if isinstance(mask, torch.Tensor):
            mask = mask.to(device)
        elif isinstance(mask, dict):
            mask = {key: m.to(device) for key, m in mask.items()}
        if not last_only:
            logits, aux, final = self._run(ids.to(device), positions.to(device), mask, cache.hf, final_hidden)
            return BatchTargetStep(logits=logits, aux_hidden=aux, final_hidden=final, counts=counts)
        last = sorted({c - 1 for c in counts})  # the columns holding some row's last token
        keep = 1 if last == [t - 1] else torch.tensor(last, device=device)
        logits, aux, final = self._run(ids.to(device), positions.to(device), mask, cache.hf, final_hidden, keep)
        pick = torch.tensor([last.index(c - 1) for c in counts], device=device)
        rows_b = torch.arange(len(counts), device=device)
        return BatchTargetStep(
            logits=logits[rows_b, pick][:, None],
            aux_hidden=aux,
            final_hidden=None if final is None else final[rows_b, pick][:, None],
            counts=[1] * len(counts),
            aux_counts=counts,
        )

    def _run(self, ids, positions, mask, hf_cache, final_hidden: bool, logits_to_keep: int | torch.Tensor = 0):
        """One model call over ``ids [B, T]``: (logits ``[B, T', V]`` float32, aux ``[B, T, 3H]`` or None,
        final hidden ``[B, T', H]`` or None); T' = T unless ``logits_to_keep`` (transformers' meaning) says."""
        lm_head_inputs: list[torch.Tensor] = []
        hooks = []
        if final_hidden:
            hooks.append(
                self.model.get_output_embeddings().register_forward_pre_hook(
                    lambda _module, args: lm_head_inputs.append(args[0])
                )
            )
        layer_inputs: dict[int, torch.Tensor] = {}  # aux id -> the input of that decoder layer (module docstring)
        if self._aux_layers is not None:
            for i in self.aux_layer_ids:
                hooks.append(self._aux_layers[i].register_forward_pre_hook(_keeper(layer_inputs, i), with_kwargs=True))
        try:
            with _grouped_query_sdpa():
                out = self.model(
                    input_ids=ids,
                    position_ids=positions,
                    **({"attention_mask": mask} if mask is not None else {}),
                    output_hidden_states=self.aux_layer_ids is not None and self._aux_layers is None,
                    cache=hf_cache,
                    use_cache=True,
                    **(
                        {"logits_to_keep": logits_to_keep}
                        if not isinstance(logits_to_keep, int) or logits_to_keep
                        else {}
                    ),
                )
        finally:
            for hook in hooks:
                hook.remove()
        aux = None
        if self.aux_layer_ids is not None:
            states = layer_inputs if self._aux_layers is not None else out.hidden_states
            aux = torch.cat([states[i] for i in self.aux_layer_ids], dim=-1)  # [B, T, 3H]
        final = None
        if final_hidden:
            if len(lm_head_inputs) != 1 or lm_head_inputs[0].shape[:2] != out.logits.shape[:2]:
                raise RuntimeError(
                    f"{type(self.model).__name__}: expected one lm_head call over all "
                    f"{ids.shape[1]} rows, saw {[tuple(x.shape) for x in lm_head_inputs]}; "
                    "final_hidden needs a model whose forward applies its output embedding once "
                    "to every position"
                )
            final = lm_head_inputs[0]  # [B, T, H]
        return out.logits.float(), aux, final


def _decoder_layers(model, n: int) -> "torch.nn.ModuleList | None":
    """The model's N decoder layers (``get_decoder().layers``), or None when it has no such list: then aux states
    come from ``output_hidden_states``."""
    try:
        layers = getattr(model.get_decoder(), "layers", None)
    except (AttributeError, NotImplementedError):
        return None
    return layers if isinstance(layers, torch.nn.ModuleList) and len(layers) == n else None


def _keeper(store: dict, i: int):
    """A forward pre-hook (``with_kwargs``) keeping its layer's input hidden states in ``store[i]``."""

    def keep(_module, args, kwargs) -> None:
        store[i] = args[0] if args else kwargs["hidden_states"]

    return keep


@contextlib.contextmanager
def _grouped_query_sdpa():
    """Within the block, transformers' SDPA attention passes grouped K/V heads to torch (``enable_gqa``) even
    with an attention mask, instead of first copying each K/V head once per query head (``repeat_kv``).

    transformers 5.24 (``integrations/sdpa_attention.py::use_gqa_in_sdpa``) uses ``enable_gqa`` on CPU/CUDA only
    when the mask is None, i.e. for a one-token decode step; a verify step over 1 + k tokens and every batched
    step carry a mask, so each layer copied its whole K/V cache n_heads / n_kv_heads times. The results are the
    same values (torch computes the same products; ``tests/test_batch_runtime.py`` checks bit-equality), the
    copy is gone: measured on the reference target (6 query / 2 K/V heads) a masked SDPA call over 32 rows x
    300 keys took 4.0 ms with the copies and 1.0 ms without. transformers reads its switch,
    ``TRANSFORMERS_SDPA_FORCE_GQA``, at every call; it is set for the forward and restored after."""
    key = "TRANSFORMERS_SDPA_FORCE_GQA"
    before = os.environ.get(key)
    os.environ[key] = "1"
    try:
        yield
    finally:
        if before is None:
            os.environ.pop(key, None)
        else:
            os.environ[key] = before


def _additive(mask, dtype):
    """A bool attention mask (True attends) as the additive float mask eager attention adds (0 / dtype min)."""
    if isinstance(mask, dict):
        return {key: _additive(m, dtype) for key, m in mask.items()}
    zero = torch.zeros((), dtype=dtype)
    return torch.where(mask, zero, torch.finfo(dtype).min)


def resolve_max_model_len(limit: tuple[str, int] | None, requested: int | None) -> int:
    """max_model_len: ``requested``, at most (and by default) the target's declared position limit ``limit``
    (``target.position_limit``: ``(config key, positions)``).

    Raises:
        ValueError: ``requested`` outside 1..limit, or missing when the target declares no limit.
    """
    if limit is None:
        if requested is None or requested < 1:
            raise ValueError(
                f"the target's config declares no position limit (none of "
                f"{', '.join(POSITION_LIMIT_KEYS)}): pass max_model_len (--max-model-len N)"
            )
        return int(requested)
    key, n = limit
    if requested is not None and not 0 < requested <= n:
        raise ValueError(f"max_model_len must be in 1..{n} (the target's {key}), got {requested}")
    return int(requested or n)
