"""Conditional disaggregation: a request prefills on its decode instance or remotely, by cost or by a peer's rule."""

import re

import pytest

from scheduler.candidates import RequestShape, Slo
from scheduler.core import ConductorCore
from scheduler.cost_model import DecodeModel, LinkModels, PrefillModel, TransferModel
from scheduler.disaggregation import is_local
from scheduler.instance import InstanceState
from scheduler.policy import ConductorPolicy, Plan, PolicyConfig, Rejection
from scheduler.profiles import Profile
from scheduler.sim.simulator import SimConfig, Simulator
from scheduler.sim.trace import TraceRequest, block_hash

BS = 16
PREFILL = PrefillModel(c0=0.01, c1=1e-4, c2=1e-9)  # 0.1 s per 1k tokens
DECODE = DecodeModel(d0=0.02, d1=1e-3, d2=1e-7)
LINK = TransferModel(latency_s=0.001, bandwidth_bytes_per_s=5e9)
SLO = Slo(max_ttft=5.0, max_tbt=0.2)


def core(rule="cost", **knobs):
    return ConductorCore(ConductorPolicy(PolicyConfig(disaggregation=rule, **knobs)), LinkModels(LINK))


def state(instance_id, role):
    return InstanceState(instance_id, role, PREFILL, DECODE, num_blocks=100_000, max_running=64, chunk_tokens=512)


def shape(n, output=32):
    return RequestShape(n, (n + output) // BS + 1, BS, 1024, output_tokens=output)


def busy_decoding(c: InstanceState, requests: int, context: int, now=0.0):
    """Requests decoding on ``c`` (booked as they would be, already started)."""
    from scheduler.booking import Booking

    for i in range(requests):
        booking = Booking(now, 0.0, context, 10, now, 30.0)
        booking.decode_started = now
        c.decoding.add(f"resident-{c.instance_id}-{i}", booking)


def test_a_request_prefills_where_its_total_cost_is_lower_and_carries_the_other_plan():
    p, c = state("p0", "prefill"), state("c0", "colocated")
    # An idle colocated instance: prefilling there costs no transfer and stalls nobody.
    plan = core().decide_conditional(0.0, shape(1024), {}, [p], [c], SLO)
    assert isinstance(plan, Plan) and is_local(plan) and plan.prefill.instance_id == "c0"
    assert isinstance(plan.alternative, Plan) and plan.alternative.prefill.instance_id == "p0"
    assert "prefills on its decode instance: cost" in plan.reason
    # The same instance decoding for 40 requests: its prompt's chunks would stall all of them.
    busy_decoding(c, 40, 2000)
    plan = core().decide_conditional(0.0, shape(1024), {}, [p], [c], SLO)
    assert isinstance(plan, Plan) and not is_local(plan)
    assert (plan.prefill.instance_id, plan.decode_instance) == ("p0", "c0")
    assert "prefills on a prefill instance: cost" in plan.reason and is_local(plan.alternative)


def test_the_prefix_cached_on_the_decode_instance_keeps_a_long_prompt_local_while_the_pool_is_queued():
    p, c = state("p0", "prefill"), state("c0", "colocated")
    from scheduler.booking import Booking

    p.prefilling.add("queued", Booking(0.0, 2.0, 8000, 0))  # two seconds of prefill queued on the pool
    plan = core().decide_conditional(0.0, shape(8192), {"c0": 8000}, [p], [c], SLO)
    assert isinstance(plan, Plan) and is_local(plan) and plan.prefill.prefix_len == 8000
    # Dynamo's rule decides the same here (little is uncached), and the length rule would not.
    assert is_local(core("dynamo").decide_conditional(0.0, shape(8192), {"c0": 8000}, [p], [c], SLO))
    length = core("length").decide_conditional(0.0, shape(8192), {"c0": 8000}, [p], [c], SLO)
    assert isinstance(length, Plan) and not is_local(length) and "below 2048 tokens" in length.reason


def test_dynamo_goes_remote_for_a_long_uncached_prompt_unless_the_pool_is_busy():
    p, c = state("p0", "prefill"), state("c0", "colocated")
    plan = core("dynamo").decide_conditional(0.0, shape(4096), {}, [p], [c], SLO)
    assert isinstance(plan, Plan) and not is_local(plan) and "by Dynamo's rule" in plan.reason
    from scheduler.booking import Booking

    p.prefilling.add("queued", Booking(0.0, 0.5, 4000, 0))
    assert is_local(core("dynamo").decide_conditional(0.0, shape(4096), {}, [p], [c], SLO))


def test_a_request_is_refused_only_when_neither_path_meets_the_slos():
    p, c = state("p0", "prefill"), state("c0", "colocated")
    from scheduler.booking import Booking

    p.prefilling.add("queued", Booking(0.0, 9.0, 8000, 0))  # the pool: 9 s queued, over the 5 s SLO
    plan = core().decide_conditional(0.0, shape(2048), {}, [p], [c], SLO)
    assert isinstance(plan, Plan) and is_local(plan) and isinstance(plan.alternative, Rejection)
    assert "remotely predicted TTFT" in plan.reason
    c.prefilling.add("queued", Booking(0.0, 9.0, 8000, 0))
    refused = core().decide_conditional(0.0, shape(2048), {}, [p], [c], SLO)
    assert isinstance(refused, Rejection) and refused.kind == "ttft_slo"
    assert refused.reason.startswith("neither path meets the SLOs: remote: predicted TTFT")


def test_a_bad_rule_is_refused_by_name():
    with pytest.raises(ValueError, match="disaggregation must be one of cost, slack, dynamo, length"):
        ConductorPolicy(PolicyConfig(disaggregation="always"))


def _trace(n=200, seed=3):
    import random

    rng = random.Random(seed)
    requests, t = [], 0.0
    for i in range(n):
        t += rng.expovariate(6.0)
        shared = rng.randrange(3)
        hashes = [1000 * shared + j for j in range(rng.randrange(1, 5))] + [10_000 + i]
        requests.append(TraceRequest(i, t, len(hashes) * 512 - rng.randrange(512), rng.randrange(2, 80),
                                     tuple(block_hash(h) for h in hashes)))  # fmt: skip
    return requests


def test_the_simulator_runs_a_mixed_deployment_through_the_same_core():
    profile = Profile(name="mixed", prefill=PrefillModel(0.01, 1e-4, 1e-8), decode=DECODE, link=LINK,
                      bytes_per_token=1024, prefill_cache_tokens=40 * 512, decode_kv_tokens=400 * 512,
                      max_running=32, chunk_tokens=2048)  # fmt: skip
    result = Simulator(SimConfig(policy="conditional", num_prefill=2, num_decode=2, max_ttft=5.0, max_tbt=0.3),
                       profile, _trace()).run()  # fmt: skip
    served = [r for r in result.records if r.served]
    local = [r for r in served if r.prefill_instance == r.decode_instance]
    remote = [r for r in served if r.prefill_instance != r.decode_instance]
    assert len(served) == 200 and local and remote  # both paths taken in one run
    assert {r.prefill_instance for r in local} <= {"c0", "c1"} and {r.prefill_instance for r in remote} <= {"p0", "p1"}
    assert {r.decode_instance for r in served} <= {"c0", "c1"}


def test_a_local_prompt_that_would_push_a_resident_past_the_tbt_slo_goes_remote():
    """Cheaper locally by cost, but its chunks would stall requests with few tokens left past the TBT SLO."""
    from scheduler.booking import Booking

    p, c = state("p0", "prefill"), state("c0", "colocated")
    booking = Booking(0.0, 0.0, 500, 10, 0.0, 0.2)  # a request with about 0.2 s (9 steps) of decoding left
    booking.decode_started = 0.0
    c.decoding.add("r0", booking)
    p.prefilling.add("queued", Booking(0.0, 1.0, 4000, 0))  # the pool has a second queued: local is cheaper
    slo = Slo(max_ttft=5.0, max_tbt=0.05)
    plan = core().decide_conditional(0.0, shape(6000), {}, [p], [c], slo)
    assert isinstance(plan, Plan) and not is_local(plan)
    assert isinstance(plan.alternative, Rejection) and plan.alternative.kind == "tbt_slo"
    assert "would push a request decoding there to a TBT of up to" in plan.reason
    # Without SLO admission the cost decides alone: locally.
    unchecked = core().decide_conditional(0.0, shape(6000), {}, [p], [c], Slo(5.0, 0.05, reject=False))
    assert isinstance(unchecked, Plan) and is_local(unchecked)


def _resident(c: InstanceState, rid: str, decode_s: float, context: int = 500) -> None:
    """A request decoding on c from now for ``decode_s`` seconds (about decode_s / 22 ms tokens)."""
    from scheduler.booking import Booking

    booking = Booking(0.0, 0.0, context, 10, 0.0, decode_s)
    booking.decode_started = 0.0
    c.decoding.add(rid, booking)


def test_stalls_booked_on_a_request_add_up_until_the_next_local_prompt_would_break_its_tbt():
    """Each local prompt stalls a few of a resident's steps: alone each is fine, together they are not."""
    from scheduler.booking import Booking

    p, c = state("p0", "prefill"), state("c0", "colocated")
    p.prefilling.add("queued", Booking(0.0, 2.0, 8000, 0))  # the pool is queued: local is cheaper while admitted
    _resident(c, "r0", 4.4)  # about 200 tokens: its TBT is the mean of its longest 20 gaps
    local, slo, closest = [], Slo(max_ttft=5.0, max_tbt=0.1), []
    for i in range(8):  # up to the SLO itself (no headroom): two prompts fit
        plan = core(local_tbt_headroom=0.0).decide_conditional(0.0, shape(2048, output=8), {}, [p], [c], slo)
        assert isinstance(plan, Plan)
        local.append(is_local(plan))
        if is_local(plan):  # explain says how close to the SLO it leaves the requests it stalls
            within = re.search(r"decoding there within the TBT SLO of 100 ms \(up to (\d+) ms\)", plan.reason)
            closest.append(int(within[1]))
        ConductorCore.book(0.0, f"q{i}", plan, shape(2048, output=8), c if is_local(plan) else p, c)
    booking = c.decoding.items["r0"]
    assert local[0] and not local[-1], local  # local while the resident absorbs the stalls, then remote
    assert booking.stalls and sum(n for n, _ in booking.stalls) >= 2 * local.count(True)  # 4 chunks of 512 each
    assert booking.expected_decode_s > 4.4  # the stalls stretch its decode
    assert closest == sorted(closest) and closest[0] < closest[-1] <= 100, closest  # each adds to r0's stalls
    refused = core(local_tbt_headroom=0.0).decide_conditional(0.0, shape(2048, output=8), {}, [p], [c], slo).alternative
    assert isinstance(refused, Rejection) and "decoding there to a TBT of up to" in refused.reason
    # With the default headroom (20% of the SLO) the stalls stop at 80 ms: fewer prompts go local.
    p, c = state("p0", "prefill"), state("c0", "colocated")
    p.prefilling.add("queued", Booking(0.0, 2.0, 8000, 0))
    _resident(c, "r0", 4.4)
    kept = []
    for i in range(8):
        plan = core().decide_conditional(0.0, shape(2048, output=8), {}, [p], [c], slo)
        kept.append(is_local(plan))
        ConductorCore.book(0.0, f"q{i}", plan, shape(2048, output=8), c if is_local(plan) else p, c)
    assert 0 < kept.count(True) < local.count(True) and "less its 20% headroom" in plan.alternative.reason, kept


def test_the_slack_rule_takes_the_plan_that_leaves_more_room_under_the_slos_where_cost_takes_the_faster():
    """A local prompt that brings a resident to 35 ms of a 100 ms TBT SLO leaves 65% room; a remote plan queued
    one second under a 5 s TTFT SLO leaves 76%: the slack rule goes remote, the cost rule local (its TTFT is
    shorter). Queued three seconds (36% room), both go local."""
    from scheduler.booking import Booking
    from scheduler.disaggregation import slo_slack

    slo = Slo(max_ttft=5.0, max_tbt=0.1)
    for queued, slack_goes_local in ((1.0, False), (3.0, True)):
        p, c = state("p0", "prefill"), state("c0", "colocated")
        p.prefilling.add("queued", Booking(0.0, queued, 8000, 0))
        _resident(c, "r0", 4.4)
        cost = core().decide_conditional(0.0, shape(2048, output=8), {}, [p], [c], slo)
        assert isinstance(cost, Plan) and is_local(cost)
        plan = core("slack").decide_conditional(0.0, shape(2048, output=8), {}, [p], [c], slo)
        assert isinstance(plan, Plan) and is_local(plan) is slack_goes_local
        local = plan if slack_goes_local else plan.alternative
        assert isinstance(local, Plan) and 0.03 < local.stall_tbt < 0.04  # r0 at 35 ms: 65% room
        room, other = slo_slack(plan, slo), slo_slack(plan.alternative, slo)
        assert room > other and f"room under the SLOs {room:.0%} against {other:.0%} the other way" in plan.reason


def test_a_request_prefilled_remotely_decodes_where_no_queued_prompt_stalls_it():
    from scheduler.booking import Booking

    p, c0, c1 = state("p0", "prefill"), state("c0", "colocated"), state("c1", "colocated")
    _resident(c1, "r0", 1.0, context=4000)  # c1 decodes a little slower: the plain choice is c0
    c0.prefilling.add("long", Booking(0.0, 12.0, 30_000, 0, new_tokens=30_000))  # 59 chunks of 0.2 s queued on c0
    slo = Slo(max_ttft=10.0, max_tbt=0.1)
    plan = core("length", local_prefill_max_tokens=1).decide_conditional(0.0, shape(1024, 200), {}, [p], [c0, c1], slo)
    assert isinstance(plan, Plan) and not is_local(plan) and plan.decode_instance == "c1"
    # Without the queued prompt c0 is the choice.
    c0.prefilling.remove("long", 0.0)
    plan = core("length", local_prefill_max_tokens=1).decide_conditional(0.0, shape(1024, 200), {}, [p], [c0, c1], slo)
    assert isinstance(plan, Plan) and plan.decode_instance == "c0"


def test_a_request_that_joins_a_long_prompts_chunking_is_stalled_at_every_step_until_it_ends():
    """Ten 0.5 s chunks queued on c0 for 5 s: a request of 32 tokens at about 20 ms a step that starts decoding
    there at once takes a chunk with each of its first ten steps (not the two that fit in its unstalled 0.66 s),
    so its TBT (the mean of its 4 longest gaps) is about 0.52 s: it decodes on c1 instead."""
    from scheduler.booking import Booking

    p, c0, c1 = state("p0", "prefill"), state("c0", "colocated"), state("c1", "colocated")
    _resident(c1, "r0", 1.0, context=4000)  # c1 decodes a little slower: the plain choice is c0
    c0.prefilling.add("long", Booking(0.0, 5.0, 5120, 0, new_tokens=5120))
    slo = Slo(max_ttft=10.0, max_tbt=0.3)
    plan = core("length", local_prefill_max_tokens=1).decide_conditional(0.0, shape(1024, 32), {}, [p], [c0, c1], slo)
    assert isinstance(plan, Plan) and plan.decode_instance == "c1"
    # Booked on c0 all the same, it carries the ten stalls.
    ConductorCore.book(0.0, "q", plan, shape(1024, 32), p, c0)
    assert c0.decoding.items["q"].stalls == ((10, 0.5),)


def test_a_colocated_request_is_steered_off_an_instance_whose_residents_it_would_push_past_the_tbt_slo():
    """The pure colocated path weighs the stall as a cost and, with SLO admission, re-plans as the conditional
    path does: a request pushed past the SLO after it was admitted is a miss as much as a refused one."""
    c0, c1 = state("c0", "colocated"), state("c1", "colocated")
    _resident(c0, "short", 0.3)  # a few tokens left: a prompt's chunks would be most of its longest gaps
    slo = Slo(max_ttft=10.0, max_tbt=0.05)
    unchecked = core().decide(0.0, shape(8192), {"c0": 6144}, [c0, c1], [c0, c1], Slo(10.0, 0.05, reject=False), True)
    assert isinstance(unchecked, Plan) and unchecked.prefill.instance_id == "c0"  # c0 holds 3/4 of it: cheaper
    holder, idle = (next(e for e in unchecked.candidates if e.instance_id == i) for i in ("c0", "c1"))
    assert holder.t_shared > idle.t_shared  # the stall it imposes on "short" counts against c0
    plan = core().decide(0.0, shape(8192), {"c0": 6144}, [c0, c1], [c0, c1], slo, True)
    assert isinstance(plan, Plan) and plan.prefill.instance_id == "c1" and "; not c0: " in plan.reason
    # With a request decoding on c1 too, every plan pushes one: refused, naming both.
    _resident(c1, "short", 0.3)
    refused = core().decide(0.0, shape(8192), {"c0": 6144}, [c0, c1], [c0, c1], slo, True)
    assert isinstance(refused, Rejection) and refused.kind == "tbt_slo" and "on c0:" in refused.reason


def test_a_colocated_prompt_that_every_instance_would_push_waits_for_room_inside_its_ttft_slo():
    """Refused now, it is planned again when the first request decoding there is due to leave, while the TTFT
    SLO still leaves time for its plan after the wait; otherwise, or with deferral off, it is refused."""
    c0, c1 = state("c0", "colocated"), state("c1", "colocated")
    _resident(c0, "short", 0.3)
    _resident(c1, "short", 0.5)
    slo = Slo(max_ttft=10.0, max_tbt=0.05)
    deferred = core().decide(0.0, shape(8192), {"c0": 6144}, [c0, c1], [c0, c1], slo, True)
    assert isinstance(deferred, Rejection) and deferred.kind == "tbt_slo"
    assert deferred.retry_in == pytest.approx(0.3)  # c0's request leaves first
    assert deferred.plan is not None and deferred.plan.ttft + 0.3 <= 10.0
    tight = Slo(max_ttft=deferred.plan.ttft + 0.2, max_tbt=0.05)  # no time to wait for it
    refused = core().decide(0.0, shape(8192), {"c0": 6144}, [c0, c1], [c0, c1], tight, True)
    assert isinstance(refused, Rejection) and refused.retry_in == 0
    off = core(defer_local_prefill=False).decide(0.0, shape(8192), {"c0": 6144}, [c0, c1], [c0, c1], slo, True)
    assert isinstance(off, Rejection) and off.retry_in == 0
    # Once c0's request has left, the prompt is planned there.
    ConductorCore.release("short", 0.3, c0)
    plan = core().decide(0.3, shape(8192), {"c0": 6144}, [c0, c1], [c0, c1], Slo(10.0, 0.05, ttft_overhead=0.3), True)
    assert isinstance(plan, Plan) and plan.prefill.instance_id == "c0"


def test_the_simulator_defers_what_it_would_refuse_and_serves_it_within_the_ttft_slo():
    profile = Profile(name="colocated", prefill=PrefillModel(0.01, 1e-4, 1e-8), decode=DECODE, link=LINK,
                      bytes_per_token=1024, prefill_cache_tokens=40 * 512, decode_kv_tokens=400 * 512,
                      max_running=32, chunk_tokens=512)  # fmt: skip
    results = {}
    for defer in (False, True):
        config = SimConfig(policy="colocated", num_prefill=1, num_decode=1, max_ttft=10.0, max_tbt=0.1, reject=True,
                           defer_local_prefill=defer)  # fmt: skip
        results[defer] = Simulator(config, profile, _trace()).run().records
    refused = {d: sum(r.rejection == "tbt" for r in records) for d, records in results.items()}
    assert refused[False] > 0 and refused[True] < refused[False], refused
    served = [r for r in results[True] if r.served]
    assert len(served) > len([r for r in results[False] if r.served])
    assert all(r.first_token - r.arrival <= 10.0 for r in served)  # the waits were inside the TTFT SLO
