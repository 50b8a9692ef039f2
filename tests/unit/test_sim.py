"""The simulator against hand-computable cases, and proof that it runs the live policy code."""

import json
from dataclasses import replace

import numpy as np
import pytest

from scheduler.cost_model import DecodeModel, PrefillModel, TransferModel
from scheduler.policy import ConductorPolicy
from scheduler.profiles import GpuSpec, Profile, analytic_gpu, load_profile, named_profile
from scheduler.sim.metrics import RequestRecord, summarize, tbt_of
from scheduler.sim.simulator import SIM_POLICIES, SimConfig, Simulator
from scheduler.sim.trace import TraceRequest, block_hash, load_trace

BS = 512
PROFILE = Profile(
    name="test",
    prefill=PrefillModel(c0=0.01, c1=1e-4, c2=1e-8),
    decode=DecodeModel(d0=0.01, d1=1e-3, d2=1e-7),
    link=TransferModel(latency_s=0.0, bandwidth_bytes_per_s=1e30),  # transfers take no time
    bytes_per_token=1024,
    prefill_cache_tokens=100 * BS,
    decode_kv_tokens=1000 * BS,
    max_running=64,
    chunk_tokens=8192,
)


def request(rid, arrival, n, hash_ids, out=4):
    return TraceRequest(rid, arrival, n, out, tuple(block_hash(h) for h in hash_ids))


def run(requests, policy="kvcache_centric", profile=PROFILE, **kw):
    config = SimConfig(policy=policy, num_prefill=kw.pop("num_prefill", 1), num_decode=kw.pop("num_decode", 1), **kw)
    return Simulator(config, profile, requests).run()


def test_one_request_ttft_is_the_profile_prefill_time():
    result = run([request(0, 0.0, 1500, [1, 2, 3])])
    r = result.records[0]
    assert r.first_token - r.arrival == pytest.approx(PROFILE.prefill.predict(1500, 0))
    assert r.predicted_ttft == pytest.approx(PROFILE.prefill.predict(1500, 0))


def test_one_request_decodes_at_the_profile_step_time():
    result = run([request(0, 0.0, 1000, [1, 2], out=3)])
    r = result.records[0]
    steps = result.step_logs["d0"]
    first = PROFILE.decode.predict(1, 1001)
    assert steps[0] - r.first_token == pytest.approx(first)
    assert steps[1] - steps[0] == pytest.approx(PROFILE.decode.predict(1, 1002))
    assert r.finish == pytest.approx(steps[1])


def test_prompt_kv_streams_to_decode_during_later_chunks():
    """Live, each chunk's KV leaves while the next computes: token 0 waits only for the last chunk's."""
    link = TransferModel(latency_s=0.001, bandwidth_bytes_per_s=1e9)
    profile = replace(PROFILE, link=link, chunk_tokens=1024)
    r = run([request(0, 0.0, 2500, [1, 2, 3, 4, 5])], profile=profile).records[0]
    prefill = sum(profile.prefill.predict(n, done) for n, done in ((1024, 0), (1024, 1024), (452, 2048)))
    last_chunk = link.predict(BS * profile.bytes_per_token)  # its 452 tokens' one block
    assert r.first_token - r.arrival == pytest.approx(prefill + last_chunk)
    assert r.predicted_ttft == pytest.approx(profile.prefill.predict(2500, 0) + last_chunk)  # the policy's the same
    one_chunk = run([request(0, 0.0, 1000, [1])], profile=profile).records[0]  # all of it goes after
    assert one_chunk.first_token - one_chunk.arrival == pytest.approx(
        profile.prefill.predict(1000, 0) + link.predict(2 * BS * profile.bytes_per_token)
    )


def test_second_identical_prefix_hits_the_cache():
    first, second = request(0, 0.0, 1500, [1, 2, 3]), request(1, 10.0, 1500, [1, 2, 3])
    result = run([first, second])
    r0, r1 = result.records
    assert r0.local_tokens == 0
    assert r1.local_tokens == 2 * BS  # two full blocks; the partial third one is never reused
    assert r1.first_token - r1.arrival == pytest.approx(PROFILE.prefill.predict(1500 - 2 * BS, 2 * BS))


@pytest.mark.parametrize(
    ("first", "second", "reused"),
    [
        ((1500, [1, 2, 3]), (1500, [1, 2, 3]), 1488),  # the same prompt: its partial third block's 476 of 476 -> 464
        ((1100, [1, 2, 3]), (1500, [1, 2, 3]), 1088),  # a later prompt continues the block the first ended inside
        ((1536, [1, 2, 3]), (1300, [1, 2, 3]), 1296),  # it ends inside a block the first cached whole
        ((1100, [1, 2, 3]), (1500, [1, 2, 4]), 1024),  # a different third block: whole blocks only
    ],
)
def test_a_partly_shared_trace_block_is_reused_in_engine_blocks_as_live(first, second, reused):
    """A live prefix cache holds 16-token blocks, so it reuses the whole 16-token pieces of a 512-token trace
    block that a prompt ended inside; ``cache_block_tokens`` makes the simulator do the same (up to the last
    prompt token, which is always computed)."""
    requests = [request(0, 0.0, *first), request(1, 10.0, *second)]
    r1 = run(requests, cache_block_tokens=16).records[1]
    assert r1.local_tokens == reused
    assert r1.first_token - r1.arrival == pytest.approx(PROFILE.prefill.predict(second[0] - reused, reused))
    assert run(requests).records[1].local_tokens == min(reused // BS * BS, (second[0] - 1) // BS * BS)


def test_partly_cached_blocks_give_way_to_whole_ones_and_stay_out_of_the_index():
    from scheduler.kv_index import KVIndex
    from scheduler.sim.prefix_cache import PrefixCache

    index = KVIndex()
    cache = PrefixCache("p0", 2, index, cache_block_tokens=16)
    cache.store([block_hash(1)], (block_hash(2), 300))
    assert len(cache) == 2 and cache.match_tokens([block_hash(1), block_hash(2)], 1024, BS) == 512 + 288
    assert index.match_prefix([block_hash(1), block_hash(2)], ["p0"]).prefix_blocks == {"p0": 1}
    cache.store([block_hash(3), block_hash(4)])  # two whole blocks fill it: the tail goes first, then block 1
    assert len(cache) == 2 and cache.match_tokens([block_hash(1), block_hash(2)], 1024, BS) == 0
    with pytest.raises(ValueError, match="cache_block_tokens"):
        SimConfig(cache_block_tokens=48)


def test_kvcache_centric_copies_a_hot_prefix_to_an_idle_instance():
    # p0 and p1 both compute a 20-block prompt; then a burst of requests sharing it queues up, and the
    # policy copies the prefix to the idle instances rather than recomputing it there.
    prefix = list(range(1, 21))
    requests = [request(0, 0.0, 20 * BS + 10, [*prefix, 100])]
    requests += [request(i, 5.0, 20 * BS + 10, [*prefix, 100 + i]) for i in range(1, 6)]
    result = run(requests, num_prefill=3)
    assert sum(r.copied_tokens for r in result.records) > 0
    assert all(r.local_tokens + r.copied_tokens == 20 * BS for r in result.records[1:])


def test_decisions_come_from_the_live_conductor_policy(monkeypatch):
    calls = []
    live = ConductorPolicy.schedule

    def spy(self, *args, **kwargs):
        calls.append(self.config.policy)
        return live(self, *args, **kwargs)

    monkeypatch.setattr(ConductorPolicy, "schedule", spy)
    requests = [request(i, i * 0.1, 700, [1, 10 + i]) for i in range(5)]
    for policy in SIM_POLICIES:
        calls.clear()
        run(requests, policy=policy, num_prefill=2, num_decode=2)
        plans = 2 if policy == "conditional" else 1  # remote and local, compared (scheduler/disaggregation.py)
        assert len(calls) == plans * len(requests), policy


@pytest.mark.parametrize("policy", SIM_POLICIES)
def test_tiny_trace_completes_under_every_policy(policy):
    requests = [request(i, i * 0.05, 300 + 97 * i, [i % 3, 10 + i], out=1 + i % 5) for i in range(30)]
    result = run(requests, policy=policy, num_prefill=2, num_decode=2)
    assert all(r.served and r.finish >= r.first_token > r.arrival for r in result.records)
    summary, ttft, _ = summarize(result.records, result.step_logs)
    assert summary.served == 30 and len(ttft) == 30


def test_colocated_decode_stalls_behind_a_prefill():
    # r1 shares 15 of its 16 blocks with r0, which decodes on c0: c0 computes 320 new tokens against 8,000 on
    # c1 (the decode steps it shares count too), so it takes r1, and r0's decode waits for that prefill.
    prefill_s = PROFILE.prefill.predict(7680, 0)
    r0 = request(0, 0.0, 7680, list(range(15)), out=50)
    r1 = request(1, prefill_s + 0.1, 8000, [*range(15), 100], out=2)
    result = run([r0, r1], policy="colocated")
    a, b = result.records
    assert a.prefill_instance == b.prefill_instance == a.decode_instance == b.decode_instance == "c0"
    longest_gap = np.diff(result.step_logs["c0"][:49]).max()
    assert longest_gap == pytest.approx(PROFILE.prefill.predict(320, 7680) + PROFILE.decode.predict(1, 7680), rel=0.05)
    alone = run([r0], policy="colocated")
    assert np.diff(alone.step_logs["c0"]).max() < 0.02


def test_colocated_requests_avoid_an_instance_whose_decodes_they_would_stall():
    # Nothing to reuse: the idle instance is predicted faster, and the request is booked where it was judged.
    r0, r1 = request(0, 0.0, 500, [1], out=50), request(1, 0.2, 8000, list(range(100, 116)), out=2)
    result = run([r0, r1], policy="colocated")
    assert [(r.prefill_instance, r.decode_instance) for r in result.records] == [("c0", "c0"), ("c1", "c1")]
    assert np.diff(result.step_logs["c0"]).max() < 0.02


def test_admission_rejects_when_the_ttft_slo_cannot_be_met():
    requests = [request(i, 0.0, 8000, [1000 + i], out=2) for i in range(5)]
    result = run(requests, reject=True, max_ttft=PROFILE.prefill.predict(8000, 0) * 2.5)
    kinds = [r.rejection for r in result.records]
    assert kinds.count("") == 2 and kinds.count("ttft") == 3


def test_tbt_is_the_mean_of_the_longest_tenth_of_gaps():
    r = RequestRecord(0, 0.0, 10, 21, first_token=0.0, first_step=0)
    steps = [float(i + 1) for i in range(20)]
    steps[5] += 0.5  # gaps: one of 1.5, one of 0.5, the rest 1.0
    for i in range(6, 20):
        steps[i] += 0.5
    assert tbt_of(r, np.array(steps)) == pytest.approx((1.5 + 1.0) / 2)


def test_analytic_profile_is_the_papers_formula_in_closed_form():
    spec = GpuSpec()
    p = analytic_gpu(spec)
    flops = spec.gpus * spec.peak_flops * spec.mfu
    n = 4096
    paper = spec.layers * (spec.attn_coef * n * n * spec.hidden + spec.linear_coef * n * spec.hidden**2) / flops
    assert p.prefill.predict(n, 0) - p.prefill.c0 == pytest.approx(paper)
    assert p.bytes_per_token == 327_680  # 2 x 80 layers x 8 KV heads x 128 x 2 bytes


def test_linear_profile_charges_new_tokens_only_as_a_one_dimensional_table_does():
    full, linear = named_profile("analytic-gpu"), named_profile("analytic-gpu-linear")
    assert linear.prefill.predict(4096, 8192) == linear.prefill.predict(4096, 0)  # the cached context is free
    assert linear.prefill.predict(4096, 0) == pytest.approx(full.prefill.c0 + full.prefill.c1 * 4096)
    assert (linear.decode, linear.link, linear.chunk_tokens) == (full.decode, full.link, full.chunk_tokens)


def test_trace_and_profile_files(tmp_path):
    trace = tmp_path / "t.jsonl"
    rows = [{"timestamp": 2000, "input_length": 1025, "output_length": 3, "hash_ids": [0, 1, 2]}]
    trace.write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    (r,) = load_trace(trace, speed=2.0)
    assert r.arrival == 1.0 and len(r.full_blocks) == 2 and r.num_output_tokens == 3
    assert load_trace(trace, max_output_tokens=2)[0].num_output_tokens == 2  # capped, as `plan --max-output-tokens`
    assert load_trace(trace, max_output_tokens=8)[0].num_output_tokens == 3
    profile = tmp_path / "p.json"
    profile.write_text(json.dumps({"prefill": {"c0": 1.0, "c1": 0.0, "c2": 0.0}, "max_running": 7}))
    loaded = load_profile(profile, PROFILE)
    assert loaded == replace(PROFILE, prefill=PrefillModel(1.0, 0.0, 0.0), max_running=7)
    profile.write_text('{"bogus": 1}')
    with pytest.raises(ValueError, match="unknown profile keys: bogus"):
        load_profile(profile, PROFILE)


def test_t_queue_counts_the_whole_backlog():
    from scheduler.booking import Booking, Bookings

    bookings = Bookings()
    for rid in range(3):
        bookings.add(rid, Booking(0.0, 1.0, 100, 1))  # three 1 s prefills queued at t=0
    assert bookings.t_queue(0.5) == pytest.approx(2.5)
    bookings.remove(0, 1.2)  # the first took 1.2 s: the second starts then
    assert bookings.t_queue(1.5) == pytest.approx(1.7)  # 0.7 s left of the running one + 1 s queued
    bookings.prefill_done(1, 2.0)
    assert bookings.t_queue(2.5) == pytest.approx(0.5)
    assert bookings.num_blocks == 2


def test_a_late_prefill_does_not_hide_the_queue_behind_it():
    from scheduler.booking import Booking, Bookings

    bookings = Bookings()
    for rid in range(3):
        bookings.add(rid, Booking(0.0, 1.0, 100, 1))  # three 1 s prefills queued at t=0
    assert bookings.t_queue(2.5) == pytest.approx(2.0)  # the first is 1.5 s late: the two behind it still wait
    assert bookings.t_queue(0.5) == pytest.approx(2.5)  # on time: the clock as before
    bookings.remove(0, 3.0)
    assert bookings.t_queue(3.0) == pytest.approx(2.0)
    bookings.remove(1, 3.5)
    bookings.remove(2, 4.0)
    assert bookings.t_queue(4.0) == 0.0 and not bookings._pending


def test_prediction_error_makes_actual_times_differ_from_predicted_ones_reproducibly():
    requests = [request(i, 2.0 * i, 1500, [10 * i, 10 * i + 1, 10 * i + 2]) for i in range(40)]

    def ratios(**kw):
        return [(r.first_token - r.arrival) / r.predicted_ttft for r in run(requests, **kw).records]

    assert ratios() == pytest.approx([1.0] * 40)  # perfect models: every TTFT as predicted
    noisy = ratios(prediction_error=0.3, seed=7)
    assert noisy == ratios(prediction_error=0.3, seed=7)  # seeded
    assert noisy != ratios(prediction_error=0.3, seed=8)
    logs = np.log(noisy)
    assert 0.15 < float(np.std(logs)) < 0.45 and abs(float(np.mean(logs))) < 0.15
    with pytest.raises(ValueError, match="prediction_error"):
        SimConfig(prediction_error=-0.1)


def test_a_prefix_evicted_from_every_instance_is_copied_back_from_the_store():
    link = TransferModel(latency_s=0.001, bandwidth_bytes_per_s=1e9)
    small = replace(PROFILE, prefill_cache_tokens=4 * BS, link=link)  # one prompt of 3 blocks fits, two do not
    a, b = [1, 2, 3], [7, 8, 9]
    trace = [request(0, 0.0, 1600, a), request(1, 10.0, 1600, b), request(2, 20.0, 1600, a)]
    without = run(trace, profile=small).records[2]
    assert (without.local_tokens, without.copied_tokens) == (0, 0)  # evicted by b: computed again
    r = run(trace, profile=small, store_tokens=100 * BS).records[2]
    assert (r.local_tokens, r.copied_tokens, r.store_tokens) == (0, 3 * BS, 3 * BS)
    expected = link.predict(3 * BS * small.bytes_per_token) + small.prefill.predict(1600 - 3 * BS, 3 * BS)
    send = link.predict(4 * BS * small.bytes_per_token)  # one chunk: the whole prompt's KV goes after it
    assert r.first_token - r.arrival == pytest.approx(expected + send)
    summary = summarize(run(trace, profile=small, store_tokens=100 * BS).records, {})[0]
    assert summary.store_hit_rate == pytest.approx(3 * BS / 4800)
    with pytest.raises(ValueError, match="store_tokens"):
        SimConfig(policy="colocated", store_tokens=BS)
