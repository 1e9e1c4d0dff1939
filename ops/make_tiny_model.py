"""``grpo make-tiny-model DIR``: the offline demo model, built here, never downloaded.

The demo model is ops.tiny_model's; with ``--calculator``, its variant that calls a calculator,
ops.tiny_tool_model's."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable

from ops import tiny_tool_model as tool
from ops.tiny_model import RECIPE_VERSION, built_here, make_tiny_model


def main(argv: list[str] | None = None) -> int:
    from common.cli import PlainHelpFormatter
    from common.log import setup_logging

    p = argparse.ArgumentParser(
        prog="grpo make-tiny-model", description=(__doc__ or "").splitlines()[0], formatter_class=PlainHelpFormatter
    )
    p.add_argument("dir", help="directory to write (replaced if it exists)")
    p.add_argument("--no-warm-start", action="store_true", help="save the random initialisation")
    p.add_argument("--habit", type=float, default=0.7, help="fraction of warm-start answers ending with a space")
    p.add_argument(
        "--calculator",
        action="store_true",
        help="the calculator variant: two-digit multiplication with a tool to call (see ops/tiny_tool_model.py)",
    )
    p.add_argument(
        "--tool-habit", type=float, default=0.3, help="with --calculator: fraction of warm-start episodes that call"
    )
    p.add_argument("--seed", type=int, default=0)
    p.add_argument(
        "--if-missing",
        action="store_true",
        help="keep DIR if it already holds this model (same recipe, seed and warm start) instead of building it again",
    )
    args = p.parse_args(argv)
    setup_logging("make-tiny-model")
    warm = not args.no_warm_start
    if args.calculator:
        what, recipe = "calculator model", tool.TOOL_RECIPE_VERSION
        kept = tool.tool_built_here(args.dir, warm=warm, tool_habit=args.tool_habit, seed=args.seed)
        make: Callable[[], dict] = lambda: tool.make_tiny_tool_model(  # noqa: E731
            args.dir, warm=warm, tool_habit=args.tool_habit, seed=args.seed
        )
    else:
        what, recipe = "demo model", RECIPE_VERSION
        kept = built_here(args.dir, warm=warm, habit=args.habit, seed=args.seed)
        make = lambda: make_tiny_model(args.dir, warm=warm, habit=args.habit, seed=args.seed)  # noqa: E731
    if args.if_missing and kept:
        print(f"{args.dir} holds the {what} already (recipe {recipe}, seed {args.seed}): kept", file=sys.stderr)
        return 0
    report = make()
    print(
        f"wrote {args.dir}: "
        + ", ".join(f"{k} {v:.3g}" if isinstance(v, float) else f"{k} {v}" for k, v in report.items()),
        file=sys.stderr,
    )
    return 0
