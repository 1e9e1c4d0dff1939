"""The `sglang` engine: pure request/reply handling, and a real `grpo actor` driving a SGLang stand-in over HTTP
(tests/sglang_standin.py), given by URL or launched by the actor as its child. Where the `sglang` package is
installed, every request the actor sent (and every reply of the stand-in) is checked with SGLang's own schema."""

from __future__ import annotations

import importlib.util
import json
import shutil
import sys
import time
from pathlib import Path
from types import ModuleType

import numpy as np
import pytest
import torch

from actor.engines.sglang.engine import EngineError, generate_request, parse_samples
from common.children import wait_until
from common.config import RedisConfig
from common.schemas import WeightsAnnouncement, decode_group
from common.transport import Transport
from common.weights import publish
from tests.conftest import pid_alive, wrong_shaped_copy
from tests.integration.test_actor_process import actor_args, metric
from tests.sglang_standin import StandIn

pytestmark = pytest.mark.integration

# The stand-in as the module an actor launches, with this interpreter (not SGLang's venv, which has no tests/).
STANDIN_LAUNCH = ("-o", "sglang.launch_module=tests.sglang_standin", "-o", f"sglang.python={sys.executable}")


def sglang_schema() -> ModuleType | None:
    """sglang/api/v1/api_types.py, loaded by path: importing the package would pull its whole GPU stack."""
    spec = importlib.util.find_spec("sglang")
    if spec is None or not spec.submodule_search_locations:
        return None
    path = Path(next(iter(spec.submodule_search_locations))) / "api" / "v1" / "api_types.py"
    if not path.is_file() or importlib.util.find_spec("msgspec") is None:
        return None
    module_spec = importlib.util.spec_from_file_location("sglang_api_types", path)
    assert module_spec is not None and module_spec.loader is not None
    module = importlib.util.module_from_spec(module_spec)
    sys.modules["sglang_api_types"] = module
    module_spec.loader.exec_module(module)
    return module


def reply(ids: list[int], finish: dict, version: str = "3") -> dict:
    return {"output_ids": ids, "meta_info": {"finish_reason": finish, "weight_version": version,
            "output_token_logprobs": [[-0.5, t, None] for t in ids]}}  # fmt: skip


def test_requests_set_every_sampling_knob_and_replies_are_read_prompt_major() -> None:
    for mode, expected in (("n", [[1, 2], [3]]), ("separate", [[1, 2], [1, 2], [3], [3]])):
        body = generate_request([[1, 2], [3]], 2, temperature=0.7, max_new_tokens=4, stop_token_ids={9, 2}, mode=mode)
        assert body["input_ids"] == expected and body["return_logprob"] is True and body["logprob_start_len"] == -1
        p = body["sampling_params"]
        assert (p["temperature"], p["top_p"], p["top_k"], p["max_new_tokens"], p["stop_token_ids"]) == (
            0.7, 1.0, -1, 4, [2, 9]
        )  # fmt: skip
        assert p.get("n") == (2 if mode == "n" else None)
    items = [reply([5, 9], {"type": "stop", "matched": 9}), reply([6, 7], {"type": "length", "length": 2})] * 2
    groups, version = parse_samples(items, 2, 2)
    assert version == "3"
    assert [[s.token_ids for s in g] for g in groups] == [[[5, 9], [6, 7]], [[5, 9], [6, 7]]]
    assert groups[0][1].finish_reason == "length" and groups[0][0].logprobs == [-0.5, -0.5]


@pytest.mark.parametrize(
    ("items", "error"),
    [
        ([reply([1], {"type": "stop", "matched": 1})], "1 completions for 1 prompts x 2"),
        ([reply([1], {"type": "abort", "message": "x"})] * 2, "aborted"),
        ([reply([1], {"type": "stop"}, version="2"), reply([1], {"type": "stop"})],
         r"mixed weight versions \['2', '3'\]"),
        ([{"output_ids": [1]}] * 2, "malformed"),
        ([{"output_ids": [1, 2], "meta_info": {"finish_reason": {"type": "stop"}, "output_token_logprobs": []}}] * 2,
         "2 output ids but 0 log-probs"),
    ],
)  # fmt: skip
def test_unusable_replies_are_errors(items: list, error: str) -> None:
    with pytest.raises(EngineError, match=error):
        parse_samples(items, 1, 2)


def check_with_sglang_schema(standin: StandIn, replies: bool = True) -> None:
    schema = sglang_schema()
    if schema is None:
        pytest.skip("the sglang package (with msgspec) is not installed: requests were not checked against its schema")
    generates = [body for path, body in standin.requests if path == "/generate"]
    assert generates
    for body in generates:
        schema.GenerateRequest.from_json_value(body)
    if replies:
        body = generates[-1]
        answer = standin.generate(body)
        for item in answer if isinstance(answer, list) else [answer]:
            schema.GenerateResponse.from_json_value(item)


def test_actor_with_sglang_engine_sends_groups_and_updates_the_server_weights(
    demo_model_dir: Path, redis_url: str, tmp_path: Path, processes
) -> None:  # type: ignore[no-untyped-def]
    # Started as SGLang is by default (weight_version "default"), and busy for a while after each reply, as the real
    # server is: a weights update sent then loads but answers 400, "the cache was not flushed".
    standin = StandIn(str(demo_model_dir), busy_s=60.0).start()
    try:
        t = Transport(RedisConfig(url=redis_url), "it")
        args = actor_args(
            demo_model_dir, tmp_path, redis_url, "-o", "actor.engine=sglang", "-o", f"sglang.url={standin.url}"
        )
        proc = processes.grpo(*args, log=tmp_path / "actor.log")
        assert wait_until(lambda: t.stream_length() >= 4, 120), (tmp_path / "actor.log").read_text()
        for _, fields in t.client.xrange(t.keys.groups):
            g = decode_group(fields[b"data"])
            assert g.policy_version == 0 and len(g.completions) == 8
            for c in g.completions:
                assert len(c.token_ids) == len(c.logprobs) and (c.logprobs <= 0).all()

        # A new version: the actor checks its digest and has the server load that directory as version 5.
        from transformers import AutoModelForCausalLM, AutoTokenizer

        model = AutoModelForCausalLM.from_pretrained(demo_model_dir)
        with torch.no_grad():
            model.model.norm.weight.mul_(3.0)
        pub = publish(model, AutoTokenizer.from_pretrained(demo_model_dir), tmp_path / "weights", 5, keep=2)
        t.announce_weights(pub.announcement)
        t.client.delete(t.keys.groups)
        assert wait_until(lambda: standin.weight_version == "5", 60), (tmp_path / "actor.log").read_text()
        updates = [body for path, body in standin.requests if path == "/update_weights_from_disk"]
        assert updates == [{"model_path": pub.announcement.uri, "weight_version": "5", "abort_all_requests": False,
                            "flush_cache": True}]  # fmt: skip
        # The 400 was taken as loaded: the actor had the cache flushed and /model_info brought up to date.
        after = [path for path, _ in standin.requests[standin.requests.index(("/update_weights_from_disk",
                                                                              updates[0])) + 1 :]]  # fmt: skip
        assert after[:2] == ["/flush_cache?timeout=10", "/update_weight_version"]
        assert standin.cache_flushes == 1 and standin.weight_version == "5"
        assert "the server flushed its cache when asked again" in (tmp_path / "actor.log").read_text()

        # Every round sampled after the update is stamped 5 (one in flight during it may still be 0).
        def versions() -> list[int]:
            return [decode_group(f[b"data"]).policy_version for _, f in t.client.xrange(t.keys.groups)]

        assert wait_until(lambda: 5 in versions(), 60), (tmp_path / "actor.log").read_text()
        seen = versions()
        assert set(seen) <= {0, 5} and 0 not in seen[seen.index(5) :]
        state = {k: v for k, v in standin.model.state_dict().items() if k == "model.norm.weight"}
        assert np.allclose(state["model.norm.weight"].numpy(), model.model.norm.weight.detach().numpy())

        # A server that refuses a version: the actor keeps generating with the one it has, and says why.
        standin.fail_next_update = True
        t.announce_weights(publish(model, None, tmp_path / "weights", 6, keep=2).announcement)
        assert wait_until(lambda: "the SGLang server refused them" in (tmp_path / "actor.log").read_text(), 60)
        assert proc.poll() is None
        # and takes it at the next round's try; a next round needs room (with rounds in flight, no learner reading,
        # the stream may be full by now)
        t.client.delete(t.keys.groups)
        assert wait_until(lambda: standin.weight_version == "6", 60)

        metrics_url = json.loads(next((tmp_path / "endpoints.d").glob("actor-*.json")).read_text())
        flushes = sum(path.startswith("/flush_cache") for path, _ in standin.requests)
        assert metric(metrics_url["metrics_url"], 'grpo_actor_engine_events_total{kind="cache_flush_retry"}') == flushes
        proc.terminate()
        assert proc.wait(timeout=30) == 0
        check_with_sglang_schema(standin)
    finally:
        standin.stop()


def test_actor_launches_the_server_as_its_child_and_stops_it(
    tiny_model_dir: Path, redis_url: str, tmp_path: Path, processes
) -> None:  # type: ignore[no-untyped-def]
    t = Transport(RedisConfig(url=redis_url), "it")
    args = actor_args(
        tiny_model_dir, tmp_path, redis_url, "-o", "actor.engine=sglang", *STANDIN_LAUNCH,
        "-o", "actor.filter_zero_std=false", "-o", "sglang.requests=separate",
    )  # fmt: skip
    proc = processes.grpo(*args, log=tmp_path / "actor.log")
    assert wait_until(lambda: t.stream_length() >= 4, 120), (tmp_path / "actor.log").read_text()
    # endpoints.json (grpo run gathers endpoints.d) lists the server under the actor's name, with its PID and URL
    server = json.loads((tmp_path / "endpoints.d" / "sglang-actor-it.json").read_text())
    assert server["role"] == "sglang" and server["url"].startswith("http://127.0.0.1:")
    child = server["pid"]
    assert pid_alive(child)
    proc.terminate()
    assert proc.wait(timeout=60) == 0
    assert wait_until(lambda: not pid_alive(child), 30), "the launched server outlived the actor"
    time.sleep(0.1)


def test_a_version_that_does_not_fit_the_served_model_is_never_sent(demo_model_dir: Path, tmp_path: Path) -> None:
    """A real server dies on a wrong-shaped checkpoint (so does the stand-in): the engine checks shapes first."""
    from actor.engines.sglang.engine import SGLangEngine
    from common.config import load_config
    from common.weights import WeightsError

    standin = StandIn(str(demo_model_dir)).start()
    try:
        cfg = load_config(None, [f"model.path={demo_model_dir}", f"run.dir={tmp_path}", f"sglang.url={standin.url}"])
        engine = SGLangEngine(cfg, seed=0)
        from transformers import AutoModelForCausalLM

        model = AutoModelForCausalLM.from_pretrained(demo_model_dir)
        good = publish(model, None, tmp_path / "weights", 2, keep=2).announcement
        bad = wrong_shaped_copy(good, tmp_path / "weights" / "v000003", 3, extra=7)
        with pytest.raises(WeightsError, match=r"shapes model.norm.weight \[103\] \(served \[96\]\)"):
            engine.load(bad)
        assert not [p for p, _ in standin.requests if p == "/update_weights_from_disk"] and engine.version == 0
        # Names and dtypes are checked the same way (a float tensor where the model has integers, say).
        from safetensors.torch import load_file, save_file

        from common.weights import digest

        odd = tmp_path / "weights" / "v000004"
        shutil.copytree(good.uri, odd)
        state = load_file(str(odd / "model.safetensors"))
        state["model.norm.weight"] = state["model.norm.weight"].to(torch.int32)
        state["model.extra"] = torch.zeros(1)
        save_file(state, str(odd / "model.safetensors"), metadata={"format": "pt"})
        with pytest.raises(WeightsError, match=r"dtypes model.norm.weight int32 \[96\].*unknown \['model.extra'\]"):
            engine.load(WeightsAnnouncement(4, str(odd), digest(odd)[0]))
        assert not [p for p, _ in standin.requests if p == "/update_weights_from_disk"] and engine.version == 0
        assert engine.client.healthy()
    finally:
        standin.stop()


def test_a_reply_from_broadcast_weights_waits_for_their_announcement_and_is_refused_without_it(
    demo_model_dir: Path, tmp_path: Path
) -> None:
    """weights.transport nccl: the server takes a broadcast's weights before its learner announces them, and a
    request sent meanwhile (a round in flight, an episode's next turn) is answered by them. Its reply waits for the
    decision: announced, it stands as that version; dropped (a learner fenced out after its broadcast), it is
    refused, the engine samples nothing (version -1) until announced weights replace them, and the successor's
    version of the same number, loaded from disk, is loaded and served, not taken for the one the server held."""
    from concurrent.futures import ThreadPoolExecutor

    from transformers import AutoModelForCausalLM

    from actor.engines.sglang.engine import SGLangEngine
    from actor.engines.sglang.unannounced import UnannouncedWeights
    from common.config import load_config
    from common.schemas.control import NcclRound

    def took_broadcast(standin: StandIn, engine: SGLangEngine, version: int) -> NcclRound:
        """A round's weights received (no buckets here; the last one names the version on the server)."""
        rnd = NcclRound("s", version, version, "g", "127.0.0.1", 1, 2, "gloo", {"a": 1})
        engine.receive(rnd, 5.0)
        standin.scheduler_version = str(version)  # what SGLang reports once the last bucket is in
        standin.paused.serving(str(version))
        return rnd

    standin = StandIn(str(demo_model_dir)).start()
    try:
        cfg = load_config(None, [f"model.path={demo_model_dir}", f"run.dir={tmp_path}", f"sglang.url={standin.url}",
                                 "weights.transport=nccl", "weights.nccl_timeout_s=10",
                                 "sampling.max_new_tokens=4"])  # fmt: skip
        events: list[str] = []
        engine = SGLangEngine(cfg, seed=0, on_event=events.append)
        with ThreadPoolExecutor(1) as pool:
            rnd = took_broadcast(standin, engine, 5)
            turn = pool.submit(engine.generate_versioned, [[1, 2, 3]], 2)
            time.sleep(1.0)
            assert not turn.done()  # answered by v5's weights, waiting for their announcement
            engine.commit(rnd)
            assert turn.result(timeout=30)[1] == 5 and engine.version == 5

            rnd = took_broadcast(standin, engine, 6)
            turn = pool.submit(engine.generate_versioned, [[1, 2, 3]], 2)
            time.sleep(1.0)
            assert not turn.done()
            engine.discard(rnd)  # never announced: its learner lost the run
            with pytest.raises(UnannouncedWeights, match="never announced"):
                turn.result(timeout=30)
        assert engine.version == -1
        with pytest.raises(UnannouncedWeights):  # whatever is sent before announced weights replace them
            engine.generate_versioned([[1, 2]], 1)
        successor = publish(AutoModelForCausalLM.from_pretrained(demo_model_dir), None, tmp_path / "weights", 6, keep=2)
        engine.load(successor.announcement)
        assert engine.generate_versioned([[1, 2]], 1)[1] == 6 and engine.version == 6
        assert "version_from_reply" not in events  # no reply's version was ever taken on trust
    finally:
        standin.stop()
