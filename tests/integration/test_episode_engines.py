"""Both engines continue a conversation from token ids: episodes with a tool, on the local engine and on the SGLang
engine over HTTP (the stand-in), each turn checked token by token against what the engine returned for exactly the
context before it, and the behaviour log-probs against the learner's scoring of the whole episode."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from common.config import load_config
from env.episodes import episode_counts
from tests.episodes_check import Recorder, check_turns, learner_gap, run_episodes

pytestmark = pytest.mark.integration

# A random model writes the call's closing token now and then; the echo tool answers any call.
ENV = ["env.name=tool", "env.tool=tests.graders_for_tests:tool_echo", "env.call_close=e", "env.max_turns=3"]


def check(prompts: list[list[int]], groups: Any, recorder: Recorder, model: Any, tol: float) -> None:
    calls = 0
    for prompt, group in zip(prompts, groups, strict=True):
        for s in group:
            calls += check_turns(recorder, prompt, s)
            assert max(learner_gap(model, prompt, s, 1.0)) < tol
    ends, answered = episode_counts([s for g in groups for s in g])
    assert answered == calls >= 2, f"too few calls to check anything: {ends}"
    assert len(recorder.calls) >= 2  # turns after the first were generated from the episodes' contexts


def test_the_local_engine_continues_episodes_from_token_ids(tiny_model_dir: Path, tmp_path: Path) -> None:
    from actor.engines.local import LocalEngine

    cfg = load_config(None, [f"model.path={tiny_model_dir}", f"run.dir={tmp_path}", "sampling.max_new_tokens=12",
                             *ENV])  # fmt: skip
    engine = LocalEngine(cfg, seed=0)
    prompts, groups, recorder = run_episodes(engine, cfg, lambda p, n, g: (engine.generate(p, n, greedy=g), None))
    check(prompts, groups, recorder, engine.model, tol=1e-4)


def test_the_sglang_engine_continues_episodes_from_token_ids(tiny_model_dir: Path, tmp_path: Path) -> None:
    from actor.engines.sglang.engine import SGLangEngine
    from common.model.loading import load_pretrained
    from tests.sglang_standin import StandIn

    standin = StandIn(str(tiny_model_dir)).start()
    try:
        cfg = load_config(None, [f"model.path={tiny_model_dir}", f"run.dir={tmp_path}", f"sglang.url={standin.url}",
                                 "sampling.max_new_tokens=12", *ENV])  # fmt: skip
        engine = SGLangEngine(cfg, seed=0)
        prompts, groups, recorder = run_episodes(engine, cfg, lambda p, n, g: engine.generate_versioned(p, n, greedy=g))
        # every later turn went to the server as input_ids, the call's closing token among the stop ids
        bodies = [b for p, b in standin.requests if p == "/generate"]
        assert len(bodies) == len(recorder.calls)
        assert all("input_ids" in b and cfg_close(engine) in b["sampling_params"]["stop_token_ids"] for b in bodies)
        _, model = load_pretrained(str(tiny_model_dir), "float32", "cpu")
        check(prompts, groups, recorder, model, tol=1e-4)
    finally:
        standin.stop()


def cfg_close(engine: Any) -> int:
    return int(engine.tokenizer.convert_tokens_to_ids("e"))
