"""PNG plots of the simulator studies (matplotlib, headless)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402


def _cdf(ax: Any, values: list[float], label: str) -> None:
    if values:
        x = np.sort(np.asarray(values))
        ax.plot(x, np.arange(1, len(x) + 1) / len(x), label=label)


def plot_policies(runs: dict[str, dict[str, Any]], paper: dict[str, float], path: Path, title: str) -> None:
    """TTFT and TBT CDFs, mean TTFT beside the paper's Figure 5, SLO attainment per TBT threshold."""
    fig, axes = plt.subplots(2, 2, figsize=(14, 10))
    ttft_ax, tbt_ax, fig5_ax, slo_ax = axes.flat
    for policy, run in runs.items():
        _cdf(ttft_ax, [max(v, 1e-3) for v in run["ttft_s"]], policy)
        _cdf(tbt_ax, [max(v, 1e-3) for v in run["tbt_s"]], policy)
    ttft_ax.set(xscale="log", xlabel="TTFT (s)", ylabel="fraction of served requests", title="TTFT CDF")
    ttft_ax.axvline(30, color="grey", ls=":")
    tbt_ax.set(xscale="log", xlabel="TBT = mean of the longest 10% gaps (s)", title="TBT CDF")
    for threshold in (0.1, 0.2, 0.3):
        tbt_ax.axvline(threshold, color="grey", ls=":")
    for ax in (ttft_ax, tbt_ax):
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    names = list(runs)
    x = np.arange(len(names))
    fig5_ax.bar(x - 0.2, [runs[p]["summary"]["ttft"]["mean"] for p in names], 0.4, label="simulated")
    fig5_ax.bar(x + 0.2, [paper.get(p, np.nan) for p in names], 0.4, label="paper Fig. 5")
    fig5_ax.set_xticks(x, names, rotation=30, ha="right", fontsize=8)
    fig5_ax.set(ylabel="mean TTFT (s)", title="mean TTFT: simulated vs paper Figure 5")
    fig5_ax.legend()
    keys = list(next(iter(runs.values()))["summary"]["slo_attainment"])
    for i, key in enumerate(keys):
        slo_ax.bar(x + (i - 1) * 0.27, [runs[p]["summary"]["slo_attainment"][key] for p in names], 0.27, label=key)
    slo_ax.set_xticks(x, names, rotation=30, ha="right", fontsize=8)
    slo_ax.set(ylabel="SLO attainment (TTFT <= 30 s and TBT <= threshold)", ylim=(0, 1.05), title="SLO attainment")
    slo_ax.legend(fontsize=8)
    fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def plot_overload(runs: dict[str, dict[str, Any]], path: Path, title: str, bin_s: float = 60.0) -> None:
    """Prefill and decode load over time, and rejections per minute, one row per early-rejection mode."""
    fig, axes = plt.subplots(len(runs), 1, figsize=(14, 4.5 * len(runs)), squeeze=False)
    for ax, (mode, run) in zip(axes[:, 0], runs.items(), strict=True):
        cfg = run["config"]
        t = np.array([s["time"] for s in run["samples"]]) / 60
        prefill = np.array([s["prefill_t_queue_mean"] for s in run["samples"]]) / cfg["max_ttft"]
        decode = np.array([s["decode_step_mean"] for s in run["samples"]]) / cfg["max_tbt"]
        ax.plot(t, prefill, label="prefill load: mean T_queue / TTFT SLO", color="tab:blue")
        ax.plot(t, decode, label="decode load: mean step time / TBT SLO", color="tab:orange")
        ax.set(xlabel="trace time (min)", ylabel="load (1 = at the SLO)")
        rejected = [a for a, _ in run["rejections_at"]]
        if rejected:
            bins = np.arange(0, max(rejected) + bin_s, bin_s)
            counts, edges = np.histogram(rejected, bins)
            twin = ax.twinx()
            twin.bar(edges[:-1] / 60, counts, width=bin_s / 60, align="edge", alpha=0.25, color="tab:red")
            twin.set_ylabel("rejections per minute", color="tab:red")
        total = sum(run["summary"]["rejections"].values())
        ax.set_title(f"{mode} early rejection: {total} rejected {run['summary']['rejections']}")
        ax.legend(loc="upper left", fontsize=8)
        ax.grid(alpha=0.3)
    fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
