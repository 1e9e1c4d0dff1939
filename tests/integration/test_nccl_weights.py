"""``weights.transport: nccl`` with real parts: the learner's broadcast thread (learner/nccl_weights.py) in this
process, real `grpo actor` processes driving SGLang stand-ins (tests/sglang_standin.py, each its own process, joining
the update group over gloo as SGLang's workers join it), a real Redis in between. Versions reach every member bit for
bit; the group follows the members as they come and go; a member that is not ready in time sends the version to
disk instead, and nobody hangs. A version broadcast but never announced (its learner lost the run after its "go"),
or whose number a successor announced from disk, is never served; and a broadcast thread whose learner lost the run
writes nothing more."""

from __future__ import annotations

import json
import signal
import sys
import threading
import urllib.request
from pathlib import Path
from typing import Any

import pytest
import torch
from prometheus_client import CollectorRegistry

from common.children import wait_until
from common.config import Config, RedisConfig
from common.metrics import LearnerMetrics
from common.model.loading import load_pretrained
from common.ports import free_port
from common.schemas import LeaseHolder, NcclRound, WeightsAnnouncement
from common.transport import LeaseLost, Transport
from common.weights import publish, tensors_digest
from common.weights.nccl import announcement_uri, flatten, plan_buckets
from learner.nccl_weights import Broadcaster, Snapshot, snapshot
from tests.integration.test_actor_process import actor_args

pytestmark = [pytest.mark.integration, pytest.mark.slow]

TIMEOUT_S = 4.0
NCCL = ["-o", "weights.transport=nccl", "-o", "weights.nccl_backend=gloo", "-o", "weights.nccl_address=127.0.0.1",
        "-o", f"weights.nccl_timeout_s={TIMEOUT_S}", "-o", "run.heartbeat_ttl_s=2", "-o", "sampling.group_size=4",
        "-o", "sampling.max_new_tokens=4"]  # fmt: skip


def post(url: str, path: str, body: Any) -> Any:
    req = urllib.request.Request(url + path, json.dumps(body).encode(), {"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=30) as resp:
        return json.loads(resp.read())


def served(url: str, name: str) -> torch.Tensor:
    return torch.tensor(post(url, "/get_weights_by_name", {"name": name, "truncate_size": 10**6}))


def version(url: str) -> str:
    with urllib.request.urlopen(url + "/model_info", timeout=30) as resp:
        return str(json.loads(resp.read())["weight_version"])


class Recorder:
    """The learner's callbacks: what went to disk, what was received over NCCL and announced in Redis as the
    learner announces it (members take a version into service only then), except the versions ``withheld``."""

    def __init__(self, t: Transport, withheld: tuple[int, ...] = ()) -> None:
        self.t = t
        self.withheld = set(withheld)
        self.disk: list[int] = []
        self.nccl: list[int] = []

    def to_disk(self, v: int, snap: Snapshot) -> None:
        self.disk.append(v)

    def announce(self, v: int, snap: Snapshot, rnd: NcclRound) -> None:
        self.nccl.append(v)
        if v not in self.withheld:
            digest = tensors_digest(snap.flats, "xxh3-128")[0]
            self.t.announce_weights(WeightsAnnouncement(v, announcement_uri(rnd), digest, format="nccl"))


def test_versions_reach_every_member_the_group_follows_members_and_a_laggard_sends_them_to_disk(  # type: ignore[no-untyped-def]
    tiny_model_dir: Path, redis_url: str, tmp_path: Path, processes
) -> None:
    cfg = Config.model_validate({
        "run": {"name": "it", "heartbeat_ttl_s": 2},
        "weights": {"transport": "nccl", "nccl_backend": "gloo", "nccl_address": "127.0.0.1",
                    "nccl_timeout_s": TIMEOUT_S, "nccl_bucket_mb": 0.05},
    })  # fmt: skip
    t = Transport(RedisConfig(url=redis_url), "it")
    registry = CollectorRegistry()
    rec = Recorder(t)
    b = Broadcaster(cfg, t, LearnerMetrics(registry), to_disk=rec.to_disk, announce_nccl=rec.announce)
    _, model = load_pretrained(str(tiny_model_dir), "float32", "cpu")

    def start_member(name: str) -> tuple[str, Any]:
        port = free_port()
        processes.start([sys.executable, "-m", "tests.sglang_standin", "--model-path", str(tiny_model_dir),
                         "--port", str(port)], tmp_path / f"sglang-{name}.log")  # fmt: skip
        url = f"http://127.0.0.1:{port}"
        args = actor_args(tiny_model_dir, tmp_path, redis_url, "-o", f"actor.id={name}", "-o", "actor.engine=sglang",
                          "-o", f"sglang.url={url}", *NCCL)  # fmt: skip
        return url, processes.grpo(*args, log=tmp_path / f"{name}.log")

    def new_version(v: int) -> Snapshot:
        with torch.no_grad():
            for p in model.parameters():
                p.add_(0.01 * v)
        return snapshot(model, None, "model", int(0.05 * 2**20))

    def logs() -> str:
        codes = [f"{' '.join(map(str, p.args[-4:]))}: exit {p.poll()}" for p in processes.procs]
        return "\n".join([*codes, *(p.read_text()[-3000:] for p in sorted(tmp_path.glob("*.log")))])

    def delivered(v: int, urls: list[str], snap: Snapshot) -> None:
        assert wait_until(lambda: v in rec.nccl or v in rec.disk, 120), logs()
        assert rec.nccl[-1] == v, (rec.nccl, rec.disk, logs())
        for url in urls:
            # The learner is done once the bytes are sent; a server may still be loading them.
            assert wait_until(lambda: version(url) == str(v), 30), logs()  # noqa: B023
            for name, expected in snap.tensors().items():
                torch.testing.assert_close(served(url, name), expected, rtol=0, atol=0, msg=name)

    try:
        url_a, actor_a = start_member("a")
        assert wait_until(lambda: set(b.members()) == {"a"}, 120), logs()
        v1 = new_version(1)
        b.submit(1, v1)
        delivered(1, [url_a], v1)
        name_1 = b.group.name if b.group else None

        # A second member: the next version forms a new group of both (the first leaves its old group).
        url_b, actor_b = start_member("b")
        assert wait_until(lambda: set(b.members()) == {"a", "b"}, 120), logs()
        v2 = new_version(2)
        b.submit(2, v2)
        delivered(2, [url_a, url_b], v2)
        assert b.group is not None and b.group.name != name_1 and b.group.world_size == 3

        # A member that never becomes ready (registered, then silent): the round is cancelled after the timeout,
        # before anyone entered the new group's rendezvous; the version goes to disk, and the actors that were ready
        # go back to sampling.
        t.nccl_register("ghost", {"ranks": 1, "nonce": "x", "group": None})
        v3 = new_version(3)
        b.submit(3, v3)
        assert wait_until(lambda: rec.disk == [3], 60), logs()
        assert registry.get_sample_value(
            "grpo_learner_weight_broadcast_fallbacks_total", {"reason": "not_ready"}
        ) == 1  # fmt: skip
        assert wait_until(lambda: "the learner cancelled its broadcast" in (tmp_path / "a.log").read_text(), 30)
        assert version(url_a) == "2" and actor_a.poll() is None and actor_b.poll() is None

        # The silent member ages out of the registry; the next version reaches both again, in a new group.
        assert wait_until(lambda: "ghost" not in b.members(), 30)
        v4 = new_version(4)
        b.submit(4, v4)
        delivered(4, [url_a, url_b], v4)

        # A member killed outright: it ages out too, and the one left gets the next version alone.
        actor_b.send_signal(signal.SIGKILL)
        actor_b.wait(timeout=30)
        assert wait_until(lambda: set(b.members()) == {"a"}, 30), logs()
        v5 = new_version(5)
        b.submit(5, v5)
        delivered(5, [url_a], v5)
        assert rec.disk == [3] and rec.nccl == [1, 2, 4, 5]
        a_log = (tmp_path / "a.log").read_text()
        assert "Traceback" not in a_log, a_log

        actor_a.terminate()  # a member that stops leaves the registry at once
        assert actor_a.wait(timeout=60) == 0
        assert "a" not in b.members()
    finally:
        closing = threading.Thread(target=b.close)
        closing.start()
        closing.join(timeout=2 * TIMEOUT_S + 30)
        assert not closing.is_alive(), "the broadcast thread did not stop"
        t.close()


def test_a_version_broadcast_but_never_announced_is_never_served(  # type: ignore[no-untyped-def]
    tiny_model_dir: Path, redis_url: str, tmp_path: Path, processes
) -> None:
    """v2 reaches both members (a SGLang stand-in's actor, and an actor whose local engine joins the group itself)
    and is never announced, as when its learner lost the run after its "go": neither serves it (the local engine
    samples on with v1, the SGLang actor, whose server took the bytes, samples nothing). Then a successor announces
    its own v2, from disk: both load that one, though its number is the one they received."""
    cfg = Config.model_validate({
        "run": {"name": "it", "heartbeat_ttl_s": 2},
        "weights": {"transport": "nccl", "nccl_backend": "gloo", "nccl_address": "127.0.0.1",
                    "nccl_timeout_s": TIMEOUT_S, "nccl_bucket_mb": 0.05},
    })  # fmt: skip
    t = Transport(RedisConfig(url=redis_url), "it")
    rec = Recorder(t, withheld=(2,))
    b = Broadcaster(cfg, t, LearnerMetrics(CollectorRegistry()), to_disk=rec.to_disk, announce_nccl=rec.announce)
    tokenizer, model = load_pretrained(str(tiny_model_dir), "float32", "cpu")
    port = free_port()
    processes.start([sys.executable, "-m", "tests.sglang_standin", "--model-path", str(tiny_model_dir), "--port",
                     str(port)], tmp_path / "sglang.log")  # fmt: skip
    url = f"http://127.0.0.1:{port}"
    common = ["-o", "run.log_level=DEBUG", *NCCL]
    processes.grpo(*actor_args(tiny_model_dir, tmp_path, redis_url, "-o", "actor.id=s", "-o", "actor.engine=sglang",
                               "-o", f"sglang.url={url}", *common), log=tmp_path / "s.log")  # fmt: skip
    processes.grpo(*actor_args(tiny_model_dir, tmp_path, redis_url, "-o", "actor.id=l", *common),
                   log=tmp_path / "l.log")  # fmt: skip

    def logs() -> str:
        return "\n".join(f"== {p.name}\n{p.read_text()[-3000:]}" for p in sorted(tmp_path.glob("*.log")))

    def held(actor: str) -> int | None:
        beat = t.live_actors().get(actor)
        return None if beat is None else beat.version

    def shifted(by: float) -> Snapshot:
        with torch.no_grad():
            for p in model.parameters():
                p.add_(by)
        return snapshot(model, None, "model", int(0.05 * 2**20))

    try:
        assert wait_until(lambda: set(b.members()) == {"s", "l"}, 180), logs()
        v1 = shifted(0.01)
        b.submit(1, v1)
        assert wait_until(lambda: held("s") == 1 and held("l") == 1, 120), logs()

        b.submit(2, shifted(0.01))  # broadcast to both, never announced
        assert wait_until(lambda: rec.nccl == [1, 2], 60), logs()
        # Past the bound on the announcement: the local engine samples on with v1 (v2 never touched its model), the
        # SGLang actor, whose server holds v2's bytes, samples nothing.
        assert not wait_until(lambda: held("l") == 2 or held("s") == 2, TIMEOUT_S + 5), logs()
        assert held("l") == 1 and wait_until(lambda: held("s") == -1, 10), logs()
        assert version(url) == "2"
        for actor in ("s", "l"):
            assert "weights v2 arrived over NCCL" in (tmp_path / f"{actor}.log").read_text(), logs()

        # The successor's own v2, written to disk and announced (other weights, the same number): both load it.
        with torch.no_grad():
            for p in model.parameters():
                p.add_(0.5)
        pub = publish(model, tokenizer, tmp_path / "weights", 2, keep=3, dtype="float32")
        t.announce_weights(pub.announcement)
        assert wait_until(lambda: held("s") == 2 and held("l") == 2, 120), logs()
        for actor in ("s", "l"):
            assert "loaded weights v2 " in (tmp_path / f"{actor}.log").read_text(), logs()
        for name, expected in model.state_dict().items():
            if name != "lm_head.weight" or not model.config.tie_word_embeddings:
                torch.testing.assert_close(served(url, name), expected, rtol=0, atol=0, msg=name)
        assert "Traceback" not in logs()
    finally:
        closing = threading.Thread(target=b.close)
        closing.start()
        closing.join(timeout=2 * TIMEOUT_S + 30)
        t.close()


@pytest.mark.parametrize("members", [0, 1], ids=["no member: disk", "a member: a fenced round"])
def test_a_broadcast_thread_whose_learner_lost_the_run_writes_nothing_more(redis_url: str, members: int) -> None:
    """The version would go to disk (no member), or its round is refused by the fence: either way nothing is written
    to disk or announced, the thread stops, and the training loop's next submit raises LeaseLost (exit code 5)."""
    cfg = Config.model_validate({
        "run": {"name": "lost", "heartbeat_ttl_s": 30},
        "weights": {"transport": "nccl", "nccl_backend": "gloo", "nccl_address": "127.0.0.1", "nccl_timeout_s": 2},
    })  # fmt: skip
    old, new = Transport(RedisConfig(url=redis_url), "lost"), Transport(RedisConfig(url=redis_url), "lost")
    assert old.acquire_lease(LeaseHolder(0, "old", "h", 1, 0.0), 30, floor=0) is None
    if members:
        old.nccl_register("a1", {"ranks": 1, "nonce": "x", "group": None})
    rec = Recorder(old)
    b = Broadcaster(cfg, old, LearnerMetrics(CollectorRegistry()), to_disk=rec.to_disk, announce_nccl=rec.announce)
    w = torch.arange(8, dtype=torch.float32)
    snap = Snapshot(plan_buckets([("w", w)], 1024), [flatten([w])])
    try:
        # The old learner was frozen past its lease, and another took the run over.
        new.client.delete(new.keys.lease)
        assert new.acquire_lease(LeaseHolder(0, "new", "h", 2, 0.0), 30, floor=0) is None
        b.submit(1, snap)
        assert wait_until(lambda: b.lost is not None, 30)
        assert rec.disk == [] and rec.nccl == [] and old.latest_weights() is None
        with pytest.raises(LeaseLost):
            b.submit(2, snap)
        b._thread.join(timeout=10)
        assert not b._thread.is_alive()
    finally:
        b.close()
        old.close()
        new.close()
