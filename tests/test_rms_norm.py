"""core.rms_norm: a fused RMSNorm gives the bits of the model's own, a norm of another formula is never fused,
autograd and other dtypes get the original forward, and the engine's serving kernels fuse the target's and the
drafter's norms without changing a served token."""

import pytest
import torch
from transformers.models.gemma3.modeling_gemma3 import Gemma3RMSNorm
from transformers.models.llama.modeling_llama import LlamaRMSNorm

from draftsmith import drafters, reference
from draftsmith.core.rms_norm import FusedRMSNorm, candidates, fuse_rms_norms, fused_rms_norms, probe
from draftsmith.serve.engine import Engine


def _norm(cls=LlamaRMSNorm, hidden: int = 64) -> torch.nn.Module:
    torch.manual_seed(0)
    norm = cls(hidden, eps=1e-5)
    with torch.no_grad():
        norm.weight.copy_(torch.randn(hidden))
    return norm


def test_a_fused_norm_gives_the_same_bits_and_keeps_its_identity():
    norm = _norm()
    x = torch.randn(3, 9, 64) * 50
    want = norm(x)
    keys = list(norm.state_dict())
    if not probe(norm):  # whether torch's kernel rounds as LlamaRMSNorm does depends on the CPU's ISA
        pytest.skip("F.rms_norm rounds differently from LlamaRMSNorm on this CPU")
    assert fuse_rms_norms(norm) == 1
    assert isinstance(norm, FusedRMSNorm) and isinstance(norm, LlamaRMSNorm)  # isinstance checks keep working
    assert list(norm.state_dict()) == keys
    with torch.no_grad():
        assert torch.equal(norm(x), want)
    assert fuse_rms_norms(norm) == 0  # a second call leaves it as it is


class OnePlusWeightRMSNorm(LlamaRMSNorm):
    """An RMSNorm of another formula (Gemma's ``1 + weight``) that the name alone would let through."""

    def forward(self, x):
        return super().forward(x) * (1.0 + self.weight) / self.weight


@pytest.mark.parametrize("cls", [OnePlusWeightRMSNorm, Gemma3RMSNorm])
def test_a_norm_of_another_formula_is_not_fused(cls):
    norm = _norm(cls)
    assert candidates(norm) == [norm]  # it looks like one...
    assert not probe(norm)  # ...but its fused form would change its output
    assert fuse_rms_norms(norm) == 0 and not isinstance(norm, FusedRMSNorm)


def test_other_dtypes_and_autograd_get_the_original_forward():
    norm = _norm()
    if not fuse_rms_norms(norm):
        pytest.skip("F.rms_norm rounds differently from LlamaRMSNorm on this CPU")
    x = torch.randn(2, 5, 64, dtype=torch.bfloat16)
    with torch.no_grad():
        assert torch.equal(norm(x), LlamaRMSNorm.forward(norm, x))  # probed in float32 only
    x = torch.randn(2, 5, 64, requires_grad=True)
    y = norm(x)
    (g,) = torch.autograd.grad(y.square().sum(), x)
    x2 = x.detach().clone().requires_grad_(True)
    (g2,) = torch.autograd.grad(LlamaRMSNorm.forward(norm, x2).square().sum(), x2)
    assert torch.equal(g, g2)


def test_the_reference_target_gives_the_same_logits_fused():
    model, tok = reference.target()
    ids = torch.tensor([tok.encode("def reverse(items):\n    return items[::-1]\n")])
    with torch.no_grad():
        want = model(ids).logits
        n = fuse_rms_norms(model)
        got = model(ids).logits
    assert n == fused_rms_norms(model)
    assert torch.equal(got, want)


@pytest.mark.parametrize("name", ["eagle3", "dflash"])
def test_the_engine_fuses_the_drafter_norms_as_serving_kernels(tmp_path, name):
    model, tok = reference.target()
    spec = drafters.get(name).example(model, tok, tmp_path)
    off = Engine(model, tok, spec, onednn="off")
    assert off.fused_norms == 0 and fused_rms_norms(model) == 0  # off: the caller's modules are left as they are
    on = Engine(model, tok, spec, onednn="on")
    modules = (model, *on.drafter.modules)
    assert on.fused_norms == sum(fused_rms_norms(m) for m in modules)
    assert not any(probe(m) for module in modules for m in candidates(module))  # every norm that could fuse did
