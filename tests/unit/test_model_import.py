"""``grpo import-model``: a GGUF file, written here with the ``gguf`` package the way llama.cpp writes a Llama,
becomes an HF folder whose model computes what the original computed and whose tokenizer splits text the same way."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

gguf = pytest.importorskip("gguf", reason="the models extra (gguf) is not installed")

CHAT_TEMPLATE = "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
TEXT = "What is 7*8? Answer with the number only. 56"


def byte_level_bpe() -> Any:
    """A small byte-level BPE tokenizer (GPT-2's kind, as SmolLM2's), trained on a few lines of arithmetic."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=400, special_tokens=["<|endoftext|>", "<|im_start|>", "<|im_end|>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )  # fmt: skip
    corpus = [f"What is {a}*{b}? Answer with the number only. {a * b}" for a in range(13) for b in range(13)]
    tok.train_from_iterator(corpus * 3, trainer)
    return PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<|im_start|>", eos_token="<|im_end|>")


def tiny_llama(vocab: int) -> Any:
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=vocab, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=128, rms_norm_eps=1e-5, rope_theta=10000.0,
        tie_word_embeddings=False, bos_token_id=1, eos_token_id=2,
    )  # fmt: skip
    return LlamaForCausalLM(config).eval()


def _permute(w: torch.Tensor, heads: int) -> torch.Tensor:
    """llama.cpp's rotary layout for q/k rows (interleaved halves), which a GGUF reader undoes."""
    return w.reshape(heads, 2, w.shape[0] // heads // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def write_gguf(model: Any, tokenizer: Any, path: Path) -> None:
    c = model.config
    w = gguf.GGUFWriter(str(path), "llama")
    w.add_name("tiny-test-llama")
    w.add_block_count(c.num_hidden_layers)
    w.add_context_length(c.max_position_embeddings)
    w.add_embedding_length(c.hidden_size)
    w.add_feed_forward_length(c.intermediate_size)
    w.add_head_count(c.num_attention_heads)
    w.add_head_count_kv(c.num_key_value_heads)
    w.add_rope_dimension_count(c.hidden_size // c.num_attention_heads)
    w.add_rope_freq_base(c.rope_theta if hasattr(c, "rope_theta") else c.rope_parameters["rope_theta"])
    w.add_layer_norm_rms_eps(c.rms_norm_eps)
    w.add_vocab_size(c.vocab_size)
    w.add_file_type(gguf.LlamaFileType.ALL_F32)
    vocab = tokenizer.backend_tokenizer.get_vocab()
    tokens = [t for t, _ in sorted(vocab.items(), key=lambda kv: kv[1])]
    merges = json.loads(tokenizer.backend_tokenizer.to_str())["model"]["merges"]
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("default")
    w.add_token_list(tokens)
    w.add_token_types([3 if t.startswith("<|") else 1 for t in tokens])  # 3: control, 1: normal
    w.add_token_merges([m if isinstance(m, str) else " ".join(m) for m in merges])
    w.add_bos_token_id(tokenizer.bos_token_id)
    w.add_eos_token_id(tokenizer.eos_token_id)
    w.add_chat_template(CHAT_TEMPLATE)
    sd = {k: v.detach().float() for k, v in model.state_dict().items()}
    w.add_tensor("token_embd.weight", sd["model.embed_tokens.weight"].numpy())
    for i in range(c.num_hidden_layers):
        p = f"model.layers.{i}."
        q = _permute(sd[p + "self_attn.q_proj.weight"], c.num_attention_heads)
        k = _permute(sd[p + "self_attn.k_proj.weight"], c.num_key_value_heads)
        for name, t in [
            ("attn_norm", sd[p + "input_layernorm.weight"]), ("attn_q", q), ("attn_k", k),
            ("attn_v", sd[p + "self_attn.v_proj.weight"]), ("attn_output", sd[p + "self_attn.o_proj.weight"]),
            ("ffn_norm", sd[p + "post_attention_layernorm.weight"]), ("ffn_gate", sd[p + "mlp.gate_proj.weight"]),
            ("ffn_up", sd[p + "mlp.up_proj.weight"]), ("ffn_down", sd[p + "mlp.down_proj.weight"]),
        ]:  # fmt: skip
            w.add_tensor(f"blk.{i}.{name}.weight", t.numpy())
    w.add_tensor("output_norm.weight", sd["model.norm.weight"].numpy())
    w.add_tensor("output.weight", sd["lm_head.weight"].numpy())
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


@pytest.fixture(scope="module")
def imported(tmp_path_factory: pytest.TempPathFactory) -> tuple[Any, Any, Path, str]:
    tmp = tmp_path_factory.mktemp("gguf")
    tokenizer = byte_level_bpe()
    model = tiny_llama(len(tokenizer))
    write_gguf(model, tokenizer, tmp / "tiny.gguf")
    out = tmp / "imported"
    env = {**os.environ, "HF_HUB_OFFLINE": "1"}
    done = subprocess.run(
        [sys.executable, "-m", "common.cli", "import-model", str(tmp / "tiny.gguf"), "--out", str(out)],
        capture_output=True, text=True, timeout=300, env=env,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    return tokenizer, model, out, done.stdout


def test_a_gguf_file_becomes_a_plain_hf_folder(imported: tuple[Any, Any, Path, str]) -> None:
    _, _, out, stdout = imported
    assert stdout.strip() == str(out)  # the folder, alone on stdout, for scripts
    files = {p.name for p in out.iterdir()}
    assert "model.safetensors" in files and "config.json" in files and "tokenizer.json" in files
    config = json.loads((out / "config.json").read_text())
    assert config["architectures"] == ["LlamaForCausalLM"]
    assert "quantization_config" not in config  # a plain model, which save_pretrained and every loader accept


def test_the_imported_model_computes_what_the_original_did(imported: tuple[Any, Any, Path, str]) -> None:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer, model, out, _ = imported
    loaded_tok = AutoTokenizer.from_pretrained(out)
    loaded = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).eval()
    ids = tokenizer(TEXT).input_ids
    assert loaded_tok(TEXT, add_special_tokens=False).input_ids == ids  # the same split into the same ids
    assert loaded_tok.decode(ids) == TEXT
    assert loaded_tok.eos_token == "<|im_end|>"
    with torch.no_grad():
        want = model(torch.tensor([ids])).logits
        got = loaded(torch.tensor([ids])).logits
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)  # q/k un-permuted, every tensor in its place


def test_the_chat_template_survives(imported: tuple[Any, Any, Path, str]) -> None:
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(imported[2])
    text = tok.apply_chat_template([{"role": "user", "content": "7*8"}], tokenize=False)
    assert text == "<|im_start|>user\n7*8<|im_end|>\n"


def test_a_missing_file_or_package_is_one_line(tmp_path: Path) -> None:
    for source in [str(tmp_path / "absent.gguf"), str(tmp_path / "model.bin")]:
        (tmp_path / "model.bin").write_bytes(b"x")
        done = subprocess.run(
            [sys.executable, "-m", "common.cli", "import-model", source, "--out", str(tmp_path / "o")],
            capture_output=True, text=True, timeout=120,
        )  # fmt: skip
        assert done.returncode == 2, done.stderr
        assert len(done.stderr.strip().splitlines()) == 1 and "model.path" in done.stderr
