"""actor.weight_updates in_flight against a real SGLang 0.5.23 server (launched by the engine, as an actor launches
it): a version loaded while a request generates pauses it (in place, or retracted), updates the weights and continues
it; the reply's ``weight_versions`` spans say which tokens each version produced, and the behaviour log-probs are
the old model's before the update and the new one's after it (within the bf16 tolerance of test_real_server), both as
the learner computes them in float32 and under bfloat16 autocast (learner.autocast). The stand-in
(tests/sglang_standin_pause.py) is held to the same replies in tests/integration/test_sglang_in_flight.py.

The worst token: the server computes in bfloat16, and a few tokens' log-probs hang on its rounding (the learner's own
float32 and bfloat16 computations of them differ by tenths of a nat, where most tokens' agree within hundredths). A
fixed bound on the worst of ~800 tokens failed now and then on such a token alone (1.09 against 0.5, once); each
token is held to the bound plus twice the spread of its own two computations, so a token that does not hang on
rounding is held to the bound as before. The old version's mean under autocast is taken within whole answers (the
new version's keeps its own bound): when the update lands
after a token or two, the old version's part is the same few tokens in all eight answers, and its mean alone was
one token's bfloat16 rounding (0.033 against the 0.02 bound, once, where the float32 computation was 0.011 off).
The float32 means keep their bound on each version's part, and the version is loaded 0.2 s into the answers first
(13-31 tokens in, on an AMD EPYC with AVX512-BF16), sooner on each retry, rather than after 0.05 s (a token or two)."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

from actor.engines.sglang.engine import SGLangEngine
from actor.engines.sglang.requests import generate_request, parse_samples
from common.model.loading import load_pretrained
from common.weights import publish
from tests.integration.test_in_flight_updates import expected
from tests.sglang.conftest import server_config
from tests.sglang.test_real_server import LOGPROB_MAX_TOL, LOGPROB_MEAN_TOL

pytestmark = [pytest.mark.sglang, pytest.mark.slow]

TOKENS = 100  # within the demo model's 128 positions
SHARPEN = 2.0  # the new version's final norm scale: log-probs move by far more than bf16's error (checked below)
# bf16's error in a logit grows with the logit: the sharper model's worst token of ~800 may be SHARPEN times as far.
SHARPER_MAX_TOL = SHARPEN * LOGPROB_MAX_TOL
LOAD_AFTER_S = (0.2, 0.1, 0.05, 0.02, 0.01)  # when the version is loaded after the request is sent, try by try


@pytest.fixture(scope="module")
def in_flight_engine(demo_model_dir: Path, tmp_path_factory: pytest.TempPathFactory, sglang_python: str) -> Iterator:
    cfg = server_config(demo_model_dir, tmp_path_factory.mktemp("sglang-in-flight"), sglang_python,
                        "actor.weight_updates=in_flight")  # fmt: skip
    engine = SGLangEngine(cfg, seed=0, name="in-flight")
    try:
        yield engine
    finally:
        engine.close()


def long_answers(engine: SGLangEngine, prompt: list[int]) -> dict:
    """Eight answers of TOKENS tokens each (end of sequence ignored), so that an update can land mid-answer."""
    body = generate_request([prompt], 8, temperature=1.0, max_new_tokens=TOKENS, stop_token_ids=[], mode="n")
    body["sampling_params"]["ignore_eos"] = True
    return body


def send(e: SGLangEngine, body: dict, out: dict[str, Any]) -> None:
    out["r"] = e.client.request("POST", "/generate", body)


@pytest.mark.parametrize("mode", ["in_place", "retract"])
def test_an_update_mid_answer_is_served_from_the_next_token_on(
    in_flight_engine: SGLangEngine, demo_model_dir: Path, mode: str
) -> None:
    e = in_flight_engine
    e.pause_mode = mode  # what actor.in_flight_kv keep / recompute choose
    tokenizer, old = load_pretrained(str(demo_model_dir), "float32", "cpu")
    _, new = load_pretrained(str(demo_model_dir), "float32", "cpu")
    with torch.no_grad():
        new.model.norm.weight.mul_(SHARPEN)
    prompt = tokenizer.encode("12+7=")
    # The update should land some tokens into the answers (the old version's part is then more than one token's
    # rounding), and must land before they end (an update after them teaches nothing): sooner on each try.
    for attempt, wait_s in enumerate(LOAD_AFTER_S, 1):  # noqa: B007 - the attempt that landed is reported below
        version = e.version + 1
        ann = publish(new if version % 2 else old, tokenizer, Path(e.cfg.weights.dir), version, keep=2).announcement
        before, after = (old, new) if version % 2 else (new, old)
        out: dict[str, Any] = {}
        worker = threading.Thread(target=send, args=(e, long_answers(e, prompt), out))
        worker.start()
        time.sleep(wait_s)
        e.load(ann)
        worker.join(120)
        groups, newest = parse_samples(out["r"], 1, 8, mixed=True)
        spanning = [s for s in groups[0] if len(s.versions) == 2]
        if spanning:
            break
    assert spanning, f"no update landed mid-answer in {len(LOAD_AFTER_S)} attempts"
    assert newest == str(version) and e.version == version
    old_gaps, new_gaps, unchanged_gaps, old_gaps16, new_gaps16, over = [], [], [], [], [], []
    for s in spanning:
        (v0, k), (v1, rest) = s.versions
        assert (v0, v1) == (version - 1, version) and k + rest == TOKENS
        # In place, the rest attends to the keys and values cached with the old weights; retracted, to recomputed ones.
        kv = "keep" if mode == "in_place" else "recompute"
        ours = expected(before, after, prompt, s, kv)
        with torch.autocast("cpu", dtype=torch.bfloat16, cache_enabled=False):  # as learner.autocast computes it
            ours16 = expected(before, after, prompt, s, kv)
        old_gaps += gaps(ours[:k], s.logprobs[:k])
        new_gaps += gaps(ours[k:], s.logprobs[k:])
        old_gaps16 += gaps(ours16[:k], s.logprobs[:k])
        new_gaps16 += gaps(ours16[k:], s.logprobs[k:])
        over += [g - SHARPER_MAX_TOL - 2 * d for g, d in zip(gaps(ours, s.logprobs), gaps(ours, ours16), strict=True)]
        unchanged_gaps += gaps(expected(before, before, prompt, s, "recompute")[k:], s.logprobs[k:])
    landed = sorted(s.versions[0][1] for s in spanning)
    print(f"{mode}: {len(spanning)} answers span v{version - 1} and v{version}, after {landed[0]}-{landed[-1]} tokens "
          f"(attempt {attempt}); mean |Δ| before "
          f"{mean(old_gaps):.4f}, after {mean(new_gaps):.4f} (max {max(new_gaps):.3f}); had the old weights "
          f"stayed: {mean(unchanged_gaps):.4f}; under autocast before {mean(old_gaps16):.4f}, after "
          f"{mean(new_gaps16):.4f}; the worst token {max(over):+.3f} from its bound")  # fmt: skip
    for g in (old_gaps, new_gaps):
        assert mean(g) < LOGPROB_MEAN_TOL
    # Under autocast, the new version's part on its own (stale casts of the old weights after the update would put it
    # tenths of a nat off), and the old version's within whole answers (see the module docstring).
    assert mean(new_gaps16) < LOGPROB_MEAN_TOL
    assert mean(old_gaps16 + new_gaps16) < LOGPROB_MEAN_TOL
    assert max(over) < 0, f"a token {max(over):.3f} past its bound"
    # The old weights' log-probs are ten times further off: the tolerance cannot pass them for the new ones'.
    assert mean(unchanged_gaps) > 10 * mean(new_gaps)


def gaps(ours: list[float], theirs: list[float]) -> list[float]:
    return [abs(a - b) for a, b in zip(ours, theirs, strict=True)]


def mean(xs: list[float]) -> float:
    return sum(xs) / len(xs)
