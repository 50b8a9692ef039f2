"""Online refinement of a worker's cost models from the engine steps it times.

A step is a prefill sample when it only computes prompt chunks and a decode sample when it only decodes
(one new token per sequence). A mixed step (a colocated worker's prompt chunk beside its decode rows)
becomes a prefill sample of its chunks with the decode rows' time, as the last fitted decode model
predicts it, taken off, when the chunks take at least ``MIXED_PREFILL_SHARE`` of the step: under load
nearly every prefill step of a colocated worker is mixed, and its prefill model must learn from them (the
Conductor's T_queue on colocated instances rests on it). Decode-heavy mixed steps are skipped: their
prefill part would be mostly the decode model's error.
The models follow the machine both ways, by these rules (docs/design.md, "Cost models", repeats them):

* **Window.** Only steps measured in the last ``HORIZON_S`` seconds count, at most ``WINDOW`` of each
  kind; older ones are dropped.
* **Recency.** A step's weight halves every ``HALF_LIFE_S`` seconds. The start-up profile's samples
  never age and weigh ``PROFILE_WEIGHT`` steps in all: a steady stream of fresh steps outweighs them,
  and when fresh steps stop coming (an idle or rejecting cluster) the fit returns to the profile.
* **Relative error.** Residuals count relative to the measured and the predicted time (iteratively
  reweighted least squares), so a 16-token step counts as much as a 4,096-token one, and being 3x too
  slow costs as much as being 3x too fast.
* **Outliers.** After a first fit, fresh steps slower than predicted by more than ``OUTLIER_MADS``
  median absolute deviations above the median relative residual (and over ``OUTLIER_FLOOR``) are
  dropped and the fit repeated: a step stretched by the OS or a noisy neighbour does not move the
  model. Medians are weighted by recency, and fast steps are never outliers, so a machine that turns
  faster (or, after about a half-life, slower) is followed rather than filtered.

Sample forms (see ``scheduler.cost_model``)::

    prefill: (new tokens, attention work = sum of new * (cached + new / 2), seconds)
    decode:  (batch size, total context, seconds)
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable, Sequence
from typing import TypeVar

from scheduler.cost_model import DecodeModel, PrefillModel, attention_work

StepShape = Sequence[tuple[int, int]]  # (new tokens, tokens computed before) per sequence
Sample = tuple[int, float, float]  # (size, second feature, seconds); see the module docstring
M = TypeVar("M")

WINDOW = 256
HORIZON_S = 120.0
HALF_LIFE_S = 10.0
PROFILE_WEIGHT = 4.0
OUTLIER_MADS = 4.0
OUTLIER_FLOOR = 0.25  # relative residuals within +-25% of the median are never outliers
MIN_SECONDS = 1e-4  # relative weights of near-zero timings are capped
REWEIGHTS = 3  # reweighting passes of the relative fit
MIXED_PREFILL_SHARE = 0.5  # of a mixed step's time, the least its prompt chunks take to count as a prefill sample


class CostRefiner:
    """Profile samples plus a window of measured steps; ``refit`` while there is anything fresh."""

    def __init__(
        self,
        prefill_profile: Sequence[Sample],
        decode_profile: Sequence[Sample],
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.prefill_profile = list(prefill_profile)
        self.decode_profile = list(decode_profile)
        self.prefill_steps: deque[tuple[float, Sample]] = deque(maxlen=WINDOW)
        self.decode_steps: deque[tuple[float, Sample]] = deque(maxlen=WINDOW)
        self.clock = clock
        self._stale = False  # the last fit used steps that have expired since
        self._decode: DecodeModel | None = None  # the last fitted decode model: a mixed step's decode rows

    def observe(self, shape: StepShape, seconds: float) -> None:
        """Record one timed engine step (called on the engine thread)."""
        if not shape or seconds <= 0:
            return
        decodes = [c for n, c in shape if n == 1 and c > 0]
        if len(decodes) == len(shape):
            self.decode_steps.append((self.clock(), (len(decodes), sum(c + 1 for c in decodes), seconds)))
            return
        chunks = [(n, c) for n, c in shape if n > 1 or c == 0]
        if decodes:  # a mixed step: its chunks' share, if they take most of it (after a first fit)
            if self._decode is None:
                return
            chunk_seconds = seconds - self._decode.predict(len(decodes), sum(c + 1 for c in decodes))
            if chunk_seconds < MIXED_PREFILL_SHARE * seconds:
                return
            seconds = chunk_seconds
        work = sum(attention_work(n, c) for n, c in chunks)
        self.prefill_steps.append((self.clock(), (sum(n for n, _ in chunks), work, seconds)))

    def profile_models(self) -> tuple[PrefillModel, DecodeModel]:
        """The models of the start-up profile alone (what admission falls back on for an idle instance)."""
        return (
            _fit(PrefillModel.fit_work, _predict_prefill, self.prefill_profile, [], 0.0),
            _fit(DecodeModel.fit, _predict_decode, self.decode_profile, [], 0.0),
        )

    def fit(self) -> tuple[PrefillModel, DecodeModel]:
        """Models over the profile and the fresh steps, by the module's rules."""
        now = self.clock()
        self._expire(now)
        self._stale = bool(self.prefill_steps or self.decode_steps)
        self._decode = _fit(DecodeModel.fit, _predict_decode, self.decode_profile, list(self.decode_steps), now)
        return (
            _fit(PrefillModel.fit_work, _predict_prefill, self.prefill_profile, list(self.prefill_steps), now),
            self._decode,
        )

    def refit(self) -> tuple[PrefillModel, DecodeModel] | None:
        """New models while fresh steps exist or the last ones just expired; None when the profile stands."""
        self._expire(self.clock())
        if not (self.prefill_steps or self.decode_steps or self._stale):
            return None
        return self.fit()

    def _expire(self, now: float) -> None:
        for steps in (self.prefill_steps, self.decode_steps):
            while steps and now - steps[0][0] > HORIZON_S:
                steps.popleft()


def _predict_prefill(model: PrefillModel, sample: Sample) -> float:
    return model.predict_work(sample[0], sample[1])


def _predict_decode(model: DecodeModel, sample: Sample) -> float:
    return model.predict(sample[0], int(sample[1]))


def _fit(
    fit: Callable[[Sequence[Sample], Sequence[float]], M],
    predict: Callable[[M, Sample], float],
    profile: Sequence[Sample],
    fresh: Sequence[tuple[float, Sample]],
    now: float,
) -> M:
    """Weighted relative least squares over the profile and the fresh steps, fresh outliers removed."""
    recency = [0.5 ** ((now - t) / HALF_LIFE_S) for t, _ in fresh]
    model = _weighted(fit, predict, profile, [s for _, s in fresh], recency)
    if len(fresh) < 8:
        return model
    residuals = [s[2] / max(predict(model, s), MIN_SECONDS) - 1 for _, s in fresh]  # > 0: slower than predicted
    middle = _weighted_median(residuals, recency)
    spread = _weighted_median([abs(r - middle) for r in residuals], recency)
    bound = max(OUTLIER_MADS * 1.4826 * spread, OUTLIER_FLOOR)
    keep = [i for i, r in enumerate(residuals) if r - middle <= bound]
    if len(keep) == len(fresh):
        return model
    return _weighted(fit, predict, profile, [fresh[i][1] for i in keep], [recency[i] for i in keep])


def _weighted_median(values: Sequence[float], weights: Sequence[float]) -> float:
    ordered = sorted(zip(values, weights, strict=True))
    half, seen = sum(weights) / 2, 0.0
    for value, weight in ordered:
        seen += weight
        if seen >= half:
            return value
    return ordered[-1][0]


def _weighted(
    fit: Callable[[Sequence[Sample], Sequence[float]], M],
    predict: Callable[[M, Sample], float],
    profile: Sequence[Sample],
    fresh: Sequence[Sample],
    recency: Sequence[float],
) -> M:
    """Relative least squares by reweighting: each squared residual is divided by measured x predicted time.

    That cost, ``y/p + p/y - 2``, is symmetric in over- and under-prediction; dividing by the measured time
    alone would favour the faster of two conflicting sets of samples (over-predicting by 3x costs 4 units
    of squared relative error, under-predicting by 3x only 0.44), dividing by the prediction the slower.
    """
    samples = [*profile, *fresh]
    weights = [PROFILE_WEIGHT / len(profile)] * len(profile) + list(recency)
    model = fit(samples, [w / max(s[2], MIN_SECONDS) ** 2 for w, s in zip(weights, samples, strict=True)])
    for _ in range(REWEIGHTS):
        scale = [max(predict(model, s), MIN_SECONDS) for s in samples]
        model = fit(
            samples, [w / (p * max(s[2], MIN_SECONDS)) for w, p, s in zip(weights, scale, samples, strict=True)]
        )
    return model
