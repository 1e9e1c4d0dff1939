"""Who may import whom, checked on the source (``ast``; nothing of the product is imported).

The parts are layered: ``common/`` is what the roles share and imports none of them; ``grader/`` is a library both
roles use and imports neither; the actor and the learner meet only through Redis and ``common/``, never importing each
other; and ``ops/``, the operator, knows every part while no part imports it. Imports inside functions count as much
as those at the top: a lazy import is still a dependency.
"""

from __future__ import annotations

import ast
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.conftest import REPO

# part -> the top-level packages it must not import
FORBIDDEN = {
    "common": ("actor", "learner", "grader", "ops"),
    "grader": ("actor", "learner", "ops"),
    "actor": ("learner", "ops"),
    "learner": ("actor", "ops"),
}


def imported_modules(tree: ast.Module) -> Iterator[tuple[int, str]]:
    """``(line, module)`` of every absolute import in the tree, at any depth: ``import a.b``, ``from a.b import c``
    and ``importlib.import_module("a.b")`` with a literal name (a relative ``from . import x`` stays in its part)."""
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            yield from ((node.lineno, alias.name) for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            yield node.lineno, node.module
        elif isinstance(node, ast.Call) and node.args and isinstance(node.args[0], ast.Constant):
            func = node.func
            name = func.attr if isinstance(func, ast.Attribute) else func.id if isinstance(func, ast.Name) else ""
            if name == "import_module" and isinstance(node.args[0].value, str):
                yield node.lineno, node.args[0].value


def offences(part: str, path: Path, tree: ast.Module) -> list[str]:
    where = path.relative_to(REPO) if path.is_relative_to(REPO) else path
    return [
        f"{where}:{line} imports {module}"
        for line, module in imported_modules(tree)
        if module.split(".")[0] in FORBIDDEN[part]
    ]


@pytest.mark.parametrize("part", sorted(FORBIDDEN))
def test_no_part_imports_what_its_layer_forbids(part: str) -> None:
    paths = sorted((REPO / part).rglob("*.py"))
    assert paths, f"{part}/ has no Python files: the check would pass on nothing"
    found = [o for path in paths for o in offences(part, path, ast.parse(path.read_text(), filename=str(path)))]
    assert not found, f"{part}/ must not import {', '.join(FORBIDDEN[part])}:\n" + "\n".join(found)


def test_the_check_sees_every_form_of_import() -> None:
    # The test above passes on a tidy tree whether or not it works: it is shown each form of offence here.
    source = (
        "import ops\n"
        "import ops.status as s\n"
        "from learner.loop import run\n"
        "def lazy():\n"
        "    from actor import engine\n"
        "importlib.import_module('ops.dead')\n"
        "from . import ops\n"
        "import opsy\n"
        "from common import config\n"
    )
    found = offences("common", REPO / "common" / "example.py", ast.parse(source))
    assert sorted(int(o.split(":")[1].split()[0]) for o in found) == [1, 2, 3, 5, 6], found
    assert offences("actor", REPO / "actor" / "example.py", ast.parse("from grader.pool import open_grader\n")) == []
