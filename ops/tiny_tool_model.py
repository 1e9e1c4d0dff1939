"""The calculator variant of the demo model (``grpo make-tiny-model --calculator``): multi-turn, tool-using episodes.

The task is two-digit multiplication (``a``, ``b`` in 10..99), which the tiny model cannot compute itself, but it can
call a calculator. An episode, in the demo model's own characters::

    prompt (the task's):     "37*48="    (tokenized with <bos> first, as for the demo model)
    model turn 1 (a call):   "(37*48)"   (generation stops at CALL_CLOSE)
    environment turn:        "=1776;"    (RESULT_TEMPLATE filled with the tool's result; never trained on)
    model turn 2 (answer):   "1776" then <eos>

or, answering directly, model turn 1 = ``"1776"`` then ``<eos>`` (almost always wrong: the product is not learnt).
:data:`CALL_OPEN`, :data:`CALL_CLOSE` and :data:`RESULT_TEMPLATE` are the syntax; an environment that serves this
model is configured with the same strings (``env.call_open``, ``env.call_close``, ``env.result_template``).

The supervised warm start (:func:`warm_start`) teaches the syntax and the copying (operands into the call, the
result into the answer) but leaves the *decision to call* a habit: with probability ``tool_habit`` (0.3) a training
transcript calls the tool, else it answers directly with the true product. Sampling at temperature 1 the model then
calls on about ``tool_habit`` of problems and, when it calls, copies correctly (measured on pairs it never trained
on); greedily it mostly answers directly, because the call is not its likeliest first token, so greedy accuracy
starts low and RL raises it by making the call the likeliest. Two additions make the copying reliable in the time
(about a minute on one thread): each step also trains on calling transcripts whose opening is not trained on (they
teach the copying, not the decision), and these are drawn half with three-digit products (a fifth of all products,
and copied at another offset than four-digit ones, so drawn uniformly they were learnt last, or not at all).
Measured for seeds 0, 1 and 2 on 400 held-out pairs: calls at temperature 1 on 0.27-0.29 of problems, copies right
in 0.99-1.0 of calls, answers directly right in 2-5%; greedily calls on 0.08-0.16 (where it cannot tell the leading
digit of the product, the call is likelier than any one digit), so greedy accuracy starts at 0.12-0.21.

:func:`run_episodes` is a small sampling loop of its own, with the calculator in it, for the warm start's report and
the tests; the pipeline's actors run episodes their own way.
"""

from __future__ import annotations

import math
import random
import re
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from common.model.importing import cache_dir
from ops.tiny_model import build_cached, build_model, build_tokenizer, built_report, one_thread, save_atomically

CALL_OPEN = "("  # a model turn that calls the calculator starts with this...
CALL_CLOSE = ")"  # ...and ends with this: generation stops here and the environment answers
RESULT_TEMPLATE = "={result};"  # the environment's turn: the tool's result, appended after the call
CALL_ERROR = "error"  # the result of a call that is not ``CALL_OPEN a*b CALL_CLOSE`` (both whole numbers)
# Bump when the model or the warm start changes: cached models of older recipes are then rebuilt.
TOOL_RECIPE_VERSION = 1
VARIANT = "calculator"
OPERANDS = (10, 99)
HELD_OUT_PAIRS = 400  # (a, b) pairs the warm start never trains on: copying is measured on them
MODEL_SHAPE: dict[str, Any] = {
    "hidden_size": 64,
    "intermediate_size": 256,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
}


def prompt(a: int, b: int) -> str:
    return f"{a}*{b}="


def calculator(call: str) -> str:
    """The tool: the product for a call ``(a*b)``, else :data:`CALL_ERROR`."""
    m = re.fullmatch(rf"{re.escape(CALL_OPEN)}(\d+)\*(\d+){re.escape(CALL_CLOSE)}", call)
    return str(int(m[1]) * int(m[2])) if m else CALL_ERROR


def transcript(a: int, b: int, *, call: bool, decided: bool = True) -> list[tuple[str, bool]]:
    """The warm start's transcript of one episode as ``(text, trained)`` segments: the prompt and the environment's
    turn are not trained on, the model's turns are; ``"<eos>"`` stands for end-of-sequence. With ``decided=False``
    a call's opening is not trained on either: the transcript teaches the call and the copying, not the decision."""
    product = str(a * b)
    if not call:
        return [(prompt(a, b), False), (product + "<eos>", True)]
    expression = f"{CALL_OPEN}{a}*{b}{CALL_CLOSE}"
    call_turn = [(expression, True)] if decided else [(CALL_OPEN, False), (expression.removeprefix(CALL_OPEN), True)]
    return [
        (prompt(a, b), False),
        *call_turn,
        (RESULT_TEMPLATE.format(result=calculator(expression)), False),
        (product + "<eos>", True),
    ]


def encode(tokenizer: Any, segments: list[tuple[str, bool]]) -> tuple[list[int], list[int]]:
    """Token ids (``<bos>`` first) and labels: the id where the segment is trained on, else -100 (no loss)."""
    ids = [tokenizer.bos_token_id]
    labels = [-100]
    for text, trained in segments:
        eos = text.endswith("<eos>")
        piece = tokenizer.convert_tokens_to_ids(list(text.removesuffix("<eos>")))  # one token per character
        piece += [tokenizer.eos_token_id] if eos else []
        ids += piece
        labels += piece if trained else [-100] * len(piece)
    return ids, labels


def batch(tokenizer: Any, transcripts: list[list[tuple[str, bool]]]) -> tuple[Any, Any, Any]:
    """Input ids, attention mask and labels of transcripts (see :func:`transcript`), right-padded into one batch."""
    rows = [encode(tokenizer, segments) for segments in transcripts]
    width = max(len(ids) for ids, _ in rows)
    ids = torch.full((len(rows), width), tokenizer.pad_token_id)
    labels = torch.full_like(ids, -100)
    mask = torch.zeros_like(ids)
    for i, (row, lab) in enumerate(rows):
        ids[i, : len(row)] = torch.tensor(row)
        labels[i, : len(row)] = torch.tensor(lab)
        mask[i, : len(row)] = 1
    return ids, mask, labels


def split_pairs(seed: int = 0) -> tuple[list[tuple[int, int]], list[tuple[int, int]]]:
    """All ``(a, b)`` pairs, shuffled by ``seed``: those the warm start trains on, and :data:`HELD_OUT_PAIRS` it
    never sees."""
    low, high = OPERANDS
    pairs = [(a, b) for a in range(low, high + 1) for b in range(low, high + 1)]
    random.Random(seed).shuffle(pairs)
    return pairs[HELD_OUT_PAIRS:], pairs[:HELD_OUT_PAIRS]


def by_product_length(pairs: list[tuple[int, int]]) -> tuple[list[tuple[int, int]], list[tuple[int, int]]]:
    """``pairs`` with three-digit products, and those with four."""
    return [(a, b) for a, b in pairs if a * b < 1000], [(a, b) for a, b in pairs if a * b >= 1000]


def draw_pairs(
    rng: random.Random, groups: tuple[list[tuple[int, int]], list[tuple[int, int]]], n: int
) -> list[tuple[int, int]]:
    """``n`` pairs, half from each of the :func:`by_product_length` groups: about one product in five has three
    digits, and drawn uniformly the model learns to copy four digits into the answer but not three (after "=992;"
    the answer starts one position nearer than after "=1776;")."""
    short, long = groups
    return [rng.choice(short if rng.random() < 0.5 else long) for _ in range(n)]


def build_tool_model(tokenizer: Any, seed: int = 0) -> Any:
    return build_model(tokenizer, seed, MODEL_SHAPE)


@dataclass
class Episode:
    """One episode of :func:`run_episodes`: the model's turns as text (end-of-sequence left out), whether the
    last one ended with end-of-sequence, and the tool's result if it called."""

    a: int
    b: int
    turns: list[str]
    ended: bool
    result: str | None = None

    @property
    def called(self) -> bool:
        return self.result is not None

    @property
    def correct(self) -> bool:
        """The reward: the last turn is the product, then end-of-sequence."""
        return self.ended and self.turns[-1] == str(self.a * self.b)

    @property
    def copied(self) -> bool:
        """A call with the operands copied into it and the result copied into the answer."""
        return self.called and self.turns[0] == f"{CALL_OPEN}{self.a}*{self.b}{CALL_CLOSE}" and self.correct


def _next_tokens(model: Any, seqs: list[list[int]], pad: int, greedy: bool, generator: torch.Generator | None) -> Any:
    """The next token of each sequence (left-padded into one batch, recomputed whole: they are short)."""
    width = max(len(s) for s in seqs)
    ids = torch.tensor([[pad] * (width - len(s)) + s for s in seqs])
    mask = torch.tensor([[0] * (width - len(s)) + [1] * len(s) for s in seqs])
    positions = (mask.cumsum(1) - 1).clamp(min=0)
    with torch.no_grad():
        logits = model(input_ids=ids, attention_mask=mask, position_ids=positions).logits[:, -1].float()
    if greedy:
        return logits.argmax(-1).tolist()
    return torch.multinomial(logits.softmax(-1), 1, generator=generator).squeeze(1).tolist()


def run_episodes(
    model: Any,
    tokenizer: Any,
    pairs: list[tuple[int, int]],
    *,
    greedy: bool,
    generator: torch.Generator | None = None,
    first: str = "",
    max_turn_tokens: int = 12,
) -> list[Episode]:
    """Run one episode per pair, at temperature 1 (or greedily): generation stops at end-of-sequence, or at
    :data:`CALL_CLOSE` for the first call, whose turn goes to :func:`calculator`; its result is appended in
    :data:`RESULT_TEMPLATE` and the model goes on. One call per episode; a turn is cut at ``max_turn_tokens``.
    ``first`` is written for the model at the start of its first turn (``CALL_OPEN`` forces a call)."""
    eos, close = tokenizer.eos_token_id, tokenizer.convert_tokens_to_ids(CALL_CLOSE)
    seqs = [tokenizer(prompt(a, b) + first).input_ids for a, b in pairs]
    starts = [len(tokenizer(prompt(a, b)).input_ids) for a, b in pairs]
    episodes = [Episode(a, b, [], ended=False) for a, b in pairs]
    active = list(range(len(pairs)))
    while active:
        for i, tok in zip(
            active,
            _next_tokens(model, [seqs[i] for i in active], tokenizer.pad_token_id, greedy, generator),
            strict=True,
        ):
            seqs[i].append(tok)
            ep = episodes[i]
            if tok == eos or (tok == close and not ep.called) or len(seqs[i]) - starts[i] >= max_turn_tokens:
                ep.turns.append(tokenizer.decode(seqs[i][starts[i] :], skip_special_tokens=True))
                ep.ended = tok == eos
            if tok == close and not ep.called:
                ep.result = calculator(ep.turns[-1])
                seqs[i] += tokenizer(RESULT_TEMPLATE.format(result=ep.result), add_special_tokens=False).input_ids
                starts[i] = len(seqs[i])
        active = [i for i in active if not episodes[i].ended and len(seqs[i]) - starts[i] < max_turn_tokens]
    return episodes


def measure(model: Any, tokenizer: Any, pairs: list[tuple[int, int]], seed: int = 0) -> dict[str, float]:
    """The warm start's report on ``pairs``: sampled at temperature 1 and greedily, the call rate and accuracy;
    and the copy accuracy of calls (each episode's first turn started with :data:`CALL_OPEN` for the model: the
    same as the calls it samples itself, more of them)."""
    g = torch.Generator().manual_seed(seed)
    model.eval()
    sampled = run_episodes(model, tokenizer, pairs, greedy=False, generator=g)
    forced = run_episodes(model, tokenizer, pairs, greedy=False, generator=g, first=CALL_OPEN)
    greedy = run_episodes(model, tokenizer, pairs, greedy=True)
    mean = lambda xs: sum(xs) / len(xs)  # noqa: E731
    return {
        "sampled_call_rate": mean([e.called for e in sampled]),
        "copy_accuracy": mean([e.copied for e in forced]),
        "sampled_copy_accuracy": mean([e.copied for e in sampled if e.called] or [0.0]),
        "sampled_accuracy": mean([e.correct for e in sampled]),
        "sampled_direct_accuracy": mean([e.correct for e in sampled if not e.called] or [0.0]),
        "greedy_accuracy": mean([e.correct for e in greedy]),
        "greedy_call_rate": mean([e.called for e in greedy]),
    }


def warm_start(
    model: Any,
    tokenizer: Any,
    tool_habit: float,
    seed: int = 0,
    *,
    batch_size: int = 32,
    copy_rows: int = 32,
    steps: int = 2000,
    lr: float = 5e-3,
) -> dict[str, Any]:
    """Supervised training for ``steps`` steps (cosine learning rate after a short warm-up), then :func:`measure`.

    Each step trains on ``batch_size`` transcripts of training pairs that call the tool with probability
    ``tool_habit``, drawn afresh per example per step, and else answer directly; and on ``copy_rows`` calling
    transcripts (pairs from :func:`draw_pairs`) whose opening is not trained on (``decided=False``). The decision to
    call is learnt from the first kind alone, so at ``tool_habit``; the second gives the copying the examples it
    needs: at ``tool_habit`` alone it was learnt within the time in some seeds and not in others."""
    torch.manual_seed(seed)
    rng = random.Random(seed)
    train, held_out = split_pairs(seed)
    groups = by_product_length(train)
    opt = torch.optim.AdamW(model.parameters(), lr=lr)
    warmup = max(1, steps // 20)
    schedule = torch.optim.lr_scheduler.LambdaLR(
        opt, lambda s: min(1.0, (s + 1) / warmup) * (0.05 + 0.475 * (1 + math.cos(math.pi * min(s, steps) / steps)))
    )
    t0 = time.perf_counter()
    model.train()
    for _ in range(steps):
        transcripts = [transcript(*rng.choice(train), call=rng.random() < tool_habit) for _ in range(batch_size)]
        transcripts += [transcript(a, b, call=True, decided=False) for a, b in draw_pairs(rng, groups, copy_rows)]
        ids, mask, labels = batch(tokenizer, transcripts)
        loss = model(input_ids=ids, attention_mask=mask, labels=labels).loss
        opt.zero_grad()
        loss.backward()
        opt.step()
        schedule.step()
    seconds = time.perf_counter() - t0
    report = {"steps": steps, "seconds": seconds, "tool_habit": tool_habit, "evaluated_pairs": len(held_out)}
    return report | measure(model, tokenizer, held_out, seed)


def make_tiny_tool_model(directory: str | Path, *, warm: bool = True, tool_habit: float = 0.3, seed: int = 0) -> dict:
    """Build, optionally warm-start (on one thread), and save the calculator model (atomically, as the demo model);
    returns what the warm start measured, also saved as ``warm_start.json``."""
    tokenizer = build_tokenizer()
    model = build_tool_model(tokenizer, seed)
    report: dict[str, Any] = {
        "variant": VARIANT,
        "recipe": TOOL_RECIPE_VERSION,
        "parameters": sum(p.numel() for p in model.parameters()),
        "seed": seed,
    }
    if warm:
        with one_thread():
            report |= warm_start(model, tokenizer, tool_habit, seed)
    save_atomically(model, tokenizer, report, directory)
    return report


def ensure_tiny_tool_model(seed: int = 0, *, tool_habit: float = 0.3) -> Path:
    """The calculator model for ``seed``, built on first use in the cache and reused after (it is deterministic)."""
    directory = cache_dir() / f"tiny-calculator-seed{seed}-habit{tool_habit:g}-v{TOOL_RECIPE_VERSION}"
    return build_cached(directory, lambda tmp: make_tiny_tool_model(tmp, tool_habit=tool_habit, seed=seed), VARIANT)


def tool_built_here(directory: str | Path, *, warm: bool, tool_habit: float, seed: int) -> bool:
    """Whether ``directory`` already holds the calculator model this recipe, seed and warm start (or none) build."""
    report = built_report(directory)
    return (
        report.get("variant") == VARIANT
        and report.get("recipe") == TOOL_RECIPE_VERSION
        and report.get("seed") == seed
        and report.get("tool_habit") == (tool_habit if warm else None)
    )
