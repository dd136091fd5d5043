"""Offline capture throughput against the plain no-grad target forward, and peak RSS as the dataset grows.

Prints, as medians of interleaved repetitions with fixed torch threads:
  forward_tokens_per_s   the target's plain forward (no grad, logits at every position, no hidden states
                         kept) over exactly the padded batches capture runs, already rendered and tokenized;
  capture_tokens_per_s   ``write_shards`` end to end into a fresh folder: render + mask, forward, stream the
                         shards to disk, validate, hash, manifest;
  capture_over_forward   their ratio (issue 4 asks capture to keep >= 0.85 of the plain forward);
  forward_last_logit_... the same forward computing logits at the last position only
                         (``logits_to_keep=1``, the arithmetic capture does): capture's own overhead;
and the peak RSS during a capture of the N conversations and of them repeated 4 times (4N: the dataset
grows, its longest batch does not), each in a fresh subprocess whose peak is reset after loading (so
loading's own peak does not hide it), next to the RSS before capture: capture streams, so the peak
follows the largest batch, not the dataset. Tokens are real tokens (padding
excluded), the manifest's ``num_tokens``. The plain forward computes logits at every position; capture
keeps the final hidden state instead (``shards.py``), so on a small-model/large-vocab target it does
less arithmetic and pays for rendering, copies and disk writes with it.

Run: python bench/capture.py [--target reference] [--conversations 64] [--threads 2] [--repeats 3]
"""

from __future__ import annotations

import argparse
import json
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

from draftsmith.arguments import ArgumentParser, run_guarded
from draftsmith.core.aux_layers import default_aux_layer_ids
from draftsmith.data_pipeline.dataset import load_conversations, pad_batch
from draftsmith.data_pipeline.shards import _render_shard, write_shards
from draftsmith.models import load_causal_lm


def memory_mb() -> dict[str, float]:
    """This process's resident set now and its peak, in MiB (Linux ``/proc/self/status`` VmRSS and VmHWM;
    elsewhere both are ``ru_maxrss``, the peak since the start)."""
    try:
        fields = dict(line.split(":", 1) for line in Path("/proc/self/status").read_text().splitlines())
        return {"rss": int(fields["VmRSS"].split()[0]) / 1024, "peak": int(fields["VmHWM"].split()[0]) / 1024}
    except (OSError, KeyError, ValueError):
        peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
        return {"rss": peak, "peak": peak}


def reset_peak_rss() -> bool:
    """Restart the peak (VmHWM) from the current RSS (Linux >= 4.0: ``echo 5 > /proc/self/clear_refs``),
    so a capture's peak is not hidden by the higher one of loading the model."""
    try:
        Path("/proc/self/clear_refs").write_text("5")
        return True
    except OSError:
        return False


def plain_batches(tokenizer, conversations, max_length: int, shard_size: int, batch_size: int, pad_id: int):
    """The (input_ids [B, T], attention_mask [B, T]) batches ``write_shards`` forwards, and their real tokens."""
    batches, tokens = [], 0
    for lo in range(0, len(conversations), shard_size):
        seqs, _, _ = _render_shard(
            tokenizer, conversations, lo, min(len(conversations), lo + shard_size), max_length, None
        )
        for b in range(0, len(seqs), batch_size):
            chunk = seqs[b : b + batch_size]
            ids, attn, _ = pad_batch([s[1] for s in chunk], [s[2] for s in chunk], pad_id)
            batches.append((ids, attn))
            tokens += sum(s[1].numel() for s in chunk)
    return batches, tokens


def capture_once(model, tokenizer, conversations, a, aux) -> tuple[float, int]:
    """(seconds, tokens) of one ``write_shards`` into a fresh temporary folder."""
    with tempfile.TemporaryDirectory(dir=a.tmp) as out:
        t0 = time.perf_counter()
        manifest = write_shards(
            model,
            tokenizer,
            conversations,
            Path(out) / "capture",
            aux,
            max_length=a.max_length,
            shard_size=a.shard_size,
            batch_size=a.batch_size,
            target_name=a.target,
            progress=False,
        )
        return time.perf_counter() - t0, manifest["num_tokens"]


def rss_worker(a) -> None:
    """Subprocess body: load, capture the N conversations repeated ``a.rss_worker`` times, print RSS as JSON.

    Repeating the same conversations grows the dataset without changing its longest batch, which is
    what bounds a streaming capture's memory."""
    torch.set_num_threads(a.threads)
    model, tok = load_causal_lm(a.target, dtype=a.dtype)
    conversations = (
        load_conversations("reference:train" if a.source is None else a.source, limit=a.conversations) * a.rss_worker
    )
    aux = default_aux_layer_ids(model.config.get_text_config().num_hidden_layers)
    loaded = memory_mb()
    reset = reset_peak_rss()
    _, tokens = capture_once(model, tok, conversations, a, aux)
    print(
        json.dumps(
            {
                "conversations": len(conversations),
                "tokens": tokens,
                "rss_before_capture_mb": round(loaded["rss"], 1),
                "peak_rss_during_capture_mb" if reset else "peak_rss_mb": round(memory_mb()["peak"], 1),
                "peak_rss_including_load_mb": round(loaded["peak"], 1),
            }
        )
    )


@torch.no_grad()
def main(argv=None) -> None:
    p = ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--target", default="reference")
    p.add_argument("--dtype", default="float32")
    p.add_argument("--source", default=None, help="conversations (.jsonl/.json); default reference:train")
    p.add_argument("--conversations", type=int, default=64, help="N: the timed dataset; RSS at N and 4N")
    p.add_argument("--max-length", type=int, default=640)
    p.add_argument("--shard-size", type=int, default=32)
    p.add_argument("--batch-size", type=int, default=8)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--tmp", default=None, help="folder for the shards (default: the system's temp dir)")
    p.add_argument("--rss-worker", type=int, default=None, help=argparse.SUPPRESS)
    a = p.parse_args(argv)
    if a.rss_worker is not None:
        return rss_worker(a)
    torch.set_num_threads(a.threads)
    model, tok = load_causal_lm(a.target, dtype=a.dtype)
    conversations = load_conversations("reference:train" if a.source is None else a.source, limit=a.conversations)
    aux = default_aux_layer_ids(model.config.get_text_config().num_hidden_layers)
    pad_id = next(i for i in (tok.pad_token_id, tok.eos_token_id, 0) if i is not None)
    batches, tokens = plain_batches(tok, conversations, a.max_length, a.shard_size, a.batch_size, pad_id)

    def plain_forward(**kwargs) -> float:
        t0 = time.perf_counter()
        for ids, attn in batches:
            model(input_ids=ids, attention_mask=attn, use_cache=False, **kwargs)
        return time.perf_counter() - t0

    plain_forward()  # warm-up (allocator, kernels, page cache)
    capture_once(model, tok, conversations, a, aux)
    forward_s, last_logit_s, capture_s, captured = [], [], [], 0
    for _ in range(a.repeats):  # interleaved: load drifts hit all three
        forward_s.append(plain_forward())
        last_logit_s.append(plain_forward(logits_to_keep=1))
        seconds, captured = capture_once(model, tok, conversations, a, aux)
        capture_s.append(seconds)
    assert captured == tokens, (captured, tokens)
    forward_tps, capture_tps = tokens / statistics.median(forward_s), tokens / statistics.median(capture_s)
    last_logit_tps = tokens / statistics.median(last_logit_s)

    rss = []
    peak = lambda r: r.get("peak_rss_during_capture_mb", r.get("peak_rss_mb"))  # noqa: E731
    for times in (1, 4):
        cmd = [sys.executable, __file__, "--rss-worker", str(times)] + [
            f"--{k.replace('_', '-')}={v}"
            for k, v in vars(a).items()
            if k not in ("rss_worker", "repeats") and v is not None
        ]
        rss.append(json.loads(subprocess.run(cmd, check=True, capture_output=True, text=True).stdout.splitlines()[-1]))
    print(
        json.dumps(
            {
                "target": a.target,
                "dtype": a.dtype,
                "threads": a.threads,
                "conversations": len(conversations),
                "tokens": tokens,
                "batch_size": a.batch_size,
                "shard_size": a.shard_size,
                "max_length": a.max_length,
                "aux_layer_ids": list(aux),
                "repeats": a.repeats,
                "forward_tokens_per_s": round(forward_tps),
                "capture_tokens_per_s": round(capture_tps),
                "capture_over_forward": round(capture_tps / forward_tps, 3),
                "forward_last_logit_tokens_per_s": round(last_logit_tps),
                "capture_over_forward_last_logit": round(capture_tps / last_logit_tps, 3),
                "forward_s": [round(s, 3) for s in forward_s],
                "forward_last_logit_s": [round(s, 3) for s in last_logit_s],
                "capture_s": [round(s, 3) for s in capture_s],
                "rss": rss,
                "peak_rss_growth_4x_mb": round(peak(rss[1]) - peak(rss[0]), 1),
            },
            indent=1,
        )
    )


if __name__ == "__main__":
    raise SystemExit(run_guarded("python bench/capture.py", main))  # one line per error
