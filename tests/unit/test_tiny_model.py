"""The tiny model directories the real-vLLM tests serve (`engine_patch.tiny_model`)."""

from __future__ import annotations

import json
import string
from pathlib import Path
from typing import Any

import pytest
from transformers import AutoTokenizer

from engine_patch import tiny_model


def test_the_llama_build_is_unchanged_by_the_qwen3_option(tmp_path: Path) -> None:
    llama = tiny_model.build(tmp_path / "llama")
    config = json.loads((llama / "config.json").read_text())
    assert config["architectures"] == ["LlamaForCausalLM"]
    tok = AutoTokenizer.from_pretrained(str(llama))
    assert len(tok.encode("yes", add_special_tokens=False)) > 1  # no decision words added


def test_the_qwen3_build_reads_every_decision_label_as_one_token(qwen3_model_dir: Path) -> None:
    # vLLM 0.33's decisions API reads an answer from the logprobs of one label token right
    # after the chat prompt, and refuses a model whose tokenizer splits a label (the route
    # then answers 501): A-Z (choices), yes/no (predicates), 0-9 (scores).
    config = json.loads((qwen3_model_dir / "config.json").read_text())
    assert config["architectures"] == ["Qwen3ForCausalLM"]
    tok = AutoTokenizer.from_pretrained(str(qwen3_model_dir))
    assert config["vocab_size"] == len(tok)
    prompt = tok.apply_chat_template(
        [{"role": "user", "content": "x"}],
        add_generation_prompt=True,
        tokenize=True,
        return_dict=False,
    )
    added = set(tok.get_added_vocab().values())
    start = max((i + 1 for i, t in enumerate(prompt) if t in added), default=0)
    tail = list(prompt[start:])
    text = tok.decode(tail)
    for labels in (string.ascii_uppercase, ("yes", "no"), string.digits):
        ids = []
        for label in labels:
            extended = tok.encode(text + label, add_special_tokens=False)
            assert extended[:-1] == tail, label
            ids.append(extended[-1])
        assert len(set(ids)) == len(ids)


def test_an_unknown_architecture_is_refused(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="architecture must be one of"):
        tiny_model.build(tmp_path, architecture="gpt2")


def test_the_lora_adapter_fits_the_model_and_is_deterministic(
    tiny_model_dir: Path, tmp_path: Path
) -> None:
    # vLLM refuses an adapter whose weight shapes do not match the model's projections.
    from safetensors.numpy import load_file

    def weights_of(adapter: Path) -> dict[str, Any]:
        return load_file(str(adapter / "adapter_model.safetensors"))

    adapter = tiny_model.build_lora(tiny_model_dir, tmp_path / "a", rank=4, seed=3)
    config = json.loads((tiny_model_dir / "config.json").read_text())
    peft = json.loads((adapter / "adapter_config.json").read_text())
    assert peft["peft_type"] == "LORA"
    assert peft["r"] == 4
    assert peft["target_modules"] == ["q_proj", "v_proj"]
    weights = weights_of(adapter)
    assert len(weights) == 4 * config["num_hidden_layers"]
    q = "base_model.model.model.layers.0.self_attn.q_proj"
    assert weights[f"{q}.lora_A.weight"].shape == (4, config["hidden_size"])
    heads_dim = config["num_attention_heads"] * config["head_dim"]
    assert weights[f"{q}.lora_B.weight"].shape == (heads_dim, 4)
    again = weights_of(tiny_model.build_lora(tiny_model_dir, tmp_path / "b", rank=4, seed=3))
    assert all((again[k] == v).all() for k, v in weights.items())
    other = weights_of(tiny_model.build_lora(tiny_model_dir, tmp_path / "c", rank=4, seed=4))
    assert any((other[k] != v).any() for k, v in weights.items())
