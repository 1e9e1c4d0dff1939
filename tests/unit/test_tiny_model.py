"""The tiny demo model: built offline in HF format, reloaded with the auto classes, readable by others, warm-started."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch


def test_tiny_model_reloads_offline_with_auto_classes(tiny_model_dir: Path) -> None:
    code = (
        "from transformers import AutoTokenizer, AutoModelForCausalLM;"
        f"t = AutoTokenizer.from_pretrained({str(tiny_model_dir)!r});"
        f"m = AutoModelForCausalLM.from_pretrained({str(tiny_model_dir)!r});"
        "ids = t('3+5= a b').input_ids;"
        "print(type(m).__name__, sum(p.numel() for p in m.parameters()), ids[0] == t.bos_token_id,"
        " repr(t.decode(ids, skip_special_tokens=True)))"
    )
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=120)
    name, params, bos_first, text = out.stdout.split(maxsplit=3)
    assert name == "LlamaForCausalLM"
    assert 300_000 < int(params) < 1_000_000
    assert bos_first == "True"
    assert text.strip() == "'3+5= a b'"  # one token per character, spaces kept


def test_make_tiny_model_cli(tmp_path: Path) -> None:
    r = subprocess.run(
        [sys.executable, "-m", "common.cli", "make-tiny-model", str(tmp_path / "m"), "--no-warm-start"],
        capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert r.returncode == 0, r.stderr
    assert {"config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json"} <= {
        p.name for p in (tmp_path / "m").iterdir()
    }


def test_the_tiny_model_is_readable_by_other_users_and_kept_when_asked(tmp_path: Path) -> None:
    """Mounted into containers it is read by the images' user: safetensors' owner-only files get the umask's mode
    (022 here: 0644). With --if-missing a model of the same recipe, seed and warm start is kept, not rebuilt."""
    cmd = [sys.executable, "-m", "common.cli", "make-tiny-model", str(tmp_path / "m"), "--no-warm-start"]
    run = lambda *extra: subprocess.run([*cmd, *extra], capture_output=True, text=True, timeout=300,  # noqa: E731
                                        preexec_fn=lambda: os.umask(0o022))  # fmt: skip
    assert run().returncode == 0
    modes = {p.name: p.stat().st_mode & 0o777 for p in (tmp_path / "m").iterdir()}
    assert set(modes.values()) == {0o644}, modes
    assert (tmp_path / "m").stat().st_mode & 0o777 == 0o755
    made = (tmp_path / "m" / "model.safetensors").stat().st_mtime_ns
    kept = run("--if-missing")
    assert kept.returncode == 0 and "holds the demo model already" in kept.stderr, kept.stderr
    assert (tmp_path / "m" / "model.safetensors").stat().st_mtime_ns == made
    other_seed = run("--if-missing", "--seed", "1")  # another model: built, replacing the folder
    assert other_seed.returncode == 0 and "wrote" in other_seed.stderr
    assert json.loads((tmp_path / "m" / "warm_start.json").read_text())["seed"] == 1


@pytest.mark.slow
def test_warm_start_leaves_the_demo_model_at_its_documented_starting_point(demo_model_dir: Path) -> None:
    import json

    from common.model.loading import load_pretrained
    from common.tasks import addition_task
    from ops.tiny_model import accuracy

    report = json.loads((demo_model_dir / "warm_start.json").read_text())
    assert report["greedy_answer_accuracy"] >= 0.99
    tok, model = load_pretrained(str(demo_model_dir), "float32", "cpu")
    task = addition_task(20, 0)
    torch.manual_seed(0)
    assert 0.1 <= accuracy(model, tok, task.all, greedy=False) <= 0.45  # sampled reward starts near 0.3
    assert accuracy(model, tok, task.eval, greedy=True) <= 0.1  # greedy: the habit (a space) wins
    assert accuracy(model, tok, task.eval, greedy=True, strict=False) >= 0.95  # ... but the sums are known
