"""Empirical cost models: prefill time, decode step time and KV transfer time, fitted from measurements.

Prefill of ``new`` tokens on top of ``cached`` reused ones costs a fixed overhead, a per-token term
(the linear layers) and an attention term: new token i attends to ``cached + i`` earlier tokens, so
the attention work is ``sum_i (cached + i) = new * (cached + new / 2)``::

    T_prefill(new, cached) = c0 + c1 * new + c2 * new * (cached + new / 2)

A decode step over a batch costs a fixed overhead, a per-sequence term and a term in the total
context the batch attends to::

    T_step(batch, context) = d0 + d1 * batch + d2 * context

Moving KV costs a latency plus bytes over bandwidth, a line fitted robustly (Theil-Sen) to timed
transfers. The compute models' coefficients come from least squares over measured samples (a start-up
profile each worker runs and publishes with its etcd record) and are clamped at zero, so a noisy fit
can never predict negative time.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, fields
from typing import Self

import numpy as np


def attention_work(new_tokens: int, cached_tokens: int) -> float:
    """Token pairs the attention of ``new_tokens`` after ``cached_tokens`` visits: new * (cached + new / 2)."""
    return new_tokens * (cached_tokens + new_tokens / 2)


def _lstsq_nonneg(
    features: list[list[float]], seconds: Sequence[float], weights: Sequence[float] | None = None
) -> list[float]:
    """(Weighted) least squares with every coefficient >= 0: refit without the most negative term until none is."""
    if len(features) < len(features[0]):
        raise ValueError(f"need at least {len(features[0])} samples to fit, got {len(features)}")
    x, y = np.asarray(features), np.asarray(seconds)
    if weights is not None:
        root = np.sqrt(np.asarray(weights))
        x, y = x * root[:, None], y * root
    active = list(range(x.shape[1]))
    coef = np.zeros(x.shape[1])
    while active:
        solution, *_ = np.linalg.lstsq(x[:, active], y, rcond=None)
        if solution.min() >= 0:
            coef[active] = solution
            break
        del active[int(solution.argmin())]
    return [float(c) for c in coef]


@dataclass(frozen=True)
class Coefficients:
    """A linear model's coefficients by name, for the instance record."""

    def to_dict(self) -> dict[str, float]:
        """Coefficients by name."""
        return {f.name: float(getattr(self, f.name)) for f in fields(self)}

    @classmethod
    def from_dict(cls, data: Mapping[str, float]) -> Self:
        """Inverse of to_dict (KeyError names a missing coefficient)."""
        return cls(**{f.name: float(data[f.name]) for f in fields(cls)})


@dataclass(frozen=True)
class PrefillModel(Coefficients):
    """T_prefill(new, cached) in seconds."""

    c0: float
    c1: float
    c2: float

    def predict(self, new_tokens: int, cached_tokens: int = 0) -> float:
        """Predicted seconds to compute ``new_tokens`` after ``cached_tokens`` of reused KV."""
        if new_tokens <= 0:
            return 0.0
        return self.c0 + self.c1 * new_tokens + self.c2 * attention_work(new_tokens, cached_tokens)

    @classmethod
    def fit(cls, samples: Sequence[tuple[int, int, float]]) -> PrefillModel:
        """Least-squares fit from (new_tokens, cached_tokens, seconds) samples of single-request prefills."""
        return cls.fit_work([(n, attention_work(n, c), s) for n, c, s in samples])

    @classmethod
    def fit_work(
        cls, samples: Sequence[tuple[int, float, float]], weights: Sequence[float] | None = None
    ) -> PrefillModel:
        """Least-squares fit from (new_tokens, attention_work, seconds) samples, e.g. of whole engine steps."""
        features = [[1.0, float(n), float(w)] for n, w, _ in samples]
        return cls(*_lstsq_nonneg(features, [s for *_, s in samples], weights))

    def predict_work(self, new_tokens: int, work: float) -> float:
        """Predicted seconds of a step computing ``new_tokens`` with ``work`` attention token pairs."""
        return 0.0 if new_tokens <= 0 else self.c0 + self.c1 * new_tokens + self.c2 * work


@dataclass(frozen=True)
class DecodeModel(Coefficients):
    """T_step(batch, context) in seconds: one decode step of a continuous batch."""

    d0: float
    d1: float
    d2: float

    def predict(self, batch_size: int, total_context: int) -> float:
        """Predicted seconds of one step for ``batch_size`` sequences attending to ``total_context`` tokens."""
        if batch_size <= 0:
            return 0.0
        return self.d0 + self.d1 * batch_size + self.d2 * total_context

    @classmethod
    def fit(cls, samples: Sequence[tuple[int, float, float]], weights: Sequence[float] | None = None) -> DecodeModel:
        """Least-squares fit from (batch_size, total_context, seconds) samples."""
        features = [[1.0, float(b), float(c)] for b, c, _ in samples]
        return cls(*_lstsq_nonneg(features, [s for *_, s in samples], weights))


@dataclass(frozen=True)
class TransferModel:
    """T_transfer(bytes) = latency + bytes / bandwidth, in seconds."""

    latency_s: float
    bandwidth_bytes_per_s: float

    def predict(self, num_bytes: int) -> float:
        """Predicted seconds to move ``num_bytes``."""
        if num_bytes <= 0:
            return 0.0
        return self.latency_s + num_bytes / self.bandwidth_bytes_per_s

    @classmethod
    def from_gbps(cls, gbps: float, latency_s: float = 0.003) -> TransferModel:
        """A model from a configured link speed in Gbit/s (the default latency is the TCP per-call cost)."""
        return cls(latency_s, gbps * 1e9 / 8)

    @classmethod
    def fit(cls, samples: Sequence[tuple[int, float]]) -> TransferModel | None:
        """A robust line through (bytes, seconds); None when the samples cannot separate latency from bandwidth.

        Theil-Sen, weighted: the per-byte time is the median slope between every two transfers of different
        sizes, each pair weighted by how far apart their sizes are (two transfers of about the same size say
        little about the per-byte time, however different their times); the latency is the median of what
        each transfer leaves (at least 0). A transfer timed on a busy moment (a contended CPU, a queue on the
        wire) moves a least-squares line; here a few such move nothing.
        """
        if len(samples) > FIT_SAMPLES_MAX:  # evenly spaced: the pairs grow with the square of the count
            samples = [samples[i * len(samples) // FIT_SAMPLES_MAX] for i in range(FIT_SAMPLES_MAX)]
        b = np.fromiter((s[0] for s in samples), float, len(samples))
        t = np.fromiter((s[1] for s in samples), float, len(samples))
        i, j = np.triu_indices(len(samples), 1)
        apart = b[i] != b[j]
        if not apart.any():
            return None
        spread = (b[j] - b[i])[apart]
        slopes = (t[j] - t[i])[apart] / spread
        order = np.argsort(slopes)
        weights = np.abs(spread)[order].cumsum()
        per_byte = float(slopes[order][np.searchsorted(weights, weights[-1] / 2)])
        if per_byte <= 0:
            return None
        return cls(max(0.0, float(np.median(t - per_byte * b))), 1.0 / per_byte)


FIT_SAMPLES_MAX = 256  # transfers one fit reads at most (32k pairs)
OWN_FIT_SAMPLES = 8  # transfers a link (or a source) needs before its own fit replaces the wider one


class LinkModels:
    """Transfer models per (source, destination) instance pair, learned from the transfers they report.

    A pair's model is fitted from its recent transfers once it has ``OWN_FIT_SAMPLES`` of them; before that
    it falls back to a fit over every link from the same source (with as many), then over all links, then to
    the configured prior. A fit of its own from two or three transfers follows their noise: one slow
    transfer on a busy moment made one prefill instance's T_send seconds longer than its peer's on the same
    host, and the Conductor sent a prompt away from the instance holding its prefix. The fits are robust
    (``TransferModel.fit``) for the same reason: a few such transfers among many move none of them.

    Each set of transfers is fitted once, until a transfer joins it: a pair's own, a source's (every model
    from that source without a fit of its own shares it: the prefill candidate's T_send, the copies from it),
    all links'. Every decision asks for the model of each prefill candidate and of each copy between them;
    refitting each of those after every transfer cost the Conductor 1.5 ms a model once the windows filled
    (256 transfers a source): on a 12P+4D cluster at 21-22 req/s its CPU rose from 0.33 to 0.48 of a core
    over 4,800 requests, and stays at 0.32-0.36 now (bench/results/scale/conditional/README.md).
    """

    def __init__(self, prior: TransferModel, window: int = 64) -> None:
        self.prior = prior
        self.window = window
        self._samples: dict[tuple[str, str], deque[tuple[int, float]]] = {}
        self._fits: dict[tuple[str, ...], TransferModel | None] = {}  # by set: (src, dst), (src,) or () for all

    def observe(self, source: str, destination: str, num_bytes: int, seconds: float) -> None:
        """Record one measured transfer; forget the fits of the sets it joins."""
        if num_bytes <= 0 or seconds <= 0:
            return
        self._samples.setdefault((source, destination), deque(maxlen=self.window)).append((num_bytes, seconds))
        for key in ((source, destination), (source,), ()):
            self._fits.pop(key, None)

    def learned(self) -> list[tuple[str, str, int, TransferModel | None]]:
        """Every observed pair: (source, destination, samples, its own fit or None while it has too few)."""
        return [(src, dst, len(q), TransferModel.fit(list(q))) for (src, dst), q in sorted(self._samples.items())]

    def model(self, source: str, destination: str = "") -> TransferModel:
        """The best model for a pair (destination "" = any destination from ``source``)."""
        for key in ((source, destination), (source,)):
            if key not in self._fits:  # None: too few transfers, or they cannot separate latency from bandwidth
                samples = self._set(key)
                self._fits[key] = TransferModel.fit(samples) if len(samples) >= OWN_FIT_SAMPLES else None
            if (fitted := self._fits[key]) is not None:
                return fitted
        if () not in self._fits:
            self._fits[()] = TransferModel.fit(self._set(()))
        return self._fits[()] or self.prior

    def _set(self, key: tuple[str, ...]) -> list[tuple[int, float]]:
        """The transfers of a pair (src, dst), of a source (src,), or of every link ()."""
        return [s for pair, q in self._samples.items() if pair[: len(key)] == key for s in q]
