"""LoRA versions (learner.lora) through the `sglang` engine, against the SGLang stand-in over real HTTP with SGLang
0.5.23's adapter API (tests/sglang_standin_lora.py): each version's adapter loaded under a name of its own and
named by every /generate, the one before unloaded; the log-probs are the adapted model's; refusals, ours and the
server's, leave the engine on the version it had. Where the sglang package is installed, every /generate is checked
with SGLang's own schema (its lora_path included)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from actor.engines.sglang.adapters import ALL_LINEAR, launch_args, uncovered
from actor.engines.sglang.engine import EngineError, SGLangEngine
from common.config import ConfigError, check_engine, load_config
from common.grpo.logprobs import token_logprobs
from common.weights import WeightsError, WeightsMismatch, publish
from common.weights.adapters import base_identity
from tests.adapters import adapted
from tests.integration.test_sglang_engine import check_with_sglang_schema
from tests.sglang_standin import StandIn

pytestmark = [pytest.mark.integration, pytest.mark.filterwarnings("ignore::UserWarning")]


def engine_for(model: Path, tmp: Path, url: str) -> SGLangEngine:
    cfg = load_config(None, [f"model.path={model}", f"run.dir={tmp}", f"sglang.url={url}", "learner.lora.rank=4",
                             "sampling.max_new_tokens=6", "sampling.temperature=1.0"])  # fmt: skip
    return SGLangEngine(cfg, seed=0)


def test_adapter_versions_are_loaded_named_and_unloaded(tiny_model_dir: Path, tmp_path: Path) -> None:
    from transformers import AutoModelForCausalLM

    standin = StandIn(str(tiny_model_dir), lora=(8, list(ALL_LINEAR), 4)).start()
    try:
        engine = engine_for(tiny_model_dir, tmp_path, standin.url)
        base = AutoModelForCausalLM.from_pretrained(tiny_model_dir).eval()
        identity = base_identity(str(tiny_model_dir))
        root = tmp_path / "weights"
        policy = adapted(base, 4, seed=2)
        v2 = publish(policy, None, root, 2, keep=5, base=identity).announcement
        assert engine.load(v2) > 0 and engine.version == 2
        (body,) = [b for p, b in standin.requests if p == "/load_lora_adapter"]
        assert body == {"lora_name": engine.adapter, "lora_path": str(Path(v2.uri).resolve()), "pinned": False}
        assert not [p for p, _ in standin.requests if p in ("/update_weights_from_disk", "/flush_cache")]

        # Sampled with the adapter: its name in the request, the version it was loaded as, its log-probs.
        prompts = [[5, 6, 7], [8, 9]]
        groups, version = engine.generate_versioned(prompts, 2)
        assert version == 2
        generate_body = [b for p, b in standin.requests if p == "/generate"][-1]
        assert generate_body["lora_path"] == engine.adapter
        for prompt, group in zip(prompts, groups, strict=True):
            for s in group:
                ids = torch.tensor([prompt + s.token_ids])
                with torch.no_grad():
                    logits = policy(input_ids=ids).logits[0, len(prompt) - 1 : -1]
                expected = token_logprobs(logits, torch.tensor(s.token_ids))
                assert expected.tolist() == pytest.approx(s.logprobs, abs=1e-4)

        # The next version: loaded, and the one before unloaded; announced again, the same adapter is kept.
        first = engine.adapter
        v3 = publish(adapted(base, 4, seed=3), None, root, 3, keep=5, base=identity).announcement
        engine.load(v3)
        assert engine.version == 3 and engine.adapter != first
        assert ("/unload_lora_adapter", {"lora_name": first}) in standin.requests
        engine.load(v3)
        assert standin.adapters is not None and list(standin.adapters.loaded) == [engine.adapter]
        assert engine.version == 3

        # Refused before the server sees it: an adapter trained on another base.
        loads = len([p for p, _ in standin.requests if p == "/load_lora_adapter"])
        foreign = {"path": "another-model", "digest": "xxh3-128:" + "0" * 32}
        v4 = publish(adapted(base, 4, seed=4), None, root, 4, keep=5, base=foreign).announcement
        with pytest.raises(WeightsMismatch, match="another-model"):
            engine.load(v4)
        assert len([p for p, _ in standin.requests if p == "/load_lora_adapter"]) == loads
        # Refused by the server: a rank above its --max-lora-rank. The engine keeps version 3 and its adapter.
        v5 = publish(adapted(base, 16, seed=5, alpha=32.0), None, root, 5, keep=5, base=identity).announcement
        with pytest.raises(WeightsError, match="incompatible with the current LoRA memory pool"):
            engine.load(v5)
        assert engine.version == 3 and engine.generate_versioned([[5, 6]], 1)[1] == 3
        check_with_sglang_schema(standin, replies=False)  # last: it skips where sglang's schema is not installed
    finally:
        standin.stop()


@pytest.mark.parametrize(
    ("lora", "version"),
    [(None, "default"), ((2, list(ALL_LINEAR), None), "default"), ((8, ["q_proj", "v_proj"], None), "default"),
     ((8, ["all"], None), "7")],
)  # fmt: skip
def test_a_server_that_cannot_take_our_adapters_is_refused_at_start_in_one_line(
    tiny_model_dir: Path, tmp_path: Path, lora: tuple | None, version: str
) -> None:
    """No LoRA, a lower rank, fewer layers than ours, or whole weights of some version instead of the base."""
    standin = StandIn(str(tiny_model_dir), weight_version=version, lora=lora).start()
    try:
        with pytest.raises(EngineError, match="restart it" if version == "7" else "--enable-lora --max-lora-rank 4"):
            engine_for(tiny_model_dir, tmp_path, standin.url)
    finally:
        standin.stop()


def test_layers_a_server_covers() -> None:
    assert uncovered("all-linear", ["all"]) == []
    assert uncovered("all-linear", ["qkv_proj", "o_proj", "gate_up_proj", "down_proj"]) == []
    assert uncovered(["k_proj"], ["q_proj", "v_proj"]) == []  # SGLang fuses q, k and v into one layer
    assert uncovered("all-linear", ["q_proj", "v_proj"]) == ["o_proj", "gate_proj", "up_proj", "down_proj"]


def test_launch_arguments_and_the_cpu_refusal() -> None:
    assert launch_args(16, "all-linear") == [
        "--enable-lora", "--max-lora-rank", "16", "--lora-target-modules", *ALL_LINEAR,
        "--max-loras-per-batch", "4", "--max-loaded-loras", "4",
    ]  # fmt: skip
    assert launch_args(8, ["q_proj", "v_proj"])[3:6] == ["--lora-target-modules", "q_proj", "v_proj"]
    with pytest.raises(ConfigError, match=r"learner\.lora\.rank: a SGLang server on the CPU cannot serve LoRA"):
        check_engine("sglang", "", "cpu", lora_rank=8)
    check_engine("sglang", "http://gpu-host:30000", "cpu", lora_rank=8)  # a server elsewhere: its own business
    check_engine("local", "", "cpu", lora_rank=8)
