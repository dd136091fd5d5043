"""Draft-model distillation: the KL objective, building and refusals, resume, offline = online, the
pipeline (train, export, re-export), export/reload, runtime metadata checks, and lossless greedy
speculation with a distilled draft on the reference target."""

from __future__ import annotations

import copy
import json
import random

import pytest
import torch

import draftsmith.train.trainer as trainer_module
from conftest import train_draft_model
from draftsmith.data_pipeline.dataset import RenderedDataset
from draftsmith.drafters.draft_model.config import Section as DraftModelConfig
from draftsmith.drafters.draft_model.train import build_draft_model, distill_loss
from draftsmith.export.metadata import HeadMismatchError
from draftsmith.train.config import TrainConfig

SMALL = dict(
    init_from=None,
    num_hidden_layers=1,
    hidden_size=16,
    intermediate_size=32,
    num_attention_heads=2,
    num_key_value_heads=1,
)


def make_data(n=12, t=20, vocab=96, seed=0):
    g = torch.Generator().manual_seed(seed)
    ids = [torch.randint(2, vocab, (t - i % 5,), generator=g) for i in range(n)]
    return RenderedDataset(ids, [torch.arange(x.numel()) >= 5 for x in ids])


def batch_of(data, n=3):
    from draftsmith.data_pipeline.dataset import pad_batch

    return pad_batch(data.input_ids[:n], data.loss_mask[:n], 0)


# ------------------------------------------------------------------------------------------ objective


def test_kl_is_zero_for_the_target_positive_otherwise_and_has_the_soft_ce_gradient(tiny_llama):
    """Forward KL(p||q) is 0 exactly when the draft is the target, > 0 for another model, and differs from
    soft cross-entropy by the target's entropy only (same gradient)."""
    target = tiny_llama(seed=7)
    ids, attn, mask = batch_of(make_data())
    with torch.no_grad():
        p_logits = target(input_ids=ids, attention_mask=attn).logits
    same = copy.deepcopy(target).requires_grad_(True)
    for w in (0.0, 0.5):
        out = distill_loss(same, ids, attn, mask, p_logits, prompt_loss_weight=w)
        assert float(out.loss.detach()) == pytest.approx(0.0, abs=1e-7) and out.acc == 1.0 and out.count > 0
    other = tiny_llama(seed=8).requires_grad_(True)
    out = distill_loss(other, ids, attn, mask, p_logits)
    assert float(out.loss.detach()) > 1e-3 and 0.0 <= out.acc < 1.0  # near-uniform random models: small KL
    out.loss.backward()
    kl_grads = [p.grad.clone() for p in other.parameters()]
    other.zero_grad()
    # soft CE on the same rows and weights (assistant rows only): -sum p log q, weighted mean
    scored = torch.cat([mask[:, 1:], torch.zeros_like(mask[:, :1])], dim=1).bool()
    log_q = torch.log_softmax(other(input_ids=ids, attention_mask=attn).logits[scored].float(), -1)
    p = torch.softmax(p_logits[scored].float(), -1)
    soft_ce = -(p * log_q).sum(-1).mean()
    entropy = -(p * p.log()).sum(-1).mean()
    assert float((soft_ce - entropy).detach()) == pytest.approx(float(out.loss.detach()), rel=1e-4)
    soft_ce.backward()
    for g_kl, param in zip(kl_grads, other.parameters()):
        torch.testing.assert_close(g_kl, param.grad, rtol=1e-4, atol=1e-7)


def test_distill_loss_refuses_another_vocabulary(tiny_llama):
    ids, attn, mask = batch_of(make_data())
    draft = tiny_llama(seed=1, vocab_size=96).requires_grad_(True)
    with pytest.raises(ValueError, match="96 tokens, the target over 80"):
        distill_loss(draft, ids, attn, mask, torch.zeros(*ids.shape, 80))
    with pytest.raises(ValueError, match="prompt_loss_weight"):
        distill_loss(draft, ids, attn, mask, torch.zeros(*ids.shape, 96), prompt_loss_weight=2.0)


# ------------------------------------------------------------------------------------------ building


def _save_lm(model, tokenizer, path):
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    return str(path)


def test_vocab_and_tokenizer_mismatches_are_refused(tiny_llama, word_tokenizer, tmp_path):
    target = tiny_llama(seed=7)  # vocab 96
    small = _save_lm(tiny_llama(seed=1, vocab_size=64), word_tokenizer(64), tmp_path / "v64")
    with pytest.raises(ValueError, match=r"64 tokens .* the target's 96"):
        build_draft_model(target, DraftModelConfig(init_from=small))
    renamed = _save_lm(tiny_llama(seed=1), word_tokenizer(96, rename={40: "zz"}), tmp_path / "renamed")
    with pytest.raises(ValueError, match="tokenizer"):
        build_draft_model(target, DraftModelConfig(init_from=renamed), tokenizer=word_tokenizer(96))
    same = _save_lm(tiny_llama(seed=1, num_hidden_layers=1), word_tokenizer(96), tmp_path / "same")
    draft = build_draft_model(target, DraftModelConfig(init_from=same), tokenizer=word_tokenizer(96))
    assert draft.training and all(p.requires_grad for p in draft.parameters())
    with pytest.raises(ValueError, match="drafter.hidden_size"):
        DraftModelConfig(init_from=same, hidden_size=32)


def test_built_from_the_target_config(tiny_llama):
    target = tiny_llama(seed=7, arch="qwen3")
    draft = build_draft_model(target, DraftModelConfig(**SMALL))
    assert type(draft) is type(target) and draft.config.num_hidden_layers == 1
    assert draft.config.hidden_size == 16 and draft.config.head_dim == 8 and draft.config.vocab_size == 96
    warm = build_draft_model(target, DraftModelConfig(init_from=None))  # target's width: warm start
    assert warm.config.num_hidden_layers == 1  # a quarter of 4 layers
    assert torch.equal(warm.get_input_embeddings().weight, target.get_input_embeddings().weight)
    assert torch.equal(warm.get_output_embeddings().weight, target.get_output_embeddings().weight)
    with pytest.raises(ValueError, match="multiple of num_attention_heads"):
        build_draft_model(target, DraftModelConfig(init_from=None, hidden_size=18, num_attention_heads=4))


# ------------------------------------------------------------------------------------------ training


def run(target, data, out, **kw):
    cfg = TrainConfig(mixed_precision="no", epochs=2, batch_size=4, lr=3e-3, warmup_steps=2, log_every=1, **kw)
    return train_draft_model(target, data, DraftModelConfig(**SMALL), cfg, out, pad_id=0)


def test_training_lowers_the_kl_and_resume_gives_the_same_next_losses(tiny_llama, tmp_path, monkeypatch):
    target = tiny_llama(seed=7)
    data = make_data()
    full = run(target, data, tmp_path / "a", max_steps=4)
    assert full.steps == 4 and full.log[-1]["loss"] < full.log[0]["loss"]
    real_commit = trainer_module.commit_checkpoint

    def commit_then_die(path):
        real_commit(path)
        if json.loads((path / "state.json").read_text())["step"] == 2:
            raise KeyboardInterrupt("simulated preemption")

    monkeypatch.setattr(trainer_module, "commit_checkpoint", commit_then_die)
    with pytest.raises(KeyboardInterrupt):
        run(target, data, tmp_path / "b", max_steps=4, ckpt_every=2)
    monkeypatch.setattr(trainer_module, "commit_checkpoint", real_commit)
    state = json.loads((tmp_path / "b" / "checkpoint" / "state.json").read_text())
    assert state["step"] == 2 and state["extra"]["drafter"] == "draft_model"
    resumed = run(target, data, tmp_path / "b", max_steps=4, ckpt_every=2)
    assert [e["step"] for e in resumed.log] == [1, 2, 3, 4]
    for a, b in zip(full.log, resumed.log):
        assert a["loss"] == pytest.approx(b["loss"], rel=1e-5, abs=1e-7)
    for (name, p), q in zip(full.head.named_parameters(), resumed.head.parameters()):
        torch.testing.assert_close(p, q, rtol=1e-5, atol=1e-6, msg=name)


def test_an_eagle3_checkpoint_is_not_resumed_as_a_draft_model(tiny_llama, tmp_path):
    from conftest import train_eagle3
    from draftsmith.data_pipeline.vocab import build_vocab_map, count_tokens
    from draftsmith.drafters.eagle3.config import Section as HeadConfig

    target, data = tiny_llama(seed=7), make_data()
    vmap = build_vocab_map(count_tokens(data.input_ids, data.loss_mask, 96), 64, always_include=[1])
    train_eagle3(
        target,
        data,
        vmap,
        HeadConfig(ttt_steps=2, aux_layer_ids=[1, 2, 3]),
        TrainConfig(mixed_precision="no", max_steps=1, batch_size=4),
        tmp_path,
        pad_id=0,
    )
    with pytest.raises(ValueError, match="checkpoint of drafter 'eagle3', this run trains 'draft_model'"):
        run(target, data, tmp_path, max_steps=2)


def conversations(n: int, seed: int = 0) -> list[dict]:
    rng = random.Random(seed)
    words = ["def", "add", "(a, b)", "return", "a + b", "Hello", "there", "how", "are", "you", "?", ":"]
    return [
        {
            "messages": [
                {"role": "user", "content": " ".join(rng.choices(words, k=rng.randint(2, 6)))},
                {"role": "assistant", "content": " ".join(rng.choices(words, k=rng.randint(4, 12)))},
            ]
        }
        for _ in range(n)
    ]


def test_offline_shards_give_the_online_loss(tiny_llama, chatml, tmp_path):
    """Logits recomputed from stored final hidden states train the draft exactly as the online target does;
    the shards' aux layers do not matter to a draft model."""
    from draftsmith.data_pipeline.shards import ShardReader, write_shards

    target = tiny_llama(seed=3, vocab_size=len(chatml))
    write_shards(
        target,
        chatml,
        conversations(8),
        tmp_path / "capture",
        aux_layer_ids=(1, 2, 3),
        max_length=48,
        shard_size=4,
        batch_size=3,
        target_name="tiny",
        progress=False,
    )
    reader = ShardReader(tmp_path / "capture")
    seqs = list(reader)
    online = RenderedDataset([s.input_ids for s in seqs], [s.loss_mask for s in seqs])
    draft_cfg = DraftModelConfig(**SMALL, prompt_loss_weight=0.5)
    cfg = TrainConfig(
        mixed_precision="no", max_steps=3, batch_size=4, micro_batch_size=2, lr=3e-3, warmup_steps=1, log_every=1
    )
    a = train_draft_model(target, online, draft_cfg, cfg, tmp_path / "online", pad_id=chatml.pad_token_id)
    b = train_draft_model(
        target,
        reader,
        draft_cfg,
        TrainConfig(**{**vars(cfg), "mode": "offline"}),
        tmp_path / "offline",
        pad_id=chatml.pad_token_id,
    )
    assert len(a.log) == len(b.log) == 3
    for x, y in zip(a.log, b.log):
        assert x["loss"] == pytest.approx(y["loss"], rel=1e-5) and x["acc_0"] == pytest.approx(y["acc_0"])
    for (name, p), q in zip(a.head.named_parameters(), b.head.parameters()):
        torch.testing.assert_close(p, q, rtol=1e-4, atol=1e-6, msg=name)


def test_online_batches_skip_hidden_states(tiny_llama):
    """The draft model's online source asks the target for logits only."""
    from draftsmith.train.batches import OnlineSource

    target = tiny_llama(seed=3)
    calls = []
    real = target.forward
    target.forward = lambda *a, **kw: calls.append(kw.get("output_hidden_states")) or real(*a, **kw)
    batch = OnlineSource(make_data(), target, 0, None, frozenset({"target_logits"})).batch([0, 1], "cpu")
    assert calls == [False] and batch.aux_hidden is None and batch.target_logits.shape[-1] == 96
    with pytest.raises(ValueError, match="no aux_hidden"):
        batch.inputs({"aux_hidden"})


def test_pipeline_trains_exports_and_reexports_a_draft_model(tiny_llama, chatml, tmp_path):
    """`draftsmith train` with method draft_model (offline capture, in-loop τ), then `draftsmith export
    RUN_DIR` of the checkpoint and of the exported directory: same weights, the metadata says draft_model."""
    from draftsmith.config import load_config
    from draftsmith.drafters.draft_model.export import check_draft_model
    from draftsmith.export.metadata import read_metadata
    from draftsmith.pipeline.recipe import Recipe
    from draftsmith.pipeline.stages import export_run, run_train

    source = tmp_path / "conversations.jsonl"
    source.write_text("".join(json.dumps(c) + "\n" for c in conversations(14)))
    target = tiny_llama(seed=3, vocab_size=len(chatml))
    target.save_pretrained(tmp_path / "target")  # the recipe names its target (export_run reloads it)
    chatml.save_pretrained(tmp_path / "target")
    recipe = load_config(
        Recipe,
        None,
        [
            f"out_dir={tmp_path / 'runs'}",
            "name=distil",
            "drafter.method=draft_model",
            f"data.source={source}",
            f"target.name_or_path={tmp_path / 'target'}",
            "data.num_conversations=11",
            "data.heldout_conversations=3",
            "data.regenerate=false",
            "data.max_length=48",
            "drafter.init_from=null",
            "drafter.num_hidden_layers=1",
            "drafter.num_speculative_tokens=2",
            "train.mode=offline",
            "train.max_steps=3",
            "train.batch_size=4",
            "train.warmup_steps=1",
            "train.log_every=1",
            "train.acceptance.every=3",
            "train.acceptance.prompts=2",
            "train.acceptance.k=2",
            "train.acceptance.max_new_tokens=6",
            "capture.aux_layer_ids=[1, 2, 3]",
            "capture.shard_size=5",
            "capture.batch_size=2",
        ],
    )
    out = run_train(recipe)
    meta = read_metadata(out)
    assert meta.head_type == "draft_model" and meta.aux_layer_ids is None and meta.draft_vocab_size == len(chatml)
    assert meta.training["steps"] == 3 and meta.training["final"]["tau"] >= 1.0
    assert check_draft_model(out, target, chatml).checked_target
    card = (out / "README.md").read_text()
    assert card.startswith("---") and f'"model": "{out}"' in card and (out / "tokenizer.json").is_file()
    from_checkpoint = export_run(recipe.run_dir, tmp_path / "again", ["draftsmith"])  # RUN_DIR: the checkpoint
    assert read_metadata(from_checkpoint).weights == meta.weights
    copied = export_run(out, tmp_path / "copy", ["draftsmith"])  # an exported directory: re-exported
    assert read_metadata(copied).weights == meta.weights and read_metadata(copied).target == meta.target


# ------------------------------------------------------------------------------------------ export / runtime


@pytest.fixture
def exported(tiny_llama, word_tokenizer, tmp_path):
    """A draft distilled 2 steps from a 4-layer tiny target, exported; (dir, target, tokenizer, draft)."""
    from draftsmith.drafters.draft_model.export import export_draft_model
    from draftsmith.identity import target_identity

    target, tok = tiny_llama(seed=7), word_tokenizer(96)
    result = run(target, make_data(), tmp_path / "train", max_steps=2)
    out = export_draft_model(
        result.head, tok, tmp_path / "draft", target_identity(target, tok, "tiny"), training={"steps": result.steps}
    )
    return out, target, tok, result.head


def test_export_reloads_bit_identical(exported):
    from transformers import AutoModelForCausalLM

    from draftsmith.identity import file_sha256

    out, target, tok, draft = exported
    files = sorted(p.name for p in out.iterdir())
    assert {"config.json", "model.safetensors", "draftsmith.json", "README.md", "tokenizer.json"} <= set(files)
    assert not [f for f in files if f.endswith((".bin", ".pt", ".pkl")) or f.startswith(".")]
    meta = json.loads((out / "draftsmith.json").read_text())
    assert meta["format_version"] == 1 and meta["head_type"] == "draft_model"
    assert meta["weights"] == {"model.safetensors": file_sha256(out / "model.safetensors")}
    assert meta["head_config"]["num_hidden_layers"] == 1 and meta["target"]["num_hidden_layers"] == 4
    reloaded = AutoModelForCausalLM.from_pretrained(out).eval()
    ids = torch.randint(2, 96, (2, 17), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        assert torch.equal(reloaded(input_ids=ids).logits, draft.eval()(input_ids=ids).logits)


def test_runtime_checks_the_recorded_target(exported, tiny_llama, tmp_path):
    """An exported draft names its target: another one is refused naming the field (overridable by name);
    a corrupted weight file is refused; the method is inferred from draftsmith.json; a plain HF draft
    directory (no draftsmith.json) is still served, checked by its tokenizer only."""
    from draftsmith.drafters.eagle3.check import check_head
    from draftsmith.drafters.speculative import SpeculativeConfig
    from draftsmith.serve.engine import Engine

    out, target, tok, draft = exported
    assert SpeculativeConfig.from_dict({"model": str(out), "num_speculative_tokens": 3}).method == "draft_model"
    Engine(target, tok, {"model": str(out), "num_speculative_tokens": 3})
    assert "draft_model" in check_head(out, target, tok).summary()
    other = tiny_llama(seed=7, num_hidden_layers=3)
    with pytest.raises(HeadMismatchError, match="num_hidden_layers: head was trained for 4, target has 3") as e:
        Engine(other, tok, {"method": "draft_model", "model": str(out), "num_speculative_tokens": 3})
    assert e.value.field == "num_hidden_layers"
    Engine(
        other,
        tok,
        {"method": "draft_model", "model": str(out), "num_speculative_tokens": 3},
        allow_mismatch=("num_hidden_layers", "architecture_sha256"),
    )
    plain = tmp_path / "plain"
    draft.save_pretrained(plain)
    tok.save_pretrained(plain)
    Engine(other, tok, {"method": "draft_model", "model": str(plain), "num_speculative_tokens": 3})
    weights = out / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:-4] + b"\0\0\0\0")
    with pytest.raises(HeadMismatchError, match="sha256 of model.safetensors") as e:
        Engine(target, tok, {"method": "draft_model", "model": str(out), "num_speculative_tokens": 3})
    assert e.value.field == "weights"


# ------------------------------------------------------------------------------------------ reference target


@pytest.fixture(scope="module")
def reference_distilled(tmp_path_factory):
    """The reference target and `reference-draft` distilled 3 steps on its training split, exported."""
    from draftsmith.data_pipeline.dataset import load_conversations, render_dataset
    from draftsmith.drafters.draft_model.export import export_draft_model
    from draftsmith.identity import target_identity
    from draftsmith.models import load_causal_lm

    target, tok = load_causal_lm("reference")
    data = render_dataset(tok, load_conversations("reference:train", limit=12, seed=1), 256)
    out = tmp_path_factory.mktemp("reference")
    cfg = TrainConfig(mixed_precision="no", max_steps=3, batch_size=4, lr=1e-3, warmup_steps=1, log_every=1)
    result = train_draft_model(
        target,
        data,
        DraftModelConfig(init_from="reference-draft", prompt_loss_weight=1.0),
        cfg,
        out / "train",
        tok.pad_token_id,
        tokenizer=tok,
    )
    draft_dir = export_draft_model(result.head, tok, out / "draft", target_identity(target, tok, "reference"))
    return target, tok, draft_dir


def test_distilled_draft_is_lossless_greedy_on_held_out_prompts(reference_distilled):
    """Speculative greedy output with the exported distilled draft equals plain greedy output token for
    token, k in {1, 3, 5}, on 20 held-out prompts (5 per task) of the reference target."""
    from draftsmith import reference
    from draftsmith.core.generate import GenerationConfig, generate_plain, generate_speculative
    from draftsmith.data_pipeline.chat import prompt_ids
    from draftsmith.serve.engine import Engine

    target, tok, draft_dir = reference_distilled
    prompts = [r["messages"] for recs in reference.tasks(limit=5).values() for r in recs]
    assert len(prompts) >= 20
    gen = GenerationConfig(max_new_tokens=20, eos_token_ids=[tok.eos_token_id])
    engines = {
        k: Engine(target, tok, {"method": "draft_model", "model": str(draft_dir), "num_speculative_tokens": k})
        for k in (1, 3, 5)
    }
    accepted = {k: 0 for k in engines}
    for messages in prompts:
        ids = prompt_ids(tok, messages)
        plain = generate_plain(engines[1].target, ids, gen).tokens
        for k, engine in engines.items():
            out = generate_speculative(engine.target, engine.new_proposer(GenerationConfig()), ids, gen, k)
            assert out.tokens == plain, f"k={k}: speculative output differs from plain greedy"
            accepted[k] += out.stats.num_accepted_tokens
    assert all(n > 0 for n in accepted.values()), accepted  # the draft does propose the target's tokens
