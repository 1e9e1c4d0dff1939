"""``grpo make-tiny-model DIR``: the offline demo model, built here, never downloaded.

A character-level tokenizer (``tokenizers`` WordLevel, one token per character, wrapped in PreTrainedTokenizerFast)
and a small ``LlamaForCausalLM`` (~0.5M parameters), saved with ``save_pretrained`` and reloadable offline with
``AutoTokenizer`` / ``AutoModelForCausalLM.from_pretrained``. Llama, not Qwen2: from a Qwen2 folder ``AutoTokenizer``
loads a Qwen2Tokenizer that silently drops spaces.

RL starts from a fine-tuned model, so by default the model also gets a brief supervised warm start on the demo task
(single-digit addition, cross-entropy on the answer and its ending) that leaves it knowing the sums but, with the
``--habit`` (0.7) of ending most answers with a space, earning a sampled reward of only about 0.25: GRPO then has
groups with mixed rewards to learn from (see :func:`warm_start`). The warm start stands in for pre-training, so it
sees every problem; the held-out split is held out from RL.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import time
import uuid
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch

from common.model.importing import cache_dir
from common.storage import open_to_umask

log = logging.getLogger(__name__)

SPECIAL_TOKENS = ["<pad>", "<bos>", "<eos>", "<unk>"]
CHARACTERS = list("0123456789+-*/=.,:;!?()#$%'\" ") + [chr(c) for c in range(ord("a"), ord("z") + 1)]
# Bump when the model or the warm start changes: cached models of older recipes are then rebuilt.
RECIPE_VERSION = 4
MODEL_SHAPE: dict[str, Any] = {
    "hidden_size": 96,
    "intermediate_size": 384,
    "num_hidden_layers": 4,
    "num_attention_heads": 4,
}


def build_tokenizer() -> Any:
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, processors
    from transformers import PreTrainedTokenizerFast

    vocab = {tok: i for i, tok in enumerate(SPECIAL_TOKENS + CHARACTERS)}
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Split(Regex("."), behavior="isolated")  # every character is a token
    tok.decoder = decoders.Fuse()  # ...and decoding joins them back without spaces
    tok.post_processor = processors.TemplateProcessing(single="<bos> $A", special_tokens=[("<bos>", vocab["<bos>"])])
    return PreTrainedTokenizerFast(
        tokenizer_object=tok, bos_token="<bos>", eos_token="<eos>", pad_token="<pad>", unk_token="<unk>"
    )


def build_model(tokenizer: Any, seed: int = 0, shape: dict[str, Any] | None = None) -> Any:
    """A randomly initialised Llama of ``shape`` (the demo model's, MODEL_SHAPE, by default)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    shape = shape or MODEL_SHAPE
    config = LlamaConfig(
        vocab_size=len(tokenizer),
        num_key_value_heads=shape["num_attention_heads"],
        max_position_embeddings=128,
        tie_word_embeddings=True,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        **shape,
    )
    torch.manual_seed(seed)
    return LlamaForCausalLM(config)


def accuracy(model: Any, tokenizer: Any, problems: list[Any], *, greedy: bool, strict: bool = True) -> float:
    """Fraction of completions (4 per problem when sampling at temperature 1, 1 when greedy) that are the answer
    followed by end-of-sequence; with ``strict=False`` trailing spaces before end-of-sequence are forgiven."""
    enc = tokenizer([p.prompt for p in problems], return_tensors="pt", padding=True, padding_side="left")
    n = 1 if greedy else 4
    with torch.no_grad():
        out = model.generate(
            **enc,
            do_sample=not greedy,
            temperature=None if greedy else 1.0,
            top_k=None if greedy else 0,
            top_p=None if greedy else 1.0,
            num_return_sequences=n,
            max_new_tokens=4,
            pad_token_id=tokenizer.pad_token_id,
        )
    eos = tokenizer.eos_token_id
    correct = 0
    for i, ids in enumerate(out[:, enc.input_ids.shape[1] :].tolist()):
        if eos in ids:
            text = tokenizer.decode(ids[: ids.index(eos)])
            correct += (text if strict else text.rstrip(" ")) == problems[i // n].reference
    return correct / (n * len(problems))


def warm_start(model: Any, tokenizer: Any, problems: list[Any], habit: float, seed: int = 0) -> dict[str, float]:
    """Supervised training on ``prompt → answer[ ]<eos>`` until the answers themselves are learnt.

    A fraction ``habit`` of the training answers end with a space before end-of-sequence, drawn afresh each step,
    so the model learns the sums and, on purpose, a bad habit that the reward (exact answer, then end-of-sequence)
    does not accept: sampling at temperature 1 it scores about ``1 − habit``, and greedily about 0, because the space
    is its likeliest ending. The habit belongs to no particular problem, so what RL does about it on the training
    prompts carries over to held-out ones; that is what ``eval/accuracy`` measures.
    """
    torch.manual_seed(seed)
    rng = torch.Generator().manual_seed(seed)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    space = tokenizer.convert_tokens_to_ids(" ")
    prompt_len = [len(tokenizer(p.prompt).input_ids) for p in problems]
    answers = [tokenizer(p.reference, add_special_tokens=False).input_ids for p in problems]
    width = max(pl + len(a) for pl, a in zip(prompt_len, answers, strict=True)) + 2
    t0 = time.perf_counter()
    step = 0
    answered = 0.0
    while step < 3000:
        spaced = torch.rand(len(problems), generator=rng) < habit
        ids, labels = _warm_batch(
            tokenizer, problems, answers, prompt_len, [space if s else None for s in spaced], width
        )
        model.train()
        loss = model(
            input_ids=ids, attention_mask=(labels != -100) | (ids != tokenizer.pad_token_id), labels=labels
        ).loss
        opt.zero_grad()
        loss.backward()
        opt.step()
        step += 1
        if step % 10 == 0:
            model.eval()
            # Learnt means the sums are right when sampling too, not merely the likeliest: then what stands
            # between the model and the reward is the habit alone, the same for every problem.
            answered = accuracy(model, tokenizer, problems, greedy=False, strict=False)
            if answered >= 0.95:
                break
    model.eval()
    return {
        "steps": step,
        "seconds": time.perf_counter() - t0,
        "habit": habit,
        "sampled_answer_accuracy": answered,
        "greedy_answer_accuracy": accuracy(model, tokenizer, problems, greedy=True, strict=False),
        "sampled_accuracy": accuracy(model, tokenizer, problems, greedy=False),
        "greedy_accuracy": accuracy(model, tokenizer, problems, greedy=True),
    }


def _warm_batch(
    tokenizer: Any,
    problems: list[Any],
    answers: list[list[int]],
    prompt_len: list[int],
    endings: list[int | None],
    width: int,
) -> tuple[torch.Tensor, torch.Tensor]:
    """One warm-start batch: each problem's prompt, answer, its ending (a space, or none) and end-of-sequence, and
    the labels: loss on the answer and its ending only (the prompts are random digits)."""
    ids = torch.full((len(problems), width), tokenizer.pad_token_id)
    labels = torch.full_like(ids, -100)
    for i, p in enumerate(problems):
        ending = [] if endings[i] is None else [endings[i]]
        row = tokenizer(p.prompt).input_ids + answers[i] + ending + [tokenizer.eos_token_id]
        ids[i, : len(row)] = torch.tensor(row)
        labels[i, prompt_len[i] : len(row)] = ids[i, prompt_len[i] : len(row)]
    return ids, labels


def make_tiny_model(
    directory: str | Path, *, warm: bool = True, habit: float = 0.7, seed: int = 0, eval_size: int = 20
) -> dict:
    """Build, optionally warm-start, and save the demo model (:func:`save_atomically`); returns what the warm start
    measured."""
    from common.tasks import addition_task

    tokenizer = build_tokenizer()
    model = build_model(tokenizer, seed)
    report: dict[str, Any] = {
        "recipe": RECIPE_VERSION,
        "parameters": sum(p.numel() for p in model.parameters()),
        "seed": seed,
    }
    if warm:
        with one_thread():
            report |= warm_start(model, tokenizer, addition_task(eval_size, seed).all, habit, seed)
    save_atomically(model, tokenizer, report, directory)
    return report


def save_atomically(model: Any, tokenizer: Any, report: dict[str, Any], directory: str | Path) -> None:
    """Save the model, its tokenizer and ``warm_start.json`` (``report``) in ``directory``, replacing it.

    Written under a temporary name and renamed, so a concurrent reader never sees half a model."""
    directory = Path(directory)
    directory.parent.mkdir(parents=True, exist_ok=True)
    tmp = directory.with_name(f".{directory.name}.{uuid.uuid4().hex[:8]}.tmp")
    model.save_pretrained(tmp)
    tokenizer.save_pretrained(tmp)
    (tmp / "warm_start.json").write_text(json.dumps(report, indent=2) + "\n")
    open_to_umask(tmp)  # readable by other users, as any folder: a model volume mounted into containers
    if directory.exists():
        shutil.rmtree(directory)
    os.rename(tmp, directory)


@contextmanager
def one_thread() -> Iterator[None]:
    """Torch on one thread for a warm start: the model is too small to gain from two, and two threads on a busy
    machine spin-wait against each other (measured on 2 loaded cores: 207 s with two threads, 28 s with one)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(threads)


def ensure_tiny_model(seed: int = 0, eval_size: int = 20) -> Path:
    """The demo model for ``run.seed``, built on first use and reused after (it is deterministic)."""
    directory = cache_dir() / f"tiny-addition-seed{seed}-eval{eval_size}-v{RECIPE_VERSION}"
    return build_cached(directory, lambda tmp: make_tiny_model(tmp, seed=seed, eval_size=eval_size), "demo model")


def build_cached(directory: Path, make: Callable[[Path], dict], what: str) -> Path:
    """``directory``, built by ``make(folder)`` (which returns its report) unless it holds a model already; built
    beside it and renamed into place, so that concurrent runs building the same model both end with it."""
    if (directory / "config.json").is_file():
        return directory
    log.info("building the tiny %s in %s (first use only)", what, directory)
    tmp_parent = directory.parent
    tmp_parent.mkdir(parents=True, exist_ok=True)
    tmp = tmp_parent / f".build-{uuid.uuid4().hex[:8]}"
    report = make(tmp)
    try:
        os.rename(tmp, directory)
    except OSError:  # built concurrently by another run: theirs is the same model
        shutil.rmtree(tmp, ignore_errors=True)
    log.info(
        "tiny model: %s", ", ".join(f"{k} {v:.3g}" if isinstance(v, float) else f"{k} {v}" for k, v in report.items())
    )
    return directory


def built_report(directory: str | Path) -> dict[str, Any]:
    """The warm-start report of the model saved in ``directory``; empty when there is none (or no model)."""
    try:
        report = json.loads((Path(directory) / "warm_start.json").read_text())
    except (OSError, ValueError):
        return {}
    return report if isinstance(report, dict) and (Path(directory) / "config.json").is_file() else {}


def built_here(directory: str | Path, *, warm: bool, habit: float, seed: int) -> bool:
    """Whether ``directory`` already holds the model this recipe, seed and warm start (or none) build: the build is
    deterministic, so it need not run again."""
    report = built_report(directory)
    return (
        report.get("recipe") == RECIPE_VERSION
        and report.get("seed") == seed
        and report.get("habit") == (habit if warm else None)
        and "variant" not in report  # the calculator model's report names its variant
    )
