"""Checkpoints in Hugging Face layout: write a small random Llama (``make_model``) and load one.

A generated model folder holds config.json, model.safetensors, tokenizer.json and
tokenizer_config.json (with a Llama-3-style chat template). Weights come from a
seeded generator, so the same arguments always give the same bytes.
"""

import json
import math
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file, save_file

from engine.config import ModelConfig
from engine.tokenizer import BOS_TOKEN, EOT_TOKEN, build_byte_level_tokenizer

CHAT_TEMPLATE = (
    "{{ bos_token }}{% for message in messages %}"
    "<|start_header_id|>{{ message['role'] }}<|end_header_id|>\n\n{{ message['content'] | trim }}<|eot_id|>"
    "{% endfor %}{% if add_generation_prompt %}<|start_header_id|>assistant<|end_header_id|>\n\n{% endif %}"
)

DEFAULT_SHAPE: dict[str, int] = {
    "hidden_size": 512,
    "num_hidden_layers": 4,
    "num_attention_heads": 8,
    "num_key_value_heads": 2,
    "intermediate_size": 1408,
    "max_position_embeddings": 4096,
}


def make_model(out_dir: str | Path, seed: int = 0, **shape: int) -> Path:
    """Write a random-weight LlamaForCausalLM folder; ``shape`` overrides keys of ``DEFAULT_SHAPE``.

    Linear weights use std 1/sqrt(fan_in) and embeddings std 1, so attention and MLP
    both move the residual stream and the logits have a std of about 2: the top-1 /
    top-2 gap is then far above float noise, and greedy decoding is stable.
    """
    unknown = set(shape) - set(DEFAULT_SHAPE)
    if unknown:
        raise ValueError(f"unknown shape keys {sorted(unknown)}; allowed: {sorted(DEFAULT_SHAPE)}")
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    tokenizer = build_byte_level_tokenizer()
    config = _llama_config({**DEFAULT_SHAPE, **shape}, tokenizer.get_vocab_size())
    config["bos_token_id"] = tokenizer.token_to_id(BOS_TOKEN)
    config["eos_token_id"] = tokenizer.token_to_id(EOT_TOKEN)
    (out / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    save_file(_random_weights(config, seed), str(out / "model.safetensors"), metadata={"format": "pt"})
    tokenizer.save(str(out / "tokenizer.json"))
    tokenizer_config = {"bos_token": BOS_TOKEN, "eos_token": EOT_TOKEN, "chat_template": CHAT_TEMPLATE}
    (out / "tokenizer_config.json").write_text(json.dumps(tokenizer_config, indent=2) + "\n")
    return out


def _llama_config(shape: dict[str, int], vocab_size: int) -> dict[str, Any]:
    """Return the config.json dict of a generated Llama."""
    return {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        **shape,
        "head_dim": shape["hidden_size"] // shape["num_attention_heads"],
        "vocab_size": vocab_size,
        "hidden_act": "silu",
        "rope_theta": 10000.0,
        "rms_norm_eps": 1e-5,
        "tie_word_embeddings": False,
        "attention_bias": False,
        "mlp_bias": False,
        "torch_dtype": "float32",
    }


def _random_weights(config: dict[str, Any], seed: int) -> dict[str, torch.Tensor]:
    """Generate the state dict in a fixed order from one seeded generator."""
    gen = torch.Generator().manual_seed(seed)
    hidden, inter = config["hidden_size"], config["intermediate_size"]
    head_dim = config["head_dim"]
    q_out = config["num_attention_heads"] * head_dim
    kv_out = config["num_key_value_heads"] * head_dim

    def linear(out_features: int, in_features: int) -> torch.Tensor:
        return torch.randn(out_features, in_features, generator=gen) / math.sqrt(in_features)

    weights = {"model.embed_tokens.weight": torch.randn(config["vocab_size"], hidden, generator=gen)}
    for i in range(config["num_hidden_layers"]):
        p = f"model.layers.{i}."
        weights[p + "self_attn.q_proj.weight"] = linear(q_out, hidden)
        weights[p + "self_attn.k_proj.weight"] = linear(kv_out, hidden)
        weights[p + "self_attn.v_proj.weight"] = linear(kv_out, hidden)
        weights[p + "self_attn.o_proj.weight"] = linear(hidden, q_out)
        weights[p + "mlp.gate_proj.weight"] = linear(inter, hidden)
        weights[p + "mlp.up_proj.weight"] = linear(inter, hidden)
        weights[p + "mlp.down_proj.weight"] = linear(hidden, inter)
        weights[p + "input_layernorm.weight"] = torch.ones(hidden)
        weights[p + "post_attention_layernorm.weight"] = torch.ones(hidden)
    weights["model.norm.weight"] = torch.ones(hidden)
    weights["lm_head.weight"] = 2.0 * linear(config["vocab_size"], hidden)
    return weights


def load_model_config(model_dir: str | Path) -> ModelConfig:
    """Read a model folder's config.json (no weights)."""
    folder = Path(model_dir)
    config_path = folder / "config.json"
    if not config_path.is_file():
        raise FileNotFoundError(f"no config.json in {folder}")
    return ModelConfig.from_hf_config(json.loads(config_path.read_text()), name=folder.name)


def load_checkpoint(model_dir: str | Path) -> tuple[ModelConfig, dict[str, torch.Tensor]]:
    """Read config.json and every ``*.safetensors`` file (sharded checkpoints too) of a model folder."""
    folder = Path(model_dir)
    config = load_model_config(folder)
    shards = sorted(folder.glob("*.safetensors"))
    if not shards:
        raise FileNotFoundError(f"no *.safetensors weights in {folder}")
    state: dict[str, torch.Tensor] = {}
    for shard in shards:
        state.update(load_file(str(shard)))
    return config, state
