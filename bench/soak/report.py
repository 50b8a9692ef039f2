"""The pure parts of the soak benchmark: latency per time window, resource deltas, the verdict, the outputs.

A *sample* is one reading of the whole cluster (see ``bench.soak.probe.sample``)::

    {"label": "start" | "warmup" | "load" | "drained" | "end", "t_s": seconds from the start of the load,
     "processes": {id: {"role", "pid", "rss_kib": int | None, "fds": int | None}},
     "workers": {id: {"free_blocks", "total_blocks", "running", "waiting", "reserved"} | None}}

``None`` means the value could not be read (process gone, worker unreachable).

Verdict (``verdict``):

- FAIL when any request failed (errors by kind, target 0), when fewer results came back than requests
  were sent, when a process of the cluster is gone at the end, or when a worker's free KV blocks at the
  end differ from its free blocks at the start (read after the load drained).
- RSS growth is reported, never failed, and *flagged* when a process grew from the warm-up sample to the
  end by more than ``max(rss_flag_mib, rss_flag_pct % of its warm-up RSS)`` (defaults 32 MiB, 10 %).
  The warm-up sample is the baseline because the first requests allocate once (torch workspaces, gRPC
  channels, prefix-cache pages); growth after that is what a leak looks like.
- Open file descriptors likewise: flagged when a process holds more than ``fd_flag`` (default 8) more
  descriptors at the end than after the warm-up.
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from bench.serve.client import RequestResult
from bench.serve.metrics import percentile

QUANTILES = (50, 90, 99)
MIB = 1024.0  # KiB per MiB


@dataclass(frozen=True)
class Thresholds:
    """When RSS and fd growth (warm-up to end) get a flag."""

    rss_flag_mib: float = 32.0
    rss_flag_pct: float = 10.0
    fd_flag: int = 8


def _quantiles(values: Sequence[float]) -> dict[str, float]:
    return {f"p{q}": percentile(values, q) for q in QUANTILES}


def windows(results: Sequence[RequestResult], window_s: float) -> list[dict[str, Any]]:
    """Requests grouped by start time into windows of ``window_s`` s: counts, errors, TTFT/TPOT/E2E percentiles (ms).

    Every window from 0 to the last request's start is present, empty ones included.
    """
    if window_s <= 0:
        raise ValueError("window_s must be > 0")
    if not results:
        return []
    count = int(max(r.start_s for r in results) // window_s) + 1
    groups: list[list[RequestResult]] = [[] for _ in range(count)]
    for r in results:
        groups[max(0, int(r.start_s // window_s))].append(r)
    out = []
    for i, group in enumerate(groups):
        done = [r for r in group if r.error is None]
        out.append(
            {
                "start_s": i * window_s,
                "end_s": (i + 1) * window_s,
                "requests": len(group),
                "completed": len(done),
                "errors": dict(Counter(r.error for r in group if r.error is not None)),
                "ttft_ms": _quantiles([r.ttft * 1e3 for r in done if r.ttft is not None]),
                "tpot_ms": _quantiles([t * 1e3 for r in done if (t := r.tpot) is not None]),
                "e2e_ms": _quantiles([r.latency * 1e3 for r in done if r.latency is not None]),
            }
        )
    return out


def _at(samples: Sequence[Mapping[str, Any]], label: str) -> Mapping[str, Any] | None:
    """The last sample with this label."""
    return next((s for s in reversed(samples) if s["label"] == label), None)


def _value(sample: Mapping[str, Any] | None, kind: str, key: str, field: str) -> float | None:
    if sample is None:
        return None
    entry = sample[kind].get(key)
    return None if entry is None else entry.get(field)


def _delta(a: float | None, b: float | None) -> float | None:
    return None if a is None or b is None else b - a


def slope_per_min(points: Sequence[tuple[float, float]]) -> float | None:
    """Least-squares slope of (t_s, value) points, per minute; None with fewer than 3 points or no time span."""
    if len(points) < 3:
        return None
    n = len(points)
    mt = sum(t for t, _ in points) / n
    mv = sum(v for _, v in points) / n
    var = sum((t - mt) ** 2 for t, _ in points)
    if var == 0:
        return None
    return 60.0 * sum((t - mt) * (v - mv) for t, v in points) / var


def _series(samples: Sequence[Mapping[str, Any]], kind: str, key: str, field: str) -> list[float]:
    return [v for s in samples if (v := _value(s, kind, key, field)) is not None]


def resources(samples: Sequence[Mapping[str, Any]]) -> dict[str, Any]:
    """Start, warm-up and end values with deltas: RSS (MiB) and fds per process, free KV blocks per worker."""
    start, warm, end = _at(samples, "start"), _at(samples, "warmup"), _at(samples, "end")
    keys_p = list(dict.fromkeys(k for s in samples for k in s["processes"]))
    keys_w = list(dict.fromkeys(k for s in samples for k in s["workers"]))
    processes: dict[str, Any] = {}
    for key in keys_p:
        info = next(s["processes"][key] for s in samples if key in s["processes"])
        rss = [_value(s, "processes", key, "rss_kib") for s in (start, warm, end)]
        rss_mib = [None if v is None else v / MIB for v in rss]
        fds = [_value(s, "processes", key, "fds") for s in (start, warm, end)]
        load = [
            (s["t_s"], v / MIB)
            for s in samples
            if s["label"] == "load" and (v := _value(s, "processes", key, "rss_kib"))
        ]
        processes[key] = {
            "role": info["role"],
            "pid": info["pid"],
            "rss_mib": _row(rss_mib, [v / MIB for v in _series(samples, "processes", key, "rss_kib")]),
            "rss_slope_mib_per_min_under_load": slope_per_min(load),
            "fds": _row(fds, _series(samples, "processes", key, "fds")),
        }
    workers: dict[str, Any] = {}
    for key in keys_w:
        free = [_value(s, "workers", key, "free_blocks") for s in (start, warm, end)]
        workers[key] = {
            "total_blocks": next((t for s in samples if (t := _value(s, "workers", key, "total_blocks"))), None),
            "free_blocks": _row(free, _series(samples, "workers", key, "free_blocks")),
        }
    return {"processes": processes, "workers": workers}


def _row(values: Sequence[float | None], series: Sequence[float]) -> dict[str, float | None]:
    start, warm, end = values
    return {
        "start": start,
        "warmup": warm,
        "end": end,
        "min": min(series) if series else None,
        "max": max(series) if series else None,
        "delta": _delta(start, end),
        "delta_after_warmup": _delta(warm, end),
    }


def verdict(
    requested: int, results: Sequence[RequestResult], table: Mapping[str, Any], thresholds: Thresholds = Thresholds()
) -> dict[str, Any]:
    """PASS/FAIL with the reasons, and the (non-failing) flags; see the module docstring."""
    failures: list[str] = []
    flags: list[str] = []
    errors = Counter(r.error for r in results if r.error is not None)
    if errors:
        failures.append(f"{sum(errors.values())} failed requests ({len(errors)} kinds)")
    if len(results) != requested:
        failures.append(f"{len(results)} results for {requested} requests")
    for key, p in table["processes"].items():
        _check_process(key, p, thresholds, failures, flags)
    for key, w in table["workers"].items():
        free = w["free_blocks"]
        if free["end"] is None or free["start"] is None:
            failures.append(f"{key}: free KV blocks unreadable at {'start' if free['start'] is None else 'end'}")
        elif free["end"] != free["start"]:
            failures.append(f"{key}: {free['end']:.0f} free KV blocks at the end, {free['start']:.0f} at the start")
    passed = not failures
    done = len(results) - sum(errors.values())
    line = f"{'PASS' if passed else 'FAIL'}: {done}/{requested} completed, {sum(errors.values())} errors, " + (
        "free KV blocks back to start on every worker" if not any("KV" in f for f in failures) else "; ".join(failures)
    )
    if flags:
        line += f" ({len(flags)} flagged: {'; '.join(flags)})"
    return {"passed": passed, "failures": failures, "flags": flags, "line": line}


def _check_process(key: str, p: Mapping[str, Any], th: Thresholds, failures: list[str], flags: list[str]) -> None:
    """A process gone at the end fails; RSS or fd growth after warm-up above the thresholds is flagged."""
    rss, fds = p["rss_mib"], p["fds"]
    if rss["start"] is not None and rss["end"] is None:
        failures.append(f"{key} (pid {p['pid']}) is gone at the end")
        return
    grew, base = rss["delta_after_warmup"], rss["warmup"]
    if grew is not None and base is not None and grew > max(th.rss_flag_mib, base * th.rss_flag_pct / 100):
        flags.append(f"{key} RSS +{grew:.1f} MiB after warm-up ({base:.0f} -> {rss['end']:.0f} MiB)")
    if fds["delta_after_warmup"] is not None and fds["delta_after_warmup"] > th.fd_flag:
        flags.append(f"{key} open fds +{fds['delta_after_warmup']:.0f} after warm-up")


def _fmt(value: float | None, digits: int = 1, sign: bool = False) -> str:
    if value is None or (isinstance(value, float) and not math.isfinite(value)):
        return "-"
    return f"{value:+.{digits}f}" if sign else f"{value:.{digits}f}"


def markdown(record: Mapping[str, Any]) -> str:
    """The report: verdict, configuration, errors, latency per window, resources start vs end."""
    cfg, summary, table = record["config"], record["summary"], record["resources"]
    lines = [
        f"# Soak: {record['verdict']['line']}",
        "",
        f"{cfg['requests']} streaming chat requests, {cfg['workload']} workload, {cfg['arrivals']} arrivals at "
        f"{cfg['rate']:g} req/s (seed {cfg['seed']}), {cfg['warmup']} warm-up requests first; cluster: "
        f"{record['cluster']['description']}; code {record['code']}; load {summary['duration_s']:.0f} s, "
        f"drained in {_fmt(record['drain_s'])} s, wall {record['wall_s']:.0f} s.",
        "",
        f"Completed {summary['completed']}/{summary['requests']}, failed {summary['failed']}; "
        f"{summary['request_throughput']:.2f} req/s, {summary['output_throughput']:.1f} output tok/s, "
        f"prefix-cache hit rate {_fmt(100 * summary['prefix_cache_hit_rate'] if summary['cached_tokens'] else 0.0)} %.",
        "",
    ]
    if summary["errors"]:
        lines += ["Errors by kind:", ""] + [f"- {n} x `{reason}`" for reason, n in summary["errors"].items()] + [""]
    head = "| window s | requests | errors | TTFT p50 | TTFT p90 | TTFT p99 | TPOT p50 | TPOT p99 | E2E p50 | E2E p99 |"
    lines += ["## Latency per window (ms)", "", head, "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for w in record["windows"]:
        t, p, e = w["ttft_ms"], w["tpot_ms"], w["e2e_ms"]
        lines.append(
            f"| {w['start_s']:.0f}-{w['end_s']:.0f} | {w['requests']} | {sum(w['errors'].values())} | "
            f"{_fmt(t['p50'])} | {_fmt(t['p90'])} | {_fmt(t['p99'])} | {_fmt(p['p50'], 2)} | {_fmt(p['p99'], 2)} | "
            f"{_fmt(e['p50'])} | {_fmt(e['p99'])} |"
        )
    lines += ["", "## Processes: RSS (MiB) and open file descriptors", "",
              "| process | start | warm-up | end | max | Δ end-start | Δ end-warm-up | slope under load MiB/min | "
              "fds start | fds warm-up | fds end | Δ fds |",
              "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]  # fmt: skip
    for key, p in table["processes"].items():
        r, f = p["rss_mib"], p["fds"]
        lines.append(
            f"| {key} | {_fmt(r['start'])} | {_fmt(r['warmup'])} | {_fmt(r['end'])} | {_fmt(r['max'])} | "
            f"{_fmt(r['delta'], sign=True)} | {_fmt(r['delta_after_warmup'], sign=True)} | "
            f"{_fmt(p['rss_slope_mib_per_min_under_load'], 2, sign=True)} | {_fmt(f['start'], 0)} | "
            f"{_fmt(f['warmup'], 0)} | {_fmt(f['end'], 0)} | {_fmt(f['delta'], 0, sign=True)} |"
        )
    lines += ["", "## Workers: free KV blocks", "", "| worker | total | start | warm-up | min under load | end | Δ |",
              "|---|---:|---:|---:|---:|---:|---:|"]  # fmt: skip
    for key, w in table["workers"].items():
        b = w["free_blocks"]
        lines.append(
            f"| {key} | {_fmt(w['total_blocks'], 0)} | {_fmt(b['start'], 0)} | {_fmt(b['warmup'], 0)} | "
            f"{_fmt(b['min'], 0)} | {_fmt(b['end'], 0)} | {_fmt(b['delta'], 0, sign=True)} |"
        )
    v = record["verdict"]
    lines += ["", "## Verdict", "", v["line"], ""]
    lines += [f"- FAIL: {f}" for f in v["failures"]] + [f"- flag: {f}" for f in v["flags"]]
    th = record["thresholds"]
    lines += [
        "",
        f"Flags (reported, not failed): RSS growth from warm-up to end above max({th['rss_flag_mib']:g} MiB, "
        f"{th['rss_flag_pct']:g} %), fd growth above {th['fd_flag']}.",
        "",
    ]
    return "\n".join(lines)


def plot(record: Mapping[str, Any], samples: Sequence[Mapping[str, Any]], path: Path) -> None:
    """Three panels over time: latency percentiles per window, RSS growth per process, free KV blocks per worker."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (lat, rss, kv) = plt.subplots(3, 1, figsize=(11, 10), sharex=True)
    mids = [(w["start_s"] + w["end_s"]) / 2 for w in record["windows"]]
    for metric, style in (("ttft_ms", "-"), ("e2e_ms", "--")):
        for q, color in (("p50", "tab:blue"), ("p99", "tab:red")):
            values = [w[metric][q] for w in record["windows"]]
            lat.plot(mids, values, style, marker="o", color=color, label=f"{metric[:-3].upper()} {q}")
    lat.set_ylabel("ms (per window)")
    lat.set_yscale("log")
    lat.legend(loc="upper right", fontsize=8, ncol=2)
    lat.set_title(record["verdict"]["line"][:110], fontsize=9)
    for key in record["resources"]["processes"]:
        points = [(s["t_s"], v / MIB) for s in samples if (v := _value(s, "processes", key, "rss_kib")) is not None]
        if points:
            base = points[0][1]
            label = f"{key} ({base:.0f} MiB at start)"
            rss.plot([t for t, _ in points], [v - base for _, v in points], marker=".", label=label)
    rss.set_ylabel("RSS growth since start, MiB")
    rss.legend(loc="best", fontsize=7, ncol=3)
    for key in record["resources"]["workers"]:
        points = [(s["t_s"], v) for s in samples if (v := _value(s, "workers", key, "free_blocks")) is not None]
        kv.plot([t for t, _ in points], [v for _, v in points], marker=".", label=key)
    kv.set_ylabel("free KV blocks")
    kv.set_xlabel("s since the start of the load (negative: start and warm-up samples)")
    kv.legend(loc="lower left", fontsize=8)
    for ax in (lat, rss, kv):
        ax.axvline(0, color="grey", lw=0.6)
        ax.axvline(record["summary"]["duration_s"], color="grey", lw=0.6, ls=":")
        ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
