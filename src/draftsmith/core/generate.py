"""Decoding one sequence: plain autoregressive, and speculative with any ``Proposer``.

Both run the one decode loop of the runtime (``core/batch.py``) with a batch of one, so a sequence decoded here,
served by the engine or decoded in a batch goes through the same steps. The algorithm lives in ``verify.py``
(accept/reject), ``sampling.py`` (p and q) and the proposers. Invariant of the loop: the target's cache holds
prompt + all emitted tokens except the last one, which is fed first in the next verify pass:

    cache:   x0 .. x_{T-1} t1 .. t_{m-1}         last = t_m (emitted, not yet read by the target)
    verify:  read [t_m, d1 .. dk']  → logits [k'+1, V]; row i judges d_{i+1}, row k' is the bonus
    accept:  n drafts → roll the cache back to keep t_m, d1..dn; emitted = d1..dn, t' (t' = new last)

Greedy speculative output is token-identical to ``generate_plain`` greedy output (up to float
rounding between batched and one-token forwards); sampled output follows the same distribution.
The types (``GenerationConfig``, ``SpecStats``, ``GenerationResult``, ``VerifyStep``) live in ``sequence.py``
and are importable from here.
"""

from __future__ import annotations

from typing import Callable

from draftsmith.core.batch import BatchDecoder, BatchSequence
from draftsmith.core.proposer import PerSequence, Proposer
from draftsmith.core.sequence import (  # noqa: F401 - re-exported: the runtime's public types
    Emitted,
    GenerationConfig,
    GenerationResult,
    SpecStats,
    VerifyStep,
    as_prompt,
)
from draftsmith.core.target import TargetModel
from draftsmith.core.tree import TreeShape


def generate_plain(
    target: TargetModel, prompt_ids, cfg: GenerationConfig, on_tokens: Callable[[list[int]], None] | None = None
) -> GenerationResult:
    """Plain autoregressive decoding with a KV cache: one target forward per emitted token.

    Args:
        target: the wrapped target. prompt_ids: ``[T]`` int64 (or ``[1, T]``, or a list).
        cfg: decoding settings.
        on_tokens: called with each emitted chunk (here one token) after the stop rules; an exception
            it raises ends generation and propagates (how a caller stops on a stop string or cancels).

    Returns:
        ``GenerationResult`` with ``stats=None``.

    Raises:
        ValueError: an empty or batched prompt; prompt + max_new_tokens beyond the target's position limit.
    """
    return _decode_one(target, None, prompt_ids, cfg, 0, on_tokens, None)


def generate_speculative(
    target: TargetModel,
    proposer: Proposer,
    prompt_ids,
    cfg: GenerationConfig,
    k: int,
    on_tokens: Callable[[list[int]], None] | None = None,
    on_step: Callable[[VerifyStep], None] | None = None,
    tree: TreeShape | None = None,
    policy=None,
) -> GenerationResult:
    """Speculative decoding: the proposer drafts up to k tokens, one target forward verifies them.

    Steps:
      1. Prefill the prompt; the first token comes from the target alone; ``proposer.start``.
      2. Ask for min(k, remaining − 1) drafts (the verify pass always adds one target token).
      3. Target forward over [last emitted token, d1..dk'].
      4. Verify: greedy (temperature 0) or rejection sampling with p = cfg.probs(logits), q from the
         proposal (None → one-hot).
      5. Crop the target cache to drop the rejected drafts; record stats; ``proposer.accept``.
      6. Append the emitted chunk token by token, stopping at EOS / stop ids / max_new_tokens.

    Args:
        target: wrapped target (built with ``aux_layer_ids`` when the proposer needs aux states; every
            forward returns ``final_hidden`` when ``proposer.needs_final_hidden``).
        proposer: a fresh or reusable ``Proposer`` (``start`` resets it per sequence).
        prompt_ids: ``[T]`` int64 (or ``[1, T]``, or a list). cfg: decoding settings.
        k: most drafted tokens per verify step (>= 0; 0 degenerates to plain decoding).
        on_tokens: called with each emitted chunk after the stop rules (the first token, then each
            verify step's accepted drafts + target token); an exception it raises ends generation.
        on_step: the observer hook, called with a :class:`VerifyStep` after each verify step, before that
            step's tokens reach ``on_tokens`` (so its counts survive a stop raised there): how the engine
            counts spec-decode metrics, eval times the drafter and the referee records every step.
        tree: draft a tree of this shape per step instead of a chain of k (``Proposer.propose_tree``, verified
            by ``core.tree``); k is then ignored and the counters run over ``tree.num_steps`` depths.
        policy: choose each step's k (at most k; a tree's depth) live (``core.adaptive.AdaptivePolicy``, shared
            across sequences as an engine shares it); None: k every step.

    Returns:
        ``GenerationResult`` with ``SpecStats`` over k positions.

    Raises:
        ValueError: k < 0, an empty/batched prompt, prompt + max_new_tokens beyond the target's position
            limit, a proposer needing aux states with a target that has no ``aux_layer_ids``, or a proposal
            breaking the ``Proposer`` contract.
    """
    return _decode_one(target, PerSequence.of(proposer), prompt_ids, cfg, k, on_tokens, on_step, tree, policy)


def _decode_one(target, proposer, prompt_ids, cfg, k, on_tokens, on_step, tree=None, policy=None) -> GenerationResult:
    """One sequence through the batch decoder, its whole prompt prefilled at once; a callback's exception
    propagates."""
    prompt = as_prompt(prompt_ids)
    reads = max(k, tree.num_draft_tokens if tree is not None else 0)
    decoder = BatchDecoder(
        target,
        proposer,
        k,
        max_num_seqs=1,
        max_num_batched_tokens=prompt.numel() + reads + 1,
        tree=tree,
        policy=policy,
    )
    seq = decoder.add(BatchSequence(prompt, cfg, on_tokens=on_tokens, on_step=on_step))
    decoder.run()
    if seq.error is not None:
        raise seq.error
    return seq.result
