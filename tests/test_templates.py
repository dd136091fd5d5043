"""Golden assistant-only masks for four chat-template families, and the malformed-record policy.

The templates below are written here, modelled on the real families (never downloaded): Llama-3.1
headers, Qwen3 ChatML with reasoning (history think blocks dropped, enable_thinking), Mistral [INST],
plain ChatML; plus two that stress the mask: Mistral v0.3's moving system prompt (refused) and an
R1-style generation prompt that opens the think block. Each expected supervised text is hand-labelled:
the decoded supervised tokens must equal it exactly, so a token of a system/user/tool turn, a header or
a reasoning block that slipped into the mask fails the test.
"""

import json
import logging

import pytest
from jinja2 import TemplateError

from draftsmith.data_pipeline.chat import ChatTemplateError, render, supervised_spans
from draftsmith.data_pipeline.dataset import (
    DatasetError,
    load_conversations,
    normalise,
    read_conversations,
    render_dataset,
)

# Llama-3.1 header style: a system block always (knowledge-date preamble), contents trimmed, tool -> ipython.
LLAMA3 = r"""{{- bos_token }}
{%- if messages[0]['role'] == 'system' %}
    {%- set system_text = messages[0]['content'] | trim %}
    {%- set turns = messages[1:] %}
{%- else %}
    {%- set system_text = '' %}
    {%- set turns = messages %}
{%- endif %}
{{- '<|start_header_id|>system<|end_header_id|>\n\nCutting Knowledge Date: December 2023\nToday Date: 26 Jul 2024\n\n' }}
{{- system_text + '<|eot_id|>' }}
{%- for message in turns %}
    {%- set role = 'ipython' if message['role'] == 'tool' else message['role'] %}
    {{- '<|start_header_id|>' + role + '<|end_header_id|>\n\n' + message['content'] | trim + '<|eot_id|>' }}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<|start_header_id|>assistant<|end_header_id|>\n\n' }}
{%- endif %}"""

# Qwen3 style ChatML: the reasoning is split off the content at </think> and kept only for assistant
# turns after the last user query (always for the last message, empty or not); enable_thinking=false
# prompts with an empty think block; tool results go in a user turn.
QWEN3 = r"""{%- if messages[0]['role'] == 'system' %}
    {{- '<|im_start|>system\n' + messages[0]['content'] + '<|im_end|>\n' }}
{%- endif %}
{%- set state = namespace(last_query=-1) %}
{%- for message in messages %}
    {%- if message['role'] == 'user' %}{%- set state.last_query = loop.index0 %}{%- endif %}
{%- endfor %}
{%- for message in messages %}
    {%- if message['role'] == 'user' or (message['role'] == 'system' and not loop.first) %}
        {{- '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>\n' }}
    {%- elif message['role'] == 'assistant' %}
        {%- set answer = message['content'] %}
        {%- set reasoning = '' %}
        {%- if '</think>' in answer %}
            {%- set reasoning = answer.split('</think>')[0].split('<think>')[-1].strip('\n') %}
            {%- set answer = answer.split('</think>')[-1].lstrip('\n') %}
        {%- endif %}
        {%- if loop.index0 > state.last_query and (loop.last or reasoning) %}
            {{- '<|im_start|>assistant\n<think>\n' + reasoning + '\n</think>\n\n' + answer + '<|im_end|>\n' }}
        {%- else %}
            {{- '<|im_start|>assistant\n' + answer + '<|im_end|>\n' }}
        {%- endif %}
    {%- elif message['role'] == 'tool' %}
        {%- if loop.first or messages[loop.index0 - 1]['role'] != 'tool' %}{{- '<|im_start|>user' }}{%- endif %}
        {{- '\n<tool_response>\n' + message['content'] + '\n</tool_response>' }}
        {%- if loop.last or messages[loop.index0 + 1]['role'] != 'tool' %}{{- '<|im_end|>\n' }}{%- endif %}
    {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<|im_start|>assistant\n' }}
    {%- if enable_thinking is defined and enable_thinking is false %}{{- '<think>\n\n</think>\n\n' }}{%- endif %}
{%- endif %}"""

# Mistral [INST] style: roles alternate (else raise_exception), the system prompt joins the first user
# turn, the assistant writes " ANSWER</s>" (the space is the model's, not the prompt's).
MISTRAL = r"""{%- if messages[0]['role'] == 'system' %}
    {%- set system_text = messages[0]['content'] %}
    {%- set turns = messages[1:] %}
{%- else %}
    {%- set system_text = '' %}
    {%- set turns = messages %}
{%- endif %}
{{- bos_token }}
{%- for message in turns %}
    {%- if (message['role'] == 'user') != (loop.index0 % 2 == 0) %}
        {{- raise_exception('Conversation roles must alternate user/assistant/user/assistant/...') }}
    {%- endif %}
    {%- if message['role'] == 'user' and loop.first and system_text %}
        {{- '[INST] ' + system_text + '\n\n' + message['content'] + '[/INST]' }}
    {%- elif message['role'] == 'user' %}
        {{- '[INST] ' + message['content'] + '[/INST]' }}
    {%- else %}
        {{- ' ' + message['content'] | trim + eos_token }}
    {%- endif %}
{%- endfor %}"""

# Mistral v0.3's quirk: the system prompt goes with the LAST user turn, so it moves as turns are added.
MISTRAL_SYSTEM_LAST = MISTRAL.replace("loop.first and system_text", "loop.last and system_text")

# Plain ChatML with a default system prompt when the conversation has none.
CHATML = r"""{%- if messages[0]['role'] != 'system' %}
    {{- '<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n' }}
{%- endif %}
{%- for message in messages %}
    {{- '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>\n' }}
{%- endfor %}
{%- if add_generation_prompt %}{{- '<|im_start|>assistant\n' }}{%- endif %}"""

# R1 style: the generation prompt opens the think block; earlier turns keep only their answer.
R1 = r"""{{- bos_token }}
{%- for message in messages %}
    {%- if message['role'] == 'system' %}{{- message['content'] }}
    {%- elif message['role'] == 'user' %}{{- '<|User|>' + message['content'] }}
    {%- else %}
        {%- set answer = message['content'] if loop.last else message['content'].split('</think>')[-1].lstrip() %}
        {{- '<|Assistant|>' + answer + eos_token }}
    {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}{{- '<|Assistant|><think>\n' }}{%- endif %}"""

FAMILIES = {  # name: (template, special tokens, bos, eos)
    "llama3": (
        LLAMA3,
        ["<|begin_of_text|>", "<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>"],
        "<|begin_of_text|>",
        "<|eot_id|>",
    ),
    "qwen3": (QWEN3, ["<|endoftext|>", "<|im_start|>", "<|im_end|>"], None, "<|im_end|>"),
    "mistral": (MISTRAL, ["<s>", "</s>", "[INST]", "[/INST]"], "<s>", "</s>"),
    "mistral_system_last": (MISTRAL_SYSTEM_LAST, ["<s>", "</s>", "[INST]", "[/INST]"], "<s>", "</s>"),
    "chatml": (CHATML, ["<|endoftext|>", "<|im_start|>", "<|im_end|>"], None, "<|im_end|>"),
    "r1": (R1, ["<s>", "</s>", "<|User|>", "<|Assistant|>"], "<s>", "</s>"),
}

SYSTEM = {"role": "system", "content": "You are a concise geography tutor."}
ASK_FRANCE = {"role": "user", "content": "What is the capital of France?"}
PARIS = "The capital of France is Paris."
ASK_ITALY = {"role": "user", "content": "And of Italy?"}
ROME = "Rome is the capital of Italy."
# assistant, tool result, assistant: an agentic turn in the middle
TOOL_TURNS = [
    {"role": "user", "content": "Is it sunny in Paris?"},
    {"role": "assistant", "content": "Let me check the forecast."},
    {"role": "tool", "content": "sunny, 24 C"},
    {"role": "assistant", "content": "Yes, sunny and 24 C."},
]


def think(reasoning: str, answer: str) -> str:
    return f"<think>\n{reasoning}\n</think>\n\n{answer}"


@pytest.fixture(scope="module")
def tokenizers():
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    out = {}
    for name, (template, specials, bos, eos) in FAMILIES.items():
        tok = Tokenizer(models.BPE())
        tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
        tok.decoder = decoders.ByteLevel()
        trainer = trainers.BpeTrainer(
            vocab_size=320,
            special_tokens=specials,
            show_progress=False,
            initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        )
        tok.train_from_iterator([PARIS, ROME, "What is the capital of France? And of Italy?"] * 10, trainer)
        tok.add_tokens([AddedToken("<think>", special=False), AddedToken("</think>", special=False)])
        fast = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token=bos, eos_token=eos)
        fast.chat_template = template
        out[name] = fast
    return out


def supervised(tok, messages, **template_kwargs):
    r = render(tok, messages, chat_template_kwargs=template_kwargs or None)
    assert r.input_ids.shape == r.loss_mask.shape
    return tok.decode(r.input_ids[r.loss_mask]), r.text


def test_llama3_headers(tokenizers):
    tok = tokenizers["llama3"]
    messages = [SYSTEM, ASK_FRANCE, {"role": "assistant", "content": f"  {PARIS}\n"}, *TOOL_TURNS]
    got, text = supervised(tok, messages)
    assert got == f"{PARIS}<|eot_id|>Let me check the forecast.<|eot_id|>Yes, sunny and 24 C.<|eot_id|>"
    assert text == (
        "<|begin_of_text|><|start_header_id|>system<|end_header_id|>\n\nCutting Knowledge Date: December "
        "2023\nToday Date: 26 Jul 2024\n\nYou are a concise geography tutor.<|eot_id|>"
        "<|start_header_id|>user<|end_header_id|>\n\nWhat is the capital of France?<|eot_id|>"
        f"<|start_header_id|>assistant<|end_header_id|>\n\n{PARIS}<|eot_id|>"
        "<|start_header_id|>user<|end_header_id|>\n\nIs it sunny in Paris?<|eot_id|>"
        "<|start_header_id|>assistant<|end_header_id|>\n\nLet me check the forecast.<|eot_id|>"
        "<|start_header_id|>ipython<|end_header_id|>\n\nsunny, 24 C<|eot_id|>"
        "<|start_header_id|>assistant<|end_header_id|>\n\nYes, sunny and 24 C.<|eot_id|>"
    )


QWEN3_BEFORE_LAST = (
    "<|im_start|>system\nYou are a concise geography tutor.<|im_end|>\n"
    "<|im_start|>user\nWhat is the capital of France?<|im_end|>\n"
    f"<|im_start|>assistant\n{PARIS}<|im_end|>\n"  # history: think block dropped
    "<|im_start|>user\nAnd of Italy?<|im_end|>\n<|im_start|>assistant\n"
)


@pytest.mark.parametrize("enable_thinking", [True, False])
@pytest.mark.parametrize("reasoning", ["present", "empty"])
def test_qwen3_thinking(tokenizers, enable_thinking, reasoning):
    """History think blocks vanish from the final text, the last turn keeps its (possibly empty) block:
    neither is ever supervised, whatever the generation prompt (enable_thinking) holds."""
    tok = tokenizers["qwen3"]
    if reasoning == "present":
        answers = [think("France: Paris.", PARIS), think("Italy: Rome.", ROME)]
        last_block = "<think>\nItaly: Rome.\n</think>\n\n"
    else:
        answers, last_block = [PARIS, ROME], "<think>\n\n</think>\n\n"
    messages = [
        SYSTEM,
        ASK_FRANCE,
        {"role": "assistant", "content": answers[0]},
        ASK_ITALY,
        {"role": "assistant", "content": answers[1]},
    ]
    got, text = supervised(tok, messages, enable_thinking=enable_thinking)
    assert got == f"{PARIS}<|im_end|>{ROME}<|im_end|>"
    assert text == QWEN3_BEFORE_LAST + last_block + f"{ROME}<|im_end|>\n"
    full, spans = supervised_spans(tok, messages, {"enable_thinking": enable_thinking})
    assert [full[a:b] for a, b in spans] == [f"{PARIS}<|im_end|>", f"{ROME}<|im_end|>"]


def test_qwen3_tool_turns_keep_reasoning_after_the_last_query(tokenizers):
    """After the last user query, an assistant turn with reasoning keeps its block in the final text
    (and a later user turn drops it again): the mask follows both."""
    tok = tokenizers["qwen3"]
    agentic = [
        {"role": "user", "content": "Is it sunny in Paris?"},
        {"role": "assistant", "content": think("I need the forecast.", "Let me check the forecast.")},
        {"role": "tool", "content": "sunny, 24 C"},
        {"role": "assistant", "content": think("It says sunny.", "Yes, sunny and 24 C.")},
    ]
    expected = "Let me check the forecast.<|im_end|>Yes, sunny and 24 C.<|im_end|>"
    got, text = supervised(tok, [SYSTEM, *agentic])
    assert got == expected and "<think>\nI need the forecast.\n</think>" in text
    got, text = supervised(tok, [SYSTEM, *agentic, ASK_ITALY, {"role": "assistant", "content": ROME}])
    assert got == expected + f"{ROME}<|im_end|>" and "I need the forecast" not in text
    assert "<tool_response>\nsunny, 24 C\n</tool_response>" in text


def test_mistral_inst(tokenizers):
    tok = tokenizers["mistral"]
    messages = [
        SYSTEM,
        ASK_FRANCE,
        {"role": "assistant", "content": PARIS},
        ASK_ITALY,
        {"role": "assistant", "content": ROME},
    ]
    got, text = supervised(tok, messages)
    assert got == f" {PARIS}</s> {ROME}</s>"  # the model writes the space after [/INST]
    assert text == (
        f"<s>[INST] You are a concise geography tutor.\n\nWhat is the capital of France?[/INST] {PARIS}</s>"
        f"[INST] And of Italy?[/INST] {ROME}</s>"
    )


def test_mistral_moving_system_prompt_is_refused(tokenizers):
    """Mistral v0.3 renders the system prompt with the last user turn only: the text of earlier turns
    changes as the conversation grows, and the mask refuses it rather than guess."""
    tok = tokenizers["mistral_system_last"]
    messages = [SYSTEM, ASK_FRANCE, {"role": "assistant", "content": PARIS}]
    with pytest.raises(ChatTemplateError, match="changes the text of earlier turns"):
        render(tok, messages)
    got, _ = supervised(tok, messages[1:])  # without a system prompt it is prefix-stable
    assert got == f" {PARIS}</s>"


def test_plain_chatml_with_default_system(tokenizers):
    tok = tokenizers["chatml"]
    got, text = supervised(tok, [ASK_FRANCE, {"role": "assistant", "content": PARIS}, *TOOL_TURNS])
    assert got == f"{PARIS}<|im_end|>Let me check the forecast.<|im_end|>Yes, sunny and 24 C.<|im_end|>"
    assert text.startswith("<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n")
    got, _ = supervised(tok, [SYSTEM, ASK_FRANCE, {"role": "assistant", "content": PARIS}])
    assert got == f"{PARIS}<|im_end|>"


def test_generation_prompt_that_opens_the_think_block(tokenizers):
    """R1 style: the prompt ends in "<think>\\n", so what the model writes starts inside the block."""
    tok = tokenizers["r1"]
    messages = [
        SYSTEM,
        ASK_FRANCE,
        {"role": "assistant", "content": think("France: Paris.", PARIS)},
        ASK_ITALY,
        {"role": "assistant", "content": think("Italy: Rome.", ROME)},
    ]
    got, text = supervised(tok, messages)
    assert got == f"{PARIS}</s>{ROME}</s>"
    assert text.endswith(f"<|Assistant|>{think('Italy: Rome.', ROME)}</s>") and "France: Paris." not in text


def test_unfinished_reasoning_is_never_supervised(tokenizers):
    tok = tokenizers["chatml"]
    got, _ = supervised(tok, [ASK_FRANCE, {"role": "assistant", "content": "<think>\nFrance is in Europe and"}])
    assert got == ""


# ------------------------------------------------------------------------------------ malformed records

GOOD = {"messages": [SYSTEM, ASK_FRANCE, {"role": "assistant", "content": PARIS}, *TOOL_TURNS]}


@pytest.mark.parametrize(
    "roles, problem",
    [
        (["user", "user", "assistant"], "turn 1: role 'user' cannot follow a 'user' turn"),
        (["assistant", "user"], "turn 0: role 'assistant' cannot come first"),
        (["user", "assistant", "assistant"], "turn 2: role 'assistant' cannot follow a 'assistant' turn"),
        (["user", "system", "assistant"], "turn 1: role 'system' cannot follow a 'user' turn"),
        (["user", "tool", "assistant"], "turn 1: role 'tool' cannot follow a 'user' turn"),
    ],
)
def test_non_alternating_turns_are_malformed(roles, problem):
    record = {"messages": [{"role": r, "content": f"text {i}"} for i, r in enumerate(roles)]}
    with pytest.raises(DatasetError, match=f"record 7, {problem}"):
        normalise(record, 7)
    assert normalise(GOOD, 0)["messages"] == GOOD["messages"]


@pytest.fixture()
def mixed_jsonl(tmp_path):
    lines = [
        json.dumps(GOOD),
        json.dumps({"messages": [ASK_FRANCE, ASK_ITALY, {"role": "assistant", "content": ROME}]}),
        json.dumps({"messages": [{"role": "assistant", "content": PARIS}, ASK_FRANCE]}),
        "{not json",
        json.dumps({"conversations": [{"from": "human", "value": "hi"}, {"from": "gpt", "value": "hello"}]}),
        json.dumps({"text": "no conversation here"}),
    ]
    path = tmp_path / "data.jsonl"
    path.write_text("\n".join(lines) + "\n")
    return path


def test_on_error_raise_names_the_record(mixed_jsonl):
    with pytest.raises(DatasetError, match="record 1, turn 1"):
        load_conversations(str(mixed_jsonl))
    with pytest.raises(ValueError, match="on_error must be one of"):
        load_conversations(str(mixed_jsonl), on_error="ignore")


def test_on_error_skip_counts_and_logs(mixed_jsonl, caplog):
    with caplog.at_level(logging.WARNING, logger="draftsmith.data_pipeline.dataset"):
        loaded = read_conversations(str(mixed_jsonl), on_error="skip")
    assert loaded.total == 6 and len(loaded.conversations) == 2
    assert [s.index for s in loaded.skipped] == [1, 2, 3, 5]
    assert "not valid JSON" in loaded.skipped[2].reason and "no 'messages'" in loaded.skipped[3].reason
    assert "skipped 4 of 6 malformed records" in caplog.text
    assert len(load_conversations(str(mixed_jsonl), on_error="skip")) == 2


def test_render_dataset_skips_what_the_template_refuses(tokenizers, caplog):
    tok = tokenizers["mistral"]
    good = {"messages": [ASK_FRANCE, {"role": "assistant", "content": PARIS}]}
    bad = {"messages": [ASK_FRANCE, ASK_ITALY, {"role": "assistant", "content": ROME}]}  # not normalised
    with pytest.raises(TemplateError, match="must alternate"):
        render_dataset(tok, [good, bad], 64)
    with caplog.at_level(logging.WARNING, logger="draftsmith.data_pipeline.dataset"):
        ds = render_dataset(tok, [good, bad], 64, on_error="skip")
    assert len(ds) == 1 and [s.index for s in ds.skipped] == [1] and "must alternate" in ds.skipped[0].reason
    assert "skipped 1 of 2" in caplog.text


@pytest.fixture()
def good_records():
    return [
        GOOD,
        {"conversations": [{"from": "human", "value": "hi"}, {"from": "gpt", "value": "hello"}]},
        {"messages": [ASK_FRANCE, {"role": "assistant", "content": PARIS}]},
    ]


def test_parquet_and_load_dataset_folders_normalise_alike(good_records, tmp_path, monkeypatch):
    """A .parquet file and a datasets.load_dataset folder (what a Hub name resolves to) give the .jsonl's
    conversations; offline, nothing is downloaded."""
    import datasets

    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    jsonl = tmp_path / "data.jsonl"
    jsonl.write_text("".join(json.dumps(r) + "\n" for r in good_records))
    expected = load_conversations(str(jsonl), seed=3)
    rows = [{"messages": normalise(r, i)["messages"]} for i, r in enumerate(good_records)]
    datasets.Dataset.from_list(rows).to_parquet(str(tmp_path / "data.parquet"))
    assert load_conversations(str(tmp_path / "data.parquet"), seed=3) == expected
    folder = tmp_path / "hub_like"
    folder.mkdir()
    datasets.Dataset.from_list(rows).to_json(str(folder / "train.jsonl"))
    assert load_conversations(str(folder), seed=3, split="train") == expected
    with pytest.raises(DatasetError, match="no split 'test_sft'"):
        load_conversations(str(folder), split="test_sft")
    with pytest.raises(FileNotFoundError, match="not found"):
        load_conversations(str(tmp_path / "missing.parquet"))


def test_prepare_skips_and_counts_malformed_records(mixed_jsonl, tmp_path):
    from draftsmith import reference
    from draftsmith.data_pipeline.config import DataConfig
    from draftsmith.data_pipeline.prepare import prepare

    target, tok = reference.target()
    cfg = DataConfig(
        source=str(mixed_jsonl),
        num_conversations=None,
        heldout_conversations=0,
        regenerate=False,
        max_length=64,
        draft_vocab_size=None,
    )
    with pytest.raises(DatasetError, match="record 1"):
        prepare(cfg, target, tok, "reference", tmp_path / "raise")
    cfg.on_error = "skip"
    data = prepare(cfg, target, tok, "reference", tmp_path / "skip")
    assert len(data.conversations) == 2
    assert data.manifest["records_read"] == 6 and data.manifest["skipped_records"] == 4
    assert "not valid JSON" in " ".join(data.manifest["skipped_examples"])
