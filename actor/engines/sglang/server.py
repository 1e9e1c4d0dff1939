"""A SGLang server launched by its actor: which interpreter and flags, its log, its endpoint, and stopping it.

SGLang pins its own torch and transformers, so on a machine set up by this project the server runs in a venv of its
own (``scripts/sglang_env.sh`` makes ``.venv-sglang``); in SGLang's image it is this process's interpreter. On a
machine without a GPU it runs SGLang's CPU backend (``sglang.cpu_args``, ``SGLANG_USE_CPU_ENGINE=1``).

The server is this process's child in a process group of its own: it dies with the actor (``PR_SET_PDEATHSIG``), and
stopping it ends the whole group, SGLang's scheduler and detokenizer processes included, by the group's id.
"""

from __future__ import annotations

import contextlib
import logging
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

from actor.engines.sglang.adapters import launch_args
from common.children import die_with_parent, stop_process
from common.config import Config
from common.metrics import register_endpoint
from common.ports import free_port

log = logging.getLogger(__name__)

# scripts/sglang_env.sh makes it here, in the checkout this package runs from.
PROJECT_VENV = Path(__file__).resolve().parents[3] / ".venv-sglang" / "bin" / "python"


def server_python(configured: str) -> str:
    if configured:
        return configured
    return str(PROJECT_VENV) if PROJECT_VENV.is_file() else sys.executable


def on_cpu(device: str) -> bool:
    if device != "auto":
        return device == "cpu"
    import torch

    return not torch.cuda.is_available()


# What SGLang's CPU recipe preloads: Intel's OpenMP runtime and two allocators (found in the server's venv and in
# the system's library directories; each only where installed).
PRELOADS = ("libiomp5.so", "libtcmalloc_minimal.so.4", "libtbbmalloc.so.2")


def cpu_preloads(python: str) -> list[str]:
    """The libraries of :data:`PRELOADS` found for the server's interpreter, in that order."""
    venv_lib = Path(python).parent.parent / "lib"
    found = []
    for name in PRELOADS:
        where = [venv_lib / name, *sorted(Path("/usr/lib").glob(f"*-linux-gnu/{name}")), Path("/usr/lib") / name]
        hit = next((w for w in where if w.is_file()), None)
        if hit is not None:
            found.append(str(hit))
    return found


def launch_command(cfg: Config, port: int) -> tuple[list[str], dict[str, str]]:
    """The command line and environment of a server for ``cfg.model.path`` on ``port`` (pure but for the device)."""
    sc = cfg.sglang
    cmd = [server_python(sc.python), "-m", sc.launch_module, "--model-path", cfg.model.path,
           "--host", "127.0.0.1", "--port", str(port), "--weight-version", "0"]  # fmt: skip
    env = dict(os.environ)
    if on_cpu(sc.device):
        cmd += sc.cpu_args
        env["SGLANG_USE_CPU_ENGINE"] = "1"
        # The server's OpenMP threads would spin between kernels, on cores the learner and other servers share:
        # measured on the demo with two actors on 2 cores, 3 groups/s spinning, 15 yielding.
        env.setdefault("OMP_WAIT_POLICY", "PASSIVE")
        # As many compute threads as the local engine would take (actor.torch_threads), not one per core of the
        # machine: the learner and the other actors' servers share those cores.
        env.setdefault("OMP_NUM_THREADS", str(cfg.actor.torch_threads))
        preloads = cpu_preloads(cmd[0]) if sc.cpu_preload else []
        if preloads:
            env["LD_PRELOAD"] = ":".join([*preloads, *filter(None, [env.get("LD_PRELOAD", "")])])
    if cfg.learner.lora.rank:  # versions will be adapters of this shape: the server reserves room for them now
        cmd += launch_args(cfg.learner.lora.rank, cfg.learner.lora.target_modules)
    return cmd + sc.launch_args, env


def describe_exit(code: int) -> str:
    return f"killed by {signal.Signals(-code).name}" if code < 0 else f"exit code {code}"


class LaunchedServer:
    """``python -m sglang.launch_server`` as a child; listed in ``endpoints.json`` with role ``sglang``."""

    def __init__(self, cfg: Config, name: str):
        port = free_port()
        cmd, env = launch_command(cfg, port)
        logs = Path(cfg.run.dir) / "logs"
        logs.mkdir(parents=True, exist_ok=True)
        self.log_path = logs / f"sglang-{name or port}.log"
        with self.log_path.open("ab") as out:
            self.proc = subprocess.Popen(
                cmd, stdout=out, stderr=subprocess.STDOUT, env=env, preexec_fn=die_with_parent, start_new_session=True
            )
        self.url = f"http://127.0.0.1:{port}"
        log.info("launched SGLang (pid %d, %s) at %s; its log: %s", self.proc.pid, cmd[0], self.url, self.log_path)
        register_endpoint(cfg.run.dir, "sglang", name or str(port), self.url, pid=self.proc.pid, key="url")

    def gone(self) -> str | None:
        """Why the server is no longer running, or None while it runs."""
        code = self.proc.poll()
        if code is None:
            return None
        return f"the SGLang server (pid {self.proc.pid}) is gone ({describe_exit(code)}); its log: {self.log_path}"

    def tail(self, lines: int = 5) -> str:
        with contextlib.suppress(OSError):
            text = self.log_path.read_text(errors="replace").strip().splitlines()
            return " | ".join(line.strip() for line in text[-lines:])
        return ""

    def stop(self) -> None:
        stop_process(self.proc, grace_s=30, name="sglang server")
        # What SGLang started (scheduler, detokenizer) is in the server's group; after the server itself has gone
        # they exit on their own, and whatever has not is ended here, and waited for (briefly), so that nothing of
        # it is still running when the actor has stopped.
        deadline = time.monotonic() + 5.0
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(self.proc.pid, signal.SIGKILL)
            while time.monotonic() < deadline:
                time.sleep(0.05)
                os.killpg(self.proc.pid, 0)  # ProcessLookupError once the group is empty
