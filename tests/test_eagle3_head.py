"""EAGLE-3 head: train/serve parity, vocab map, export names."""

import pytest
import torch

from draftsmith.core.aux_layers import default_aux_layer_ids
from draftsmith.data_pipeline.vocab import build_vocab_map, count_tokens, validate_vocab_map
from draftsmith.drafters.eagle3.head import Eagle3Config, Eagle3Head, HeadKV
from draftsmith.drafters.eagle3.ttt import ttt_loss
from draftsmith.train.losses import shift_left


def make_head(target, draft_vocab_size=None, seed=0):
    cfg = Eagle3Config.from_target(target.config, draft_vocab_size=draft_vocab_size)
    torch.manual_seed(seed)
    head = Eagle3Head(cfg)
    head.bind_embedding(target.get_input_embeddings())
    return head


def test_default_aux_layer_ids():
    assert default_aux_layer_ids(32) == (2, 16, 29)
    assert default_aux_layer_ids(8) == (2, 4, 5)
    ids = default_aux_layer_ids(4)  # (2, 2, 1) collapses: three distinct ids instead
    assert len(set(ids)) == 3 and max(ids) < 4


def test_ttt_step_equals_runtime_step(tiny_llama):
    """Each TTT step at position t equals a runtime chain step rooted at t (same weights, same inputs)."""
    target = tiny_llama(seed=1)
    head = make_head(target).eval()
    T, steps, H = 12, 4, target.config.hidden_size
    torch.manual_seed(0)
    ids = torch.randint(2, 96, (1, T))
    aux = torch.randn(1, T, 3 * H)
    # training path: whole sequence, all positions at once
    kv = HeadKV()
    hidden = head.fuse(aux)
    train_logits = []
    for i in range(steps):
        hidden, logits = head.step(hidden, shift_left(ids, 1 + i, 0), kv, "prefix" if i == 0 else "chain")
        train_logits.append(logits)
    # runtime path: prefix over positions 0..t, then a chain of single-token steps rooted at t
    for t in (0, 3, 7):
        kv = HeadKV()
        h, logits = head.step(head.fuse(aux[:, : t + 1]), ids[:, 1 : t + 2], kv, "prefix")
        torch.testing.assert_close(logits[:, -1], train_logits[0][:, t], rtol=1e-5, atol=1e-5)
        h = h[:, -1:]
        for i in range(1, steps):
            if t + 1 + i >= T:
                break
            h, logits = head.step(h, ids[:, t + 1 + i : t + 2 + i], kv, "chain")
            torch.testing.assert_close(logits[:, 0], train_logits[i][:, t], rtol=1e-5, atol=1e-5)


def test_ttt_loss_decreases_and_masks(tiny_llama):
    target = tiny_llama(seed=2)
    ids = torch.randint(2, 96, (2, 16))
    mask = torch.zeros(2, 16, dtype=torch.bool)
    mask[:, 6:] = True
    with torch.no_grad():
        out = target(input_ids=ids, output_hidden_states=True)
    aux = torch.cat([out.hidden_states[i] for i in (1, 2, 3)], -1)
    counts = count_tokens([ids[0], ids[1]], [mask[0], mask[1]], 96)
    vmap = build_vocab_map(counts, 48, always_include=[1])
    head = make_head(target, draft_vocab_size=48)
    head.set_vocab_map(vmap.d2t, vmap.t2d)
    opt = torch.optim.AdamW(head.parameters(), lr=1e-2)
    first = None
    for _ in range(30):
        r = ttt_loss(head, aux, ids, out.logits, mask, ttt_steps=3)
        opt.zero_grad()
        r.loss.backward()
        opt.step()
        first = first if first is not None else r.loss.item()
    assert r.loss.item() < first
    assert all(c <= int(mask.sum()) for c in r.step_count)
    none = ttt_loss(head, aux, ids, out.logits, torch.zeros_like(mask), ttt_steps=2)
    assert none.step_count == [0, 0] and none.loss.item() == 0.0


def test_prompt_loss_weight_scores_prompt_rows_but_never_padding(tiny_llama):
    """w=0 is the assistant-only loss; w>0 changes it; padding (attention 0) never enters the loss."""
    target = tiny_llama(seed=2)
    torch.manual_seed(1)
    ids = torch.randint(2, 96, (2, 16))
    attn = torch.ones(2, 16, dtype=torch.long)
    attn[1, 12:] = 0  # row 1: 12 real tokens, then padding
    mask = torch.zeros(2, 16, dtype=torch.bool)
    mask[:, 6:12] = True
    with torch.no_grad():
        out = target(input_ids=ids, output_hidden_states=True)
    aux = torch.cat([out.hidden_states[i] for i in (1, 2, 3)], -1)
    head = make_head(target)

    def loss(w, ids=ids, aux=aux, logits=out.logits):
        return ttt_loss(head, aux, ids, logits, mask, ttt_steps=3, attention_mask=attn, prompt_loss_weight=w)

    base = ttt_loss(head, aux, ids, out.logits, mask, ttt_steps=3)
    assert loss(0.0).loss.item() == pytest.approx(base.loss.item(), rel=1e-6)
    assert loss(1.0).loss.item() != pytest.approx(base.loss.item(), rel=1e-3)
    assert loss(1.0).step_acc == base.step_acc  # accuracy stays on assistant rows
    # changing what sits in the padded tail of row 1 leaves every weighted loss unchanged
    ids2, aux2, logits2 = ids.clone(), aux.clone(), out.logits.clone()
    ids2[1, 12:] = 0
    aux2[1, 12:] = 5.0
    logits2[1, 12:] = torch.randn_like(logits2[1, 12:])
    assert loss(0.5, ids2, aux2, logits2).loss.item() == pytest.approx(loss(0.5).loss.item(), rel=1e-5)
    with pytest.raises(ValueError, match="attention_mask"):
        ttt_loss(head, aux, ids, out.logits, mask, prompt_loss_weight=0.5)
    with pytest.raises(ValueError, match=r"\[0, 1\]"):
        loss(1.5)


def test_vocab_map_round_trip():
    torch.manual_seed(0)
    corpus = torch.randint(0, 50, (400,))
    counts = count_tokens([corpus], [torch.ones_like(corpus, dtype=torch.bool)], 200)
    vmap = build_vocab_map(counts, 64)
    validate_vocab_map(vmap.d2t, vmap.t2d)
    target_ids = vmap.draft_ids_in_target()
    assert target_ids.unique().numel() == 64 and int(target_ids.max()) < 200
    assert set(corpus.unique().tolist()) <= set(target_ids.tolist())  # every seen token is in the draft vocab
    for d in range(64):
        assert vmap.t2d[d + vmap.d2t[d]]
    full = build_vocab_map(counts, 200)
    assert torch.all(full.d2t == 0)


def test_vocab_map_rejects_duplicates():
    d2t = torch.tensor([0, 0, -1])  # draft 1 and 2 both map to target 1
    t2d = torch.zeros(5, dtype=torch.bool)
    t2d[:2] = True
    with pytest.raises(ValueError, match="same target id"):
        validate_vocab_map(d2t, t2d)


def test_export_names(tiny_llama):
    target = tiny_llama()
    head = make_head(target, draft_vocab_size=32)
    names = set(head.export_state_dict())
    assert "fc.weight" in names and "lm_head.weight" in names and "d2t" in names and "t2d" in names
    assert "midlayer.self_attn.q_proj.weight" in names and "midlayer.hidden_norm.weight" in names
    assert not any("embed" in n or n.endswith("bias") or n.startswith("model.") for n in names)
    assert head.midlayer.self_attn.q_proj.weight.shape[1] == 2 * target.config.hidden_size
    full = make_head(target)
    assert "d2t" not in full.export_state_dict()
