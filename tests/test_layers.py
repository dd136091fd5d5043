"""The package's layers import one way, no folder imports another in a cycle, and drafter names are compared only
inside the drafters' own folders.

Layers, lowest first (a module may import its own layer and those below, never above):
    base       config, precision, sizes, models, sources, arguments, reference  (helpers every layer uses)
    core       the verification core: target + KV cache, sampling, verification, decode loop, Proposer contract
    data       data_pipeline: chat rendering, masks, regeneration, draft vocabulary, capture, shards
    train / export   the drafter-agnostic trainer; metadata, identity, atomic writing, checks, model card
    drafters   the registry and one folder per drafter
    serve / evaluation   engine, server, metrics, memory plan; held-out eval, referee, serving benchmark
    pipeline   recipe, stages, demo, Hub
    cli        the command line
Imports inside functions count too (``ast``, not a running interpreter).
"""

from __future__ import annotations

import ast
import io
import tokenize
from collections import defaultdict
from pathlib import Path

import pytest

from draftsmith import drafters

PACKAGE = Path(__file__).resolve().parents[1] / "src" / "draftsmith"
LAYERS = {
    "base": 0,
    "core": 1,
    "data_pipeline": 2,
    "train": 3,
    "export": 3,
    "drafters": 4,
    "serve": 5,
    "evaluation": 5,
    "pipeline": 6,
    "cli": 7,
}
BASE = {"config", "precision", "sizes", "models", "sources", "arguments", "reference", "identity", "__init__"}


def unit(module: str) -> str:
    """The folder (or top-level module) a ``draftsmith.x.y`` module belongs to."""
    parts = module.split(".")[1:] or ["__init__"]
    return "base" if parts[0] in BASE else parts[0]


def modules() -> dict[str, Path]:
    out = {}
    for path in PACKAGE.rglob("*.py"):
        rel = path.relative_to(PACKAGE.parent).with_suffix("")
        name = ".".join(rel.parts).removesuffix(".__init__")
        out[name] = path
    return out


def imports(path: Path) -> set[str]:
    """Every ``draftsmith...`` module ``path`` imports, at any depth (relative imports resolved)."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("draftsmith"):
            found.add(node.module)
            found.update(f"{node.module}.{a.name}" for a in node.names)
        elif isinstance(node, ast.Import):
            found.update(a.name for a in node.names if a.name.startswith("draftsmith"))
    return found


def graph() -> dict[str, set[str]]:
    """Folder -> folders it imports (only modules that exist)."""
    mods = modules()
    edges = defaultdict(set)
    for name, path in mods.items():
        for target in imports(path):
            while target not in mods and "." in target:
                target = target.rsplit(".", 1)[0]
            if target in mods and unit(target) != unit(name):
                edges[unit(name)].add(unit(target))
    return edges


def test_layers_import_one_way():
    upward = [(src, dst) for src, dsts in graph().items() for dst in dsts if LAYERS[dst] > LAYERS[src]]
    assert not upward, f"imports from a lower layer to a higher one: {sorted(upward)}"


def test_no_import_cycle_between_folders():
    edges = graph()
    seen, stack, cycles = set(), [], []

    def visit(node):
        if node in stack:
            cycles.append(stack[stack.index(node) :] + [node])
            return
        if node in seen:
            return
        seen.add(node)
        stack.append(node)
        for nxt in sorted(edges.get(node, ())):
            visit(nxt)
        stack.pop()

    for node in sorted(edges):
        visit(node)
    assert not cycles, f"import cycles between folders: {cycles}"


def test_the_verification_core_imports_nothing_above_it():
    above = {
        unit(t)
        for name, path in modules().items()
        if unit(name) == "core"
        for t in imports(path)
        if unit(t) not in ("core", "base")
    }
    assert not above, f"the core imports {above}"
    base = {t for name, path in modules().items() if unit(name) == "core" for t in imports(path) if unit(t) == "base"}
    assert base <= {"draftsmith"}, f"the core imports base modules {base}: it stands on torch and transformers alone"


def code_strings(path: Path) -> list[tuple[int, str]]:
    """String literals of ``path`` that are code, not docstrings or comments: (line, value)."""
    tree = ast.parse(path.read_text())
    docstrings = {
        node.body[0].value.lineno
        for node in ast.walk(tree)
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef))
        and node.body
        and isinstance(node.body[0], ast.Expr)
        and isinstance(node.body[0].value, ast.Constant)
        and isinstance(node.body[0].value.value, str)
    }
    out = []
    for tok in tokenize.generate_tokens(io.StringIO(path.read_text()).readline):
        if tok.type == tokenize.STRING and tok.start[0] not in docstrings:
            try:
                out.append((tok.start[0], ast.literal_eval(tok.string)))
            except (ValueError, SyntaxError):  # f-strings: their text is messages, not comparisons
                continue
    return out


@pytest.mark.parametrize("name", drafters.names())
def test_no_drafter_name_outside_the_drafters_folders(name):
    """A drafter's name is data of the registry: no code outside src/draftsmith/drafters/ spells it (so nothing
    there can compare it), whatever module it is in."""
    hits = [
        f"{path.relative_to(PACKAGE)}:{line}"
        for mod, path in modules().items()
        if unit(mod) != "drafters"
        for line, value in code_strings(path)
        if value == name
    ]
    assert not hits, f"{name!r} spelled outside drafters/: {hits}"
