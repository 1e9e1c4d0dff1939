"""What the benchmark scripts share: the real `grpo run` as a measured process, and their command-line shell
(``--quick``, ``--out``, one JSON object printed). Named so as not to shadow the project's ``common`` package,
since a script's own folder comes first on its import path."""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent


def grpo_run(
    overrides: list[str], run_dir: Path, timeout_s: float = 1800, config: str | None = None
) -> list[dict[str, Any]]:
    """Run ``grpo run --plain [--config config] -o ...`` with ``run.dir=run_dir`` to its end; its metrics.jsonl
    rows. A failed run ends the benchmark with its output."""
    cmd = [sys.executable, "-m", "common.cli", "run", "--plain", *(["--config", config] if config else [])]
    for o in [*overrides, f"run.dir={run_dir}"]:
        cmd += ["-o", o]
    done = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=timeout_s)
    if done.returncode != 0:
        raise SystemExit(f"grpo run failed ({done.returncode}):\n{done.stdout[-2000:]}\n{done.stderr[-2000:]}")
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def parser(doc: str | None, quick_help: str) -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=(doc or "").splitlines()[0])
    p.add_argument("--quick", action="store_true", help=quick_help)
    p.add_argument("--out", type=Path, default=None, help="write the JSON result here too")
    return p


def emit(result: dict[str, Any], out: Path | None) -> int:
    """Print the result as one JSON line (and write it to ``out``), with the machine it was measured on."""
    if str(REPO) not in sys.path:
        sys.path.insert(0, str(REPO))
    from common.hardware import machine

    text = json.dumps({**result, "machine": result.get("machine") or machine()})
    if out:
        out.write_text(text + "\n")
    print(text)
    return 0
