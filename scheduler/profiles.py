"""Cost-model profiles: the coefficients the policy predicts with and the simulated instances run at.

Two sources:

- ``measured_cpu``: coefficients fitted from this machine's engine (a tiny model on CPU), or any JSON
  with the ``prefill`` / ``decode`` dicts a worker publishes with its etcd record.
- ``analytic_gpu``: the paper's model of a LLaMA3-70B-like model on one 8 x A800 node, in closed form.
  Prefill FLOPs = l * (a * n^2 * d + b * n * d^2). With ``cached`` tokens already in the cache, new
  token i attends to ``cached + i`` tokens, so the n^2 term generalises to ``2 * new * (cached + new/2)``
  (equal to n^2 when nothing is cached) and the model is exactly ``PrefillModel``'s form::

      c1 = l * b * d^2 / F          c2 = 2 * l * a * d / F          F = gpus * peak * MFU

  Decode is bound by memory bandwidth: a step reads the weights once and every sequence's KV::

      d0 = weight_bytes / B     d1 = 2 * params / F (per-sequence compute)     d2 = kv_bytes_per_token / B
      B = gpus * hbm_bandwidth * bandwidth_efficiency

The same coefficients drive both the policy's predictions and the simulated instances, so prediction
error in the simulation comes only from what the policy cannot know (queues that change, chunking,
evictions, decode contexts that grow), not from a wrong model.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any

from scheduler.cost_model import DecodeModel, PrefillModel, TransferModel


@dataclass(frozen=True)
class Profile:
    """Everything instance-specific the simulator needs."""

    name: str
    prefill: PrefillModel
    decode: DecodeModel
    link: TransferModel  # KV copies between prefill instances and prompt KV to decode
    bytes_per_token: int  # KV bytes per token (all layers, K and V)
    prefill_cache_tokens: int  # per prefill (or colocated) instance: prefix-cache capacity
    decode_kv_tokens: int  # per decode (or colocated) instance: KV capacity for running requests
    max_running: int  # per decode instance: max_concurrent_requests
    chunk_tokens: int  # max_num_batched_tokens: prefill runs in chunks of at most this many tokens

    def bytes_per_block(self, block_size: int) -> int:
        """KV bytes of one block."""
        return self.bytes_per_token * block_size

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready form (the inverse of ``from_dict``)."""
        data = asdict(self)
        data["link"] = {"latency_s": self.link.latency_s, "bandwidth_bytes_per_s": self.link.bandwidth_bytes_per_s}
        return data

    @classmethod
    def from_dict(cls, data: dict[str, Any], base: Profile | None = None) -> Profile:
        """A profile from JSON; keys missing from ``data`` come from ``base``."""
        if base is None and "name" not in data:
            raise ValueError("a profile needs 'name' (or a base profile to extend)")
        known = set(cls.__dataclass_fields__)
        unknown = set(data) - known
        if unknown:
            raise ValueError(f"unknown profile keys: {', '.join(sorted(unknown))}")
        fields: dict[str, Any] = {}
        if "prefill" in data:
            fields["prefill"] = PrefillModel.from_dict(data["prefill"])
        if "decode" in data:
            fields["decode"] = DecodeModel.from_dict(data["decode"])
        if "link" in data:
            link = data["link"]
            fields["link"] = TransferModel(float(link["latency_s"]), float(link["bandwidth_bytes_per_s"]))
        for key in known - {"prefill", "decode", "link"}:
            if key in data:
                fields[key] = data[key] if key == "name" else int(data[key])
        if base is not None:
            return replace(base, **fields)
        return cls(**fields)


def load_profile(path: Path | str, base: Profile | None = None) -> Profile:
    """A profile from a JSON file (see ``Profile.from_dict``)."""
    return Profile.from_dict(json.loads(Path(path).read_text()), base)


def measured_cpu() -> Profile:
    """The engine as measured here: a tiny Llama on 2 CPU cores (coefficients from a start-up profile run)."""
    return Profile(
        name="measured-cpu",
        prefill=PrefillModel(c0=0.002, c1=0.00033, c2=2e-8),
        decode=DecodeModel(d0=0.005, d1=0.0006, d2=2.5e-6),
        link=TransferModel.from_gbps(10.0),
        bytes_per_token=2 * 4 * 2 * 64 * 4,  # K+V x 4 layers x 2 KV heads x head_dim 64 x fp32
        prefill_cache_tokens=2_000_000,
        decode_kv_tokens=1_000_000,
        max_running=64,
        chunk_tokens=2048,
    )


@dataclass(frozen=True)
class GpuSpec:
    """The analytic model's inputs (defaults: LLaMA3-70B-like on 8 x A800-80GB, 100 Gbps between nodes)."""

    layers: int = 80  # l
    hidden: int = 8192  # d
    attn_coef: float = 4.0  # a
    linear_coef: float = 22.0  # b
    kv_heads: int = 8  # GQA 8
    head_dim: int = 128
    kv_dtype_bytes: int = 2
    params: float = 70e9
    weight_dtype_bytes: int = 2
    gpus: int = 8
    peak_flops: float = 312e12  # A800 dense BF16
    mfu: float = 0.5
    hbm_bytes: float = 80e9
    hbm_bandwidth: float = 2.0e12
    bandwidth_efficiency: float = 0.6
    kv_memory_fraction: float = 0.9  # of HBM, after which the weights are subtracted
    dram_cache_bytes: float = 1e12  # per prefill node: the CPU-memory KV pool (Mooncake Store)
    link_gbps: float = 100.0
    link_latency_s: float = 0.001
    launch_overhead_s: float = 0.005  # fixed cost of a prefill chunk
    max_running: int = 128
    chunk_tokens: int = 8192

    @property
    def kv_bytes_per_token(self) -> int:
        """K and V of every layer: 2 * l * kv_heads * head_dim * dtype bytes (320 KiB for the defaults)."""
        return 2 * self.layers * self.kv_heads * self.head_dim * self.kv_dtype_bytes


def analytic_gpu(spec: GpuSpec | None = None) -> Profile:
    """The paper's analytic model turned into ``PrefillModel`` / ``DecodeModel`` coefficients (closed form)."""
    s = spec or GpuSpec()
    flops = s.gpus * s.peak_flops * s.mfu
    bandwidth = s.gpus * s.hbm_bandwidth * s.bandwidth_efficiency
    weight_bytes = s.params * s.weight_dtype_bytes
    kv_hbm = s.gpus * s.hbm_bytes * s.kv_memory_fraction - weight_bytes
    return Profile(
        name=f"analytic-gpu (LLaMA3-70B-like, {s.gpus}xA800, MFU {s.mfu}, HBM eff {s.bandwidth_efficiency})",
        prefill=PrefillModel(
            c0=s.launch_overhead_s,
            c1=s.layers * s.linear_coef * s.hidden**2 / flops,
            c2=2 * s.layers * s.attn_coef * s.hidden / flops,
        ),
        decode=DecodeModel(d0=weight_bytes / bandwidth, d1=2 * s.params / flops, d2=s.kv_bytes_per_token / bandwidth),
        link=TransferModel.from_gbps(s.link_gbps, s.link_latency_s),
        bytes_per_token=s.kv_bytes_per_token,
        prefill_cache_tokens=int(s.dram_cache_bytes // s.kv_bytes_per_token),
        decode_kv_tokens=int(kv_hbm // s.kv_bytes_per_token),
        max_running=s.max_running,
        chunk_tokens=s.chunk_tokens,
    )


def analytic_gpu_linear() -> Profile:
    """analytic-gpu without the attention term (c2 = 0): a prefill costs c0 + c1 per new token, whatever is cached.

    This is exactly what a prefill table indexed by new tokens alone charges (Dynamo's mocker looks a chunk's
    time up by its uncached tokens), so its engines and ours run one cost model in a like-for-like comparison.
    """
    profile = analytic_gpu(GpuSpec(attn_coef=0.0))
    return replace(profile, name=profile.name.replace("analytic-gpu", "analytic-gpu-linear", 1))


PROFILES = {"analytic-gpu": analytic_gpu, "analytic-gpu-linear": analytic_gpu_linear, "measured-cpu": measured_cpu}


def named_profile(spec: str) -> Profile:
    """A built-in profile by name (``PROFILES``), else a JSON file whose missing keys come from analytic-gpu."""
    if spec in PROFILES:
        return PROFILES[spec]()
    if not Path(spec).is_file():
        raise ValueError(f"no profile {spec!r}: give one of {', '.join(PROFILES)} or a JSON file")
    return load_profile(spec, analytic_gpu())
