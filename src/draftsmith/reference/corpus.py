"""Source corpus of the reference target: CPython stdlib modules split by module, plus task examples.

The reference target (DESIGN.md §8) is pretrained on real code present on every machine: the
standard-library sources of the running interpreter. Modules are split deterministically by the
sha256 of their dotted name (about 10% held out). From the functions of a module we derive chat
examples of the three task families the model must answer in its chat format:

  code-complete  "Complete this function" -> the remaining lines of the function
  code-edit      "Rename `a` to `b`" / "Add a parameter" -> the whole edited function
  docstring      "Write the docstring" -> the docstring prose

Train-split examples go into pretraining and head training; held-out examples (and the same
`code-complete` family on third-party package sources, `code-foreign`) become the held-out tasks.

The corpus files the target was pretrained on are written by ``tools/reference/corpus.py`` (see
REPRODUCE.md); draftsmith itself reads these functions for the ``reference:train`` data source.
"""

from __future__ import annotations

import ast
import hashlib
import importlib.metadata
import io
import random
import sysconfig
import textwrap
import tokenize
from dataclasses import dataclass
from pathlib import Path

#: Folders of the stdlib that are tests, tools or vendored code rather than library source.
EXCLUDED_PARTS = {
    "test",
    "tests",
    "idlelib",
    "site-packages",
    "lib2to3",
    "__pycache__",
    "turtledemo",
    "config-3.11-x86_64-linux-gnu",
    "ensurepip",
    "tkinter",
}
#: Share of modules held out (by sha256 of the module name), never seen in pretraining.
HELDOUT_PERCENT = 10
#: Third-party distributions whose sources form the `code-foreign` task.
FOREIGN_DISTRIBUTIONS = ("accelerate", "tqdm", "starlette", "fastapi")
RENAME_SUFFIXES = ("_value", "_obj", "_item", "_ref", "_data")
#: Seed offset of the head-training prompts (``reference:train``), distinct from pretraining's seed 0.
HEAD_DATA_SEED = 1000
NEW_PARAMETERS = ("verbose=False", "timeout=None", "strict=True", "encoding=None", "debug=False")


@dataclass(frozen=True)
class SourceFile:
    """One module source. ``module`` is its dotted name, ``origin`` 'stdlib' or 'dist==version'."""

    module: str
    path: Path
    relpath: str
    origin: str
    text: str

    @property
    def sha256(self) -> str:
        return hashlib.sha256(self.text.encode()).hexdigest()


def is_heldout(module: str) -> bool:
    """Deterministic module split: held out iff sha256(module) mod 100 < HELDOUT_PERCENT."""
    return int(hashlib.sha256(module.encode()).hexdigest(), 16) % 100 < HELDOUT_PERCENT


def _read(path: Path) -> str | None:
    try:
        text = path.read_text(encoding="utf-8")
        ast.parse(text)
    except (UnicodeDecodeError, SyntaxError, ValueError):
        return None
    return text


def stdlib_sources() -> list[SourceFile]:
    """All parseable stdlib modules of the running interpreter, sorted by dotted name."""
    root = Path(sysconfig.get_paths()["stdlib"])
    out = []
    for path in sorted(root.rglob("*.py")):
        rel = path.relative_to(root)
        if EXCLUDED_PARTS & set(rel.parts[:-1]) or rel.name.startswith("test_"):
            continue
        text = _read(path)
        if text is None or len(text) < 200:
            continue
        module = ".".join(rel.with_suffix("").parts).removesuffix(".__init__")
        out.append(SourceFile(module, path, str(rel), "stdlib", text))
    return out


def distribution_sources(names=FOREIGN_DISTRIBUTIONS) -> list[SourceFile]:
    """Sources of installed third-party distributions (raises PackageNotFoundError if absent)."""
    out = []
    for name in names:
        dist = importlib.metadata.distribution(name)
        for f in sorted(dist.files or [], key=str):
            if f.suffix != ".py" or "tests" in f.parts:
                continue
            text = _read(Path(dist.locate_file(f)))
            if text is None or len(text) < 200:
                continue
            module = ".".join(Path(f).with_suffix("").parts).removesuffix(".__init__")
            out.append(SourceFile(module, Path(dist.locate_file(f)), str(f), f"{name}=={dist.version}", text))
    return out


@dataclass(frozen=True)
class Function:
    """One function's source, dedented; ``start``/``end`` are 1-based inclusive file lines."""

    src: SourceFile
    name: str
    code: str
    start: int
    end: int
    node: ast.FunctionDef


def functions(src: SourceFile, min_lines: int = 5, max_lines: int = 40) -> list[Function]:
    """Functions and methods of ``src`` whose source spans ``min_lines..max_lines`` lines."""
    lines = src.text.splitlines()
    out = []
    for node in ast.walk(ast.parse(src.text)):
        if not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            continue
        start = min([node.lineno] + [d.lineno for d in node.decorator_list])
        n = node.end_lineno - start + 1
        if not (min_lines <= n <= max_lines):
            continue
        code = textwrap.dedent("\n".join(lines[start - 1 : node.end_lineno]))
        if "\t" in code or max(map(len, code.splitlines())) > 100:
            continue
        try:
            fnode = ast.parse(code).body[0]
        except SyntaxError:
            continue
        out.append(Function(src, node.name, code, start, node.end_lineno, fnode))
    return out


def _fence(code: str) -> str:
    return f"```python\n{code}\n```"


def _docstring_span(fn: Function) -> tuple[int, int] | None:
    body = fn.node.body
    if (
        body
        and isinstance(body[0], ast.Expr)
        and isinstance(getattr(body[0], "value", None), ast.Constant)
        and isinstance(body[0].value.value, str)
    ):
        return body[0].lineno, body[0].end_lineno
    return None


def complete_example(fn: Function, rng: random.Random) -> tuple[str, str] | None:
    """code-complete: show the signature and the first part of the body, answer with the rest."""
    lines = fn.code.splitlines()
    body_start = fn.node.body[0].lineno - 1
    doc = _docstring_span(fn)
    if doc:
        body_start = doc[1]
    remaining = len(lines) - body_start
    if remaining < 3:
        return None
    cut = body_start + rng.randint(1, max(1, remaining // 2))
    head, rest = "\n".join(lines[:cut]), "\n".join(lines[cut:])
    prompt = f"Complete the following Python function from `{fn.src.module}`:\n{_fence(head)}"
    return prompt, _fence(rest)


def _rename_tokens(code: str, old: str, new: str) -> str | None:
    toks = list(tokenize.generate_tokens(io.StringIO(code).readline))
    out, prev, changed = [], None, False
    for tok in toks:
        if tok.type == tokenize.NAME and tok.string == old and not (prev and prev.string == "."):
            tok = tok._replace(string=new)
            changed = True
        out.append(tok)
        if tok.type not in (tokenize.NL, tokenize.COMMENT):
            prev = tok
    return tokenize.untokenize(out) if changed else None


def edit_example(fn: Function, rng: random.Random) -> tuple[str, str] | None:
    """code-edit: rename a local identifier, or add a keyword parameter; answer the whole function."""
    if rng.random() < 0.5:
        args = [a.arg for a in fn.node.args.args + fn.node.args.kwonlyargs if a.arg not in ("self", "cls")]
        stored = sorted({n.id for n in ast.walk(fn.node) if isinstance(n, ast.Name) and isinstance(n.ctx, ast.Store)})
        names = sorted(set(args) | set(stored))
        if not names:
            return None
        old = rng.choice(names)
        new = old + rng.choice(RENAME_SUFFIXES)
        if new in fn.code:
            return None
        try:
            edited = _rename_tokens(fn.code, old, new)
        except (tokenize.TokenError, IndentationError):
            return None
        if edited is None:
            return None
        prompt = f"Rename the identifier `{old}` to `{new}` in this function:\n{_fence(fn.code)}"
        return prompt, _fence(edited.rstrip("\n"))
    lines = fn.code.splitlines()
    def_idx = fn.node.lineno - 1
    line = lines[def_idx]
    a = fn.node.args
    if (
        a.vararg
        or a.kwarg
        or a.kwonlyargs
        or a.posonlyargs
        or fn.node.end_lineno == fn.node.lineno
        or not line.rstrip().endswith(":")
        or line.count(")") != 1 + line.count("(") - 1
    ):
        return None
    close = line.rfind(")")
    if close < 0 or line.count("(") != 1:
        return None
    param = rng.choice(NEW_PARAMETERS)
    if param.split("=")[0] in fn.code:
        return None
    sep = "" if line[:close].rstrip().endswith("(") else ", "
    lines[def_idx] = line[:close] + sep + param + line[close:]
    prompt = f"Add a keyword parameter `{param}` to this function's signature:\n{_fence(fn.code)}"
    return prompt, _fence("\n".join(lines))


def docstring_example(fn: Function, rng: random.Random) -> tuple[str, str] | None:
    """docstring: show the function without its docstring, answer with the docstring prose."""
    span = _docstring_span(fn)
    text = ast.get_docstring(fn.node)
    if span is None or not text or len(text) < 20:
        return None
    lines = fn.code.splitlines()
    stripped = lines[: span[0] - 1] + lines[span[1] :]
    if len(stripped) - (fn.node.lineno) < 1:
        return None
    prompt = f"Write the docstring for this function:\n{_fence(chr(10).join(stripped))}"
    return prompt, text


FAMILIES = {"code-complete": complete_example, "code-edit": edit_example, "docstring": docstring_example}


def examples(sources: list[SourceFile], families: dict, seed: int) -> list[dict]:
    """Chat records ``{"task", "messages", "provenance"}`` for every function and family that fits."""
    rng = random.Random(seed)
    out = []
    for src in sources:
        for fn in functions(src):
            for task, make in families.items():
                ex = make(fn, rng)
                if ex is None:
                    continue
                prompt, answer = ex
                out.append(
                    {
                        "task": task,
                        "messages": [{"role": "user", "content": prompt}, {"role": "assistant", "content": answer}],
                        "provenance": {
                            "source": src.relpath,
                            "module": src.module,
                            "origin": src.origin,
                            "lines": [fn.start, fn.end],
                            "sha256": src.sha256,
                        },
                    }
                )
    return out
