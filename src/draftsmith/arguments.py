"""Argument types, the parser class and the error boundary of draftsmith's command lines (no torch).

    p = ArgumentParser(prog="draftsmith serve")
    p.add_argument("--port", type=port, default=8000)
    p.add_argument("--speculative-config", type=json_object)

A ``type=`` function here turns a bad value into one line, ``draftsmith serve: error: argument --port: 99999
is not a TCP port; pass 1-65535``, at parse time, before any verb imports torch. Checks that look at the file
system (a target folder, a head directory) run after parsing (``cli.check_args`` with ``draftsmith.sources``).
``run_guarded`` is the boundary: whatever the command raises ends as one line on stderr and an exit status
(``draftsmith VERB: error: <problem>; <fix>``); ``cli.main`` and the scripts under ``bench/`` and
``reference/`` run through it.
"""

from __future__ import annotations

import argparse
import errno
import json
import os
import sys
import traceback
from typing import Callable

TRACEBACK_ENV = "DRAFTSMITH_TRACEBACK"  #: set to 1 to print the traceback of an error (as -v does)
#: dtype names ``models.load_causal_lm`` takes (its ``DTYPES`` and ``auto``; kept equal by a test).
DTYPE_NAMES = ("float32", "bfloat16", "float16", "auto")


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


def k_value(text: str) -> "int | str":
    """An argparse type: num_speculative_tokens, an integer >= 1 or ``auto`` (adaptive speculation)."""
    if text.strip().lower() == "auto":
        return "auto"
    try:
        int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a k: pass an integer >= 1 or 'auto'") from None
    return positive_int(text)


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
        raise argparse.ArgumentTypeError(
            f"{text!r} is not a dtype draftsmith loads; pass one of {', '.join(DTYPE_NAMES)}"
        )
    return text


def json_object(text: str) -> dict:
    """An argparse type: a JSON object (``--speculative-config``), parsed. Its keys are checked later by
    ``drafters.speculative.SpeculativeConfig``."""
    try:
        value = json.loads(text)
    except json.JSONDecodeError as e:
        raise argparse.ArgumentTypeError(
            f"{text!r} is not JSON ({e.msg} at character {e.pos}); write an object in "
            f'single quotes, e.g. \'{{"method": "ngram", "num_speculative_tokens": '
            f"4}}'"
        ) from None
    if not isinstance(value, dict):
        raise argparse.ArgumentTypeError(
            f'{text!r} is JSON but not an object; write {{"method": ..., "num_speculative_tokens": ...}}'
        )
    return value


def drafter(text: str) -> tuple[str, dict]:
    """An argparse type for ``draftsmith eval --drafter LABEL=JSON``: (label, speculative config mapping)."""
    label, sep, raw = text.partition("=")
    example = 'LABEL=\'{"method": "draft_model", "model": DIR}\''
    if not sep or not label.strip():
        raise argparse.ArgumentTypeError(f"{text!r} must look like {example}")
    try:
        spec = json.loads(raw)
    except json.JSONDecodeError as e:
        raise argparse.ArgumentTypeError(
            f"{text!r}: the part after '=' is not JSON ({e.msg} at character {e.pos}); write it like {example}"
        ) from None
    if not isinstance(spec, dict):
        raise argparse.ArgumentTypeError(f"{text!r}: the part after '=' must be a JSON object, like {example}")
    return label.strip(), spec


def non_empty(text: str) -> str:
    """An argparse type: a string that is not empty (``--api-key``)."""
    if not text.strip():
        raise argparse.ArgumentTypeError("is empty; pass a value, or leave the flag out")
    return text


class HelpWithDefaults(argparse.HelpFormatter):
    """Help that ends every flag's text with its default, ``(default: 8000)``, unless the text already says what the
    default is (a None or empty default means something only words can tell: ``default: the target's limit``)."""

    def _get_help_string(self, action):
        text = action.help or ""
        if "default" in text or action.default is argparse.SUPPRESS or not action.option_strings:
            return text
        return f"{text} (default: %(default)s)"


def url(text: str) -> str:
    """An argparse type: an http(s) URL of a running server."""
    if not text.startswith(("http://", "https://")) or len(text.split("://", 1)[1].strip("/")) == 0:
        raise argparse.ArgumentTypeError(f"{text!r} is not a server URL; pass one like http://127.0.0.1:8000")
    return text


# --- the error boundary of every command line -------------------------------------------------------------------------

#: Operating-system errors that reach the CLI without a message of ours: (problem, fix) by kind.
OS_ERRORS = (
    (FileNotFoundError, "no such file or directory", "check the path"),
    (PermissionError, "permission denied", "fix its permissions, or choose a path you can read and write"),
    (IsADirectoryError, "is a directory where a file is expected", "pass the file"),
    (NotADirectoryError, "is a file where a directory is expected", "pass a directory"),
    (FileExistsError, "already exists", "remove it, or choose another path"),
)
EXPECTED = (ValueError, OSError, KeyError)  # errors raised with a message for the user (by kind)


def one_line(message: str) -> str:
    """``message`` on one line: its stripped lines joined by '; ' (by ' ' after a line ending in ':')."""
    out = ""
    for line in (x.strip().removeprefix("- ") for x in str(message).splitlines()):
        if line:
            out += ("" if not out else " " if out.endswith(":") else "; ") + line
    return out


def describe_error(error: BaseException) -> str:
    """One line for an error that reached the CLI.

    draftsmith's errors (ConfigError, HeadMismatchError, ModelSourceError, ...) and the library errors it lets
    through carry their message (made where they were raised). An OSError raised by the operating system on a
    path (``errno`` and ``filename`` set, no message of ours) is named by its kind (``OS_ERRORS``). Anything
    else (a RuntimeError from torch, a bug) is named by its type, with how to see its traceback."""
    if isinstance(error, OSError) and error.errno is not None and error.filename is not None:
        where = f"{error.filename}" + (f" -> {error.filename2}" if error.filename2 else "")
        if error.errno == errno.ENOSPC:
            return f"no space left on the device of {where}; free some space, or write somewhere else"
        for kind, problem, fix in OS_ERRORS:
            if isinstance(error, kind):
                return f"{where}: {problem}; {fix}"
        return f"{where}: {error.strerror}; check the path"
    message = one_line(error.args[0] if isinstance(error, KeyError) and error.args else error)
    try:
        from safetensors import SafetensorError
    except ImportError:  # pragma: no cover - safetensors is a dependency
        SafetensorError = ()
    if isinstance(error, SafetensorError):
        return f"a weights file is not valid safetensors ({message}); re-download it, or re-export it"
    if isinstance(error, EXPECTED):
        return message or type(error).__name__
    return f"{type(error).__name__}: {message} (rerun with -v or {TRACEBACK_ENV}=1 for the traceback)"


def run_guarded(
    prog: str, fn: Callable[[], int | None], verbose: bool = False, interrupted: str = "rerun the command"
) -> int:
    """Run ``fn()`` and return its status (None: 0). An exception ends as one line on stderr, ``PROG: error:
    <describe_error>``, status 1; Ctrl+C as ``PROG: interrupted (Ctrl+C); <interrupted>``, status 130. With
    ``verbose`` or ``DRAFTSMITH_TRACEBACK=1`` the traceback is printed first."""
    verbose = bool(verbose) or os.environ.get(TRACEBACK_ENV, "") not in ("", "0")
    try:
        status = fn()
        return 0 if status is None else int(status)
    except KeyboardInterrupt:
        if verbose:
            traceback.print_exc()
        print(f"{prog}: interrupted (Ctrl+C); {interrupted}", file=sys.stderr)
        return 130
    except Exception as e:  # the one boundary: never a bare traceback
        if verbose:
            traceback.print_exc()
        print(f"{prog}: error: {describe_error(e)}", file=sys.stderr)
        return 1
