"""ModelConfig: the architecture facts the engine needs, parsed from a Hugging Face config.json.

Supported architectures: LlamaForCausalLM and Qwen2ForCausalLM (Qwen2 = Llama with
q/k/v biases). Unknown or unsupported settings raise ValueError naming the key.
"""

from dataclasses import dataclass
from typing import Any

SUPPORTED_ARCHITECTURES = ("LlamaForCausalLM", "Qwen2ForCausalLM")


@dataclass(frozen=True)
class ModelConfig:
    """Decoder shape and special token ids of a Llama-family checkpoint."""

    name: str
    architecture: str
    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    vocab_size: int
    max_model_len: int
    rope_theta: float
    rope_scaling: dict[str, Any] | None
    rms_norm_eps: float
    tie_word_embeddings: bool
    attention_bias: bool
    bos_token_id: int | None
    eos_token_ids: tuple[int, ...]

    @property
    def eos_token_id(self) -> int | None:
        """The primary end-of-sequence id (the first one when the config lists several)."""
        return self.eos_token_ids[0] if self.eos_token_ids else None

    @classmethod
    def from_hf_config(cls, raw: dict[str, Any], name: str) -> "ModelConfig":
        """Parse a config.json dict; raises ValueError for unsupported architectures or settings."""
        architectures = raw.get("architectures") or []
        arch = next((a for a in architectures if a in SUPPORTED_ARCHITECTURES), None)
        if arch is None:
            raise ValueError(f"config.json 'architectures' {architectures} not in {SUPPORTED_ARCHITECTURES}")
        if raw.get("hidden_act", "silu") != "silu":
            raise ValueError(f"config.json 'hidden_act' must be 'silu', got {raw['hidden_act']!r}")
        if raw.get("use_sliding_window"):
            raise ValueError("config.json 'use_sliding_window' is not supported")
        num_heads = int(raw["num_attention_heads"])
        hidden = int(raw["hidden_size"])
        theta, scaling = _rope(raw)
        eos = raw.get("eos_token_id")
        return cls(
            name=name,
            architecture=arch,
            hidden_size=hidden,
            num_layers=int(raw["num_hidden_layers"]),
            num_heads=num_heads,
            num_kv_heads=int(raw.get("num_key_value_heads") or num_heads),
            head_dim=int(raw.get("head_dim") or hidden // num_heads),
            intermediate_size=int(raw["intermediate_size"]),
            vocab_size=int(raw["vocab_size"]),
            max_model_len=int(raw.get("max_position_embeddings", 4096)),
            rope_theta=theta,
            rope_scaling=scaling,
            rms_norm_eps=float(raw.get("rms_norm_eps", 1e-6)),
            tie_word_embeddings=bool(raw.get("tie_word_embeddings", False)),
            attention_bias=arch == "Qwen2ForCausalLM" or bool(raw.get("attention_bias", False)),
            bos_token_id=raw.get("bos_token_id"),
            eos_token_ids=tuple(eos) if isinstance(eos, list) else (() if eos is None else (int(eos),)),
        )


def _rope(raw: dict[str, Any]) -> tuple[float, dict[str, Any] | None]:
    """Return (rope_theta, llama3 scaling or None) from either the v4 or the v5 config layout."""
    params = raw.get("rope_parameters") or {}
    theta = float(params.get("rope_theta", raw.get("rope_theta", 10000.0)))
    scaling = raw.get("rope_scaling") or params
    rope_type = scaling.get("rope_type", scaling.get("type", "default"))
    if rope_type == "default":
        return theta, None
    if rope_type != "llama3":
        raise ValueError(f"config.json rope type {rope_type!r} is not supported (only 'default', 'llama3')")
    return theta, dict(scaling)
