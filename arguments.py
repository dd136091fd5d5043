"""Argument types and the parser class of ``draftsmith`` and ``draftsmith bench``: value checks that need no torch.

    p = ArgumentParser(prog="draftsmith serve")
    p.add_argument("--port", type=port, default=8000)
    p.add_argument("--speculative-config", type=json_object)

A ``type=`` function here turns a bad value into one line, ``draftsmith serve: error: argument --port: 99999
is not a TCP port; pass 1-65535``, at parse time, before any verb imports torch. Checks that look at the file
system (a target folder, a head directory) run after parsing (``cli.check_args`` with ``draftsmith.sources``).
"""
from __future__ import annotations

import argparse
import json
from typing import Callable

#: dtype names ``models.load_causal_lm`` takes (its ``DTYPES``; kept equal by a test).
DTYPE_NAMES = ("float32", "bfloat16", "float16")
#: ``inference.engine.SPECULATIVE_METHODS`` (kept equal by a test): the methods ``draftsmith eval`` can run.
SPECULATIVE_METHODS = ("draft_model", "eagle3", "mlp_speculator", "ngram")


class ArgumentParser(argparse.ArgumentParser):
    """argparse with a one-line error: ``PROG: error: MESSAGE; see `PROG --help``` (exit status 2), no usage
    block. Sub-parsers made by ``add_subparsers`` are of this class too."""

    def error(self, message: str):
        self.exit(2, f"{self.prog}: error: {message}; see `{self.prog} --help`\n")


def int_at_least(low: int) -> Callable[[str], int]:
    """An argparse type: an integer >= ``low``."""
    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not an integer; pass a whole number >= {low}") from None
        if value < low:
            raise argparse.ArgumentTypeError(f"{value} is below {low}; pass a whole number >= {low}")
        return value
    return parse


positive_int = int_at_least(1)


def non_negative_float(text: str) -> float:
    """An argparse type: a finite float >= 0 (temperatures)."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number; pass a number >= 0") from None
    if not 0 <= value < float("inf"):
        raise argparse.ArgumentTypeError(f"{text} is out of range; pass a finite number >= 0")
    return value


def port(text: str) -> int:
    """An argparse type: a TCP port, 1-65535."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a TCP port; pass a number in 1-65535 (e.g. 8000)") from None
    if not 1 <= value <= 65535:
        raise argparse.ArgumentTypeError(f"{value} is not a TCP port; pass a number in 1-65535 (e.g. 8000)")
    return value


def dtype(text: str) -> str:
    """An argparse type: a dtype name of ``DTYPE_NAMES``."""
    if text not in DTYPE_NAMES:
        raise argparse.ArgumentTypeError(f"{text!r} is not a dtype draftsmith loads; pass one of "
                                         f"{', '.join(DTYPE_NAMES)}")
    return text


def json_object(text: str) -> dict:
    """An argparse type: a JSON object (``--speculative-config``), parsed. Its keys are checked later by
    ``inference.engine.SpeculativeConfig``."""
    try:
        value = json.loads(text)
    except json.JSONDecodeError as e:
        raise argparse.ArgumentTypeError(f"{text!r} is not JSON ({e.msg} at character {e.pos}); write an object in "
                                         f"single quotes, e.g. '{{\"method\": \"ngram\", \"num_speculative_tokens\": "
                                         f"4}}'") from None
    if not isinstance(value, dict):
        raise argparse.ArgumentTypeError(f"{text!r} is JSON but not an object; write {{\"method\": ..., "
                                         f"\"num_speculative_tokens\": ...}}")
    return value


def drafter(text: str) -> tuple[str, dict]:
    """An argparse type for ``draftsmith eval --drafter LABEL=JSON``: (label, speculative config mapping)."""
    label, sep, raw = text.partition("=")
    example = "LABEL='{\"method\": \"draft_model\", \"model\": DIR}'"
    if not sep or not label.strip():
        raise argparse.ArgumentTypeError(f"{text!r} must look like {example}")
    try:
        spec = json.loads(raw)
    except json.JSONDecodeError as e:
        raise argparse.ArgumentTypeError(f"{text!r}: the part after '=' is not JSON ({e.msg} at character "
                                         f"{e.pos}); write it like {example}") from None
    if not isinstance(spec, dict):
        raise argparse.ArgumentTypeError(f"{text!r}: the part after '=' must be a JSON object, like {example}")
    return label.strip(), spec


def url(text: str) -> str:
    """An argparse type: an http(s) URL of a running server."""
    if not text.startswith(("http://", "https://")) or len(text.split("://", 1)[1].strip("/")) == 0:
        raise argparse.ArgumentTypeError(f"{text!r} is not a server URL; pass one like http://127.0.0.1:8000")
    return text
