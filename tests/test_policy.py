import pytest

from scheduler.cost_model import DecodeModel, PrefillModel, TransferModel
from scheduler.kv_index import KVIndex
from scheduler.policy import DecodeCandidate, Plan, PrefillCandidate, Rejection, RequestShape, Slo, schedule

pytestmark = pytest.mark.unit

PREFILL = PrefillModel(c0=0.002, c1=0.0002, c2=1e-8)
DECODE = DecodeModel(d0=0.005, d1=0.0005, d2=1e-6)


def decode(instance_id="d0", running=0, free=1000):
    return DecodeCandidate(instance_id, running, running * 100, free, 64, DECODE)


def test_cost_models_fit_recovers_coefficients():
    samples = [(n, c, PREFILL.predict(n, c)) for n in (16, 64, 256, 1024) for c in (0, 512)]
    fitted = PrefillModel.fit(samples)
    for n, c, t in samples:
        assert fitted.predict(n, c) == pytest.approx(t, rel=1e-6)
    d_samples = [(b, ctx, DECODE.predict(b, ctx)) for b in (1, 4, 8) for ctx in (64, 4096)]
    assert DecodeModel.fit(d_samples).predict(3, 1000) == pytest.approx(DECODE.predict(3, 1000))
    assert TransferModel.from_gbps(8.0, latency_s=0.001).predict(10**9) == pytest.approx(1.001)


def test_prefix_holder_wins_when_idle_and_queue_moves_work_away():
    shape = RequestShape(num_prompt_tokens=1024, num_blocks=70, kv_bytes=0)
    slo = Slo(max_ttft=10.0, max_tbt=1.0)
    idle = [PrefillCandidate("p0", 0, 0.0, PREFILL), PrefillCandidate("p1", 768, 0.0, PREFILL)]
    plan = schedule(idle, [decode()], shape, slo, None)
    assert isinstance(plan, Plan)
    assert plan.prefill.instance_id == "p1"
    assert plan.prefill.prefix_len == 768
    assert (plan.best_len, plan.best_instance) == (768, "p1")
    busy = [PrefillCandidate("p0", 0, 0.0, PREFILL), PrefillCandidate("p1", 768, 5.0, PREFILL)]
    plan = schedule(busy, [decode()], shape, slo, None)
    assert isinstance(plan, Plan)
    assert plan.prefill.instance_id == "p0"
    assert plan.prefill.ttft < 5.0


def test_decode_selection_prefers_the_lightest_batch_with_room():
    shape = RequestShape(num_prompt_tokens=100, num_blocks=10, kv_bytes=0)
    slo = Slo(max_ttft=10.0, max_tbt=1.0)
    decodes = [decode("d0", 8), decode("d1", 2), decode("d2", 0, free=5)]
    plan = schedule([PrefillCandidate("p0", 0, 0.0, PREFILL)], decodes, shape, slo, None)
    assert isinstance(plan, Plan)
    assert plan.decode_instance == "d1"


def test_slo_rejection_gives_reason_and_numbers():
    shape = RequestShape(num_prompt_tokens=4000, num_blocks=260, kv_bytes=4000 * 4096)
    send = TransferModel.from_gbps(10)
    result = schedule([PrefillCandidate("p0", 0, 3.0, PREFILL)], [decode()], shape, Slo(2.0, 1.0), send)
    assert isinstance(result, Rejection)
    assert "TTFT" in result.reason and "2000 ms" in result.reason
    assert result.plan is not None and result.plan.prefill.ttft > 3.0
    assert isinstance(schedule([PrefillCandidate("p0", 0, 3.0, PREFILL)], [decode()], shape,
                               Slo(2.0, 1.0, reject=False), send), Plan)  # fmt: skip
    full = schedule([PrefillCandidate("p0", 0, 0.0, PREFILL)], [decode(free=3)], shape, Slo(9, 9), send)
    assert isinstance(full, Rejection) and "free KV blocks" in full.reason


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
    assert index.drop_instance("p1") == 2
    assert index.match_prefix(h).prefix_blocks == {"p0": 1}
    assert index.apply("p9", 5, [h[0]], []) is True  # unknown instance: resync
