"""Sampling parameters and the sampler.

Reproducibility across processes: the token at output index ``i`` of a request
depends only on (its logits, ``seed``, ``i``): each sampled token draws one uniform
number from a generator seeded with sha256(seed, i). A prefill worker that
samples token 0 and a decode worker that samples the rest therefore produce the
same sequence as a single engine would.
"""

import hashlib
import math
import random
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class SamplingParams:
    """How to pick tokens and when to stop (``temperature == 0``: greedy; ``top_k == 0``: no top-k)."""

    max_tokens: int = 16
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int | None = None
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    logprobs: bool = False  # report the log-probability of each chosen token

    def __post_init__(self) -> None:
        """Validate every field; raise ValueError naming the bad one."""
        if self.max_tokens < 1:
            raise ValueError(f"max_tokens must be >= 1, got {self.max_tokens}")
        if not (math.isfinite(self.temperature) and self.temperature >= 0):
            raise ValueError(f"temperature must be a finite number >= 0, got {self.temperature}")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.top_k < 0:
            raise ValueError(f"top_k must be >= 0 (0 disables it), got {self.top_k}")
        if self.seed is not None and not 0 <= self.seed < 2**64:
            raise ValueError(f"seed must be in [0, 2**64), got {self.seed}")
        if any(t < 0 for t in self.stop_token_ids):
            raise ValueError(f"stop_token_ids must be non-negative, got {self.stop_token_ids}")
        object.__setattr__(self, "stop_token_ids", tuple(self.stop_token_ids))

    def with_seed(self) -> "SamplingParams":
        """Return these params with a random seed filled in when none was given (and sampling is random)."""
        if self.seed is not None or self.temperature == 0:
            return self
        return SamplingParams(**{**self.__dict__, "seed": random.getrandbits(63)})


def sample(logits: torch.Tensor, params: list[SamplingParams], output_indices: list[int]) -> list[int]:
    """Pick one token per row of ``logits`` [B, V]; row ``b`` is output index ``output_indices[b]``."""
    greedy = logits.argmax(dim=-1).tolist()
    return [
        greedy[b] if p.temperature == 0 else _sample_row(logits[b], p, output_indices[b]) for b, p in enumerate(params)
    ]


def chosen_logprobs(logits: torch.Tensor, tokens: list[int], wanted: list[bool]) -> list[float | None]:
    """Log-probability of ``tokens[b]`` under row ``b``'s raw distribution, or None where not wanted."""
    if not any(wanted):
        return [None] * len(tokens)
    picked = torch.log_softmax(logits.float(), dim=-1).gather(1, torch.tensor(tokens).unsqueeze(1))
    return [float(lp) if w else None for lp, w in zip(picked.squeeze(1).tolist(), wanted, strict=True)]


def _sample_row(logits: torch.Tensor, params: SamplingParams, index: int) -> int:
    """Temperature, top-k, top-p, then inverse-CDF sampling with the (seed, index) generator."""
    probs, order = torch.sort(torch.softmax(logits.double() / params.temperature, dim=-1), descending=True)
    if params.top_k:
        probs = probs[: params.top_k]
    cumulative = probs.cumsum(0)
    keep = (cumulative - probs) < params.top_p  # always keeps the most likely token
    probs = probs[keep]
    digest = hashlib.sha256(f"{params.seed}:{index}".encode()).digest()
    generator = torch.Generator().manual_seed(int.from_bytes(digest[:8], "little") >> 1)
    u = torch.rand((), generator=generator, dtype=torch.float64) * probs.sum()
    pick = int(torch.searchsorted(probs.cumsum(0), u, right=True).clamp(max=probs.numel() - 1))
    return int(order[pick])
