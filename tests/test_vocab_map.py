"""Draft vocab map (d2t/t2d) and the whole-dataset mask sanity check of ``render_dataset``.

Vocab map: a round trip on a corpus of 50 distinct tokens with Vd = 64 (through safetensors, with its
counts and sha256), full vocab -> zero offsets (and no d2t shipped: ``test_export.py::
test_full_vocab_ships_no_vocab_map``), target id = i + d2t[i] always in range and unique, and
``prepare`` reusing the saved map. Mask: a dataset supervised at 0% or above 95% is an error that
names the tokenizer whose template produced it.
"""

import copy
import json

import pytest
import torch
from safetensors.torch import load_file, save_file

from draftsmith.data_pipeline.config import DataConfig
from draftsmith.data_pipeline.dataset import render_dataset
from draftsmith.data_pipeline.prepare import load_prepared, prepare
from draftsmith.data_pipeline.vocab import VocabMap, build_vocab_map, count_tokens, validate_vocab_map

V = 200


def draft_ids_of(vmap: VocabMap, target_ids: torch.Tensor) -> torch.Tensor:
    """target id -> draft id (t2d marks the draft vocab; draft ids follow increasing target ids)."""
    return torch.cumsum(vmap.t2d.long(), 0)[target_ids] - 1


def test_round_trip_50_token_corpus_vd_64(tmp_path):
    torch.manual_seed(0)
    vocab = torch.randperm(V)[:50]  # 50 distinct tokens anywhere in V
    corpus = vocab[torch.randint(0, 50, (1000,))]
    corpus[:50] = vocab  # each appears at least once
    mask = torch.ones_like(corpus, dtype=torch.bool)
    mask[::7] = False  # unsupervised tokens are not counted
    counts = count_tokens([corpus], [mask], V)
    assert int(counts.sum()) == int(mask.sum())
    vmap = build_vocab_map(counts, 64, always_include=[2])

    in_target = vmap.draft_ids_in_target()  # i + d2t[i]
    assert set(corpus[mask].tolist()) | {2} <= set(in_target.tolist())
    unseen = [t for t in in_target.tolist() if counts[t] == 0 and t != 2]
    assert unseen == sorted(set(range(V)) - set(corpus[mask].tolist()) - {2})[: len(unseen)]  # ties: lowest ids
    assert torch.equal(draft_ids_of(vmap, in_target), torch.arange(64))  # target -> draft -> target

    save_file(vmap.to_tensors(), str(tmp_path / "vocab_map.safetensors"))
    back = VocabMap.from_tensors(load_file(str(tmp_path / "vocab_map.safetensors")))
    assert torch.equal(back.d2t, vmap.d2t) and torch.equal(back.t2d, vmap.t2d) and torch.equal(back.counts, counts)
    assert back.sha256() == vmap.sha256() and back.d2t.dtype == torch.int64 and back.t2d.dtype == torch.bool
    assert build_vocab_map(back.counts, 64, always_include=[2]).sha256() == vmap.sha256()  # rebuilt identically


def test_full_vocab_gives_zero_offsets():
    counts = torch.randint(0, 5, (V,))
    full = build_vocab_map(counts, V)
    assert torch.equal(full.d2t, torch.zeros(V, dtype=torch.long)) and bool(full.t2d.all())
    assert torch.equal(full.draft_ids_in_target(), torch.arange(V))


@pytest.mark.parametrize("seed", range(5))
def test_target_ids_are_in_range_unique_and_monotone(seed):
    g = torch.Generator().manual_seed(seed)
    counts = torch.randint(0, 4, (V,), generator=g) * (torch.rand(V, generator=g) < 0.3)  # many ties, many zeros
    always = torch.randint(0, V, (3,), generator=g).tolist()
    for vd in (1, 7, 64, V - 1, V):
        vmap = build_vocab_map(counts, vd, always_include=always)
        ids = torch.arange(vd) + vmap.d2t
        assert int(ids.min()) >= 0 and int(ids.max()) < V and ids.unique().numel() == vd
        assert bool((ids[1:] > ids[:-1]).all()) and bool((vmap.d2t >= 0).all())
        assert bool(vmap.t2d[ids].all()) and int(vmap.t2d.sum()) == vd
        if vd >= len(set(always)):
            assert set(always) <= set(ids.tolist())
        validate_vocab_map(vmap.d2t, vmap.t2d)
    with pytest.raises(ValueError, match="draft_vocab_size"):
        build_vocab_map(counts, V + 1)
    with pytest.raises(ValueError, match="outside the target vocab"):
        validate_vocab_map(torch.tensor([0, V]), torch.ones(V, dtype=torch.bool))


CONVERSATIONS = [
    {"messages": [{"role": "user", "content": q}, {"role": "assistant", "content": a}]}
    for q, a in [
        ("Add two numbers", "def add(a, b):\n    return a + b"),
        ("Hi", "Hello there"),
        ("How are you?", "Hello there, how are you?"),
        ("a", "b"),
        ("x", "def add"),
    ]
]


def test_prepare_saves_the_map_with_counts_and_sha256_and_reuses_it(chatml, tmp_path):
    source = tmp_path / "data.jsonl"
    source.write_text("".join(json.dumps(c) + "\n" for c in CONVERSATIONS))
    cfg = DataConfig(
        source=str(source),
        num_conversations=None,
        heldout_conversations=1,
        regenerate=False,
        max_length=64,
        draft_vocab_size=64,
    )
    first = prepare(cfg, None, chatml, "tiny", tmp_path / "data")
    assert first.manifest["d2t_sha256"] == first.vocab_map.sha256() and first.vocab_map.draft_vocab_size == 64
    assert int(first.vocab_map.counts.sum()) == first.manifest["supervised_tokens"]
    assert bool(first.vocab_map.t2d[chatml.eos_token_id])  # EOS always drafted
    again = load_prepared(tmp_path / "data")  # what a resumed training reads
    assert again.vocab_map.sha256() == first.vocab_map.sha256()
    assert torch.equal(again.vocab_map.counts, first.vocab_map.counts)
    assert prepare(cfg, None, chatml, "tiny", tmp_path / "data").vocab_map.sha256() == first.vocab_map.sha256()

    full = prepare(DataConfig(**{**cfg.__dict__, "draft_vocab_size": None}), None, chatml, "tiny", tmp_path / "full")
    assert full.vocab_map.draft_vocab_size == len(chatml) and not bool(full.vocab_map.d2t.any())

    tensors = load_file(str(tmp_path / "data" / "vocab_map.safetensors"))
    tensors["counts"][0] += 1
    save_file(tensors, str(tmp_path / "data" / "vocab_map.safetensors"))
    with pytest.raises(ValueError, match="vocab_map.safetensors changed"):
        load_prepared(tmp_path / "data")


def test_supervised_fraction_zero_or_above_95_percent_is_an_error(chatml):
    ok = render_dataset(chatml, CONVERSATIONS, 64)
    assert 0.0 < ok.supervised_fraction() <= 0.95

    questions_only = [{"messages": c["messages"][:1]} for c in CONVERSATIONS]
    with pytest.raises(ValueError, match=r"supervised fraction 0\.0% .* chat template of tiny-chatml"):
        render_dataset(chatml, questions_only, 64)

    answers_only = copy.deepcopy(chatml)  # a template that renders nothing but the answers
    answers_only.chat_template = (
        "{% for m in messages %}{% if m['role'] == 'assistant' %}"
        "{{ m['content'] }}{{ eos_token }}{% endif %}{% endfor %}"
    )
    with pytest.raises(ValueError, match=r"supervised fraction 100\.0% .* chat template of tiny-chatml"):
        render_dataset(answers_only, CONVERSATIONS, 64)
