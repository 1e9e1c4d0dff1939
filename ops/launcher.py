"""The processes of a ``grpo run`` on this machine (:class:`Run`): its directory prepared (and put back when a start
fails), its private Redis, its learner and actors started as children with the resolved config and stopped by PID,
watched until the learner has finished. The command itself is :mod:`ops.run`."""

from __future__ import annotations

import contextlib
import json
import logging
import os
import secrets
import shlex
import signal
import subprocess
import sys
import time
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any
from urllib.parse import urlsplit, urlunsplit

import redis
from pydantic import SecretStr

from common.children import die_with_parent, stop_process
from common.config import Config, mask_url
from common.metrics import gather_endpoints
from common.model.importing import prepare_model_path
from common.transport import Transport

if TYPE_CHECKING:
    from ops.live_view import Startup

log = logging.getLogger("run")

_STARTUP_TIMEOUT_S = 300.0
ACTOR_EXIT_GRACE_S = 15.0


class ChildFailed(RuntimeError):
    def __init__(self, message: str, code: int | None = None, line: str = ""):
        super().__init__(message)
        self.code = code  # the child's exit code, when it exited: 2 is a mistake its log names in one line
        self.line = line  # that line


class Interrupted(Exception):
    """Ctrl-C or SIGTERM, raised from the signal handler so that no wait (building the model, starting children)
    outlives it."""

    def __init__(self, signum: int):
        super().__init__(signal.Signals(signum).name)
        self.signum = signum


@dataclass
class Child:
    role: str
    name: str
    proc: subprocess.Popen
    log_path: Path

    def tail(self, n: int = 15) -> str:
        try:
            with self.log_path.open(errors="replace") as f:
                return "".join(deque(f, maxlen=n))
        except OSError:
            return ""


@dataclass
class Run:
    cfg: Config
    children: list[Child] = field(default_factory=list)
    redis_server: Any = None
    rows: list[dict[str, Any]] = field(default_factory=list)
    started: float = field(default_factory=time.perf_counter)
    _offset: int = 0
    prepared: bool = False  # prepare_dir ran: run.dir is this run's
    _made_dir: bool = False  # this start created run.dir (so a start that fails removes it)
    _kept: Path | None = None  # where prepare_dir moved the previous run (so a start that fails moves it back)
    _watcher: Transport | None = None  # reads what the processes have done so far (startup, sampling_choices)
    _seen: dict[str, Any] = field(default_factory=dict)  # what it read last, and when

    @property
    def run_dir(self) -> Path:
        return Path(self.cfg.run.dir)

    # -- prepare ------------------------------------------------------------------------------------------------

    def prepare_dir(self) -> None:
        """A fresh run directory; a previous run's directory is kept, renamed with its time. Called once every check
        that can fail on the user's input has passed (task, model, Redis), and undone by :meth:`undo_dir` if the
        start fails before any process of the run started."""
        d = self.run_dir
        if d.exists() and any(d.iterdir()):
            stamp = time.strftime("%Y%m%d-%H%M%S", time.localtime(d.stat().st_mtime))
            kept = d.with_name(f"{d.name}.{stamp}")
            n = 1
            while kept.exists():
                kept, n = d.with_name(f"{d.name}.{stamp}-{n}"), n + 1
            d.rename(kept)
            self._kept = kept
            log.info("kept the previous run in %s", kept)
        self._made_dir = not d.exists()
        (d / "logs").mkdir(parents=True, exist_ok=True)
        self.prepared = True

    def undo_dir(self) -> None:
        """After a start that failed before any process of the run started: remove what :meth:`prepare_dir` and the
        start wrote (the empty ``logs/``, ``config.json``; ``redis/`` goes in any case) and put the previous run
        back. Anything else in the directory means something else wrote there: it stays."""
        d = self.run_dir
        if not self.prepared or self.children:
            return
        with contextlib.suppress(OSError):
            (d / "config.json").unlink(missing_ok=True)
            (d / "logs").rmdir()
            if self._made_dir:
                d.rmdir()
        if self._kept is not None and not d.exists():
            self._kept.rename(d)
            log.info("put the previous run back in %s", d)

    def prepare_model(self) -> None:
        if self.cfg.model.path:
            prepare_model_path(self.cfg)  # before any process starts: one line, exit 2
            return
        if self.cfg.env.name == "tool":  # the demo model's tool variant: it writes calls, it does not yet choose to
            from ops.tiny_tool_model import ensure_tiny_tool_model

            self.cfg.model.path = str(ensure_tiny_tool_model(self.cfg.run.seed))
            return
        from ops.tiny_model import ensure_tiny_model  # torch and transformers load only when needed

        # The demo model knows the addition task; under another task it only exercises the machinery.
        eval_size = self.cfg.task.eval_size if self.cfg.task.name == "addition" else 20
        self.cfg.model.path = str(ensure_tiny_model(self.cfg.run.seed, eval_size))

    def check_task(self) -> None:
        """Read the dataset once before any process starts: a wrong path or field is one line and exit 2, not
        a crash in every child."""
        if self.cfg.task.name != "addition":
            from common.tasks import make_task

            task = make_task(self.cfg.task, self.cfg.run.seed)
            log.info("task: %d training prompts, %d held out", len(task.train), len(task.eval))

    def check_env(self) -> None:
        """``env.call_close`` must be one token of the model's tokenizer, and your environment class must import and
        build from ``env.args``: one line and exit 2 here, not in every actor (a model the actors' SGLang servers
        read from their own path is checked there)."""
        if self.cfg.env.name == "single_turn" or not Path(self.cfg.model.path).is_dir():
            return
        from transformers import AutoTokenizer

        from env.environment import call_close_id
        from env.episodes import make_environment

        tokenizer = AutoTokenizer.from_pretrained(self.cfg.model.path)
        if self.cfg.env.name == "tool":
            call_close_id(self.cfg.env, tokenizer)
            return
        env = make_environment(self.cfg.env, tokenizer)  # built once and closed: the actors build their own
        if env is not None:
            env.close()

    def check_redis(self) -> None:
        """An unreachable Redis (or a refused password) is a user's mistake: one line, exit 2 (TransportError), before
        the run directory is touched. The private Redis has nothing to check."""
        if self.cfg.redis.url:
            t = Transport(self.cfg.redis, self.cfg.run.name)
            try:
                t.ping()
            finally:
                t.close()

    def start_redis(self) -> None:
        if not self.cfg.redis.url:
            from ops.redis_server import RedisServer

            # A password of its own: anyone on this machine can reach a loopback port. The children get it through
            # the environment (spawn), the operator from the 0600 file beside the server's data.
            password = secrets.token_urlsafe(32)
            self.redis_server = RedisServer(self.run_dir / "redis", password=password).start()
            self.cfg.redis.url = self.redis_server.url
            self.cfg.redis.password = SecretStr(password)
            # It knows only its default user: an ACL user from the operator's environment (for another Redis) would be
            # refused there.
            self.cfg.redis.username = ""
            log.info(
                "private redis-server (pid %d) at %s, password in %s",
                self.redis_server.proc.pid,
                self.redis_server.url,
                self.redis_server.password_file,
            )
            return
        t = Transport(self.cfg.redis, self.cfg.run.name)
        try:
            t.delete_run()  # a fresh run under this name: old counters would break the accounting
        finally:
            t.close()

    # -- children -----------------------------------------------------------------------------------------------

    def spawn(self, role: str, name: str, overrides: Sequence[str] = ()) -> None:
        env = dict(os.environ)
        # Secrets travel through the environment, never through config.json (which masks them).
        env["GRPO_REDIS_URL"] = self.cfg.redis.url
        if self.cfg.redis.password is not None:
            env["GRPO_REDIS_PASSWORD"] = self.cfg.redis.password.get_secret_value()
        if self.redis_server is not None:
            env.pop("GRPO_REDIS_USERNAME", None)  # the private server knows only its default user (start_redis)
        log_path = self.run_dir / "logs" / f"{name}.log"
        cmd = [sys.executable, "-m", "common.cli", role, "--config", str(self.run_dir / "config.json")]
        for o in overrides:
            cmd += ["-o", o]
        with log_path.open("ab") as out:
            proc = subprocess.Popen(
                cmd, stdout=out, stderr=subprocess.STDOUT, env=env, preexec_fn=die_with_parent, start_new_session=True
            )
        self.children.append(Child(role, name, proc, log_path))

    def start_children(self) -> None:
        self.spawn("learner", "learner")
        for i in range(1, self.cfg.run.actors + 1):
            self.spawn("actor", f"actor-{i}", [f"actor.id=actor-{i}"])

    def actors_to_start(self) -> str:
        """Under ``run.actors=0``: the one line saying what to start, and where: the exact ``grpo actor`` command,
        the password by the path of its file (never the password itself)."""
        q = shlex.quote
        url, name = self.cfg.redis.url, self.cfg.run.name
        actor = f"grpo actor --config {q(str(self.run_dir / 'config.json'))}"
        if self.redis_server is not None:
            return (f"run.actors=0: this runs the learner and a private Redis only; start each actor on this machine "
                    f"(the Redis listens on 127.0.0.1) with: GRPO_REDIS_PASSWORD=\"$(cat "
                    f"{q(str(self.redis_server.password_file))})\" {actor} -o redis.url={q(url)} -o run.name={q(name)} "
                    f"-o actor.id=actor-1 (each actor its own actor.id)")  # fmt: skip
        # config.json holds the URL masked, so the command names it; a password inside it is never printed: the
        # actor gets the URL without it and the password from its environment (redis.password overrides the URL's).
        secret = mask_url(url) != url
        creds = "GRPO_REDIS_PASSWORD set to redis.url's password" if secret else "Redis credentials as for this command"
        return (f"run.actors=0: this runs the learner only; start each actor where Redis at {mask_url(url)} is "
                f"reachable with: {actor} -o redis.url={q(_without_password(url))} -o run.name={q(name)} "
                f"-o actor.id=actor-1 (each actor its own actor.id; {creds})")  # fmt: skip

    def check_children(self) -> bool:
        """True once the learner has finished; raises ChildFailed when any child has died otherwise."""
        learner = next(c for c in self.children if c.role == "learner")
        for child in self.children:  # failures first: a crashed actor is never hidden by the learner's success
            if child.proc.poll() not in (None, 0):
                raise self._failed(child)
        if learner.proc.poll() == 0:
            return True
        early = next((c for c in self.children if c.role == "actor" and c.proc.poll() == 0), None)
        if early is None:
            return False
        # An actor ends by itself once the learner has marked the run done, which may be seen here a moment before
        # the learner's own exit.
        with contextlib.suppress(subprocess.TimeoutExpired):
            learner.proc.wait(timeout=ACTOR_EXIT_GRACE_S)
        if learner.proc.returncode == 0:
            return True
        raise self._failed(learner if learner.proc.returncode is not None else early)

    def _failed(self, child: Child) -> ChildFailed:
        tail = child.tail()
        last = next((line for line in reversed(tail.splitlines()) if line.strip()), "")
        return ChildFailed(
            f"{child.name} (pid {child.proc.pid}) exited with code {child.proc.returncode} before the run finished; "
            f"last lines of {child.log_path}:\n" + tail,
            child.proc.returncode,
            f"{child.name}: {last.strip()}",
        )

    def expected_endpoints(self) -> list[tuple[str, str]]:
        """(role, name) of every endpoint the run waits for: the learner, the actors, and the SGLang server each
        actor launches (actor.engine sglang, no sglang.url)."""
        launched = self.cfg.actor.engine == "sglang" and not self.cfg.sglang.url
        want = [(c.role, c.name) for c in self.children]
        return want + [("sglang", c.name) for c in self.children if launched and c.role == "actor"]

    def wait_for_endpoints(self, waiting: Callable[[], None] = lambda: None) -> list[dict[str, Any]]:
        want = len(self.expected_endpoints())
        deadline = time.monotonic() + _STARTUP_TIMEOUT_S
        while True:
            endpoints = gather_endpoints(self.run_dir)
            if len(endpoints) >= want:
                break
            self.check_children()
            waiting()
            if time.monotonic() > deadline:
                raise ChildFailed(f"only {len(endpoints)} of {want} processes came up in {_STARTUP_TIMEOUT_S:.0f}s")
            time.sleep(0.1)
        tmp = self.run_dir / ".endpoints.json.tmp"
        tmp.write_text(json.dumps(endpoints, indent=2) + "\n")
        os.replace(tmp, self.run_dir / "endpoints.json")
        return endpoints

    def stop_children(self) -> None:
        # Actors first (they exit by themselves once the learner marks the run done), then the learner.
        # An actor may wait up to actor.stop_send_timeout_s for room to send its round whole (the learner, still
        # running, makes it): its grace covers that wait.
        for child in sorted(self.children, key=lambda c: c.role == "learner"):
            grace = self.cfg.actor.stop_send_timeout_s + 10 if child.role == "actor" else 10
            stop_process(child.proc, grace_s=grace, name=child.name)

    def wait_actors(self, timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        for child in self.children:
            if child.role == "actor":
                with contextlib.suppress(subprocess.TimeoutExpired):
                    child.proc.wait(timeout=max(0.0, deadline - time.monotonic()))

    # -- progress -----------------------------------------------------------------------------------------------

    def startup(self) -> Startup:
        """What the run's processes have done so far, before its first step: their endpoint files, the learner's
        step-0 row, and in Redis (read once a second at most) the learner's first announcement, the actors'
        heartbeats and the groups they sent."""
        from ops.live_view import Startup  # rich loads only after the arguments are valid

        up = {(e["role"], e["name"]) for e in gather_endpoints(self.run_dir)}
        missing = [name if role != "sglang" else f"{name}'s SGLang server"
                   for role, name in self.expected_endpoints() if (role, name) not in up]  # fmt: skip
        if time.monotonic() >= self._seen.get("next", 0.0):
            self._seen |= self._read_redis()
            self._seen["next"] = time.monotonic() + 1.0
        return Startup(
            missing=missing,
            started=len(self.expected_endpoints()),
            announced=self._seen.get("announced", False),
            evaluated=any(r.get("step") == 0 for r in self.rows),
            actors=self.cfg.run.actors,
            actors_ready=self._seen.get("actors_ready", 0),
            produced=self._seen.get("produced", 0),
            batch=self.cfg.learner.batch_groups,
        )

    def _read_redis(self) -> dict[str, Any]:
        """One look, no retries and a short timeout: a Redis that does not answer at once is looked at again next
        time (and, if it is gone, the children say so)."""
        t = self._watch()
        try:
            announced, produced = t.started_signs()
            return {"announced": announced, "produced": produced, "actors_ready": len(t.live_actors())}
        except redis.RedisError:
            return {}

    def sampling_choices(self) -> dict[str, int] | None:
        """Difficulty sampling's choices so far (``taken:<pool>``, ``passed:<pool>``), read every 2 s at most;
        None when the run draws by the cursor."""
        if self.cfg.actor.prompt_sampling != "difficulty":
            return None
        if time.monotonic() >= self._seen.get("next_choices", 0.0):
            self._seen["next_choices"] = time.monotonic() + 2.0
            t = self._watch()
            with contextlib.suppress(redis.RedisError):
                self._seen["choices"] = t.sampling_choices()[1]
        return self._seen.get("choices", {})

    def _watch(self) -> Transport:
        if self._watcher is None:
            quick = self.cfg.redis.model_copy(update={"retries": 0, "socket_timeout_s": 3.0})
            self._watcher = Transport(quick, self.cfg.run.name)
        return self._watcher

    def close_watcher(self) -> None:
        if self._watcher is not None:
            self._watcher.close()
            self._watcher = None

    def read_rows(self) -> list[dict[str, Any]]:
        path = self.run_dir / "metrics.jsonl"
        if not path.exists():
            return []
        with path.open() as f:
            f.seek(self._offset)
            chunk = f.read()
        complete = chunk[: chunk.rfind("\n") + 1]
        self._offset += len(complete.encode())
        new = [json.loads(line) for line in complete.splitlines() if line.strip()]
        self.rows.extend(new)
        return new


def _without_password(url: str) -> str:
    """``redis://user:secret@host/0?password=x`` → ``redis://user@host/0``: what may be printed of a URL."""
    parts = urlsplit(url)
    query = "&".join(p for p in parts.query.split("&") if p and not p.lower().startswith("password="))
    userinfo, at, hosts = parts.netloc.rpartition("@")
    netloc = f"{userinfo.split(':', 1)[0]}@{hosts}" if at and userinfo.split(":", 1)[0] else hosts
    return urlunsplit(parts._replace(netloc=netloc, query=query))
