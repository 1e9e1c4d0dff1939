"""The ``sglang`` engine: a client of a SGLang server's native HTTP API (shapes of SGLang 0.5.23).

- ``POST /generate`` with ``input_ids``, every sampling knob explicit (``temperature``, ``top_p`` = 1, ``top_k`` = -1:
  unset ones would come from the model's generation_config.json, and the behaviour log-probs assume plain
  temperature sampling), ``max_new_tokens``, ``stop_token_ids`` and ``return_logprob``. Completions come from
  ``output_ids``, ``meta_info.output_token_logprobs`` and ``meta_info.finish_reason``; the server's
  ``weight_version`` must be the version the group is stamped with.
- ``POST /update_weights_from_disk`` with a published version's directory (checked against its digest first) and our
  version number; ``flush_cache`` so that no prefix-cache entry computed with old weights serves a new request. Sent
  right after a ``/generate`` reply, a real server may answer HTTP 400 "Weights were updated, but the cache was
  not flushed because requests are still running or queued": the weights *are* loaded (and later replies carry the
  new ``weight_version``), so the actor asks ``/flush_cache?timeout=…`` until the server takes it (bounded, logged,
  counted) and then ``/update_weight_version``, which brings ``/model_info`` up to date (it is not, after that 400).
- learner.lora: each version's adapter through ``/load_lora_adapter`` and named by every ``/generate`` request
  (``lora_path``), the one before unloaded (actor.engines.sglang.adapters); the server must have been started
  with LoRA on (checked at start through ``/server_info``), which SGLang does on GPUs only.
- actor.weight_updates in_flight: a version is loaded while requests are generating, between
  ``/pause_generation`` (``in_place`` or ``retract``, from actor.in_flight_kv) and ``/continue_generation``, and each
  sample says which version produced which of its tokens (``meta_info.weight_versions``). Retracted requests leave
  the server idle, so the update flushes the prefix cache as usual; requests paused in place keep their cache, which
  therefore cannot be flushed: instead every request names its version as its prefix-cache namespace
  (``cache_salt``), so that no entry computed with old weights serves a request sent after the update.
- ``GET /health`` for readiness. Requests are retried a bounded number of times on connection errors and 5xx, except
  when the server this actor launched has died: that is said at once.

The server is either given (``sglang.url``) or launched as this process's child (actor.engines.sglang.server), which
dies with the actor. Building requests and reading replies are pure functions, tested on their own.
"""

from __future__ import annotations

import contextlib
import json
import logging
import threading
import time
from collections import Counter
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

from actor.engines.base import Capabilities, EngineError, Updates
from actor.engines.sglang.adapters import adapter_name, already_loaded, launch_args, load_body, load_refusal, uncovered
from actor.engines.sglang.client import SGLangClient
from actor.engines.sglang.nccl import NcclUpdates
from actor.engines.sglang.requests import (
    PAUSE_MODES,
    generate_request,
    loaded_but_not_flushed,
    parse_samples,
    version_number,
)
from actor.engines.sglang.server import LaunchedServer
from actor.engines.sglang.unannounced import Unannounced, reply_names
from common.config import Config
from common.metrics import EngineEvent
from common.rollout import Sample
from common.schemas import WeightsAnnouncement
from common.weights import WeightsError, WeightsMismatch, confined, mismatch, tensor_specs, verify
from common.weights.adapters import base_identity, check_base

log = logging.getLogger(__name__)


# -- the client -------------------------------------------------------------------------------------------------


def _stop_ids(model_path: str, tokenizer: Any) -> set[int]:
    """End-of-sequence ids of the tokenizer and of the model's generation_config.json, as SGLang would stop on."""
    ids: set[int] = set()
    if tokenizer.eos_token_id is not None:
        ids.add(int(tokenizer.eos_token_id))
    config = Path(model_path) / "generation_config.json"
    if config.is_file():
        eos = json.loads(config.read_text()).get("eos_token_id")
        ids.update([eos] if isinstance(eos, int) else eos or [])
    return ids


class SGLangEngine(NcclUpdates):
    def __init__(
        self, cfg: Config, seed: int, *, name: str = "", on_event: Callable[[EngineEvent], None] = lambda _: None
    ):
        from transformers import AutoTokenizer

        self.cfg = cfg
        sc = cfg.sglang
        self.tokenizer = AutoTokenizer.from_pretrained(cfg.model.path)
        self.stop_ids = _stop_ids(cfg.model.path, self.tokenizer)
        self.version = 0
        self.adapter = None
        self._base: dict[str, str] | None = None  # model.path's identity, read at the first LoRA version
        self.on_event = on_event  # engine incidents survived, by kind (grpo_actor_engine_events_total)
        # actor.weight_updates in_flight: versions loaded while requests generate (paused, updated, continued)
        self.pause_mode = PAUSE_MODES[cfg.actor.in_flight_kv] if cfg.actor.weight_updates == "in_flight" else None
        self._adapter_users: Counter[str] = Counter()  # requests generating with each adapter
        self._adapters_lock = threading.Lock()
        self._said_flush = False
        self.unannounced = Unannounced(4 * cfg.weights.nccl_timeout_s)  # broadcast weights not announced yet
        # A real server's scheduler dies on a checkpoint whose shapes differ from its model's (an assertion in its
        # weight loader, then SGLang kills itself): new versions are checked against the served model's first
        # (names, shapes and dtypes, as the local engine checks them).
        self.specs = tensor_specs(cfg.model.path, published=False) if Path(cfg.model.path).is_dir() else {}
        self.server = None if sc.url else LaunchedServer(cfg, name)
        url = sc.url or self.server.url  # type: ignore[union-attr]
        self.client = SGLangClient(url, sc.timeout_s, sc.retries, self.server.gone if self.server else lambda: None)
        try:
            self._wait_ready(sc.ready_timeout_s)
        except BaseException:
            self.close()
            raise
        # The weights the server holds now: a version of ours (it outlived an earlier actor, say) or, under any
        # other name (SGLang's "default"), the model it was started with, which is version 0.
        served = (self.client.request("GET", "/model_info") or {}).get("weight_version")
        self.served = str(served) if served is not None else "default"
        self.version = int(self.served) if self.served.isdigit() else 0
        log.info(
            "SGLang at %s serves weight_version %r (policy version %d)", self.client.url, self.served, self.version
        )
        if cfg.learner.lora.rank:
            self._check_lora()
        # The server batches concurrent requests (continuous batching): an actor keeps sglang.rounds_in_flight going,
        # and loads versions mid-round while it waits for them. weights.transport nccl: the server's ranks in the
        # update group are its tensor-parallel workers.
        nccl_ranks = self._update_group_ranks() if cfg.weights.transport == "nccl" else 0
        self.capabilities = Capabilities(True, sc.rounds_in_flight, nccl_ranks=nccl_ranks)

    def _check_lora(self) -> None:
        """learner.lora: the server must take adapters of this rank (a launched one is started so; a given one may
        not be), said at start, not at the first version."""
        lora = self.cfg.learner.lora
        info = self.client.request("GET", "/server_info") or {}
        rank, served = info.get("max_lora_rank"), info.get("lora_target_modules")
        missing = uncovered(lora.target_modules, served) if served is not None else []
        if not info.get("enable_lora") or (rank is not None and int(rank) < lora.rank) or missing:
            raise EngineError(f"learner.lora: the SGLang server at {self.client.url} cannot take rank-{lora.rank} "
                              f"adapters of {lora.target_modules} (enable_lora {info.get('enable_lora')}, "
                              f"max_lora_rank {rank}, lora_target_modules {served}): start it with "
                              f"{' '.join(launch_args(lora.rank, lora.target_modules))}")  # fmt: skip
        if self.served.isdigit() and self.served != "0":
            # Adapters apply to the weights the server holds: they must be the base (launched servers say "0").
            raise EngineError(f"learner.lora: the SGLang server at {self.client.url} holds whole weights of version "
                              f"{self.served}, not the base model adapters were trained on: restart it")  # fmt: skip

    def _update_group_ranks(self) -> int:
        """The server's ranks in an update group (its tp_size), or 0 where SGLang cannot take part: it refuses
        data-parallel replicas, and pipeline stages would take the same ranks. Such an actor loads from disk."""
        try:
            info = self.client.request("GET", "/server_info") or {}
        except EngineError as e:
            raise EngineError(f"weights.transport nccl needs the server's tp_size from /server_info: {e}") from None
        dp, pp = int(info.get("dp_size") or 1), int(info.get("pp_size") or 1)
        if dp > 1 or pp > 1:
            log.warning("the SGLang server has dp_size %d, pp_size %d: SGLang's update groups need 1 and 1, so this "
                        "actor loads weights from disk (weights.disk_every)", dp, pp)  # fmt: skip
            return 0
        return int(info.get("tp_size") or 1)

    def _wait_ready(self, timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        while not self.client.healthy():
            if self.server is not None and (why := self.server.gone()):
                raise EngineError(f"{why} before it was ready: {self.server.tail()} (set up SGLang's environment with "
                                  "scripts/sglang_env.sh, or name its interpreter in sglang.python)")  # fmt: skip
            if time.monotonic() > deadline:
                raise EngineError(f"SGLang at {self.client.url} was not healthy after {timeout_s:.0f}s")
            time.sleep(1.0)

    updates: Updates | None = None  # (never set: the actor loads versions while it waits for the server's replies)
    adapter: str | None = None  # learner.lora: the loaded adapter every request names (none: the served weights)

    def failed(self) -> str | None:
        """Why the server this engine launched is gone, or None: asked while the actor waits (for room, say), so that
        a dead server ends the actor then, not at its next request."""
        return self.server.gone() if self.server is not None else None

    def generate(self, prompts: Sequence[Sequence[int]], n: int, *, greedy: bool = False) -> list[list[Sample]]:
        return self.generate_versioned(prompts, n, greedy=greedy)[0]

    def generate_versioned(
        self, prompts: Sequence[Sequence[int]], n: int, *, greedy: bool = False
    ) -> tuple[list[list[Sample]], int | None]:
        """The completions and the policy version the server generated them with (None where it reports none).
        Safe to call from several threads at once: each call is its own HTTP request."""
        s = self.cfg.sampling
        with self._adapters_lock:
            adapter, version = self.adapter, self.version  # the request names the adapter: its version, whole answers
            if adapter is not None:
                self._adapter_users[adapter] += 1
        # Requests paused in place keep their cache: a namespace per version keeps it from serving later requests.
        salt = f"v{version}" if self.pause_mode == "in_place" and adapter is None else None
        body = generate_request(
            prompts, n, temperature=0.0 if greedy else s.temperature, max_new_tokens=s.max_new_tokens,
            stop_token_ids=self.stop_ids, mode=self.cfg.sglang.requests, lora=adapter, cache_salt=salt,
        )  # fmt: skip
        try:
            with self.unannounced.request() as dropped:  # (weights.transport nccl: none while weights are taken)
                reply = self.client.request("POST", "/generate", body)
        finally:
            if adapter is not None:
                self._done_with(adapter)
        mixed = self.pause_mode is not None and adapter is None
        groups, served = parse_samples(reply, len(prompts), n, mixed=mixed)
        self.unannounced.check(reply_names(served, groups), dropped)  # refused where unannounced weights gave it
        if mixed:  # the versions are ours, loaded by this engine: the samples say which produced what
            return groups, version_number(served) if served is not None else None
        if adapter is not None:  # the reply's weight_version is the base's, which adapters do not change
            if served is not None and served != self.served:
                raise EngineError(f"the SGLang server's base weights changed to {served!r} under the LoRA adapters "
                                  "(another client updated them): its answers are not the policy's")  # fmt: skip
            return groups, version
        if served is None:
            return groups, None
        if served != self.served:
            self._adopt_served_version(served)
        return groups, version_number(served)

    def _adopt_served_version(self, served: str) -> None:
        """/generate says the server holds another version than /model_info said: a server whose weights were loaded
        by a reply SGLang reports as a failure (the 400 of :meth:`load`) before this actor started. Its replies are
        the truth about what generated them; a name that is not a version of ours means someone else's weights."""
        if not served.isdigit():
            raise EngineError(f"the server generated with weight_version {served!r}, the actor expects "
                              f"{self.served!r}: another client updated its weights?")  # fmt: skip
        log.warning("SGLang's /generate reports weight_version %s, /model_info said %s: sampling as v%s",
                    served, self.served, served)  # fmt: skip
        self.on_event("version_from_reply")
        self.version, self.served = int(served), served

    def load(self, ann: WeightsAnnouncement) -> int:
        """Verify the published directory (inside ``weights.dir``) against its digest and the served model's
        tensors, then have the server load it as our version. Refused before the server sees it: the server keeps
        its weights and the engine its version."""
        if ann.format == "lora-safetensors":
            return self._load_adapter(ann)
        directory = confined(ann.uri, self.cfg.weights.dir)
        nbytes = verify(ann, root=self.cfg.weights.dir)
        if self.specs and (problem := mismatch(self.specs, tensor_specs(directory))):
            raise WeightsMismatch(f"weights v{ann.version} do not fit the served model ({problem}): not sent to the "
                                  "SGLang server, which would die loading them")  # fmt: skip
        version = str(ann.version)
        # The resolved directory, not the announced name: the server reads what was checked.
        # Requests paused in place keep their cache, which cannot be flushed: their versions' namespaces stand in.
        body = {"model_path": str(directory), "weight_version": version, "abort_all_requests": False,
                "flush_cache": self.pause_mode != "in_place"}  # fmt: skip
        with self._paused():
            self._update_from_disk(ann, body)
        self.version = ann.version
        self.served = version
        self.unannounced.announced()
        self._drop_adapter()  # whole weights replace the base; requests name no adapter from now on
        return nbytes

    @contextlib.contextmanager
    def _paused(self) -> Iterator[None]:
        """In-flight updates: generation paused (in place or its requests retracted) for the update, and continued
        whatever became of it; requests sent meanwhile wait in the server."""
        if self.pause_mode is None:
            yield
            return
        self.client.request("POST", "/pause_generation", {"mode": self.pause_mode})
        try:
            yield
        finally:
            self.client.request("POST", "/continue_generation", {})

    def _update_from_disk(self, ann: WeightsAnnouncement, body: dict[str, Any]) -> None:
        version = body["weight_version"]
        reply = self.client.request("POST", "/update_weights_from_disk", body, ok_statuses=(400,))
        message = str(reply.get("message", "")) if isinstance(reply, dict) else str(reply)
        if not (isinstance(reply, dict) and reply.get("success")):
            if not loaded_but_not_flushed(message):
                raise WeightsError(f"weights v{ann.version}: the SGLang server refused them: {message}")
            self._flush(ann.version)
            # That 400 left /model_info at the old version (the scheduler and /generate have the new one).
            self.client.request("POST", "/update_weight_version", {"new_version": version, "abort_all_requests": False})

    def _load_adapter(self, ann: WeightsAnnouncement) -> int:
        """A LoRA version: verified (its digest, and its base against the model this engine serves), loaded under
        a name of its own through ``/load_lora_adapter``, then named by every request; the adapter before it is
        unloaded once no request names it (at once between rounds). Refused before the server sees it, or by
        the server: WeightsError, and the engine samples on with what it had."""
        directory = confined(ann.uri, self.cfg.weights.dir)
        nbytes = verify(ann, root=self.cfg.weights.dir)
        if self._base is None:  # (a hub name has no files here to hash: nothing to check against)
            self._base = base_identity(self.cfg.model.path)
        check_base(self._base, directory, ann.version)
        name = adapter_name(ann)
        reply = self.client.request("POST", "/load_lora_adapter", load_body(name, str(directory)), ok_statuses=(400,))
        if (refused := load_refusal(reply)) is not None and not already_loaded(refused):
            raise WeightsError(f"weights v{ann.version}: the SGLang server refused the LoRA adapter: {refused}")
        with self._adapters_lock:
            previous, self.adapter, self.version = self.adapter, name, ann.version
        if previous is not None and previous != name:
            self._retire(previous)
        return nbytes

    def _drop_adapter(self) -> None:
        if self.adapter is None:
            return
        with self._adapters_lock:
            previous, self.adapter = self.adapter, None
        if previous is not None:
            self._retire(previous)

    def _retire(self, name: str) -> None:
        """An adapter no new request names: unloaded now, or (in-flight updates) when the last request that named
        it returns."""
        with self._adapters_lock:
            busy = self._adapter_users[name] > 0
        if not busy:
            self._unload(name)

    def _done_with(self, name: str) -> None:
        with self._adapters_lock:
            self._adapter_users[name] -= 1
            idle = self._adapter_users[name] <= 0 and name != self.adapter
            if self._adapter_users[name] <= 0:
                del self._adapter_users[name]
        if idle:
            self._unload(name)

    def _unload(self, name: str) -> None:
        """Free an adapter no request names any more; a failure only leaves it to the server's own eviction."""
        try:
            self.client.request("POST", "/unload_lora_adapter", {"lora_name": name}, ok_statuses=(400,))
        except EngineError as e:
            log.debug("unloading LoRA adapter %s: %s", name, e)

    def _flush(self, version: int) -> None:
        """The server loaded ``version`` but had requests in flight when it tried to flush its prefix cache, whose
        entries were computed with the old weights: ask again, each time waiting for it to go idle."""
        sc = self.cfg.sglang
        for attempt in range(1, sc.flush_attempts + 1):
            self.on_event("cache_flush_retry")
            reply = self.client.request("POST", f"/flush_cache?timeout={sc.flush_timeout_s:g}", ok_statuses=(400,),
                                        timeout_s=sc.flush_timeout_s + 30)  # fmt: skip
            if isinstance(reply, str) and reply.startswith("Cache flushed"):
                # Routine with a real server (some updates sent right after a reply): said once, then
                # only counted (grpo_actor_engine_events_total) and logged at DEBUG.
                level, self._said_flush = (logging.DEBUG if self._said_flush else logging.INFO), True
                log.log(level, "weights v%d loaded; the server flushed its cache when asked again (attempt %d/%d; "
                        "counted as engine event cache_flush_retry)", version, attempt, sc.flush_attempts)  # fmt: skip
                return
            log.warning("weights v%d loaded, the cache not flushed yet: %s (attempt %d/%d)",
                        version, str(reply).strip(), attempt, sc.flush_attempts)  # fmt: skip
        raise EngineError(f"the SGLang server loaded weights v{version} but refused to flush its prefix cache "
                          f"{sc.flush_attempts} times: it would serve prefixes computed with old weights")  # fmt: skip

    def close(self) -> None:
        if self.server is not None:
            self.server.stop()
            self.server = None
