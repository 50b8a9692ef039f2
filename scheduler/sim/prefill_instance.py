"""A simulated prefill instance: a FIFO of prefill jobs over an LRU prefix cache.

A job starts when the one before it ends. At its start the instance looks its prompt up in its own
cache (blocks may have been evicted, or added, since the Conductor planned; a partly cached trace block
counts in engine blocks, ``PrefixCache.match_tokens``); if the plan copies KV it
first pulls the missing prefix from the best holder (``T_transfer``), then computes the rest in chunks
of at most ``chunk_tokens`` with the profile's ``PrefillModel`` (each chunk pays the fixed cost c0 and
attends to everything before it). At the end it stores the prompt's full blocks (copied ones too: that
is the hot-spot replication of Algorithm 1), and writes them through to the Mooncake Store when there is
one (a copy source like any holder, ``SimConfig.store_tokens``). Its KV has streamed to the decode
instance chunk by chunk, all but the last chunk's while later chunks computed
(``scheduler.candidates.exposed_tokens``).
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable
from dataclasses import dataclass

from scheduler.candidates import RequestShape
from scheduler.core import ConductorCore
from scheduler.cost_model import PrefillModel
from scheduler.instance import InstanceState
from scheduler.profiles import Profile
from scheduler.sim.metrics import RequestRecord
from scheduler.sim.prefix_cache import PrefixCache
from scheduler.sim.trace import TraceRequest

Noise = Callable[[], float]  # actual / predicted duration of the next job or iteration
STORE = "store"  # the Mooncake Store's holder name in the simulated KV index


def chunked_prefill_s(model: PrefillModel, new_tokens: int, cached_tokens: int, chunk_tokens: int) -> float:
    """Seconds to compute ``new_tokens`` after ``cached_tokens``, in chunks of at most ``chunk_tokens``."""
    total = 0.0
    done = 0
    while done < new_tokens:
        n = min(chunk_tokens, new_tokens - done)
        total += model.predict(n, cached_tokens + done)
        done += n
    return total


@dataclass
class PrefillJob:
    """One admitted request's prefill, as planned."""

    request: TraceRequest
    record: RequestRecord
    shape: RequestShape
    submitted: float
    plan_prefix: int  # tokens the plan reuses (best_len when it copies)
    copy_from: str  # the instance (or the Store) the plan copies KV from; "" = no copy
    decode_instance: str
    reused: int = 0  # prompt tokens it did not compute (own cache and copied), known at its start

    def start(self, cache: PrefixCache, block_size: int, now: float) -> int:
        """Look the prompt up at start time; record local and copied tokens; return the reused tokens."""
        n, grain = self.request.num_prompt_tokens, cache.cache_block_tokens or block_size
        held = cache.match_tokens(self.request.block_hashes, n, block_size)
        own = min(held, (n - 1) // grain * grain)  # the last prompt token is computed
        prefix = own
        if self.copy_from and self.plan_prefix > own:
            prefix = self.plan_prefix
            self.record.copied_tokens = prefix - own
            self.record.store_tokens = prefix - own if self.copy_from == STORE else 0
            self.record.copy_bytes = self.shape.kv_bytes(prefix - own)
        self.record.local_tokens = own
        self.reused = prefix
        return prefix


class PrefillInstance:
    """FIFO prefill worker; the simulator schedules an event at each job's end."""

    def __init__(
        self,
        instance_id: str,
        profile: Profile,
        block_size: int,
        cache: PrefixCache,
        core: ConductorCore,
        noise: Noise = lambda: 1.0,
        store: PrefixCache | None = None,
    ) -> None:
        self.instance_id = instance_id
        self.noise = noise  # each job's actual/predicted duration (cost-model error)
        self.profile = profile
        self.block_size = block_size
        self.cache = cache
        self.store = store  # the Mooncake Store every prefill writes through to (None: no Store)
        self.state = InstanceState(
            instance_id, "prefill", profile.prefill, profile.decode, num_blocks=cache.capacity_blocks,
            max_running=profile.max_running, chunk_tokens=profile.chunk_tokens,
        )  # fmt: skip
        self.core = core  # the simulator's Conductor core, told when a prefill ends
        self.queue: deque[PrefillJob] = deque()
        self.running: PrefillJob | None = None
        self.busy_s = 0.0

    def submit(self, job: PrefillJob, now: float) -> float | None:
        """Queue a job; returns its end time when it starts at once."""
        self.queue.append(job)
        return self._start(now) if self.running is None else None

    def finish(self, now: float) -> tuple[PrefillJob, float | None]:
        """The running job ends now: store its blocks, start the next; returns (job, next end or None)."""
        job = self.running
        if job is None:
            raise RuntimeError(f"{self.instance_id} has no running prefill")
        self.cache.store(job.request.full_blocks, job.request.tail)
        if self.store is not None:
            self.store.store(job.request.full_blocks)
        self.core.release(job.record.request_id, now, self.state)
        self.running = None
        return job, self._start(now) if self.queue else None

    def _start(self, now: float) -> float:
        job = self.queue.popleft()
        self.running = job
        prefix = job.start(self.cache, self.block_size, now)
        n = job.shape.num_prompt_tokens
        duration = self.noise() * (
            self.profile.link.predict(job.record.copy_bytes)
            + chunked_prefill_s(self.profile.prefill, n - prefix, prefix, self.profile.chunk_tokens)
        )
        self.busy_s += duration
        return now + duration
