"""The drafters, one folder each, found by name through this registry: the one place a drafter is listed.

    from draftsmith import drafters
    drafters.names()                          # ('eagle3', 'mlp_speculator', 'draft_model', 'ngram', 'dflash')
    drafters.section_class("eagle3")          # its recipe section (torch-free, drafters/eagle3/config.py)
    drafters.get("eagle3")                    # its Drafter (drafters/base.py contract; drafters/eagle3/drafter.py)

The registry key is the one name of a drafter everywhere: the recipe's ``drafter.method``, the ``head_type``
of its exports' ``draftsmith.json``, and the ``method`` of vLLM's ``--speculative-config``. A drafter folder
holds ``config.py`` (its recipe section and speculative-config rules, importable without torch, so that a
bad recipe is reported in a fraction of a second) and ``drafter.py`` (the ``Drafter`` object ``DRAFTER``:
model, training spec, proposer, export / check / load, card lines, memory). Adding a drafter is a new folder
and one line in ``REGISTRY`` (README.md, "Adding a drafter"); the contract tests then run over it.
"""

from __future__ import annotations

import importlib
from types import ModuleType

#: drafter name -> its folder's module path
REGISTRY: dict[str, str] = {
    "eagle3": "draftsmith.drafters.eagle3",
    "mlp_speculator": "draftsmith.drafters.mlp_speculator",
    "draft_model": "draftsmith.drafters.draft_model",
    "ngram": "draftsmith.drafters.ngram",
    "dflash": "draftsmith.drafters.dflash",
}
#: the drafter a recipe trains when it names none (the main job's)
DEFAULT = "eagle3"


class UnknownDrafterError(ValueError):
    """A drafter name that is not registered (the message lists the registered ones)."""


def names() -> tuple[str, ...]:
    """Registered drafter names, in registry order."""
    return tuple(REGISTRY)


def check_name(name: object, where: str = "method") -> str:
    """``name`` when it is a registered drafter; else UnknownDrafterError naming ``where`` and the choices."""
    if name not in REGISTRY:
        raise UnknownDrafterError(
            f"{where} {name!r} is not a drafter draftsmith implements; choose one of {', '.join(REGISTRY)}"
        )
    return str(name)


def config_module(name: str) -> ModuleType:
    """The drafter's torch-free ``config`` module (its recipe section and speculative-config rules)."""
    return importlib.import_module(f"{REGISTRY[check_name(name)]}.config")


def section_class(name: str) -> type:
    """The dataclass of the drafter's recipe section (``config.Section``)."""
    return config_module(name).Section


def get(name: str):
    """The drafter's ``Drafter`` (``drafters.base.Drafter``; imports torch and the drafter's model code)."""
    return importlib.import_module(f"{REGISTRY[check_name(name)]}.drafter").DRAFTER


def all_drafters() -> list:
    """Every registered ``Drafter``, in registry order (the contract tests run over these)."""
    return [get(name) for name in REGISTRY]
