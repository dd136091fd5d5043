"""Where generation stops: stop token ids and stop strings, the same for serving, eval and the referee.

    ids = stop_token_ids(model, tokenizer)          # EOS of the tokenizer and of the generation config
    text = TextStream(tokenizer, stop=["\\n\\n"], on_text=send)
    text.add(chunk)                                 # raises StopStringFound at the token completing a stop

Stop strings are found on decoded text that can no longer change: a byte-level tokenizer splits a character's
bytes across tokens, so the text of a trailing incomplete character is held back. The stop point is the fewest
tokens whose final text contains the stop string, whatever the chunking (one token per step for plain decoding,
accepted chunks for speculative decoding): every method stops at the same token.
"""

from __future__ import annotations

from typing import Callable, Sequence


class StopStringFound(Exception):
    """Raised from the token callback to end generation at a stop string."""


class TextStream:
    """Decoded text of a growing token list, with stop strings and streamed deltas.

    Tokens are read one at a time however they arrive (plain decoding: one per step; speculative: an accepted
    chunk of 1..k+1), so the outcome depends on the tokens only, never on the chunking. After each token the
    decoded text is split in:

        final text   what later tokens cannot change: everything before a trailing incomplete character
        open tail    the trailing '\\ufffd' a byte-level decode ends in while a character's bytes are split
                     across tokens ('é' = 2 bytes, '→' and '。' 3, '😀' 4); it turns final when the character
                     completes (or at ``finish``)

    ``text`` is the final text and only grows (until cut at a stop string): the tokens are decoded whole (a window
    of the last tokens would drop the space before a word that follows a skipped special token), special tokens
    skipped, without ``clean_up_tokenization_spaces`` (it rewrites text already final, "a ." -> "a."; transformers
    5 ignores it for BPE, vLLM's detokenizer never applies it), and what extends the final text is appended. A
    decode that does not extend it (a tokenizer whose decode is not prefix-stable) adds nothing until one does.

    Stop point (canonical): the fewest tokens n whose decoded text, trailing '\\ufffd' stripped, contains a stop
    string. ``add`` then cuts ``tokens`` after token n and ``text`` before the earliest stop string found, sends
    the rest and raises ``StopStringFound``. Deltas sent to ``on_text`` are final text only, holding back any
    tail that may start a stop string, so nothing sent is ever changed or lies past a stop; ``finish()`` sends
    what is left (the open tail becomes final, and is searched for stop strings too).

    vLLM's options (``vllm/v1/engine/detokenizer.py``): ``include_stop_str_in_output`` cuts the text AFTER the stop
    string instead of before it (nothing is held back then: a stop string found ends after everything already
    sent); ``min_tokens``: a stop string counts only once more than ``min_tokens`` tokens were read and only if it
    ends after the text of the first ``min_tokens`` tokens. ``add_hidden`` reads a token whose text is not shown
    (the stop token that ended generation, which vLLM leaves out of the text unless
    ``include_stop_str_in_output``).

    Attributes:
        tokens: the tokens read (cut after the stop point). text: the final text (cut before a stop string, or
            after it with ``include_stop``). stopped: True once a stop string was found. stop_reason: that
            string (None before).
    """

    def __init__(
        self,
        tokenizer,
        stop: Sequence[str] = (),
        on_text: Callable[[str], None] | None = None,
        *,
        include_stop: bool = False,
        min_tokens: int = 0,
    ):
        self.tokenizer, self.on_text = tokenizer, on_text
        self.stop = tuple(s for s in stop if s)
        self.longest_stop = max((len(s) for s in self.stop), default=0)
        self.include_stop, self.min_tokens = include_stop, min_tokens
        self.min_offset = 0  # a stop string must end past this many characters (the first min_tokens' text)
        self.tokens: list[int] = []
        self.hidden = 0  # trailing tokens read but not decoded (add_hidden)
        self.text = ""
        self.stopped = False
        self.stop_reason: str | None = None
        self.sent = 0

    def _decode(self) -> str:
        shown = self.tokens[: len(self.tokens) - self.hidden]
        return self.tokenizer.decode(shown, skip_special_tokens=True, clean_up_tokenization_spaces=False)

    def _find_stop(self, text: str, start: int) -> tuple[int, str] | None:
        """The earliest stop string starting at or after ``start`` and ending past ``min_offset``: (index, it)."""
        hits = []
        for s in self.stop:
            i = text.find(s, max(start, self.min_offset - len(s) + 1))
            if i >= 0:
                hits.append((i, s))
        return min(hits, key=lambda hit: hit[0]) if hits else None

    def add(self, chunk: Sequence[int]) -> None:
        """Read ``chunk`` token by token; raises ``StopStringFound`` at the token that completes a stop string."""
        for token in chunk:
            self.tokens.append(int(token))
            if self._extend(self._decode().rstrip("\ufffd")):
                self.finish()
                raise StopStringFound
        self._send(self._safe_end())

    def add_hidden(self, token: int) -> None:
        """Read ``token`` without showing its text (the stop token that ended generation); send what is held."""
        self.tokens.append(int(token))
        self.hidden += 1

    def _extend(self, decoded: str) -> bool:
        """Append what ``decoded`` adds to the final text; cut it at a stop string that now appears (True)."""
        searching = len(self.tokens) > self.min_tokens
        if len(decoded) <= len(self.text) or not decoded.startswith(self.text):
            if len(self.tokens) == self.min_tokens:
                self.min_offset = len(self.text)
            return False
        start = max(0, len(self.text) - self.longest_stop + 1)  # a new hit ends in the appended part
        self.text = decoded
        if len(self.tokens) == self.min_tokens:
            self.min_offset = len(self.text)
        hit = self._find_stop(self.text, start) if self.stop and searching else None
        if hit is not None:
            index, self.stop_reason = hit
            end = index + len(self.stop_reason) if self.include_stop else index
            self.text, self.stopped = self.text[:end], True
        return hit is not None

    def _safe_end(self) -> int:
        """How much of ``text`` can be sent now: all but a tail that may start a stop string."""
        end = len(self.text)
        if self.include_stop:
            return end
        for n in range(min(self.longest_stop - 1, end), 0, -1):
            tail = self.text[end - n :]
            if any(s.startswith(tail) for s in self.stop):
                return end - n
        return end

    def _send(self, end: int) -> None:
        if end > self.sent:
            delta, self.sent = self.text[self.sent : end], end
            if self.on_text is not None:
                self.on_text(delta)

    def finish(self) -> None:
        """End of generation: the open tail is final now (searched for stop strings); send what is held back."""
        if not self.stopped:
            self._extend(self._decode())
        self._send(len(self.text))


def stop_token_ids(model, tokenizer) -> tuple[int, ...]:
    """EOS ids of the tokenizer and of the model's generation config (an int or a list): the ids that end
    generation everywhere (serving, eval, in-loop τ, the referee), as vLLM takes them."""
    ids = [getattr(tokenizer, "eos_token_id", None)]
    generation_config = getattr(model, "generation_config", None)
    eos = getattr(generation_config, "eos_token_id", None)
    ids += list(eos) if isinstance(eos, (list, tuple)) else [eos]
    return tuple(sorted({int(i) for i in ids if i is not None}))
