"""What the images install, in two steps of their Dockerfiles (no third-party imports: it runs on the base images).

``requirements PYPROJECT EXTRA...``: the project's dependencies and those of the named extras, one per line, read
from pyproject.toml (extras that name the project itself, such as ``grpo-pipeline[data]``, are expanded). The list
changes only when the dependencies do, so the image layer that installs it is reused after any other edit.

``constraints FILE``: the pins of FILE (docker/constraints.txt) for the packages this interpreter does not have yet.
What the base image ships (torch, and SGLang's transformers) stays as it is; everything pip adds is pinned.
"""

from __future__ import annotations

import re
import sys
from collections.abc import Iterable
from importlib import metadata
from pathlib import Path
from typing import Any

_NAME = re.compile(r"\s*([A-Za-z0-9][A-Za-z0-9._-]*)\s*(\[([^\]]*)\])?")


def canonical(name: str) -> str:
    """A distribution's name as pip compares them (PEP 503)."""
    return re.sub(r"[-_.]+", "-", name).lower()


def requirement_name(line: str) -> str:
    match = _NAME.match(line)
    if match is None:
        raise ValueError(f"not a requirement: {line!r}")
    return canonical(match.group(1))


def requirements(pyproject: dict[str, Any], extras: Iterable[str]) -> list[str]:
    """The dependencies and the named extras' dependencies, in order, each once."""
    project = pyproject["project"]
    own = canonical(project["name"])
    optional = project.get("optional-dependencies", {})
    out: list[str] = []
    seen_extras: set[str] = set()

    def add(lines: Iterable[str]) -> None:
        for line in lines:
            match = _NAME.match(line)
            if match is not None and canonical(match.group(1)) == own:  # grpo-pipeline[data]: that extra's lines
                for extra in (match.group(3) or "").split(","):
                    add_extra(extra.strip())
            elif line not in out:
                out.append(line)

    def add_extra(extra: str) -> None:
        if extra in seen_extras:
            return
        if extra not in optional:
            raise KeyError(f"pyproject.toml has no extra {extra!r}")
        seen_extras.add(extra)
        add(optional[extra])

    add(project.get("dependencies", []))
    for extra in extras:
        add_extra(extra)
    return out


def pins_to_install(lines: Iterable[str], installed: set[str]) -> list[str]:
    """The constraint lines (comments and blanks dropped) for packages not among ``installed`` (canonical names)."""
    kept = []
    for line in lines:
        text = line.split("#", 1)[0].strip()
        if text and requirement_name(text) not in installed:
            kept.append(text)
    return kept


def installed_here() -> set[str]:
    return {canonical(d.metadata["Name"]) for d in metadata.distributions() if d.metadata["Name"]}


def main(argv: list[str]) -> int:
    if len(argv) >= 2 and argv[0] == "requirements":
        import tomllib  # Python >= 3.11: this step runs in a python image of its own

        pyproject = tomllib.loads(Path(argv[1]).read_text())
        print("\n".join(requirements(pyproject, argv[2:])))
        return 0
    if len(argv) == 2 and argv[0] == "constraints":
        print("\n".join(pins_to_install(Path(argv[1]).read_text().splitlines(), installed_here())))
        return 0
    print(__doc__, file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
