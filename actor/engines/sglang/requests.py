"""The request bodies the ``sglang`` engine sends and the replies it reads (shapes of SGLang 0.5.23), as pure
functions, tested on their own; the client that sends them is :mod:`actor.engines.sglang.engine`.

- ``/generate``: every sampling knob explicit (``temperature``, ``top_p`` = 1, ``top_k`` = -1: unset ones would come
  from the model's generation_config.json, and the behaviour log-probs assume plain temperature sampling). A reply's
  ``meta_info.weight_version`` is the version its last token came from, and ``meta_info.weight_versions`` the spans
  of its output tokens each version produced (``[{"version", "start", "end"}]``, ``end`` exclusive; a server that
  updated its weights while the request was paused in place or retracted reports two or more).
- In-flight updates (``actor.weight_updates: in_flight``): ``/pause_generation`` with ``mode`` ``in_place`` (the
  requests keep their place in the running batch and their cached keys and values: ``actor.in_flight_kv`` keep) or
  ``retract`` (their cache is freed and prompt and answer so far prefilled again after the update: recompute),
  the update, then ``/continue_generation``. Requests sent meanwhile wait in the server.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any

from actor.engines.base import EngineError
from common.rollout import Sample

PAUSE_MODES = {"keep": "in_place", "recompute": "retract"}  # actor.in_flight_kv → /pause_generation's mode


def generate_request(
    prompts: Sequence[Sequence[int]],
    n: int,
    *,
    temperature: float,
    max_new_tokens: int,
    stop_token_ids: Iterable[int],
    mode: str,
    lora: str | None = None,
    cache_salt: str | None = None,
) -> dict[str, Any]:
    """One /generate body for ``n`` samples of each prompt. ``mode`` "n": one entry per prompt with
    ``sampling_params.n``; "separate": each prompt repeated ``n`` times. Either way the reply is prompt-major.
    ``lora``: the name of a loaded adapter every prompt is sampled with (actor.engines.sglang.adapters).
    ``cache_salt``: the prefix-cache namespace of the request (in-flight updates keep one per version, so that no entry
    computed with old weights serves a request sent after the update)."""
    params: dict[str, Any] = {
        "temperature": temperature,
        "top_p": 1.0,
        "top_k": -1,
        "max_new_tokens": max_new_tokens,
        "stop_token_ids": sorted(stop_token_ids),
        "skip_special_tokens": False,
        "no_stop_trim": True,  # the stop token stays in output_ids: the policy is trained to emit it
    }
    if mode == "n":
        ids = [list(p) for p in prompts]
        params["n"] = n
    elif mode == "separate":
        ids = [list(p) for p in prompts for _ in range(n)]
    else:
        raise ValueError(f"unknown request mode {mode!r}")
    body = {"input_ids": ids, "sampling_params": params, "return_logprob": True, "logprob_start_len": -1}
    return body | ({"lora_path": lora} if lora is not None else {}) | ({"cache_salt": cache_salt} if cache_salt else {})


def version_number(served: str) -> int:
    """A server's weight version as a policy version: ours are numbers; "default" (the model it was started with)
    is version 0."""
    return int(served) if served.isdigit() else 0


def spans(meta: dict[str, Any], length: int) -> tuple[tuple[str, int], ...]:
    """``meta_info.weight_versions`` as (version, tokens) runs covering the ``length`` output tokens; () where the
    server reports none. Raises :class:`EngineError` when they do not cover them exactly."""
    raw = meta.get("weight_versions")
    if not raw:
        return ()
    runs: list[tuple[str, int]] = []
    at = 0
    for span in raw:
        start, end, version = int(span["start"]), int(span["end"]), str(span["version"])
        if start != at or end <= start:
            raise EngineError(f"weight_versions spans {raw!r} do not cover the {length} output tokens in order")
        runs.append((version, end - start))
        at = end
    if at != length:
        raise EngineError(f"weight_versions spans {raw!r} do not cover the {length} output tokens in order")
    return tuple(runs)


def parse_samples(reply: Any, n_prompts: int, n: int, *, mixed: bool = False) -> tuple[list[list[Sample]], str | None]:
    """The reply of :func:`generate_request` as ``n`` samples per prompt, and the ``weight_version`` its newest
    completion ended with (None when the server reports none). With ``mixed`` (in-flight updates), each sample says
    which versions its tokens came from (``Sample.versions``: the server's spans, required); without, every
    completion must come from one and the same version (another client updating the server's weights is an error).
    Raises :class:`EngineError` when the reply has the wrong shape or a request was aborted."""
    items = reply if isinstance(reply, list) else [reply]
    if len(items) != n_prompts * n:
        raise EngineError(f"/generate returned {len(items)} completions for {n_prompts} prompts x {n}")
    groups: list[list[Sample]] = []
    versions: set[str] = set()
    for i, item in enumerate(items):
        sample, runs = _sample(item, i)
        served = [v for v, _ in runs] or [v for v in [item["meta_info"].get("weight_version")] if v is not None]
        versions.update(str(v) for v in served)
        if mixed and not runs and sample.token_ids:
            # SGLang (0.5.23 on) gives every finished request its spans; without them no token's version is known,
            # and stamping them all with the newest would hide their age from the learner.
            raise EngineError(f"/generate reply {i} has no meta_info.weight_versions: in-flight updates need a SGLang "
                              "server that reports which version produced which tokens (0.5.23 or newer)")  # fmt: skip
        if mixed and runs:
            sample = Sample(sample.token_ids, sample.logprobs, sample.finish_reason,
                            tuple((version_number(v), k) for v, k in runs))  # fmt: skip
        if i % n == 0:
            groups.append([])
        groups[-1].append(sample)
    if len(versions) > 1 and not mixed:
        raise EngineError(f"/generate mixed weight versions {sorted(versions)} in one reply: another client is "
                          "updating the server's weights")  # fmt: skip
    newest = max(versions, key=lambda v: (v.isdigit(), version_number(v)), default=None)
    return groups, newest


def _sample(item: Any, i: int) -> tuple[Sample, tuple[tuple[str, int], ...]]:
    try:
        ids = [int(t) for t in item["output_ids"]]
        meta = item["meta_info"]
        logprobs = [float(lp[0]) for lp in meta["output_token_logprobs"]]
        finish = meta["finish_reason"] or {}
        kind = finish.get("type")
        runs = spans(meta, len(ids))
    except (KeyError, TypeError, ValueError, IndexError, AttributeError) as e:
        raise EngineError(f"/generate reply {i} is malformed: {e!r}") from None
    if kind == "abort":
        raise EngineError(f"/generate aborted a request: {finish.get('message', '')}")
    if kind not in ("stop", "length"):
        raise EngineError(f"/generate reply {i}: unknown finish_reason {finish!r}")
    if len(logprobs) != len(ids):
        raise EngineError(f"/generate reply {i}: {len(ids)} output ids but {len(logprobs)} log-probs")
    return Sample(ids, logprobs, kind), runs


def loaded_but_not_flushed(message: str) -> bool:
    """A real server's answer (HTTP 400) to a weights update whose cache flush found requests still running: the
    weights are swapped, only the prefix cache is not flushed yet (SGLang 0.5.23, weight_updater.py)."""
    return "Weights were updated, but the cache was not flushed" in message
