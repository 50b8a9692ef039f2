"""How long a request keeps its place in a decode batch: expected output lengths and measured progress."""

from __future__ import annotations

import random

from scheduler.booking import Booking
from scheduler.candidates import RequestShape, Slo
from scheduler.core import ConductorCore
from scheduler.cost_model import DecodeModel, LinkModels, PrefillModel, TransferModel
from scheduler.instance import InstanceState
from scheduler.output_length import OutputLengths
from scheduler.policy import ConductorPolicy, Plan


def test_with_nothing_seen_a_request_is_expected_to_use_its_max_tokens():
    assert OutputLengths().expected(64) == 64
    assert OutputLengths().expected(64, produced=10) == 20  # none seen that long: as many again
    assert OutputLengths().expected(0) == 0  # no limit and nothing seen: unknown


def test_expected_lengths_are_the_mean_of_the_longer_completions_capped_at_max_tokens():
    lengths = OutputLengths()
    for n in [10] * 50 + [100] * 50:
        lengths.observe(n)
    assert lengths.expected(200) == 55
    assert lengths.expected(50) == 30  # (50 x 10 + 50 x 50) / 100
    assert lengths.expected(200, produced=20) == 100  # past the short ones: only the long ones are left
    assert lengths.expected(200, produced=150) == 200  # longer than any seen: as many again, capped
    assert lengths.expected(80, produced=80) == 80  # at max_tokens: it ends now


def test_short_warm_up_requests_do_not_make_a_long_request_look_finished():
    """The bug it fixes: a moving mean of 2-token warm-ups and 32-token requests (22) said a request at
    token 25 had one token left; the requests that outlived the warm-ups say it has 7."""
    lengths = OutputLengths()
    for n in [2] * 5 + [32] * 10:
        lengths.observe(n)
    assert lengths.expected(32) == 22
    assert lengths.expected(32, produced=25) == 32


def test_the_window_forgets_the_oldest_completion_and_matches_a_plain_computation():
    rng = random.Random(7)
    lengths, seen = OutputLengths(window=50), []
    for _ in range(400):
        n = rng.randrange(1, 300)
        lengths.observe(n)
        seen = (seen + [n])[-50:]
        max_tokens, produced = rng.choice([0, 64, 256]), rng.randrange(0, 200)
        if max_tokens and produced >= max_tokens:
            continue
        longer = [min(m, max_tokens) if max_tokens else m for m in seen if m > produced]
        if longer:
            assert lengths.expected(max_tokens, produced) == max(produced + 1, round(sum(longer) / len(longer)))
    assert len(lengths) == 50


def _colocated(name: str) -> InstanceState:
    return InstanceState(name, "colocated", PrefillModel(0.0, 1e-4, 0.0), DecodeModel(0.01, 0.005, 0.0),
                         num_blocks=1000, max_running=8, chunk_tokens=512)  # fmt: skip


def _decoding(state: InstanceState, request_id: str, started: float) -> None:
    """A request decoding on ``state`` since ``started``, predicted (too optimistically) to be done 0.3 s later."""
    state.decoding.add(request_id, Booking(started - 0.05, 0.0, 200, 20, started, 0.3, decode_started=started))


def test_residents_decoding_slower_than_predicted_still_count_once_their_progress_is_reported():
    """Two requests on a whose predicted end has passed (the machine decodes slower than its models say)
    and one on b: read from the predictions alone, a looks empty and the next request lands on it, three
    deep; with the tokens they streamed (10 of 32 in 0.95 s) they have 2 s left, and b is the choice."""
    core = ConductorCore(ConductorPolicy(), LinkModels(TransferModel(0.001, 1e9)))
    a, b = _colocated("a"), _colocated("b")
    _decoding(a, "a1", 9.05)
    _decoding(a, "a2", 9.05)
    _decoding(b, "b1", 9.95)
    shape, slo = RequestShape(200, 20, 16, 4096, output_tokens=32), Slo(10.0, 1.0)

    def choice(now: float) -> str:
        plan = core.decide(now, shape, {}, [a, b], [a, b], slo, colocated=True)
        assert isinstance(plan, Plan)
        return plan.prefill.instance_id

    assert choice(10.0) == "a"  # the stale predictions: a's two requests "left" at 9.35
    for request_id in ("a1", "a2"):
        core.decode_progress(a, request_id, 10.0, 10, 32, fixed=True)
    core.decode_progress(b, "b1", 10.0, 1, 32, fixed=True)
    assert a.decoding.items["a1"].resident(10.0).t_leave > 2.0
    assert choice(10.0) == "b"
