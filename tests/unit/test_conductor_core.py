"""One Conductor core: the simulator's decisions replayed through the live Conductor's state give the same plans.

The simulator runs a small trace (disaggregated, colocated and conditional: prefill instances beside colocated
ones) and every call it makes into ``ConductorCore`` is recorded: decide or decide_conditional (with the
prefix matches and the clock), book, prefill_done, decode_started, decode_progress, release. The recording
is then replayed against instance states built the way the live Conductor builds them, from workers' etcd
records (``services.conductor.cluster_view``), with a fresh core: every decision must come out identical,
its reason and the plan of the path not taken included.
"""

import json
import random

import pytest

from scheduler.candidates import RequestShape, Slo
from scheduler.core import ConductorCore
from scheduler.cost_model import DecodeModel, LinkModels, PrefillModel, TransferModel
from scheduler.instance import InstanceState
from scheduler.policy import ConductorPolicy, Plan, PolicyConfig, Rejection
from scheduler.profiles import Profile
from scheduler.sim.simulator import SimConfig, Simulator
from scheduler.sim.trace import TraceRequest, block_hash
from services.common.instance_record import CostModels, InstanceRecord, KVShape, WorkerRecord
from services.conductor.cluster_view import _state

BS = 512
PROFILE = Profile(
    name="core-test",
    prefill=PrefillModel(c0=0.01, c1=1e-4, c2=1e-8),
    decode=DecodeModel(d0=0.01, d1=1e-3, d2=1e-7),
    link=TransferModel(latency_s=0.001, bandwidth_bytes_per_s=5e9),
    bytes_per_token=1024,
    prefill_cache_tokens=40 * BS,
    decode_kv_tokens=400 * BS,
    max_running=16,
    chunk_tokens=4096,
)


def _trace(n=60, seed=0):
    rng = random.Random(seed)
    requests, t = [], 0.0
    for i in range(n):
        t += rng.expovariate(4.0)
        shared = rng.randrange(4)  # four hot prefixes of 2-6 blocks, then a private tail
        hashes = [1000 * shared + j for j in range(rng.randrange(2, 7))] + [10_000 + i]
        requests.append(TraceRequest(i, t, len(hashes) * BS - rng.randrange(BS), rng.randrange(2, 60),
                                     tuple(block_hash(h) for h in hashes)))  # fmt: skip
    return requests


class Recorder:
    """Wraps a core; remembers each call with the ids of the instances it named."""

    def __init__(self, core):
        self.core, self.calls = core, []

    def decide(self, now, shape, prefix, prefills, decodes, slo, colocated, store=None, hashes=()):
        outcome = self.core.decide(now, shape, prefix, prefills, decodes, slo, colocated, store, hashes)
        ids = ([p.instance_id for p in prefills], [d.instance_id for d in decodes])
        self.calls.append(("decide", now, shape, dict(prefix), ids, slo, colocated, store, hashes, outcome))
        return outcome

    def decide_conditional(self, now, shape, prefix, prefills, mixed, slo, store=None, hashes=()):
        outcome = self.core.decide_conditional(now, shape, prefix, prefills, mixed, slo, store, hashes)
        ids = ([p.instance_id for p in prefills], [m.instance_id for m in mixed])
        self.calls.append(("decide_conditional", now, shape, dict(prefix), ids, slo, store, hashes, outcome))
        return outcome

    def book(self, now, rid, plan, shape, p, d, hashes=()):
        self.calls.append(("book", now, rid, plan, shape, p.instance_id, d.instance_id, hashes))
        self.core.book(now, rid, plan, shape, p, d, hashes)

    def prefill_done(self, p, rid, now):
        self.calls.append(("prefill_done", p.instance_id, rid, now))
        self.core.prefill_done(p, rid, now)

    def decode_started(self, d, rid, now):
        self.calls.append(("decode_started", d.instance_id, rid, now))
        self.core.decode_started(d, rid, now)

    def decode_progress(self, d, rid, now, tokens_out, max_tokens, fixed):
        self.calls.append(("decode_progress", d.instance_id, rid, now, tokens_out, max_tokens, fixed))
        self.core.decode_progress(d, rid, now, tokens_out, max_tokens, fixed)

    def release(self, rid, now, *instances):
        self.calls.append(("release", rid, now, [v.instance_id for v in instances]))
        self.core.release(rid, now, *instances)

    def observe_completion(self, tokens):
        self.calls.append(("observe_completion", tokens))
        self.core.observe_completion(tokens)

    def __getattr__(self, name):
        return getattr(self.core, name)


def _record(policy):
    sim = Simulator(SimConfig(policy=policy, num_prefill=2, num_decode=2, block_size=BS, max_ttft=1.0, max_tbt=0.05,
                              reject=True), PROFILE, _trace())  # fmt: skip
    sim.core = recorder = Recorder(sim.core)
    for instance in [*sim.prefills, *sim.decodes]:  # the instances' own calls (prefill ends, releases) too
        instance.core = recorder
    sim.run()
    states = [*(p.state for p in sim.prefills), *(d.state for d in sim.decodes)]
    return recorder.calls, states, sim.core.core.policy.config


def _live_states(states):
    """Each instance as the live Conductor sees it: built from the record its worker would publish."""
    live = {}
    for s in states:
        record = WorkerRecord(
            role=s.role, instance_id=s.instance_id, address="127.0.0.1:1", model="m", transfer_endpoint="127.0.0.1:2",
            block_size=BS, num_blocks=s.num_blocks, max_concurrent_requests=s.max_running,
            max_num_batched_tokens=s.chunk_tokens, kv_layout=KVShape(1, 1, 1, "float32", 1),
            cost_model=CostModels(s.prefill_model, s.decode_model, s.profile),
        )  # fmt: skip
        published = InstanceRecord.from_json(json.loads(json.dumps(record.to_json())))
        assert isinstance(published, WorkerRecord)
        live[s.instance_id] = _state(published, None)
    return live


def _same(a, b):
    if isinstance(a, Rejection) or isinstance(b, Rejection):
        return type(a) is type(b) and a.reason == b.reason
    assert isinstance(a, Plan) and isinstance(b, Plan)
    fields = ("prefill", "decode_instance", "tbt", "best_len", "probe", "reason")
    same_alternative = a.alternative is None and b.alternative is None or _same(a.alternative, b.alternative)
    return same_alternative and all(getattr(a, f) == getattr(b, f) for f in fields)


@pytest.mark.parametrize("policy", ["kvcache_centric", "colocated", "conditional"],
                         ids=["disaggregated", "colocated", "conditional"])  # fmt: skip
def test_the_live_core_replays_the_simulators_decisions(policy):
    calls, states, policy_config = _record(policy)
    decisions = [c for c in calls if c[0].startswith("decide")]
    assert len(decisions) >= 60 and any(isinstance(c[-1], Plan) for c in decisions)  # deferred ones twice or more
    if policy == "conditional":  # both paths taken, each plan carrying the other
        plans = [c[-1] for c in decisions if isinstance(c[-1], Plan)]
        paths = {p.prefill.instance_id == p.decode_instance for p in plans}
        assert paths == {True, False} and all(p.alternative is not None for p in plans)
    live = _live_states(states)
    core = ConductorCore(ConductorPolicy(policy_config, seed=0), LinkModels(PROFILE.link))
    for call in calls:
        kind, *args = call
        if kind == "decide":
            now, shape, prefix, (p_ids, d_ids), slo, coloc, store, hashes, outcome = args
            prefills, decodes = [live[i] for i in p_ids], [live[i] for i in d_ids]
            replayed = core.decide(now, shape, prefix, prefills, decodes, slo, coloc, store, hashes)
            assert _same(replayed, outcome), (now, replayed, outcome)
        elif kind == "decide_conditional":
            now, shape, prefix, (p_ids, m_ids), slo, store, hashes, outcome = args
            prefills, mixed = [live[i] for i in p_ids], [live[i] for i in m_ids]
            replayed = core.decide_conditional(now, shape, prefix, prefills, mixed, slo, store, hashes)
            assert _same(replayed, outcome), (now, replayed, outcome)
        elif kind == "book":
            now, rid, plan, shape, p, d, hashes = args
            core.book(now, rid, plan, shape, live[p], live[d], hashes)
        elif kind in ("prefill_done", "decode_started"):
            instance, rid, now = args
            getattr(core, kind)(live[instance], rid, now)
        elif kind == "decode_progress":
            instance, *rest = args
            core.decode_progress(live[instance], *rest)
        elif kind == "release":
            rid, now, ids = args
            core.release(rid, now, *(live[i] for i in ids))
        else:
            core.observe_completion(*args)


def _instance(instance_id):
    return InstanceState(instance_id, "prefill", PROFILE.prefill, PROFILE.decode, num_blocks=400, max_running=16,
                         chunk_tokens=PROFILE.chunk_tokens)  # fmt: skip


def test_a_prompt_queued_behind_its_prefix_is_predicted_to_reuse_it_but_never_copies_it():
    """The next turn of a conversation arrives while the previous one is queued on p0: p0 will hold the
    previous prompt by the time the next runs there (first come, first served), though nothing is cached yet."""
    core = ConductorCore(ConductorPolicy(PolicyConfig(), seed=0), LinkModels(PROFILE.link))
    p0, p1, d = _instance("p0"), _instance("p1"), _instance("d0")
    d.role = "decode"
    slo = Slo(60.0, 1.0, reject=False)
    turn1 = [block_hash(h) for h in range(8)]  # 8 full blocks
    turn2 = [*turn1, block_hash(100), block_hash(101)]
    first_shape = RequestShape(8 * BS + 10, 10, BS, 1024)
    first = core.decide(0.0, first_shape, {}, [p0, p1], [d], slo, False, None, turn1)
    assert isinstance(first, Plan)
    holder = p0 if first.prefill.instance_id == "p0" else p1
    core.book(0.0, "turn-1", first, first_shape, holder, d, turn1)
    other = p1 if holder is p0 else p0
    busy_shape, busy = RequestShape(30 * BS, 31, BS, 1024), [block_hash(1000 + h) for h in range(30)]
    core.book(0.0, "elsewhere", core.decide(0.0, busy_shape, {}, [other], [d], slo, False, None, busy), busy_shape,
              other, d, busy)  # fmt: skip
    shape = RequestShape(10 * BS + 10, 12, BS, 1024)
    # The other instance caches 2 blocks of the prefix: a copy source; the holder caches none yet: not one.
    cached = {other.instance_id: 2 * BS}
    plan = core.decide(0.1, shape, cached, [p0, p1], [d], slo, False, None, turn2)
    assert isinstance(plan, Plan)
    by_id = {e.instance_id: e for e in plan.candidates}
    assert by_id[holder.instance_id].prefix_len == 8 * BS  # the queued prompt's blocks, reused there
    assert by_id[holder.instance_id].copy_from == ""  # what it will hold is not copied
    assert by_id[holder.instance_id].t_prefill == pytest.approx(PROFILE.prefill.predict(2 * BS + 10, 8 * BS))
    assert by_id[other.instance_id].prefix_len == 2 * BS
    assert plan.prefill.instance_id == holder.instance_id and plan.best_len == 8 * BS
    assert f"reuses {8 * BS} tokens ({8 * BS} of them from prompts queued ahead of it there)" in plan.reason
    # Its prefill done, the holder's blocks are the KV index's to report: nothing is queued any more.
    core.prefill_done(holder, "turn-1", 0.5)
    again = core.decide(0.6, shape, cached, [p0, p1], [d], slo, False, None, turn2)
    assert {e.instance_id: e.prefix_len for e in again.candidates}[holder.instance_id] <= 2 * BS  # at most a copy


def test_the_queued_prefix_is_the_longest_common_prefix_with_any_queued_prompt():
    """Binary search over chained hashes gives what a walk over every queued block would (random prompts)."""
    from scheduler.booking import Booking, Bookings, common_prefix

    rng = random.Random(7)
    trunks = [[f"t{t}-{i}" for i in range(rng.randrange(1, 400))] for t in range(4)]

    def prompt():  # a shared trunk's prefix, then blocks of its own (chained: ids stand for the whole prefix)
        trunk = rng.choice(trunks)
        k = rng.randrange(len(trunk) + 1)
        own = f"p{rng.random()}"
        return trunk[:k] + [f"{own}-{i}" for i in range(rng.randrange(0, 50))]

    for _ in range(200):
        bookings, queued = Bookings(), [prompt() for _ in range(rng.randrange(0, 6))]
        for i, blocks in enumerate(queued):
            bookings.add(i, Booking(0.0, 1.0, 16 * len(blocks), 0, prompt_blocks=blocks))
        done = rng.randrange(len(queued) + 1)
        for i in range(done):
            bookings.prefill_done(i, 0.5)
        new = prompt()
        union = {h for blocks in queued[done:] for h in blocks}
        walked = next((i for i, h in enumerate(new) if h not in union), len(new))
        assert bookings.queued_prefix(new) == walked
    assert common_prefix(["a", "b", "c"], ["a", "b", "x"]) == 2 and common_prefix([], ["a"]) == 0
