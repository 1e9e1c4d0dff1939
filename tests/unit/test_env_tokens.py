"""Multi-turn episodes: the tokens an environment wrote into a completion (a tool's output) travel in the group message
with a NaN behaviour log-prob (``completions.mask``, schema 5) and are the model's input, never its loss.

The key test is :func:`test_environment_tokens_never_reach_the_loss`: on the trainer's real path, the gradient with
environment tokens is finite, does not move when their behaviour log-probs do, and differs from the gradient of the
same batch with those tokens counted as the model's."""

from __future__ import annotations

import math
from dataclasses import replace
from typing import Any

import msgpack
import numpy as np
import pytest
import torch

from common.schemas import Completion, GroupMessage, SchemaError, decode_group, encode_group
from learner import trainer as trainer_module
from learner.batch import assemble, env_share, version_spread
from learner.loss import importance_weights
from tests.unit.test_trainer import captured_gradients, groups_of, policy, trainer_for

__all__ = ["policy"]  # the tiny model fixture, shared with test_trainer

# pytest's warning filter of test_trainer (captured_gradients replaces optimizer.step once the scheduler wrapped it).
pytestmark = pytest.mark.filterwarnings("ignore:Seems like `optimizer.step\\(\\)` has been overridden:UserWarning")
NAN = math.nan


def episode(mask: list[int], reward: float = 1.0, runs: Any = None) -> Completion:
    """A completion of len(mask) tokens whose environment tokens (mask 0) carry NaN log-probs, as actors send them."""
    lp = np.where(np.array(mask) > 0, -0.5, NAN).astype(np.float32)
    return Completion(np.arange(10, 10 + len(mask), dtype=np.int32), lp, reward, "stop", runs, np.array(mask, np.uint8))


def group(*comps: Completion, version: int = 7) -> GroupMessage:
    return GroupMessage("p", version, "a", np.array([1, 2, 3], np.int32), comps)


def body(msg: GroupMessage) -> dict:
    return msgpack.unpackb(encode_group(msg), raw=False)


def packed(d: dict) -> bytes:
    return msgpack.packb(d, use_bin_type=True)


# --- the wire ---------------------------------------------------------------------------------------------------


def test_a_mask_travels_as_runs_and_comes_back_as_views_of_one_column() -> None:
    msg = group(episode([1, 1, 0, 0, 1]), episode([1, 1, 1]), episode([1, 0]))
    runs = body(msg)["completions"]["mask"]
    assert {k: np.frombuffer(v["data"], "<i4").tolist() for k, v in runs.items()} == {
        "runs": [3, 1, 2], "value": [1, 0, 1, 1, 1, 0], "tokens": [2, 2, 1, 3, 1, 1]}  # fmt: skip
    back = decode_group(encode_group(msg))
    cols = back.columns
    assert cols.mask is not None and cols.mask.dtype == np.uint8
    assert cols.mask.tolist() == [1, 1, 0, 0, 1, 1, 1, 1, 1, 0]
    first = back.completions[0]
    assert first.mask is not None and np.shares_memory(first.mask, cols.mask) and first.mask.tolist() == [1, 1, 0, 0, 1]
    assert np.isnan(first.logprobs[2:4]).all() and first.logprobs[[0, 1, 4]].tolist() == [-0.5] * 3
    assert back.completions[1].mask.tolist() == [1, 1, 1]  # type: ignore[union-attr]


def test_a_group_without_environment_tokens_carries_no_mask() -> None:
    plain = replace(episode([1, 1]), mask=None)
    for msg in (group(plain, plain), group(episode([1, 1]), episode([1, 1, 1]))):  # none, or all ones
        assert msg.columns.mask is None and "mask" not in body(msg)["completions"]
        assert decode_group(encode_group(msg)).columns.mask is None
        assert decode_group(encode_group(msg)).completions[0].mask is None


def test_earlier_schema_versions_decode_without_a_mask() -> None:
    d = body(group(replace(episode([1, 1]), mask=None), replace(episode([1]), mask=None)))
    for v in (3, 4):
        back = decode_group(packed(d | {"v": v}))
        assert back.columns.mask is None and back.columns.logprobs.tolist() == [-0.5] * 3
    with_mask = body(group(episode([1, 0]), episode([1])))
    with pytest.raises(SchemaError, match="unknown keys"):  # version 4 had no mask
        decode_group(packed(with_mask | {"v": 4}))


def _i32(*v: int) -> dict:
    return {"dtype": "int32", "data": np.array(v, "<i4").tobytes()}


# One group of completions of 3 and 2 tokens, [1, 0, 1] and [1, 1]: its runs, and what each broken variant says.
_GOOD = {"runs": _i32(3, 1), "value": _i32(1, 0, 1, 1), "tokens": _i32(1, 1, 1, 2)}
BAD_MASKS = [
    ({**_GOOD, "tokens": _i32(1, 1, 2, 2)}, "completions[0].mask: runs of 4 tokens for 3"),
    ({**_GOOD, "tokens": _i32(1, 1, 1, 1)}, "completions[1].mask: runs of 1 tokens for 2"),
    ({**_GOOD, "value": _i32(1, 2, 1, 1)}, "values are 1 (the model's tokens) or 0 (the environment's), got 2"),
    ({**_GOOD, "value": _i32(1, -1, 1, 1)}, "got -1"),
    ({**_GOOD, "value": _i32(1, 0, 1, 0)}, "completions[1].mask: no token of the model's"),
    ({"runs": _i32(1, 1), "value": _i32(0, 1), "tokens": _i32(3, 2)}, "completions[0].mask: no token of the model's"),
    ({**_GOOD, "runs": _i32(4)}, "1 run counts for 2 completions"),
    ({**_GOOD, "runs": _i32(2, 1)}, "add up to the 4 runs"),
    ({**_GOOD, "runs": _i32(4, 0)}, "run counts must be >= 1"),
    ({**_GOOD, "tokens": _i32(1, 1, 1)}, "4 values but 3 token counts"),
    ({**_GOOD, "tokens": _i32(0, 2, 1, 2)}, "every run has at least one token"),
    ({"runs": _GOOD["runs"], "value": _GOOD["value"]}, "missing ['tokens']"),
    ([1, 0, 1, 1, 1], "completions.mask: expected a map"),
    ({**_GOOD, "value": {"dtype": "float32", "data": b"\x00" * 16}}, "completions.mask.value: dtype 'float32'"),
]


@pytest.mark.parametrize(("mask", "reason"), BAD_MASKS)
def test_a_bad_mask_is_refused_with_its_reason(mask: object, reason: str) -> None:
    d = body(group(episode([1, 0, 1]), episode([1, 1])))
    d["completions"]["mask"] = mask
    with pytest.raises(SchemaError) as e:
        decode_group(packed(d))
    assert reason in str(e.value), str(e.value)
    d["completions"]["mask"] = _GOOD
    assert decode_group(packed(d)).columns.mask.tolist() == [1, 0, 1, 1, 1]  # type: ignore[union-attr]


def test_nan_log_probs_are_accepted_on_environment_tokens_alone() -> None:
    d = body(group(episode([1, 0, 1]), episode([1, 1])))
    lp = np.frombuffer(d["completions"]["logprobs"]["data"], "<f4").copy()
    assert np.isnan(lp[1]) and np.isfinite(np.delete(lp, 1)).all()
    decode_group(packed(d))
    for model_token, owner in ((0, 0), (2, 0), (4, 1)):  # a NaN on a model token, wherever it is
        bad = lp.copy()
        bad[model_token] = NAN
        d["completions"]["logprobs"] = {"dtype": "float32", "data": bad.tobytes()}
        with pytest.raises(SchemaError, match=rf"completions\[{owner}\].logprobs: must be finite"):
            decode_group(packed(d))
    # An environment token's log-prob, if one is given, is still a log-prob: only NaN stands for "none".
    for value in (0.5, -math.inf):
        bad = lp.copy()
        bad[1] = value
        d["completions"]["logprobs"] = {"dtype": "float32", "data": bad.tobytes()}
        with pytest.raises(SchemaError, match=r"completions\[0\].logprobs"):
            decode_group(packed(d))
    # Without a mask every token is the model's: the same NaN is refused.
    plain = body(group(replace(episode([1, 1]), mask=None), replace(episode([1]), mask=None)))
    plain["completions"]["logprobs"] = {"dtype": "float32", "data": np.array([-0.5, NAN, -0.5], "<f4").tobytes()}
    with pytest.raises(SchemaError, match=r"completions\[0\].logprobs: must be finite"):
        decode_group(packed(plain))


def test_a_mask_not_as_long_as_its_completion_is_refused_where_it_is_built() -> None:
    with pytest.raises(ValueError, match="completion 1: a mask of 2 for 3 tokens"):
        group(episode([1, 0]), replace(episode([1, 1, 1]), mask=np.array([1, 0], np.uint8)))


# --- the batch ----------------------------------------------------------------------------------------------------


def test_environment_tokens_are_input_but_never_in_the_loss_mask_nor_a_nan() -> None:
    g = decode_group(encode_group(group(episode([1, 0, 0, 1]), episode([1, 1]), version=4)))
    b = assemble([g], pad_id=0, learner_version=5)
    assert b.input_ids.tolist() == [[1, 2, 3, 10, 11, 12, 13], [1, 2, 3, 10, 11, 0, 0]]
    assert b.row_lengths.tolist() == [7, 5]  # the forward reads every token, the environment's included
    assert b.loss_mask.tolist() == [[0, 0, 1, 0, 0, 1], [0, 0, 1, 1, 0, 0]]
    assert torch.isfinite(b.behavior_logprobs).all()
    assert b.behavior_logprobs.tolist() == [[0, 0, -0.5, 0, 0, -0.5], [0, 0, -0.5, -0.5, 0, 0]]
    assert b.completion_lengths.tolist() == [2, 2]  # the model's tokens
    assert b.token_staleness.tolist() == [[0, 0, 1, 0, 0, 1], [0, 0, 1, 1, 0, 0]]  # 0 outside the mask
    assert env_share([g]) == {"tokens/env_frac": 2 / 6}
    assert env_share([decode_group(encode_group(group(episode([1]))))]) == {"tokens/env_frac": 0.0}


def test_per_token_staleness_figures_count_the_models_tokens_alone() -> None:
    # Versions 4, 6, 6 and the middle token the environment's: the model's are 3 and 1 versions old.
    g = group(episode([1, 0, 1], runs=np.array([[4, 1], [6, 2]])), episode([1, 1]), version=6)
    spread = version_spread(assemble([decode_group(encode_group(g))], pad_id=0, learner_version=7))
    assert spread["staleness/token_mean"] == pytest.approx((3 + 1 + 1 + 1) / 4)
    assert spread["tokens/age_1"] == pytest.approx(3 / 4) and spread["tokens/age_3plus"] == pytest.approx(1 / 4)


def test_importance_weights_never_read_a_log_prob_outside_the_mask() -> None:
    mask = torch.tensor([[1.0, 0.0, 1.0]])
    prox, behaviour = torch.tensor([[-0.5, -0.2, -0.7]]), torch.tensor([[-0.6, NAN, -0.7]])
    weights, stats = importance_weights(prox, behaviour, mask)
    assert weights[0].tolist() == pytest.approx([math.exp(0.1), 0.0, 1.0])
    assert all(math.isfinite(v) for v in stats.values())


# --- the loss, on the trainer's real path ---------------------------------------------------------------------------


def with_environment(groups: list[GroupMessage], env_logprob: float, masked: bool = True) -> list[GroupMessage]:
    """The model's sampled groups with every odd token of each answer (1, 3, ...) made the environment's: its
    behaviour log-prob ``env_logprob`` (NaN, as actors send it, or a value that must change nothing). ``masked``
    False: the same tokens and log-probs, every token counted as the model's (what a learner that ignored the mask
    would train on). Through the wire and back, as the learner gets them."""
    out = []
    for g in groups:
        comps = []
        for c in g.completions:
            env = np.arange(len(c.token_ids)) % 2 == 1
            lp = np.where(env, np.float32(env_logprob), c.logprobs).astype(np.float32)
            comps.append(replace(c, logprobs=lp, mask=(~env).astype(np.uint8) if masked else None))
        out.append(decode_group(encode_group(replace(g, completions=comps))))
    return out


def trained(model: Any, groups: list[GroupMessage], opts: list[str], fuse: bool) -> tuple[list[torch.Tensor], dict]:
    """One trainer step's gradient (not applied) and statistics; ``fuse`` False forces the proximal scoring pass."""
    trainer = trainer_for(model, "learner.updates_per_batch=1", *opts)
    trainer.fuse_proximal = trainer.fuse_proximal and fuse
    stats: dict[str, float] = {}
    step = trainer.step

    def recorded(g: list[GroupMessage], version: int, *rest: Any) -> dict[str, float]:
        stats.update(step(g, version, *rest))
        return stats

    trainer.step = recorded  # type: ignore[method-assign,assignment]
    return captured_gradients(trainer, groups), stats


def same(a: list[torch.Tensor], b: list[torch.Tensor]) -> bool:
    return all(torch.equal(x, y) for x, y in zip(a, b, strict=True))


def figures(stats: dict[str, float]) -> dict[str, float]:
    return {k: v for k, v in stats.items() if not k.startswith("time/")}


MODES = [
    (["learner.loss_type=dapo"], True),  # proximal log-probs from the training forward, importance weights
    (["learner.loss_type=grpo"], False),  # proximal log-probs from a scoring pass
    (["learner.loss_type=bnpo", "learner.old_logprobs=behavior"], True),  # the ratio's denominator is π_b itself
]


@pytest.mark.parametrize(("opts", "fuse"), MODES)
def test_environment_tokens_never_reach_the_loss(policy, opts: list[str], fuse: bool) -> None:  # type: ignore[no-untyped-def]
    tok, model = policy
    base = groups_of(tok, model, [0, 0])
    env_tokens = sum(
        int(np.count_nonzero(m == 0)) for g in with_environment(base, NAN) if (m := g.columns.mask) is not None
    )
    assert env_tokens > 0
    nan_grad, nan_stats = trained(model, with_environment(base, NAN), opts, fuse)
    assert all(torch.isfinite(g).all() for g in nan_grad) and any(g.abs().sum() > 0 for g in nan_grad)
    assert all(math.isfinite(v) for v in figures(nan_stats).values()), nan_stats
    for other in (-0.1, -3.0):  # whatever the environment tokens' behaviour log-probs, nothing moves
        grad, stats = trained(model, with_environment(base, other), opts, fuse)
        assert same(grad, nan_grad) and figures(stats) == figures(nan_stats)
    # Counted as the model's, the same tokens change the gradient, and their log-probs then matter: the test would
    # fail if the mask were ignored.
    unmasked_a, unmasked_stats = trained(model, with_environment(base, -0.1, masked=False), opts, fuse)
    unmasked_b, _ = trained(model, with_environment(base, -3.0, masked=False), opts, fuse)
    assert not same(unmasked_a, nan_grad) and not same(unmasked_a, unmasked_b)
    # Every count is the model's tokens: the loss's, the completion lengths, and the environment's share beside them.
    assert nan_stats["tokens"] + env_tokens == unmasked_stats["tokens"]
    assert nan_stats["completions/mean_length"] * 8 + env_tokens == unmasked_stats["completions/mean_length"] * 8
    total = sum(len(c.token_ids) for g in base for c in g.completions)
    assert nan_stats["tokens/env_frac"] == pytest.approx(env_tokens / total) and unmasked_stats["tokens/env_frac"] == 0


def test_dapo_divides_by_the_models_tokens_alone(policy, monkeypatch) -> None:  # type: ignore[no-untyped-def]
    tok, model = policy
    groups = with_environment(groups_of(tok, model, [0, 0]), NAN)
    model_tokens = sum(int(np.count_nonzero(g.columns.mask)) for g in groups if g.columns.mask is not None)
    seen: list[tuple[float, float]] = []
    real = trainer_module.grpo_loss

    def recording(*args: Any, **kw: Any) -> Any:
        seen.append((float(kw["num_tokens"]), float(args[3].sum())))  # the divisor, and the micro-batch's mask
        return real(*args, **kw)

    monkeypatch.setattr(trainer_module, "grpo_loss", recording)
    trained(model, groups, ["learner.loss_type=dapo", "learner.grad_accum=2"], True)
    assert len(seen) == 2 and {n for n, _ in seen} == {float(model_tokens)}
    assert sum(m for _, m in seen) == model_tokens
