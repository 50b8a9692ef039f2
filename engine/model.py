"""Llama-family decoder (Llama, Qwen2) over a paged KV pool.

Module names mirror Hugging Face's, so a checkpoint's state dict loads as is:
RMSNorm, rotary embeddings (rope_theta, optional Llama-3 scaling), grouped-query
attention through ``paged_attention``, SwiGLU MLP, tied or untied LM head.
"""

import math

import torch
import torch.nn.functional as F
from torch import nn

from engine.attention import AttentionBatch, paged_attention
from engine.config import ModelConfig
from engine.kv_pool import KVPool


class RMSNorm(nn.Module):
    """Root-mean-square layer norm, computed in float32 like the reference."""

    def __init__(self, size: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Normalize the last dimension of ``x``."""
        x32 = x.float()
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x32.to(x.dtype)


def rope_cos_sin(config: ModelConfig) -> tuple[torch.Tensor, torch.Tensor]:
    """Return cos/sin tables ``[max_model_len, head_dim]`` (rotate-half layout)."""
    dim = config.head_dim
    inv_freq = 1.0 / (config.rope_theta ** (torch.arange(0, dim, 2, dtype=torch.int64, device="cpu").float() / dim))
    if config.rope_scaling is not None:
        inv_freq = _llama3_inv_freq(inv_freq, config.rope_scaling)
    freqs = torch.outer(torch.arange(config.max_model_len, dtype=torch.float32, device="cpu"), inv_freq)
    emb = torch.cat((freqs, freqs), dim=-1)
    return emb.cos(), emb.sin()


def _llama3_inv_freq(inv_freq: torch.Tensor, scaling: dict[str, float]) -> torch.Tensor:
    """Llama-3 frequency scaling: long wavelengths divided by ``factor``, smooth blend in between."""
    factor, low, high = scaling["factor"], scaling["low_freq_factor"], scaling["high_freq_factor"]
    old_len = scaling["original_max_position_embeddings"]
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > old_len / low, inv_freq / factor, inv_freq)
    smooth = (old_len / wavelen - low) / (high - low)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    is_medium = (wavelen >= old_len / high) & (wavelen <= old_len / low)
    return torch.where(is_medium, smoothed, scaled)


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Apply rotary embedding to ``x`` [T, H, D] with cos/sin [T, 1, D]."""
    x1, x2 = x.chunk(2, dim=-1)
    return x * cos + torch.cat((-x2, x1), dim=-1) * sin


class Attention(nn.Module):
    """Grouped-query self-attention reading and writing one layer of the KV pool."""

    def __init__(self, config: ModelConfig, layer_idx: int) -> None:
        super().__init__()
        self.layer_idx = layer_idx
        self.num_heads, self.num_kv_heads, self.head_dim = (
            config.num_heads,
            config.num_kv_heads,
            config.head_dim,
        )
        bias = config.attention_bias
        self.q_proj = nn.Linear(config.hidden_size, self.num_heads * self.head_dim, bias=bias)
        self.k_proj = nn.Linear(config.hidden_size, self.num_kv_heads * self.head_dim, bias=bias)
        self.v_proj = nn.Linear(config.hidden_size, self.num_kv_heads * self.head_dim, bias=bias)
        self.o_proj = nn.Linear(self.num_heads * self.head_dim, config.hidden_size, bias=False)

    def forward(
        self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, pool: KVPool, batch: AttentionBatch
    ) -> torch.Tensor:
        """Attend the tokens ``x`` [T, hidden] to their requests' context."""
        q = _rotate(self.q_proj(x).view(-1, self.num_heads, self.head_dim), cos, sin)
        k = _rotate(self.k_proj(x).view(-1, self.num_kv_heads, self.head_dim), cos, sin)
        v = self.v_proj(x).view(-1, self.num_kv_heads, self.head_dim)
        out: torch.Tensor = self.o_proj(paged_attention(q, k, v, pool, self.layer_idx, batch))
        return out


class MLP(nn.Module):
    """SwiGLU feed-forward block."""

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(config.hidden_size, config.intermediate_size, bias=False)
        self.up_proj = nn.Linear(config.hidden_size, config.intermediate_size, bias=False)
        self.down_proj = nn.Linear(config.intermediate_size, config.hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Apply down(silu(gate(x)) * up(x))."""
        out: torch.Tensor = self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))
        return out


class DecoderLayer(nn.Module):
    """Pre-norm transformer block."""

    def __init__(self, config: ModelConfig, layer_idx: int) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.self_attn = Attention(config, layer_idx)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.mlp = MLP(config)

    def forward(
        self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, pool: KVPool, batch: AttentionBatch
    ) -> torch.Tensor:
        """Run attention then MLP, each with a residual connection."""
        x = x + self.self_attn(self.input_layernorm(x), cos, sin, pool, batch)
        out: torch.Tensor = x + self.mlp(self.post_attention_layernorm(x))
        return out


class Decoder(nn.Module):
    """Embeddings, decoder layers and the final norm (``model.*`` in the checkpoint)."""

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(config, i) for i in range(config.num_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)


class CausalLM(nn.Module):
    """The whole model: ``forward`` returns final hidden states, ``compute_logits`` projects them."""

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.config = config
        self.model = Decoder(config)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        self.rope_cos, self.rope_sin = rope_cos_sin(config)  # on the CPU even when built on "meta"

    @classmethod
    def from_state_dict(cls, config: ModelConfig, state: dict[str, torch.Tensor], dtype: torch.dtype) -> "CausalLM":
        """Build the model around checkpoint tensors (strict: missing or unexpected keys raise)."""
        state = {k: v.to(dtype) for k, v in state.items() if not k.endswith("rotary_emb.inv_freq")}
        if config.tie_word_embeddings:
            state["lm_head.weight"] = state["model.embed_tokens.weight"]
        with torch.device("meta"):
            model = cls(config)
        model.load_state_dict(state, strict=True, assign=True)
        return model.eval()

    def forward(self, batch: AttentionBatch, pool: KVPool) -> torch.Tensor:
        """Run the decoder over the flat batch; returns hidden states [T, hidden]."""
        x = self.model.embed_tokens(batch.input_ids)
        cos = self.rope_cos[batch.positions].unsqueeze(1).to(x.dtype)
        sin = self.rope_sin[batch.positions].unsqueeze(1).to(x.dtype)
        for layer in self.model.layers:
            x = layer(x, cos, sin, pool, batch)
        out: torch.Tensor = self.model.norm(x)
        return out

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Project hidden states to float32 vocabulary logits."""
        logits: torch.Tensor = self.lm_head(hidden)
        return logits.float()
