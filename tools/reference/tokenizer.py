"""Byte-level BPE tokenizer of the reference target, with a ChatML chat template.

Trained with the ``tokenizers`` library on the train split of the corpus (code and chat examples)
and saved as a transformers fast tokenizer, loadable offline with ``AutoTokenizer.from_pretrained``.

Run: ``python tools/reference/tokenizer.py --corpus .cache/reference/corpus --out DIR``.
"""

from __future__ import annotations

import json
from pathlib import Path

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import PreTrainedTokenizerFast

from draftsmith.arguments import ArgumentParser, run_guarded
from draftsmith.reference import CHAT_TEMPLATE, SPECIAL_TOKENS


def _texts(corpus: Path):
    for line in (corpus / "train_code.jsonl").open():
        yield json.loads(line)["text"]
    for line in (corpus / "train_chat.jsonl").open():
        for m in json.loads(line)["messages"]:
            yield m["content"]


def train_tokenizer(corpus: Path, out: Path, vocab_size: int = 8192) -> PreTrainedTokenizerFast:
    """Train byte-level BPE on ``corpus`` and save a transformers tokenizer to ``out``."""
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=SPECIAL_TOKENS,
        min_frequency=2,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(_texts(corpus), trainer=trainer)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        eos_token="<|im_end|>",
        pad_token="<|endoftext|>",
        unk_token=None,
        bos_token=None,
        model_max_length=2048,
    )
    fast.chat_template = CHAT_TEMPLATE
    out.mkdir(parents=True, exist_ok=True)
    fast.save_pretrained(out)
    return fast


def main(argv=None) -> None:
    p = ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--corpus", type=Path, required=True)
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--vocab-size", type=int, default=8192)
    a = p.parse_args(argv)
    fast = train_tokenizer(a.corpus, a.out, a.vocab_size)
    print(f"vocab {len(fast)} saved to {a.out}")


if __name__ == "__main__":
    raise SystemExit(run_guarded("python tools/reference/tokenizer.py", main))  # one line per error
