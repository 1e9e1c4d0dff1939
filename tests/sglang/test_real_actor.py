"""Real `grpo actor` and `grpo run` processes with real SGLang servers they launch themselves."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from common.children import wait_until
from common.config import RedisConfig
from common.schemas import decode_group
from common.transport import Transport
from common.weights import publish
from tests.conftest import REPO, pid_alive
from tests.integration.test_actor_process import actor_args

pytestmark = [pytest.mark.sglang, pytest.mark.slow, pytest.mark.integration]


def group_members(pgid: int) -> list[int]:
    """Processes of a process group still running (an exited one that is not reaped yet is not)."""
    out = subprocess.run(["ps", "-o", "pid=,stat=", "-g", str(pgid)], capture_output=True, text=True).stdout
    return [int(pid) for pid, stat in (line.split() for line in out.splitlines()) if not stat.startswith("Z")]


def test_groups_are_stamped_and_a_killed_server_ends_the_actor_in_one_line(
    demo_model_dir: Path, redis_url: str, tmp_path: Path, processes, sglang_python: str
) -> None:  # type: ignore[no-untyped-def]
    t = Transport(RedisConfig(url=redis_url), "it")
    log = tmp_path / "actor.log"
    args = actor_args(demo_model_dir, tmp_path, redis_url, "-o", "actor.engine=sglang",
                      "-o", f"sglang.python={sglang_python}", "-o", "actor.filter_zero_std=false")  # fmt: skip
    proc = processes.grpo(*args, log=log)
    assert wait_until(lambda: t.stream_length() >= 4, 300), log.read_text()
    server = json.loads((tmp_path / "endpoints.d" / "sglang-actor-it.json").read_text())
    assert server["role"] == "sglang" and pid_alive(server["pid"])

    # a new version: loaded into the real server, and the groups sampled with it say so
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(demo_model_dir)
    tok = AutoTokenizer.from_pretrained(demo_model_dir)
    t.announce_weights(publish(model, tok, tmp_path / "weights", 3, 2).announcement)  # inside the actor's weights.dir
    cleared = t.client.xlen(t.keys.groups)
    t.client.delete(t.keys.groups)  # room for the actor (backpressure): these groups are accounted for here

    def versions() -> list[int]:
        return [decode_group(f[b"data"]).policy_version for _, f in t.client.xrange(t.keys.groups)]

    assert wait_until(lambda: 3 in versions(), 120), log.read_text()
    seen = versions()
    assert set(seen) <= {0, 3} and 0 not in seen[seen.index(3) :]

    # SIGKILL to the server: the actor says so in one line and exits 1 for its supervisor; what it sent is all there
    os.kill(server["pid"], signal.SIGKILL)
    assert proc.wait(timeout=120) == 1
    errors = [line for line in log.read_text().splitlines() if " ERROR " in line or "Traceback" in line]
    assert len(errors) == 1 and f"the SGLang server (pid {server['pid']}) is gone (killed by SIGKILL)" in errors[0]
    # every group counted as produced is in the stream: the round the kill interrupted was never half-sent
    assert int(t.client.hget(t.keys.stats, "groups_produced") or 0) == cleared + t.client.xlen(t.keys.groups)
    assert wait_until(lambda: not group_members(server["pid"]), 30), "SGLang's own processes outlived it"


def test_grpo_run_with_real_servers_lists_them_and_leaves_nothing_running(
    demo_model_dir: Path, tmp_path: Path, sglang_python: str
) -> None:
    run_dir = tmp_path / "run"
    cmd = [sys.executable, "-m", "common.cli", "run", "--plain", "-o", "actor.engine=sglang",
           "-o", f"sglang.python={sglang_python}", "-o", "run.steps=3", "-o", "run.actors=1",
           "-o", f"run.dir={run_dir}", "-o", "learner.eval_every=1000"]  # fmt: skip
    done = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    endpoints = json.loads((run_dir / "endpoints.json").read_text())
    assert sorted(e["role"] for e in endpoints) == ["actor", "learner", "sglang"]
    server = next(e for e in endpoints if e["role"] == "sglang")
    assert server["name"] == "actor-1" and server["url"].startswith("http://127.0.0.1:")
    assert not pid_alive(server["pid"]) and not group_members(server["pid"])
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["steps"] == 3 and summary["unexplained"] == 0


def test_b6_measures_both_engines_on_the_same_rounds(tmp_path: Path, sglang_python: str) -> None:
    out = tmp_path / "b6.json"
    env = {**os.environ, "GRPO_SGLANG_PYTHON": sglang_python}
    cmd = [sys.executable, str(REPO / "benchmarks" / "engines.py"), "--quick", "--out", str(out)]
    done = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=600, env=env)
    assert done.returncode == 0, done.stderr[-3000:]
    result = json.loads(out.read_text())
    assert result["machine"]["cpu"] and result["machine"]["cores"] >= 1
    (c,) = result["cases"]
    per_round = c["prompts_per_round"] * c["group_size"]
    assert c["sglang_startup_s"] > 0 and c["trials"] == 2
    measured = [c["local"], *c["sglang"]]
    assert [m["in_flight"] for m in measured] == [1, 1, 4]  # the local engine generates one round at a time
    for m in measured:
        assert len(m["trials"]) == c["trials"]
        for t in m["trials"]:  # every completion of every round in flight, once
            assert t["completions"] == m["in_flight"] * per_round and t["seconds"] > 0
        rates = sorted(t["completions"] / t["seconds"] for t in m["trials"])
        assert m["completions_per_s"] == {"median": pytest.approx(sum(rates) / 2), "min": rates[0], "max": rates[-1]}
        assert 1 <= m["mean_tokens"] <= c["max_new_tokens"]
    for m in c["sglang"]:
        ratio = m["completions_per_s"]["median"] / c["local"]["completions_per_s"]["median"]
        assert c["completions_per_s_ratio"][str(m["in_flight"])] == pytest.approx(ratio)
