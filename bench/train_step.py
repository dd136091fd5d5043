"""Overhead of the EAGLE-3 trainer: one training step against the work it cannot avoid.

For the reference target in online mode, each measured step s is timed twice on the same sequences
(the step's micro-batches, padded outside the timing), interleaved so machine noise hits both alike:
  alone  the frozen target's no-grad forward (``capture``) + the head's TTT forward and backward;
  step   ``DrafterTrainer.train_step()`` (EAGLE-3 spec): the same, plus batch assembly, gradient clipping, the AdamW
         step, the schedule, and the cross-rank sums of the logged figures.
Prints median seconds of each part and ratio = median(step) / median(alone), on two clocks: wall time
and this process's CPU time (all threads; unaffected by waiting for a core on a shared machine). The
trainer must stay within 1.3x on the ``--clock`` chosen (exit status 1 otherwise). Single process,
fixed torch threads, the demo recipe's shape (batch 8, 5 TTT steps, aux layers 2/4/7, draft vocab
2048) unless overridden.

Run: python bench/train_step.py [--threads 2] [--steps 8] [--warmup 2] [--batch-size 8] [--precision no] [--clock wall]
"""

from __future__ import annotations

import json
import statistics
import tempfile
import time
from pathlib import Path

import torch

from draftsmith.arguments import ArgumentParser, run_guarded
from draftsmith.data_pipeline.capture import capture
from draftsmith.data_pipeline.dataset import load_conversations, pad_batch, render_dataset
from draftsmith.data_pipeline.vocab import build_vocab_map, count_tokens
from draftsmith.drafters.eagle3.config import Section
from draftsmith.drafters.eagle3.train import Eagle3Spec
from draftsmith.drafters.eagle3.ttt import ttt_loss
from draftsmith.models import load_causal_lm
from draftsmith.train.config import TrainConfig
from draftsmith.train.trainer import DrafterTrainer

LIMIT = 1.3


CLOCKS = {"wall": time.perf_counter, "cpu": time.process_time}


def now() -> dict:
    """Readings of every clock (seconds)."""
    return {name: clock() for name, clock in CLOCKS.items()}


def since(t0: dict) -> dict:
    """Seconds elapsed on every clock since the readings ``t0``."""
    return {name: clock() - t0[name] for name, clock in CLOCKS.items()}


def time_alone(trainer: DrafterTrainer, data, pad_id: int) -> dict:
    """Target no-grad forward + head TTT forward/backward on the next step's micro-batches:
    ``{part: {clock: seconds}}``."""
    head, cfg = trainer.raw.head, trainer.spec.section
    device = trainer.accelerator.device
    parts = {p: dict.fromkeys(CLOCKS, 0.0) for p in ("capture", "head_fwd_bwd")}
    for indices in trainer.schedule.micro_batches(trainer.step, 0):
        ids, attn, mask = pad_batch([data.input_ids[i] for i in indices], [data.loss_mask[i] for i in indices], pad_id)
        ids, attn, mask = ids.to(device), attn.to(device), mask.to(device)
        t0 = now()
        cap = capture(trainer.target, ids, head.config.aux_layer_ids, attention_mask=attn)
        t_capture, t1 = since(t0), now()
        with trainer.accelerator.autocast():
            out = ttt_loss(
                head,
                cap.aux_hidden,
                ids,
                cap.target_logits,
                mask,
                step_decay=cfg.step_decay,
                attention_mask=attn,
                prompt_loss_weight=cfg.prompt_loss_weight,
            )
        out.loss.backward()
        t_head = since(t1)
        for c in CLOCKS:
            parts["capture"][c] += t_capture[c]
            parts["head_fwd_bwd"][c] += t_head[c]
    head.zero_grad(set_to_none=True)
    parts["alone"] = {c: parts["capture"][c] + parts["head_fwd_bwd"][c] for c in CLOCKS}
    return parts


def main(argv=None) -> int:
    """Run the benchmark; returns the exit status (1 when the ratio exceeds the limit)."""
    p = ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--target", default="reference")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--steps", type=int, default=8, help="measured steps")
    p.add_argument("--warmup", type=int, default=2, help="steps run before measuring")
    p.add_argument("--batch-size", type=int, default=8)
    p.add_argument("--micro-batch-size", type=int, default=None)
    p.add_argument("--conversations", type=int, default=160)
    p.add_argument("--max-length", type=int, default=640)
    p.add_argument("--precision", default="no", help="train.mixed_precision: no | bf16")
    p.add_argument("--clock", choices=list(CLOCKS), default="wall", help="clock of the verdict")
    p.add_argument("--json", type=Path, default=None, help="also write the figures here")
    a = p.parse_args(argv)
    torch.set_num_threads(a.threads)
    target, tok = load_causal_lm(a.target)
    data = render_dataset(tok, load_conversations("reference:train", limit=a.conversations), a.max_length)
    vmap = build_vocab_map(
        count_tokens(data.input_ids, data.loss_mask, len(tok)), 2048, always_include=[tok.eos_token_id]
    )
    head_cfg = Section(aux_layer_ids=[2, 4, 7], ttt_steps=5)
    cfg = TrainConfig(
        max_steps=a.warmup + a.steps,
        batch_size=a.batch_size,
        micro_batch_size=a.micro_batch_size,
        lr=2e-3,
        warmup_steps=2,
        threads=a.threads,
        mixed_precision=a.precision,
        log_every=10**9,
    )
    with tempfile.TemporaryDirectory() as out:
        trainer = DrafterTrainer(Eagle3Spec(head_cfg, vmap), target, data, cfg, Path(out), tok.pad_token_id)
        rows = []
        for s in range(a.warmup + a.steps):
            alone = time_alone(trainer, data, tok.pad_token_id)
            t0 = now()
            trainer.train_step()
            if s >= a.warmup:
                rows.append({**alone, "step": since(t0)})
    med = {part: {c: statistics.median(r[part][c] for r in rows) for c in CLOCKS} for part in rows[0]}
    ratio = {c: med["step"][c] / med["alone"][c] for c in CLOCKS}
    print(
        f"reference target, online, batch {a.batch_size}, micro {cfg.micro_batch_size or a.batch_size}, "
        f"precision {a.precision}, {a.threads} threads, {a.steps} steps; median seconds (wall / cpu)"
    )
    names = {
        "capture": "target no-grad forward",
        "head_fwd_bwd": "head TTT forward + backward",
        "alone": "both, measured alone",
        "step": "trainer step",
    }
    for part, label in names.items():
        print(f"  {label:<28} {med[part]['wall']:8.3f} / {med[part]['cpu']:8.3f}")
    for c in CLOCKS:
        per_step = sorted(r["step"][c] / r["alone"][c] for r in rows)
        print(f"  ratio step / alone ({c:<4})   {ratio[c]:.3f}  (per step {per_step[0]:.3f}..{per_step[-1]:.3f})")
    if a.json:
        a.json.write_text(
            json.dumps({"median_s": med, "ratio": ratio, "per_step": rows, "args": vars(a)}, indent=1, default=str)
        )
    if ratio[a.clock] > LIMIT:
        print(
            f"FAIL ({a.clock} clock): the trainer step costs {ratio[a.clock]:.2f}x the forward/backward it cannot "
            f"avoid (limit {LIMIT})"
        )
        return 1
    print(f"ok ({a.clock} clock): {ratio[a.clock]:.3f} <= {LIMIT}")
    return 0


if __name__ == "__main__":
    raise SystemExit(run_guarded("python bench/train_step.py", main))  # one line per error
