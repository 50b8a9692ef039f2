import pytest

from scheduler.cost_model import DecodeModel, PrefillModel, attention_work
from services.cost_refiner import CostRefiner

pytestmark = pytest.mark.unit

TRUE_PREFILL = PrefillModel(0.002, 0.0003, 2e-8)
TRUE_DECODE = DecodeModel(0.005, 0.0006, 2e-6)


def test_refit_moves_the_models_towards_measured_steps():
    # The start-up profile says the machine is twice as fast as it turns out to be under load.
    profile_prefill = [(n, attention_work(n, 0), TRUE_PREFILL.predict(n) / 2) for n in (16, 64, 256, 512)]
    profile_decode = [(b, b * 100, TRUE_DECODE.predict(b, b * 100) / 2) for b in (1, 4, 8)]
    refiner = CostRefiner(profile_prefill, profile_decode)
    before_prefill, before_decode = refiner.fit()
    assert refiner.refit() is None  # nothing measured yet
    for _ in range(50):
        for n in (32, 128, 384):  # single-request prefill steps
            refiner.observe([(n, 0)], TRUE_PREFILL.predict(n))
        refiner.observe([(200, 0), (100, 300)], TRUE_PREFILL.c0 + TRUE_PREFILL.c1 * 300
                        + TRUE_PREFILL.c2 * (attention_work(200, 0) + attention_work(100, 300)))  # fmt: skip
        for b, context in ((2, 150), (6, 150), (3, 900)):  # decode steps: one token per sequence
            refiner.observe([(1, context)] * b, TRUE_DECODE.predict(b, b * (context + 1)))
    refiner.observe([(1, 150), (64, 0)], 1.0)  # a mixed step fits neither model
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
    assert refiner.refit() is None
