"""Build a tiny Llama-shaped model directory for running real vLLM on CPU with dummy weights.

No weights are written (vLLM's ``--load-format dummy`` makes random ones); the directory holds
``config.json``, a byte-level BPE ``tokenizer.json`` trained here on a deterministic synthetic
corpus, ``tokenizer_config.json`` (with a chat template) and ``generation_config.json``. The
result is deterministic for the same arguments. Used by the tests, the benchmarks and the CPU
compose profile::

    python -m engine_patch.tiny_model /tmp/tiny-llama

``--architecture qwen3`` writes the same model as a Qwen3 (``Qwen3ForCausalLM``): one of the
architectures vLLM 0.33's decisions API (``/v1/decisions``) serves, started with
``--logprobs-mode raw_logprobs``. Its tokenizer also has ``yes`` and ``no`` as tokens of
their own (`DECISION_WORDS`): vLLM reads a decision from the logprobs of one label token
right after the chat prompt (A-Z, 0-9, yes, no), and refuses a tokenizer that splits one.

`build_lora` (``--lora DIR``) writes a LoRA adapter for the built model in PEFT's format
(``adapter_config.json`` and small random ``adapter_model.safetensors`` for ``q_proj`` and
``v_proj``, deterministic per seed): what vLLM loads with ``--enable-lora --lora-modules
name=DIR`` or ``POST /v1/load_lora_adapter``.
"""

from __future__ import annotations

import argparse
import json
import random
from pathlib import Path

CHAT_TEMPLATE = (
    "{{ bos_token }}"
    "{% for message in messages %}"
    "<|{{ message['role'] }}|>\n{{ message['content'] }}{{ eos_token }}\n"
    "{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>\n{% endif %}"
)

_SPECIAL = ["<unk>", "<s>", "</s>", "<|system|>", "<|user|>", "<|assistant|>"]
ARCHITECTURES = ("llama", "qwen3")
"""What `build` can write (see the module docstring)."""
DECISION_WORDS = ("yes", "no")
"""Labels of vLLM's decisions API that a small BPE splits: whole tokens in the qwen3 build."""


def _corpus(seed: int, n_lines: int) -> list[str]:
    rng = random.Random(seed)
    syllables = ["ka", "lo", "mi", "ne", "ru", "sa", "ti", "vo", "xe", "zu", "an", "or", "el"]
    words = ["".join(rng.choice(syllables) for _ in range(rng.randint(1, 4))) for _ in range(3000)]
    words += ["the", "a", "of", "token", "request", "gpu", "cache", "hello", "world", "prompt"]
    return [" ".join(rng.choice(words) for _ in range(rng.randint(4, 30))) for _ in range(n_lines)]


def build_tokenizer_json(
    vocab_size: int = 2048, seed: int = 0, extra_tokens: tuple[str, ...] = ()
) -> str:
    """Train a byte-level BPE tokenizer and return its ``tokenizer.json`` text; `extra_tokens`
    become tokens of their own (added, not special: they decode as text)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=_SPECIAL,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(_corpus(seed, 4000), trainer=trainer)
    bos_id = tok.token_to_id("<s>")
    tok.post_processor = processors.TemplateProcessing(
        single="<s> $A", pair="<s> $A <s> $B", special_tokens=[("<s>", bos_id)]
    )
    if extra_tokens:
        tok.add_tokens(list(extra_tokens))
    return str(tok.to_str())


def build(
    out_dir: Path,
    *,
    vocab_size: int = 2048,
    max_model_len: int = 4096,
    hidden_size: int = 64,
    num_layers: int = 2,
    seed: int = 0,
    architecture: str = "llama",
) -> Path:
    """Write the model directory (idempotent) and return its path."""
    from tokenizers import Tokenizer

    if architecture not in ARCHITECTURES:
        raise ValueError(f"architecture must be one of {ARCHITECTURES}, got {architecture!r}")
    qwen3 = architecture == "qwen3"
    out_dir.mkdir(parents=True, exist_ok=True)
    tok_text = build_tokenizer_json(vocab_size, seed, DECISION_WORDS if qwen3 else ())
    (out_dir / "tokenizer.json").write_text(tok_text)
    real_vocab = Tokenizer.from_str(tok_text).get_vocab_size()
    head_dim = 32
    num_heads = hidden_size // head_dim
    config = {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "vocab_size": real_vocab,
        "hidden_size": hidden_size,
        "intermediate_size": hidden_size * 2,
        "num_hidden_layers": num_layers,
        "num_attention_heads": num_heads,
        "num_key_value_heads": num_heads,
        "head_dim": head_dim,
        "max_position_embeddings": max_model_len,
        "rms_norm_eps": 1e-5,
        "rope_theta": 10000.0,
        "hidden_act": "silu",
        "tie_word_embeddings": False,
        "bos_token_id": 1,
        "eos_token_id": 2,
        "torch_dtype": "bfloat16",
    }
    if qwen3:
        config.update(
            {
                "architectures": ["Qwen3ForCausalLM"],
                "model_type": "qwen3",
                "attention_bias": False,
                "attention_dropout": 0.0,
                "use_sliding_window": False,
                "sliding_window": None,
                "max_window_layers": num_layers,
            }
        )
    (out_dir / "config.json").write_text(json.dumps(config, indent=2))
    tok_config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": "<s>",
        "eos_token": "</s>",
        "unk_token": "<unk>",
        "model_max_length": max_model_len,
        "add_bos_token": True,
        "chat_template": CHAT_TEMPLATE,
    }
    (out_dir / "tokenizer_config.json").write_text(json.dumps(tok_config, indent=2))
    gen = {"bos_token_id": 1, "eos_token_id": 2}
    (out_dir / "generation_config.json").write_text(json.dumps(gen, indent=2))
    return out_dir


LORA_TARGETS = ("q_proj", "v_proj")


def build_lora(model_dir: Path, out_dir: Path, *, rank: int = 8, seed: int = 0) -> Path:
    """Write a LoRA adapter of rank `rank` for the model in `model_dir` (idempotent) and
    return its path. Its weights are small random numbers: it changes the model's output,
    which is all a scheduling or routing test needs of it."""
    import numpy as np
    from safetensors.numpy import save_file

    config = json.loads((model_dir / "config.json").read_text())
    hidden = int(config["hidden_size"])
    head_dim = int(config.get("head_dim", hidden // config["num_attention_heads"]))
    outputs = {
        "q_proj": int(config["num_attention_heads"]) * head_dim,
        "v_proj": int(config.get("num_key_value_heads", config["num_attention_heads"])) * head_dim,
    }
    rng = np.random.default_rng(seed)
    tensors = {}
    for layer in range(int(config["num_hidden_layers"])):
        for module in LORA_TARGETS:
            prefix = f"base_model.model.model.layers.{layer}.self_attn.{module}"
            a = rng.normal(0.0, 0.01, (rank, hidden)).astype(np.float32)
            b = rng.normal(0.0, 0.01, (outputs[module], rank)).astype(np.float32)
            tensors[f"{prefix}.lora_A.weight"] = a
            tensors[f"{prefix}.lora_B.weight"] = b
    out_dir.mkdir(parents=True, exist_ok=True)
    adapter = {
        "peft_type": "LORA",
        "task_type": "CAUSAL_LM",
        "r": rank,
        "lora_alpha": 2 * rank,
        "lora_dropout": 0.0,
        "target_modules": list(LORA_TARGETS),
        "bias": "none",
        "fan_in_fan_out": False,
        "modules_to_save": None,
        "base_model_name_or_path": str(model_dir),
    }
    (out_dir / "adapter_config.json").write_text(json.dumps(adapter, indent=2))
    save_file(tensors, str(out_dir / "adapter_model.safetensors"))
    return out_dir


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("out_dir", type=Path)
    parser.add_argument("--max-model-len", type=int, default=4096)
    parser.add_argument("--vocab-size", type=int, default=2048)
    parser.add_argument("--architecture", choices=ARCHITECTURES, default="llama")
    parser.add_argument("--lora", type=Path, help="also write a LoRA adapter for it here")
    args = parser.parse_args(argv)
    path = build(
        args.out_dir,
        vocab_size=args.vocab_size,
        max_model_len=args.max_model_len,
        architecture=args.architecture,
    )
    print(path)
    if args.lora is not None:
        print(build_lora(path, args.lora))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
