"""EAGLE-3 trainer: loss goes down, resume gives the same next batch and loss (and keeps the saved
vocab map), offline shards give the online loss, padding changes nothing, the micro-batch schedule does
not depend on the world size, launches that are not what the recipe asks for are refused, in-loop τ
is `draftsmith eval`'s τ, trackers. Multi-process runs: tests/test_train_distributed.py."""

import json
import random

import pytest
import torch

import draftsmith.train.trainer as trainer
from conftest import train_eagle3
from draftsmith.data_pipeline.dataset import RenderedDataset
from draftsmith.data_pipeline.vocab import build_vocab_map, count_tokens
from draftsmith.drafters.eagle3.config import Section as HeadConfig
from draftsmith.train.checkpoint import checkpoint_vocab_map
from draftsmith.train.config import TrainConfig


def make_data(n=12, t=20, vocab=96, seed=0):
    g = torch.Generator().manual_seed(seed)
    ids = [torch.randint(2, vocab, (t - i % 5,), generator=g) for i in range(n)]
    masks = [torch.arange(x.numel()) >= 5 for x in ids]
    return RenderedDataset(ids, masks)


def run(target, data, out, **kw):
    vmap = build_vocab_map(count_tokens(data.input_ids, data.loss_mask, 96), 64, always_include=[1])
    cfg = TrainConfig(mixed_precision="no", epochs=2, batch_size=4, lr=3e-3, warmup_steps=2, log_every=1, **kw)
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
    real_commit = trainer.commit_checkpoint

    def commit_then_die(path):
        real_commit(path)
        if json.loads((path / "state.json").read_text())["step"] == 2:
            raise KeyboardInterrupt("simulated preemption")

    monkeypatch.setattr(trainer, "commit_checkpoint", commit_then_die)
    with pytest.raises(KeyboardInterrupt):
        run(target, data, tmp_path / "b", ckpt_every=2)
    monkeypatch.setattr(trainer, "commit_checkpoint", real_commit)
    resumed = run(target, data, tmp_path / "b", ckpt_every=2)
    assert [e["step"] for e in resumed.log] == [e["step"] for e in full.log]
    for a, b in zip(full.log, resumed.log):
        assert a["loss"] == pytest.approx(b["loss"], rel=1e-5, abs=1e-6)
    for (name, p), q in zip(full.head.named_parameters(), resumed.head.parameters()):
        torch.testing.assert_close(p, q, rtol=1e-5, atol=1e-6, msg=name)


def test_resume_keeps_the_saved_vocab_map(tiny_llama, tmp_path, monkeypatch):
    """Resuming with a vocab map built from other token frequencies keeps the checkpoint's map, and
    the run continues exactly as the uninterrupted one."""
    target = tiny_llama(seed=7)
    data = make_data()
    full = run(target, data, tmp_path / "a", max_steps=4)
    saved = build_vocab_map(count_tokens(data.input_ids, data.loss_mask, 96), 64, always_include=[1])
    other_data = make_data(seed=5)
    other = build_vocab_map(
        count_tokens(other_data.input_ids, other_data.loss_mask, 96) ** 2 + torch.arange(96), 64, always_include=[1]
    )
    assert other.sha256() != saved.sha256()
    real_commit = trainer.commit_checkpoint

    def commit_then_die(path):
        real_commit(path)
        raise KeyboardInterrupt("simulated preemption")

    monkeypatch.setattr(trainer, "commit_checkpoint", commit_then_die)
    with pytest.raises(KeyboardInterrupt):
        run(target, data, tmp_path / "b", max_steps=4, ckpt_every=2)
    monkeypatch.setattr(trainer, "commit_checkpoint", real_commit)
    cfg = TrainConfig(mixed_precision="no", epochs=2, batch_size=4, lr=3e-3, warmup_steps=2, log_every=1, max_steps=4)
    resumed = train_eagle3(
        target, data, other, HeadConfig(ttt_steps=3, aux_layer_ids=[1, 2, 3]), cfg, tmp_path / "b", pad_id=0
    )
    assert torch.equal(resumed.head.d2t, saved.d2t) and torch.equal(resumed.head.t2d, saved.t2d)
    assert checkpoint_vocab_map(tmp_path / "b" / "checkpoint").sha256() == saved.sha256()
    assert [round(e["loss"], 5) for e in resumed.log] == [round(e["loss"], 5) for e in full.log]


def test_resume_refuses_an_old_checkpoint_without_its_vocab_map(tiny_llama, tmp_path):
    target = tiny_llama(seed=7)
    data = make_data()
    run(target, data, tmp_path, max_steps=2)
    (tmp_path / "checkpoint" / "vocab_map.safetensors").unlink()  # as written before maps were saved
    other = build_vocab_map(torch.arange(96).flip(0), 64)
    with pytest.raises(ValueError, match="another vocab map"):
        train_eagle3(
            target,
            data,
            other,
            HeadConfig(ttt_steps=2, aux_layer_ids=[1, 2, 3]),
            TrainConfig(mixed_precision="no", max_steps=4, batch_size=4),
            tmp_path,
            pad_id=0,
        )


def test_resume_refuses_another_data_schedule(tiny_llama, tmp_path):
    """The step number is the data position only under the same batch sizes, seed and data."""
    target = tiny_llama(seed=7)
    data = make_data()
    run(target, data, tmp_path, max_steps=2)
    vmap = build_vocab_map(count_tokens(data.input_ids, data.loss_mask, 96), 64, always_include=[1])
    with pytest.raises(ValueError, match="data schedule"):
        train_eagle3(
            target,
            data,
            vmap,
            HeadConfig(ttt_steps=3, aux_layer_ids=[1, 2, 3]),
            TrainConfig(mixed_precision="no", max_steps=4, batch_size=4, micro_batch_size=2),
            tmp_path,
            pad_id=0,
        )


def test_length_grouped_batches_cover_the_epoch_once_with_less_padding():
    from draftsmith.train.batches import batches_for_epoch

    rng = random.Random(0)
    lengths = [rng.randint(10, 600) for _ in range(1003)]
    for epoch in (0, 1):
        grouped = batches_for_epoch(1003, 8, 3, epoch, lengths, megabatch=16)
        assert sorted(i for b in grouped for i in b) == list(range(1003))
        assert len(grouped) == len(batches_for_epoch(1003, 8, 3, epoch)) == 126
        assert grouped == batches_for_epoch(1003, 8, 3, epoch, lengths, megabatch=16)  # pure function

    def padded(batches):
        return sum(len(b) * max(lengths[i] for i in b) for b in batches)

    assert padded(batches_for_epoch(1003, 8, 3, 0, lengths)) < 0.8 * padded(batches_for_epoch(1003, 8, 3, 0))


# --------------------------------------------------------------------------------------- chat data


def conversations(n: int, seed: int = 0) -> list[dict]:
    rng = random.Random(seed)
    words = ["def", "add", "(a, b)", "return", "a + b", "Hello", "there", "how", "are", "you", "?", ":"]
    return [
        {
            "messages": [
                {"role": "user", "content": " ".join(rng.choices(words, k=rng.randint(2, 6)))},
                {"role": "assistant", "content": " ".join(rng.choices(words, k=rng.randint(4, 12)))},
            ]
        }
        for _ in range(n)
    ]


def test_offline_shards_give_the_online_loss(tiny_llama, chatml, tmp_path):
    """Same sequences, same order: training from capture shards equals training with the target online."""
    from draftsmith.data_pipeline.shards import ShardReader, write_shards

    target = tiny_llama(seed=3, vocab_size=len(chatml))
    write_shards(
        target,
        chatml,
        conversations(10),
        tmp_path / "capture",
        aux_layer_ids=(1, 2, 3),
        max_length=48,
        shard_size=4,
        batch_size=3,
        target_name="tiny",
        progress=False,
    )
    reader = ShardReader(tmp_path / "capture")
    seqs = list(reader)
    assert reader.lengths() == [s.input_ids.numel() for s in seqs]
    online = RenderedDataset([s.input_ids for s in seqs], [s.loss_mask for s in seqs])
    vmap = build_vocab_map(
        count_tokens(online.input_ids, online.loss_mask, len(chatml)), 128, always_include=[chatml.eos_token_id]
    )
    head_cfg = HeadConfig(ttt_steps=3, aux_layer_ids=[1, 2, 3], prompt_loss_weight=0.25)
    cfg = TrainConfig(
        mixed_precision="no",
        max_steps=4,
        batch_size=4,
        micro_batch_size=2,
        lr=3e-3,
        warmup_steps=1,
        log_every=1,
        group_by_length=True,
    )
    a = train_eagle3(target, online, vmap, head_cfg, cfg, tmp_path / "online", pad_id=chatml.pad_token_id)
    b = train_eagle3(
        target,
        reader,
        vmap,
        head_cfg,
        TrainConfig(**{**vars(cfg), "mode": "offline"}),
        tmp_path / "offline",
        pad_id=chatml.pad_token_id,
    )
    assert len(a.log) == len(b.log) == 4
    for x, y in zip(a.log, b.log):
        assert x["loss"] == pytest.approx(y["loss"], rel=1e-5)
        assert [x[f"acc_{i}"] for i in range(3)] == pytest.approx([y[f"acc_{i}"] for i in range(3)], abs=1e-6)
    for (name, p), q in zip(a.head.named_parameters(), b.head.parameters()):
        torch.testing.assert_close(p, q, rtol=1e-4, atol=1e-6, msg=name)
    with pytest.raises(ValueError, match="aux layers"):
        train_eagle3(target, reader, vmap, HeadConfig(aux_layer_ids=[0, 1, 2]), cfg, tmp_path / "x", pad_id=0)


def test_right_padding_changes_neither_states_nor_loss(tiny_llama):
    """Padding sits after the real tokens: the target's states there, the TTT loss and its counts are
    those of the unpadded sequence (position ids 0..len-1 in both)."""
    from draftsmith.data_pipeline.capture import capture
    from draftsmith.data_pipeline.dataset import pad_batch
    from draftsmith.drafters.eagle3.train import build_head
    from draftsmith.drafters.eagle3.ttt import ttt_loss

    target = tiny_llama(seed=7)
    data = make_data(n=2)
    vmap = build_vocab_map(count_tokens(data.input_ids, data.loss_mask, 96), 64, always_include=[1])
    head = build_head(target, vmap, HeadConfig(ttt_steps=3, aux_layer_ids=[1, 2, 3]))
    short, long_ = data.input_ids[1], data.input_ids[0]
    assert short.numel() < long_.numel()
    alone_ids, alone_attn, alone_mask = pad_batch([short], [data.loss_mask[1]], 0)
    both_ids, both_attn, both_mask = pad_batch([short, long_], [data.loss_mask[1], data.loss_mask[0]], 0)
    t = short.numel()
    alone = capture(target, alone_ids, (1, 2, 3), attention_mask=alone_attn)
    both = capture(target, both_ids, (1, 2, 3), attention_mask=both_attn)
    torch.testing.assert_close(both.aux_hidden[:1, :t], alone.aux_hidden, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(both.target_logits[:1, :t], alone.target_logits, rtol=1e-5, atol=1e-5)
    for w in (0.0, 0.5):
        ref = ttt_loss(
            head,
            alone.aux_hidden,
            alone_ids,
            alone.target_logits,
            alone_mask,
            attention_mask=alone_attn,
            prompt_loss_weight=w,
        )
        padded = ttt_loss(
            head,
            both.aux_hidden[:1],
            both_ids[:1],
            both.target_logits[:1],
            both_mask[:1],
            attention_mask=both_attn[:1],
            prompt_loss_weight=w,
        )
        assert float(padded.loss.detach()) == pytest.approx(float(ref.loss.detach()), rel=1e-5)
        assert padded.step_count == ref.step_count


def test_micro_batches_do_not_depend_on_the_world_size():
    """1 process x 4 accumulation steps, 2 x 2 and 4 x 1 read the same micro-batches at every step."""
    from draftsmith.train.batches import StepSchedule, batches_for_epoch

    lengths = [random.Random(i).randint(5, 50) for i in range(37)]
    one = StepSchedule(37, 8, 2, 1, seed=3, lengths=lengths)
    assert one.grad_accum == 4 and one.steps_per_epoch == 5  # 4 full batches + the last 5 cut to 4
    for world in (2, 4):
        many = StepSchedule(37, 8, 2, world, seed=3, lengths=lengths)
        assert many.steps_per_epoch == one.steps_per_epoch and many.grad_accum == 4 // world
        for step in range(12):
            merged = [mb for r in range(world) for mb in many.micro_batches(step, r)]
            assert merged == one.micro_batches(step, 0)
    plain = StepSchedule(37, 8, 8, 1, seed=3)  # no accumulation: the old batches
    assert [plain.micro_batches(s, 0)[0] for s in range(5)] == batches_for_epoch(37, 8, 3, 0)
    with pytest.raises(ValueError, match="multiple"):
        StepSchedule(37, 8, 3, 2, seed=0)


def test_launches_that_differ_from_the_recipe_are_refused(monkeypatch):
    """What `accelerate launch --cpu --num_processes 2` gives (one plain process) is refused when the
    recipe asks for 2 processes or a distributed strategy."""
    from accelerate import Accelerator

    from draftsmith.train.distributed import LaunchError, check_launch

    acc = Accelerator(cpu=True)
    assert check_launch(acc) == "single" and check_launch(acc, "single", 1) == "single"
    with pytest.raises(LaunchError, match="expects 2 processes"):
        check_launch(acc, "auto", 2)
    with pytest.raises(LaunchError, match="asks for strategy 'ddp'"):
        check_launch(acc, "ddp")
    monkeypatch.setenv("ACCELERATE_USE_FSDP", "true")  # an FSDP config on one process
    with pytest.raises(LaunchError, match="single process"):
        check_launch(acc)
    monkeypatch.setenv("FSDP_VERSION", "1")
    with pytest.raises(LaunchError, match="fsdp_version: 2"):
        check_launch(acc, "fsdp")


def test_inloop_acceptance_is_the_eval_acceptance(tiny_llama, chatml, tmp_path):
    """τ logged every N steps equals what `draftsmith eval`'s evaluate() reports for the same head and prompts."""
    from draftsmith.core.target import TargetModel
    from draftsmith.data_pipeline.dataset import render_dataset
    from draftsmith.drafters.eagle3.proposer import Eagle3Proposer
    from draftsmith.evaluation.config import EvalConfig
    from draftsmith.evaluation.heldout import EvalRow, evaluate
    from draftsmith.train.acceptance import heldout_prompts
    from draftsmith.train.config import AcceptanceConfig

    target = tiny_llama(seed=3, vocab_size=len(chatml))
    data = render_dataset(chatml, conversations(8), 48)
    heldout = conversations(3, seed=9)
    vmap = build_vocab_map(
        count_tokens(data.input_ids, data.loss_mask, len(chatml)), 128, always_include=[chatml.eos_token_id]
    )
    cfg = TrainConfig(
        mixed_precision="no",
        max_steps=4,
        batch_size=4,
        lr=3e-3,
        warmup_steps=1,
        log_every=3,
        acceptance=AcceptanceConfig(every=2, prompts=3, k=3, max_new_tokens=12),
    )
    result = train_eagle3(
        target,
        data,
        vmap,
        HeadConfig(ttt_steps=3, aux_layer_ids=[1, 2, 3]),
        cfg,
        tmp_path,
        pad_id=chatml.pad_token_id,
        heldout=heldout,
        tokenizer=chatml,
    )
    measured = [e for e in result.log if "tau" in e]
    assert [e["step"] for e in measured] == [2, 4] and [e["step"] for e in result.log] == [2, 3, 4]
    tasks = {"heldout": [{"messages": m} for m in heldout_prompts(heldout, 3)]}
    row = EvalRow(lambda: Eagle3Proposer(result.head), 3, TargetModel(target, chatml, aux_layer_ids=(1, 2, 3)))
    report = evaluate(target, chatml, tasks, {"eagle3": row}, EvalConfig(max_new_tokens=12, threads=None))
    row = report["tasks"]["heldout"]["eagle3"]
    assert row["greedy_mismatches"] == 0
    assert measured[-1]["tau"] == pytest.approx(row["tau"]) and measured[-1]["tau"] >= 1.0
    assert measured[-1]["acceptance_rate"] == pytest.approx(row["acceptance_rate"])
    assert [measured[-1][f"accepted_pos{i}"] for i in range(3)] == pytest.approx(row["accepted_per_pos"])


def test_trackers_are_checked(tiny_llama, tmp_path):
    import importlib.util

    target = tiny_llama(seed=7)
    with pytest.raises(ValueError, match="unknown tracker"):
        run(target, make_data(), tmp_path, max_steps=1, trackers=["mlflow"])
    missing = [t for t, mods in trainer.TRACKERS.items() if not any(importlib.util.find_spec(m) for m in mods)]
    for name in missing:
        with pytest.raises(ImportError, match=f"pip install {trainer.TRACKERS[name][0]}"):
            run(target, make_data(), tmp_path, max_steps=1, trackers=[name])


@pytest.mark.skipif(
    __import__("importlib").util.find_spec("wandb") is None,
    reason="wandb is not installed (pip install wandb); offline logging untested here",
)
def test_wandb_offline(tiny_llama, tmp_path, monkeypatch):
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    result = run(tiny_llama(seed=7), make_data(), tmp_path, max_steps=2, wandb_project="draftsmith-test")
    assert result.steps == 2
    assert list((tmp_path / "wandb").glob("offline-run-*")), "wandb wrote no offline run"


@pytest.mark.skipif(
    all(__import__("importlib").util.find_spec(m) is None for m in ("tensorboard", "tensorboardX")),
    reason="tensorboard is not installed (pip install tensorboard); its tracker untested here",
)
def test_tensorboard(tiny_llama, tmp_path):
    run(tiny_llama(seed=7), make_data(), tmp_path, max_steps=2, trackers=["tensorboard"])
    assert list((tmp_path / "logs").rglob("events.out.tfevents.*"))


def test_pipeline_trains_offline_from_capture(tiny_llama, chatml, tmp_path):
    """`draftsmith capture` then `draftsmith train` with train.mode=offline: the head trains from the
    shards, τ is measured on the held-out split and lands in the exported metadata."""
    from draftsmith.config import load_config
    from draftsmith.pipeline.recipe import Recipe
    from draftsmith.pipeline.stages import run_capture, run_train

    source = tmp_path / "conversations.jsonl"
    source.write_text("".join(json.dumps(c) + "\n" for c in conversations(14)))
    recipe = load_config(
        Recipe,
        None,
        [
            f"out_dir={tmp_path / 'runs'}",
            "name=offline",
            f"data.source={source}",
            "data.num_conversations=11",
            "data.heldout_conversations=3",
            "data.regenerate=false",
            "data.max_length=48",
            "data.draft_vocab_size=128",
            "drafter.aux_layer_ids=[1, 2, 3]",
            "drafter.ttt_steps=2",
            "drafter.num_speculative_tokens=2",
            "train.mode=offline",
            "train.max_steps=3",
            "train.batch_size=4",
            "train.micro_batch_size=2",
            "train.warmup_steps=1",
            "train.log_every=1",
            "train.acceptance.every=3",
            "train.acceptance.prompts=2",
            "train.acceptance.k=2",
            "train.acceptance.max_new_tokens=6",
            "capture.shard_size=5",
            "capture.batch_size=2",
            "export.formats=[draftsmith]",
        ],
    )
    target = tiny_llama(seed=3, vocab_size=len(chatml))
    manifest = run_capture(recipe, target, chatml)
    assert manifest["complete"] and manifest["num_sequences"] == 11
    head_dir = run_train(recipe, target, chatml)
    state = json.loads((recipe.run_dir / "train" / "checkpoint" / "state.json").read_text())
    assert state["step"] == 3 and state["extra"]["mode"] == "offline" and state["extra"]["strategy"] == "single"
    log = json.loads((recipe.run_dir / "train" / "train_log.json").read_text())
    assert "tau" in log[-1] and log[-1]["tau"] >= 1.0
    meta = json.loads((head_dir / "draftsmith.json").read_text())
    assert meta["training"]["final"]["tau"] == log[-1]["tau"]
