"""The deployments `bench compare` sets side by side: the same worker slots, one engine (one torch thread) each."""


def colocated(workers: int = 2) -> tuple[str, ...]:
    """``workers`` colocated workers."""
    return ("prefill.node_count=0", "decode.node_count=0", f"colocated.node_count={workers}")


def disaggregated(workers: int = 2) -> tuple[str, ...]:
    """The same slots as prefill and decode workers, half each (the extra one decodes)."""
    prefill = max(1, workers // 2)
    return (f"prefill.node_count={prefill}", f"decode.node_count={max(1, workers - prefill)}", "colocated.node_count=0")
