"""Stop strings end generation at the same token in every method, in any script (issue 13, fault 1).

The canonical stop point: the fewest output tokens n whose decoded text (trailing '\\ufffd' of a character still
split across tokens stripped) contains a stop string; the tokens end at n, the text before the earliest stop string.
Checked on the reference tokenizer (byte-level BPE: 'é' is 2 bytes, '→' and '。' 3, '😀' 4) for:
  * ``TextStream`` fed the same tokens in every chunking (plain decoding: ones; speculative: 1..k+1), with the
    natural tokenization and with one token per byte;
  * the ``Engine`` on the reference target made to continue a prompt with a fixed script (``ScriptedTarget``):
    plain, n-gram, the reference draft model, an EAGLE-3 head and scripted chunkings all stop where the
    definition says;
  * the server: streamed text concatenates to the non-streamed text, for every stop string.
"""

from __future__ import annotations

import json
import random

import pytest
import torch
from transformers import LlamaForCausalLM

from draftsmith import reference
from draftsmith.core.generate import GenerationConfig
from draftsmith.core.proposer import PerSequence, Proposal, Proposer
from draftsmith.core.stops import StopStringFound as StopStringFound
from draftsmith.core.stops import TextStream
from draftsmith.serve.engine import Engine

SCRIPT = "s = 'café' → 日本。\nprint('😀 naïve')  # → 😀。\n"
PROMPT = "# copy the two lines below\n" + SCRIPT
STOPS = [
    ["😀"],
    ["。"],
    ["é"],
    ["→"],
    ["ï"],
    ["日本"],
    ["本"],
    ["é'"],
    ["'😀 na"],
    ["→ 😀"],
    ["print"],
    ["\n"],
    ["naïve", "。"],
    ["😀。", "# →"],
    ["never there"],
]
ENGINE_STOPS = [["😀"], ["。"], ["é"], ["→"], ["'😀 na"], ["naïve", "。"], ["never there"]]
SLOW_DRAFTER_STOPS = [["→"], ["'😀 na"]]  # draft model, EAGLE-3: a forward per drafted token, few accepted
CHUNKINGS = [(1,), (2,), (3, 1), (4,), (1, 5, 2), (6,), (2, 7, 1, 3)]
ENGINE_CHUNKINGS = [(3, 1), (1, 5, 2), (6,)]


@pytest.fixture(scope="module")
def tokenizer():
    return reference.target()[1]


@pytest.fixture(scope="module")
def script_ids(tokenizer) -> list[int]:
    ids = tokenizer(SCRIPT, add_special_tokens=False).input_ids
    assert tokenizer.decode(ids) == SCRIPT
    return ids


def byte_tokens(tokenizer, ids: list[int]) -> list[int]:
    """The same text with one token per byte (byte-level BPE: each character of a token's string is one byte)."""
    out = tokenizer.convert_tokens_to_ids([ch for tok in tokenizer.convert_ids_to_tokens(ids) for ch in tok])
    assert tokenizer.decode(out) == tokenizer.decode(ids) and len(out) > len(ids)
    return out


def expected_stop(tokenizer, tokens: list[int], stops: list[str]) -> tuple[list[int], str, bool]:
    """(tokens, text, stopped) by the definition, with one full decode per prefix."""
    for n in range(1, len(tokens) + 1):
        text = tokenizer.decode(tokens[:n], skip_special_tokens=True).rstrip("\ufffd")
        hits = [text.find(s) for s in stops if s in text]
        if hits:
            return tokens[:n], text[: min(hits)], True
    return tokens, tokenizer.decode(tokens, skip_special_tokens=True), False


def chunks(tokens: list[int], sizes) -> list[list[int]]:
    out, i, step = [], 0, 0
    while i < len(tokens):
        n = sizes[step % len(sizes)]
        out.append(tokens[i : i + n])
        i, step = i + n, step + 1
    return out


def stream_through(tokenizer, parts: list[list[int]], stops: list[str]) -> tuple[TextStream, bool, list[str]]:
    """The stream after reading ``parts`` (then ``finish``), whether a stop string ended it, the deltas sent."""
    sent: list[str] = []
    stream = TextStream(tokenizer, stops, on_text=sent.append)
    try:
        for part in parts:
            stream.add(part)
    except StopStringFound:
        return stream, True, sent
    stream.finish()
    return stream, False, sent


def test_stops_in_every_script_are_found_at_the_same_token_whatever_the_chunking(tokenizer, script_ids):
    rng = random.Random(0)
    for ids in (script_ids, byte_tokens(tokenizer, script_ids)):
        chunkings = [*CHUNKINGS, (len(ids),)] + [tuple(rng.randint(1, 9) for _ in range(8)) for _ in range(5)]
        for stops in STOPS:
            want_tokens, want_text, stopped = expected_stop(tokenizer, ids, stops)
            assert stopped == (stops != ["never there"]), stops
            for sizes in chunkings:
                stream, raised, sent = stream_through(tokenizer, chunks(ids, sizes), stops)
                where = f"stop {stops} chunks {sizes}"
                assert (stream.tokens, stream.text, raised) == (want_tokens, want_text, stopped), where
                assert "".join(sent) == want_text, where  # streamed = final text, nothing past the stop


def test_streamed_deltas_are_final_and_hold_back_stop_prefixes(tokenizer, script_ids):
    """Each delta is sent once and never changes: after every token the text sent so far is a prefix of the end
    text, never ends inside a character, and never ends with a proper prefix of a stop string."""
    final = tokenizer.decode(script_ids)
    for stops in (["never there"], ["😀 n", "。\n"]):
        sent: list[str] = []
        stream = TextStream(tokenizer, stops, on_text=sent.append)
        try:
            for token in byte_tokens(tokenizer, script_ids):
                stream.add([token])
                shown = "".join(sent)
                assert final.startswith(shown) and "\ufffd" not in shown
                assert not any(shown.endswith(s[:n]) for s in stops for n in range(1, len(s))), shown
        except StopStringFound:
            pass
        stream.finish()
        assert "".join(sent) == expected_stop(tokenizer, script_ids, stops)[1]


def sentencepiece_style_tokenizer():
    """A Llama-2-style tokenizer built in memory: '▁' for spaces, byte fallback (<0xNN>) for characters outside
    the vocabulary, and a decoder that strips the leading space of whatever it decodes (so decode(a + b) is not
    decode(a) + decode(b))."""
    from tokenizers import Tokenizer, decoders, models, normalizers
    from transformers import PreTrainedTokenizerFast

    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2} | {f"<0x{i:02X}>": 3 + i for i in range(256)}
    pieces = ["▁", "▁h", "▁he", "▁hel", "▁hell", "▁hello", "▁w", "▁wo", "▁wor", *"abcdefghijklmnopqrstuvwxyz"]
    vocab |= {p: len(vocab) + i for i, p in enumerate(pieces)}
    merges = [
        ("▁", "h"),
        ("▁h", "e"),
        ("▁he", "l"),
        ("▁hel", "l"),
        ("▁hell", "o"),
        ("▁", "w"),
        ("▁w", "o"),
        ("▁wo", "r"),
    ]
    backend = Tokenizer(models.BPE(vocab, merges, byte_fallback=True, unk_token="<unk>"))
    backend.normalizer = normalizers.Sequence([normalizers.Prepend("▁"), normalizers.Replace(" ", "▁")])
    backend.decoder = decoders.Sequence(
        [decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse(), decoders.Strip(" ", 1, 0)]
    )
    return PreTrainedTokenizerFast(tokenizer_object=backend, bos_token="<s>", eos_token="</s>", unk_token="<unk>")


def test_a_tokenizer_that_strips_the_leading_space_stops_at_the_same_token():
    tokenizer = sentencepiece_style_tokenizer()
    ids = tokenizer("hello world 😀 café → 日本。 done", add_special_tokens=False).input_ids
    assert tokenizer.decode(ids[:1]) + tokenizer.decode(ids[1:2]) == "hellowor" != tokenizer.decode(ids[:2])
    for stops in (["never there"], ["→"], ["😀"], ["é"], ["。"], ["world 😀"], [" d"], ["hello"]):
        want_tokens, want_text, stopped = expected_stop(tokenizer, ids, stops)
        for sizes in CHUNKINGS:
            stream, raised, sent = stream_through(tokenizer, chunks(ids, sizes), stops)
            where = f"stop {stops} chunks {sizes}"
            assert (stream.tokens, stream.text, raised, "".join(sent)) == (
                want_tokens,
                want_text,
                stopped,
                want_text,
            ), where


def test_text_is_the_whole_decode_with_special_tokens_between_words(word_tokenizer):
    """A skipped special token between two words keeps the space the whole decode puts there (a decode window
    starting at the special token would lose it)."""
    tokenizer = word_tokenizer(96)
    ids = [5, 2, 6, 7, 2, 2, 8]  # w2 is <unk>, special
    for sizes in CHUNKINGS:
        stream, raised, sent = stream_through(tokenizer, chunks(ids, sizes), ["w8"])
        assert stream.text == "".join(sent) == "w5 w6 w7 " and raised
        stream, _, sent = stream_through(tokenizer, chunks(ids, sizes), [])
        assert stream.text == "".join(sent) == tokenizer.decode(ids, skip_special_tokens=True) == "w5 w6 w7 w8"


class ScriptedTarget(LlamaForCausalLM):
    """The reference target made to continue a prompt of ``prompt_len`` tokens with ``script``: the row at
    position prompt_len - 1 + i gets the logit of script[i] raised above the row's maximum. Everything else
    (KV cache, hidden states read by EAGLE-3, verification) is the real model's."""

    prompt_len: int = 0
    script: tuple[int, ...] = ()

    def forward(self, *args, position_ids=None, logits_to_keep=0, **kwargs):
        out = super().forward(*args, position_ids=position_ids, logits_to_keep=logits_to_keep, **kwargs)
        columns = list(range(position_ids.shape[1]))  # the input columns whose logits were computed
        if isinstance(logits_to_keep, torch.Tensor):
            columns = logits_to_keep.tolist()
        elif logits_to_keep:
            columns = columns[-logits_to_keep:]
        for b in range(position_ids.shape[0]):
            for row, column in enumerate(columns):
                i = int(position_ids[b, column]) + 1 - self.prompt_len
                if 0 <= i < len(self.script):
                    out.logits[b, row, self.script[i]] = out.logits[b, row].max() + 10.0
        return out


class ScriptedChunks(Proposer):
    """Drafts the script's next ``sizes[step % len(sizes)]`` tokens (all accepted: chunks of that + 1)."""

    def __init__(self, script: list[int], sizes):
        self.script, self.sizes, self.done, self.step = script, sizes, 0, 0

    def start(self, prompt_ids, first_token, target_step) -> None:
        self.done = 1

    def propose(self, k: int) -> Proposal:
        n = min(k, self.sizes[self.step % len(self.sizes)])
        self.step += 1
        return Proposal(torch.tensor(self.script[self.done : self.done + n], dtype=torch.long))

    def accept(self, n_accepted, emitted, target_step) -> None:
        self.done += emitted.numel()


class ScriptedEngine(Engine):
    """An engine whose proposer is ``ScriptedChunks`` (set ``sizes``)."""

    sizes: tuple[int, ...] = (1,)

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.scheduler.decoder.proposer = PerSequence(
            lambda _: ScriptedChunks(list(self.target.model.script), self.sizes)
        )


@pytest.fixture(scope="module")
def scripted(tokenizer, script_ids, tmp_path_factory):
    """(target, prompt ids, engines by name): plain, ngram, draft_model, eagle3, scripted chunkings."""
    from draftsmith.drafters.eagle3.export import export_eagle3
    from draftsmith.drafters.eagle3.head import Eagle3Config, Eagle3Head
    from draftsmith.identity import target_identity

    target = ScriptedTarget.from_pretrained(reference.TARGET_DIR, dtype=torch.float32).eval()
    prompt = tokenizer(PROMPT).input_ids
    target.prompt_len, target.script = len(prompt), tuple(script_ids)
    torch.manual_seed(0)
    head = Eagle3Head(Eagle3Config.from_target(target.config, ttt_steps=4))
    head_dir = export_eagle3(
        head, tmp_path_factory.mktemp("stop") / "head", target_identity(target, tokenizer, "reference"), target.config
    )
    engines = {
        "plain": Engine(target, tokenizer),
        "ngram": Engine(target, tokenizer, {"method": "ngram", "num_speculative_tokens": 5}),
        "draft_model": Engine(
            target, tokenizer, {"method": "draft_model", "model": "reference-draft", "num_speculative_tokens": 3}
        ),
        "eagle3": Engine(target, tokenizer, {"method": "eagle3", "model": str(head_dir), "num_speculative_tokens": 3}),
    }
    for sizes in ENGINE_CHUNKINGS:
        engine = ScriptedEngine(target, tokenizer, {"method": "ngram", "num_speculative_tokens": 8})
        engine.sizes = sizes
        engines[f"chunks{sizes}"] = engine
    return target, prompt, engines


def test_every_method_stops_at_the_canonical_token(tokenizer, script_ids, scripted):
    target, prompt, engines = scripted
    cfg = GenerationConfig(max_new_tokens=len(script_ids))
    assert engines["plain"].generate(prompt, cfg).tokens == script_ids  # the script is what it decodes
    accepted = {}
    for stops in ENGINE_STOPS:
        want_tokens, want_text, stopped = expected_stop(tokenizer, script_ids, stops)
        for name, engine in engines.items():
            if name in ("draft_model", "eagle3") and stops not in SLOW_DRAFTER_STOPS:
                continue
            result = engine.generate(prompt, cfg, stop=stops)
            where = f"{name}, stop {stops}"
            assert result.tokens == want_tokens and result.text == want_text, where
            assert result.finish_reason == ("stop" if stopped else "length"), where
            if result.stats is not None:
                accepted[name] = accepted.get(name, 0) + result.stats.num_accepted_tokens
    assert accepted["ngram"] > 0 and accepted["chunks(6,)"] > 0  # chunks of several tokens were checked


def test_server_streams_the_text_it_returns_for_every_stop(tokenizer, script_ids, scripted):
    from fastapi.testclient import TestClient

    from draftsmith.serve.server import create_app

    target, prompt, engines = scripted
    body = {"prompt": prompt, "max_tokens": len(script_ids), "temperature": 0}
    for name in ("ngram", "chunks(1, 5, 2)"):
        with TestClient(create_app(engines[name])) as client:
            for stops in ENGINE_STOPS:
                _, want_text, _ = expected_stop(tokenizer, script_ids, stops)
                whole = client.post("/v1/completions", json=body | {"stop": stops}).json()["choices"][0]["text"]
                texts = []
                with client.stream("POST", "/v1/completions", json=body | {"stop": stops, "stream": True}) as r:
                    for line in r.iter_lines():
                        if line.startswith("data: {"):
                            texts.append(json.loads(line[6:])["choices"][0]["text"])
                assert whole == want_text and "".join(texts) == want_text, f"{name}, stop {stops}"
