"""The shape of the product code, checked: short files, short functions (or a reason written where they start), a
learner that reads no actor settings, and roles and ``common/`` that never import the operator commands (``ops/``).

Each test reads the source (``ast``), imports nothing of the product, and names every offender with its size, so
that a failure says what to split and by how much."""

from __future__ import annotations

import ast
from collections.abc import Iterator
from pathlib import Path

from tests.conftest import REPO

ROLES_AND_COMMON = ("actor", "learner", "grader", "common")
PRODUCT = (*ROLES_AND_COMMON, "ops")  # ops/ may not exist yet: a missing folder has no files to check
MAX_FILE_LINES = 500
MAX_FUNCTION_LINES = 60
LONG_MARK = "# long:"  # at the top of a long function's body, followed by why it is long


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


def says_why_long(lines: list[str], fn: ast.FunctionDef | ast.AsyncFunctionDef) -> bool:
    """A ``# long: <reason>`` line between the ``def`` and the first statement after the docstring: where a reader
    of the function sees it before the code it excuses."""
    body = fn.body
    has_docstring = isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant)
    first = body[1] if has_docstring and len(body) > 1 else body[0]
    for line in lines[fn.lineno - 1 : first.lineno]:
        text = line.strip()
        if text.startswith(LONG_MARK) and text[len(LONG_MARK) :].strip():
            return True
    return False


def rel(path: Path) -> str:
    return str(path.relative_to(REPO))


def test_no_product_file_is_over_500_lines() -> None:
    long_files = []
    for path in files(*PRODUCT):
        n = len(path.read_text().splitlines())
        if n > MAX_FILE_LINES:
            long_files.append(f"{rel(path)}: {n} lines")
    assert not long_files, f"files over {MAX_FILE_LINES} lines:\n" + "\n".join(long_files)


def test_no_function_is_over_60_lines_without_a_reason() -> None:
    long_functions = []
    for path in files(*PRODUCT):
        lines, tree = parsed(path)
        for fn in functions(tree):
            n = length(fn)
            if n > MAX_FUNCTION_LINES and not says_why_long(lines, fn):
                long_functions.append(f"{rel(path)}:{fn.lineno} {fn.name}: {n} lines")
    assert not long_functions, (
        f"functions over {MAX_FUNCTION_LINES} lines with no `{LONG_MARK} <why>` line at the top of their body:\n"
        + "\n".join(long_functions)
    )


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
    tree = ast.parse("\n".join(lines))
    (fn,) = functions(tree)
    assert length(fn) == 72 and not says_why_long(lines, fn)
    excused = ["def f():", '    """Doc."""', "    # long: one table, row by row", *["    x = 1"] * 70]
    (fn,) = functions(ast.parse("\n".join(excused)))
    assert says_why_long(excused, fn)
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
