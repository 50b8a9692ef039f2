"""The deployments `bench compare` sets side by side: the same worker slots, one engine (one torch thread) each."""


def colocated(workers: int = 2) -> tuple[str, ...]:
    """``workers`` colocated workers."""
    return ("prefill.node_count=0", "decode.node_count=0", f"colocated.node_count={workers}")


def disaggregated(workers: int = 2, prefill: int | None = None) -> tuple[str, ...]:
    """The same slots as ``prefill`` prefill workers and the rest decode (default half each, the extra one decodes)."""
    prefill = max(1, workers // 2) if prefill is None else prefill
    if not 1 <= prefill < workers:
        raise ValueError(f"a disaggregated deployment of {workers} slots needs 1 to {workers - 1} prefill workers")
    return (f"prefill.node_count={prefill}", f"decode.node_count={workers - prefill}", "colocated.node_count=0")
