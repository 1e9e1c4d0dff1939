"""Sampling with transformers ``generate`` (KV cache), shared by the local engine (actors) and evaluation (learner).

What comes back for each completion is what SGLang's ``/generate`` returns with ``return_logprob``: the sampled token
ids (up to and including the end-of-sequence token), the log-prob of each under the temperature-scaled distribution
over the whole vocabulary, and a finish reason (``stop`` at end-of-sequence, ``length`` at ``max_new_tokens``).

Memory: a real vocabulary is large (49,152 tokens for SmolLM2, 151,936 for Qwen2.5), so the full-vocabulary logits
of every step are never kept. While sampling, :class:`SampledLogprobs` keeps one step's log-softmax at a time and,
at the next step, only the log-prob of the token that was drawn: one (rows × vocabulary) tensor however long the
completions. Greedy decoding (evaluation) records nothing.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch
from transformers import StoppingCriteria, StoppingCriteriaList

from common.grpo.logprobs import scaled_log_softmax
from common.rollout import Sample, version_runs


def split_at_stop(tokens: Sequence[int], stop_ids: set[int]) -> tuple[list[int], str]:
    """Cut a generated row after its first stop token (kept: the policy is trained to emit it)."""
    for i, t in enumerate(tokens):
        if t in stop_ids:
            return list(tokens[: i + 1]), "stop"
    return list(tokens), "length"


def stop_token_ids(model: Any, tokenizer: Any) -> set[int]:
    ids = getattr(model.generation_config, "eos_token_id", None)
    ids = ids if isinstance(ids, list) else [ids]
    return {int(i) for i in [*ids, tokenizer.eos_token_id] if i is not None}


def pad_token_id(tokenizer: Any, stop_ids: set[int]) -> int:
    """The tokenizer's pad token, else a stop token (padding is masked out, any id will do)."""
    pad = tokenizer.pad_token_id
    return int(pad if pad is not None else min(stop_ids))


class SampledLogprobs:
    """A logits processor that records, for every row, the log-prob of each sampled token under
    ``softmax(logits / temperature)``.

    ``generate`` calls it with each step's logits before it draws a token (before its own temperature warper: custom
    processors run ahead of the sampling warpers), and with that token appended to ``input_ids`` at the next step; the
    last step's token is gathered by :meth:`finish`. It returns the scores unchanged. With ``version``, it also
    records the weights' version each step's logits were computed with (weights may change between steps)."""

    def __init__(self, temperature: float, prompt_width: int, version: Callable[[], int] | None = None):
        self.temperature = temperature
        self.prompt_width = prompt_width
        self.pending: torch.Tensor | None = None  # the current step's log-softmax, (rows, vocabulary)
        self.taken: list[torch.Tensor] = []  # one (rows,) tensor per generated token
        self.version = version
        self.versions: list[int] = []  # each step's weights version, when asked for

    def _gather(self, tokens: torch.Tensor) -> None:
        assert self.pending is not None
        self.taken.append(self.pending.gather(1, tokens.view(-1, 1)).squeeze(1))
        self.pending = None

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        if input_ids.shape[1] > self.prompt_width:
            self._gather(input_ids[:, -1])
        # The learner's definition of a token's log-prob (common.grpo.logprobs): the ratio's two sides must be one
        # function.
        self.pending = scaled_log_softmax(scores, self.temperature)
        if self.version is not None:
            self.versions.append(self.version())
        return scores

    def finish(self, new_tokens: torch.Tensor) -> torch.Tensor:
        """(rows, steps) log-probs of ``new_tokens``, the tokens generated after the prompt."""
        if self.pending is not None:
            self._gather(new_tokens[:, len(self.taken)])
        if not self.taken:
            return new_tokens.new_zeros(new_tokens.shape, dtype=torch.float)
        return torch.stack(self.taken, dim=1)


@torch.no_grad()
def generate(
    model: Any,
    prompts: Sequence[Sequence[int]],
    *,
    n: int,
    max_new_tokens: int,
    stop_ids: set[int],
    pad_id: int,
    temperature: float | None,
    greedy_logprobs: bool = False,
    each_step: Callable[[], object] | None = None,
    version: Callable[[], int] | None = None,
    interrupt: Callable[[], bool] | None = None,
) -> list[list[Sample]]:
    """``n`` completions for each prompt (prompt-major), sampled at ``temperature`` or greedy when it is None.
    Greedy completions carry log-probs (at temperature 1, as a SGLang server reports them) only when
    ``greedy_logprobs`` asks for them. ``each_step`` is called before every forward of the decode loop (the torch
    threads chosen there: common.idle_cores; a weights load between two steps), after the step's log-probs are recorded.
    ``version``: each sample's tokens carry the version it returned when their logits were computed
    (``Sample.versions``). ``interrupt``: asked after every step; when it says yes, generation stops there for every
    row, and the unfinished rows come back with the tokens they have and finish reason "length" (the caller, who
    knows ``max_new_tokens``, tells them from rows that reached it)."""
    device = next(model.parameters()).device
    ids, attn = _left_padded(prompts, pad_id)
    width = ids.shape[1]
    greedy = temperature is None
    record = SampledLogprobs(temperature or 1.0, width, version) if not greedy or greedy_logprobs else None
    out = model.generate(
        input_ids=ids.to(device),
        attention_mask=attn.to(device),
        do_sample=not greedy,
        # Every knob that could reshape the distribution is set explicitly: a model's generation_config.json may
        # carry top_k/top_p/repetition_penalty defaults, and the behaviour log-probs below assume plain
        # temperature sampling over the full vocabulary.
        temperature=None if greedy else temperature,
        top_k=None if greedy else 0,
        top_p=None if greedy else 1.0,
        min_p=None,
        repetition_penalty=None,
        num_return_sequences=n,
        max_new_tokens=max_new_tokens,
        eos_token_id=sorted(stop_ids),
        pad_token_id=pad_id,
        logits_processor=[p for p in (record, _each_step(each_step)) if p is not None] or None,
        stopping_criteria=StoppingCriteriaList([_Interrupt(interrupt)]) if interrupt is not None else None,
        return_dict_in_generate=True,
    )
    return _samples(out.sequences[:, width:], record, n, stop_ids)


def _left_padded(prompts: Sequence[Sequence[int]], pad_id: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The prompts as one batch, padded on the left (every row's next token comes right after its last prompt
    token), and the attention mask that leaves the padding out."""
    width = max(len(p) for p in prompts)
    ids = torch.full((len(prompts), width), pad_id, dtype=torch.long)
    attn = torch.zeros((len(prompts), width), dtype=torch.long)
    for i, p in enumerate(prompts):
        ids[i, width - len(p) :] = torch.as_tensor(p, dtype=torch.long)
        attn[i, width - len(p) :] = 1
    return ids, attn


def _samples(
    new_tokens: torch.Tensor, record: SampledLogprobs | None, n: int, stop_ids: set[int]
) -> list[list[Sample]]:
    """The generated rows as ``n`` samples per prompt, each cut after its first stop token."""
    # Greedy answers carry no log-probs unless asked for: nothing trains on them.
    logps = record.finish(new_tokens).cpu().tolist() if record else None
    versions = record.versions if record is not None and record.version is not None else None
    rows: list[list[Sample]] = []
    for i, row in enumerate(new_tokens.cpu().tolist()):
        tokens, reason = split_at_stop(row, stop_ids)
        runs = version_runs(versions[: len(tokens)]) if versions is not None else ()
        sample = Sample(tokens, logps[i][: len(tokens)] if logps else [], reason, runs)
        if i % n == 0:
            rows.append([])
        rows[-1].append(sample)
    return rows


def _each_step(call: Callable[[], object] | None) -> Callable[[torch.Tensor, torch.Tensor], torch.Tensor] | None:
    """``call`` as a logits processor: run once per decode step (after the step's forward, so before the next
    one), the scores unchanged."""
    if call is None:
        return None

    def processor(_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        call()
        return scores

    return processor


class _Interrupt(StoppingCriteria):
    """Every row stops after this step when ``asked()`` says so (a weights version to load before going on)."""

    def __init__(self, asked: Callable[[], bool]):
        self.asked = asked

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor, **kwargs: Any) -> torch.Tensor:
        return torch.full((input_ids.shape[0],), bool(self.asked()), dtype=torch.bool, device=input_ids.device)
