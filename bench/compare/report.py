"""Side-by-side output of ``bench compare``: a terminal table, a markdown table and a PNG plot.

Rows are (deployment, pacing) runs; ``runs`` maps a label such as ``colocated c=4`` to the summary
that ``bench.serve.metrics.summarize`` returned for it.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

COLUMNS: tuple[tuple[str, Callable[[Mapping[str, Any]], str]], ...] = (
    ("TTFT p50 ms", lambda s: f"{s['ttft_ms']['median']:.1f}"),
    ("TTFT p90 ms", lambda s: f"{s['ttft_ms']['p90']:.1f}"),
    ("TPOT p50 ms", lambda s: f"{s['tpot_ms']['median']:.2f}"),
    ("TBT p90 ms", lambda s: f"{s['tbt_ms']['p90']:.1f}"),
    ("TBT per token", lambda s: _per_token(s.get("tbt_per_token"))),
    ("hit rate", lambda s: f"{s['prefix_cache_hit_rate']:.1%}"),
    ("req/s", lambda s: f"{s['request_throughput']:.2f}"),
    ("tok/s", lambda s: f"{s['output_throughput']:.1f}"),
    ("goodput req/s", lambda s: f"{s['goodput']:.2f}"),
    ("within SLO", lambda s: f"{s['slo_attainment']:.0%}"),
    ("done/failed", lambda s: f"{s['completed']}/{s['failed']}"),
)


def _per_token(share: float | None) -> str:
    """The share of streams whose TBT is of their tokens' own gaps ("-": not recorded, or no stream of two)."""
    return "-" if share is None or share != share else f"{share:.0%}"


def _cells(summary: Mapping[str, Any]) -> list[str]:
    return [fmt(summary) for _, fmt in COLUMNS]


def text_table(runs: Mapping[str, Mapping[str, Any]]) -> str:
    """Aligned columns for the terminal."""
    rows = [["run", *(name for name, _ in COLUMNS)]] + [[label, *_cells(s)] for label, s in runs.items()]
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    lines = []
    for row in rows:
        cells = [row[0].ljust(widths[0])] + [cell.rjust(w) for cell, w in zip(row[1:], widths[1:], strict=True)]
        lines.append("  ".join(cells))
    return "\n".join(lines)


def markdown_table(runs: Mapping[str, Mapping[str, Any]]) -> str:
    """A GitHub markdown table."""
    head = "| run | " + " | ".join(name for name, _ in COLUMNS) + " |\n"
    rule = "|---|" + "---:|" * len(COLUMNS) + "\n"
    return head + rule + "".join(f"| {label} | " + " | ".join(_cells(s)) + " |\n" for label, s in runs.items())


ATTAINMENT = 0.9  # DistServe's goodput: the highest request rate at which 90% of requests meet every SLO


def slo_capacity(by_rate: Mapping[float, Mapping[str, Any]]) -> float | None:
    """The highest swept rate at which this and every lower rate had ``ATTAINMENT`` within SLO; None if none."""
    best = None
    for rate in sorted(by_rate):
        if by_rate[rate]["slo_attainment"] < ATTAINMENT:
            break
        best = rate
    return best


def capacity_markdown(by_contender: Mapping[str, Mapping[float, Mapping[str, Any]]], peers: Sequence[str]) -> str:
    """Per contender: its SLO capacity, the goodput there and at the best peer's capacity; ours vs. the best peer.

    ``by_contender``: label -> {rate: summary}; ``peers``: the labels of the third-party front ends.
    """
    capacity = {label: slo_capacity(runs) for label, runs in by_contender.items()}
    best_peer = max((c for label, c in capacity.items() if label in peers and c is not None), default=None)
    ours = max((c for label, c in capacity.items() if label not in peers and c is not None), default=None)
    lines = [f"SLO capacity: the highest swept rate at which at least {ATTAINMENT:.0%} of requests met every SLO "
             "(and every lower rate did too).\n\n",
             f"| front end | capacity req/s | goodput there req/s | goodput at the best peer's capacity "
             f"({best_peer if best_peer is not None else '-'} req/s) |\n|---|---:|---:|---:|\n"]  # fmt: skip
    for label, runs in by_contender.items():
        cap = capacity[label]
        there = "-" if cap is None else f"{runs[cap]['goodput']:.2f}"
        at_peer = "-" if best_peer is None or best_peer not in runs else f"{runs[best_peer]['goodput']:.2f}"
        lines.append(f"| {label} | {'below the lowest rate' if cap is None else cap} | {there} | {at_peer} |\n")
    if ours is not None and best_peer is not None:
        lines.append(f"\nBest Conductor capacity / best peer capacity: {ours / best_peer:.2f}x\n")
    return "".join(lines)


def plot(runs: Mapping[str, Mapping[str, Any]], path: Path, title: str, colors: Sequence[str] | None = None) -> None:
    """Grouped bars: TTFT and TPOT (median with a p90 whisker), hit rate, goodput, per run.

    ``colors``: one bar colour per run (default: blue for ``colocated ...`` runs, orange otherwise).
    """
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    labels = list(runs)
    fig, axes = plt.subplots(1, 4, figsize=(16, 4.2))
    panels = (
        ("TTFT (ms)", "ttft_ms"),
        ("TPOT (ms)", "tpot_ms"),
    )
    if colors is None:
        colors = ["#4C72B0" if label.startswith("colocated") else "#DD8452" for label in labels]
    for ax, (name, key) in zip(axes, panels, strict=False):
        med = [runs[label][key]["median"] for label in labels]
        p90 = [runs[label][key]["p90"] for label in labels]
        ax.bar(
            labels, med, color=colors, yerr=[[0] * len(med), [b - a for a, b in zip(med, p90, strict=True)]], capsize=4
        )
        ax.set_title(f"{name}: median, whisker to p90")
    axes[2].bar(labels, [100 * runs[label]["prefix_cache_hit_rate"] for label in labels], color=colors)
    axes[2].set_title("prefix-cache hit rate (%)")
    axes[3].bar(labels, [runs[label]["goodput"] for label in labels], color=colors)
    axes[3].set_title("goodput (req/s within SLO)")
    for ax in axes:
        plt.setp(
            ax.get_xticklabels(), rotation=35, ha="right", rotation_mode="anchor", fontsize=8 if len(labels) < 8 else 7
        )
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
