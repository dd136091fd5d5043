"""Acceptance length τ of the drafter while it trains, on held-out conversations.

The definition is the one ``draftsmith eval`` reports, computed by the same code: each prompt is
decoded greedily by ``core.generate.generate_speculative`` with a fresh proposer over the
current drafter (``Eagle3Proposer`` for a head, ``DraftModelProposer`` for a draft LM: the trainer's
``DrafterSpec.proposer``), and the counters are ``core.generate.SpecStats`` (τ = 1 + accepted / drafts,
acceptance rate = accepted / drafted tokens, accepted per position). ``evaluation.heldout.evaluate``
runs exactly these calls per task; here the tasks are the run's held-out split and the plain-decoding
baseline (speed only) is skipped. Under several processes the prompts are split over the ranks and
the counters summed.
"""

from __future__ import annotations

from typing import Callable, Sequence

import torch

from draftsmith.core.generate import GenerationConfig, SpecStats, generate_speculative
from draftsmith.core.proposer import Proposer
from draftsmith.core.stops import stop_token_ids
from draftsmith.core.target import TargetModel
from draftsmith.data_pipeline.chat import prompt_ids


def heldout_prompts(conversations: list[dict], limit: int) -> list[list[dict]]:
    """Messages up to (and including) the last user turn of the first ``limit`` conversations."""
    prompts = []
    for conv in conversations[:limit]:
        messages = conv["messages"]
        last_user = max((i for i, m in enumerate(messages) if m["role"] == "user"), default=None)
        if last_user is not None:
            prompts.append(messages[: last_user + 1])
    return prompts


def measure_acceptance(
    target,
    tokenizer,
    make_proposer: Callable[[], Proposer],
    prompts: list[list[dict]],
    k: int,
    max_new_tokens: int,
    rank: int = 0,
    world_size: int = 1,
    aux_layer_ids: Sequence[int] | None = None,
) -> SpecStats:
    """Greedy speculative decoding of ``prompts[rank::world_size]``; its ``SpecStats``.

    ``make_proposer()`` returns a fresh greedy proposer per prompt (proposers hold per-sequence state);
    ``aux_layer_ids``: the target hidden states it reads (EAGLE-3: the head's), None for none. The
    caller restores its drafter's train/eval mode afterwards (proposers put models in eval mode). Sum
    the counters of all ranks for the run's figure (``stats_tensor``)."""
    tm = TargetModel(target, tokenizer, aux_layer_ids=aux_layer_ids)
    gen = GenerationConfig(max_new_tokens=max_new_tokens, eos_token_ids=stop_token_ids(target, tokenizer))
    stats = SpecStats(k=k)
    for messages in prompts[rank::world_size]:
        out = generate_speculative(tm, make_proposer(), prompt_ids(tokenizer, messages), gen, k)
        stats = stats.merge(out.stats)
    return stats


def stats_tensor(stats: SpecStats) -> torch.Tensor:
    """Counters as float64 [3 + k] (drafts, draft tokens, accepted, accepted per position) for a sum-reduce."""
    return torch.tensor(
        [stats.num_drafts, stats.num_draft_tokens, stats.num_accepted_tokens, *stats.accepted_per_pos],
        dtype=torch.float64,
    )


def stats_from_tensor(t: torch.Tensor, k: int) -> SpecStats:
    """Inverse of :func:`stats_tensor` (after summing over ranks)."""
    v = [int(round(x)) for x in t.tolist()]
    return SpecStats(k=k, num_drafts=v[0], num_draft_tokens=v[1], num_accepted_tokens=v[2], accepted_per_pos=v[3:])


def log_fields(stats: SpecStats) -> dict:
    """The log entry of one measurement: tau, acceptance rate and accepted fraction per position."""
    drafts = max(1, stats.num_drafts)
    return {
        "tau": stats.acceptance_length,
        "acceptance_rate": stats.acceptance_rate,
        **{f"accepted_pos{i}": a / drafts for i, a in enumerate(stats.accepted_per_pos)},
    }
