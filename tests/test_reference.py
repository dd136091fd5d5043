"""The embedded reference target, its draft sibling and the held-out tasks (offline)."""

import json

import pytest

from draftsmith import reference
from draftsmith.reference import corpus


@pytest.fixture(scope="module")
def models():
    target, tok = reference.target()
    draft, draft_tok = reference.draft()
    return target, tok, draft, draft_tok


def test_models_load_offline_and_share_vocabulary(models, monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    target, tok, draft, draft_tok = models
    assert type(target).__name__ == "LlamaForCausalLM" and type(draft).__name__ == "LlamaForCausalLM"
    assert tok.get_vocab() == draft_tok.get_vocab()
    assert target.config.vocab_size == draft.config.vocab_size == len(tok)
    assert target.config.num_hidden_layers >= 8
    n_target = sum(p.numel() for p in target.parameters())
    n_draft = sum(p.numel() for p in draft.parameters())
    assert 15e6 <= n_target <= 25e6 and n_draft * 4 < n_target
    text = tok.apply_chat_template([{"role": "user", "content": "hi"}], tokenize=False, add_generation_prompt=True)
    assert text == "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"
    assert tok.eos_token == "<|im_end|>"


def test_tasks_are_held_out_with_provenance():
    tasks = reference.tasks()
    assert set(tasks) == set(reference.TASK_NAMES)
    for name, records in tasks.items():
        assert len(records) >= 50, name
        for r in records:
            prov = r["provenance"]
            assert {"source", "lines", "sha256"} <= set(prov)
            assert r["messages"][-1]["role"] == "user"
            if name == "code-foreign":
                assert prov["origin"] != "stdlib"
            else:
                assert prov["origin"] == "stdlib" and corpus.is_heldout(prov["module"]), r["id"]


def test_reproduce_file_records_commands():
    text = (reference.ROOT / "REPRODUCE.md").read_text()
    for needle in ("tools/reference/corpus.py", "tools/reference/tokenizer.py", "tools/reference/pretrain.py", "seed"):
        assert needle in text
    meta = json.loads((reference.TARGET_DIR / "config.json").read_text())
    assert meta["architectures"] == ["LlamaForCausalLM"]
