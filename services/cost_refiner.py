"""Online refinement of a worker's cost models from the engine steps it times.

The start-up profile's samples stay as the anchor; every timed step adds a sample to a window of recent
ones, and a refit over both replaces the published models. A step is a prefill sample when it only
computes prompt chunks and a decode sample when it only decodes (one new token per sequence); the mixed
steps of a colocated worker fit neither model and are skipped.

Sample forms (see ``scheduler.cost_model``)::

    prefill: (new tokens, attention work = sum of new * (cached + new / 2), seconds)
    decode:  (batch size, total context, seconds)
"""

from __future__ import annotations

from collections import deque
from collections.abc import Sequence

from scheduler.cost_model import DecodeModel, PrefillModel, attention_work

StepShape = Sequence[tuple[int, int]]  # (new tokens, tokens computed before) per sequence


class CostRefiner:
    """Profile samples plus a window of measured steps; ``refit`` when there is something new."""

    def __init__(
        self,
        prefill_profile: Sequence[tuple[int, float, float]],
        decode_profile: Sequence[tuple[int, int, float]],
        window: int = 512,
    ) -> None:
        self.prefill_profile = list(prefill_profile)
        self.decode_profile = list(decode_profile)
        self.prefill_steps: deque[tuple[int, float, float]] = deque(maxlen=window)
        self.decode_steps: deque[tuple[int, int, float]] = deque(maxlen=window)
        self._new = 0

    def observe(self, shape: StepShape, seconds: float) -> None:
        """Record one timed engine step (called on the engine thread)."""
        if not shape:
            return
        if all(n == 1 and c > 0 for n, c in shape):
            self.decode_steps.append((len(shape), sum(c + 1 for _, c in shape), seconds))
        elif all(n > 1 or c == 0 for n, c in shape):
            new = sum(n for n, _ in shape)
            self.prefill_steps.append((new, sum(attention_work(n, c) for n, c in shape), seconds))
        else:
            return
        self._new += 1

    def fit(self) -> tuple[PrefillModel, DecodeModel]:
        """Models over the profile and the measured steps."""
        prefill = PrefillModel.fit_work([*self.prefill_profile, *self.prefill_steps])
        decode = DecodeModel.fit([*self.decode_profile, *self.decode_steps])
        return prefill, decode

    def refit(self) -> tuple[PrefillModel, DecodeModel] | None:
        """New models when steps were observed since the last call, else None."""
        if self._new == 0:
            return None
        self._new = 0
        return self.fit()
