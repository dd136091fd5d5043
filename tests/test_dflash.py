"""DFlash beyond the drafter contract (tests/test_contract.py runs the lossless, batch, export and train contracts
over it): the config's published defaults, training and serving seeing the same block, the block objective's
anchors and mask, the vLLM layout and its refusals."""

from __future__ import annotations

import json

import pytest
import torch

from conftest import make_tiny_llama, make_word_tokenizer
from draftsmith.core.proposer import Sampling
from draftsmith.core.target import TargetModel
from draftsmith.drafters.dflash.config import PUBLISHED_GAMMA, Section, default_gamma, default_target_layer_ids
from draftsmith.drafters.dflash.export import check_dflash, config_from_vllm, export_dflash, load_dflash, vllm_config
from draftsmith.drafters.dflash.proposer import DFlashProposer
from draftsmith.drafters.dflash.train import block_loss, block_mask, build_dflash, sample_anchors
from draftsmith.export.metadata import HeadMismatchError
from draftsmith.identity import target_identity


def test_published_defaults():
    assert default_target_layer_ids(36, 5) == (1, 9, 17, 25, 33)  # z-lab's Qwen3-8B drafter
    assert default_target_layer_ids(32, 5) == (1, 8, 15, 22, 29)
    assert default_target_layer_ids(8, 1) == (4,)
    assert all(default_gamma(b) == g for b, g in PUBLISHED_GAMMA.items())
    assert PUBLISHED_GAMMA[8] < default_gamma(9) < PUBLISHED_GAMMA[10] < default_gamma(12) < PUBLISHED_GAMMA[16]
    assert Section(block_size=16, num_speculative_tokens=15).gamma == 7.0


@pytest.mark.parametrize(
    "fields, says",
    [
        ({"block_size": 4, "num_speculative_tokens": 4}, "block_size - 1"),
        ({"target_layer_ids": [3, 1]}, "strictly ascending"),
        ({"block_size": 1, "num_speculative_tokens": 1}, "block_size must be >= 2"),
        ({"num_anchors": 0}, "num_anchors"),
    ],
)
def test_section_refuses_what_cannot_train(fields, says):
    with pytest.raises(ValueError, match=says):
        Section(**fields)


def test_layer_ids_past_the_target_are_refused():
    with pytest.raises(ValueError, match="ids <= 6"):
        Section(target_layer_ids=[1, 7]).layer_ids(8)
    assert Section(target_layer_ids=[1, 3, 6]).aux_layers(8) == (2, 4, 7)  # HF hidden_states index = id + 1


@pytest.fixture(scope="module")
def drafter():
    target = make_tiny_llama(seed=3, num_hidden_layers=6)
    tok = make_word_tokenizer(96)
    torch.manual_seed(0)
    head = build_dflash(target, Section(block_size=6, num_speculative_tokens=5, target_layer_ids=[1, 4]), tok)
    return target, tok, head.eval()


def test_anchors_are_supervised_pairs_and_blocks_see_only_the_past():
    loss_mask = torch.tensor([[0, 0, 1, 1, 1, 0, 1, 1], [0, 1, 1, 0, 0, 0, 0, 0]], dtype=torch.bool)
    anchors, keep = sample_anchors(loss_mask, None, 8, torch.Generator().manual_seed(0))
    assert anchors.shape == (2, 3)  # row 0 has 3 valid anchors (2, 3, 6), row 1 one (1)
    assert anchors[0].tolist() == [2, 3, 6] and keep[0].all()
    assert anchors[1, keep[1]].tolist() == [1] and keep[1].sum() == 1
    mask = block_mask(anchors, 4, 8)[0, 0]  # [3 * 4, 8 + 12]
    for n, a in enumerate(anchors[0].tolist()):
        rows = mask[n * 4 : (n + 1) * 4]
        assert rows[:, :8].sum(1).tolist() == [a] * 4  # context keys 0..a-1, never the anchor's own state
        assert rows[:, 8:].sum(1).tolist() == [4] * 4 and rows[:, 8 + n * 4 : 8 + (n + 1) * 4].all()


def test_training_block_is_the_served_block(drafter):
    """The logits the objective scores for anchor a are the q the proposer drafts from after reading x_0..x_{a-1}
    and emitting x_a: training and serving see the same context, block and positions."""
    target, tok, head = drafter
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(3, 96, (1, 14), generator=g)
    a, k = 9, head.config.block_size - 1
    tm = TargetModel(target, aux_layer_ids=head.config.aux_layer_ids)
    step = tm.forward(ids[0], tm.new_cache())
    # the objective's forward for one anchor a
    with torch.no_grad():
        c = head.context(step.aux_hidden[None])
        kv = head.context_kv(c, torch.arange(14)[None])
        block = torch.full((1, k + 1), head.config.mask_token_id)
        block[0, 0] = ids[0, a]
        hidden = head.block(block, torch.arange(a, a + k + 1)[None], kv, block_mask(torch.tensor([[a]]), k + 1, 14))
        want = torch.softmax(head.logits(hidden[0, 1:]).float(), -1)
    # the proposer after a prompt of a tokens and the emitted token x_a
    proposer = DFlashProposer(head, sampling=Sampling(temperature=1.0, seed=0))
    prefill = tm.forward(ids[0, :a], tm.new_cache())
    proposer.start(ids[0, :a], int(ids[0, a]), prefill)
    got = proposer.propose(k).q
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-6)


def test_block_loss_weights_positions_and_reaches_every_parameter(drafter):
    target, _, head = drafter
    head = head.train()
    g = torch.Generator().manual_seed(2)
    ids = torch.randint(3, 96, (2, 16), generator=g)
    loss_mask = torch.zeros(2, 16, dtype=torch.bool)
    loss_mask[:, 6:] = True
    tm = TargetModel(target, aux_layer_ids=head.config.aux_layer_ids)
    with torch.no_grad():
        steps = [tm.forward(ids[b], tm.new_cache()) for b in range(2)]
    aux = torch.stack([s.aux_hidden for s in steps])
    logits = torch.stack([s.logits for s in steps])
    out = block_loss(head, aux, ids, logits, loss_mask, torch.ones(2, 16), num_anchors=4, gamma=4.0)
    assert len(out.step_count) == head.config.block_size - 1
    assert out.step_count[0] == 8 and out.step_count == sorted(out.step_count, reverse=True)  # later ones run off
    out.loss.backward()
    assert all(p.grad is not None and p.grad.abs().sum() > 0 for n, p in head.named_parameters()), "unreached"
    head.zero_grad()
    head.eval()


def test_vllm_layout_names_and_refusals(drafter, tmp_path):
    target, tok, head = drafter
    out = export_dflash(head, tmp_path / "head", target_identity(target, tok, "tiny"))
    cfg = json.loads((out / "config.json").read_text())
    assert cfg["architectures"] == ["DFlashDraftModel"] and cfg["model_type"] == "qwen3"
    assert cfg["dflash_config"] == {"mask_token_id": head.config.mask_token_id, "target_layer_ids": [1, 4]}
    assert config_from_vllm(cfg) == head.config == config_from_vllm(vllm_config(head.config, "float32"))
    from safetensors import safe_open

    with safe_open(out / "model.safetensors", "pt") as f:
        names = set(f.keys())
    assert "fc.weight" in names and "layers.0.self_attn.q_norm.weight" in names
    assert not any("embed_tokens" in n or "lm_head" in n for n in names)  # vLLM shares the target's
    loaded, meta = load_dflash(out, target_model=target, tokenizer=tok)
    assert meta.aux_layer_ids == [2, 5]
    for (name, p), q in zip(head.export_state_dict().items(), loaded.export_state_dict().values()):
        assert torch.equal(p, q), name
    # a hand-edited config.json (another target layer) is refused, naming the file
    cfg["dflash_config"]["target_layer_ids"] = [1, 3]
    (out / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(HeadMismatchError, match="config.json as vLLM reads it disagrees"):
        check_dflash(out)
    # another target (deeper): refused, not overridable
    deeper = make_tiny_llama(seed=3, num_hidden_layers=8)
    cfg["dflash_config"]["target_layer_ids"] = [1, 4]
    (out / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(HeadMismatchError, match="num_hidden_layers"):
        check_dflash(out, deeper, tok)
