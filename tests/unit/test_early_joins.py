"""Requests that join sooner than predicted: the learned margin and the stalls counted from it."""

import pytest

from scheduler.booking import Booking
from scheduler.candidates import RequestShape, Resident, Slo
from scheduler.core import ConductorCore
from scheduler.cost_model import DecodeModel, LinkModels, PrefillModel, TransferModel
from scheduler.early_joins import MAX_SHARE, EarlyJoins
from scheduler.instance import InstanceState
from scheduler.policy import ConductorPolicy, PolicyConfig
from scheduler.stalls import stalled_steps

PREFILL = PrefillModel(c0=0.01, c1=1e-4, c2=1e-9)
DECODE = DecodeModel(d0=0.02, d1=1e-3, d2=1e-7)


def test_the_margin_is_the_share_of_its_predicted_ttft_by_which_one_join_in_ten_came_sooner():
    joins = EarlyJoins()
    assert joins.share() == 0.0  # nothing seen: the predicted joins
    for i in range(100):  # predicted TTFT 2 s; joined 0..0.99 s early
        joins.observe(10.0, 12.0, 12.0 - i / 100)
    assert joins.share() == pytest.approx(0.45)  # the 90th of 0, 0.005, ..., 0.495
    late = EarlyJoins()
    for _ in range(10):
        late.observe(0.0, 1.0, 1.5)  # always late: no margin
    assert late.share() == 0.0
    wild = EarlyJoins()
    wild.observe(0.0, 4.0, 0.1)  # nearly all of its TTFT early: capped
    assert wild.share() == MAX_SHARE


def test_the_margin_forgets_joins_past_its_window():
    joins = EarlyJoins(window=4)
    for _ in range(4):
        joins.observe(0.0, 1.0, 0.5)
    for _ in range(4):
        joins.observe(0.0, 1.0, 1.0)
    assert joins.share() == 0.0


def test_a_request_that_may_join_early_is_stalled_by_a_prompt_its_predicted_join_misses():
    """A prompt chunks over [0, 1.5] s in 3 steps; a request predicted to join at 2 s misses it, one that may
    come 1 s sooner takes the chunk still to run at 1 s."""
    on_time = Resident(2.0, 4.0, 100)
    assert stalled_steps(3, 0.0, 1.5, on_time, 0.02) == 0
    early = Resident(2.0, 4.0, 100, early=1.0)
    assert stalled_steps(3, 0.0, 1.5, early, 0.02) == 1


def test_the_core_learns_from_each_join_and_books_the_margin_on_later_requests():
    core = ConductorCore(ConductorPolicy(PolicyConfig()), LinkModels(TransferModel(0.001, 5e9)))
    c = InstanceState("c0", "colocated", PREFILL, DECODE, num_blocks=10_000, max_running=64, chunk_tokens=512)
    for i in range(10):  # predicted to join 2 s after assignment; each token 0 comes at 1.2 s
        c.decoding.add(i, Booking(0.0, 0.0, 100, 1, expected_join=2.0, expected_decode_s=1.0))
        core.decode_progress(c, i, 1.2, 1, 32, False)
    assert core.early_joins.share() == pytest.approx(0.4)
    shape = RequestShape(1000, 70, 16, 1024, output_tokens=32)
    plan = core.decide(5.0, shape, {}, [c], [c], Slo(max_ttft=10.0, max_tbt=1.0), colocated=True)
    core.book(5.0, "next", plan, shape, c, c)
    booking = c.decoding.items["next"]
    assert booking.early_s == pytest.approx(0.4 * plan.prefill.ttft)
    assert booking.resident(5.0).early == booking.early_s
