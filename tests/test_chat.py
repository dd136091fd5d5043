"""Assistant-only loss masks from prefix rendering, against hand-labelled spans."""

import pytest
import torch

from draftsmith.data_pipeline.chat import ChatTemplateError, render, supervised_spans
from draftsmith.data_pipeline.dataset import DatasetError, normalise, render_dataset


@pytest.fixture(scope="module")
def chatml(chatml_tokenizer):
    return chatml_tokenizer(vocab_size=400)


def supervised_text(tok, r):
    return tok.decode(r.input_ids[r.loss_mask])


def test_only_assistant_answers_are_supervised(chatml):
    messages = [
        {"role": "system", "content": "You are terse."},
        {"role": "user", "content": "Add two numbers."},
        {"role": "assistant", "content": "def add(a, b):\n    return a + b"},
        {"role": "user", "content": "Thanks"},
        {"role": "assistant", "content": "Hello there"},
    ]
    r = render(chatml, messages)
    assert supervised_text(chatml, r) == "def add(a, b):\n    return a + b<|im_end|>Hello there<|im_end|>"
    assert r.input_ids.shape == r.loss_mask.shape and r.loss_mask.dtype == torch.bool
    # the role header and the template's trailing newline are never supervised
    text = r.text
    full, spans = supervised_spans(chatml, messages)
    assert [full[a:b] for a, b in spans] == ["def add(a, b):\n    return a + b<|im_end|>", "Hello there<|im_end|>"]
    assert text == full


def test_think_blocks_are_not_supervised(chatml):
    messages = [
        {"role": "user", "content": "Hi"},
        {"role": "assistant", "content": "<think>\nthe user greets me\n</think>\n\nHello there"},
    ]
    _, spans = supervised_spans(chatml, messages)
    full = supervised_spans(chatml, messages)[0]
    assert "".join(full[a:b] for a, b in spans) == "Hello there<|im_end|>"


def test_template_that_rewrites_history_is_refused(chatml):
    import copy

    tok = copy.deepcopy(chatml)
    # renders only the last message: earlier turns change between prefixes
    tok.chat_template = "{{ messages[-1]['content'] }}{% if add_generation_prompt %}>{% endif %}"
    with pytest.raises(ChatTemplateError, match="changes the text of earlier turns"):
        render(tok, [{"role": "user", "content": "a"}, {"role": "assistant", "content": "b"}])


def test_dataset_without_answers_is_an_error(chatml):
    with pytest.raises(ValueError, match="supervised fraction"):
        render_dataset(chatml, [{"messages": [{"role": "user", "content": "Hi"}]}], 64)


def test_normalise_sharegpt_and_errors():
    rec = normalise({"conversations": [{"from": "human", "value": "hi"}, {"from": "gpt", "value": "yo"}]}, 0)
    assert rec["messages"] == [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo"}]
    with pytest.raises(DatasetError, match="record 3, turn 0: unknown role"):
        normalise({"messages": [{"role": "robot", "content": "x"}]}, 3)
    with pytest.raises(DatasetError, match="empty or missing content"):
        normalise({"messages": [{"role": "user", "content": ""}]}, 1)
