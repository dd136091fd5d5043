"""The vLLM referee on a tiny target and head built here: vLLM must decode exactly as draftsmith does.

Opt-in (marker ``vllm``): runs with ``DRAFTSMITH_RUN_VLLM=1``, ``pytest -m vllm`` or ``--run-vllm``
(once a conftest registers that option) and needs the vLLM venv (``python bench/vllm_referee.py
--setup``); about two minutes on 2 CPU cores, mostly vLLM start-ups. The counting rule (``vllm_view``),
our side of the referee and the metadata record are tested without vLLM.

The tiny head gets a few TTT steps on the target's own greedy continuations (seconds), so acceptance
is neither 0 nor 1 at every position: a per-position comparison of all-zero counts would prove nothing.
"""

from __future__ import annotations

import json
import os

import pytest
import torch

from draftsmith.evaluation.referee import (
    Counters,
    RunResult,
    compare,
    record_verdicts,
    run_ours,
    vllm_python,
    vllm_view,
)

VOCAB, HIDDEN, LAYERS, MAX_TOKENS = 256, 128, 4, 24
TRAIN_STEPS = 60
TEMPLATE = (
    "{% for m in messages %}<|{{ m.role }}|> {{ m.content }} {% endfor %}{% if add_generation_prompt %}"
    "<|assistant|> {% endif %}"
)


def build_tiny(root, seed: int = 0, draft_vocab_size: int = 160):
    """Save a tiny Llama target (tied embeddings, head_dim 64 for vLLM's CPU attention) + tokenizer to
    ``root/target`` and export a constructed EAGLE-3 head (both formats) to ``root/head``."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    from draftsmith.data_pipeline.vocab import build_vocab_map
    from draftsmith.drafters.eagle3.export import export_eagle3
    from draftsmith.drafters.eagle3.head import Eagle3Config, Eagle3Head
    from draftsmith.identity import target_identity

    specials = ["<pad>", "<eos>", "<unk>", "<|user|>", "<|assistant|>", "<|system|>"]
    vocab = {t: i for i, t in enumerate(specials + [f"w{i}" for i in range(VOCAB - len(specials))])}
    backend = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok = PreTrainedTokenizerFast(tokenizer_object=backend, pad_token="<pad>", eos_token="<eos>", unk_token="<unk>")
    tok.chat_template = TEMPLATE
    config = LlamaConfig(
        vocab_size=VOCAB,
        hidden_size=HIDDEN,
        intermediate_size=2 * HIDDEN,
        num_hidden_layers=LAYERS,
        num_attention_heads=2,
        num_key_value_heads=1,
        max_position_embeddings=512,
        tie_word_embeddings=True,
        bos_token_id=None,
        eos_token_id=1,
        pad_token_id=0,
    )
    torch.manual_seed(seed)
    target = LlamaForCausalLM(config).eval()
    with torch.no_grad():
        target.model.embed_tokens.weight.normal_(0, 1.0)
        target.model.norm.weight.normal_(0, 1.0)  # large logit gaps: no near-ties between engines
    target.save_pretrained(root / "target")
    tok.save_pretrained(root / "target")

    hc = Eagle3Config.from_target(config, draft_vocab_size=draft_vocab_size, ttt_steps=3)
    counts = torch.randint(1, 100, (VOCAB,), generator=torch.Generator().manual_seed(seed))
    vm = build_vocab_map(counts, draft_vocab_size, always_include=[1])
    head = Eagle3Head(hc)
    head.set_vocab_map(vm.d2t, vm.t2d)
    head.bind_embedding(target.get_input_embeddings())
    head.init_from_target(target)
    _fit(head, target, seed)
    ident = target_identity(target, tok, str(root / "target"))
    export_eagle3(head, root / "head", ident, target.config, formats=("draftsmith", "speculators"))
    return root / "target", root / "head", tok


def _fit(head, target, seed: int, steps: int = TRAIN_STEPS) -> None:
    """A few TTT steps on the target's own greedy continuations of random prompts (seconds)."""
    from draftsmith.drafters.eagle3.ttt import ttt_loss

    g = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        seqs = target.generate(
            torch.randint(6, VOCAB, (32, 8), generator=g),
            max_new_tokens=56,
            do_sample=False,
            min_new_tokens=56,
            pad_token_id=0,
        )
        out = target(seqs, output_hidden_states=True)
        aux = torch.cat([out.hidden_states[i] for i in head.config.aux_layer_ids], dim=-1)
    mask = torch.ones_like(seqs, dtype=torch.bool)
    opt = torch.optim.Adam(head.parameters(), lr=3e-3)
    for _ in range(steps):
        loss = ttt_loss(head, aux, seqs, out.logits, mask).loss
        opt.zero_grad()
        loss.backward()
        opt.step()
    head.eval()


def tiny_prompts(tok, n: int = 6, seed: int = 0) -> list[list[int]]:
    """Chat-rendered prompts of random words (the ids draftsmith's server would feed the target)."""
    from draftsmith.data_pipeline.chat import prompt_ids

    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(n):
        words = " ".join(
            f"w{int(i)}"
            for i in torch.randint(0, VOCAB - 6, (int(torch.randint(3, 12, (1,), generator=g)),), generator=g)
        )
        out.append(prompt_ids(tok, [{"role": "user", "content": words}]).tolist())
    return out


# --- without vLLM ----------------------------------------------------------------------------------
def test_vllm_view_counts_full_drafts_until_the_stop():
    # k=3, max 6: step 1 accepts 2 (emits 3), step 2 accepts 3 but only 2 tokens still fit; step 3 never counts
    steps = [(3, 2, [5, 6, 7]), (3, 3, [8, 9, 10, 11]), (3, 0, [12])]
    tokens, c = vllm_view(4, steps, max_tokens=6, stop_ids=[99], k=3)
    assert tokens == [4, 5, 6, 7, 8, 9]
    assert (c.num_drafts, c.num_draft_tokens, c.num_accepted_tokens, c.accepted_per_pos) == (2, 6, 5, [2, 2, 1])
    tokens, c = vllm_view(4, steps, max_tokens=50, stop_ids=[6], k=3)  # EOS inside an accepted chunk
    assert tokens == [4, 5, 6] and c.num_drafts == 1 and c.accepted_per_pos == [1, 1, 0]
    tokens, c = vllm_view(99, steps, max_tokens=50, stop_ids=[99], k=3)  # the first token stops
    assert tokens == [99] and c.num_drafts == 0


def test_ours_in_vllm_convention_matches_plain(tmp_path):
    from draftsmith import drafters
    from draftsmith.drafters.speculative import SpeculativeConfig
    from draftsmith.models import load_causal_lm

    target_dir, head_dir, tok = build_tiny(tmp_path)
    model, tok = load_causal_lm(str(target_dir))
    loaded = drafters.get("eagle3").load(SpeculativeConfig("eagle3", str(head_dir), 3), model, tok)
    prompts = tiny_prompts(tok, n=3)
    plain, spec = run_ours(model, tok, loaded, prompts, (3,), MAX_TOKENS, [tok.eos_token_id])
    assert spec[3].tokens == plain.tokens
    total = spec[3].total
    assert 0 < total.accepted_per_pos[0] < total.num_drafts, "the constructed head should accept sometimes"


def test_compare_and_record(tmp_path):
    from draftsmith.export.metadata import read_metadata

    _, head_dir, _ = build_tiny(tmp_path)
    c = [Counters(2, 6, 3, [2, 1, 0])]
    same = compare(
        "research",
        3,
        "0.32.0",
        RunResult([[1, 2]]),
        RunResult([[1, 2]], c),
        RunResult([[1, 2]]),
        RunResult([[1, 2]], c),
        max_tokens=2,
    )
    off = compare(
        "research",
        5,
        "0.32.0",
        RunResult([[1, 2]]),
        RunResult([[1, 2]], c),
        RunResult([[1, 2]]),
        RunResult([[1, 2]], [Counters(2, 6, 2, [2, 0, 0])]),
        max_tokens=2,
    )
    assert same.match and not off.match
    record_verdicts(head_dir, [same, off])
    referee = read_metadata(head_dir).referee
    assert list(referee) == ["vllm/research/k3"] and referee["vllm/research/k3"]["match"] is True
    assert referee["vllm/research/k3"]["weights"] == read_metadata(head_dir).weights
    with pytest.raises(RuntimeError, match="re-exported"):  # verdicts about weights no longer there
        record_verdicts(head_dir, [same], weights={"model.safetensors": "0" * 64})


# --- with vLLM (opt-in) ----------------------------------------------------------------------------
@pytest.fixture
def vllm_opted_in(request):
    """Skip unless asked for: DRAFTSMITH_RUN_VLLM=1, ``-m vllm``, or ``--run-vllm`` (when a conftest
    registers that option); and skip when the vLLM venv is missing."""
    config = request.config
    asked = (
        os.environ.get("DRAFTSMITH_RUN_VLLM") == "1"
        or config.getoption("--run-vllm", default=False)
        or "vllm" in (config.getoption("markexpr", default="") or "")
    )
    if not asked:
        pytest.skip("opt-in: DRAFTSMITH_RUN_VLLM=1 (or -m vllm / --run-vllm)")
    if not vllm_python().exists():
        pytest.skip("no vLLM venv: python bench/vllm_referee.py --setup")


@pytest.mark.vllm
def test_vllm_decodes_like_draftsmith(tmp_path, vllm_opted_in):
    from draftsmith.evaluation.referee import format_table, referee
    from draftsmith.export.metadata import read_metadata

    target_dir, head_dir, tok = build_tiny(tmp_path)
    verdicts, _ = referee(head_dir, str(target_dir), tiny_prompts(tok), ks=(3,), max_tokens=MAX_TOKENS)
    table = format_table(verdicts)
    print(table)
    assert all(v.match for v in verdicts), table
    assert set(read_metadata(head_dir).referee) == {"vllm/research/k3", "vllm/speculators/k3"}
    assert json.dumps(read_metadata(head_dir).to_dict())  # still serialisable


@pytest.mark.vllm
def test_certify_a_real_vllm_server(tmp_path, vllm_opted_in):
    """``draftsmith certify`` against vLLM's OpenAI server started from the referee's venv: the head's own trace
    is 'identical' (outputs and counters)."""
    import socket

    from transformers import AutoModelForCausalLM

    from draftsmith.evaluation.certify import certify, make_trace, write_trace
    from draftsmith.evaluation.vllm_server import VllmServer

    target_dir, head_dir, tok = build_tiny(tmp_path)
    model = AutoModelForCausalLM.from_pretrained(target_dir).eval()
    write_trace(head_dir, make_trace(head_dir, model, tok, k=3, prompts=tiny_prompts(tok, 4), max_tokens=MAX_TOKENS))
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    spec = {"method": "eagle3", "model": str(head_dir), "num_speculative_tokens": 3}
    with VllmServer(str(target_dir), spec, port=port, max_model_len=256, log=tmp_path / "vllm.log") as server:
        result = certify(head_dir, server.url)
    print(result.summary())
    assert result.verdict == "identical" and result.convention == "vllm", result.summary()
    assert result.theirs["num_accepted_tokens"] > 0


def build_tiny_dflash(root, seed: int = 0):
    """``build_tiny``'s target with a DFlash drafter (2 layers, block 4) fitted to the target's own greedy
    continuations for a few seconds, exported to ``root/dflash`` (vLLM's DFlashDraftModel layout)."""
    from transformers import AutoTokenizer, LlamaForCausalLM

    from draftsmith.drafters.dflash.config import Section
    from draftsmith.drafters.dflash.export import export_dflash
    from draftsmith.drafters.dflash.train import block_loss, build_dflash
    from draftsmith.identity import target_identity

    target_dir, _, _ = build_tiny(root, seed)
    target = LlamaForCausalLM.from_pretrained(target_dir).eval()
    tok = AutoTokenizer.from_pretrained(target_dir)
    torch.manual_seed(seed)
    head = build_dflash(target, Section(block_size=4, num_speculative_tokens=3, target_layer_ids=[0, 2]), tok)
    g = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        seqs = target.generate(
            torch.randint(6, VOCAB, (32, 8), generator=g),
            max_new_tokens=56,
            do_sample=False,
            min_new_tokens=56,
            pad_token_id=0,
        )
        out = target(seqs, output_hidden_states=True)
        aux = torch.cat([out.hidden_states[i] for i in head.config.aux_layer_ids], dim=-1)
    mask = torch.ones_like(seqs, dtype=torch.bool)
    opt = torch.optim.Adam(head.parameters(), lr=3e-3)
    for _ in range(TRAIN_STEPS):
        loss = block_loss(head, aux, seqs, out.logits, mask, num_anchors=16, gamma=4.0).loss
        opt.zero_grad()
        loss.backward()
        opt.step()
    export_dflash(head.eval(), root / "dflash", target_identity(target, tok, str(target_dir)))
    return target_dir, root / "dflash", tok


@pytest.mark.vllm
def test_vllm_decodes_dflash_like_draftsmith(tmp_path, vllm_opted_in):
    """vLLM serves the DFlash export as method dflash (its DFlashQwen3 model, non-causal CPU attention) and
    decodes the same tokens with the same spec-decode counters as draftsmith's runtime."""
    from draftsmith.evaluation.referee import format_table, referee
    from draftsmith.export.metadata import read_metadata

    target_dir, head_dir, tok = build_tiny_dflash(tmp_path)
    verdicts, _ = referee(
        head_dir, str(target_dir), tiny_prompts(tok), ks=(3,), formats=("vllm",), max_tokens=MAX_TOKENS
    )
    table = format_table(verdicts)
    print(table)
    assert all(v.match for v in verdicts), table
    assert sum(verdicts[0].details["ours"]["accepted_per_pos"]) > 0, "the fitted drafter accepts nothing: vacuous"
    assert set(read_metadata(head_dir).referee) == {"vllm/vllm/k3"}
