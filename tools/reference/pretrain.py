"""Pretrain the reference target (or its draft sibling): a transformers LlamaForCausalLM on CPython code.

Steps:
  1. tokenize the corpus once into token streams (train: code modules and rendered chat examples,
     shuffled, separated by ``<|endoftext|>``; held-out: code, and chat with the answer mask);
  2. train with accelerate (bf16 autocast where the device computes bf16 natively, else fp32: the
     rule of ``draftsmith.precision``), AdamW(0.9, 0.95), warmup + cosine, random ``seq_len`` windows
     drawn from a generator seeded by (seed, step), so resuming from a checkpoint replays exactly
     the batches the uninterrupted run would have drawn;
  3. evaluate held-out loss on plain code and on chat answers every ``eval_every`` steps;
  4. save ``out_dir/model`` as a transformers model directory (bf16 weights + tokenizer).

Run (exact commands in reference/REPRODUCE.md):
  python tools/reference/pretrain.py tools/reference/pretrain_target.yaml
"""

from __future__ import annotations

import json
import math
import random
import time
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch
from tqdm.auto import tqdm

from draftsmith.arguments import ArgumentParser, run_guarded
from draftsmith.config import load_config, to_dict
from draftsmith.data_pipeline.chat import render, render_text
from draftsmith.precision import resolve_mixed_precision
from draftsmith.train.checkpoint import load_checkpoint, save_checkpoint


@dataclass
class ModelShape:
    """Geometry of the LlamaForCausalLM to pretrain."""

    hidden_size: int = 384
    num_hidden_layers: int = 8
    intermediate_size: int = 960
    num_attention_heads: int = 6
    num_key_value_heads: int = 2
    max_position_embeddings: int = 2048
    rope_theta: float = 10000.0


@dataclass
class PretrainConfig:
    """Everything one pretraining run needs; paths are relative to the working directory."""

    corpus_dir: Path = Path(".cache/reference/corpus")
    tokenizer_dir: Path = Path(".cache/reference/tokenizer")
    out_dir: Path = Path(".cache/reference/target-run")
    model: ModelShape = field(default_factory=ModelShape)
    seq_len: int = 512
    batch_size: int = 8
    steps: int = 3000
    lr: float = 1.5e-3
    min_lr_ratio: float = 0.1
    warmup_steps: int = 100
    weight_decay: float = 0.1
    grad_clip: float = 1.0
    seed: int = 0
    eval_every: int = 500
    eval_windows: int = 64
    eval_chat_examples: int = 200
    ckpt_every: int = 100
    threads: int = 2
    mixed_precision: str = "auto"  #: draftsmith.precision rule: bf16 where native (measured), else fp32


def build_streams(cfg: PretrainConfig, tokenizer) -> dict[str, np.ndarray]:
    """Token streams (uint16) cached under ``out_dir/data``: ``train``, ``heldout_code``."""
    data_dir = cfg.out_dir / "data"
    names = ("train", "heldout_code")
    if all((data_dir / f"{n}.npy").exists() for n in names):
        return {n: np.load(data_dir / f"{n}.npy") for n in names}
    data_dir.mkdir(parents=True, exist_ok=True)
    eot = tokenizer.convert_tokens_to_ids("<|endoftext|>")
    docs = [json.loads(line)["text"] for line in (cfg.corpus_dir / "train_code.jsonl").open()]
    docs += [
        render_text(tokenizer, json.loads(line)["messages"]) for line in (cfg.corpus_dir / "train_chat.jsonl").open()
    ]
    random.Random(cfg.seed).shuffle(docs)
    held = [json.loads(line)["text"] for line in (cfg.corpus_dir / "heldout_code.jsonl").open()]
    out = {}
    for name, texts in (("train", docs), ("heldout_code", held)):
        ids = []
        for batch_start in tqdm(range(0, len(texts), 512), desc=f"tokenize {name}"):
            for enc in tokenizer(texts[batch_start : batch_start + 512], add_special_tokens=False)["input_ids"]:
                ids.extend(enc + [eot])
        arr = np.asarray(ids, dtype=np.uint16)
        np.save(data_dir / f"{name}.npy", arr)
        out[name] = arr
    return out


def batch_at(stream: np.ndarray, step: int, cfg: PretrainConfig) -> torch.Tensor:
    """The batch of step ``step``: [batch_size, seq_len] int64 windows, a pure function of (seed, step)."""
    g = torch.Generator().manual_seed(cfg.seed * 1_000_003 + step)
    starts = torch.randint(0, len(stream) - cfg.seq_len, (cfg.batch_size,), generator=g)
    return torch.stack([torch.from_numpy(stream[s : s + cfg.seq_len].astype(np.int64)) for s in starts.tolist()])


def lr_at(step: int, cfg: PretrainConfig) -> float:
    """Linear warmup then cosine decay to ``min_lr_ratio * lr``."""
    if step < cfg.warmup_steps:
        return cfg.lr * (step + 1) / cfg.warmup_steps
    frac = (step - cfg.warmup_steps) / max(1, cfg.steps - cfg.warmup_steps)
    return cfg.lr * (cfg.min_lr_ratio + (1 - cfg.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * min(1.0, frac))))


@torch.no_grad()
def evaluate(model, tokenizer, streams, cfg: PretrainConfig, accelerator) -> dict:
    """Held-out mean loss and perplexity on plain code windows and on chat answers (assistant tokens)."""
    model.eval()
    code = streams["heldout_code"]
    n = min(cfg.eval_windows, len(code) // cfg.seq_len)
    losses = []
    for i in range(n):
        start = i * (len(code) - cfg.seq_len) // max(1, n - 1)
        x = torch.from_numpy(code[start : start + cfg.seq_len].astype(np.int64))[None]
        with accelerator.autocast():
            losses.append(model(input_ids=x, labels=x).loss.float().item())
    chats = [json.loads(line)["messages"] for line in (cfg.corpus_dir / "heldout_chat.jsonl").open()]
    chats = random.Random(cfg.seed).sample(chats, min(cfg.eval_chat_examples, len(chats)))
    tot, cnt = 0.0, 0
    for messages in chats:
        r = render(tokenizer, messages, max_length=cfg.seq_len * 2)
        labels = torch.where(r.loss_mask, r.input_ids, torch.full_like(r.input_ids, -100))[None]
        with accelerator.autocast():
            logits = model(input_ids=r.input_ids[None]).logits.float()
        lp = torch.nn.functional.cross_entropy(logits[0, :-1], labels[0, 1:], ignore_index=-100, reduction="sum")
        tot += lp.item()
        cnt += int((labels[0, 1:] != -100).sum())
    model.train()
    code_loss = float(np.mean(losses))
    chat_loss = tot / max(1, cnt)
    return {
        "heldout_code_loss": code_loss,
        "heldout_code_ppl": math.exp(code_loss),
        "heldout_chat_answer_loss": chat_loss,
        "heldout_chat_answer_ppl": math.exp(chat_loss),
        "chat_answer_tokens": cnt,
    }


def build_model(cfg: PretrainConfig, tokenizer):
    """A fresh LlamaForCausalLM of ``cfg.model``'s shape over ``tokenizer``'s vocabulary (tied embeddings)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    m = cfg.model
    config = LlamaConfig(
        vocab_size=len(tokenizer),
        hidden_size=m.hidden_size,
        num_hidden_layers=m.num_hidden_layers,
        intermediate_size=m.intermediate_size,
        num_attention_heads=m.num_attention_heads,
        num_key_value_heads=m.num_key_value_heads,
        max_position_embeddings=m.max_position_embeddings,
        rope_theta=m.rope_theta,
        tie_word_embeddings=True,
        bos_token_id=None,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
    )
    torch.manual_seed(cfg.seed)
    return LlamaForCausalLM(config)


def pretrain(cfg: PretrainConfig) -> dict:
    """Run (or resume) pretraining; returns the final held-out metrics and writes ``out_dir/model``."""
    from accelerate import Accelerator
    from transformers import AutoTokenizer

    torch.set_num_threads(cfg.threads)
    tokenizer = AutoTokenizer.from_pretrained(cfg.tokenizer_dir)
    streams = build_streams(cfg, tokenizer)
    choice = resolve_mixed_precision(cfg.mixed_precision)
    precision = choice.value
    print(f"mixed precision {precision}: {choice.reason}")
    accelerator = Accelerator(mixed_precision=precision, cpu=not torch.cuda.is_available())
    model = build_model(cfg, tokenizer)
    opt = torch.optim.AdamW(model.parameters(), lr=cfg.lr, betas=(0.9, 0.95), weight_decay=cfg.weight_decay)
    ckpt = cfg.out_dir / "checkpoint"
    start, log = 0, []
    if (ckpt / "state.json").exists():
        state = load_checkpoint(ckpt, model, opt)
        start, log = state["step"], state["extra"].get("log", [])
        accelerator.print(f"resumed from {ckpt} at step {start}")
    model, opt = accelerator.prepare(model, opt)
    n_params = sum(p.numel() for p in model.parameters())
    accelerator.print(
        f"{n_params / 1e6:.2f}M parameters, {len(streams['train']) / 1e6:.2f}M train tokens, precision {precision}"
    )
    bar = tqdm(range(start, cfg.steps), initial=start, total=cfg.steps, disable=not accelerator.is_main_process)
    t0, tokens = time.time(), 0
    for step in bar:
        for g in opt.param_groups:
            g["lr"] = lr_at(step, cfg)
        x = batch_at(streams["train"], step, cfg)
        with accelerator.autocast():
            loss = model(input_ids=x, labels=x).loss
        accelerator.backward(loss)
        accelerator.clip_grad_norm_(model.parameters(), cfg.grad_clip)
        opt.step()
        opt.zero_grad(set_to_none=True)
        tokens += x.numel()
        bar.set_postfix(loss=f"{loss.item():.3f}", tok_s=f"{tokens / (time.time() - t0):.0f}")
        done = step + 1
        if done % cfg.eval_every == 0 or done == cfg.steps:
            metrics = evaluate(model, tokenizer, streams, cfg, accelerator)
            log.append({"step": done, "train_loss": loss.item(), **metrics})
            accelerator.print(json.dumps(log[-1]))
        if done % cfg.ckpt_every == 0 or done == cfg.steps:
            save_checkpoint(
                ckpt, accelerator.unwrap_model(model), opt, step=done, extra={"log": log, "config": to_dict(cfg)}
            )
    final = log[-1] if log else evaluate(model, tokenizer, streams, cfg, accelerator)
    export_model(accelerator.unwrap_model(model), tokenizer, cfg.out_dir / "model")
    (cfg.out_dir / "metrics.json").write_text(json.dumps({"params": n_params, "log": log, "final": final}, indent=1))
    return final


def export_model(model, tokenizer, out: Path) -> None:
    """Save bf16 weights, config and tokenizer as a transformers model directory (atomic rename)."""
    tmp = out.with_name(out.name + ".tmp")
    model = model.to(torch.bfloat16)
    model.config.dtype = "bfloat16"
    model.save_pretrained(tmp)
    tokenizer.save_pretrained(tmp)
    model.float()
    if out.exists():
        import shutil

        shutil.rmtree(out)
    tmp.rename(out)


def export_checkpoint(cfg: PretrainConfig, out: Path) -> None:
    """Write the latest checkpoint of a (possibly still running) pretraining as a model directory."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(cfg.tokenizer_dir)
    model = build_model(cfg, tokenizer)
    state = load_checkpoint(cfg.out_dir / "checkpoint", model)
    export_model(model, tokenizer, out)
    print(f"exported step {state['step']} to {out}")


def main(argv=None) -> None:
    p = ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("config", type=Path)
    p.add_argument("overrides", nargs="*", help="dotted overrides, e.g. steps=100")
    p.add_argument(
        "--export-checkpoint",
        type=Path,
        default=None,
        help="only write the latest checkpoint as a model directory at this path",
    )
    a = p.parse_args(argv)
    cfg = load_config(PretrainConfig, a.config, a.overrides)
    if a.export_checkpoint:
        export_checkpoint(cfg, a.export_checkpoint)
    else:
        print(json.dumps(pretrain(cfg)))


if __name__ == "__main__":
    raise SystemExit(run_guarded("python tools/reference/pretrain.py", main))  # one line per error
