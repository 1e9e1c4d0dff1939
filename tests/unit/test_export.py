"""`grpo export` (ops/export.py) in-process on the tiny model: a version of whole weights copied into a folder that
plain transformers loads, a LoRA version merged into its base (found where base.json says, or given), a run's newest
version that a fenced-out learner wrote passed over, and every refusal one line with exit code 2 that leaves no folder
behind."""

from __future__ import annotations

import copy
import json
from pathlib import Path

import pytest
import torch

from common.model.lora import peft_config, wrap
from common.weights import publish
from common.weights.adapters import base_identity
from learner.fencing import Marker, write_marker
from ops.export import main

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning")


@pytest.fixture(scope="module")
def base(tiny_model_dir: Path):  # type: ignore[no-untyped-def]
    from common.model.loading import load_pretrained

    return load_pretrained(str(tiny_model_dir), "float32", "cpu")


def logits(model, ids: list[int]) -> torch.Tensor:  # type: ignore[no-untyped-def]
    with torch.no_grad():
        return model(input_ids=torch.tensor([ids])).logits


def test_whole_weights_are_copied_and_load_as_they_were(base, tmp_path: Path, capsys) -> None:  # type: ignore[no-untyped-def]
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok, model = base
    trained = copy.deepcopy(model)
    with torch.no_grad():
        trained.model.norm.weight.mul_(2.0)
    pub = publish(trained, tok, tmp_path / "weights", 7, keep=2)
    # A run directory names its versions through its resolved config: the newest is taken.
    (tmp_path / "run").mkdir()
    (tmp_path / "run" / "config.json").write_text(json.dumps({"weights": {"dir": str(tmp_path / "weights")}}))
    assert main([str(tmp_path / "run"), str(tmp_path / "out")]) == 0
    assert "whole weights, copied" in capsys.readouterr().out
    assert not {"digest", "lease_token"} & {p.name for p in (tmp_path / "out").iterdir()}
    loaded = AutoModelForCausalLM.from_pretrained(tmp_path / "out")
    ids = AutoTokenizer.from_pretrained(tmp_path / "out")("1+2=").input_ids
    torch.testing.assert_close(logits(loaded, ids), logits(trained, ids), rtol=0, atol=0)
    capsys.readouterr()  # (transformers' progress bars while loading)
    # --version of a version directory, an empty run, a folder in the way: one line each, exit 2, nothing written
    cases = [
        ([pub.announcement.uri, str(tmp_path / "o1"), "--version", "3"], "is a version already"),
        ([str(tmp_path / "run"), str(tmp_path / "o2"), "--version", "3"], "no version 3"),
        ([str(tmp_path), str(tmp_path / "o3")], "neither a run directory"),
        ([str(tmp_path / "run"), str(tmp_path / "out")], "exists and is not empty"),
    ]
    for argv, said in cases:
        assert main(argv) == 2
        err = capsys.readouterr().err
        assert said in err and len(err.strip().splitlines()) == 1, err
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(("o1", "o2", "o3", ".o"))]


def test_a_run_exports_its_newest_version_not_a_fenced_out_learners(base, tmp_path: Path, capsys) -> None:  # type: ignore[no-untyped-def]
    """Learner 1 was frozen past its lease after v5; learner 2 took the run over (its marker: it found v5) and
    published v6 and v7; learner 1 woke up and wrote v9 before it found it had lost the run. The run's policy is
    learner 2's v7."""
    tok, model = base
    successor, stale = copy.deepcopy(model), copy.deepcopy(model)
    with torch.no_grad():
        successor.model.norm.weight.mul_(2.0)
        stale.model.norm.weight.mul_(3.0)
    checkpoints, weights = tmp_path / "run" / "checkpoints", tmp_path / "weights"
    write_marker(checkpoints, Marker(1, 0, -1))
    publish(model, tok, weights, 5, keep=5, token=1)
    write_marker(checkpoints, Marker(2, 4, 5))
    publish(successor, tok, weights, 7, keep=5, token=2)
    publish(stale, tok, weights, 9, keep=5, token=1)
    config = {"weights": {"dir": str(weights)}, "checkpoint": {"dir": str(checkpoints)}}
    (tmp_path / "run" / "config.json").write_text(json.dumps(config))
    assert main([str(tmp_path / "run"), str(tmp_path / "out")]) == 0
    assert "v000007" in capsys.readouterr().out
    exported = (tmp_path / "out" / "model.safetensors").read_bytes()
    assert exported == (weights / "v000007" / "model.safetensors").read_bytes()
    # Asked for by number, it is refused in one line; its directory, given as such, is exported as it is.
    assert main([str(tmp_path / "run"), str(tmp_path / "o1"), "--version", "9"]) == 2
    err = capsys.readouterr().err
    assert "after another took the run over" in err and len(err.strip().splitlines()) == 1
    assert not (tmp_path / "o1").exists()
    assert main([str(weights / "v000009"), str(tmp_path / "o2")]) == 0
    # The run's config naming checkpoints that are not there (copied without them): refused, not a guess.
    config["checkpoint"] = {"dir": str(tmp_path / "elsewhere")}
    (tmp_path / "run" / "config.json").write_text(json.dumps(config))
    assert main([str(tmp_path / "run"), str(tmp_path / "o3")]) == 2
    err = capsys.readouterr().err
    assert "holders not found" in err and len(err.strip().splitlines()) == 1, err
    assert not (tmp_path / "o3").exists()


def test_a_torn_version_is_not_exported(base, tmp_path: Path, capsys) -> None:  # type: ignore[no-untyped-def]
    tok, model = base
    pub = publish(model, tok, tmp_path / "weights", 1, keep=2)
    f = Path(pub.announcement.uri) / "model.safetensors"
    f.write_bytes(f.read_bytes()[:-8] + b"\0" * 8)
    assert main([pub.announcement.uri, str(tmp_path / "out")]) == 2
    assert "do not match its digest" in capsys.readouterr().err and not (tmp_path / "out").exists()


def test_a_lora_version_is_merged_into_its_base(base, tiny_model_dir: Path, tmp_path: Path, capsys) -> None:  # type: ignore[no-untyped-def]
    from transformers import AutoModelForCausalLM

    tok, model = base
    pm = wrap(copy.deepcopy(model), peft_config(4, 8.0, 0.0, "all-linear"))
    with torch.no_grad():
        for name, p in pm.named_parameters():
            if "lora_B" in name:
                p.normal_(0, 0.05)
    pm.eval()
    identity = base_identity(str(tiny_model_dir))
    version = publish(pm, None, tmp_path / "weights", 4, keep=2, base=identity).announcement.uri
    assert main([version, str(tmp_path / "out")]) == 0
    assert "LoRA merged into" in capsys.readouterr().out
    merged = AutoModelForCausalLM.from_pretrained(tmp_path / "out")
    ids = tok("12+3=").input_ids
    torch.testing.assert_close(logits(merged, ids), logits(pm, ids), rtol=0, atol=1e-5)
    # A base moved elsewhere is named with --base (its digest still checked); another model is refused.
    moved = {**identity, "path": str(tmp_path / "gone")}
    elsewhere = publish(pm, None, tmp_path / "weights", 5, keep=3, base=moved).announcement.uri
    assert main([elsewhere, str(tmp_path / "out2")]) == 2
    assert "--base" in capsys.readouterr().err
    assert main([elsewhere, str(tmp_path / "out2"), "--base", str(tiny_model_dir), "--dtype", "bfloat16"]) == 0
    capsys.readouterr()
    assert AutoModelForCausalLM.from_pretrained(tmp_path / "out2").dtype == torch.bfloat16
    other = copy.deepcopy(model)
    with torch.no_grad():
        other.model.norm.weight.add_(1.0)
    other.save_pretrained(tmp_path / "other")
    assert main([elsewhere, str(tmp_path / "out3"), "--base", str(tmp_path / "other")]) == 2
    assert "is not this process's" in capsys.readouterr().err and not (tmp_path / "out3").exists()
