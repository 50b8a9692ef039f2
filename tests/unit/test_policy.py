"""Algorithm 1, admission and the baselines on scripted cluster states."""

import gc
import math
import random
from dataclasses import replace

import numpy as np
import pytest

from scheduler.booking import Booking
from scheduler.candidates import DecodeCandidate, PrefillCandidate, RequestShape, Resident, Slo
from scheduler.cost_model import DecodeModel, LinkModels, PrefillModel, TransferModel
from scheduler.instance import InstanceState
from scheduler.kv_index import KVIndex
from scheduler.policy import ConductorPolicy, CopySource, Plan, PolicyConfig, Rejection

PREFILL = PrefillModel(c0=0.002, c1=0.0002, c2=1e-8)  # ~5,000 tokens/s
DECODE = DecodeModel(d0=0.005, d1=0.0005, d2=1e-6)
FAST_LINK = LinkModels(TransferModel(latency_s=0.001, bandwidth_bytes_per_s=1e9))
SLOW_LINK = LinkModels(TransferModel(latency_s=0.001, bandwidth_bytes_per_s=1e6))
BPB = 64 * 1024  # bytes per 16-token block
SLO = Slo(max_ttft=10.0, max_tbt=1.0)


def shape(n=1024, blocks=None):
    return RequestShape(n, blocks or math.ceil((n + 16) / 16), 16, BPB)


def decode(instance_id="d0", residents=(), free=10_000):
    return DecodeCandidate(instance_id, tuple(residents), free, 64, DECODE)


def policy(**kw):
    return ConductorPolicy(PolicyConfig(**kw))


def test_cost_models_fit_recovers_coefficients():
    samples = [(n, c, PREFILL.predict(n, c)) for n in (16, 64, 256, 1024) for c in (0, 512)]
    fitted = PrefillModel.fit(samples)
    for n, c, t in samples:
        assert fitted.predict(n, c) == pytest.approx(t, rel=1e-6)
    d_samples = [(b, ctx, DECODE.predict(b, ctx)) for b in (1, 4, 8) for ctx in (64, 4096)]
    assert DecodeModel.fit(d_samples).predict(3, 1000) == pytest.approx(DECODE.predict(3, 1000))
    assert TransferModel.from_gbps(8.0, latency_s=0.001).predict(10**9) == pytest.approx(1.001)


def test_link_models_learn_a_pair_and_fall_back_to_the_prior():
    prior = TransferModel(0.003, 1e9)
    links = LinkModels(prior)
    assert links.model("p0", "d0") is prior
    for nbytes in (1 << 16, 1 << 20, 1 << 24):
        links.observe("p0", "d0", nbytes, 0.0005 + nbytes / 2e9)
    learned = links.model("p0", "d0")
    assert learned.bandwidth_bytes_per_s == pytest.approx(2e9, rel=1e-6)
    assert learned.latency_s == pytest.approx(0.0005, rel=1e-6)
    assert links.model("p0").bandwidth_bytes_per_s == pytest.approx(2e9, rel=1e-6)  # same source, any dest
    assert links.model("p9", "d0").bandwidth_bytes_per_s == pytest.approx(2e9, rel=1e-6)  # all links
    links.observe("store-0", "p0", 1 << 20, 0.01)  # one size: no fit of its own yet (status shows it so)
    (first, second) = links.learned()
    assert first[:3] == ("p0", "d0", 3) and first[3].bandwidth_bytes_per_s == pytest.approx(2e9, rel=1e-6)
    assert second == ("store-0", "p0", 1, None)


def test_a_link_gets_a_model_of_its_own_only_from_enough_transfers():
    """Two slow transfers on a busy moment must not make one prefill instance's T_send far longer than its peer's."""
    links = LinkModels(TransferModel(0.003, 1e9))
    sizes = [1 << k for k in range(16, 26)]
    for nbytes in sizes:
        links.observe("p0", "", nbytes, 0.001 + nbytes / 1e9)
    for nbytes in sizes[:2]:
        links.observe("p1", "", nbytes, 0.5 + nbytes / 1e6)  # a contended moment: 1000x slower
    assert links.model("p1").predict(20 << 20) < 2 * links.model("p0").predict(20 << 20)  # the wider fit
    for nbytes in sizes[2:8]:
        links.observe("p1", "", nbytes, 0.5 + nbytes / 1e6)
    assert links.model("p1").bandwidth_bytes_per_s == pytest.approx(1e6, rel=1e-6)  # eight: its own


def test_a_transfer_refits_only_the_link_models_it_could_change(monkeypatch):
    """Every decision reads each prefill candidate's model: a transfer from p0 must not refit p1's from its window."""
    links = LinkModels(TransferModel(0.003, 1e9))
    sizes = [1 << k for k in range(16, 26)]
    for source, bandwidth in (("p0", 1e9), ("p1", 2e9)):
        for nbytes in sizes:
            links.observe(source, "d0", nbytes, 0.001 + nbytes / bandwidth)
    links.observe("p2", "d0", 1 << 20, 0.002)  # too few of its own: p2's fit reads every link
    copies = [("p0", "p1"), ("p0", "p2"), ("p1", "p0")]  # no transfers of their own: their sources' fits
    before = {p: links.model(p).bandwidth_bytes_per_s for p in ("p0", "p1", "p2")}
    assert [links.model(*c).bandwidth_bytes_per_s for c in copies] == [before["p0"], before["p0"], before["p1"]]
    fits, fit = [], TransferModel.fit
    monkeypatch.setattr(TransferModel, "fit", lambda samples: fits.append(len(samples)) or fit(samples))
    for nbytes in sizes:
        links.observe("p0", "d0", nbytes, 0.001 + nbytes / 4e9)  # p0's link got faster
    after = {p: links.model(p).bandwidth_bytes_per_s for p in ("p0", "p1", "p2")}
    assert [links.model(*c).bandwidth_bytes_per_s for c in copies] == [after["p0"], after["p0"], after["p1"]]
    assert after["p1"] == before["p1"] == pytest.approx(2e9, rel=1e-6)
    assert after["p0"] > before["p0"] and after["p2"] != before["p2"]
    assert len(fits) == 2  # p0's (its candidate's and its copies') and all links' (p2's), once each


def test_a_few_transfers_timed_on_a_busy_moment_do_not_move_a_link_model():
    links = LinkModels(TransferModel(0.003, 1e9))
    sizes = [1 << k for k in range(16, 28)]
    for k, nbytes in enumerate(sizes):
        slow = k in (1, 6, 10)  # a quarter of them waited half a second behind a contended CPU
        links.observe("p0", "", nbytes, 0.001 + nbytes / 1e9 + (0.5 if slow else 0.0))
    learned = links.model("p0")
    assert learned.bandwidth_bytes_per_s == pytest.approx(1e9, rel=1e-6)
    assert learned.latency_s == pytest.approx(0.001, rel=1e-6)
    least_squares = np.linalg.lstsq(  # what a least-squares line through the same transfers predicts instead
        [[1.0, b] for b in sizes], [0.001 + b / 1e9 + 0.5 * (k in (1, 6, 10)) for k, b in enumerate(sizes)], rcond=None
    )[0]
    assert least_squares[0] > 0.1


def test_transfers_of_about_one_size_say_little_about_the_per_byte_time():
    """vLLM's pushes of similar prompts: their times differ by contention, not by their few bytes apart."""
    links = LinkModels(TransferModel(0.003, 1e9))
    for nbytes, seconds in [(40_000_000, 0.2), (40_500_000, 0.45), (41_000_000, 0.22), (41_500_000, 0.5),
                            (1_000_000, 0.006), (80_000_000, 0.4)]:  # fmt: skip
        links.observe("p0", "", nbytes, seconds)
    assert 0.15 < links.model("p0").predict(40_000_000) < 0.5  # unweighted pair slopes predicted 10 s and more


def test_a_vllm_prefill_instance_sends_its_kv_after_the_prefill_and_exports_after_the_running_one():
    """vLLM's connector: no KV streams while later chunks compute, and an export is a request queued there."""
    vllm = InstanceState("p0", "prefill", PREFILL, DECODE, num_blocks=1000, max_running=8, chunk_tokens=64,
                         kv_connector=True)  # fmt: skip
    vllm.prefilling.add("running", Booking(0.0, 0.15, 1000, 0))
    vllm.prefilling.add("waiting", Booking(0.0, 2.0, 4000, 0))
    candidate = vllm.prefill_candidate(0, now=0.1)
    assert candidate.t_queue == pytest.approx(2.05) and candidate.t_export == pytest.approx(0.05)
    assert candidate.exposed_tokens(1000, 0) == 1000  # the whole prompt's KV after token 0
    ours = InstanceState("p1", "prefill", PREFILL, DECODE, num_blocks=1000, max_running=8, chunk_tokens=64)
    ours.prefilling.add("running", Booking(0.0, 0.5, 1000, 0))
    assert ours.prefill_candidate(0, now=0.1).t_export == 0.0  # its pool is read without waiting for a step
    assert ours.prefill_candidate(0, now=0.1).exposed_tokens(1000, 0) < 64  # the last chunk's KV only
    # The copy from a busy vLLM holder waits for its running prefill: in T_transfer.
    cluster = [replace(candidate, prefix_len=960), PrefillCandidate("cold", 0, 0.0, PREFILL)]
    plan = policy().schedule(cluster, [decode()], shape(), SLO, FAST_LINK)
    assert isinstance(plan, Plan) and plan.prefill.instance_id == "cold" and plan.prefill.copy_from == "p0"
    copy = FAST_LINK.model("p0", "cold").predict(60 * BPB)
    export = PREFILL.predict(16, 960 - 16)  # the export computes the prefix's last block again
    assert plan.prefill.t_transfer == pytest.approx(0.05 + export + copy)
    # An import is a request of its own on the puller: its step counts too, when the puller's engine copies so.
    both = [cluster[0], replace(cluster[1], copies_by_request=True)]
    plan = policy().schedule(both, [decode()], shape(), SLO, FAST_LINK)
    assert isinstance(plan, Plan) and plan.prefill.copy_from == "p0"
    assert plan.prefill.t_transfer == pytest.approx(0.05 + export + copy + PREFILL.predict(1, 959))
    # An idle holder: its own prefill of the rest beats exporting, moving and importing the prefix elsewhere.
    idle = [replace(cluster[0], t_export=0.0, t_queue=0.0), both[1]]
    plan = policy().schedule(idle, [decode()], shape(), SLO, FAST_LINK)
    assert isinstance(plan, Plan) and (plan.prefill.instance_id, plan.prefill.copy_from) == ("p0", "")
    # Behind a longer running prefill, recomputing on the cold instance is cheaper than waiting to copy.
    cluster[0] = replace(cluster[0], t_export=0.5)
    plan = policy().schedule(cluster, [decode()], shape(), SLO, FAST_LINK)
    assert isinstance(plan, Plan) and (plan.prefill.instance_id, plan.prefill.copy_from) == ("cold", "")


def test_prefix_holder_wins_when_idle():
    idle = [PrefillCandidate("p0", 0, 0.0, PREFILL), PrefillCandidate("p1", 768, 0.0, PREFILL)]
    plan = policy().schedule(idle, [decode()], shape(), SLO, FAST_LINK)
    assert isinstance(plan, Plan)
    assert plan.prefill.instance_id == "p1"
    assert (plan.prefill.prefix_len, plan.prefill.copy_from) == (768, "")
    assert (plan.best_len, plan.best_instance) == (768, "p1")
    assert "p1" in plan.reason
    assert plan.reason.startswith("prefill p1 by least predicted TTFT (") and "shares" not in plan.reason  # PD


def test_busy_hot_holder_vs_idle_cold_instance_copy_or_recompute_by_bandwidth():
    cluster = [PrefillCandidate("hot", 960, 2.0, PREFILL), PrefillCandidate("cold", 0, 0.0, PREFILL)]
    copied = policy().schedule(cluster, [decode()], shape(), SLO, FAST_LINK)
    assert isinstance(copied, Plan)
    assert copied.prefill.instance_id == "cold"
    assert (copied.prefill.copy_from, copied.prefill.copy_tokens, copied.prefill.prefix_len) == ("hot", 960, 960)
    expected = FAST_LINK.model("hot", "cold").predict(60 * BPB) + PREFILL.predict(1024 - 960, 960)
    assert copied.prefill.t_transfer + copied.prefill.t_prefill == pytest.approx(expected)
    # Over a slow link the copy costs more than recomputing: the cold instance computes everything.
    recomputed = policy().schedule(cluster, [decode()], shape(), SLO, SLOW_LINK)
    assert isinstance(recomputed, Plan)
    assert recomputed.prefill.instance_id == "cold"
    assert (recomputed.prefill.copy_from, recomputed.prefill.prefix_len) == ("", 0)
    # The paper's rule alone plans the slow copy for the cold instance, which then loses to the busy holder.
    forced = policy(compare_copy_with_recompute=False).schedule(cluster, [decode()], shape(), SLO, SLOW_LINK)
    assert isinstance(forced, Plan)
    assert next(c for c in forced.candidates if c.instance_id == "cold").copy_from == "hot"
    assert forced.prefill.instance_id == "hot"


def test_the_store_is_one_more_copy_source_with_its_own_link():
    """A prefix no instance holds any more, but the Mooncake Store does: copied from there when its link is fast."""
    cluster = [PrefillCandidate("p0", 0, 0.0, PREFILL), PrefillCandidate("p1", 0, 0.5, PREFILL)]
    store = CopySource("store-0", 960)
    links = LinkModels(SLOW_LINK.prior)
    for nbytes in (1 << 16, 1 << 20, 1 << 24):  # learned from reads: the Store reads fast into p0
        links.observe("store-0", "p0", nbytes, 0.001 + nbytes / 1e9)
    plan = policy().schedule(cluster, [decode()], shape(), SLO, links, store=store)
    assert isinstance(plan, Plan)
    assert (plan.prefill.instance_id, plan.prefill.copy_from, plan.prefill.copy_tokens) == ("p0", "store-0", 960)
    assert (plan.best_len, plan.best_instance) == (960, "store-0")
    assert "copies 960 tokens of KV from the Mooncake Store (store-0)" in plan.reason
    # Over a slow link recomputing wins; and a holder with the whole prefix ties the Store: no copy from it.
    slow = policy().schedule(cluster, [decode()], shape(), SLO, SLOW_LINK, store=store)
    assert isinstance(slow, Plan) and slow.prefill.copy_from == ""
    held = [PrefillCandidate("p0", 960, 0.0, PREFILL)]
    plan = policy().schedule(held, [decode()], shape(), SLO, FAST_LINK, store=store)
    assert isinstance(plan, Plan) and (plan.prefill.copy_from, plan.best_instance) == ("", "p0")
    # A worker whose engine pool is not ours to fill (vLLM) cannot take the Store's blocks either.
    vllm = [replace(c, exports_kv=False) for c in cluster]
    plan = policy().schedule(vllm, [decode()], shape(), SLO, FAST_LINK, store=store)
    assert isinstance(plan, Plan) and plan.prefill.copy_from == ""


@pytest.mark.parametrize(("threshold", "copies"), [(1.49, True), (1.5, False), (0.8, True), (math.inf, False)])
def test_threshold_boundary(threshold, copies):
    # best_len / prefix_len = 960 / 640 = 1.5: copy only when the ratio is above the threshold.
    cluster = [PrefillCandidate("hot", 960, 5.0, PREFILL), PrefillCandidate("warm", 640, 0.0, PREFILL)]
    plan = policy(kv_cache_balancing_threshold=threshold, compare_copy_with_recompute=False).schedule(
        cluster, [decode()], shape(), SLO, FAST_LINK
    )
    assert isinstance(plan, Plan)
    warm = next(c for c in plan.candidates if c.instance_id == "warm")
    assert (warm.copy_from == "hot") is copies
    assert warm.prefix_len == (960 if copies else 640)


def test_instance_with_no_match_has_an_infinite_ratio():
    cluster = [PrefillCandidate("hot", 16, 5.0, PREFILL), PrefillCandidate("cold", 0, 0.0, PREFILL)]
    plan = policy(kv_cache_balancing_threshold=1000.0, compare_copy_with_recompute=False).schedule(
        cluster, [decode()], shape(), SLO, FAST_LINK
    )
    assert isinstance(plan, Plan)
    assert next(c for c in plan.candidates if c.instance_id == "cold").copy_from == "hot"


def test_no_copies_without_links_or_under_baselines():
    cluster = [PrefillCandidate("hot", 960, 5.0, PREFILL), PrefillCandidate("cold", 0, 0.0, PREFILL)]
    for plan in (
        policy().schedule(cluster, [decode()], shape(), SLO, None),
        policy(policy="least_loaded").schedule(cluster, [decode()], shape(), SLO, FAST_LINK),
    ):
        assert isinstance(plan, Plan)
        assert all(c.copy_from == "" for c in plan.candidates)


def test_prompt_fully_cached_still_computes_its_last_token():
    plan = policy().schedule([PrefillCandidate("p0", 1024, 0.0, PREFILL)], [decode()], shape(1024), SLO, None)
    assert isinstance(plan, Plan)
    assert plan.prefill.prefix_len == 1008


def test_decode_selection_prefers_the_lightest_batch_with_room():
    now = Resident(-1.0, 10.0, 100)
    decodes = [decode("d0", [now] * 8), decode("d1", [now] * 2), decode("d2", [], free=5)]
    plan = policy().schedule([PrefillCandidate("p0", 0, 0.0, PREFILL)], decodes, shape(100), SLO, None)
    assert isinstance(plan, Plan)
    assert plan.decode_instance == "d1"
    full = DecodeCandidate("d3", (now,) * 4, 10_000, 4, DECODE)
    assert isinstance(policy().schedule([PrefillCandidate("p0", 0, 0.0, PREFILL)], [full], shape(100), SLO, None),
                      Rejection)  # fmt: skip


def test_rejection_on_ttft_and_on_tbt_gives_reason_and_numbers():
    busy = [PrefillCandidate("p0", 0, 3.0, PREFILL)]
    rejected = policy().schedule(busy, [decode()], shape(), Slo(2.0, 1.0), FAST_LINK)
    assert isinstance(rejected, Rejection)
    assert "TTFT" in rejected.reason and "2000 ms" in rejected.reason
    assert rejected.plan is not None and rejected.plan.prefill.ttft > 3.0
    assert isinstance(policy().schedule(busy, [decode()], shape(), Slo(2.0, 1.0, reject=False), FAST_LINK), Plan)
    crowded = decode("d0", [Resident(-1.0, 60.0, 2000)] * 40)
    rejected = policy().schedule([PrefillCandidate("p0", 0, 0.0, PREFILL)], [crowded], shape(), Slo(9, 0.05))
    assert isinstance(rejected, Rejection)
    assert "TBT" in rejected.reason and "50 ms" in rejected.reason
    full = policy().schedule([PrefillCandidate("p0", 0, 0.0, PREFILL)], [decode(free=3)], shape(), Slo(9, 9))
    assert isinstance(full, Rejection) and "free KV blocks" in full.reason


def test_prediction_based_rejection_vs_plain_early_rejection():
    slo = Slo(max_ttft=10.0, max_tbt=0.030)
    prefills = [PrefillCandidate("p0", 0, 0.5, PREFILL)]  # TTFT ~0.72 s
    # The batch is heavy now but drains before this request's prefill ends: plain refuses, prediction accepts.
    leaving = decode("d0", [Resident(-5.0, 0.3, 1000)] * 40)
    assert isinstance(policy(early_rejection="plain").schedule(prefills, [leaving], shape(), slo), Rejection)
    assert isinstance(policy(early_rejection="prediction").schedule(prefills, [leaving], shape(), slo), Plan)
    # The batch is light now but prefilled requests join it before ours: plain accepts, prediction refuses.
    joining = decode("d0", [Resident(0.2, 30.0, 1000)] * 40)
    assert isinstance(policy(early_rejection="plain").schedule(prefills, [joining], shape(), slo), Plan)
    assert isinstance(policy(early_rejection="prediction").schedule(prefills, [joining], shape(), slo), Rejection)


def test_baselines_choose_as_named():
    cluster = [
        PrefillCandidate("a", 0, 0.5, PREFILL),
        PrefillCandidate("b", 512, 0.9, PREFILL),
        PrefillCandidate("c", 0, 0.1, PREFILL),
    ]

    def chosen(name, n=1):
        p = policy(policy=name)
        return [p.schedule(cluster, [decode()], shape(), SLO, None).prefill.instance_id for _ in range(n)]

    assert chosen("round_robin", 4) == ["a", "b", "c", "a"]
    assert chosen("least_loaded") == ["c"]
    assert chosen("cache_aware") == ["b"]
    assert set(chosen("random", 30)) == {"a", "b", "c"}
    with pytest.raises(ValueError, match="policy must be one of"):
        policy(policy="fastest")


def test_kv_index_prefix_match_gaps_and_drops():
    index = KVIndex()
    h = [bytes([i]) * 32 for i in range(6)]
    assert index.apply("p0", 1, [], [], full=True) is False
    assert index.apply("p0", 2, h[:4], []) is False
    assert index.apply("p1", 1, h[:2], [], full=True) is False
    match = index.match_prefix(h)
    assert match.prefix_blocks == {"p0": 4, "p1": 2}
    assert (match.best_blocks, match.best_instance) == (4, "p0")
    assert index.match_prefix(h, ["p1"]).prefix_blocks == {"p1": 2}
    assert index.apply("p0", 4, [h[4]], []) is True  # seq 3 was lost: resync
    assert index.apply("p0", 3, [], [h[1]]) is False  # evicting block 1 cuts p0's prefix at 1
    assert index.match_prefix(h).prefix_blocks == {"p0": 1, "p1": 2}
    assert index.apply("p0", 3, [], [h[1]]) is False  # sent again after a timeout: in already, no resync
    assert index.apply("p0", 2, h[:4], []) is False  # an older one too: nothing changes
    assert index.match_prefix(h).prefix_blocks == {"p0": 1, "p1": 2}
    assert index.drop_instance("p1") == 2
    assert index.match_prefix(h).prefix_blocks == {"p0": 1}
    assert index.apply("p9", 5, [h[0]], []) is True  # unknown instance: resync


def test_kv_index_matches_a_brute_force_reference_through_random_events():
    rng = random.Random(5)
    h = [bytes([i]) * 32 for i in range(40)]
    index, held = KVIndex(), {f"p{i}": set() for i in range(6)}
    seq = dict.fromkeys(held, 1)
    for instance in held:
        index.apply(instance, 1, [], [], full=True)
    for _ in range(400):
        instance = rng.choice(sorted(held))
        if rng.random() < 0.05:  # a lease lost, then a resync with a fresh inventory
            index.drop_instance(instance)
            held[instance] = set(rng.sample(h, rng.randrange(10)))
            seq[instance] = 1
            index.apply(instance, 1, held[instance], [], full=True)
        else:
            stored = h[: rng.randrange(len(h))] if rng.random() < 0.5 else rng.sample(h, 3)
            removed = rng.sample(h, rng.randrange(4))
            seq[instance] += 1
            assert index.apply(instance, seq[instance], stored, removed) is False
            held[instance] = (held[instance] - set(removed)) | set(stored)
        prompt = h[: rng.randrange(1, len(h))]
        wanted = rng.sample(sorted(held), rng.randrange(3))
        expected = {}
        for name in wanted or held:
            n = next((i for i, b in enumerate(prompt) if b not in held[name]), len(prompt))
            if n:
                expected[name] = n
        assert index.match_prefix(prompt, wanted).prefix_blocks == expected
        assert all(index.num_blocks(name) == len(blocks) for name, blocks in held.items())


def test_kv_streaming_leaves_only_the_last_chunk_to_send_after_token_0():
    links = LinkModels(TransferModel(latency_s=0.0, bandwidth_bytes_per_s=BPB * 16))  # 16 blocks/s: slow on purpose
    whole = PrefillCandidate("p0", 0, 0.0, PREFILL)
    streamed = PrefillCandidate("p0", 0, 0.0, PREFILL, chunk_tokens=512)
    assert streamed.exposed_tokens(1200, 0) == 176  # chunks of 512, 512, 176
    assert streamed.exposed_tokens(400, 0) == 400  # one chunk: everything goes after token 0
    assert streamed.exposed_tokens(1200, 800) == 1200  # 400 new tokens: one chunk
    plans = [policy().schedule([c], [decode()], shape(1200), SLO, links) for c in (whole, streamed)]
    assert plans[0].prefill.t_send == pytest.approx(75 / 16)  # 75 blocks
    assert plans[1].prefill.t_send == pytest.approx(11 / 16)  # the last chunk's 11 blocks


def test_a_colocated_instance_busy_decoding_loses_its_cache_advantage():
    # Both colocated; the holder decodes 12 requests, so each of its prefill steps carries a decode step too.
    busy_step = DECODE.predict(12, 12 * 600)
    holder = PrefillCandidate("holder", 640, 0.0, PREFILL, decode_step_s=busy_step, step_tokens=16)
    idle = PrefillCandidate("idle", 0, 0.0, PREFILL, decode_step_s=DECODE.predict(0, 0), step_tokens=16)
    assert holder.t_prefill(400, 640) == pytest.approx(PREFILL.predict(400, 640) + 25 * busy_step)
    decodes = [decode("holder"), decode("idle")]
    plan = policy().schedule([holder, idle], decodes, shape(1040), SLO, None, colocated=True)
    assert isinstance(plan, Plan)
    assert (plan.prefill.instance_id, plan.decode_instance) == ("idle", "idle")
    assert "by least predicted TTFT plus the decode time it shares (" in plan.reason
    quiet = replace(holder, decode_step_s=0.0)
    plan = policy().schedule([quiet, idle], decodes, shape(1040), SLO, None, colocated=True)
    assert isinstance(plan, Plan) and (plan.prefill.instance_id, plan.decode_instance) == ("holder", "holder")
    full = [decode("holder", free=3), decode("idle")]  # the holder has no room: the other takes it
    plan = policy().schedule([quiet, idle], full, shape(1040), SLO, None, colocated=True)
    assert isinstance(plan, Plan) and plan.decode_instance == "idle"


def test_the_measured_ttft_overhead_counts_for_admission_not_for_the_choice():
    cluster = [PrefillCandidate("p0", 0, 0.0, PREFILL), PrefillCandidate("p1", 0, 0.1, PREFILL)]
    n = 3000  # about 0.7 s of prefill
    alone = policy().schedule(cluster, [decode()], shape(n), Slo(1.0, 1.0))
    assert isinstance(alone, Plan) and alone.prefill.instance_id == "p0" and alone.ttft == alone.prefill.ttft
    late = policy().schedule(cluster, [decode()], shape(n), Slo(1.0, 1.0, ttft_overhead=0.5))
    assert isinstance(late, Rejection) and late.kind == "ttft_slo"
    assert late.plan is not None and late.plan.prefill.instance_id == "p0"
    assert late.plan.ttft == pytest.approx(late.plan.prefill.ttft + 0.5)
    assert f"{late.plan.ttft * 1e3:.0f} ms" in late.reason


def test_idle_instances_admit_a_probe_when_only_the_learned_models_predict_a_miss():
    contended = PrefillModel(c0=0.002, c1=0.0008, c2=4e-8)  # learned in a burst: 4x slower than the profile
    n = 2000  # profile: about 0.45 s of prefill; learned: about 1.8 s
    idle = PrefillCandidate("p0", 0, 0.0, contended, idle=True, profile=PREFILL)
    d = replace(decode(), profile=DECODE)
    slo = Slo(max_ttft=1.0, max_tbt=1.0)
    probe = policy().schedule([idle], [d], shape(n), slo)
    assert isinstance(probe, Plan) and probe.probe
    assert probe.ttft > 1.0  # the prediction keeps its numbers
    assert probe.solo is not None and probe.solo[0] == pytest.approx(PREFILL.predict(n))
    assert "probe" in probe.reason
    busy = replace(idle, idle=False)  # something queued or running: the learned models decide
    assert isinstance(policy().schedule([busy], [d], shape(n), slo), Rejection)
    decoding = replace(d, residents=(Resident(0.0, 1.0, 100),))
    assert isinstance(policy().schedule([idle], [decoding], shape(n), slo), Rejection)
    too_long = policy().schedule([idle], [d], shape(6000), slo)  # over the SLO even under the profile
    assert isinstance(too_long, Rejection) and too_long.kind == "ttft_slo"
    assert too_long.plan is not None and too_long.plan.solo is not None and too_long.plan.solo[0] > 1.0


def test_the_ttft_overhead_is_a_bounded_median_of_fresh_samples():
    from scheduler.ttft_overhead import TtftOverhead

    overhead = TtftOverhead(cap_s=0.5, horizon_s=60.0)
    assert overhead.value(0.0) == 0.0
    for i, sample in enumerate((0.01, 0.012, 3.0, 0.011, -0.2)):  # one slow outlier, one negative residual
        overhead.observe(float(i), sample)
    assert overhead.value(5.0) == pytest.approx(0.011)
    for i in range(10):
        overhead.observe(10.0 + i, 2.0)  # a burst of queueing-like samples cannot pass the cap
    assert overhead.value(20.0) == 0.5
    assert overhead.value(200.0) == 0.0  # decays: nothing fresh


def test_the_peers_rules_are_policies_like_the_others():
    idle = PrefillCandidate("idle", 0, 0.0, PREFILL)
    holder = PrefillCandidate("holder", 512, 0.5, PREFILL, in_flight=3, queued_new_tokens=3000)
    sglang = policy(policy="sglang").schedule([idle, holder], [decode()], shape(1024), SLO, FAST_LINK)
    assert isinstance(sglang, Plan) and sglang.prefill.instance_id == "holder"  # 50% match beats the load
    assert not sglang.prefill.copy_from and "SGLang" in sglang.reason
    dynamo = policy(policy="dynamo").schedule([idle, holder], [decode()], shape(1024), SLO, FAST_LINK)
    assert isinstance(dynamo, Plan) and dynamo.prefill.instance_id == "idle"  # 64 blocks < 64 + 188 - 32
    short = replace(holder, prefix_len=256)  # 25% match: the least loaded
    sglang = policy(policy="sglang").schedule([idle, short], [decode()], shape(1024), SLO, FAST_LINK)
    assert isinstance(sglang, Plan) and sglang.prefill.instance_id == "idle"


def test_every_policy_is_a_valid_scheduler_setting():
    from scheduler.policy import POLICIES
    from services.common.config import load_config

    assert {"dynamo", "sglang", "kvcache_centric"} <= set(POLICIES)
    for name in POLICIES:
        assert load_config(None, [f'scheduler.policy="{name}"']).scheduler.policy == name


def test_colocated_choice_counts_the_decode_time_a_prompt_shares_with_the_holders_batch():
    """A prefix holder decoding 12 requests loses to an idle instance once the slowdown it spreads costs more."""
    busy = [Resident(-1.0, 30.0, 600) for _ in range(12)]
    holder = PrefillCandidate("holder", 3000, 0.0, PREFILL, step_tokens=4096)
    idle = PrefillCandidate("idle", 0, 0.0, PREFILL, step_tokens=4096)
    request = replace(shape(3400), output_tokens=64)

    def chosen(residents, request):
        plan = policy().schedule([holder, idle], [decode("holder", residents), decode("idle")], request, SLO,
                                 colocated=True)  # fmt: skip
        assert isinstance(plan, Plan)
        return plan

    plan = chosen(busy, request)
    assert plan.prefill.instance_id == plan.decode_instance == "idle"
    on_holder = next(c for c in plan.candidates if c.instance_id == "holder")
    before, after = DECODE.predict(12, 12 * 600), DECODE.predict(13, 12 * 600 + 3400)
    assert on_holder.t_shared == pytest.approx(12 * PREFILL.predict(400, 3000) + 64 * (after + 12 * (after - before)))
    assert on_holder.ttft < plan.prefill.ttft  # the holder alone would have the lower TTFT
    assert chosen(busy[:1], request).prefill.instance_id == "holder"  # a small batch: the prefix wins
    assert chosen((), request).prefill.instance_id == "holder"


def test_the_kv_index_holds_no_container_the_garbage_collector_walks():
    """A full collection must not walk the index's blocks: 400k of them cost a 20 ms pause in a set per instance."""
    index = KVIndex()
    hashes = [i.to_bytes(32, "little") for i in range(2000)]
    for n, instance in enumerate(("p0", "p1", "store-0")):
        index.update(instance, hashes[: 1000 * (n + 1) // 2 + 500], [])
    index.update("p1", [], hashes[:10])
    gc.collect()
    assert not gc.is_tracked(index._holders)
    assert sorted(index.blocks("p1")) == sorted(hashes[10:1500]) and index.num_blocks("p1") == 1490
    assert sorted(dict(index.inventories())["p0"]) == sorted(hashes[:1000])
    assert index.drop_instance("p0") == 1000 and index.match_prefix(hashes).prefix_blocks == {"store-0": 2000}


def test_a_reason_names_the_cheapest_eight_candidates_of_many():
    """The reason is logged for every request: at 256 instances it named all 256."""
    cluster = [PrefillCandidate(f"p{i:03d}", 0, i * 0.01, PREFILL) for i in range(40)]
    plan = policy().schedule(cluster, [decode()], shape(), SLO, FAST_LINK)
    assert isinstance(plan, Plan) and len(plan.candidates) == 40
    assert "p007=" in plan.reason and "p008=" not in plan.reason and ", 32 more)" in plan.reason
