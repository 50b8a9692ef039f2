"""The event loop: requests arrive, the live policy plans them, simulated instances run the plans.

Per arrival the simulator does what the live Conductor does, through the same ``scheduler.core``:
match the prompt's block hashes in the global ``KVIndex``, ``ConductorCore.decide`` over the instances'
``InstanceState`` (candidates built from their bookings), and ``ConductorCore.book`` the plan. Every
``[scheduler] policy`` rule runs, the peers' (``dynamo``, ``sglang``) included. ``colocated`` runs
Algorithm 1 over colocated instances with no transfer links; the request runs wholly on the chosen
instance, which is the plan's decode instance, as in the live colocated path.

Events: arrivals, prefill completions (PD), and load samples; decode and colocated instances advance
lazily to each event's time before anyone looks at them.
"""

from __future__ import annotations

import heapq
import math
import random
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace

import numpy as np

from scheduler.booking import request_blocks
from scheduler.candidates import RequestShape, Slo, exposed_tokens
from scheduler.core import ConductorCore
from scheduler.cost_model import LinkModels
from scheduler.kv_index import KVIndex
from scheduler.policy import POLICIES, ConductorPolicy, CopySource, Plan, PolicyConfig, Rejection
from scheduler.profiles import Profile
from scheduler.sim.decode_instance import DecodeInstance
from scheduler.sim.metrics import RequestRecord
from scheduler.sim.prefill_instance import STORE, Noise, PrefillInstance, PrefillJob
from scheduler.sim.prefix_cache import PrefixCache
from scheduler.sim.trace import TraceRequest

SIM_POLICIES = (*POLICIES, "colocated", "conditional")
PROGRESS_S = 1.0  # the decode instances report their requests' tokens to the core this often (at an arrival)
_PREFILL_DONE, _ARRIVAL, _SAMPLE, _DEFERRED = 0, 1, 2, 3


@dataclass
class SimConfig(PolicyConfig):
    """One simulated run: the policy's knobs (``PolicyConfig``) and the bed's.

    ``policy`` may also be "colocated" (num_prefill + num_decode colocated instances, Algorithm 1 over them)
    or "conditional" (num_prefill prefill instances and num_decode colocated ones, each request prefilled on
    its decode instance or remotely by the ``disaggregation`` rule: ``scheduler/disaggregation.py``).
    """

    num_prefill: int = 10
    num_decode: int = 6
    block_size: int = 512
    max_ttft: float = 30.0
    max_tbt: float = 0.3
    reject: bool = False  # SLO admission (rejections for lack of decode memory happen regardless)
    seed: int = 0
    sample_interval: float = 10.0
    # Cost-model error: every prefill job and decode iteration runs exp(N(0, sigma)) times as long as the
    # profile (which the policy still predicts with), so the ranking no longer rests on perfect predictions.
    # 0 = perfect; live median relative errors of 5-20% correspond to sigma of about 0.07-0.3.
    prediction_error: float = 0.0
    # The Mooncake Store: a cluster-wide pool of this many tokens (0 = none) beside the instances' own caches.
    # Every prefill writes its prompt's blocks through to it; any prefill instance copies from it over the
    # profile's link, as from a peer. Not on the colocated path (no transfers there).
    store_tokens: int = 0
    # The engines' KV block (tokens): a trace block that a prompt ends inside stays cached in whole engine
    # blocks, and a later prompt reuses those (as a live cluster's prefix cache does). 0 = whole trace blocks only.
    cache_block_tokens: int = 0

    def __post_init__(self) -> None:
        if self.policy not in SIM_POLICIES:
            raise ValueError(f"policy must be one of {', '.join(SIM_POLICIES)}, got {self.policy!r}")
        if self.num_prefill < 1 or self.num_decode < 1:
            raise ValueError("num_prefill and num_decode must be at least 1")
        if self.prediction_error < 0:
            raise ValueError("prediction_error must be >= 0")
        if self.cache_block_tokens < 0 or (self.cache_block_tokens and self.block_size % self.cache_block_tokens):
            raise ValueError(f"cache_block_tokens must be 0 or divide block_size {self.block_size}")
        if self.store_tokens < 0 or (self.store_tokens and self.colocated):
            raise ValueError("store_tokens must be >= 0, and 0 on the colocated path")

    def noise(self, stream: int) -> Noise:
        """Factors for one instance's durations (seeded per instance; always 1.0 without prediction error)."""
        if self.prediction_error == 0:
            return lambda: 1.0
        rng, sigma = random.Random(self.seed * 1_000_003 + stream), self.prediction_error
        return lambda: math.exp(rng.gauss(0.0, sigma))

    @property
    def colocated(self) -> bool:
        """Whether instances do both prefill and decode."""
        return self.policy == "colocated"

    @property
    def conditional(self) -> bool:
        """Whether the decode instances may prefill too (beside prefill instances)."""
        return self.policy == "conditional"

    @property
    def live_policy(self) -> str:
        """The ``PolicyConfig.policy`` the run calls (colocated and conditional run Algorithm 1)."""
        return "kvcache_centric" if self.colocated or self.conditional else self.policy


@dataclass
class SimResult:
    """Records and logs of a finished run."""

    config: SimConfig
    records: list[RequestRecord]
    step_logs: dict[str, np.ndarray]
    samples: list[dict[str, float]]
    policy_calls: int
    instance_stats: dict[str, dict[str, float]] = field(default_factory=dict)


class Simulator:
    """One run of one policy over one trace."""

    def __init__(self, config: SimConfig, profile: Profile, requests: Sequence[TraceRequest]) -> None:
        self.config = config
        self.profile = profile
        self.requests = requests
        self.records = [
            RequestRecord(r.request_id, r.arrival, r.num_prompt_tokens, r.num_output_tokens) for r in requests
        ]
        self.index = KVIndex()
        policy_config = config.policy_config(policy=config.live_policy)
        self.core = ConductorCore(ConductorPolicy(policy_config, seed=config.seed), LinkModels(profile.link))
        self.slo = Slo(config.max_ttft, config.max_tbt, config.reject)
        self._build_instances()
        self._events: list[tuple[float, int, int, int]] = []  # (time, kind, seq, argument)
        self._seq = 0
        self.policy_calls = 0
        self._next_progress = 0.0  # when the decode instances next report their progress (PROGRESS_S)
        self.samples: list[dict[str, float]] = []

    def _build_instances(self) -> None:
        cfg, prof, bs = self.config, self.profile, self.config.block_size
        cache_blocks = prof.prefill_cache_tokens // bs
        self.store = PrefixCache(STORE, cfg.store_tokens // bs, self.index) if cfg.store_tokens else None
        self.prefills: list[PrefillInstance] = []
        if cfg.colocated:
            self.decodes = [
                DecodeInstance(
                    f"c{i}",
                    prof,
                    bs,
                    self._finished,
                    self.core,
                    PrefixCache(f"c{i}", cache_blocks, self.index, cfg.cache_block_tokens),
                    noise=cfg.noise(i),
                )  # fmt: skip
                for i in range(cfg.num_prefill + cfg.num_decode)
            ]
        else:
            self.prefills = [
                PrefillInstance(
                    f"p{i}",
                    prof,
                    bs,
                    PrefixCache(f"p{i}", cache_blocks, self.index, cfg.cache_block_tokens),
                    self.core,
                    noise=cfg.noise(i),
                    store=self.store,
                )  # fmt: skip
                for i in range(cfg.num_prefill)
            ]
            self.decodes = [
                DecodeInstance(
                    f"{'c' if cfg.conditional else 'd'}{i}",
                    prof,
                    bs,
                    self._finished,
                    self.core,
                    PrefixCache(f"c{i}", cache_blocks, self.index, cfg.cache_block_tokens) if cfg.conditional else None,
                    noise=cfg.noise(cfg.num_prefill + i),
                )  # fmt: skip
                for i in range(cfg.num_decode)
            ]
        self._decode_by_id = {d.instance_id: d for d in self.decodes}
        self._prefill_index = {p.instance_id: i for i, p in enumerate(self.prefills)}

    def _push(self, time: float, kind: int, argument: int) -> None:
        self._seq += 1
        heapq.heappush(self._events, (time, kind, self._seq, argument))

    def run(self, progress: Callable[[int, int], None] | None = None) -> SimResult:
        """Replay every request; returns the records and logs."""
        for i, r in enumerate(self.requests):
            self._push(r.arrival, _ARRIVAL, i)
        last_arrival = self.requests[-1].arrival if self.requests else 0.0
        if self.config.sample_interval > 0:
            self._push(0.0, _SAMPLE, 0)
        arrived = 0
        while self._events:
            now, kind, _, arg = heapq.heappop(self._events)
            if kind == _PREFILL_DONE:
                self._prefill_done(now, arg)
            elif kind == _ARRIVAL:
                self._arrive(now, arg)
                arrived += 1
                if progress is not None and (arrived % 1000 == 0 or arrived == len(self.requests)):
                    progress(arrived, len(self.requests))
            elif kind == _DEFERRED:  # planned again (``Rejection.retry_in``)
                self._arrive(now, arg)
            else:
                self._sample(now)
                if now + self.config.sample_interval <= last_arrival:
                    self._push(now + self.config.sample_interval, _SAMPLE, 0)
        for d in self.decodes:
            d.advance_to(math.inf)
        return SimResult(
            self.config,
            self.records,
            {d.instance_id: np.asarray(d.step_times) for d in self.decodes},
            self.samples,
            self.policy_calls,
            self._instance_stats(),
        )

    def _arrive(self, now: float, i: int) -> None:
        request, record = self.requests[i], self.records[i]
        for d in self.decodes:
            d.advance_to(now)
        if now >= self._next_progress:  # the live Conductor hears of every token; the simulator once a second
            self._next_progress = now + PROGRESS_S
            for d in self.decodes:
                d.report_progress(now)
        n, bs = request.num_prompt_tokens, self.config.block_size
        shape = RequestShape(
            n, request_blocks(n, request.num_output_tokens, bs), bs, self.profile.bytes_per_block(bs),
            output_tokens=self.core.expected_output_tokens(request.num_output_tokens),
        )  # fmt: skip
        outcome = self._decide(now, request, shape)
        if isinstance(outcome, Rejection) and outcome.retry_in > 0:
            self._push(now + outcome.retry_in, _DEFERRED, i)
            return
        if isinstance(outcome, Rejection):
            record.rejection = outcome.kind.removesuffix("_slo")  # "ttft", "tbt" or "capacity"
            if outcome.plan is not None:
                record.predicted_ttft, record.predicted_tbt = outcome.plan.prefill.ttft, outcome.plan.tbt
            return
        self._book(now, request, record, shape, outcome)

    def _decide(self, now: float, request: TraceRequest, shape: RequestShape) -> Plan | Rejection:
        pool = self.prefills or self.decodes
        cached = [*pool, *self.decodes] if self.config.conditional else pool
        holders = [p.instance_id for p in cached] + ([STORE] if self.store is not None else [])
        match = self.index.match_prefix(request.block_hashes, holders).prefix_blocks
        prefix = {i: blocks * self.config.block_size for i, blocks in match.items()}
        store = CopySource(STORE, prefix.pop(STORE)) if STORE in prefix else None
        self.policy_calls += 1
        slo = self.slo  # a deferred request's wait so far is in its TTFT
        if now > request.arrival:
            slo = replace(slo, ttft_overhead=slo.ttft_overhead + now - request.arrival)
        if self.config.conditional:
            return self.core.decide_conditional(
                now, shape, prefix, [p.state for p in pool], [d.state for d in self.decodes], slo, store,
                request.full_blocks,
            )  # fmt: skip
        return self.core.decide(
            now, shape, prefix, [p.state for p in pool], [d.state for d in self.decodes], slo,
            self.config.colocated, store, request.full_blocks,
        )  # fmt: skip

    def _book(self, now: float, request: TraceRequest, record: RequestRecord, shape: RequestShape, plan: Plan) -> None:
        e = plan.prefill
        record.prefill_instance, record.decode_instance = e.instance_id, plan.decode_instance
        record.predicted_ttft, record.predicted_tbt = e.ttft, plan.tbt
        job = PrefillJob(request, record, shape, now, e.prefix_len, e.copy_from, plan.decode_instance)
        decode = self._decode_by_id[plan.decode_instance]
        if e.instance_id == plan.decode_instance:  # colocated, or prefilled on its decode instance
            self.core.book(now, record.request_id, plan, shape, decode.state, decode.state, request.full_blocks)
            decode.submit(job)
            return
        p = self._prefill_index[e.instance_id]
        self.core.book(now, record.request_id, plan, shape, self.prefills[p].state, decode.state, request.full_blocks)
        end = self.prefills[p].submit(job, now)
        if end is not None:
            self._push(end, _PREFILL_DONE, p)

    def _prefill_done(self, now: float, p: int) -> None:
        job, next_end = self.prefills[p].finish(now)
        if next_end is not None:
            self._push(next_end, _PREFILL_DONE, p)
        record = job.record
        exposed = exposed_tokens(job.shape.num_prompt_tokens, job.reused, self.profile.chunk_tokens)
        record.first_token = now + self.profile.link.predict(job.shape.kv_bytes(exposed))
        decode = self._decode_by_id[job.decode_instance]
        self.core.decode_started(decode.state, record.request_id, record.first_token)
        if record.num_output_tokens > 1:
            decode.join(record, record.first_token)
        else:
            self._finished(record, record.first_token)

    def _finished(self, record: RequestRecord, now: float) -> None:
        record.finish = now
        self.core.release(record.request_id, now, self._decode_by_id[record.decode_instance].state)
        self.core.observe_completion(record.num_output_tokens)

    def _sample(self, now: float) -> None:
        for d in self.decodes:
            d.advance_to(now)
        pool = self.prefills or self.decodes
        queue = [p.state.t_queue(now) for p in pool]
        steps = [d.model.predict(d.batch, d.context) for d in self.decodes]
        self.samples.append(
            {
                "time": now,
                "prefill_t_queue_mean": float(np.mean(queue)),
                "prefill_t_queue_max": float(np.max(queue)),
                "decode_step_mean": float(np.mean(steps)),
                "decode_step_max": float(np.max(steps)),
                "decode_batch_mean": float(np.mean([d.batch for d in self.decodes])),
            }
        )

    def _instance_stats(self) -> dict[str, dict[str, float]]:
        stats: dict[str, dict[str, float]] = {}
        for p in self.prefills:
            stats[p.instance_id] = {"busy_s": p.busy_s, "cached_blocks": len(p.cache), "evicted": p.cache.evicted}
        for d in self.decodes:
            stats[d.instance_id] = {"decode_steps": len(d.step_times)}
            if d.cache is not None:
                stats[d.instance_id] |= {"cached_blocks": len(d.cache), "evicted": d.cache.evicted}
        return stats
