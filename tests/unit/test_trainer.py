"""learner.trainer on the tiny model, in-process: gradient accumulation, truncation masking, the off-policy modes,
the learning-rate schedule, overlong shaping, and the reference model existing only when beta > 0."""

from __future__ import annotations

import copy
import gc
from pathlib import Path

import numpy as np
import pytest
import torch

from common.config import load_config
from common.grpo.advantages import group_advantages, overlong_penalty
from common.schemas import Completion, GroupMessage
from learner.batch import assemble
from learner.trainer import Trainer

# captured_gradients replaces optimizer.step after the scheduler wrapped it; torch warns about exactly that.
pytestmark = pytest.mark.filterwarnings("ignore:Seems like `optimizer.step\\(\\)` has been overridden:UserWarning")


@pytest.fixture(scope="module")
def policy(tiny_model_dir: Path):  # type: ignore[no-untyped-def]
    from common.model.loading import load_pretrained

    tok, model = load_pretrained(str(tiny_model_dir), "float32", "cpu")
    return tok, model


def groups_of(tok, model, versions: list[int], group: int = 4, truncated: bool = False) -> list[GroupMessage]:  # type: ignore[no-untyped-def]
    """Groups of completions the model itself sampled (real behaviour log-probs), rewards 1, 0, 1, 0, ..."""
    from common.model.generation import generate, stop_token_ids

    torch.manual_seed(0)
    prompts = [tok(f"{i}+{i + 1}=").input_ids for i in range(len(versions))]
    sampled = generate(model, prompts, n=group, max_new_tokens=4, stop_ids=stop_token_ids(model, tok),
                       pad_id=tok.pad_token_id, temperature=1.0)  # fmt: skip
    out = []
    for prompt, samples, version in zip(prompts, sampled, versions, strict=True):
        comps = tuple(
            Completion(
                np.array(s.token_ids, np.int32),
                np.array(s.logprobs, np.float32),
                float(j % 2 == 0),
                "length" if truncated else s.finish_reason,
            )
            for j, s in enumerate(samples)
        )
        out.append(GroupMessage("p", version, "t", np.array(prompt, np.int32), comps))
    return out


def trainer_for(model, *overrides: str) -> Trainer:  # type: ignore[no-untyped-def]
    cfg = load_config(overrides=["learner.lr=1e-3", "sampling.group_size=4", *overrides], env={})
    return Trainer(cfg, copy.deepcopy(model), pad_id=0)


def captured_gradients(trainer: Trainer, groups: list[GroupMessage]) -> list[torch.Tensor]:
    """Run one step but, instead of applying the update, keep the gradient the optimizer would have used."""
    grads: list[list[torch.Tensor]] = []
    trainer.optimizer.step = lambda *a, **k: grads.append(  # type: ignore[method-assign]
        [p.grad.clone() if p.grad is not None else torch.zeros_like(p) for p in trainer.model.parameters()]
    )
    trainer.step(groups, version=0)
    assert len(grads) == 1
    return grads[0]


@pytest.mark.parametrize("loss_type", ["dapo", "grpo", "dr_grpo"])
@pytest.mark.parametrize(("n_groups", "accum"), [(4, 4), (3, 5)])  # 16 rows in 4 equal parts; 12 rows as 3,3,2,2,2
def test_gradient_accumulation_equals_one_big_mini_batch(policy, loss_type: str, n_groups: int, accum: int) -> None:  # type: ignore[no-untyped-def]
    tok, model = policy
    groups = groups_of(tok, model, [0] * n_groups)
    base = ["learner.updates_per_batch=1", f"learner.loss_type={loss_type}", "learner.max_staleness=2"]
    whole = captured_gradients(trainer_for(model, *base, "learner.grad_accum=1"), groups)
    parts = captured_gradients(trainer_for(model, *base, f"learner.grad_accum={accum}"), groups)
    assert any(g.abs().sum() > 0 for g in whole)
    for a, b in zip(whole, parts, strict=True):
        assert torch.allclose(a, b, atol=1e-6, rtol=1e-4)


def uneven(groups: list[GroupMessage]) -> list[GroupMessage]:
    """The same groups with completions cut to 1, 2, 3, … tokens: rows of uneven lengths."""
    from dataclasses import replace

    def cut(c: Completion, n: int) -> Completion:
        return Completion(c.token_ids[:n], c.logprobs[:n], c.reward, "length")

    return [replace(g, completions=tuple(cut(c, 1 + j % 4) for j, c in enumerate(g.completions))) for g in groups]


@pytest.mark.parametrize("loss_type", ["dapo", "grpo", "dr_grpo"])
def test_micro_batches_by_tokens_give_one_big_mini_batchs_gradient(policy, loss_type: str) -> None:  # type: ignore[no-untyped-def]
    """Rows of like length share a forward (cut to its longest row): less padding, the same gradient."""
    tok, model = policy
    groups = uneven(groups_of(tok, model, [0] * 4))
    base = ["learner.updates_per_batch=1", f"learner.loss_type={loss_type}", "learner.max_staleness=2"]
    whole = captured_gradients(trainer_for(model, *base), groups)
    by_tokens = trainer_for(model, *base, "learner.micro_batch_tokens=40")
    forwards = count_forwards(by_tokens.model)
    parts = captured_gradients(by_tokens, groups)
    assert forwards[0] >= 3  # several micro-batches (after the proximal one, fused here: none)
    for a, b in zip(whole, parts, strict=True):
        assert torch.allclose(a, b, atol=1e-5, rtol=1e-4)


def test_micro_batches_by_tokens_pad_less(policy) -> None:  # type: ignore[no-untyped-def]
    tok, model = policy
    groups = uneven(groups_of(tok, model, [0] * 4))
    rows = trainer_for(model, "learner.updates_per_batch=1").step(groups, version=0)
    tokens = trainer_for(model, "learner.updates_per_batch=1", "learner.micro_batch_tokens=40").step(groups, version=0)
    assert 0 <= tokens["padding_frac"] < rows["padding_frac"] < 1


def test_truncated_completions_can_be_left_out_of_the_loss(policy) -> None:  # type: ignore[no-untyped-def]
    tok, model = policy
    cut = groups_of(tok, model, [0, 0], truncated=True)
    kept = trainer_for(model).step(cut, version=0)
    assert kept["tokens"] > 0 and kept["completions/truncated_frac"] == 1.0
    masked = trainer_for(model, "learner.mask_truncated_completions=true")
    stats = masked.step(cut, version=0)
    assert stats["tokens"] == 0 and stats["grad_norm"] == 0.0


def count_forwards(model) -> list[int]:  # type: ignore[no-untyped-def]
    calls = [0]
    model.register_forward_hook(lambda *_: calls.__setitem__(0, calls[0] + 1))
    return calls


def test_proximal_mode_scores_once_more_than_behaviour_mode(policy) -> None:  # type: ignore[no-untyped-def]
    tok, model = policy
    groups = groups_of(tok, model, [0, 0])
    proximal = trainer_for(model, "learner.updates_per_batch=2", "learner.grad_accum=2")
    behaviour = trainer_for(
        model, "learner.updates_per_batch=2", "learner.grad_accum=2", "learner.old_logprobs=behavior"
    )
    p_calls, b_calls = count_forwards(proximal.model), count_forwards(behaviour.model)
    p_stats = proximal.step(groups, version=0)
    b_stats = behaviour.step(groups, version=0)
    # One more pass over the batch, scored in chunks the size of a training micro-batch.
    assert (p_calls[0], b_calls[0]) == (2 * 2 + 2 * 2, 2 * 2)
    assert "is_weight/mean" in p_stats and "is_weight/mean" not in b_stats
    # Same weights as the engine that sampled them: the ratio starts at 1, the weights are 1, nothing mismatches.
    assert p_stats["is_weight/mean"] == pytest.approx(1.0, abs=1e-4)
    assert p_stats["mismatch/logprob_abs_mean"] < 1e-4 and b_stats["mismatch/logprob_abs_mean"] < 1e-4


@pytest.mark.parametrize("grad_accum", [1, 3])
def test_one_update_per_batch_takes_proximal_logprobs_from_the_training_forward(policy, grad_accum: int) -> None:  # type: ignore[no-untyped-def]
    """With one update per batch the proximal policy is the one being trained: the fused path skips the scoring pass
    and gives the same update, ratios, importance weights and statistics (stale groups, so the weights are not 1)."""
    tok, model = policy
    groups = groups_of(tok, model, [0, 0, 0])
    for g in groups[1:]:  # as if sampled by an older policy: behaviour log-probs off by a little, not 1
        for c in g.completions:
            c.logprobs[:] = c.logprobs - 0.3
    opts = ["learner.updates_per_batch=1", f"learner.grad_accum={grad_accum}"]
    fused, scored = trainer_for(model, *opts), trainer_for(model, *opts)
    scored.fuse_proximal = False
    assert fused.fuse_proximal
    f_calls, s_calls = count_forwards(fused.model), count_forwards(scored.model)
    f_stats, s_stats = fused.step(groups, version=1), scored.step(groups, version=1)
    assert (f_calls[0], s_calls[0]) == (grad_accum, 2 * grad_accum)  # one pass over the batch fewer
    assert f_stats.keys() == s_stats.keys()
    for k in f_stats:
        assert f_stats[k] == pytest.approx(s_stats[k], rel=1e-4, abs=1e-6), k
    assert f_stats["is_weight/mean"] != pytest.approx(1.0, abs=1e-3)
    for a, b in zip(fused.model.parameters(), scored.model.parameters(), strict=True):
        assert torch.allclose(a, b, rtol=1e-4, atol=1e-6)


def test_mismatch_is_measured_only_at_the_same_policy_version(policy) -> None:  # type: ignore[no-untyped-def]
    tok, model = policy
    stats = trainer_for(model).step(groups_of(tok, model, [0, 0]), version=1)
    assert "mismatch/logprob_abs_mean" not in stats and stats["staleness/mean"] == 1.0


def test_learning_rate_warms_up_then_decays(policy) -> None:  # type: ignore[no-untyped-def]
    tok, model = policy
    t = trainer_for(model, "run.steps=2", "learner.updates_per_batch=2", "learner.warmup_steps=2",
                    "learner.lr_schedule=linear")  # fmt: skip
    seen, reported = [], []
    for _ in range(2):
        seen.append(t.lr)
        reported.append(t.step(groups_of(tok, model, [0, 0]), version=0)["lr"])
    assert reported == pytest.approx([1e-3, 0.5e-3])  # the rate of each learner step's last update
    # 4 optimizer steps: warm-up 1/2, 2/2, then decay over the remaining 2: 1, 1/2 (and 0 after the last).
    assert seen == pytest.approx([0.5e-3, 1e-3]) and t.lr == 0.0


def test_the_actors_overlong_penalty_is_added_before_grouping(policy) -> None:  # type: ignore[no-untyped-def]
    """The penalty is computed once, by the actor that filtered on it: the learner adds what the group carries, whatever
    its own ``shaping`` says (here: off), so the two sides cannot disagree."""
    from dataclasses import replace

    tok, model = policy
    (plain,) = groups_of(tok, model, [0])
    lengths = [len(c.token_ids) for c in plain.completions]
    penalty = overlong_penalty(lengths, 4, 2)
    shaped_group = replace(plain, penalties=np.array(penalty, np.float32))
    t = trainer_for(model)  # shaping off on the learner's side
    adv, shaping = t.advantages(assemble([shaped_group], 0, 0))
    shaped = [r + p for r, p in zip(plain.rewards, penalty, strict=True)]
    assert adv.tolist() == pytest.approx(group_advantages(shaped, 4).tolist(), abs=1e-6)
    assert shaping["reward/overlong_penalty"] == pytest.approx(sum(penalty) / 4)
    # No penalty carried: nothing added, whatever the learner's own shaping settings.
    adv, shaping = trainer_for(model, "shaping.overlong_cache=2").advantages(assemble([plain], 0, 0))
    assert adv.tolist() == pytest.approx(group_advantages(plain.rewards, 4).tolist(), abs=1e-6) and shaping == {}


def _live_models() -> int:
    """Whole language models alive in this process (their inner base models are not counted)."""
    import warnings

    from transformers import GenerationMixin

    gc.collect()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # isinstance on some torch module objects warns about deprecations
        return sum(isinstance(o, GenerationMixin) for o in gc.get_objects())


def test_no_reference_model_exists_when_beta_is_0(tiny_model_dir: Path) -> None:
    from learner.process import load_models

    before = _live_models()
    _, model, reference = load_models(load_config(overrides=[f"model.path={tiny_model_dir}"], env={}))
    assert reference is None and _live_models() == before + 1
    del model
    _, _model, reference = load_models(
        load_config(overrides=[f"model.path={tiny_model_dir}", "learner.beta=0.04"], env={})
    )
    assert reference is not None and _live_models() == before + 2
    assert not any(p.requires_grad for p in reference.parameters())


def test_a_checkpoint_resumes_training_exactly(policy, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    """Model, optimizer, schedule and RNG come back: the next step after a resume equals the uninterrupted one."""
    from learner import checkpoint
    from learner.checkpoint import Resumable

    tok, model = policy
    overrides = ("learner.warmup_steps=3", "learner.lr_schedule=cosine", "run.steps=4")
    a = trainer_for(model, *overrides)
    batches = [groups_of(tok, model, [0, 0]) for _ in range(3)]
    for g in batches[:2]:
        a.step(g, version=0)
    path = checkpoint.save(tmp_path, Resumable(2, 2, {"groups_consumed": 4}, ["1-0"], ["g"]), a.model, a.optimizer,
                           a.scheduler, a.generator, keep=2)  # fmt: skip
    assert checkpoint.latest(tmp_path) == path
    assert {p.name for p in path.iterdir()} >= {"model.safetensors", "optimizer.safetensors", "rng.safetensors",
                                                "state.json", "config.json"}  # fmt: skip
    rng_after_save = torch.get_rng_state()

    b = trainer_for(model, *overrides)  # a fresh process: the starting weights, a new optimizer
    r = checkpoint.load(path, b.model, b.optimizer, b.scheduler, b.generator)
    assert (r.step, r.version, r.counters, r.covers, r.covers_groups) == (2, 2, {"groups_consumed": 4}, ["1-0"], ["g"])
    assert torch.equal(torch.get_rng_state(), rng_after_save)
    assert b.lr == a.lr
    torch.set_rng_state(rng_after_save)
    a.step(batches[2], version=2)
    torch.set_rng_state(rng_after_save)
    b.step(batches[2], version=2)
    for (name, pa), pb in zip(a.model.named_parameters(), b.model.parameters(), strict=True):
        assert torch.equal(pa, pb), name


def test_only_the_newest_checkpoints_are_kept(policy, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    from learner import checkpoint
    from learner.checkpoint import Resumable

    _, model = policy
    t = trainer_for(model)
    for step in range(1, 5):
        checkpoint.save(tmp_path, Resumable(step, step), t.model, t.optimizer, t.scheduler, t.generator, keep=2)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["step-000003", "step-000004"]


def test_bfloat16_parameters_lose_small_updates_that_autocast_keeps(policy) -> None:  # type: ignore[no-untyped-def]
    """At lr 1e-6 an AdamW update is about 1e-6 per weight, far below bfloat16's resolution at the weights' size:
    bfloat16 parameters stay as they were. float32 parameters with bfloat16 autocast (mixed precision) move."""
    tok, model = policy
    groups = groups_of(tok, model, [0, 0])

    def changed(dtype: torch.dtype, *overrides: str) -> float:
        trainer = trainer_for(model, "learner.lr=1e-6", "learner.updates_per_batch=1", *overrides)
        trainer.model.to(dtype)
        before = [p.detach().clone() for p in trainer.model.parameters()]
        stats = trainer.step(groups, version=0)
        assert np.isfinite(stats["loss"])
        moved = sum(int((p.detach() != b).sum()) for p, b in zip(trainer.model.parameters(), before, strict=True))
        return moved / sum(b.numel() for b in before)

    assert changed(torch.bfloat16) < 0.05  # only weights within ~1e-4 of 0 move
    assert changed(torch.float32, "learner.autocast=bfloat16") > 0.5


def test_borrowing_idle_cores_chooses_threads_in_every_block_and_changes_nothing(policy, monkeypatch) -> None:  # type: ignore[no-untyped-def]
    """learner.borrow_idle_cores: the borrower is asked before each block of the model, forward and backward, and the
    step says how long it borrowed; the update is the one without it. Off (the default), torch's threads are left
    alone and the key is absent."""
    from common.idle_cores import CoreBorrower

    tok, model = policy
    groups = groups_of(tok, model, [0] * 4)
    one = ("learner.grad_accum=2", "learner.updates_per_batch=1")
    plain = trainer_for(model, *one)
    assert plain.cores is None
    without = plain.step(groups, version=0)
    assert "time/borrowed_s" not in without
    asked: list[int] = []
    monkeypatch.setattr(CoreBorrower, "adjust", lambda self: asked.append(1) or 1)
    trainer = trainer_for(model, "learner.borrow_idle_cores=true", *one)
    threads = torch.get_num_threads()
    stats = trainer.step(groups, version=0)
    layers = model.config.num_hidden_layers
    assert len(asked) == 1 + 2 * (layers + layers)  # the step's start, then each block's forward and backward
    assert stats["time/borrowed_s"] == 0.0 and torch.get_num_threads() == threads
    assert stats["loss"] == without["loss"] and stats["grad_norm"] == without["grad_norm"]


@pytest.mark.parametrize("loss_type", ["dapo", "grpo", "dr_grpo"])
@pytest.mark.parametrize("split", [(), ("learner.micro_batch_tokens=40",), ("learner.grad_accum=2",)])
def test_packed_rows_give_the_unpacked_gradient(policy, loss_type: str, split: tuple[str, ...]) -> None:  # type: ignore[no-untyped-def]
    """learner.pack_sequences: every sequence keeps its positions and sees only itself, so the gradient is the one of
    right-padded rows, whatever splits the mini-batch."""
    tok, model = policy
    groups = uneven(groups_of(tok, model, [0] * 4))
    base = ["learner.updates_per_batch=1", f"learner.loss_type={loss_type}", "learner.max_staleness=2", *split]
    rows = captured_gradients(trainer_for(model, *base), groups)
    packed = captured_gradients(trainer_for(model, *base, "learner.pack_sequences=true"), groups)
    assert any(g.abs().sum() > 0 for g in rows)
    for a, b in zip(rows, packed, strict=True):
        assert torch.allclose(a, b, atol=1e-5, rtol=1e-4)


def test_packed_rows_score_as_unpacked_and_pad_less(policy) -> None:  # type: ignore[no-untyped-def]
    from dataclasses import replace

    tok, model = policy
    groups = uneven(groups_of(tok, model, [0] * 4))
    groups[0] = replace(groups[0], prompt_ids=np.tile(groups[0].prompt_ids, 4))  # one long prompt: room to pack
    base = ("learner.updates_per_batch=2",)  # a separate scoring pass: its log-probs are packed too
    plain, packed = trainer_for(model, *base), trainer_for(model, *base, "learner.pack_sequences=true")
    batch = assemble(groups, 0, 0)
    every = torch.arange(len(batch.rewards))
    a = plain._forward(plain.model, batch, every)[1]
    b = packed._forward(packed.model, batch, every)[1]
    real = batch.loss_mask > 0
    assert torch.allclose(a[real], b[real], atol=1e-5)
    stats_plain, stats_packed = plain.step(groups, version=0), packed.step(groups, version=0)
    assert 0 <= stats_packed["padding_frac"] < stats_plain["padding_frac"] < 1
    assert stats_packed["loss"] == pytest.approx(stats_plain["loss"], abs=1e-5)


def test_packed_rows_go_end_to_end_in_one_row_for_flash_attention(policy) -> None:  # type: ignore[no-untyped-def]
    """transformers' flash-attention path finds packed sequences only in a batch of one row: the trainer lays the
    packed rows end to end there and takes the logits back to each row's own positions. A stand-in model whose
    logits depend on each token and its position alone shows where every logit landed."""
    from types import SimpleNamespace

    _tok, model = policy
    trainer = trainer_for(model, "learner.pack_sequences=true")
    shapes: list[tuple[int, ...]] = []

    class PerToken(torch.nn.Module):
        config = SimpleNamespace(_attn_implementation="flash_attention_2")

        def forward(self, input_ids, position_ids, use_cache):  # type: ignore[no-untyped-def]
            shapes.append(tuple(input_ids.shape))
            return SimpleNamespace(logits=torch.stack([input_ids, position_ids], dim=-1).float())

    ids = torch.tensor([[5, 6, 7, 0], [8, 9, 0, 0], [4, 0, 0, 0], [1, 2, 3, 4]])
    lengths = torch.tensor([3, 2, 1, 4])
    logits = trainer._packed_logits(PerToken(), ids, lengths)
    assert len(shapes) == 1 and shapes[0][0] == 1  # one row
    real = torch.arange(4) < lengths.unsqueeze(1)
    assert torch.equal(logits[..., 0][real], ids[real].float())
    assert torch.equal(logits[..., 1][real], torch.arange(4).expand(4, 4)[real].float())  # each row's own positions
