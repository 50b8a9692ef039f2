"""A simulated decode instance with continuous batching; with a prefill queue, the colocated worker.

Time advances in iterations. At each iteration boundary the requests whose prompt KV has arrived join
the batch; one iteration produces one token for every request in the batch and lasts
``DecodeModel.predict(batch, context)``, where ``context`` is the tokens the batch really attends to
(prompts plus tokens generated so far, growing by ``batch`` each step). A colocated instance also runs
one chunk of the prefill at the head of its FIFO in each iteration (vLLM-style chunked prefill in a
mixed batch), so its decode steps stall for the chunk's time::

    iteration = [ prefill chunk of the head job (colocated only) ][ decode step of the batch ]

Work is O(1) per step: the end time of every decode step goes to ``step_times``, and a request is
(index of its first step, number of steps), so its token gaps are read back from the log afterwards.
The instance advances lazily: ``advance_to(t)`` runs every iteration that ends by ``t``.
"""

from __future__ import annotations

import heapq
import math
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass

from scheduler.core import ConductorCore
from scheduler.instance import InstanceState
from scheduler.profiles import Profile
from scheduler.sim.metrics import RequestRecord
from scheduler.sim.prefill_instance import Noise, PrefillJob, chunked_prefill_s
from scheduler.sim.prefix_cache import PrefixCache

Finished = Callable[[RequestRecord, float], None]


@dataclass
class _Chunking:
    """The colocated head job's progress."""

    job: PrefillJob
    prefix: int  # reused tokens, fixed when the job starts
    done: int = 0  # tokens computed so far


class DecodeInstance:
    """Continuous batching over a step log; colocated when given a prefix cache for its own prefills."""

    def __init__(
        self,
        instance_id: str,
        profile: Profile,
        block_size: int,
        on_finish: Finished,
        core: ConductorCore,
        cache: PrefixCache | None = None,
        noise: Noise = lambda: 1.0,
    ) -> None:
        self.instance_id = instance_id
        self.profile = profile
        self.model = profile.decode
        self.capacity_blocks = profile.decode_kv_tokens // block_size
        self.block_size = block_size
        self.noise = noise  # each iteration's actual/predicted duration (cost-model error)
        self.core = core  # the simulator's Conductor core, told when a colocated prefill ends
        role = "decode" if cache is None else "colocated"
        self.state = InstanceState(
            instance_id, role, profile.prefill, profile.decode, num_blocks=self.capacity_blocks,
            max_running=profile.max_running, chunk_tokens=profile.chunk_tokens,
        )  # fmt: skip
        self.cache = cache
        self.step_times: list[float] = []
        self.batch = 0
        self.context = 0
        self.prefill_queue: deque[PrefillJob] = deque()
        self._on_finish = on_finish
        self._pending: list[tuple[float, int, RequestRecord]] = []  # (join time, id, record)
        self._finishing: list[tuple[int, int, RequestRecord]] = []  # (last step index, id, record)
        self._chunking: _Chunking | None = None
        self._step_end = math.inf
        self._step_decodes = False
        self._last_end = 0.0

    @property
    def colocated(self) -> bool:
        """Whether it runs prefills too."""
        return self.cache is not None

    def join(self, record: RequestRecord, at: float) -> None:
        """The request's prompt KV (and first token) is here at ``at``; it decodes from the next boundary."""
        heapq.heappush(self._pending, (at, record.request_id, record))

    def report_progress(self, now: float) -> None:
        """Tell the Conductor core how many tokens each request decoding here has produced by ``now``.

        The live Conductor hears it with every streamed token (``ConductorCore.decode_progress``): its view of
        when each resident leaves follows the measured pace, stalls included.
        """
        done = len(self.step_times)
        for _, rid, record in self._finishing:
            self.core.decode_progress(self.state, rid, now, done - record.first_step + 1, record.num_output_tokens,
                                      False)  # fmt: skip

    def submit(self, job: PrefillJob) -> None:
        """Queue a prefill (colocated only)."""
        self.prefill_queue.append(job)

    def advance_to(self, t: float) -> None:
        """Run every iteration that ends by ``t``; the one in progress at ``t`` stays in progress."""
        while True:
            if self._step_end == math.inf:
                start = self._next_start()
                if start is None or start > t:
                    return
                self._begin(start)
            if self._step_end > t:
                return
            self._complete(self._step_end)

    def _next_start(self) -> float | None:
        if self.batch or self._chunking is not None:
            return self._last_end
        times = [self._pending[0][0]] if self._pending else []
        if self.prefill_queue:
            times.append(self.prefill_queue[0].submitted)
        return max(self._last_end, min(times)) if times else None

    def _begin(self, start: float) -> None:
        while self._pending and self._pending[0][0] <= start:
            _, rid, record = heapq.heappop(self._pending)
            record.first_step = len(self.step_times)
            steps = record.num_output_tokens - 1
            heapq.heappush(self._finishing, (record.first_step + steps - 1, rid, record))
            self.batch += 1
            self.context += record.num_prompt_tokens + 1
        duration = self._chunk_time(start)
        self._step_decodes = self.batch > 0
        if self._step_decodes:
            duration += self.model.predict(self.batch, self.context)
        self._step_end = start + duration * self.noise()

    def _chunk_time(self, start: float) -> float:
        if self._chunking is None and self.prefill_queue and self.prefill_queue[0].submitted <= start:
            job = self.prefill_queue.popleft()
            assert self.cache is not None  # only colocated instances take prefill jobs
            prefix = job.start(self.cache, self.block_size, start)
            self._chunking = _Chunking(job, prefix)
        if self._chunking is None:
            return 0.0
        c = self._chunking
        new = min(self.profile.chunk_tokens, c.job.record.num_prompt_tokens - c.prefix - c.done)
        return chunked_prefill_s(self.profile.prefill, new, c.prefix + c.done, new)

    def _complete(self, end: float) -> None:
        if self._step_decodes:
            k = len(self.step_times)
            self.step_times.append(end)
            self.context += self.batch
            while self._finishing and self._finishing[0][0] <= k:
                _, _, record = heapq.heappop(self._finishing)
                self.batch -= 1
                self.context -= record.num_prompt_tokens + record.num_output_tokens
                self._on_finish(record, end)
        if self._chunking is not None:
            self._complete_chunk(end)
        self._last_end = end
        self._step_end = math.inf

    def _complete_chunk(self, end: float) -> None:
        c = self._chunking
        assert c is not None
        c.done += min(self.profile.chunk_tokens, c.job.record.num_prompt_tokens - c.prefix - c.done)
        if c.prefix + c.done < c.job.record.num_prompt_tokens:
            return
        self._chunking = None
        assert self.cache is not None
        self.cache.store(c.job.request.full_blocks, c.job.request.tail)
        self.core.prefill_done(self.state, c.job.record.request_id, end)
        self.core.decode_started(self.state, c.job.record.request_id, end)
        c.job.record.first_token = end
        if c.job.record.num_output_tokens > 1:
            self.join(c.job.record, end)
        else:
            self._on_finish(c.job.record, end)
