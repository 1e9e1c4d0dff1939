"""Who may import whom, checked on the source (``ast``; nothing of the product is imported).

The parts are layered: ``common/`` is what the roles share and imports none of them; ``grader/`` is a library both
roles use and imports neither; ``env/`` (multi-turn environments) builds on the grader's worker processes, and the
grader knows nothing of it; the actor and the learner meet only through Redis and ``common/``, never importing each
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
    "common": ("actor", "learner", "grader", "env", "ops"),
    "grader": ("actor", "learner", "env", "ops"),
    "env": ("actor", "learner", "ops"),
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
    assert offences("actor", REPO / "actor" / "example.py", ast.parse("from grader.open import open_grader\n")) == []


def names_imported_from(tree: ast.Module, module: str) -> Iterator[tuple[int, str]]:
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.level == 0 and node.module == module:
            yield from ((node.lineno, alias.name) for alias in node.names)


@pytest.mark.parametrize(("role", "view"), [("actor", "ActorTransport"), ("learner", "LearnerTransport")])
def test_each_role_takes_only_its_view_of_the_transport(role: str, view: str) -> None:
    # The view is the role's whole access to Redis: mypy holds the role's calls to its methods, and the object a role
    # makes has no method of the other side.
    found = [
        f"{path.relative_to(REPO)}:{line} imports {name}"
        for path in sorted((REPO / role).rglob("*.py"))
        for line, name in names_imported_from(ast.parse(path.read_text()), "common.transport")
        if name.endswith("Transport") and name != view
    ]
    assert not found, f"{role}/ must use {view}, not another view of the transport:\n" + "\n".join(found)


def test_the_redis_layer_knows_neither_the_model_nor_prometheus() -> None:
    paths = sorted((REPO / "common" / "transport").glob("*.py"))
    found = [
        f"{path.relative_to(REPO)}:{line} imports {module}"
        for path in paths
        for line, module in imported_modules(ast.parse(path.read_text()))
        if module.startswith(("common.model", "common.metrics", "torch", "transformers", "prometheus_client"))
    ]
    assert paths and not found, "\n".join(found)


def test_an_actor_view_cannot_settle_and_a_learner_view_cannot_produce() -> None:
    from common.transport import ActorTransport, LearnerTransport, Transport

    def methods(cls: type) -> set[str]:
        return {n for n in dir(cls) if not n.startswith("_")}

    actor, learner = methods(ActorTransport), methods(LearnerTransport)
    learners_own = {"read", "ack_trained", "drop", "dead_letter", "announce_weights", "mark_done", "acquire_lease",
                    "nccl_open_round", "nccl_decide", "create_identity"}  # fmt: skip
    actors_own = {"produce", "reserve_round", "next_prompts", "heartbeat", "nccl_register", "nccl_ready"}
    assert not actor & learners_own and learners_own <= learner
    assert not learner & actors_own and actors_own <= actor
    # The whole is both, and the operator's reading and replaying besides.
    assert actor | learner | {"replay_dead", "dead_letters", "run_names", "delete_run"} <= methods(Transport)
