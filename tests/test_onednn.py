"""core.onednn: a packed linear computes what nn.Linear does, never serves a stale weight, keeps autograd, and an
engine with packed target linears keeps speculative greedy equal to plain greedy."""

import pytest
import torch

from draftsmith.core.onednn import PackedLinear, pack_linears, packed_bytes, unpack_linears

pytestmark = pytest.mark.skipif(not torch.backends.mkldnn.is_available(), reason="torch built without oneDNN")


def _model(bias: bool = True) -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(48, 96, bias=bias), torch.nn.SiLU(), torch.nn.Linear(96, 40, bias=False))


@pytest.mark.parametrize("shape", [(1, 48), (6, 48), (32, 48), (2, 7, 48)])
def test_a_packed_linear_computes_what_nn_linear_does(shape):
    model = _model()
    x = torch.randn(*shape)
    with torch.no_grad():
        want = model(x)
        keys = list(model.state_dict())
        assert pack_linears(model) == 2
        assert all(type(m) is PackedLinear for m in (model[0], model[2]))
        got = model(x)
    assert got.shape == want.shape
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    assert list(model.state_dict()) == keys  # same parameters, nothing added to what is saved
    assert unpack_linears(model) == 2 and type(model[0]) is torch.nn.Linear
    with torch.no_grad():
        assert torch.equal(model(x), want)


def test_a_weight_changed_in_place_is_packed_again():
    model = _model()
    pack_linears(model)
    x = torch.randn(5, 48)
    with torch.no_grad():
        before = model(x)
        model[0].weight.mul_(-2.0)  # what an optimizer step or load_state_dict does
        model[0].bias.add_(1.0)
        after = model(x)
    unpack_linears(model)
    with torch.no_grad():
        torch.testing.assert_close(after, model(x), rtol=1e-5, atol=1e-5)
    assert not torch.allclose(before, after)


def test_autograd_gets_the_plain_linear():
    model = _model()
    for p in model.parameters():
        p.requires_grad_(True)
    pack_linears(model)
    x = torch.randn(4, 48)
    y = model(x)
    assert y.grad_fn is not None
    y.sum().backward()
    assert model[0].weight.grad is not None and model[0].weight.grad.abs().sum() > 0


def test_only_float32_cpu_linears_are_packed():
    model = _model().to(torch.bfloat16)
    assert packed_bytes(model) == 0 and pack_linears(model) == 0
    assert packed_bytes(_model()) == (48 * 96 + 96 * 40) * 4


def test_an_engine_with_packed_linears_decodes_greedy_as_plain():
    from draftsmith.core.generate import GenerationConfig
    from draftsmith.serve.engine import Engine

    prompt = list(range(20, 60)) * 2
    out = {}
    for name, spec in (("plain", None), ("ngram", {"method": "ngram", "num_speculative_tokens": 5})):
        engine = Engine.from_pretrained("reference", spec, check_memory=False, onednn="on")
        try:
            assert engine.packed_linears == 57  # 8 layers x 7 + the lm_head
            cfg = GenerationConfig(max_new_tokens=32, eos_token_ids=engine.eos_token_ids)
            out[name] = engine.generate(prompt, cfg).tokens
        finally:
            engine.close()
    assert out["ngram"] == out["plain"]


def test_an_unknown_onednn_mode_is_refused():
    from draftsmith.serve.engine import Engine

    with pytest.raises(ValueError, match="onednn must be one of"):
        Engine(_model(), None, onednn="yes")


def test_inference_tensors_are_not_packed():
    with torch.inference_mode():
        model = _model()
    assert packed_bytes(model) == 0 and pack_linears(model) == 0


def test_dflash_reads_the_packed_target_lm_head_and_stays_lossless(tmp_path):
    from draftsmith import drafters
    from draftsmith.core.generate import GenerationConfig
    from draftsmith.models import load_causal_lm
    from draftsmith.serve.engine import Engine

    model, tok = load_causal_lm("reference", dtype="float32")
    spec = drafters.get("dflash").example(model, tok, tmp_path)
    prompt = list(range(20, 60)) * 2
    out = {}
    for name, s in (("plain", None), ("dflash", spec)):
        engine = Engine(model, tok, s, onednn="on")  # the same model: packed once, then reused as it is
        try:
            assert type(model.lm_head) is PackedLinear
            out[name] = engine.generate(prompt, GenerationConfig(max_new_tokens=24, eos_token_ids=[2])).tokens
        finally:
            engine.close()
    assert out["dflash"] == out["plain"]


def test_eval_rows_and_the_bench_serve_with_the_kernels_serve_uses(tmp_path):
    """``eval.onednn`` and ``bench --onednn`` reach the engines: eval's rows pack the shared target and each row's
    drafter (what ``draftsmith serve`` runs), and a bad mode is refused before anything loads."""
    from draftsmith import drafters
    from draftsmith.cli import build_parser
    from draftsmith.evaluation.bench_config import BenchConfig
    from draftsmith.evaluation.config import EvalConfig
    from draftsmith.models import load_causal_lm
    from draftsmith.pipeline.stages import build_eval_rows

    assert EvalConfig().onednn == "auto" and BenchConfig().onednn == "auto"
    assert build_parser().parse_args(["eval", "--onednn", "off"]).onednn == "off"
    assert build_parser().parse_args(["bench", "--onednn", "off"]).onednn == "off"
    with pytest.raises(ValueError, match="onednn"):
        EvalConfig(onednn="yes")
    with pytest.raises(ValueError, match="onednn"):
        BenchConfig(onednn="yes")
    model, tok = load_causal_lm("reference", dtype="float32")
    spec = drafters.get("mlp_speculator").example(model, tok, tmp_path)
    (row,) = build_eval_rows({"mlp": spec}, model, tok, onednn="on").values()
    assert type(model.lm_head) is PackedLinear
    head = row.make_proposer().head
    linears = [m for m in head.modules() if isinstance(m, torch.nn.Linear)]
    assert linears and all(type(m) is PackedLinear for m in linears)
