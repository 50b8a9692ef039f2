from scheduler.cost_model import DecodeModel, PrefillModel, attention_work
from services.worker.profiling.refiner import HALF_LIFE_S, HORIZON_S, CostRefiner

TRUE_PREFILL = PrefillModel(0.002, 0.0003, 2e-8)
TRUE_DECODE = DecodeModel(0.005, 0.0006, 2e-6)
PROMPTS = (32, 128, 384, 1024)


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def _refiner(speedup: float = 1.0, clock: Clock | None = None) -> CostRefiner:
    """A refiner whose start-up profile saw the true machine, ``speedup`` times faster."""
    profile_prefill = [(n, attention_work(n, 0), TRUE_PREFILL.predict(n) / speedup) for n in (16, 64, 256, 512)]
    profile_decode = [(b, b * 100, TRUE_DECODE.predict(b, b * 100) / speedup) for b in (1, 4, 8)]
    return CostRefiner(profile_prefill, profile_decode, clock=clock or Clock())


def _observe_prefills(refiner: CostRefiner, slowdown: float, clock: Clock, count: int = 20) -> None:
    for _ in range(count):
        for n in PROMPTS:
            refiner.observe([(n, 0)], TRUE_PREFILL.predict(n) * slowdown)
            clock.now += 0.1


def _error(model: PrefillModel, slowdown: float = 1.0) -> float:
    return max(abs(model.predict(n) / (TRUE_PREFILL.predict(n) * slowdown) - 1) for n in PROMPTS)


def test_refit_moves_the_models_towards_measured_steps():
    # The start-up profile says the machine is twice as fast as it turns out to be under load.
    refiner = _refiner(speedup=2.0)
    before_prefill, before_decode = refiner.fit()
    assert refiner.refit() is None  # nothing measured yet
    for _ in range(50):
        for n in (32, 128, 384):  # single-request prefill steps
            refiner.observe([(n, 0)], TRUE_PREFILL.predict(n))
        refiner.observe([(200, 0), (100, 300)], TRUE_PREFILL.c0 + TRUE_PREFILL.c1 * 300
                        + TRUE_PREFILL.c2 * (attention_work(200, 0) + attention_work(100, 300)))  # fmt: skip
        for b, context in ((2, 150), (6, 150), (3, 900)):  # decode steps: one token per sequence
            refiner.observe([(1, context)] * b, TRUE_DECODE.predict(b, b * (context + 1)))
    refiner.observe([(1, 150)] * 8 + [(2, 0)], 1.0)  # decode-heavy: its prompt chunk's share is not a sample
    refined = refiner.refit()
    assert refined is not None
    prefill, decode = refined
    for n in (64, 512):
        assert abs(prefill.predict(n) - TRUE_PREFILL.predict(n)) < abs(
            before_prefill.predict(n) - TRUE_PREFILL.predict(n)
        )
    assert abs(decode.predict(4, 600) - TRUE_DECODE.predict(4, 600)) < abs(
        before_decode.predict(4, 600) - TRUE_DECODE.predict(4, 600)
    )


def test_a_colocated_worker_learns_its_prefill_model_from_mixed_steps():
    # Under load every prompt chunk of a colocated worker shares its step with decode rows; between prompts
    # it only decodes. The start-up profile says the machine is 30% faster than it is: the mixed steps must
    # correct the prefill model, once the decode steps have corrected the decode model (refit every round).
    clock = Clock()
    refiner = _refiner(speedup=1.3, clock=clock)
    before, _ = refiner.fit()
    rows = [(1, 400)] * 6
    decode_s = TRUE_DECODE.predict(len(rows), sum(c + 1 for _, c in rows))
    for _ in range(30):
        for n in PROMPTS:
            refiner.observe(rows, decode_s)
            refiner.observe([*rows, (n, 0)], TRUE_PREFILL.predict(n) + decode_s)
            clock.now += 0.1
        refiner.fit()
    after, _ = refiner.fit()
    chunk_heavy = PROMPTS[1:]  # a 32-token chunk takes less of its step than the decode rows: not a sample
    assert all(abs(after.predict(n) / TRUE_PREFILL.predict(n) - 1) < 0.05 for n in chunk_heavy)
    assert _error(before) > 0.2


def test_without_fresh_steps_the_models_return_to_the_profile():
    clock = Clock()
    refiner = _refiner(clock=clock)
    profile = refiner.profile_models()
    _observe_prefills(refiner, slowdown=3.0, clock=clock)  # a burst on a contended machine
    contended = refiner.refit()
    assert contended is not None and _error(contended[0], slowdown=3.0) < 0.2
    clock.now += HORIZON_S + 1  # nothing since: every step has expired
    back = refiner.refit()
    assert back is not None and back == profile
    assert _error(back[0]) < 0.05
    assert refiner.refit() is None  # and it stays there without republishing


def test_recent_steps_outweigh_older_ones():
    clock = Clock()
    refiner = _refiner(clock=clock)
    _observe_prefills(refiner, slowdown=3.0, clock=clock)
    clock.now += 2 * HALF_LIFE_S  # idle a while, then the machine is fast again
    _observe_prefills(refiner, slowdown=1.0, clock=clock, count=5)
    prefill, _ = refiner.fit()
    assert _error(prefill) < 0.35  # while the 80 contended steps still weigh about a quarter each
    assert _error(prefill) < _error(prefill, slowdown=3.0)


def test_outlier_steps_do_not_move_the_models():
    clock = Clock()
    refiner = _refiner(speedup=2.0, clock=clock)  # a profile far from the truth, so the steps decide
    for i in range(40):
        for n in PROMPTS:
            stretched = 20.0 if (i + n) % 13 == 0 else 1.0  # a step the OS descheduled
            refiner.observe([(n, 0)], TRUE_PREFILL.predict(n) * stretched)
            clock.now += 0.05
    prefill, _ = refiner.fit()
    assert _error(prefill) < 0.1
