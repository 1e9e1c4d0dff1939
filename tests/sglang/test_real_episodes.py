"""Episodes on a real SGLang 0.5.23 server: every later turn is a /generate with the episode's token ids, the call's
closing token among the stop ids, and each model turn is exactly what the server returned for exactly the context
before it; its log-probs are the learner's scoring of the whole episode within the bf16 server's tolerance."""

from __future__ import annotations

import statistics
from pathlib import Path

import pytest

from actor.engines.sglang.engine import SGLangEngine
from common.config import EnvConfig
from common.model.loading import load_pretrained
from env.episodes import episode_counts
from tests.episodes_check import check_turns, learner_gap, run_episodes
from tests.sglang.test_real_server import LOGPROB_MAX_TOL, LOGPROB_MEAN_TOL

pytestmark = [pytest.mark.sglang, pytest.mark.slow]


def test_real_server_continues_episodes_from_token_ids(real_engine: SGLangEngine, demo_model_dir: Path) -> None:
    # The demo model answers sums: "1" closes a call in every answer above 9, so most episodes have several turns.
    env = EnvConfig(name="tool", tool="tests.graders_for_tests:tool_echo", call_close="1", max_turns=3)
    cfg = real_engine.cfg.model_copy(update={"env": env})
    stop_ids = set(real_engine.stop_ids)
    try:
        prompts, groups, recorder = run_episodes(
            real_engine, cfg, lambda p, n, g: real_engine.generate_versioned(p, n, greedy=g)
        )
    finally:
        real_engine.stop_ids = stop_ids
    _, model = load_pretrained(str(demo_model_dir), "float32", "cpu")
    calls, gaps = 0, []
    for prompt, group in zip(prompts, groups, strict=True):
        for s in group:
            calls += check_turns(recorder, prompt, s)
            gaps += learner_gap(model, prompt, s, real_engine.cfg.sampling.temperature)
    assert episode_counts([s for g in groups for s in g])[1] == calls >= 4
    assert statistics.mean(gaps) < LOGPROB_MEAN_TOL and max(gaps) < LOGPROB_MAX_TOL
