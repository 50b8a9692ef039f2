"""SLO capacity by bisection: ``bench compare --routers --capacity LO HI``.

A contender's SLO capacity is the highest request rate at which at least ``report.ATTAINMENT`` of the
requests meet every SLO (rejections and failures count as misses). A rate grid reads it to within one grid
step; bisection finds it to within ``--tolerance`` (5%) in a few runs: the bracket [LO, HI] is halved
geometrically, each probe one open-loop run at the midpoint, until the highest passing and the lowest
failing rate are within the tolerance of each other. LO and HI themselves are not run: the first probe is
their geometric mean, so a bracket that needs ``k`` halvings costs ``k`` runs. A bracket that was too low
or too high grows: when every probe so far passed and the highest is within the tolerance of HI, HI
doubles (and LO halves the other way), ``EXPANSIONS`` times at most; after that the capacity is reported
as at least the highest probe (or below the lowest). Each ``--repeats`` bisects again with fresh prompts
and arrivals, so the spread between repeats is measured, not assumed.

Bisection assumes that attainment falls with the rate; a noisy run can break that, which the repeats
show as spread.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from bench.compare.report import ATTAINMENT

TOLERANCE = 0.05
EXPANSIONS = 2  # times a bracket may double past HI (or halve below LO)


@dataclass
class Bisection:
    """One bisection's probes (rate -> attainment) and its result."""

    lo: float
    hi: float
    probes: dict[float, float] = field(default_factory=dict)
    expansions: int = 0

    @property
    def passing(self) -> float | None:
        """The highest probed rate that met the SLO for ``ATTAINMENT`` of its requests."""
        return max((r for r, a in self.probes.items() if a >= ATTAINMENT), default=None)

    @property
    def failing(self) -> float | None:
        """The lowest probed rate that did not."""
        return min((r for r, a in self.probes.items() if a < ATTAINMENT), default=None)

    def next_rate(self, tolerance: float) -> float | None:
        """The next rate to probe (0.01 req/s resolution), or None once the bracket is within ``tolerance``."""
        a, b = self.passing or self.lo, self.failing or self.hi
        if b <= a * (1 + tolerance) and self.expansions < EXPANSIONS:
            if self.failing is None:  # every probe passed, up to HI: the capacity lies above the bracket
                self.expansions += 1
                self.hi *= 2
            elif self.passing is None:  # every probe failed, down to LO
                self.expansions += 1
                self.lo /= 2
            a, b = self.passing or self.lo, self.failing or self.hi
        if b <= a * (1 + tolerance):
            return None
        rate = round(math.sqrt(a * b), 2)
        return None if rate in self.probes or not a < rate < b else rate

    def record(self) -> dict[str, Any]:
        """JSON: the capacity (None: below every probe), the failing rate above it, whether the bracket capped it."""
        probes = {f"{r:g}": a for r, a in sorted(self.probes.items())}
        return {"capacity": self.passing, "failing": self.failing, "at_least": self.failing is None,
                "bracket": [self.lo, self.hi], "expansions": self.expansions, "probes": probes}  # fmt: skip


def bisect(attainment: Callable[[float], float], lo: float, hi: float, tolerance: float = TOLERANCE) -> Bisection:
    """Probe ``attainment(rate)`` (the share of requests within SLO at that rate) until the capacity in [lo, hi]
    is known to within ``tolerance``."""
    if not 0 < lo < hi:
        raise ValueError(f"--capacity needs 0 < LO < HI, got {lo:g} {hi:g}")
    if not 0 < tolerance < 1:
        raise ValueError(f"--tolerance must be in (0, 1), got {tolerance:g}")
    search = Bisection(lo, hi)
    while (rate := search.next_rate(tolerance)) is not None:
        search.probes[rate] = attainment(rate)
    return search


def describe(result: dict[str, Any]) -> str:
    """``9.49 (9.97 failed)``, ``at least 15.8`` or ``below 5.2`` for one bisection's record."""
    capacity, failing = result["capacity"], result["failing"]
    if capacity is None:
        return f"below {failing:g}"
    return f"at least {capacity:g}" if failing is None else f"{capacity:g} ({failing:g} failed)"


def _mean(values: list[float]) -> float:
    return sum(values) / len(values)


def markdown(contenders: dict[str, dict[str, Any]], pd: set[str]) -> str:
    """Per contender its bisected capacities, their mean and spread; then ours against the best peer of the same
    kind of deployment (``pd``: the specs that disaggregate), with whether the lead exceeds the repeats' spread.

    ``contenders``: spec -> the contender's result (``capacity``: a list of ``Bisection.record()``).
    """
    ran = {spec: r for spec, r in contenders.items() if r.get("capacity")}
    if not ran:
        return ""
    repeats = max(len(r["capacity"]) for r in ran.values())
    lines = [f"SLO capacity by bisection (at least {ATTAINMENT:.0%} of requests within every SLO; rejections "
             "count as misses; each capacity passed, the rate in brackets failed):\n\n",
             "| front end | " + " | ".join(f"bisection {i + 1} req/s" for i in range(repeats)) +
             " | mean req/s | spread req/s |\n|---|" + "---:|" * (repeats + 2) + "\n"]  # fmt: skip
    values: dict[str, list[float]] = {}
    capped = {spec for spec, r in ran.items() if any(c["at_least"] for c in r["capacity"])}
    for spec, r in ran.items():
        found = [c["capacity"] for c in r["capacity"] if c["capacity"] is not None]
        cells = [describe(c) for c in r["capacity"]] + [""] * (repeats - len(r["capacity"]))
        if len(found) == len(r["capacity"]):
            values[spec] = found
            stats = f"{_bound(spec, capped)}{_mean(found):.2f} | {max(found) - min(found):.2f}"
        else:
            stats = "- | -"
        lines.append(f"| {r['label']} | " + " | ".join(cells) + f" | {stats} |\n")
    lines.append("\n")
    for ours, kind in (("conductor", "aggregated"), ("conductor:disaggregated", "PD")):
        peers = [s for s in values if not s.startswith("conductor") and (s in pd) == (kind == "PD")]
        if ours not in values or not peers:
            continue
        best = max(peers, key=lambda s: _mean(values[s]))
        mine, theirs = values[ours], values[best]
        lead = _mean(mine) - _mean(theirs)
        spread = max(max(mine) - min(mine), max(theirs) - min(theirs))
        bound = _bound(ours, capped) if best not in capped else "about "  # a capped peer: the ratio is no bound
        lines.append(f"- {ran[ours]['label']} against the best {kind} peer, {ran[best]['label']}: "
                     f"{bound}{_mean(mine) / _mean(theirs):.2f}x ({_bound(ours, capped)}{_mean(mine):.2f} vs "
                     f"{_bound(best, capped)}{_mean(theirs):.2f} req/s; lead {lead:+.2f} req/s, "
                     f"{'larger' if abs(lead) > spread else 'not larger'} than the larger spread between "
                     f"repeats, {spread:.2f} req/s)\n")  # fmt: skip
    return "".join(lines)


def knee_rows(contenders: dict[str, dict[str, Any]]) -> list[str]:
    """Each contender at its first bisection's first failing rate: why it failed there (``knee_markdown``'s rows)."""
    rows = []
    for r in contenders.values():
        rate = r["capacity"][0]["failing"] if r.get("capacity") else None
        if rate is None:  # not bisected, or it never failed
            continue
        s = r["levels"][f"rate={rate:g}"]["summary"]
        probes = [v["summary"]["prefix_cache_hit_rate"] for v in r["levels"].values()]
        ttft, tbt = s["ttft_ms"]["p90"] / 1e3, s["tbt_ms"]["p90"]
        rows.append(f"| {r['label']} | {rate:g} | {s['slo_attainment']:.1%} | {ttft:.1f} | {tbt:.0f} | "
                    f"{s['failed']} | {min(probes):.1%}-{max(probes):.1%} |")  # fmt: skip
    return rows


def knee_markdown(contenders: dict[str, dict[str, Any]]) -> str:
    """The table of ``knee_rows`` (empty when no contender failed a probe)."""
    rows = knee_rows(contenders)
    if not rows:
        return ""
    return ("At each contender's first failing rate (bisection 1; not served: refused or failed):\n\n"
            "| front end | first failing rate req/s | within SLO | TTFT p90 s | TBT p90 ms | not served | "
            "hit rate over its probes |\n|---|---:|---:|---:|---:|---:|---:|\n" + "\n".join(rows) + "\n")  # fmt: skip


def _bound(spec: str, capped: set[str]) -> str:
    """ "at least " for a contender one of whose bisections found no failing rate, so its mean is a lower bound."""
    return "at least " if spec in capped else ""
