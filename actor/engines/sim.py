"""The ``sim`` engine: no model at all, random tokens at ``actor.sim_tokens_per_s``, for load tests of the pipeline
around the engine."""

from __future__ import annotations

import math
import threading
import time
from collections.abc import Sequence
from dataclasses import replace

import numpy as np

from actor.engines.base import Capabilities, Updates, load_if_due
from common.config import Config
from common.rollout import Sample, version_runs
from common.schemas import WeightsAnnouncement
from common.weights import load_state_dict


class SimEngine:
    """Uniformly random completions, produced no faster than ``actor.sim_tokens_per_s``: a load generator.

    Each completion has a random length up to ``sampling.max_new_tokens`` and ends with end-of-sequence when shorter;
    its log-probs are exact for uniform sampling (-log V per token). Weights are loaded and verified as a real
    engine would (same I/O, same digest check) and then discarded; only the tokenizer is loaded.

    With ``actor.sim_rounds_in_flight`` k > 1 it stands in for a server that batches concurrent requests: an actor
    keeps k rounds generating at once (each at ``sim_tokens_per_s``), as on SGLang with ``sglang.rounds_in_flight``.

    With in-flight updates a round's rows are paced as a batched decoder's: step j takes as long as the rows still
    going make tokens, and each token carries the version held when its step ended; one round at a time, a version
    due meanwhile is loaded between two steps (``updates``, asked every 20 ms); with rounds in flight the actor loads
    it while it waits for them, as with SGLang. ``in_flight_kv`` makes no difference here: no keys or values are
    cached."""

    updates: Updates | None = None
    _SLICE_S = 0.02  # in-flight pacing: how often a round checks for a version to load

    def __init__(self, cfg: Config, seed: int):
        from transformers import AutoTokenizer

        self.cfg = cfg
        self.tokenizer = AutoTokenizer.from_pretrained(cfg.model.path)
        self.vocab = len(self.tokenizer)
        self.eos = self.tokenizer.eos_token_id
        self.stop_ids: set[int] = set()  # an environment's stop ids mean nothing to random tokens: never used
        self.rng = np.random.default_rng(seed)
        self._draws = threading.Lock()  # rounds in flight draw from one generator, one at a time
        self.version = 0
        # actor.sim_rounds_in_flight > 1 stands in for a server that batches concurrent requests (SGLang's rounds);
        # one round at a time, it takes versions between two of its paced steps as an engine in this process does.
        k = cfg.actor.sim_rounds_in_flight
        self.capabilities = Capabilities(concurrent_requests=k > 1, rounds_in_flight=k, loads_mid_round=k <= 1)

    def generate(self, prompts: Sequence[Sequence[int]], n: int, *, greedy: bool = False) -> list[list[Sample]]:
        t0 = time.perf_counter()  # random either way: greedy means nothing without a model
        limit = self.cfg.sampling.max_new_tokens
        logp = -math.log(self.vocab)
        groups: list[list[Sample]] = []
        tokens = 0
        with self._draws:
            for _ in prompts:
                group = []
                for length in self.rng.integers(1, limit + 1, size=n):
                    draws = self.rng.integers(0, self.vocab, int(length))
                    ids = [t if t != self.eos else (t + 1) % self.vocab for t in draws]
                    stopped = length < limit and self.eos is not None
                    if stopped:
                        ids[-1] = self.eos
                    group.append(Sample(ids, [logp] * len(ids), "stop" if stopped else "length"))
                    tokens += len(ids)
                groups.append(group)
        if self.cfg.actor.weight_updates == "in_flight" and not greedy:
            return self._paced_in_flight(groups, t0, self.updates)
        time.sleep(max(0.0, tokens / self.cfg.actor.sim_tokens_per_s - (time.perf_counter() - t0)))
        return groups

    def _paced_in_flight(self, groups: list[list[Sample]], t0: float, updates: Updates | None) -> list[list[Sample]]:
        lengths = np.array([len(s.token_ids) for g in groups for s in g])
        steps = int(lengths.max())
        # The time each decode step ends: step j makes one token for every row longer than j.
        going = np.bincount(lengths, minlength=steps + 1)[::-1].cumsum()[::-1][1:]  # rows longer than j, j < steps
        ends = t0 + np.cumsum(going) / self.cfg.actor.sim_tokens_per_s
        versions = np.zeros(steps, dtype=np.int64)
        done = 0
        while done < steps:
            now = time.perf_counter()
            reached = int(np.searchsorted(ends, now, side="right"))
            versions[done:reached] = self.version
            done = max(done, reached)
            if done < steps:
                if updates is not None:
                    load_if_due(updates)
                time.sleep(max(0.0, min(self._SLICE_S, float(ends[done]) - time.perf_counter())))
        return [[replace(s, versions=version_runs(versions[: len(s.token_ids)].tolist())) for s in g] for g in groups]

    def generate_versioned(
        self, prompts: Sequence[Sequence[int]], n: int, *, greedy: bool = False
    ) -> tuple[list[list[Sample]], int | None]:
        return self.generate(prompts, n, greedy=greedy), None

    def failed(self) -> str | None:
        return None

    def load(self, ann: WeightsAnnouncement) -> int:
        _, nbytes = load_state_dict(ann, root=self.cfg.weights.dir)
        self.version = ann.version
        return nbytes

    def close(self) -> None:
        pass
