"""Model error on the emulated bed: the start-up profile a worker publishes departs from the steps it runs.

``[emulation] profile_error`` is a log-normal sigma: a bias per worker (seeded by its id) and noise per
profiled shape. The engine's own step times (``Emulation``) never change, so the Conductor, which predicts
from the published profile, must learn the difference from the steps the refit observes.
"""

from __future__ import annotations

import math
import statistics

import pytest

from engine.emulated_runner import Emulation
from scheduler.profiles import analytic_gpu
from services.common.config import ConfigError, load_config
from services.worker.profiling.profiler import emulated_profile

PROFILE = analytic_gpu()
EMULATION = Emulation(PROFILE.prefill, PROFILE.decode, time_scale=2.0)
SHAPES = [(1024, 0), (8192, 0), (8192, 32768), (32768, 0)]


def _log_ratios(error: float, seed: str) -> list[float]:
    """log(published / true) prefill time at SHAPES."""
    prefill, _ = emulated_profile(EMULATION, error, seed).fit()
    truth = EMULATION.time_scale
    return [math.log(prefill.predict(n, c) / (EMULATION.prefill.predict(n, c) * truth)) for n, c in SHAPES]


def test_without_error_the_published_profile_is_what_the_engine_runs():
    assert max(abs(r) for r in _log_ratios(0.0, "0/prefill-0")) < 1e-6


def test_with_error_each_worker_publishes_its_own_seeded_wrong_profile():
    a, again, b = _log_ratios(0.3, "0/prefill-0"), _log_ratios(0.3, "0/prefill-0"), _log_ratios(0.3, "0/prefill-1")
    assert a == again  # seeded: the same worker is wrong the same way at every start
    assert a != b  # another worker, another bias
    biases = [statistics.mean(_log_ratios(0.3, f"0/prefill-{i}")) for i in range(40)]
    assert 0.15 < statistics.pstdev(biases) < 0.5  # about the configured sigma across workers
    assert max(abs(x) for x in biases) > 0.2  # the Conductor would mispredict these by more than 20%


def test_the_error_is_a_config_key_with_a_bound():
    assert load_config(None, ["emulation.profile_error=0.2"]).emulation.profile_error == 0.2
    with pytest.raises(ConfigError, match=r"\[emulation\] profile_error"):
        load_config(None, ["emulation.profile_error=-1"])


def test_the_refit_learns_the_true_steps_a_wrong_profile_hides():
    seed = max((f"0/prefill-{i}" for i in range(40)), key=lambda s: abs(statistics.mean(_log_ratios(0.3, s))))
    refiner = emulated_profile(EMULATION, 0.3, seed)  # the most wrong of 40 workers
    shape = [(4096, 8192)]  # a chunk of 4,096 new tokens after 8,192 cached
    truth = EMULATION.prefill.predict(4096, 8192) * EMULATION.time_scale
    before = refiner.fit()[0].predict(4096, 8192)
    for _ in range(32):  # the steps the engine really takes, as the engine thread reports them
        refiner.observe(shape, truth)
    after = refiner.refit()[0].predict(4096, 8192)
    wrong, learned = abs(math.log(before / truth)), abs(math.log(after / truth))
    assert wrong > 0.2 and learned < wrong / 4, (before, after, truth)  # most of the error gone in 32 steps
