"""What a draft tree costs: the target's verify forward over n tokens, and the EAGLE-3 head's drafting.

Prints, for each node count n (the verify forward reads n tokens: the root and n - 1 nodes, with ancestor-only
attention after a C-token context), the median milliseconds of that forward and fwd(n) / fwd(1), next to a chain's
forward over n tokens (causal, no mask: what a chain verify of k = n - 1 costs on a cache without holes); then the
median
milliseconds of drafting a chain of k with the head against drafting each tree shape given. With τ from
``draftsmith eval --tree`` these explain a tree's wall-clock speedup: a step costs draft + fwd(n), and emits τ
tokens on average. Interleaved repetitions, fixed torch threads.

Run: python bench/tree_cost.py --eagle3 runs/reference-eagle3/head [--threads 1] [--context 256]
         [--nodes 1 2 4 6 8 12 16 24 32] [--tree topk=4,num_steps=5,num_draft_tokens=32 ...] [--k 5] [--json F]
"""

from __future__ import annotations

import json
import platform
import statistics
import time

import torch

from draftsmith.arguments import ArgumentParser, run_guarded
from draftsmith.core.batch_cache import BatchKVCache
from draftsmith.core.target import TargetModel
from draftsmith.core.tree import TreeShape
from draftsmith.drafters.eagle3.check import load_eagle3
from draftsmith.drafters.eagle3.proposer import Eagle3Proposer
from draftsmith.models import load_causal_lm


def random_tree(n: int, generator: torch.Generator) -> torch.Tensor:
    """Parents [n] of a random topological tree of n nodes (each node's parent uniform among earlier nodes)."""
    return torch.tensor([int(torch.randint(-1, i, (1,), generator=generator)) for i in range(n)], dtype=torch.long)


@torch.inference_mode()
def main(argv=None) -> int:
    p = ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--target", default="reference")
    p.add_argument("--eagle3", required=True, help="exported EAGLE-3 head directory")
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--context", type=int, default=256)
    p.add_argument("--nodes", type=int, nargs="+", default=[1, 2, 4, 6, 8, 12, 16, 24, 32])
    p.add_argument("--tree", nargs="+", default=["topk=4,num_steps=5,num_draft_tokens=32"])
    p.add_argument("--k", type=int, default=5, help="the chain the trees are compared with")
    p.add_argument("--repeats", type=int, default=30)
    p.add_argument("--json", default=None, help="also write the figures to this JSON file")
    a = p.parse_args(argv)
    torch.set_num_threads(a.threads)
    shapes = [TreeShape.parse(s) for s in a.tree]
    model, tok = load_causal_lm(a.target, dtype="float32")
    head, _ = load_eagle3(a.eagle3, model, tok)
    head = head.float()
    head.bind_embedding(model.get_input_embeddings())
    target = TargetModel(model, aux_layer_ids=head.config.aux_layer_ids)
    gen = torch.Generator().manual_seed(0)
    ctx = torch.randint(3, model.config.vocab_size, (a.context,), generator=gen)

    cache = BatchKVCache(model.config)
    cache.add_empty_row()
    target.forward_batch([ctx], cache)
    cache.commit([a.context])
    trees = {n: random_tree(n - 1, gen) for n in a.nodes}
    tokens = {n: torch.randint(3, model.config.vocab_size, (n,), generator=gen) for n in a.nodes}

    proposer = Eagle3Proposer(head)
    proposer.start(ctx, 5, target.forward(ctx, target.new_cache()))
    verify = {n: [] for n in a.nodes}
    chain = {n: [] for n in a.nodes}
    draft = {"chain": [], **{str(s): [] for s in shapes}}
    for _ in range(a.repeats):  # interleaved: a noisy neighbour hits every row alike
        for n in a.nodes:
            t0 = time.perf_counter()
            target.forward_batch([tokens[n]], cache, trees=[trees[n]] if n > 1 else None)
            verify[n].append(time.perf_counter() - t0)
            cache.commit([1])  # keep the root only: the context stays C + 1 tokens long
            cache.truncate(0, a.context)
            t0 = time.perf_counter()
            target.forward_batch([tokens[n]], cache)
            chain[n].append(time.perf_counter() - t0)
            cache.commit([1])
            cache.truncate(0, a.context)
        t0 = time.perf_counter()
        proposer.propose(a.k)
        draft["chain"].append(time.perf_counter() - t0)
        for s in shapes:
            t0 = time.perf_counter()
            proposer.propose_tree(s, s.num_steps)
            draft[str(s)].append(time.perf_counter() - t0)
    ms = {n: statistics.median(v) * 1e3 for n, v in verify.items()}
    chain_ms = {n: statistics.median(v) * 1e3 for n, v in chain.items()}
    one = ms[min(a.nodes)]
    cpu = platform.processor() or platform.machine()
    print(
        f"torch {torch.__version__}, {a.threads} thread(s), capability {torch.backends.cpu.get_cpu_capability()}, "
        f"{cpu}; target {a.target}, context {a.context} tokens; median of {a.repeats}"
    )
    print(f"{'verify tokens n':>15s} {'tree fwd ms':>12s} {'fwd(n)/fwd(1)':>14s} {'chain fwd ms':>13s}")
    for n in a.nodes:
        print(f"{n:15d} {ms[n]:12.2f} {ms[n] / one:14.2f} {chain_ms[n]:13.2f}")
    draft_ms = {name: statistics.median(v) * 1e3 for name, v in draft.items()}
    print(f"\n{'drafting (EAGLE-3 head)':45s} {'ms':>7s} {'vs chain':>9s}")
    for name, value in draft_ms.items():
        label = f"chain k={a.k}" if name == "chain" else f"tree {name}"
        print(f"{label:45s} {value:7.2f} {value / draft_ms['chain']:8.2f}x")
    if a.json:
        record = {
            "cpu": cpu,
            "capability": torch.backends.cpu.get_cpu_capability(),
            "threads": a.threads,
            "context": a.context,
            "verify_ms": ms,
            "verify_ratio": {n: v / one for n, v in ms.items()},
            "chain_verify_ms": chain_ms,
            "draft_ms": draft_ms,
        }
        with open(a.json, "w") as f:
            json.dump(record, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(run_guarded("python bench/tree_cost.py", main))
