"""How a prompt prefilled on a colocated instance stalls the requests decoding there, and what that does to their TBT.

Every engine step on a colocated instance carries one chunk of the prompts prefilling there and one token of
each request decoding: a prompt of ``chunks`` chunks makes that many of a resident's gaps longer by a chunk's
compute. A request's TBT is the mean of the longest 10% of its token gaps (``scheduler/sim/metrics.request_tbt``,
as the benchmarks' clients measure it), so a long request absorbs a few stalled steps and a short one does not.
The re-plan of a colocated prompt that would push a resident past the TBT SLO (``disaggregation.stalls_past_tbt``),
the check of a remote plan's decode instance (``stalled_by_queued_prompts``) and the bookings (``core``) share it.
"""

from __future__ import annotations

import math
from collections.abc import Iterator, Sequence

from scheduler.candidates import DecodeCandidate, Resident
from scheduler.cost_model import DecodeModel


def tbt_with_stalls(step: float, gaps: float, stalls: Sequence[tuple[int, float]]) -> float:
    """A request's TBT, the mean of its longest tenth of ``gaps`` gaps, with ``stalls``: (steps, seconds longer).

    The stalled steps are its longest gaps, the longest stalls first.
    """
    k = max(1, math.ceil(0.1 * max(1.0, gaps)))
    total, left = 0.0, k
    for steps, stall in sorted(stalls, key=lambda s: -s[1]):
        take = min(steps, left)
        total, left = total + take * stall, left - take
    return step + total / k


def chunks_after(chunks: int, start: float, end: float, t: float) -> int:
    """Of ``chunks`` steps spread evenly over [start, end], those not yet run at ``t``."""
    if chunks <= 0 or t >= end:
        return 0
    return chunks if t <= start else min(chunks, math.ceil(chunks * (end - t) / (end - start)))


def stalled_steps(chunks: int, start: float, end: float, r: Resident, step: float) -> int:
    """Of a prompt's ``chunks`` steps over [start, end] on a colocated instance, those that stall resident r.

    Once both run, every step carries one chunk and one token of r: r takes the chunks not yet run when it
    joins (all of them when it decodes before the prompt starts), as many as it has tokens left from then. Its
    decode stretches with them, so a time overlap would miss most: a request that joins a long prompt's
    chunking is stalled at every step until the prompt is done or it is.
    """
    t0 = max(r.t_join, start)
    left = math.ceil((r.t_leave - t0) / step) if r.t_leave > t0 else 0
    return min(chunks_after(chunks, start, end, r.t_join), left)


def prompt_stalls(
    residents: Sequence[Resident], model: DecodeModel, start: float, t_prefill: float, chunks: int
) -> Iterator[tuple[int, int, float, float]]:
    """(index in ``residents``, steps stalled, seconds each, decode step) of each resident a prompt stalls.

    The prompt runs ``t_prefill`` from ``start`` in ``chunks`` steps (at least one); the decode step is that of
    the batch of requests decoding meanwhile, those booked to start meanwhile included.
    """
    end = start + t_prefill
    batch = [i for i, r in enumerate(residents) if r.t_join < end and r.t_leave > 0]
    if not batch or t_prefill <= 0:
        return
    step = model.predict(len(batch), sum(residents[i].context for i in batch))
    chunks = max(1, chunks)
    stall = t_prefill / chunks
    for i in batch:
        if hit := stalled_steps(chunks, start, end, residents[i], step):
            yield i, hit, stall, step


def resident_tbts(d: DecodeCandidate, start: float, t_prefill: float, chunks: int) -> Iterator[tuple[float, float]]:
    """(TBT before, TBT after) of each request on d that a prompt stalls (``prompt_stalls``).

    A request's stalls add to those booked on it before (``Resident.stalls``).
    """
    for i, hit, stall, step in prompt_stalls(d.residents, d.model, start, t_prefill, chunks):
        r = d.residents[i]
        gaps = (r.t_leave - r.t_join - sum(n * s for n, s in r.stalls)) / step  # its stalls stretch its decode
        yield tbt_with_stalls(step, gaps, r.stalls), tbt_with_stalls(step, gaps, [*r.stalls, (hit, stall)])
