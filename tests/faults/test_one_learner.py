"""One learner per run, for real: `grpo learner` processes and a `grpo actor` on a real redis-server.

A second learner started on a live run exits 4 (``learner.if_held=exit``) or waits (``wait``), writing nothing of the
run either way, and the first finishes with the accounting balanced. A learner frozen (SIGSTOP) past its lease while
a second one takes the run over wakes up, has every write refused, exits 5, and leaves nothing that the resume path,
a pruner or `grpo export` would use, no row of metrics.jsonl either; the run finishes with nothing unexplained and
versions that never go back. With weights over NCCL the freeze comes after the frozen learner's broadcast and before
its announcement, which a proxy between it and Redis holds back: its actor received bytes that are never
announced, whose version number the successor announces next for weights of its own, and must not serve them."""

from __future__ import annotations

import json
import re
import signal
import subprocess
import sys
import threading
from pathlib import Path

import pytest

from common.children import wait_until
from common.config import RedisConfig
from common.schemas import WeightsAnnouncement
from common.transport import Transport, read_balance
from common.weights import version_token
from learner import fencing
from tests.conftest import REPO
from tests.faults.redis_hold import HoldingProxy
from tests.faults.runs import run_settings

pytestmark = [pytest.mark.faults, pytest.mark.slow]

BATCH = 2


def files(root: Path) -> dict[str, tuple[int, int]]:
    """Every file under ``root`` with its size and modification time: what a learner that writes nothing leaves."""
    return {str(p.relative_to(root)): (p.stat().st_size, p.stat().st_mtime_ns) for p in root.rglob("*") if p.is_file()}


def keys(t: Transport) -> dict[bytes, bytes | None]:
    """Every key of the run, dumped, but the lease and the actors' heartbeats (keys with a TTL, which move with time
    alone: the holder renews one, and a frozen actor's expires)."""
    return {
        k: t.client.dump(k) for k in sorted(t.client.keys("*")) if b":actors:" not in k and b":learner:lease" not in k
    }


class Versions:
    """The announced version, read every 50 ms from a thread: it must never go back."""

    def __init__(self, t: Transport):
        self.t, self.seen, self.stop = t, [-1], threading.Event()
        self.announcements: list[WeightsAnnouncement] = []  # each one seen, once
        self.thread = threading.Thread(target=self._watch, daemon=True)
        self.thread.start()

    def _watch(self) -> None:
        while not self.stop.wait(0.05):
            ann = self.t.latest_weights()
            if ann is not None:
                self.seen.append(ann.version)
                if not self.announcements or self.announcements[-1] != ann:
                    self.announcements.append(ann)

    def now(self) -> int:
        return self.seen[-1]

    def close(self) -> list[int]:
        self.stop.set()
        self.thread.join()
        return self.seen


def rows(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def test_a_second_learner_on_a_live_run_never_trains(demo_model_dir: Path, redis_url: str, tmp_path: Path,
                                                      processes) -> None:  # type: ignore[no-untyped-def]  # fmt: skip
    steps = 10
    run_dir, logs = tmp_path / "run", tmp_path / "logs"
    logs.mkdir()
    args = run_settings(redis_url, demo_model_dir, run_dir, "one", steps, BATCH, "checkpoint.every=2",
                        "run.lease_ttl_s=60", "learner.min_step_s=1.5")  # fmt: skip
    t = Transport(RedisConfig(url=redis_url), "one")
    first = processes.grpo("learner", *args, log=logs / "first.log")
    actor = processes.grpo("actor", *args, log=logs / "actor.log")
    assert wait_until(lambda: (a := t.latest_weights()) is not None and a.version >= 2, 240), _tail(logs)

    # The first learner and the actor frozen for a moment, so that only the second learner could change anything: it
    # exits 4, in one line naming the holder, and the run (its directory, every key in Redis) is as it was.
    for p in (first, actor):
        p.send_signal(signal.SIGSTOP)
    try:
        before, redis_before = files(run_dir), keys(t)
        second = processes.grpo("learner", *args, "-o", "learner.if_held=exit", log=logs / "second.log")
        assert second.wait(timeout=120) == 4, _tail(logs)
        assert files(run_dir) == before and keys(t) == redis_before
        # A third learner starts while the run is still far from done (its start-up must not outlast the first's
        # steps, or it would find the run finished and never wait).
        third = processes.grpo("learner", *args, log=logs / "third.log")
    finally:
        for p in (first, actor):
            p.send_signal(signal.SIGCONT)
    line = (logs / "second.log").read_text().strip().splitlines()[-1]
    assert line.startswith("grpo learner: run one is held by ") and f"pid {first.pid} (lease token 1)" in line, line

    # The third waits, saying for whom, and writes nothing while it does; the first trains to its last step.
    assert wait_until(lambda: "waiting for run one: held by" in (logs / "third.log").read_text(), 120), _tail(logs)
    assert f"pid {first.pid}" in (logs / "third.log").read_text()
    for p in (first, actor):  # and while it waits, it writes nothing either
        p.send_signal(signal.SIGSTOP)
    try:
        before, redis_before = files(run_dir), keys(t)
        assert not wait_until(lambda: third.poll() is not None, 3)
        assert files(run_dir) == before and keys(t) == redis_before
    finally:
        for p in (first, actor):
            p.send_signal(signal.SIGCONT)
    assert first.wait(timeout=300) == 0, _tail(logs)
    # The first gave the run up as it finished: the third takes it at once, finds every step trained, and ends.
    assert third.wait(timeout=120) == 0, _tail(logs)
    assert "has trained its 10 steps already" in (logs / "third.log").read_text()
    assert actor.wait(timeout=60) == 0, _tail(logs)

    assert [r["step"] for r in rows(run_dir)] == list(range(steps + 1))  # every step once: the first's alone
    b = read_balance(t)
    assert b.unexplained == 0 and b.trained == steps * BATCH, b.equation()


# Weights over NCCL on the CPU: gloo on loopback, every version broadcast but the first and the last (and the actor's
# local engine joins the update group itself).
NCCL = ("weights.transport=nccl", "weights.nccl_backend=gloo", "weights.nccl_address=127.0.0.1",
        "weights.nccl_timeout_s=4", "weights.disk_every=0", "run.log_level=DEBUG")  # fmt: skip
_VERSION_FIELD = re.compile(rb"\$7\r\nversion\r\n\$\d+\r\n(\d+)\r\n")


def nccl_announcement(data: bytes) -> int | None:
    """The version a learner's command announces as sent over NCCL (its fenced write of weights:latest), or None."""
    if b"nccl://" not in data or b"weights:latest" not in data:
        return None
    found = _VERSION_FIELD.search(data)
    return int(found.group(1)) if found else None


def newest_checkpoint(checkpoints: Path) -> int:
    return max((int(p.name[5:]) for p in checkpoints.glob("step-*") if p.name[5:].isdigit()), default=0)


@pytest.mark.parametrize("transport", ["disk", "nccl"])
def test_a_learner_frozen_past_its_lease_is_fenced_when_it_wakes(transport: str, demo_model_dir: Path, redis_url: str,
                                                                  tmp_path: Path, processes) -> None:  # type: ignore[no-untyped-def]  # fmt: skip
    steps, ttl = 16, 3
    run_dir, logs = tmp_path / "run", tmp_path / "logs"
    ckpts = run_dir / "checkpoints"
    logs.mkdir()
    nccl = transport == "nccl"
    # Over NCCL, checkpoints further apart than versions: the frozen learner has announced versions past its last
    # checkpoint, so its successor continues with the next number, the one of the version held back below.
    extra = ("checkpoint.every=4", "learner.min_step_s=1.5", *NCCL) if nccl else ("checkpoint.every=2",)
    args = run_settings(redis_url, demo_model_dir, run_dir, "frozen", steps, BATCH, *extra, f"run.lease_ttl_s={ttl}")
    t = Transport(RedisConfig(url=redis_url), "frozen")
    watcher = Transport(RedisConfig(url=redis_url), "frozen")  # the proxy's thread asks its own connection

    def stageable(data: bytes) -> bool:
        """The frozen learner's announcement of v over NCCL, after its announcement of v - 1 and a checkpoint at
        or below v - 2: its successor resumes there and continues at v (a new epoch), with its own weights."""
        v = nccl_announcement(data)
        ann = watcher.latest_weights() if v is not None and v >= 5 else None
        return ann is not None and v is not None and ann.version == v - 1 and newest_checkpoint(ckpts) <= v - 2

    proxy = HoldingProxy(redis_url, stageable) if nccl else None
    versions = Versions(t)
    held = -1  # the version the frozen learner broadcast and could not announce
    try:
        own = ("-o", f"redis.url={proxy.url}") if proxy is not None else ()
        first = processes.grpo("learner", *args, *own, log=logs / "first.log")
        actor = processes.grpo("actor", *args, log=logs / "actor.log")
        if proxy is None:
            assert wait_until(lambda: versions.now() >= 5, 240), _tail(logs)
            first.send_signal(signal.SIGSTOP)  # frozen mid-run: its lease runs out, its pending groups stay its own
        else:
            while held < 0:  # frozen between its broadcast and its announcement (the checkpoint checked once frozen)
                assert wait_until(proxy.held.is_set, 300), _tail(logs)
                first.send_signal(signal.SIGSTOP)
                v = nccl_announcement(proxy.chunk)
                assert v is not None
                if newest_checkpoint(ckpts) <= v - 2:
                    held = v
                else:
                    first.send_signal(signal.SIGCONT)
                    proxy.release()
        second = processes.grpo("learner", *args, log=logs / "second.log")
        assert wait_until(lambda: (h := t.lease_holder()) is not None and h.token == 2, 120), _tail(logs)
        if proxy is not None:
            proxy.cut()  # its announcement never reaches Redis; woken, it sends it again, and is refused
        took_at = versions.now()
        assert wait_until(lambda: versions.now() >= took_at + 4, 240), _tail(logs)  # the second trains on
        first.send_signal(signal.SIGCONT)
        assert first.wait(timeout=60) == 5, _tail(logs)
        assert second.wait(timeout=300) == 0, _tail(logs)
        assert actor.wait(timeout=60) == 0, _tail(logs)
    finally:
        first.send_signal(signal.SIGCONT)
        seen = versions.close()
        if proxy is not None:
            proxy.close()
        watcher.close()
    assert seen == sorted(seen), "a version went back"
    text = {p.stem: p.read_text() for p in logs.glob("*.log")}
    resumed = int(re.findall(r"resumed from \S+: step (\d+)", text["second"])[0])

    if nccl:
        # The successor's first version (a new epoch, from disk) has the number of the bytes the frozen learner sent
        # and never announced. The actor loaded it: it did not take those bytes for it.
        first_epoch = versions.announcements[0].epoch
        successors = [a for a in versions.announcements if a.epoch > first_epoch]
        assert successors and successors[0].version == held and successors[0].format == "hf-safetensors", (
            held, versions.announcements)  # fmt: skip
        assert f"loaded weights v{held} " in text["actor"], _tail(logs)
        assert f"weights v{held} arrived over NCCL" in text["actor"], _tail(logs)
        assert "over NCCL in" in text["actor"]  # (versions did go over NCCL, before and after)

    out = (logs / "first.log").read_text()
    assert "grpo learner: stopped: this learner no longer holds the run" in out, out[-3000:]
    # Nothing the first wrote after the second took over is used: no checkpoint or version of its token counts.
    ckpts = run_dir / "checkpoints"
    superseded_step, superseded_version = fencing.superseded_steps(ckpts), fencing.superseded_versions(ckpts)
    for path in ckpts.glob("step-*"):
        token = json.loads((path / "state.json").read_text())["lease_token"]
        assert token == 2 or not superseded_step(token, int(path.name[5:])), path
    for path in (run_dir / "weights").glob("v*"):
        assert not superseded_version(version_token(path), int(path.name[1:])), path
    assert json.loads((ckpts / f"step-{steps:06d}" / "state.json").read_text())["lease_token"] == 2

    b = read_balance(t)
    assert b.unexplained == 0 and b.trained == steps * BATCH, b.equation()
    # metrics.jsonl: each step once, the first's rows up to the checkpoint the second resumed from, the second's after
    got = rows(run_dir)
    assert [r["step"] for r in got] == list(range(steps + 1))
    assert [r["lease_token"] for r in got] == [1 if r["step"] <= resumed else 2 for r in got]

    # `grpo export` of the run exports the successor's last version, the one announced.
    last = t.latest_weights()
    assert last is not None and version_token(Path(last.uri)) == 2
    exported = tmp_path / "exported"
    done = subprocess.run([sys.executable, "-m", "common.cli", "export", str(run_dir), str(exported)], cwd=REPO,
                          capture_output=True, text=True, timeout=300)  # fmt: skip
    assert done.returncode == 0, done.stderr
    assert (exported / "model.safetensors").read_bytes() == (Path(last.uri) / "model.safetensors").read_bytes()
    t.close()


def test_steps_longer_than_the_lease_keep_it(demo_model_dir: Path, redis_url: str, tmp_path: Path,
                                             processes) -> None:  # type: ignore[no-untyped-def]  # fmt: skip
    """A thread renews the lease every third of run.lease_ttl_s: steps of 3 s under a lease of 1 s never lose it."""
    run_dir, logs = tmp_path / "run", tmp_path / "logs"
    logs.mkdir()
    args = run_settings(redis_url, demo_model_dir, run_dir, "long", 3, BATCH, "run.lease_ttl_s=1",
                        "learner.min_step_s=3")  # fmt: skip
    t = Transport(RedisConfig(url=redis_url), "long")
    learner = processes.grpo("learner", *args, log=logs / "learner.log")
    actor = processes.grpo("actor", *args, log=logs / "actor.log")
    assert learner.wait(timeout=240) == 0, _tail(logs)
    assert actor.wait(timeout=60) == 0, _tail(logs)
    out = (logs / "learner.log").read_text()
    assert "holding run long with lease token 1" in out and "had lapsed" not in out, out[-3000:]
    assert t.lease_holder() is None  # given up at the end: a next learner need not wait
    assert rows(run_dir)[-1]["step"] == 3


def _tail(logs: Path) -> str:
    return "\n".join(f"== {p.name}\n" + p.read_text()[-3000:] for p in sorted(logs.iterdir()))
