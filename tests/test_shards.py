"""Offline capture shards: round trip against online capture, resume after a kill, corruption refused."""

import json

import pytest
import torch

from draftsmith.data_pipeline import shards
from draftsmith.data_pipeline.capture import capture
from draftsmith.data_pipeline.chat import render
from draftsmith.data_pipeline.shards import SafetensorsStream, ShardError, ShardReader, shard_name, write_shards
from draftsmith.identity import file_sha256, target_identity

AUX = (0, 1, 2)
MAX_LENGTH = 40


@pytest.fixture(scope="module")
def target(tiny_llama, chatml):
    return tiny_llama(seed=3, vocab_size=len(chatml))


def conversation(question: str, *answers: str) -> dict:
    messages = [{"role": "user", "content": question}]
    for a in answers:
        messages += [{"role": "assistant", "content": a}, {"role": "user", "content": "more"}]
    return {"messages": messages[:-1] if answers else messages}


CONVERSATIONS = [
    conversation("Hi", "Hello there"),
    conversation("Add", "def add(a, b):\n    return a + b", "Hello"),
    conversation("How are you?", "Hello there, how are you?"),
    conversation("x", "def add(a, b):\n    return a + b\n" * 4),  # longer than MAX_LENGTH
    conversation("Only a question"),  # nothing to supervise
    conversation("a", "b"),
    conversation("Hello", "there"),
]
SUPERVISED = [i for i in range(len(CONVERSATIONS)) if i != 4]


def capture_into(target, tok, out, **overrides):
    kwargs = dict(
        aux_layer_ids=AUX, max_length=MAX_LENGTH, shard_size=3, batch_size=1, target_name="tiny", progress=False
    )
    return write_shards(target, tok, CONVERSATIONS, out, **{**kwargs, **overrides})


def test_round_trip_equals_online_capture(target, chatml, tmp_path):
    manifest = capture_into(target, chatml, tmp_path / "cap")
    reader = ShardReader(tmp_path / "cap")
    seen = []
    for seq in reader:
        r = render(chatml, CONVERSATIONS[seq.conversation_index]["messages"], max_length=MAX_LENGTH)
        assert torch.equal(seq.input_ids, r.input_ids) and torch.equal(seq.loss_mask, r.loss_mask)
        online = capture(target, r.input_ids[None], AUX, attention_mask=torch.ones_like(r.input_ids)[None])
        assert torch.equal(seq.aux_hidden, online.aux_hidden[0])  # bit-identical
        logits = ShardReader.target_logits(target.lm_head, seq.final_hidden)  # [T, V]
        torch.testing.assert_close(logits, online.target_logits[0], atol=1e-5, rtol=0)
        seen.append(seq.conversation_index)
    assert sorted(seen) == SUPERVISED and len(reader) == manifest["num_sequences"] == len(SUPERVISED)
    assert reader[-1].conversation_index == seen[-1] and reader[0].conversation_index == seen[0]

    assert manifest["complete"] and manifest["num_shards"] == 3
    assert [e["sequences"] for e in manifest["shards"]] == [3, 2, 1]
    too_long = sum(render(chatml, c["messages"]).input_ids.numel() > MAX_LENGTH for c in CONVERSATIONS)
    assert manifest["skipped_conversations"] == 1 and manifest["truncated_conversations"] == too_long >= 1
    assert manifest["aux_layer_ids"] == list(AUX) and manifest["aux_layer_convention"] == "hf_hidden_states_index"
    assert manifest["target"] == target_identity(target, chatml, "tiny")
    assert manifest["capture_dtype"] == manifest["target_dtype"] == "float32"
    rendered = [render(chatml, CONVERSATIONS[i]["messages"], max_length=MAX_LENGTH) for i in SUPERVISED]
    assert manifest["num_tokens"] == sum(r.input_ids.numel() for r in rendered)
    assert manifest["num_supervised_tokens"] == sum(int(r.loss_mask.sum()) for r in rendered)
    for entry in manifest["shards"]:
        assert file_sha256(tmp_path / "cap" / entry["file"]) == entry["sha256"]
    assert json.loads((tmp_path / "cap" / "manifest.json").read_text()) == manifest


def test_padded_batches_match_single_sequences(target, chatml, tmp_path):
    capture_into(target, chatml, tmp_path / "cap", batch_size=3)
    for seq in ShardReader(tmp_path / "cap"):
        online = capture(target, seq.input_ids[None], AUX)
        torch.testing.assert_close(seq.aux_hidden, online.aux_hidden[0], atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(
            ShardReader.target_logits(target.lm_head, seq.final_hidden), online.target_logits[0], atol=1e-5, rtol=1e-5
        )


def test_resume_after_kill_writes_only_the_remaining_shards(target, chatml, tmp_path, monkeypatch):
    real = shards._write_shard

    def killed_after_first(*args, index, out, **kwargs):
        if index > 0:
            (out / f"{shard_name(index)}.tmp").write_bytes(b"half a shard")  # what a kill leaves behind
            raise KeyboardInterrupt("simulated kill")
        return real(*args, index=index, out=out, **kwargs)

    cap = tmp_path / "cap"
    monkeypatch.setattr(shards, "_write_shard", killed_after_first)
    with pytest.raises(KeyboardInterrupt):
        capture_into(target, chatml, cap)
    partial = json.loads((cap / "manifest.json").read_text())
    assert not partial["complete"] and [e["index"] for e in partial["shards"]] == [0]
    with pytest.raises(ShardError, match="incomplete"):
        ShardReader(cap)
    first = (cap / shard_name(0)).stat().st_mtime_ns

    written = []

    def recording(*args, **kwargs):
        entry = real(*args, **kwargs)
        written.append(entry["index"])
        return entry

    monkeypatch.setattr(shards, "_write_shard", recording)
    manifest = capture_into(target, chatml, cap)
    assert written == [1, 2] and manifest["complete"]
    assert (cap / shard_name(0)).stat().st_mtime_ns == first and not list(cap.glob("*.tmp"))
    fresh = capture_into(target, chatml, tmp_path / "fresh")
    assert [e["sha256"] for e in manifest["shards"]] == [e["sha256"] for e in fresh["shards"]]
    written.clear()
    assert capture_into(target, chatml, cap) == manifest and written == []  # complete: nothing to do


def test_corrupted_shard_is_refused_by_name_and_recaptured(target, chatml, tmp_path, monkeypatch):
    cap = tmp_path / "cap"
    manifest = capture_into(target, chatml, cap)
    path = cap / shard_name(1)
    data = bytearray(path.read_bytes())
    data[-5] ^= 0xFF
    path.write_bytes(bytes(data))
    reader = ShardReader(cap)
    assert reader[0].conversation_index in SUPERVISED  # shard 0 is fine
    with pytest.raises(ShardError, match="shard-00001.safetensors"):
        list(reader)
    assert len(list(ShardReader(cap, verify=False))) == len(SUPERVISED)

    written = []
    real = shards._write_shard
    monkeypatch.setattr(shards, "_write_shard", lambda *a, **k: written.append(k["index"]) or real(*a, **k))
    assert capture_into(target, chatml, cap) == manifest and written == [1]
    assert len(list(ShardReader(cap))) == len(SUPERVISED)


def test_capture_dtype_is_the_targets_recorded_and_checked(target, chatml, tiny_llama, tmp_path):
    bf16 = tiny_llama(seed=3, vocab_size=len(chatml)).to(torch.bfloat16)
    manifest = capture_into(bf16, chatml, tmp_path / "cap", capture_dtype="bfloat16")
    assert manifest["capture_dtype"] == manifest["target_dtype"] == "bfloat16"
    reader = ShardReader(tmp_path / "cap")
    assert reader.capture_dtype == torch.bfloat16
    seq = reader[0]
    online = capture(bf16, seq.input_ids[None], AUX, attention_mask=torch.ones_like(seq.input_ids)[None])
    assert seq.aux_hidden.dtype == seq.final_hidden.dtype == torch.bfloat16
    assert torch.equal(seq.aux_hidden, online.aux_hidden[0])
    reader.check_target(bf16, chatml)
    with pytest.raises(ShardError, match="runs in float32"):  # same weights, served in another dtype
        reader.check_target(target, chatml)
    # states of an fp32 forward rounded to bf16 are not what a bf16 runtime computes: refused, not converted
    with pytest.raises(ShardError, match="capture dtype bfloat16 differs from the target's float32"):
        capture_into(target, chatml, tmp_path / "converted", capture_dtype="bfloat16")
    assert not (tmp_path / "converted" / "manifest.json").exists()


def test_other_inputs_in_the_same_folder_are_refused(target, chatml, tmp_path):
    capture_into(target, chatml, tmp_path / "cap")
    with pytest.raises(ShardError, match="capture of other inputs"):
        capture_into(target, chatml, tmp_path / "cap", max_length=MAX_LENGTH + 1)


def test_target_whose_logits_are_not_lm_head_of_the_final_state_is_refused(target, chatml, tmp_path):
    class LogitScaled(torch.nn.Module):  # like Cohere's logit_scale
        def __init__(self, inner):
            super().__init__()
            self.inner, self.config = inner, inner.config

        def forward(self, **kwargs):
            out = self.inner(**kwargs)
            out.logits = 0.0625 * out.logits
            return out

        def get_output_embeddings(self):
            return self.inner.lm_head

    with pytest.raises(ShardError, match="does not reproduce the target's logits"):
        capture_into(LogitScaled(target), chatml, tmp_path / "cap")


def test_check_target(target, chatml, tiny_llama, tmp_path):
    capture_into(target, chatml, tmp_path / "cap")
    reader = ShardReader(tmp_path / "cap")
    reader.check_target(target, chatml)
    with pytest.raises(ShardError, match="architecture_sha256"):
        reader.check_target(tiny_llama(vocab_size=len(chatml), hidden_size=48))


def test_streamed_safetensors_read_back(tmp_path):
    from safetensors.torch import load_file

    tensors = {
        "a": torch.randn(3, 5).bfloat16(),
        "b": torch.tensor([True, False]),
        "c": torch.zeros(0, 4),
        "d": torch.arange(7),
    }
    layout = [(k, v.dtype, tuple(v.shape)) for k, v in tensors.items()]
    with SafetensorsStream(tmp_path / "x.safetensors", layout, {"note": "test"}) as stream:
        for k, v in tensors.items():
            stream.write(k, v)
    back = load_file(tmp_path / "x.safetensors")
    assert all(torch.equal(back[k], v) and back[k].dtype == v.dtype for k, v in tensors.items())
    with pytest.raises(ValueError, match="expected a"):
        SafetensorsStream(tmp_path / "y.safetensors", layout).write("b", tensors["b"])
    with pytest.raises(ValueError, match="never written"):
        with SafetensorsStream(tmp_path / "z.safetensors", layout) as stream:
            stream.write("a", tensors["a"])


KILLED_CAPTURE = """
import json, sys, time
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer
from draftsmith.data_pipeline import shards

torch.set_num_threads(1)
folder, out = sys.argv[1], sys.argv[2]
model = AutoModelForCausalLM.from_pretrained(folder).eval()
tokenizer = AutoTokenizer.from_pretrained(folder)
conversations = [json.loads(line) for line in open(folder + "/conversations.jsonl")]
real = shards.capture_final

calls = [0]

def slow(*args, **kwargs):          # blocks inside shard 1 (after its first batch) until it is killed
    calls[0] += 1
    if calls[0] >= 4:
        time.sleep(3600)
    return real(*args, **kwargs)

shards.capture_final = slow
shards.write_shards(model, tokenizer, conversations, out, aux_layer_ids=(0, 1, 2), max_length=40, shard_size=2,
                    batch_size=1, target_name="tiny", progress=False)
"""


def test_sigkill_mid_capture_then_rerun_gives_the_same_manifest_and_shards(target, chatml, tmp_path):
    """A real kill: a subprocess capturing is SIGKILLed inside its second shard; the rerun finishes
    the capture without rewriting the first shard, and the folder equals an uninterrupted capture."""
    import os
    import signal
    import subprocess
    import sys
    import time

    from transformers import AutoModelForCausalLM, AutoTokenizer

    folder = tmp_path / "model"
    target.save_pretrained(folder)
    chatml.save_pretrained(folder)
    (folder / "conversations.jsonl").write_text("".join(json.dumps(c) + "\n" for c in CONVERSATIONS))
    model, tok = AutoModelForCausalLM.from_pretrained(folder).eval(), AutoTokenizer.from_pretrained(folder)
    kwargs = dict(
        aux_layer_ids=(0, 1, 2), max_length=40, shard_size=2, batch_size=1, target_name="tiny", progress=False
    )
    cap = tmp_path / "cap"
    env = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"}
    child = subprocess.Popen(
        [sys.executable, "-c", KILLED_CAPTURE, str(folder), str(cap)],
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
    )
    deadline = time.monotonic() + 600  # a guard against hanging, not a timing assertion
    try:
        while time.monotonic() < deadline and child.poll() is None:
            try:
                done = json.loads((cap / "manifest.json").read_text())["shards"]
            except (FileNotFoundError, json.JSONDecodeError):
                done = []
            if done and (cap / f"{shard_name(1)}.tmp").exists():
                break
            time.sleep(0.02)
        assert child.poll() is None, f"the capture ended before it could be killed: {child.stderr.read().decode()}"
        os.kill(child.pid, signal.SIGKILL)
    finally:
        if child.poll() is None:
            child.kill()
        child.wait()
        child.stderr.close()
    assert child.returncode == -signal.SIGKILL
    partial = json.loads((cap / "manifest.json").read_text())
    assert not partial["complete"] and [e["index"] for e in partial["shards"]] == [0]
    assert (cap / f"{shard_name(1)}.tmp").exists()  # the shard it was writing
    first = (cap / shard_name(0)).stat().st_mtime_ns

    # rerun and reference capture in fresh processes like the killed one: other tests of this session
    # may change process-wide math settings, so in-process states could differ in the last bit
    plain = KILLED_CAPTURE.replace("shards.capture_final = slow", "")
    for out in (cap, tmp_path / "fresh"):
        subprocess.run(
            [sys.executable, "-c", plain, str(folder), str(out)], env=env, check=True, stdout=subprocess.DEVNULL
        )
    resumed = write_shards(model, tok, CONVERSATIONS, cap, **kwargs)  # finished: only verified
    fresh = json.loads((tmp_path / "fresh" / "manifest.json").read_text())
    assert resumed == fresh and resumed["complete"]
    assert (cap / shard_name(0)).stat().st_mtime_ns == first and not list(cap.glob("*.tmp"))
    assert sorted(p.name for p in cap.iterdir()) == sorted(p.name for p in (tmp_path / "fresh").iterdir())
    for entry in fresh["shards"]:
        assert (cap / entry["file"]).read_bytes() == (tmp_path / "fresh" / entry["file"]).read_bytes()
    assert (cap / "manifest.json").read_text() == (tmp_path / "fresh" / "manifest.json").read_text()


def test_nan_states_are_refused_on_write_and_on_read(chatml, tiny_llama, tmp_path):
    broken = tiny_llama(seed=3, vocab_size=len(chatml))
    hook = broken.model.layers[1].register_forward_hook(lambda module, args, out: out * float("nan"))
    with pytest.raises(ShardError, match=r"conversation \d: .*NaN/inf"):
        capture_into(broken, chatml, tmp_path / "nan")
    hook.remove()

    cap = tmp_path / "cap"
    manifest = capture_into(broken, chatml, cap)
    path = cap / manifest["shards"][0]["file"]
    data = bytearray(path.read_bytes())  # the first stored float of aux_hidden -> NaN
    header_len = int.from_bytes(data[:8], "little")
    start = 8 + header_len + json.loads(data[8 : 8 + header_len])["0.aux_hidden"]["data_offsets"][0]
    data[start : start + 4] = torch.tensor([float("nan")]).numpy().tobytes()
    path.write_bytes(bytes(data))
    with pytest.raises(ShardError, match="sha256"):
        ShardReader(cap)[0]
    with pytest.raises(ShardError, match="sequence 0 of shard-00000.safetensors: hidden states hold NaN"):
        ShardReader(cap, verify=False)[0]


def test_shard_that_disagrees_with_its_manifest_entry_is_refused(target, chatml, tmp_path):
    cap = tmp_path / "cap"
    manifest = capture_into(target, chatml, cap)
    manifest["shards"][1]["tokens"] += 1
    (cap / "manifest.json").write_text(json.dumps(manifest))
    reader = ShardReader(cap, verify=False)
    reader[0]
    with pytest.raises(ShardError, match="shard-00001.safetensors .* holds .* tokens; its manifest entry says"):
        list(reader)
    manifest["shards"][1]["tokens"] -= 1
    manifest["capture_dtype"] = "bfloat16"
    (cap / "manifest.json").write_text(json.dumps(manifest))
    with pytest.raises(ShardError, match="holds float32 states; the manifest says bfloat16"):
        ShardReader(cap, verify=False)[0]
