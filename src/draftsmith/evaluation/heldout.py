"""Acceptance evaluation on held-out tasks: every drafter against plain decoding, in one run.

For each task and prompt, plain greedy decoding runs first, then each method on the same prompt
(interleaved, so machine noise hits all of them alike). Per task x method it reports:
  acceptance rate  = accepted draft tokens / draft tokens
  τ                = 1 + accepted / drafts (mean acceptance length, tokens per verify step)
  accepted per position i = drafts whose i-th token was accepted / drafts
  tokens/s, and speedup = plain decode seconds / method seconds (same prompts, same run)
  draft cost per token = seconds spent inside the proposer (start, propose, accept: every drafter
      forward, the prefix steps of a head included; the decode loop's ``VerifyStep.draft_s``) / draft
      tokens proposed, in milliseconds; next to the plain decode's milliseconds per token it says what a
      drafted token costs
With temperature 0 every method must reproduce the plain output token for token; a mismatch is
counted and reported (it would be a bug). Metric definitions follow vLLM's spec-decode metrics.

``eval.batch_size`` > 1 decodes each task's prompts ``batch_size`` at a time with the batched runtime
(``core.batch.generate_batch``: continuous batching), plain first, then each method over the whole task: the
counters are those of one prompt at a time (each sequence drafts and verifies as alone; a test checks it),
tokens/s and speedup are those of the batch, and the draft cost is the time inside the batched proposer.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Callable

import torch
from tqdm.auto import tqdm

from draftsmith.core.batch import generate_batch
from draftsmith.core.generate import GenerationConfig, SpecStats, VerifyStep, generate_plain, generate_speculative
from draftsmith.core.proposer import BatchProposer, PerSequence, Proposer
from draftsmith.core.stops import stop_token_ids
from draftsmith.core.target import TargetModel
from draftsmith.core.tree import TreeShape, best_static_tree, static_tree_tau
from draftsmith.data_pipeline.chat import prompt_ids
from draftsmith.evaluation.config import EvalConfig


@dataclass
class EvalRow:
    """One row of the table: a factory of fresh greedy proposers, the k it drafts per step, and the target
    wrapper exposing the hidden states that drafter reads (``serve.engine.Engine`` builds all three);
    ``make_batch_proposer`` makes the batched proposer (default: ``PerSequence`` over ``make_proposer``);
    ``tree``: the draft tree's shape when the row drafts trees (k is then its depth); ``policy``: adaptive
    speculation's ``core.adaptive.AdaptivePolicy`` (k is then the most a step drafts), shared by the row's prompts
    as a server shares it."""

    make_proposer: Callable[[], Proposer]
    k: int
    target: TargetModel
    make_batch_proposer: Callable[[], BatchProposer] | None = None
    tree: TreeShape | None = None
    policy: object | None = None

    def batch_proposer(self) -> BatchProposer:
        """A fresh batched proposer for this row."""
        if self.make_batch_proposer is not None:
            return self.make_batch_proposer()
        return PerSequence.over(lambda _sampling: self.make_proposer())


class TimedProposer(BatchProposer):
    """A ``BatchProposer`` that adds the seconds spent in each call of ``inner`` to ``seconds``."""

    def __init__(self, inner: BatchProposer):
        self.inner, self.seconds = inner, 0.0
        self.needs_aux_hidden, self.needs_final_hidden = inner.needs_aux_hidden, inner.needs_final_hidden
        self.free_catch_up, self.has_confidence = inner.free_catch_up, inner.has_confidence

    def _timed(self, fn, *args):
        t0 = time.perf_counter()
        try:
            return fn(*args)
        finally:
            self.seconds += time.perf_counter() - t0

    def start(self, *args) -> None:
        self._timed(self.inner.start, *args)

    def propose(self, *args):
        return self._timed(self.inner.propose, *args)

    def propose_tree(self, *args):
        return self._timed(self.inner.propose_tree, *args)

    def confidence(self, *args):
        return self._timed(self.inner.confidence, *args)

    def accept(self, *args) -> None:
        self._timed(self.inner.accept, *args)

    def stop(self, *args) -> None:
        self._timed(self.inner.stop, *args)


@dataclass
class MethodResult:
    """Totals of one method on one task."""

    stats: SpecStats
    seconds: float = 0.0
    draft_seconds: float = 0.0
    new_tokens: int = 0
    mismatches: int = 0
    request_k: list[float] = field(default_factory=list)  #: adaptive rows: each request's mean chosen k

    def add(self, out) -> None:
        """Count one request's ``GenerationResult`` (its tokens, counters and chosen k)."""
        self.new_tokens += len(out.tokens)
        self.stats = self.stats.merge(out.stats)
        if out.stats.mean_chosen_k is not None:
            self.request_k.append(round(out.stats.mean_chosen_k, 3))

    def row(self, plain_seconds: float) -> dict:
        s = self.stats
        drafts = max(1, s.num_drafts)
        return {
            "tau": s.acceptance_length,
            "acceptance_rate": s.acceptance_rate,
            "accepted_per_pos": [a / drafts for a in s.accepted_per_pos],
            "num_drafts": s.num_drafts,
            "num_draft_tokens": s.num_draft_tokens,
            "num_accepted_tokens": s.num_accepted_tokens,
            "new_tokens": self.new_tokens,
            "seconds": self.seconds,
            "tokens_per_s": self.new_tokens / max(self.seconds, 1e-9),
            "speedup": plain_seconds / max(self.seconds, 1e-9),
            "greedy_mismatches": self.mismatches,
            "draft_seconds": self.draft_seconds,
            "draft_ms_per_token": 1000 * self.draft_seconds / s.num_draft_tokens if s.num_draft_tokens else None,
            **(
                {"chosen_k": {str(k): n for k, n in sorted(s.chosen_k.items())}, "mean_chosen_k": s.mean_chosen_k}
                if s.chosen_k
                else {}
            ),
            **({"per_request_mean_chosen_k": self.request_k} if self.request_k else {}),
        }


def evaluate(target_model, tokenizer, tasks: dict[str, list[dict]], rows: dict[str, EvalRow], cfg: EvalConfig) -> dict:
    """Run plain and speculative greedy decoding on every prompt; returns the report dict.

    ``rows`` maps a row label to its ``EvalRow``; generation stops at ``core.stops.stop_token_ids`` (what
    serving stops on) or ``cfg.max_new_tokens``. The time spent in each drafter comes from the decode loop's
    observer hook (``VerifyStep.draft_s``). Report layout: ``{"config", "tasks": {task: {"plain": {...},
    label: row}}, "static_trees"}`` (see ``MethodResult.row``); ``config.k`` is the largest k, ``config.ks`` each
    row's, ``config.trees`` the tree shape of each row drafting trees; such a row also has ``static_tree`` (per
    task) and ``static_trees[label]`` (over every task): the best static tree its counters imply
    (``static_tree_record``).

    Raises:
        ValueError: before anything runs, when a prompt + ``cfg.max_new_tokens`` exceeds the target's position
            limit (the prompts are named)."""
    if cfg.threads:
        torch.set_num_threads(cfg.threads)
    plain_target = TargetModel(target_model, tokenizer)
    gen = GenerationConfig(max_new_tokens=cfg.max_new_tokens, eos_token_ids=stop_token_ids(target_model, tokenizer))
    ks = {label: row.k for label, row in rows.items()}
    report = {
        "config": {
            "k": max(ks.values(), default=0),
            "ks": ks,
            "trees": {label: str(row.tree) for label, row in rows.items() if row.tree is not None},
            "max_new_tokens": cfg.max_new_tokens,
            "methods": list(rows),
        },
        "tasks": {},
    }
    tasks = {
        task: records[: cfg.prompts_per_task] if cfg.prompts_per_task else records for task, records in tasks.items()
    }
    prompts = {task: [prompt_ids(tokenizer, rec["messages"]) for rec in records] for task, records in tasks.items()}
    _check_lengths(tasks, prompts, cfg.max_new_tokens, plain_target.position_limit)
    totals: dict[str, SpecStats] = {}  # tree rows' counters over every task
    for task, records in tasks.items():
        plain_seconds, plain_tokens = 0.0, 0
        results = {label: MethodResult(SpecStats(k=row.k)) for label, row in rows.items()}
        if cfg.batch_size > 1:
            plain_seconds, plain_tokens = _evaluate_batched(plain_target, prompts[task], rows, results, gen, cfg, task)
        for ids in tqdm(prompts[task] if cfg.batch_size == 1 else [], desc=f"eval {task}"):
            t0 = time.perf_counter()
            plain = generate_plain(plain_target, ids, gen)
            plain_seconds += time.perf_counter() - t0
            plain_tokens += len(plain.tokens)
            for label, row in rows.items():
                r = results[label]

                def on_step(step: VerifyStep, r=r) -> None:
                    r.draft_seconds += step.draft_s

                t0 = time.perf_counter()
                out = generate_speculative(
                    row.target, row.make_proposer(), ids, gen, row.k, on_step=on_step, tree=row.tree, policy=row.policy
                )
                r.seconds += time.perf_counter() - t0
                r.add(out)
                r.mismatches += int(out.tokens != plain.tokens)
        report["tasks"][task] = {
            "prompts": len(records),
            "plain": {
                "new_tokens": plain_tokens,
                "seconds": plain_seconds,
                "tokens_per_s": plain_tokens / max(plain_seconds, 1e-9),
                "ms_per_token": 1000 * plain_seconds / max(plain_tokens, 1),
            },
            **{label: r.row(plain_seconds) for label, r in results.items()},
        }
        for label, row in rows.items():
            if row.tree is not None:
                report["tasks"][task][label]["static_tree"] = static_tree_record(results[label].stats, row.tree)
                totals[label] = totals[label].merge(results[label].stats) if label in totals else results[label].stats
    report["static_trees"] = {label: static_tree_record(stats, rows[label].tree) for label, stats in totals.items()}
    return report


def static_tree_record(stats: SpecStats, tree: TreeShape) -> dict:
    """The best static tree of ``tree.num_nodes`` nodes for a tree row's counters (``core.tree.best_static_tree``):
    vLLM's ``speculative_token_tree`` string, its node count and the τ it would have had on these steps (a lower
    bound: only paths the dynamic tree drafted are counted), beside the dynamic tree's τ."""
    static = best_static_tree(stats.accepted_paths, tree.num_nodes)
    return {
        "speculative_token_tree": str(static),
        "num_nodes": len(static),
        "tau_lower_bound": static_tree_tau(stats.accepted_paths, static, stats.num_drafts),
        "dynamic_tau": stats.acceptance_length,
    }


def _evaluate_batched(
    plain_target: TargetModel,
    prompts: list,
    rows: dict[str, EvalRow],
    results: dict[str, MethodResult],
    gen: GenerationConfig,
    cfg: EvalConfig,
    task: str,
) -> tuple[float, int]:
    """One task, ``cfg.batch_size`` sequences at a time: plain, then each row; fills ``results``; returns the
    plain (seconds, new tokens)."""
    t0 = time.perf_counter()
    plain = generate_batch(plain_target, None, prompts, gen, max_num_seqs=cfg.batch_size)
    plain_seconds = time.perf_counter() - t0
    for label, row in tqdm(rows.items(), desc=f"eval {task} (batches of {cfg.batch_size})"):
        r = results[label]
        proposer = TimedProposer(row.batch_proposer())
        t0 = time.perf_counter()
        outs = generate_batch(
            row.target, proposer, prompts, gen, row.k, max_num_seqs=cfg.batch_size, tree=row.tree, policy=row.policy
        )
        r.seconds += time.perf_counter() - t0
        r.draft_seconds += proposer.seconds
        for out, ref in zip(outs, plain):
            r.add(out)
            r.mismatches += int(out.tokens != ref.tokens)
    return plain_seconds, sum(len(p.tokens) for p in plain)


def _check_lengths(
    tasks: dict[str, list[dict]],
    prompts: dict[str, list[list[int]]],
    max_new_tokens: int,
    limit: tuple[str, int] | None,
) -> None:
    """Refuse, before anything runs, prompts whose length + max_new_tokens exceeds the target's position limit
    (``TargetModel.position_limit``), naming them (task/id) and the fix."""
    if limit is None:
        return
    key, n = limit
    long = [
        (f"{task}/{rec.get('id', i)}", len(ids))
        for task, records in tasks.items()
        for i, (rec, ids) in enumerate(zip(records, prompts[task]))
        if len(ids) + max_new_tokens > n
    ]
    if long:
        longest = max(length for _, length in long)
        names = ", ".join(f"{name} ({length} tokens)" for name, length in long[:5])
        fix = (
            f"lower eval.max_new_tokens to {n - longest} or leave them out"
            if longest < n
            else f"leave them out (the longest alone has {longest} tokens)"
        )
        raise ValueError(
            f"{len(long)} eval prompt(s) + max_new_tokens={max_new_tokens} exceed the target's {key} "
            f"({n}): {names}{' ...' if len(long) > 5 else ''}; {fix}"
        )


def format_table(report: dict) -> str:
    """One text table: task x method with τ, acceptance rate, draft cost (ms per drafted token; the plain
    row gives the target's ms per decoded token), tokens/s, speedup vs plain, and for adaptive rows the mean k
    chosen per step."""
    lines = [
        f"{'task':<15}{'method':<16}{'tau':>7}{'accept':>9}{'draft ms/tok':>14}{'tok/s':>9}{'speedup':>9}{'mean k':>8}"
    ]
    for task, rows in report["tasks"].items():
        plain = rows["plain"]
        ms = plain.get("ms_per_token")
        lines.append(
            f"{task:<15}{'plain':<16}{'':>7}{'':>9}{f'({ms:.2f})' if ms is not None else '':>14}"
            f"{plain['tokens_per_s']:>9.1f}{1.0:>8.2f}x"
        )
        for method in report["config"]["methods"]:
            r = rows[method]
            cost, mean_k = r.get("draft_ms_per_token"), r.get("mean_chosen_k")
            lines.append(
                f"{'':<15}{method:<16}{r['tau']:>7.2f}{r['acceptance_rate']:>8.1%}"
                f"{f'{cost:.2f}' if cost is not None else '-':>14}{r['tokens_per_s']:>9.1f}{r['speedup']:>8.2f}x"
                f"{f'{mean_k:.2f}' if mean_k is not None else '':>8}"
            )
    return "\n".join(lines)


def plot_acceptance(report: dict, path) -> None:
    """PNG of acceptance per draft position (one panel per task, one line per method)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    tasks = list(report["tasks"])
    fig, axes = plt.subplots(1, len(tasks), figsize=(4 * len(tasks), 3.4), sharey=True, squeeze=False)
    for ax, task in zip(axes[0], tasks):
        for method in report["config"]["methods"]:
            per_pos = report["tasks"][task][method]["accepted_per_pos"]
            ax.plot(
                range(1, len(per_pos) + 1),
                per_pos,
                marker="o",
                label=f"{method} (τ={report['tasks'][task][method]['tau']:.2f})",
            )
        ax.set_title(task)
        ax.set_xlabel("draft position")
        ax.set_ylim(0, 1)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
    axes[0][0].set_ylabel("accepted / drafts")
    fig.suptitle(f"Acceptance per position, k={report['config']['k']}")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
