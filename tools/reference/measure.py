"""Measure the reference models: size, forward cost of 6 vs 1 new tokens, and output diversity.

Printed as JSON (these are the figures REPRODUCE.md and the reference issue report):
  params                      parameters of target and draft sibling
  forward_ms_1 / forward_ms_6 median ms of a target forward over 1 / 6 new tokens after a 256-token
                              KV cache (interleaved repetitions, torch threads fixed), and their ratio
  distinct_4gram              mean over code-complete prompts of distinct / total 4-grams in greedy
                              continuations of ``--new-tokens`` tokens (EOS does not stop them here)

Run: ``python tools/reference/measure.py [--threads 2] [--repeats 40] [--prompts 64]``.
"""

from __future__ import annotations

import json
import statistics
import time

import torch

from draftsmith import reference
from draftsmith.arguments import ArgumentParser, run_guarded
from draftsmith.core.generate import GenerationConfig, generate_plain
from draftsmith.core.target import TargetModel
from draftsmith.data_pipeline.chat import prompt_ids


@torch.no_grad()
def forward_cost(model, context: int = 256, new_tokens=(1, 6), repeats: int = 40) -> dict:
    """Median seconds of one forward over n new tokens after ``context`` cached tokens, per n."""
    target = TargetModel(model)
    cache = target.new_cache()
    g = torch.Generator().manual_seed(0)
    target.forward(torch.randint(3, model.config.vocab_size, (context,), generator=g), cache)
    times = {n: [] for n in new_tokens}
    for _ in range(repeats):
        for n in new_tokens:
            ids = torch.randint(3, model.config.vocab_size, (n,), generator=g)
            t0 = time.perf_counter()
            target.forward(ids, cache)
            times[n].append(time.perf_counter() - t0)
            cache.crop(context)
    return {n: statistics.median(ts) for n, ts in times.items()}


def distinct_4gram(tokens: list[int]) -> float:
    grams = [tuple(tokens[i : i + 4]) for i in range(len(tokens) - 3)]
    return len(set(grams)) / max(1, len(grams))


def diversity(model, tokenizer, prompts: int, new_tokens: int) -> float:
    """Mean distinct-4-gram fraction of greedy continuations on the code-complete task."""
    target = TargetModel(model)
    cfg = GenerationConfig(max_new_tokens=new_tokens)  # no EOS: measure the full continuation
    records = reference.tasks(["code-complete"])["code-complete"][:prompts]
    scores = [distinct_4gram(generate_plain(target, prompt_ids(tokenizer, r["messages"]), cfg).tokens) for r in records]
    return sum(scores) / len(scores)


def main(argv=None) -> None:
    p = ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--repeats", type=int, default=40)
    p.add_argument("--prompts", type=int, default=64)
    p.add_argument("--new-tokens", type=int, default=128)
    a = p.parse_args(argv)
    torch.set_num_threads(a.threads)
    target, tok = reference.target()
    draft, _ = reference.draft()
    cost = forward_cost(target, repeats=a.repeats)
    draft_cost = forward_cost(draft, repeats=a.repeats)
    out = {
        "params": {
            "target": sum(p.numel() for p in target.parameters()),
            "draft": sum(p.numel() for p in draft.parameters()),
        },
        "threads": a.threads,
        "forward_ms_1": cost[1] * 1e3,
        "forward_ms_6": cost[6] * 1e3,
        "ratio_6_vs_1": cost[6] / cost[1],
        "draft_forward_ms_1": draft_cost[1] * 1e3,
        "distinct_4gram_code_complete": diversity(target, tok, a.prompts, a.new_tokens),
    }
    print(json.dumps(out, indent=1))


if __name__ == "__main__":
    raise SystemExit(run_guarded("python tools/reference/measure.py", main))  # one line per error
