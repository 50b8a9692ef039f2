"""EmulatedRunner: the forward pass replaced by a wait from a latency profile (an emulated GPU).

Everything around the forward pass stays real: the scheduler, the block manager, the prefix cache, the
paged KV pool (registered with the transfer engine, so KV bytes really move between workers). Only
``run`` differs: it waits as long as the profile says the step takes on the emulated hardware, times
``time_scale``, and chooses each sampled token from what the KV pool holds, so a request's output
depends on its KV having arrived intact (through a prefix-cache hit, a copy or a transfer) exactly as a
real model's would.

KV contents. The pool keeps ``kv_bytes_per_token`` bytes per token (configurable, far fewer than a real
model's). The first 8 bytes of a token's slot hold a 64-bit chain value over the whole sequence so far::

    v[p] = mix(v[p - 1], token[p])          v[-1] = SEED

A step computing tokens ``[start, start + n)`` reads ``v[start - 1]`` from the pool, writes
``v[start] .. v[start + n - 1]``, and the sampled token is a function of the last one. Step time is
the simulator's (``scheduler.sim``): each prefill chunk costs ``PrefillModel.predict(new, cached)``
and the decode rows together ``DecodeModel.predict(batch, context)``.

KV transfers. ``link`` is the emulated hardware's link and ``model_bytes_per_token`` the emulated model's
KV per token; ``transfer_seconds`` is the time the emulated model's KV for the transferred tokens takes
on that link (scaled), which the worker's transfer engine waits out (``services.worker.kv.transfer``).

Sampled tokens come from the first ``OUTPUT_VOCAB`` ids that are not special (EOS/BOS), so they never end a
request early (emulated requests run to ``max_tokens``), and, with the model's tokenizer, only from ids whose
text alone is whole (``engine.tokenizer.whole_token_ids``): every token streams as a chunk of its own, as a
real model's text mostly does, so a client sees each token's gap (a byte-level vocabulary's lone bytes past
ASCII would be held back and sent together).
"""

from __future__ import annotations

import dataclasses
import math
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np
import torch
from tokenizers import Tokenizer

from engine.config import ModelConfig
from engine.kv_pool import KVPool
from engine.scheduler import ScheduledBatch
from engine.tokenizer import whole_token_ids
from scheduler.cost_model import DecodeModel, PrefillModel, TransferModel

OUTPUT_VOCAB = 1024  # ids to sample from
SEED = 0x243F6A8885A308D3
MASK = (1 << 64) - 1
KV_BYTES_ALIGN = 16  # K and V halves of whole 8-byte words: each token's chain value stays aligned


def mix(value: int, token_id: int) -> int:
    """One link of the chain (splitmix64's finaliser over the previous value and the token)."""
    z = (value ^ (token_id + 0x9E3779B97F4A7C15)) & MASK
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & MASK
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & MASK
    return z ^ (z >> 31)


@dataclass(frozen=True)
class Emulation:
    """What an emulated engine runs at: the profile's step times, scaled, and its KV shape."""

    prefill: PrefillModel
    decode: DecodeModel
    time_scale: float = 1.0  # wall seconds per emulated second
    kv_bytes_per_token: int = 64
    max_model_len: int = 131072
    link: TransferModel | None = None  # the emulated link (None: transfers as fast as loopback moves the real bytes)
    model_bytes_per_token: int = 0  # the emulated model's KV bytes per token, moved over ``link``

    def __post_init__(self) -> None:
        """Refuse shapes the chain values do not fit in."""
        if self.kv_bytes_per_token <= 0 or self.kv_bytes_per_token % KV_BYTES_ALIGN:
            raise ValueError(f"kv_bytes_per_token must be a positive multiple of {KV_BYTES_ALIGN}")
        if not self.time_scale > 0:
            raise ValueError("time_scale must be > 0")

    def model_config(self, served: ModelConfig) -> ModelConfig:
        """The served model's vocabulary and special tokens with the emulated KV shape (one uint8 'head')."""
        return dataclasses.replace(
            served, num_layers=1, num_kv_heads=1, head_dim=self.kv_bytes_per_token // 2,
            max_model_len=self.max_model_len,
        )  # fmt: skip

    def transfer_seconds(self, num_bytes: int) -> float:
        """Emulated wall time of a transfer of ``num_bytes`` real bytes: the emulated model's KV on ``link``."""
        if self.link is None:
            return 0.0
        return self.link.predict(num_bytes * self.model_bytes_per_token // self.kv_bytes_per_token) * self.time_scale

    def step_seconds(self, batch: ScheduledBatch) -> float:
        """Emulated wall time of one step: prefill chunks one after another, then the decode rows together."""
        seconds, decodes, context = 0.0, 0, 0
        for request, n in zip(batch.requests, batch.num_new_tokens, strict=True):
            if request.num_computed_tokens + n > request.num_prompt_tokens:  # a decode row (its latest token)
                decodes += 1
                context += request.num_computed_tokens + n
            else:
                seconds += self.prefill.predict(n, request.num_computed_tokens)
        return (seconds + self.decode.predict(decodes, context)) * self.time_scale


class EmulatedRunner:
    """``ModelRunner``'s interface over an emulated forward pass (see the module docstring)."""

    def __init__(
        self,
        kv_pool: KVPool,
        config: ModelConfig,
        emulation: Emulation,
        clock: Callable[[], float] = time.perf_counter,
        sleep: Callable[[float], None] = time.sleep,
        tokenizer: Tokenizer | None = None,
    ) -> None:
        """Bind to the pool whose slots hold the chain values; sample ids whole in ``tokenizer`` where given."""
        self.emulation = emulation
        self.block_size = kv_pool.block_size
        # data[num_blocks, 1, 2, block_size, 1, head_dim] uint8 -> K's first 8 bytes per slot, as uint64
        pool = kv_pool.data.numpy().reshape(kv_pool.num_blocks, 2, kv_pool.block_size, -1)
        self._values = pool[:, 0, :, :8].view(np.uint64)[..., 0]  # [num_blocks, block_size], a view
        special = {*config.eos_token_ids, *([] if config.bos_token_id is None else [config.bos_token_id])}
        if tokenizer is not None:
            self.output_ids = whole_token_ids(tokenizer, special, OUTPUT_VOCAB)
        else:
            self.output_ids = [t for t in range(min(OUTPUT_VOCAB, config.vocab_size)) if t not in special]
        self.columns = max(self.output_ids) + 1
        self._clock, self._sleep = clock, sleep

    def run(self, batch: ScheduledBatch) -> torch.Tensor:
        """Write the batch's chain values, wait out the step, return logits [B, columns] (one finite each)."""
        start = self._clock()
        chosen = [
            self._compute(r.next_token_ids(n), r.num_computed_tokens, r.block_table)
            for r, n in zip(batch.requests, batch.num_new_tokens, strict=True)
        ]
        remaining = self.emulation.step_seconds(batch) - (self._clock() - start)
        if remaining > 0:
            self._sleep(remaining)
        logits = torch.full((len(chosen), self.columns), -math.inf)
        logits[torch.arange(len(chosen)), torch.tensor(chosen, dtype=torch.long)] = 0.0
        return logits

    def _compute(self, token_ids: Sequence[int], start: int, block_table: Sequence[int]) -> int:
        """Extend the chain over ``token_ids`` at positions ``start..``; the id sampled after them."""
        bs, values = self.block_size, self._values
        value = SEED if start == 0 else int(values[block_table[(start - 1) // bs], (start - 1) % bs])
        chain = []
        for token_id in token_ids:
            value = mix(value, token_id)
            chain.append(value)
        positions = np.arange(start, start + len(chain))
        blocks = np.asarray(block_table, dtype=np.int64)[positions // bs]
        values[blocks, positions % bs] = np.asarray(chain, dtype=np.uint64)
        return self.output_ids[value % len(self.output_ids)]
