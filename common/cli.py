"""The ``grpo`` command. Subcommands are entry points of the group ``grpo.commands`` (see pyproject.toml): each role
registers its own, so this module knows no role, and heavy libraries are imported only after arguments parse.

A user's mistake (invalid config, unreachable Redis, missing model path) is one line on stderr and exit code 2;
anything else is a bug and keeps its traceback.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from importlib.metadata import entry_points

from common.config import Config, ConfigError, load_config

EXIT_USAGE = 2


def _commands() -> dict[str, object]:
    return {ep.name: ep for ep in entry_points(group="grpo.commands")}


def role_parser(prog: str, description: str) -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog=prog, description=description)
    p.add_argument("--config", metavar="FILE", help="YAML config (defaults: the CPU demo)")
    p.add_argument(
        "-o",
        "--override",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="dotted override, repeatable: -o learner.lr=1e-3 -o run.steps=50",
    )
    return p


def parse_config(prog: str, description: str, argv: Sequence[str]) -> Config:
    args = role_parser(prog, description).parse_args(list(argv))
    return load_config(args.config, args.override)


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    commands = _commands()
    if not commands:
        print("grpo: no subcommands registered; install the package (pip install -e .)", file=sys.stderr)
        return EXIT_USAGE
    if not argv or argv[0] in ("-h", "--help"):
        print("usage: grpo {" + ",".join(sorted(commands)) + "} [--config FILE] [-o key=value ...]")
        print("       grpo COMMAND --help   for the options of one command")
        return 0 if argv else EXIT_USAGE
    name, rest = argv[0], argv[1:]
    if name not in commands:
        print(f"grpo: unknown command {name!r}; choose from {', '.join(sorted(commands))}", file=sys.stderr)
        return EXIT_USAGE
    from common.transport import TransportError

    try:
        fn = commands[name].load()  # type: ignore[attr-defined]
        return int(fn(rest) or 0)
    except (ConfigError, TransportError) as e:
        print(f"grpo {name}: {e}", file=sys.stderr)
        return EXIT_USAGE
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
