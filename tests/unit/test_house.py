"""The shape of the product code, checked: short files and functions, no import circle, an engine's abilities read
from its capabilities and never probed, the wire and the grader free of torch, a learner that reads no actor
settings, and roles and ``common/`` that never import the operator commands (``ops/``).

Each test reads the source (``ast``) and names every offender (with its size, where size is the offence), so that a
failure says what to split and by how much; only the torch check imports the modules it is about, in a fresh
interpreter."""

from __future__ import annotations

import ast
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

from tests.conftest import REPO

ROLES_AND_COMMON = ("actor", "learner", "grader", "env", "common")
PRODUCT = (*ROLES_AND_COMMON, "ops")
MAX_FILE_LINES = 400
MAX_FUNCTION_LINES = 50


def files(*folders: str) -> Iterator[Path]:
    for folder in folders:
        yield from sorted((REPO / folder).rglob("*.py"))


def parsed(path: Path) -> tuple[list[str], ast.Module]:
    text = path.read_text()
    return text.splitlines(), ast.parse(text, filename=str(path))


def functions(tree: ast.Module) -> Iterator[ast.FunctionDef | ast.AsyncFunctionDef]:
    """Every function and method, nested ones included (each is measured on its own)."""
    for node in ast.walk(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            yield node


def length(fn: ast.FunctionDef | ast.AsyncFunctionDef) -> int:
    assert fn.end_lineno is not None
    return fn.end_lineno - fn.lineno + 1


def rel(path: Path) -> str:
    return str(path.relative_to(REPO))


def test_no_product_file_is_over_400_lines() -> None:
    long_files = []
    for path in files(*PRODUCT):
        n = len(path.read_text().splitlines())
        if n > MAX_FILE_LINES:
            long_files.append(f"{rel(path)}: {n} lines")
    assert not long_files, f"files over {MAX_FILE_LINES} lines:\n" + "\n".join(long_files)


def test_no_function_is_over_50_lines() -> None:
    long_functions = []
    for path in files(*PRODUCT):
        for fn in functions(parsed(path)[1]):
            if (n := length(fn)) > MAX_FUNCTION_LINES:
                long_functions.append(f"{rel(path)}:{fn.lineno} {fn.name}: {n} lines")
    assert not long_functions, f"functions over {MAX_FUNCTION_LINES} lines:\n" + "\n".join(long_functions)


MAX_SHARE_OF_COMMON_PART = 0.15


def product_lines(path: Path) -> int:
    return len(path.read_text().splitlines())


def common_parts() -> dict[str, int]:
    """The lines of each sub-package of ``common/`` and of the files directly in it, taken together."""
    common = REPO / "common"
    parts = {"common/*.py": sum(product_lines(p) for p in common.glob("*.py"))}
    for package in sorted(d for d in common.iterdir() if (d / "__init__.py").exists()):
        parts[f"{rel(package)}/"] = sum(product_lines(p) for p in package.rglob("*.py"))
    return parts


def test_common_is_a_handful_of_parts_none_over_15_percent_of_the_product() -> None:
    # A catch-all folder grows without anyone deciding it should: each concern the roles share is a sub-package
    # of its own, and what is left directly in common/ is small and cross-cutting.
    total = sum(product_lines(p) for p in files(*PRODUCT))
    parts = common_parts()
    over = [f"{name}: {n} lines, {n / total:.0%}" for name, n in parts.items() if n > MAX_SHARE_OF_COMMON_PART * total]
    assert len(parts) > 2 and not over, f"of the product's {total} lines, over {MAX_SHARE_OF_COMMON_PART:.0%}:\n" + (
        "\n".join(over)
    )


def reads_actor_section(node: ast.AST) -> bool:
    """``<x>.actor.<y>`` (``cfg.actor.engine``), the section itself (``cfg.actor``, ``self.config.actor``) or
    ``getattr(<x>, "actor")``."""
    if isinstance(node, ast.Attribute):
        if isinstance(node.value, ast.Attribute) and node.value.attr == "actor":
            return True
        base = node.value.id if isinstance(node.value, ast.Name) else getattr(node.value, "attr", "")
        return node.attr == "actor" and base in ("cfg", "config")
    return (
        isinstance(node, ast.Call)
        and isinstance(node.func, ast.Name)
        and node.func.id == "getattr"
        and len(node.args) >= 2
        and isinstance(node.args[1], ast.Constant)
        and node.args[1].value == "actor"
    )


def actor_settings_read(tree: ast.Module) -> Iterator[tuple[int, str]]:
    for node in ast.walk(tree):
        if isinstance(node, ast.expr) and reads_actor_section(node):
            yield node.lineno, ast.unparse(node)


def test_the_learner_reads_no_actor_settings() -> None:
    # A role reads only its own section of the config and the shared ones: a setting both need lives in a shared one.
    reads = [
        f"{rel(path)}:{line} {code}" for path in files("learner") for line, code in actor_settings_read(parsed(path)[1])
    ]
    assert not reads, "the learner reads the actor's section of the config:\n" + "\n".join(reads)


def modules_imported(node: ast.AST) -> list[str]:
    """The absolute module names ``node`` imports: ``import a, b``, ``from a import x`` (not a relative ``from .``)
    and ``importlib.import_module("a")`` with a literal name."""
    if isinstance(node, ast.Import):
        return [a.name for a in node.names]
    if isinstance(node, ast.ImportFrom):
        return [node.module] if node.level == 0 and node.module else []
    if isinstance(node, ast.Call) and node.args and isinstance(node.args[0], ast.Constant):
        func = node.func
        name = func.attr if isinstance(func, ast.Attribute) else func.id if isinstance(func, ast.Name) else ""
        if name == "import_module" and isinstance(node.args[0].value, str):
            return [node.args[0].value]
    return []


def imports_of_ops(tree: ast.Module) -> Iterator[tuple[int, str]]:
    for node in ast.walk(tree):
        if isinstance(node, (ast.stmt, ast.expr)) and any(
            m == "ops" or m.startswith("ops.") for m in modules_imported(node)
        ):
            yield node.lineno, ast.unparse(node)


def test_roles_and_common_never_import_the_operator_commands() -> None:
    # ops/ is a client of the run's Redis keys: the roles and common/ must not depend on it.
    found = [
        f"{rel(path)}:{line} {code}"
        for path in files(*ROLES_AND_COMMON)
        for line, code in imports_of_ops(parsed(path)[1])
    ]
    assert not found, "imports of ops/ from the roles or common/:\n" + "\n".join(found)


def test_the_checks_catch_what_they_look_for() -> None:
    # The checks above pass on a tidy tree whether or not they work: each is shown an offender here.
    lines = ["def f():", '    """Doc."""', *["    x = 1"] * 70]
    (fn,) = functions(ast.parse("\n".join(lines)))
    assert length(fn) == 72
    nested = ast.parse("def outer():\n    def inner():\n        pass\n    return inner\n")
    assert sorted((f.name, length(f)) for f in functions(nested)) == [("inner", 2), ("outer", 4)]
    reads = ast.parse(
        "a = cfg.actor.engine\nb = getattr(cfg, 'actor')\nc = cfg.learner.lr\nd = actor.x\ne = self.cfg.actor\n"
    )
    assert sorted({line for line, _ in actor_settings_read(reads)}) == [1, 2, 5]
    imports = ast.parse(
        "import ops\nimport ops.status as s\nfrom ops.dead import main\nfrom . import ops\nimport opsy\n"
        "from common import x\nimportlib.import_module('ops.status')\n"
    )
    assert [line for line, _ in imports_of_ops(imports)] == [1, 2, 3, 7]


def module_name(path: Path) -> str:
    parts = path.relative_to(REPO).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def import_graph(sources: dict[str, ast.Module]) -> dict[str, set[str]]:
    """Module -> the product modules it imports (at any depth: an import inside a function is an arrow too). ``from
    a.b import c`` is an arrow to ``a.b.c`` where that is a module, else to ``a.b`` (a name from its face)."""
    graph: dict[str, set[str]] = {m: set() for m in sources}
    for module, tree in sources.items():
        for node in ast.walk(tree):
            targets = modules_imported(node)
            if isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                targets = [f"{node.module}.{a.name}" if f"{node.module}.{a.name}" in sources else node.module
                           for a in node.names]  # fmt: skip
            graph[module].update(t for t in targets if t in sources and t != module)
    return graph


def circles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The import circles: every strongly connected set of two or more modules (Tarjan's algorithm)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    found: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        for w in sorted(graph[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            part = []
            while (w := stack.pop()) != v:
                part.append(w)
            if part:
                found.append(sorted([v, *part]))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return found


def test_no_import_circle_among_product_files() -> None:
    # A circle is broken at run time by an import inside a function, and hides from a reader which room is below.
    sources = {module_name(path): parsed(path)[1] for path in files(*PRODUCT)}
    assert not (found := circles(import_graph(sources))), "import circles:\n" + "\n".join(map(" -> ".join, found))


def engine_probes(tree: ast.Module) -> Iterator[tuple[int, str]]:
    """``getattr``/``hasattr`` of something named like an engine (``engine``, ``self.engine``, ``real_engine``)."""
    for node in ast.walk(tree):
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id in ("getattr", "hasattr"):
            target = node.args[0] if node.args else None
            name = target.id if isinstance(target, ast.Name) else getattr(target, "attr", "")
            if "engine" in str(name).lower():
                yield node.lineno, ast.unparse(node)


def test_no_caller_probes_an_engine() -> None:
    # What an engine can do is its Capabilities (actor.engines.base): a probe outside the engines is a contract
    # nobody wrote down.
    engines = REPO / "actor" / "engines"
    probes = [
        f"{rel(path)}:{line} {code}"
        for path in files(*PRODUCT)
        if not path.is_relative_to(engines)
        for line, code in engine_probes(parsed(path)[1])
    ]
    assert not probes, "engines probed with getattr/hasattr outside actor/engines/:\n" + "\n".join(probes)


HEAVY = {"torch", "transformers"}
TORCH_FREE = ("grader.pool", "grader.open", "actor.engines.sglang.requests", "common.schemas.group", "common.rollout")


def test_the_grader_the_sglang_requests_and_the_wire_load_no_torch() -> None:
    # The grader's workers restart often and the SGLang client talks JSON: neither should pay for torch's import.
    for module in TORCH_FREE:  # each in an interpreter of its own: one module's imports must not hide another's
        code = f"import importlib, sys; importlib.import_module({module!r}); print(sorted(set(sys.modules) & {HEAVY}))"
        out = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, check=True)
        assert out.stdout.strip() == "[]", f"importing {module} loads {out.stdout.strip()}"


def test_the_circle_and_probe_checks_catch_what_they_look_for() -> None:
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}, "e": set()}
    assert circles(graph) == [["a", "b", "c"]]
    sources = {"p": ast.parse("from q import f\n"), "q": ast.parse("def f():\n    from p import g\n")}
    assert circles(import_graph(sources)) == [["p", "q"]]
    probes = ast.parse("getattr(engine, 'x')\nhasattr(self.engine, 'y')\ngetattr(cfg, 'actor')\n")
    assert [line for line, _ in engine_probes(probes)] == [1, 2]


# Packages whose callers import from the face (STYLE.md, "A package's face"), and the modules of each that callers
# import by their path instead (they load what the face's other callers must not pay for).
FACES = {
    "common.config": (),
    "common.schemas": (),
    "common.transport": (),
    "common.weights": ("adapters", "nccl"),
    "common.tasks": ("evaluation",),
}


def behind_faces(module: str, tree: ast.Module) -> Iterator[tuple[int, str]]:
    """Imports of a module behind a face that hands its names on, from outside that package."""
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            for face, own in FACES.items():
                inside = module == face or module.startswith(face + ".")
                rest = node.module.removeprefix(face + ".")
                if not inside and node.module.startswith(face + ".") and rest.split(".")[0] not in own:
                    yield node.lineno, ast.unparse(node)


def test_callers_import_from_a_packages_face() -> None:
    found = [
        f"{rel(path)}:{line} {code}"
        for path in files(*PRODUCT)
        for line, code in behind_faces(module_name(path), parsed(path)[1])
    ]
    assert not found, "imports from behind a package's face (STYLE.md):\n" + "\n".join(found)
    assert [line for line, _ in behind_faces("actor.x", ast.parse("from common.schemas.group import G\n"))] == [1]
    assert not list(behind_faces("common.schemas.x", ast.parse("from common.schemas.group import G\n")))
    assert not list(behind_faces("actor.x", ast.parse("from common.weights.nccl import f\n")))
