"""Load shared by Conductor replicas: a worker's ledger of bookings, and a Conductor counting them on top of its own."""

from __future__ import annotations

import time

import pytest

from kvconductor.v1 import common_pb2, worker_pb2
from scheduler.booking import Booking
from scheduler.core import ConductorCore
from scheduler.cost_model import DecodeModel, LinkModels, PrefillModel, TransferModel
from scheduler.instance import InstanceState
from scheduler.policy import ConductorPolicy
from services.conductor.cluster_view import ClusterView
from services.conductor.shared_load import SharedLoad, booking_message, foreign_bookings
from services.worker.ledger import Ledger


def _state(num_blocks: int = 100) -> InstanceState:
    return InstanceState("w", "colocated", PrefillModel(0.0, 1e-3, 0.0), DecodeModel(0.01, 0.0, 0.0),
                         num_blocks=num_blocks, max_running=8, chunk_tokens=512)  # fmt: skip


def _booked(conductor: str, prefill_s: float = 0.0, blocks: int = 0) -> common_pb2.Booking:
    return common_pb2.Booking(conductor_id=conductor, predicted_prefill_s=prefill_s, new_tokens=100,
                              context_tokens=120, num_blocks=blocks, ttft_s=0.2, expected_decode_s=1.0)  # fmt: skip


def test_the_ledger_lists_other_conductors_requests_and_counts_the_watchers_own():
    ledger = Ledger()
    ledger.add("mine", _booked("a", 0.5, 3))
    ledger.add("theirs", _booked("b", 0.5, 5))
    ledger.add("untracked", common_pb2.Booking())  # no Conductor named: nobody to share it with
    report = ledger.report("a")
    assert (report.own_requests, report.own_blocks) == (1, 3)
    assert [i.request_id for i in report.foreign] == ["theirs"]
    assert not report.foreign[0].prefill_done and report.foreign[0].decode_age_s < 0
    version = ledger.version
    ledger.prefill_done("theirs")  # a colocated request: decoding from now
    assert ledger.version > version
    item = ledger.report("a").foreign[0]
    assert item.prefill_done and item.decode_age_s >= 0
    ledger.remove("theirs")
    assert not ledger.report("a").foreign


def test_foreign_bookings_add_to_the_instances_queue_batch_and_blocks():
    now = time.monotonic()
    state = _state()
    state.prefilling.add("own", Booking(now, 0.4, 120, 0, new_tokens=100))
    own_queue = state.t_queue(now)
    report = worker_pb2.LoadReport(foreign=[
        worker_pb2.BookedRequest(request_id="x", booking=_booked("b", 0.3, 60), age_s=0.0, decode_age_s=-1),
        worker_pb2.BookedRequest(request_id="y", booking=_booked("b", 0.0, 30), age_s=2.0, prefill_done=True,
                                 decode_age_s=1.0),
    ])  # fmt: skip
    state.foreign_prefilling, state.foreign_decoding = foreign_bookings(report, now)
    assert state.t_queue(now) == pytest.approx(own_queue + 0.3)
    candidate = state.decode_candidate(now)
    assert candidate.num_free_blocks == 100 - 90
    assert len(candidate.residents) == 2
    assert [r.t_join for r in candidate.residents if r.t_join <= 0] == [pytest.approx(-1.0)]  # y decodes already
    assert state.prefill_candidate(0, now).in_flight == 2  # own + x


def test_the_ledger_counts_the_tokens_each_request_produced_without_a_report_per_token():
    ledger = Ledger()
    ledger.add("theirs", _booked("b", 0.0, 5))
    ledger.decode_started("theirs")  # a decode reservation: token 0 came with its prefill
    version = ledger.version
    ledger.produced("theirs", 3)
    ledger.produced("gone", 1)  # not held: ignored
    assert ledger.version == version
    assert ledger.report("a").foreign[0].tokens_out == 4


def test_a_foreign_decode_slower_than_its_conductor_predicted_stays_in_the_batch_at_its_measured_pace():
    """Its own Conductor expected 1 s of decode; the worker reports 11 of its 32 tokens after 2 s: it has
    21 tokens, 4.2 s, left. Without the progress it would count as gone a second ago."""
    now = time.monotonic()
    booking = _booked("b", 0.0, 30)
    booking.max_tokens, booking.fixed_length = 32, True
    item = worker_pb2.BookedRequest(request_id="y", booking=booking, age_s=2.5, prefill_done=True, decode_age_s=2.0,
                                    tokens_out=11)  # fmt: skip
    core = ConductorCore(ConductorPolicy(), LinkModels(TransferModel(0.001, 1e9)))
    report = worker_pb2.LoadReport(foreign=[item])
    _, decoding = foreign_bookings(report, now, core.expected_output_tokens)
    assert decoding.residents(now)[0].t_leave == pytest.approx(4.2)
    _, stale = foreign_bookings(report, now)
    assert stale.residents(now)[0].t_leave < 0.01


def test_a_conductor_does_not_admit_what_another_replica_already_filled():
    now = time.monotonic()
    state = _state(num_blocks=100)
    report = worker_pb2.LoadReport(foreign=[worker_pb2.BookedRequest(request_id="x", booking=_booked("b", 0, 80))])
    state.foreign_prefilling, state.foreign_decoding = foreign_bookings(report, now)
    need = 30
    assert state.decode_candidate(now).num_free_blocks < need


def test_booking_message_carries_what_the_core_booked():
    now = time.monotonic()
    p, d = _state(), _state()
    p.prefilling.add("r", Booking(now, 0.25, 120, 0, new_tokens=90))
    d.decoding.add("r", Booking(now, 0.0, 120, 9, now + 0.4, 2.0))
    message = booking_message("a", "r", p, d, max_tokens=64, fixed_length=True)
    assert (message.max_tokens, message.fixed_length) == (64, True)
    assert (message.conductor_id, message.predicted_prefill_s, message.new_tokens) == ("a", 0.25, 90)
    assert (message.num_blocks, message.context_tokens, message.expected_decode_s) == (9, 120, 2.0)
    assert message.ttft_s == pytest.approx(0.4)
    assert booking_message("a", "r", p, None).num_blocks == 0


def test_each_report_measures_the_load_the_conductor_had_not_counted():
    shared = SharedLoad(ClusterView(), "a")
    now = time.monotonic()
    state = _state()
    state.decoding.add("own", Booking(now, 0.0, 120, 4, now, 1.0))

    def report(*foreign: tuple[str, int]) -> worker_pb2.LoadReport:
        items = [
            worker_pb2.BookedRequest(request_id=r, booking=_booked("b", 0, n), decode_age_s=-1) for r, n in foreign
        ]
        return worker_pb2.LoadReport(foreign=items, own_requests=1, own_blocks=4)

    shared.apply("w", state, report(("x", 10), ("y", 5)))  # two the other replica booked since the last report
    assert (shared.overcommit["w"].requests, shared.overcommit["w"].blocks) == (2, 15)
    shared.apply("w", state, report(("x", 10), ("y", 5), ("z", 1)))  # counted now: only z is new
    assert (shared.overcommit["w"].requests, shared.overcommit["w"].blocks) == (2, 15)
    assert state.foreign_decoding.num_blocks == 16
