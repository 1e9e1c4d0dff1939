"""common.model.generation: sampling whose behaviour log-probs match what the learner recomputes, stops, memory."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from common.grpo.logprobs import token_logprobs
from common.model.generation import generate, split_at_stop, stop_token_ids


def test_split_at_stop() -> None:
    assert split_at_stop([5, 6, 2, 0, 0], {2}) == ([5, 6, 2], "stop")
    assert split_at_stop([5, 6, 7], {2}) == ([5, 6, 7], "length")
    assert split_at_stop([2, 5], {2, 9}) == ([2], "stop")


@pytest.fixture(scope="module")
def model_and_tokenizer(tiny_model_dir: Path):  # type: ignore[no-untyped-def]
    from common.model.loading import load_pretrained

    tok, model = load_pretrained(str(tiny_model_dir), "float32", "cpu")
    return model, tok


@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_behaviour_logprobs_match_the_learners_recomputation(model_and_tokenizer, temperature: float) -> None:  # type: ignore[no-untyped-def]
    model, tok = model_and_tokenizer
    torch.manual_seed(0)
    prompts = [tok("3+5=").input_ids, tok("12+7=").input_ids]  # different lengths: left padding in play
    stops = stop_token_ids(model, tok)
    groups = generate(
        model, prompts, n=4, max_new_tokens=6, stop_ids=stops, pad_id=tok.pad_token_id, temperature=temperature
    )
    assert [len(g) for g in groups] == [4, 4]
    for prompt, group in zip(prompts, groups, strict=True):
        for s in group:
            assert len(s.token_ids) == len(s.logprobs) >= 1
            assert (s.finish_reason == "stop") == (s.token_ids[-1] in stops)
            ids = torch.tensor([prompt + s.token_ids])
            with torch.no_grad():
                logits = model(input_ids=ids).logits[0, len(prompt) - 1 : -1]
            recomputed = token_logprobs(logits, torch.tensor(s.token_ids), temperature)
            assert recomputed.tolist() == pytest.approx(s.logprobs, abs=1e-4)


def test_greedy_is_deterministic_and_seeded_sampling_reproducible(model_and_tokenizer) -> None:  # type: ignore[no-untyped-def]
    model, tok = model_and_tokenizer
    kw = dict(n=1, max_new_tokens=5, stop_ids=stop_token_ids(model, tok), pad_id=tok.pad_token_id)
    prompts = [tok("4+4=").input_ids]
    a = generate(model, prompts, temperature=None, **kw)
    b = generate(model, prompts, temperature=None, **kw)
    assert a == b
    torch.manual_seed(123)
    c = generate(model, prompts * 3, temperature=1.0, **kw)
    torch.manual_seed(123)
    d = generate(model, prompts * 3, temperature=1.0, **kw)
    assert c == d


def test_each_step_is_called_at_every_decode_step_and_changes_nothing(model_and_tokenizer) -> None:  # type: ignore[no-untyped-def]
    """The hook the core borrower rides (common.idle_cores): once per generated token, the samples and log-probs as
    without it."""
    model, tok = model_and_tokenizer
    kw = dict(n=2, max_new_tokens=5, stop_ids=set(), pad_id=tok.pad_token_id, temperature=1.0)
    prompts = [tok("4+4=").input_ids]
    torch.manual_seed(7)
    plain = generate(model, prompts, **kw)
    steps: list[int] = []
    torch.manual_seed(7)
    hooked = generate(model, prompts, **kw, each_step=lambda: steps.append(1))
    assert hooked == plain
    assert len(steps) == 5  # no stop token: every one of the 5 steps ran


def probe_memory(model: str, rows: int, steps: int) -> dict:
    """Sample ``rows`` completions of ``steps`` tokens in a process of its own (tests/memory_probe.py) and check that
    its peak memory grew by no more than the KV cache, a few steps' logits and some slack: what keeping every
    step's full-vocabulary logits (4 copies, as transformers' ``output_logits`` did) would multiply many times.

    Every allocation of 1 MiB or more is its own mapping (``MALLOC_MMAP_THRESHOLD_``), returned when freed: the peak
    then measures what generation holds, not the freed blocks glibc's heap may keep (which made the same run's
    growth anywhere from 13 to 420 MiB; docs/real-model.md quotes both)."""
    done = subprocess.run(
        [sys.executable, "-m", "tests.memory_probe", model, str(rows), str(steps)],
        capture_output=True, text=True, timeout=600, cwd=Path(__file__).resolve().parents[2],
        env={**os.environ, "MALLOC_MMAP_THRESHOLD_": str(2**20)},
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    m = json.loads(done.stdout.strip().splitlines()[-1])
    assert m["lengths"] == [steps]  # every row ran every step: the worst case
    one_step_mib = rows * m["vocabulary"] * 4 / 2**20
    bound = m["kv_cache_mib"] + 8 * one_step_mib + 64
    assert m["growth_mib"] < bound, m
    assert bound < m["all_logits_mib"]  # the bound means something: all steps' logits would not fit under it
    return m


def test_sampling_keeps_one_steps_logits_not_every_steps() -> None:
    """A 49,152-token vocabulary (SmolLM2's): 64 rows × 48 steps of logits are 576 MiB a copy; sampling grows the
    peak by a few steps' worth."""
    probe_memory("vocab:49152", rows=64, steps=48)
