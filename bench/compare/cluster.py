"""The deployments `bench compare` sets side by side: the same worker slots, one engine (one torch thread) each."""


def colocated(workers: int = 2) -> tuple[str, ...]:
    """``workers`` colocated workers."""
    return ("prefill.node_count=0", "decode.node_count=0", f"colocated.node_count={workers}")


def split(workers: int = 2, prefill: int | None = None) -> tuple[int, int]:
    """(prefill, decode) slots: ``prefill`` of ``workers`` prefill and the rest decode (default half each, the extra
    one decodes)."""
    prefill = max(1, workers // 2) if prefill is None else prefill
    if not 1 <= prefill < workers:
        raise ValueError(f"a disaggregated deployment of {workers} slots needs 1 to {workers - 1} prefill workers")
    return prefill, workers - prefill


def disaggregated(workers: int = 2, prefill: int | None = None) -> tuple[str, ...]:
    """The node counts of ``split``'s prefill and decode workers."""
    p, d = split(workers, prefill)
    return (f"prefill.node_count={p}", f"decode.node_count={d}", "colocated.node_count=0")


def conditional(workers: int = 2, prefill: int | None = None) -> tuple[str, ...]:
    """``split``'s prefill workers beside colocated ones (which decode, and prefill when the Conductor says so)."""
    p, c = split(workers, prefill)
    return (f"prefill.node_count={p}", "decode.node_count=0", f"colocated.node_count={c}")
