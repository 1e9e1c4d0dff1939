"""`docker compose up`, for real: the CPU stack as the README builds and runs it, on a real Docker engine.

The images are built offline (``scripts/build-images.sh --offline``: a Debian base from Debian's archive, Python
packages from a wheelhouse), then the stack comes up with ``--scale actor=2`` on a short run and is checked from
outside the containers: the learner steps, both actors produce groups, Prometheus scrapes the learner and both actors
and has loaded the alert rules, ``grpo status`` balances while the learner runs and after it has exited, a
``docker compose restart learner`` resumes from a checkpoint, and ``docker compose down -v`` leaves no container,
volume or network. Nothing is pulled from a registry (``--pull never``; every image is built here); the test talks to
loopback and the stack's own network only. The stack has a project name of its own, so a stack of the user's is
never touched.
"""

from __future__ import annotations

import json
import os
import re
import secrets
import subprocess
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest
import yaml

from common.children import wait_until
from common.ports import free_port
from tests.compose.conftest import run_script, skip_or_fail

# The first test to run builds the images (the module's stack): minutes on a fresh machine, whichever test it is.
pytestmark = [pytest.mark.compose, pytest.mark.e2e, pytest.mark.slow, pytest.mark.timeout(3000)]

REPO = Path(__file__).resolve().parents[2]
STEPS = 60
# A step of at least a second (learner.min_step_s): the run lasts long enough for Prometheus to find every
# replica (its DNS refresh is 15 s) and for the restart to land mid-run.
SHORT_RUN = f"""
services:
  learner:
    command: [grpo, learner, --config, /app/configs/compose.yaml, -o, metrics.port=9400, -o, run.steps={STEPS},
              -o, learner.min_step_s=1.0, -o, learner.eval_every=30]
"""


class Stack:
    """One compose project: ``docker compose`` with its env file, its files and its project name."""

    def __init__(self, tmp: Path):
        self.tmp = tmp
        self.project = f"grpo-test-{secrets.token_hex(4)}"
        self.env_file = tmp / "env"
        self.prometheus_port = free_port()
        self.times: dict[str, float] = {}
        settings = {
            "REDIS_PASSWORD": secrets.token_urlsafe(24),
            "GRPO_RUN_NAME": "ci",
            "GRPO_IMAGE_TAG": "compose-test",  # never the user's :latest
            "PROMETHEUS_PORT": str(self.prometheus_port),
            "GRPO_MODELS_DIR": str(tmp / "models"),  # bind mounts Docker would otherwise create in the clone
            "GRPO_DATA_DIR": str(tmp / "data"),
        }
        (tmp / "models").mkdir()
        (tmp / "data").mkdir()
        lines = (REPO / ".env.example").read_text().splitlines()
        lines = [f"{k}={settings.pop(k)}" if (k := line.partition("=")[0]) in settings else line for line in lines]
        self.env_file.write_text("\n".join([*lines, *(f"{k}={v}" for k, v in settings.items())]) + "\n")
        self.override = tmp / "short-run.yml"
        self.override.write_text(SHORT_RUN)

    def compose(
        self, *args: str, timeout: float = 300, check: bool = True, gpu: bool = False
    ) -> subprocess.CompletedProcess:
        files = [REPO / "docker-compose.yml", REPO / ("docker-compose.gpu.yml" if gpu else self.override)]
        cmd = ["docker", "compose", "--env-file", str(self.env_file), "-p", self.project,
               *(a for f in files for a in ("-f", str(f))), *args]  # fmt: skip
        done = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, cwd=REPO, env=compose_env())
        if check:
            assert done.returncode == 0, f"{' '.join(args)}: {done.stdout}{done.stderr}"
        return done

    def timed(self, phase: str, started: float) -> None:
        self.times[phase] = round(time.perf_counter() - started, 1)

    def logs(self, service: str) -> str:
        return self.compose("logs", "--no-color", "--no-log-prefix", service).stdout

    def states(self, service: str) -> list[dict]:
        out = self.compose("ps", "-a", "--format", "json", service).stdout
        rows = [json.loads(line) for line in out.splitlines() if line.strip()]
        return [r for row in rows for r in (row if isinstance(row, list) else [row])]

    def prometheus(self, path: str) -> dict:
        """A query's data; empty while Prometheus does not answer yet (the checks wait for what they need)."""
        url = f"http://127.0.0.1:{self.prometheus_port}{path}"
        try:
            reply = json.loads(urllib.request.urlopen(url, timeout=10).read())
        except OSError:
            return {}
        assert reply["status"] == "success", reply
        return dict(reply["data"])

    def leftovers(self) -> dict[str, list[str]]:
        label = f"label=com.docker.compose.project={self.project}"
        found = {}
        for kind, command in (
            ("containers", ["ps", "-a"]),
            ("volumes", ["volume", "ls"]),
            ("networks", ["network", "ls"]),
        ):
            out = subprocess.run(["docker", *command, "-q", "--filter", label], capture_output=True, text=True).stdout
            found[kind] = out.split()
        return found


def compose_env() -> dict[str, str]:
    """This process's environment without what would win over the stack's env file: compose's own settings
    (COMPOSE_FILE, COMPOSE_PROFILES, ...) and any variable .env.example names, which a shell may have exported."""
    named = set(re.findall(r"^#? ?([A-Z][A-Z0-9_]+)=", (REPO / ".env.example").read_text(), re.M))
    return {k: v for k, v in os.environ.items() if not k.startswith("COMPOSE_") and k not in named}


@pytest.fixture(scope="module")
def stack(docker_engine: None, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    s = Stack(tmp_path_factory.mktemp("compose"))
    t0 = time.perf_counter()
    built = run_script([str(REPO / "scripts" / "build-images.sh"), "--offline", "--env-file", str(s.env_file)], 1800)
    if built.returncode == 2:  # what an offline build needs is not here (its one line says what)
        skip_or_fail("scripts/build-images.sh --offline", built)
    assert built.returncode == 0, built.stdout[-3000:] + built.stderr[-3000:]
    s.timed("build offline", t0)
    try:
        yield s
    finally:  # whatever happened: nothing of the project stays
        s.compose("down", "-v", "--remove-orphans", "--timeout", "30", check=False, timeout=300)
        print("compose phases (s):", s.times)


def learner_step(logs: str) -> int:
    steps = re.findall(r"learner: step +(\d+)/\d+ ", logs)
    return int(steps[-1]) if steps else 0


def rule_count() -> int:
    groups = yaml.safe_load((REPO / "deploy" / "prometheus" / "alerts.yml").read_text())["groups"]
    return sum(len(g["rules"]) for g in groups)


def test_the_gpu_override_merges_as_the_deploy_tests_assume(stack: Stack) -> None:
    """tests/unit/test_deploy.py reads the GPU deployment by merging the two files itself; here docker compose
    merges them, and the parts those tests pin come out the same (no GPU is needed to read a config)."""
    from tests.unit.test_deploy import gpu_compose

    real = json.loads(stack.compose("config", "--format", "json", gpu=True).stdout)["services"]
    assumed = gpu_compose()["services"]
    for role in ("learner", "actor"):
        (device,) = real[role]["deploy"]["resources"]["reservations"]["devices"]
        assert device["driver"] == "nvidia" and device["capabilities"] == ["gpu"] and int(device["count"]) == 1
        default = "${GRPO_CONFIG:-configs/compose-gpu.yaml}"
        assert real[role]["command"] == [
            a.replace(default, "configs/compose-gpu.yaml") for a in assumed[role]["command"]
        ]
        assert real[role]["healthcheck"]["test"] == assumed[role]["healthcheck"]["test"]  # kept, not replaced
    assert real["actor"]["ipc"] == "host" and real["actor"]["build"]["dockerfile"].endswith("docker/actor.Dockerfile")
    assert real["actor"]["image"].startswith("grpo-pipeline-actor:")
    assert real["learner"]["build"]["args"]["TORCH_IMAGE"].startswith("pytorch/pytorch:")
    assert real["learner"]["build"]["args"]["PIP_OFFLINE"] == ""  # the env file says 1: the GPU build ignores it
    assert set(real["learner"]["build"]["args"]) == set(assumed["learner"]["build"]["args"])


def debian(script: str, *args: str) -> str:
    """A bash script that has sourced scripts/lib/debian.sh, in the clone: the apt state the build used."""
    done = subprocess.run(["bash", "-c", f"set -euo pipefail; source scripts/lib/debian.sh; {script}", "debian", *args],
                          cwd=REPO, capture_output=True, text=True, timeout=120)  # fmt: skip
    assert done.returncode == 0, done.stdout + done.stderr
    return done.stdout


def candidate(package: str) -> str:
    """The newest version of a package in bookworm and its updates, as the build's package lists have it."""
    policy = debian('apt-get() { apt-cache "$@"; }; debian_apt bookworm policy "$1"', package)
    return re.findall(r"Candidate: (\S+)", policy)[0]


def test_the_images_carry_debians_updates_whatever_this_machine_has_installed(stack: Stack) -> None:
    """The base is bookworm upgraded from bookworm-updates and bookworm-security: no package in it has a newer
    version in the lists the build fetched (build/apt-bookworm, an apt state of the build's own that never reads this
    machine's dpkg status); Redis's and Prometheus's images name their packages' Debian versions, the newest there."""
    settings = dict(line.split("=", 1) for line in stack.env_file.read_text().splitlines() if "=" in line)
    base = settings["PYTHON_IMAGE"]

    def labels(image: str) -> dict[str, str]:
        out = subprocess.run(["docker", "image", "inspect", "-f", "{{json .Config.Labels}}", image],
                             capture_output=True, text=True, check=True).stdout  # fmt: skip
        return dict(json.loads(out) or {})

    assert labels(base)["grpo-offline.debian-suites"] == "bookworm bookworm-updates bookworm-security"

    def read(image: str, path: str) -> str:
        cat = ["docker", "run", "--rm", "--network", "none", "--entrypoint", "cat", image, path]
        return subprocess.run(cat, capture_output=True, text=True, check=True).stdout

    status = stack.tmp / "base-status"
    status.write_text(read(base, "/var/lib/dpkg/status"))
    assert debian('debian_upgradable bookworm "$1"', str(status)) == "", "the base lacks Debian's updates"
    sources = read(base, "/etc/apt/sources.list")
    assert [line.split()[2] for line in sources.splitlines()] == ["bookworm", "bookworm-updates", "bookworm-security"]
    assert labels(settings["REDIS_IMAGE"])["grpo-offline.debian-version"] == candidate("redis-server")
    assert labels(settings["PROMETHEUS_IMAGE"])["grpo-offline.debian-version"] == candidate("prometheus")
    # Every package Prometheus's pages need, as the archive has it now (its security updates included).
    newest = debian('debian_apt bookworm download --print-uris "$@"', "prometheus", "fonts-glyphicons-halflings")
    have = {p.name for p in (REPO / "build" / "offline" / "prometheus").glob("*.deb")}
    assert {line.split()[1] for line in newest.splitlines()} <= have, (newest, have)


def test_the_cpu_stack_trains_scales_is_scraped_resumes_and_leaves_nothing(stack: Stack) -> None:
    images = stack.compose("config", "--images").stdout.split()
    missing = [i for i in images if subprocess.run(["docker", "image", "inspect", i], capture_output=True).returncode]
    assert not missing, f"not built here (the test pulls nothing): {missing}"

    t0 = time.perf_counter()
    stack.compose("up", "-d", "--pull", "never", "--scale", "actor=2", timeout=900)
    stack.timed("up (demo model built)", t0)
    assert wait_until(lambda: learner_step(stack.logs("learner")) >= 3, 300, 2), stack.logs("learner")
    stack.timed("first steps", t0)

    # Prometheus finds the learner and both actors through Docker's DNS, and loads the alert rules.
    def targets_up() -> list[tuple[str, str]]:
        active = stack.prometheus("/api/v1/targets").get("activeTargets", [])
        return sorted((t["labels"]["job"], t["health"]) for t in active)

    want = [("grpo-actor", "up"), ("grpo-actor", "up"), ("grpo-learner", "up")]
    assert wait_until(lambda: targets_up() == want, 120, 2), targets_up()

    def rules() -> list[dict]:
        return [r for g in stack.prometheus("/api/v1/rules").get("groups", []) for r in g["rules"]]

    # Loaded, and evaluated without error (a rule's health is "unknown" until its first evaluation).
    assert wait_until(lambda: len(rules()) == rule_count() and {r["health"] for r in rules()} == {"ok"}, 60, 2), rules()

    # Both actors produce groups: Prometheus has a positive count from each replica.
    def producing() -> list[float]:
        series = stack.prometheus("/api/v1/query?query=sum%20by%20(instance)%20(grpo_actor_groups_produced_total)")
        return [float(s["value"][1]) for s in series.get("result", [])]

    assert wait_until(lambda: len(producing()) == 2 and min(producing()) > 0, 90, 2), producing()
    stack.timed("scraped", t0)

    # grpo status inside the running learner: the accounting balances mid-run.
    status = stack.compose("exec", "-T", "learner", "grpo", "status", timeout=120)
    assert "(balanced)" in status.stdout, status.stdout
    assert learner_step(stack.logs("learner")) < STEPS, "the run ended before the restart: raise STEPS"

    # A restart resumes from the learner's checkpoint (every step by default), not from step 0.
    stack.compose("restart", "learner", timeout=300)
    resumed = re.compile(r"resumed from \S+: step (\d+), policy version \d+")
    assert wait_until(lambda: resumed.search(stack.logs("learner")), 120, 1), stack.logs("learner")
    step = int(resumed.findall(stack.logs("learner"))[-1])
    assert step > 0, stack.logs("learner")
    stack.timed("restarted", t0)

    # The run ends by itself: the learner exits 0 after its last step, the actors when they see it done.
    def exited(service: str) -> list[int]:
        return [int(r["ExitCode"]) for r in stack.states(service) if r["State"] == "exited"]

    assert wait_until(lambda: exited("learner") == [0], 600, 2), stack.logs("learner")[-3000:]
    assert f"learner: step {STEPS:>4}/{STEPS}" in stack.logs("learner")
    assert wait_until(lambda: exited("actor") == [0, 0], 180, 2), stack.logs("actor")[-3000:]
    stack.timed("finished", t0)

    # After the learner has gone: grpo status in a one-off container of its image, and the same balance.
    after = stack.compose("run", "--rm", "--no-deps", "learner", "grpo", "status", timeout=180)
    assert "(balanced)" in after.stdout and "learner finished: yes" in after.stdout, after.stdout
    assert re.search(r"trained \d+ ", after.stdout), after.stdout

    # down -v: no container, volume or network of the project is left.
    t1 = time.perf_counter()
    stack.compose("down", "-v", timeout=300)
    stack.timed("down -v", t1)
    assert stack.leftovers() == {"containers": [], "volumes": [], "networks": []}
