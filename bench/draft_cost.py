"""Cost of one draft step of each drafter relative to one target forward (the speedup's denominator).

Prints median milliseconds (interleaved repetitions, fixed torch threads) of: a target forward over 1
and over k+1 new tokens after a C-token cache, an EAGLE-3 chain step, and a draft-model forward over
1 token; and the ratios to the target's 1-token forward. With acceptance length τ, a chain of k drafts
costs about k * draft_step + verify(k+1) for τ tokens, against τ * target_step without speculation.

Run: python bench/draft_cost.py [--head runs/reference-eagle3/head] [--threads 2] [--context 256] [--k 5]
"""

from __future__ import annotations

import json
import statistics
import time

import torch

from draftsmith.arguments import ArgumentParser, run_guarded
from draftsmith.core.target import TargetModel
from draftsmith.drafters.eagle3.check import load_eagle3
from draftsmith.drafters.eagle3.head import Eagle3Config, Eagle3Head, HeadKV
from draftsmith.models import load_causal_lm


def median_ms(fn, repeats: int) -> float:
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times) * 1e3


@torch.inference_mode()
def main(argv=None) -> None:
    p = ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--target", default="reference")
    p.add_argument("--draft-model", default="reference-draft")
    p.add_argument("--head", default=None, help="exported head dir (default: an untrained head of the same shape)")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--context", type=int, default=256)
    p.add_argument("--k", type=int, default=5)
    p.add_argument("--repeats", type=int, default=30)
    a = p.parse_args(argv)
    torch.set_num_threads(a.threads)
    model, tok = load_causal_lm(a.target)
    if a.head:
        head, _ = load_eagle3(a.head, model, tok)
    else:
        head = Eagle3Head(Eagle3Config.from_target(model.config)).eval()
        head.bind_embedding(model.get_input_embeddings())
    draft, _ = load_causal_lm(a.draft_model)
    g = torch.Generator().manual_seed(0)
    ctx = torch.randint(3, model.config.vocab_size, (a.context,), generator=g)
    target = TargetModel(model, aux_layer_ids=head.config.aux_layer_ids)
    cache = target.new_cache()
    step = target.forward(ctx, cache)
    drafter = TargetModel(draft)
    dcache = drafter.new_cache()
    drafter.forward(ctx, dcache)
    kv = HeadKV()
    head.step(head.fuse(step.aux_hidden[None]), ctx[None], kv, "prefix")
    hidden = torch.zeros(1, 1, head.config.hidden_size)

    def target_n(n):
        def run():
            target.forward(ctx[:n], cache)
            cache.crop(a.context)

        return run

    def head_chain():
        head.step(hidden, ctx[None, :1], kv, "chain")
        kv.reset_chain()

    def draft_1():
        drafter.forward(ctx[:1], dcache)
        dcache.crop(a.context)

    out = {
        "threads": a.threads,
        "context": a.context,
        "k": a.k,
        "target_1_ms": median_ms(target_n(1), a.repeats),
        f"target_{a.k + 1}_ms": median_ms(target_n(a.k + 1), a.repeats),
        "eagle3_step_ms": median_ms(head_chain, a.repeats),
        "draft_model_step_ms": median_ms(draft_1, a.repeats),
    }
    base = out["target_1_ms"]
    out["ratios_to_target_1"] = {k: v / base for k, v in out.items() if k.endswith("_ms")}
    print(json.dumps(out, indent=1))


if __name__ == "__main__":
    raise SystemExit(run_guarded("python bench/draft_cost.py", main))  # one line per error
