"""EAGLE-3 trainer: loss goes down, checkpoints resume to the same next batch and loss."""
import random

import pytest
import torch

import draftsmith.train.eagle3 as trainer
from draftsmith.data_pipeline.dataset import RenderedDataset
from draftsmith.heads.vocab import build_vocab_map, count_tokens
from draftsmith.train.eagle3 import HeadConfig, TrainConfig, train_eagle3


def make_data(n=12, t=20, vocab=96, seed=0):
    g = torch.Generator().manual_seed(seed)
    ids = [torch.randint(2, vocab, (t - i % 5,), generator=g) for i in range(n)]
    masks = [torch.arange(x.numel()) >= 5 for x in ids]
    return RenderedDataset(ids, masks)


def run(target, data, out, **kw):
    vmap = build_vocab_map(count_tokens(data.input_ids, data.loss_mask, 96), 64, always_include=[1])
    cfg = TrainConfig(epochs=2, batch_size=4, lr=3e-3, warmup_steps=2, log_every=1, **kw)
    return train_eagle3(target, data, vmap, HeadConfig(ttt_steps=3, aux_layer_ids=[1, 2, 3]), cfg, out, pad_id=0)


def test_loss_decreases(tiny_llama, tmp_path):
    target = tiny_llama(seed=7)
    result = run(target, make_data(), tmp_path)
    assert result.steps == 6
    assert result.log[-1]["loss"] < result.log[0]["loss"]
    assert (tmp_path / "checkpoint" / "state.json").exists()


def test_resume_gives_same_next_batches(tiny_llama, tmp_path, monkeypatch):
    target = tiny_llama(seed=7)
    data = make_data()
    full = run(target, data, tmp_path / "a")
    real_save = trainer.save_checkpoint

    def save_then_die(*args, **kwargs):
        real_save(*args, **kwargs)
        if kwargs["step"] == 2:
            raise KeyboardInterrupt("simulated preemption")

    monkeypatch.setattr(trainer, "save_checkpoint", save_then_die)
    with pytest.raises(KeyboardInterrupt):
        run(target, data, tmp_path / "b", ckpt_every=2)
    monkeypatch.setattr(trainer, "save_checkpoint", real_save)
    resumed = run(target, data, tmp_path / "b", ckpt_every=2)
    assert [e["step"] for e in resumed.log] == [e["step"] for e in full.log]
    for a, b in zip(full.log, resumed.log):
        assert a["loss"] == pytest.approx(b["loss"], rel=1e-5, abs=1e-6)
    for (name, p), q in zip(full.head.named_parameters(), resumed.head.parameters()):
        torch.testing.assert_close(p, q, rtol=1e-5, atol=1e-6, msg=name)


def test_resume_refuses_other_vocab_map(tiny_llama, tmp_path):
    target = tiny_llama(seed=7)
    data = make_data()
    run(target, data, tmp_path, max_steps=2)
    other = build_vocab_map(torch.arange(96).flip(0), 64)
    with pytest.raises(ValueError, match="another vocab map"):
        train_eagle3(target, data, other, HeadConfig(ttt_steps=2, aux_layer_ids=[1, 2, 3]),
                     TrainConfig(max_steps=4, batch_size=4), tmp_path, pad_id=0)


def test_length_grouped_batches_cover_the_epoch_once_with_less_padding():
    from draftsmith.train.eagle3 import batches_for_epoch

    rng = random.Random(0)
    lengths = [rng.randint(10, 600) for _ in range(1003)]
    for epoch in (0, 1):
        grouped = batches_for_epoch(1003, 8, 3, epoch, lengths, megabatch=16)
        assert sorted(i for b in grouped for i in b) == list(range(1003))
        assert len(grouped) == len(batches_for_epoch(1003, 8, 3, epoch)) == 126
        assert grouped == batches_for_epoch(1003, 8, 3, epoch, lengths, megabatch=16)   # pure function

    def padded(batches):
        return sum(len(b) * max(lengths[i] for i in b) for b in batches)

    assert padded(batches_for_epoch(1003, 8, 3, 0, lengths)) < 0.8 * padded(batches_for_epoch(1003, 8, 3, 0))
