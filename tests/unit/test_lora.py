"""LoRA (learner.lora, common.model.lora) on the tiny model, in-process: the adapter's forward against the merged
model's, the KL reference as the adapter switched off, only the adapter trained, its files all or nothing, and a
checkpoint of the adapter alone that resumes exactly and refuses another base."""

from __future__ import annotations

import copy
import json
from pathlib import Path

import pytest
import torch

from common.config import ConfigError, load_config
from common.model.lora import adapter_state, is_lora, merged, peft_config, wrap, wrap_as
from common.weights import WeightsMismatch
from common.weights.adapters import (
    ADAPTER_CONFIG,
    ADAPTER_WEIGHTS,
    base_identity,
    base_mismatch,
    load_adapter,
    read_base,
    read_config,
    write_adapter,
)
from learner import checkpoint
from learner.trainer import Trainer
from tests.adapters import adapted
from tests.unit.test_trainer import groups_of

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning")


@pytest.fixture(scope="module")
def base(tiny_model_dir: Path):  # type: ignore[no-untyped-def]
    from common.model.loading import load_pretrained

    return load_pretrained(str(tiny_model_dir), "float32", "cpu")


def test_a_fresh_adapter_computes_the_base_and_trains_alone(base) -> None:  # type: ignore[no-untyped-def]
    tok, model = base
    ids = torch.tensor([tok("12+34=").input_ids])
    pm = wrap(copy.deepcopy(model), peft_config(4, 8.0, 0.0, "all-linear")).eval()
    assert is_lora(pm) and not is_lora(model)
    torch.testing.assert_close(pm(input_ids=ids).logits, model(input_ids=ids).logits, rtol=0, atol=0)
    trainable = [n for n, p in pm.named_parameters() if p.requires_grad]
    assert trainable and all(".lora_A." in n or ".lora_B." in n for n in trainable)
    # every linear layer but the head: 7 per block of the Llama-shaped tiny model
    assert len(trainable) == 2 * 7 * model.config.num_hidden_layers


def test_lora_forward_equals_the_merged_model(base) -> None:  # type: ignore[no-untyped-def]
    tok, model = base
    ids = torch.tensor([tok("12+34=56, 7+8=").input_ids])
    pm = adapted(model)
    with torch.no_grad():
        lora_logits = pm(input_ids=ids).logits
        base_logits = model(input_ids=ids).logits
        merged_logits = merged(copy.deepcopy(pm))(input_ids=ids).logits
    assert (lora_logits - base_logits).abs().max() > 1e-3  # the adapter does change the policy
    torch.testing.assert_close(lora_logits, merged_logits, rtol=0, atol=1e-5)


def test_the_adapter_switched_off_is_the_base(base) -> None:  # type: ignore[no-untyped-def]
    """beta > 0 with LoRA: the reference log-probs are the base model's, from the same model object."""
    tok, model = base
    groups = groups_of(tok, model, [0, 0])
    cfg = load_config(overrides=["sampling.group_size=4", "learner.beta=0.1", "learner.lora.rank=4"], env={})
    trainer = Trainer(cfg, adapted(model), pad_id=0)
    plain = Trainer(load_config(overrides=["sampling.group_size=4"], env={}), copy.deepcopy(model), pad_id=0)
    from learner.batch import assemble

    batch = assemble(groups, 0, 0)
    ref = trainer.reference_logprobs(batch, batch.loss_mask)
    on_base, _ = plain._scored(plain.model, batch, batch.loss_mask)
    on_policy, _ = trainer._scored(trainer.model, batch, batch.loss_mask)
    assert ref is not None
    torch.testing.assert_close(ref, on_base, rtol=0, atol=1e-6)
    assert (on_policy - on_base).abs().max() > 1e-4


def test_a_lora_step_moves_the_adapter_only(base) -> None:  # type: ignore[no-untyped-def]
    tok, model = base
    groups = groups_of(tok, model, [0, 0, 0])
    cfg = load_config(overrides=["learner.lr=1e-2", "sampling.group_size=4", "learner.lora.rank=4"], env={})
    pm = adapted(model)
    before = {k: v.clone() for k, v in pm.state_dict().items()}
    trainer = Trainer(cfg, pm, pad_id=0)
    assert sum(p.numel() for g in trainer.optimizer.param_groups for p in g["params"]) == sum(
        t.numel() for t in adapter_state(pm).values()
    )
    stats = trainer.step(groups, version=0)
    assert stats["updates_skipped_nonfinite"] == 0
    moved = {k for k, v in pm.state_dict().items() if not torch.equal(v, before[k])}
    assert moved and all("lora_" in k for k in moved)


def test_adapter_files_round_trip_all_or_nothing(base, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    tok, model = base
    pm = adapted(model, seed=1)
    identity = {"path": "m", "digest": "xxh3-128:" + "a" * 32}
    write_adapter(pm, tmp_path / "a", base=identity)
    assert sorted(p.name for p in (tmp_path / "a").iterdir()) == sorted([ADAPTER_CONFIG, ADAPTER_WEIGHTS, "base.json"])
    assert read_base(tmp_path / "a") == identity
    # what peft itself reads: the same adapter
    from peft import PeftModel

    theirs = PeftModel.from_pretrained(copy.deepcopy(model), str(tmp_path / "a")).eval()
    ids = torch.tensor([tok("3+4=").input_ids])
    torch.testing.assert_close(theirs(input_ids=ids).logits, pm(input_ids=ids).logits, rtol=0, atol=1e-6)
    # into a fresh wrapper shaped by the directory's config
    from safetensors.torch import load_file

    state = load_file(str(tmp_path / "a" / ADAPTER_WEIGHTS))
    ours = wrap_as(copy.deepcopy(model), read_config(tmp_path / "a")).eval()
    load_adapter(ours, state)
    torch.testing.assert_close(ours(input_ids=ids).logits, pm(input_ids=ids).logits, rtol=0, atol=1e-6)
    # an adapter of another rank does not fit, and changes nothing
    other = adapter_state(adapted(model, rank=2))
    kept = {k: v.clone() for k, v in adapter_state(ours).items()}
    with pytest.raises(WeightsMismatch, match="shapes"):
        load_adapter(ours, other)
    assert all(torch.equal(v, adapter_state(ours)[k]) for k, v in kept.items())


def test_base_identity_is_the_digest_of_the_files(tiny_model_dir: Path, tmp_path: Path) -> None:
    mine = base_identity(str(tiny_model_dir))
    assert mine["digest"].startswith("xxh3-128:") and base_identity(str(tiny_model_dir)) == mine
    assert base_mismatch(mine, mine) is None
    assert base_mismatch(mine, {}) is None  # an adapter that names no base: nothing to check against
    other = {"path": "elsewhere", "digest": "xxh3-128:" + "0" * 32}
    assert "elsewhere" in (base_mismatch(mine, other) or "")


def test_checkpoint_holds_the_adapter_and_resumes_exactly(base, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    tok, model = base
    groups = groups_of(tok, model, [0, 0])
    cfg = load_config(overrides=["learner.lr=1e-2", "sampling.group_size=4", "learner.lora.rank=4"], env={})
    identity = {"path": "m", "digest": "xxh3-128:" + "b" * 32}
    first = Trainer(cfg, adapted(model), pad_id=0)
    first.step(groups, version=0)
    state = checkpoint.Resumable(step=1, version=1)
    path = checkpoint.save(tmp_path, state, first.model, first.optimizer, first.scheduler, first.generator, 2,
                           base=identity)  # fmt: skip
    assert path is not None and checkpoint.damage(path) is None
    assert not list(path.glob("model*.safetensors")) and (path / ADAPTER_WEIGHTS).is_file()
    assert json.loads((path / "state.json").read_text())["base"] == identity
    # a second learner from the same base resumes the adapter and the optimizer, and trains on as the first does
    second = Trainer(cfg, wrap(copy.deepcopy(model), peft_config(4, 8.0, 0.0, "all-linear")), pad_id=0)
    checkpoint.load(path, second.model, second.optimizer, second.scheduler, second.generator, base=identity)
    for k, v in adapter_state(first.model).items():
        assert torch.equal(v, adapter_state(second.model)[k])
    first.step(groups, version=1)
    second.step(groups, version=1)
    for k, v in adapter_state(first.model).items():
        torch.testing.assert_close(v, adapter_state(second.model)[k], rtol=0, atol=1e-7)
    # another base, or a learner of whole weights: refused in one line before anything is loaded
    with pytest.raises(ConfigError, match=r"model\.path"):
        checkpoint.load(path, second.model, second.optimizer, second.scheduler, second.generator,
                        base={"path": "x", "digest": "xxh3-128:" + "c" * 32})  # fmt: skip
    plain = Trainer(load_config(overrides=["sampling.group_size=4"], env={}), copy.deepcopy(model), pad_id=0)
    with pytest.raises(ConfigError, match=r"learner\.lora\.rank"):
        checkpoint.load(path, plain.model, plain.optimizer, plain.scheduler, plain.generator)


def test_a_resume_with_another_alpha_is_refused(base, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    _tok, model = base
    cfg = load_config(overrides=["sampling.group_size=4", "learner.lora.rank=4"], env={})
    first = Trainer(cfg, adapted(model), pad_id=0)
    state = checkpoint.Resumable(step=1, version=1)
    path = checkpoint.save(tmp_path, state, first.model, first.optimizer, first.scheduler, first.generator, 2,
                           base={"path": "m", "digest": ""})  # fmt: skip
    assert path is not None
    other = Trainer(cfg, wrap(copy.deepcopy(model), peft_config(4, 16.0, 0.0, "all-linear")), pad_id=0)
    with pytest.raises(ConfigError, match=r"alpha 8 .* alpha 16"):
        checkpoint.load(path, other.model, other.optimizer, other.scheduler, other.generator, base={"digest": ""})


def test_the_local_engine_takes_adapters_of_a_new_shape_and_whole_weights_all_or_nothing(
    base, tiny_model_dir: Path, tmp_path: Path
) -> None:  # type: ignore[no-untyped-def]
    from actor.engines.local import LocalEngine
    from common.weights import WeightsError, publish

    tok, model = base
    cfg = load_config(overrides=[f"model.path={tiny_model_dir}", f"run.dir={tmp_path}"], env={})
    engine = LocalEngine(cfg, seed=0)
    root, identity = Path(cfg.weights.dir), base_identity(str(tiny_model_dir))
    ids = tok("7+8=").input_ids

    def served() -> torch.Tensor:
        with torch.no_grad():
            return engine.model(input_ids=torch.tensor([ids])).logits

    def expect(m) -> torch.Tensor:  # type: ignore[no-untyped-def]
        with torch.no_grad():
            return m(input_ids=torch.tensor([ids])).logits

    four = adapted(model, rank=4, seed=1)
    engine.load(publish(four, None, root, 1, keep=9, base=identity).announcement)
    torch.testing.assert_close(served(), expect(four), rtol=0, atol=1e-5)
    eight = adapted(model, rank=8, seed=2)  # another rank: the engine wraps its model anew
    engine.load(publish(eight, None, root, 2, keep=9, base=identity).announcement)
    assert engine.version == 2
    torch.testing.assert_close(served(), expect(eight), rtol=0, atol=1e-5)
    # A version whose tensors are not what its own config says: refused, and the rank-8 adapter served as before.
    bad = publish(adapted(model, rank=2, seed=3), None, root, 3, keep=9, base=identity).announcement
    config = json.loads((Path(bad.uri) / ADAPTER_CONFIG).read_text())
    (Path(bad.uri) / ADAPTER_CONFIG).write_text(json.dumps({**config, "r": 16}))
    with pytest.raises(WeightsError):
        engine.load(bad)
    assert engine.version == 2
    torch.testing.assert_close(served(), expect(eight), rtol=0, atol=1e-5)
    # Whole weights that do not fit the base: refused before the adapter goes.
    from transformers import AutoModelForCausalLM

    from tests.conftest import wrong_shaped_copy

    whole = publish(AutoModelForCausalLM.from_pretrained(tiny_model_dir), None, root, 4, keep=9).announcement
    with pytest.raises(WeightsMismatch):
        engine.load(wrong_shaped_copy(whole, root / "v000005", 5, extra=3))
    assert engine.version == 2 and is_lora(engine.model)
    engine.load(whole)  # whole weights replace the base and the adapter
    assert engine.version == 4 and not is_lora(engine.model)
    torch.testing.assert_close(served(), expect(model), rtol=0, atol=1e-6)
    with pytest.raises(WeightsMismatch, match="restart the actor"):  # an adapter over weights that are not the base
        engine.load(publish(four, None, root, 6, keep=9, base=identity).announcement)
