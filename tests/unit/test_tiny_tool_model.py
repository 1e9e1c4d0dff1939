"""The calculator variant of the demo model: its transcripts and their loss mask, the calculator, the episode loop
(driven by a scripted stand-in for the model), the command line, and (slow) the warm start's starting point."""

from __future__ import annotations

import json
import random
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch

from ops.tiny_model import build_tokenizer
from ops.tiny_tool_model import (
    CALL_CLOSE,
    CALL_ERROR,
    CALL_OPEN,
    HELD_OUT_PAIRS,
    RESULT_TEMPLATE,
    batch,
    by_product_length,
    calculator,
    draw_pairs,
    encode,
    run_episodes,
    split_pairs,
    transcript,
)


def test_the_syntax_is_the_documented_one() -> None:
    assert (CALL_OPEN, CALL_CLOSE, RESULT_TEMPLATE) == ("(", ")", "={result};")
    tok = build_tokenizer()
    assert tok.unk_token_id not in tok(CALL_OPEN + CALL_CLOSE + RESULT_TEMPLATE.format(result=CALL_ERROR)).input_ids


def test_a_calling_transcript_trains_on_the_models_turns_only() -> None:
    assert transcript(37, 48, call=True) == [
        ("37*48=", False),
        ("(37*48)", True),
        ("=1776;", False),
        ("1776<eos>", True),
    ]
    tok = build_tokenizer()
    ids, labels = encode(tok, transcript(37, 48, call=True))
    assert ids == [*tok("37*48=(37*48)=1776;1776").input_ids, tok.eos_token_id]  # <bos> first, an id a character
    assert len(labels) == len(ids)
    assert all(label in (token, -100) for token, label in zip(ids, labels, strict=True))
    assert tok.decode([t for t in labels if t != -100]) == "(37*48)1776<eos>"
    assert tok.decode([t for t, label in zip(ids, labels, strict=True) if label == -100]) == "<bos>37*48==1776;"
    undecided, undecided_labels = encode(tok, transcript(37, 48, call=True, decided=False))  # trains the copying only
    assert undecided == ids
    assert tok.decode([t for t in undecided_labels if t != -100]) == "37*48)1776<eos>"


def test_a_direct_transcript_trains_on_the_answer_and_its_end() -> None:
    assert transcript(12, 34, call=False) == [("12*34=", False), ("408<eos>", True)]
    tok = build_tokenizer()
    ids, labels = encode(tok, transcript(12, 34, call=False))
    assert labels[:7] == [-100] * 7  # <bos>12*34=
    assert labels[7:] == ids[7:] == [*tok("408", add_special_tokens=False).input_ids, tok.eos_token_id]


def test_a_batch_is_right_padded_with_no_loss_on_padding() -> None:
    tok = build_tokenizer()
    ids, mask, labels = batch(tok, [transcript(37, 48, call=True), transcript(12, 34, call=False)])
    assert ids.shape == mask.shape == labels.shape == (2, 25)
    assert mask[0].all() and mask[1].sum() == 11
    assert (ids[1, 11:] == tok.pad_token_id).all() and (labels[1, 11:] == -100).all()


def test_the_calculator_multiplies_well_formed_calls_only() -> None:
    assert calculator("(37*48)") == "1776"
    assert calculator("(7*8)") == "56"
    for bad in ("(37*48", "37*48)", "(37+48)", "(3a*48)", "()", "(37*48)1"):
        assert calculator(bad) == CALL_ERROR, bad


def test_the_warm_start_never_sees_the_held_out_pairs() -> None:
    train, held_out = split_pairs(0)
    assert len(held_out) == HELD_OUT_PAIRS and len(train) + len(held_out) == 90 * 90
    assert not set(train) & set(held_out)
    assert split_pairs(0) == (train, held_out) != split_pairs(1)
    drawn = draw_pairs(random.Random(0), by_product_length(train), 2000)
    assert set(drawn) <= set(train)
    assert 0.4 < sum(a * b < 1000 for a, b in drawn) / len(drawn) < 0.6  # three-digit products: half, not a fifth


class Scripted:
    """A stand-in for the model that writes the calling transcript (or a direct answer) character by character,
    whatever is in its context: an episode comes out right only if the loop stops and appends where it should."""

    def __init__(self, tok: Any, *, call: bool, endless: bool = False) -> None:
        self.tok, self.call, self.endless = tok, call, endless

    def __call__(self, input_ids: Any, attention_mask: Any, position_ids: Any) -> Any:
        logits = torch.full((*input_ids.shape, len(self.tok)), -1e9)
        for i, row in enumerate(input_ids.tolist()):
            real = [t for t, m in zip(row, attention_mask[i].tolist(), strict=True) if m]
            assert position_ids[i, -1] == len(real) - 1  # left padding does not shift the positions
            text = self.tok.decode(real[1:])
            a, b = (int(x) for x in text.split("=")[0].split("*"))
            script = "".join(t for t, _ in transcript(a, b, call=self.call)).removesuffix("<eos>")
            if self.endless:
                script += "9" * 50
            nxt = (
                self.tok.convert_tokens_to_ids(script[len(text)]) if len(text) < len(script) else self.tok.eos_token_id
            )
            logits[i, -1, nxt] = 0.0  # certain, sampled or not
        return SimpleNamespace(logits=logits)


def test_an_episode_stops_at_the_call_gets_the_result_and_goes_on() -> None:
    tok = build_tokenizer()
    pairs = [(37, 48), (7, 8), (12, 34)]  # (7, 8): a shorter prompt, left-padded in the batch
    for greedy in (True, False):
        episodes = run_episodes(Scripted(tok, call=True), tok, pairs, greedy=greedy, generator=torch.Generator())
        assert [e.turns for e in episodes] == [["(37*48)", "1776"], ["(7*8)", "56"], ["(12*34)", "408"]]
        assert all(e.called and e.ended and e.correct and e.copied for e in episodes)
        assert [e.result for e in episodes] == ["1776", "56", "408"]


def test_a_direct_answer_is_one_turn_and_a_runaway_turn_is_cut() -> None:
    tok = build_tokenizer()
    (direct,) = run_episodes(Scripted(tok, call=False), tok, [(37, 48)], greedy=True)
    assert direct.turns == ["1776"] and direct.ended and direct.correct and not direct.called and not direct.copied
    (forced,) = run_episodes(Scripted(tok, call=False), tok, [(37, 48)], greedy=True, first=CALL_OPEN)
    assert forced.turns[0].startswith(CALL_OPEN) and forced.ended and not forced.called  # a call never closed
    (endless,) = run_episodes(Scripted(tok, call=False, endless=True), tok, [(37, 48)], greedy=True)
    assert not endless.ended and not endless.correct and len(endless.turns[0]) == 12


def test_make_tiny_model_calculator_cli(tmp_path: Path) -> None:
    cmd = [sys.executable, "-m", "common.cli", "make-tiny-model", str(tmp_path / "m"), "--no-warm-start"]
    run = lambda *extra: subprocess.run([*cmd, *extra], capture_output=True, text=True, timeout=300)  # noqa: E731
    made = run("--calculator")
    assert made.returncode == 0, made.stderr
    report = json.loads((tmp_path / "m" / "warm_start.json").read_text())
    assert report["variant"] == "calculator" and report["seed"] == 0
    kept = run("--calculator", "--if-missing")
    assert kept.returncode == 0 and "holds the calculator model already" in kept.stderr, kept.stderr
    demo = run("--if-missing")  # the demo model is another model: built, replacing the folder
    assert demo.returncode == 0 and "wrote" in demo.stderr, demo.stderr
    assert "variant" not in json.loads((tmp_path / "m" / "warm_start.json").read_text())


@pytest.mark.slow
def test_the_warm_start_leaves_the_calculator_model_at_its_documented_starting_point() -> None:
    from common.model.loading import load_pretrained
    from ops.tiny_tool_model import ensure_tiny_tool_model

    directory = ensure_tiny_tool_model(seed=0)
    report = json.loads((directory / "warm_start.json").read_text())
    assert report["copy_accuracy"] >= 0.95  # held-out pairs: the copying generalises
    assert 0.15 <= report["sampled_call_rate"] <= 0.45  # about tool_habit (0.3)
    assert report["greedy_call_rate"] <= 0.3  # greedily it mostly answers directly...
    assert report["greedy_accuracy"] <= 0.35  # ...and wrongly
    tok, model = load_pretrained(str(directory), "float32", "cpu")
    _, held_out = split_pairs(0)
    g = torch.Generator().manual_seed(1)
    episodes = run_episodes(model, tok, held_out[:200], greedy=False, generator=g, first=CALL_OPEN)
    assert sum(e.copied for e in episodes) / len(episodes) >= 0.93
    direct = run_episodes(model, tok, held_out[:200], greedy=False, generator=g)
    assert sum(e.correct for e in direct if not e.called) / max(1, sum(not e.called for e in direct)) <= 0.1
