"""actor.weight_updates in_flight with the ``sglang`` engine, over real HTTP to the SGLang stand-in (which pauses as
SGLang 0.5.23 does, tests/sglang_standin_pause.py): a version loaded while a request generates pauses it (in place,
or retracted), updates the weights and continues it, and the reply's spans say which version produced which tokens,
the behaviour log-probs being what the server computed (the old weights before the update; after it the new ones
over the old cache, or over everything prefilled again). Requests paused in place keep their cache, so the update
does not flush it: each request names its version as its prefix-cache namespace instead; retracted ones leave the
server idle, and the update flushes it as between rounds."""

from __future__ import annotations

import threading
from pathlib import Path
from typing import Any

import pytest
from transformers import AutoModelForCausalLM

from actor.engines.sglang.engine import SGLangEngine
from common.config import load_config
from common.weights import publish
from tests.integration.test_in_flight_updates import PROMPTS, changed_model, expected
from tests.integration.test_sglang_engine import sglang_schema
from tests.sglang_standin import StandIn

pytestmark = pytest.mark.integration

STEP = 3  # the decode step at which the update arrives


def hold_at(standin: StandIn, step: int) -> threading.Event:
    """The request's ``step``-th decode step waits until a pause arrives (set: it got there)."""
    pause, reached, calls = standin.paused, threading.Event(), [0]
    hold = pause._hold

    def held() -> None:
        calls[0] += 1
        if calls[0] == step:
            reached.set()
            with pause.cond:
                pause.cond.wait_for(lambda: pause.mode is not None, timeout=30)
        hold()

    pause._hold = held  # type: ignore[method-assign]
    return reached


@pytest.mark.parametrize("kv", ["keep", "recompute"])
def test_a_version_loaded_mid_request_pauses_updates_and_continues_it(
    tiny_model_dir: Path, tmp_path: Path, kv: str
) -> None:
    standin = StandIn(str(tiny_model_dir)).start()
    try:
        cfg = load_config(None, [f"model.path={tiny_model_dir}", f"run.dir={tmp_path}", f"sglang.url={standin.url}",
                                 "actor.weight_updates=in_flight", f"actor.in_flight_kv={kv}",
                                 "sampling.max_new_tokens=12", "sampling.temperature=1.0"])  # fmt: skip
        engine = SGLangEngine(cfg, seed=0)
        new = changed_model(tiny_model_dir).eval()
        ann = publish(new, None, tmp_path / "weights", 1, keep=2).announcement
        reached = hold_at(standin, STEP)
        out: dict[str, Any] = {}
        worker = threading.Thread(target=lambda: out.update(r=engine.generate_versioned(PROMPTS, 2)))
        worker.start()
        assert reached.wait(60), "the request never reached its third step"
        engine.load(ann)
        worker.join(60)
        groups, version = out["r"]
    finally:
        standin.stop()
    assert version == 1 and engine.version == 1
    old = AutoModelForCausalLM.from_pretrained(tiny_model_dir).eval()
    spanning = 0
    for prompt, group in zip(PROMPTS, groups, strict=True):
        for s in group:
            assert s.versions[0] == (0, min(STEP, len(s.token_ids)))
            spanning += len(s.versions) == 2
            assert s.logprobs == pytest.approx(expected(old, new, prompt, s, kv), abs=1e-4)
    assert spanning
    paths = [p for p, _ in standin.requests]
    assert paths[paths.index("/pause_generation") :][:3] == [
        "/pause_generation", "/update_weights_from_disk", "/continue_generation"]  # fmt: skip
    sent = dict(standin.requests)
    assert sent["/pause_generation"] == {"mode": "in_place" if kv == "keep" else "retract"}
    generate = sent["/generate"]
    if kv == "keep":  # the cache of requests paused in place stays: a namespace per version instead of a flush
        assert generate["cache_salt"] == "v0" and sent["/update_weights_from_disk"]["flush_cache"] is False
    else:
        assert "cache_salt" not in generate and sent["/update_weights_from_disk"]["flush_cache"] is True
        assert standin.cache_flushes >= 1
    agrees_with_sglang(standin.requests)


def agrees_with_sglang(requests: list[tuple[str, Any]]) -> None:
    """Every body sent is one SGLang 0.5.23 takes (its io_struct fields; /generate through its own schema), where
    the sglang wheel is installed (the dev extra installs it)."""
    from tests.unit.test_nccl_protocol import _fields, _sglang_file

    source = _sglang_file("srt", "managers", "io_struct.py").read_text()
    structs = {"/pause_generation": "PauseGenerationReqInput", "/continue_generation": "ContinueGenerationReqInput",
               "/update_weights_from_disk": "UpdateWeightFromDiskReqInput"}  # fmt: skip
    for path, body in requests:
        if path in structs:
            fields, required = _fields(source, structs[path])
            assert set(body) <= fields and required <= set(body), (path, body, fields)
    assert "in_place" in source and '"retract"' in source  # the modes the actor pauses with
    schema = sglang_schema()
    for path, body in requests:
        if path == "/generate" and schema is not None:
            schema.GenerateRequest.from_json_value(body)


def test_between_rounds_a_reply_of_two_versions_is_still_refused_and_in_flight_one_without_spans() -> None:
    from actor.engines.base import EngineError
    from actor.engines.sglang.requests import parse_samples

    item = {"output_ids": [5, 6, 2], "meta_info": {
        "finish_reason": {"type": "stop", "matched": 2}, "weight_version": "4",
        "weight_versions": [{"version": "3", "start": 0, "end": 1}, {"version": "4", "start": 1, "end": 3}],
        "output_token_logprobs": [[-0.5, t, None] for t in (5, 6, 2)]}}  # fmt: skip
    with pytest.raises(EngineError, match="mixed weight versions"):
        parse_samples([item, {**item, "meta_info": {**item["meta_info"], "weight_versions": None}}], 1, 2)
    groups, newest = parse_samples([item], 1, 1, mixed=True)
    assert newest == "4" and groups[0][0].versions == ((3, 1), (4, 2))
    bad = {**item, "meta_info": {**item["meta_info"], "weight_versions": [{"version": "3", "start": 0, "end": 2}]}}
    with pytest.raises(EngineError, match="do not cover the 3 output tokens"):
        parse_samples([bad], 1, 1, mixed=True)
    # In flight, a reply without spans is refused: stamping every token with the newest version would hide its age.
    bare = {**item, "meta_info": {k: v for k, v in item["meta_info"].items() if k != "weight_versions"}}
    assert parse_samples([bare], 1, 1)[1] == "4"  # between rounds, the reply's one version is enough
    with pytest.raises(EngineError, match=r"no meta_info\.weight_versions"):
        parse_samples([bare], 1, 1, mixed=True)
