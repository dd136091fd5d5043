"""A tiny EAGLE-3 (or draft-model) training run for ``accelerate launch`` (used by tests/test_train_distributed.py).

    ACCELERATE_USE_CPU=1 accelerate launch --config_file recipes/accelerate/ddp.yaml --num_processes 2 \\
        tests/distributed_job.py OUT --strategy ddp --num-processes 2 [--drafter draft_model]

Builds the same tiny target, data and vocab map in every process from fixed seeds, trains a few steps
and writes ``OUT/rank{r}.json`` (log, sharding report, final head checksum) on every rank.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from conftest import (
    make_tiny_llama,  # noqa: E402
    train_eagle3,
)
from draftsmith.data_pipeline.dataset import RenderedDataset  # noqa: E402
from draftsmith.data_pipeline.vocab import build_vocab_map, count_tokens  # noqa: E402
from draftsmith.drafters.eagle3.config import Section as HeadConfig
from draftsmith.train.config import TrainConfig

VOCAB = 96


def make_data(n: int = 16, t: int = 20, seed: int = 0) -> RenderedDataset:
    """``n`` random sequences of lengths t-4..t with the first 5 tokens unsupervised."""
    g = torch.Generator().manual_seed(seed)
    ids = [torch.randint(2, VOCAB, (t - i % 5,), generator=g) for i in range(n)]
    return RenderedDataset(ids, [torch.arange(x.numel()) >= 5 for x in ids])


def run(
    out: Path,
    strategy: str = "auto",
    num_processes: int | None = None,
    steps: int = 4,
    batch_size: int = 4,
    micro_batch_size: int | None = 2,
    ckpt_every: int = 0,
    target_sharding: str = "replicated",
    drafter: str = "eagle3",
):
    """Train the tiny head (or, ``drafter="draft_model"``, a 2-layer draft LM); returns the ``TrainResult``."""
    target = make_tiny_llama(seed=7)
    data = make_data()
    cfg = TrainConfig(
        mixed_precision="no",
        max_steps=steps,
        epochs=4,
        batch_size=batch_size,
        micro_batch_size=micro_batch_size,
        lr=3e-3,
        warmup_steps=2,
        log_every=1,
        ckpt_every=ckpt_every,
        strategy=strategy,
        num_processes=num_processes,
        seed=0,
        target_sharding=target_sharding,
    )
    if drafter == "draft_model":
        from conftest import train_draft_model
        from draftsmith.drafters.draft_model.config import Section as DraftModelConfig

        draft_cfg = DraftModelConfig(
            init_from=None,
            num_hidden_layers=2,
            hidden_size=16,
            intermediate_size=32,
            num_attention_heads=2,
            num_key_value_heads=1,
        )
        return train_draft_model(target, data, draft_cfg, cfg, out, pad_id=0)
    vmap = build_vocab_map(count_tokens(data.input_ids, data.loss_mask, VOCAB), 64, always_include=[1])
    return train_eagle3(target, data, vmap, HeadConfig(ttt_steps=3, aux_layer_ids=[1, 2, 3]), cfg, out, pad_id=0)


def keep_checkpoint_at(step: int, dest: Path) -> None:
    """After the checkpoint of ``step`` is committed, copy it to ``dest`` (later ones overwrite the original)."""
    import shutil

    import draftsmith.train.trainer as trainer

    commit = trainer.commit_checkpoint

    def commit_and_copy(path):
        out = commit(path)
        if json.loads((Path(path) / "state.json").read_text())["step"] == step:
            shutil.copytree(path, dest)
        return out

    trainer.commit_checkpoint = commit_and_copy


def main() -> None:
    """Command line of the module docstring."""
    parser = argparse.ArgumentParser()
    parser.add_argument("out", type=Path)
    parser.add_argument("--strategy", default="auto")
    parser.add_argument("--num-processes", type=int, default=None)
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--ckpt-every", type=int, default=0)
    parser.add_argument("--micro-batch-size", type=int, default=2)
    parser.add_argument("--target-sharding", default="replicated")
    parser.add_argument("--snapshot-at", type=int, default=None, help="copy the checkpoint of this step aside")
    parser.add_argument("--drafter", default="eagle3", choices=["eagle3", "draft_model"])
    args = parser.parse_args()
    torch.set_num_threads(1)
    if args.snapshot_at:
        keep_checkpoint_at(args.snapshot_at, args.out / f"checkpoint-step{args.snapshot_at}")
    result = run(
        args.out,
        args.strategy,
        args.num_processes,
        args.steps,
        micro_batch_size=args.micro_batch_size,
        ckpt_every=args.ckpt_every,
        target_sharding=args.target_sharding,
        drafter=args.drafter,
    )
    import torch.distributed as dist

    rank = dist.get_rank() if dist.is_initialized() else 0
    checksum = {n: float(p.detach().double().sum()) for n, p in result.head.named_parameters()}
    (args.out / f"rank{rank}.json").write_text(
        json.dumps({"log": result.log, "sharding": result.sharding, "checksum": checksum}, indent=1)
    )
    if dist.is_initialized():
        dist.barrier()
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
