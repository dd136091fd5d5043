"""Conversations the data pipeline leaves out are counted by reason, logged, and stop prepare above
``data.max_dropped_fraction`` (issue 13, fault 5: ``max_length`` truncating answers away was silent)."""

import json
import logging

import pytest

from draftsmith import reference
from draftsmith.config import ConfigError, load_config
from draftsmith.data_pipeline import regenerate as regen
from draftsmith.data_pipeline.chat import render
from draftsmith.data_pipeline.config import DataConfig
from draftsmith.data_pipeline.dataset import load_conversations, render_dataset
from draftsmith.data_pipeline.drops import DroppedConversationsError
from draftsmith.data_pipeline.prepare import prepare
from draftsmith.data_pipeline.regenerate import Answer, regenerate, regenerate_with_drops
from draftsmith.data_pipeline.shards import write_shards

TRUNCATED = "no_supervised_tokens_after_truncation"
MAX_LENGTH = 128
NUM, HELDOUT = 40, 4


def conv(question, *answers):
    messages = [{"role": "user", "content": question}]
    for a in answers:
        messages += [{"role": "assistant", "content": a}, {"role": "user", "content": "more"}]
    return {"messages": messages[:-1] if answers else messages}


# tiny-chatml lengths: "Hi" renders 34 tokens (answer from token 21); the long questions put the answer
# past token 48; the long answer is cut at 48 but starts before it
SHORT = [conv("Hi", "fine thanks"), conv("How are you?", "fine thanks"), conv("a", "fine thanks " * 10)]
LONG_QUESTIONS = [conv("x" * 100, "fine thanks"), conv("Add two numbers " * 10, "def add")]


@pytest.fixture(scope="module")
def reference_target():
    return reference.target()


def reference_config(**overrides):
    return DataConfig(
        **{
            **dict(
                source="reference:train",
                num_conversations=NUM,
                heldout_conversations=HELDOUT,
                regenerate=False,
                max_length=MAX_LENGTH,
                draft_vocab_size=None,
            ),
            **overrides,
        }
    )


def test_prepare_counts_answers_truncated_away_by_reason(reference_target, tmp_path, caplog):
    target, tok = reference_target
    train = load_conversations("reference:train", limit=NUM + HELDOUT, seed=0)[HELDOUT:]
    rendered = [render(tok, c["messages"]) for c in train]
    lost = sum(not r.loss_mask[:MAX_LENGTH].any() for r in rendered)
    cut = sum(r.loss_mask[:MAX_LENGTH].any() and r.input_ids.numel() > MAX_LENGTH for r in rendered)
    assert 0 < lost < NUM and cut > 0

    with caplog.at_level(logging.WARNING, logger="draftsmith.data_pipeline.prepare"):
        data = prepare(reference_config(max_dropped_fraction=1.0), target, tok, "reference", tmp_path / "data")
    m = data.manifest
    assert m["dropped"] == {TRUNCATED: lost} and m["skipped_records"] == lost and m["malformed_records"] == 0
    assert m["conversations_selected"] == NUM + HELDOUT and m["heldout_conversations"] == HELDOUT
    assert m["conversations"] == len(data.conversations) == NUM - lost
    assert m["dropped_fraction"] == pytest.approx(lost / (NUM + HELDOUT))
    assert m["truncated_conversations"] == cut
    assert len(m["dropped_examples"][TRUNCATED]) == min(3, lost)
    assert all(f"past max_length {MAX_LENGTH}" in e for e in m["dropped_examples"][TRUNCATED])
    on_disk = [json.loads(line) for line in (tmp_path / "data" / "conversations.jsonl").open()]
    assert on_disk == data.conversations
    assert all(render(tok, c["messages"], max_length=MAX_LENGTH).loss_mask.any() for c in on_disk)
    assert (
        f"prepare: skipped {lost} of {NUM + HELDOUT} conversations: {TRUNCATED}: {lost} (raise data.max_length)"
        in caplog.text
    )

    # the share is checked again when the folder is reused (it does not key the folder)
    with pytest.raises(DroppedConversationsError, match=f"lost {lost} of {NUM + HELDOUT}"):
        prepare(reference_config(), target, tok, "reference", tmp_path / "data")


def test_prepare_stops_when_more_than_the_allowed_share_is_lost(reference_target, tmp_path):
    target, tok = reference_target
    out = tmp_path / "data"
    with pytest.raises(DroppedConversationsError) as e:
        prepare(reference_config(), target, tok, "reference", out)
    message = str(e.value)
    assert f"of {NUM + HELDOUT} conversations" in message and "more than data.max_dropped_fraction=0.1" in message
    assert f"Main reason {TRUNCATED}" in message and "raise data.max_length" in message
    assert "data.max_dropped_fraction=0." in message.split("or set ")[1]
    assert not (out / "manifest.json").exists() and not (out / "conversations.jsonl").exists()

    fixed = prepare(reference_config(max_length=640), target, tok, "reference", out)
    assert fixed.manifest["dropped"] == {} and fixed.manifest["conversations"] == NUM


def test_the_regeneration_journal_survives_the_stop_and_a_rerun_answers_nothing(
    tiny_llama, chatml, tmp_path, monkeypatch
):
    target = tiny_llama(seed=5, vocab_size=len(chatml))
    source = tmp_path / "data.jsonl"
    convs = SHORT + LONG_QUESTIONS + [conv("empty", "x")]
    source.write_text("".join(json.dumps(c) + "\n" for c in convs))
    calls = []

    def scripted(self, prompts, max_new_tokens, temperature, seeds):
        calls.append(len(prompts))
        return [Answer("" if p[0]["content"] == "empty" else "fine thanks", True) for p in prompts]

    monkeypatch.setattr(regen.RuntimeAnswerer, "answer", scripted)
    cfg = DataConfig(
        source=str(source),
        num_conversations=None,
        heldout_conversations=0,
        max_new_tokens=6,
        batch_size=2,
        max_length=48,
        draft_vocab_size=None,
        regenerate_engine="draftsmith",
    )
    out = tmp_path / "data"
    with pytest.raises(
        DroppedConversationsError,
        match=r"lost 3 of 6 conversations \(50\.0%.*"
        rf"{TRUNCATED}: 2 .*empty_regenerated_answer: 1",
    ) as e:
        prepare(cfg, target, chatml, "tiny", out)
    journal = out / "regenerate.partial.jsonl"
    assert journal.exists() and f"The regenerated answers stay in {journal}" in str(e.value)
    assert not (out / "manifest.json").exists() and sum(calls) == len(convs)

    calls.clear()
    cfg.max_length, cfg.max_dropped_fraction = 512, 0.2
    data = prepare(cfg, target, chatml, "tiny", out)
    assert calls == [] and not journal.exists()
    assert data.manifest["dropped"] == {"empty_regenerated_answer": 1} and data.manifest["skipped_records"] == 1
    assert "the answer to turn 0 is empty" in data.manifest["dropped_examples"]["empty_regenerated_answer"][0]
    assert len(data.conversations) == 5


def test_regenerate_reports_and_logs_empty_answers(caplog):
    class Scripted:
        def identity(self):
            return {"engine": "test", "name_or_path": "s", "revision": None}

        def answer(self, prompts, max_new_tokens, temperature, seeds):
            return [Answer("" if p[0]["content"] == "a" else "ok", p[0]["content"] != "Hi") for p in prompts]

    convs = SHORT + [conv("Hi", "hello")]
    out = regenerate_with_drops(Scripted(), convs, max_new_tokens=4, batch_size=2, progress=False)
    assert [d.kind for d in out.dropped] == ["empty_regenerated_answer"] and out.dropped[0].index == 2
    assert out.kept == [0, 1, 3] and len(out.conversations) == 3
    strict = regenerate_with_drops(
        Scripted(), convs, max_new_tokens=4, batch_size=2, progress=False, drop_unfinished=True
    )
    assert [(d.index, d.kind) for d in strict.dropped] == [
        (0, "unfinished_regenerated_answer"),
        (2, "empty_regenerated_answer"),
        (3, "unfinished_regenerated_answer"),
    ]
    with caplog.at_level(logging.WARNING, logger="draftsmith.data_pipeline.regenerate"):
        assert len(regenerate(Scripted(), convs, max_new_tokens=4, batch_size=2, progress=False)) == 3
    assert "regenerate: skipped 1 of 4 conversations: empty_regenerated_answer: 1" in caplog.text


def test_render_dataset_names_each_reason(chatml, caplog):
    convs = SHORT + LONG_QUESTIONS + [conv("Only a question")]
    with caplog.at_level(logging.WARNING, logger="draftsmith.data_pipeline.dataset"):
        ds = render_dataset(chatml, convs, 48)
    assert ds.kept == [0, 1, 2] and ds.truncated == 1
    assert [(s.index, s.kind) for s in ds.skipped] == [(3, TRUNCATED), (4, TRUNCATED), (5, "no_supervised_tokens")]
    assert "render_dataset: skipped 3 of 6 conversations" in caplog.text and "raise data.max_length" in caplog.text
    with pytest.raises(ValueError, match=rf"3 left out: {TRUNCATED}: 3"):
        render_dataset(chatml, LONG_QUESTIONS + [conv("x" * 60, "y")], 48)


def test_capture_counts_what_it_leaves_out_by_reason(tiny_llama, chatml, tmp_path, caplog):
    target = tiny_llama(seed=3, vocab_size=len(chatml))
    convs = SHORT + LONG_QUESTIONS + [conv("Only a question")]
    with caplog.at_level(logging.WARNING, logger="draftsmith.data_pipeline.shards"):
        manifest = write_shards(
            target,
            chatml,
            convs,
            tmp_path / "cap",
            aux_layer_ids=(0, 1, 2),
            max_length=48,
            shard_size=4,
            batch_size=2,
            target_name="tiny",
            progress=False,
        )
    assert manifest["dropped"] == {TRUNCATED: 2, "no_supervised_tokens": 1}
    assert manifest["skipped_conversations"] == 3 and manifest["num_sequences"] == 3
    assert [e["dropped"] for e in manifest["shards"]] == [{TRUNCATED: 1}, {TRUNCATED: 1, "no_supervised_tokens": 1}]
    assert "conversation 3: its first supervised token" in manifest["dropped_examples"][0]
    assert "skipped 3 of 6 conversations" in caplog.text and "raise data.max_length" in caplog.text


def test_prepare_refuses_a_heldout_split_that_takes_everything(chatml, tmp_path):
    source = tmp_path / "data.jsonl"
    source.write_text("".join(json.dumps(c) + "\n" for c in SHORT))
    cfg = DataConfig(
        source=str(source),
        num_conversations=None,
        heldout_conversations=5,
        regenerate=False,
        max_length=64,
        draft_vocab_size=None,
    )
    with pytest.raises(ValueError, match=r"all 3 go to the held-out split \(data.heldout_conversations=5\)"):
        prepare(cfg, None, chatml, "tiny", tmp_path / "data")


@pytest.mark.parametrize(
    "override, problem",
    [
        ("max_dropped_fraction=1.5", "max_dropped_fraction must be in"),
        ("max_dropped_fraction=-0.1", "max_dropped_fraction must be in"),
        ("max_length=1", "max_length must be >= 2"),
        ("heldout_conversations=-1", "heldout_conversations must be >= 0"),
    ],
)
def test_data_config_checks_its_ranges(override, problem):
    with pytest.raises(ConfigError, match=problem):
        load_config(DataConfig, None, [override])
