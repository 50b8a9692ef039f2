"""Pacing of a benchmark run: closed loop, Poisson arrivals, or trace timestamps; a live progress line.

- ``concurrency=C``: closed loop, C requests in flight, each finished request starts the next.
- ``rate=R``: open loop, exponential gaps with mean 1/R seconds (seeded), regardless of completions;
  for requests that carry their own ``arrival_s`` (a trace), those arrivals compressed or stretched to
  the mean rate R instead, so the trace's bursts stay.
- otherwise, open loop at the requests' own ``arrival_s`` (trace replay); requests without one start
  at once.
"""

from __future__ import annotations

import asyncio
import random
import sys
import time
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass

import httpx

from bench.serve.client import Endpoint, RequestResult, send
from bench.serve.workloads import BenchRequest

PROGRESS_EVERY_S = 0.5


@dataclass(frozen=True)
class Target:
    """Where to send: an OpenAI-compatible base URL (ending in /v1), a model, an optional key."""

    base_url: str
    model: str
    api_key: str | None = None
    endpoint: Endpoint = "chat"

    def client(self, connections: int) -> httpx.AsyncClient:
        """An HTTP client for the whole run."""
        headers = {"Authorization": f"Bearer {self.api_key}"} if self.api_key else {}
        return httpx.AsyncClient(
            base_url=self.base_url,
            headers=headers,
            timeout=httpx.Timeout(600.0, connect=10.0),
            limits=httpx.Limits(max_connections=connections, max_keepalive_connections=connections),
        )


async def check_target(target: Target) -> None:
    """Raise ValueError with a one-line message when the server is unreachable or lacks the model."""
    try:
        async with target.client(1) as client:
            response = await client.get("/models", timeout=10.0)
    except httpx.HTTPError as e:
        raise ValueError(f"cannot reach {target.base_url}: {type(e).__name__}: {e}") from None
    if response.status_code != 200:
        raise ValueError(f"{target.base_url}/models answered HTTP {response.status_code}: {response.text[:200]}")
    try:
        served = [m["id"] for m in response.json()["data"]]
    except (ValueError, KeyError, TypeError):
        raise ValueError(f"{target.base_url}/models is not an OpenAI model list") from None
    if target.model not in served:
        raise ValueError(f"model {target.model!r} is not served at {target.base_url}; served: {served}")


def arrival_times(requests: Sequence[BenchRequest], rate: float | None, seed: int) -> list[float]:
    """Each request's offset (s) in an open loop: its own ``arrival_s`` (0 without one) at ``rate`` None;
    at a rate, a trace's own arrivals scaled to that mean rate, other requests' Poisson arrivals."""
    if rate is None:
        return [r.arrival_s or 0.0 for r in requests]
    times = [r.arrival_s for r in requests if r.arrival_s is not None]
    if len(times) == len(requests) > 1 and max(times) > min(times):
        first = min(times)  # n arrivals at a mean rate R span (n - 1) / R, as Poisson's do
        factor = (len(times) - 1) / (rate * (max(times) - first))
        return [(at - first) * factor for at in times]
    return poisson_arrivals(len(requests), rate, seed)


def poisson_arrivals(n: int, rate: float, seed: int) -> list[float]:
    """Arrival offsets (s) of ``n`` requests at ``rate`` per second: exponential gaps, first at 0."""
    rng = random.Random(seed)
    arrivals, t = [], 0.0
    for _ in range(n):
        arrivals.append(t)
        t += rng.expovariate(rate)
    return arrivals


class Progress:
    """Counts, and a status line on stderr: rewritten in place on a terminal, every 10 s otherwise."""

    def __init__(self, total: int, quiet: bool = False) -> None:
        self.total, self.quiet = total, quiet
        self.completed = self.failed = self.in_flight = 0
        self.t0 = time.perf_counter()
        self._tty = sys.stderr.isatty()
        self._last_print = 0.0

    def line(self) -> str:
        """The current status."""
        elapsed = time.perf_counter() - self.t0
        return (
            f"[bench] {self.completed + self.failed}/{self.total} done: {self.completed} completed, "
            f"{self.failed} failed, {self.in_flight} in flight, {elapsed:.1f} s"
        )

    def show(self, final: bool = False) -> None:
        """Print the status line (in place on a terminal)."""
        now = time.perf_counter()
        if self.quiet or (not self._tty and not final and now - self._last_print < 10):
            return
        self._last_print = now
        end = "\n" if final or not self._tty else ""
        print(("\r" if self._tty else "") + self.line(), end=end, file=sys.stderr, flush=True)

    def started(self) -> None:
        """One more request in flight."""
        self.in_flight += 1

    def done(self, result: RequestResult) -> None:
        """One request finished."""
        self.in_flight -= 1
        if result.error is None:
            self.completed += 1
        else:
            self.failed += 1


async def run(
    target: Target,
    requests: Sequence[BenchRequest],
    concurrency: int | None = None,
    rate: float | None = None,
    seed: int = 0,
    quiet: bool = False,
) -> tuple[list[RequestResult], float]:
    """Send every request; return the results in request order and the run's duration (s)."""
    progress = Progress(len(requests), quiet)
    results: list[RequestResult | None] = [None] * len(requests)
    async with target.client(concurrency or len(requests) or 1) as client:
        start = time.perf_counter()

        async def one(i: int) -> None:
            progress.started()
            result = await send(client, requests[i], target.model, target.endpoint, start)
            results[i] = result
            progress.done(result)

        ticker = asyncio.create_task(_tick(progress))
        try:
            if concurrency:
                await _closed_loop(one, len(requests), concurrency)
            else:
                await _open_loop(one, arrival_times(requests, rate, seed), start)
        finally:
            ticker.cancel()
        duration = time.perf_counter() - start
    progress.show(final=True)
    return [r for r in results if r is not None], duration


async def _tick(progress: Progress) -> None:
    while True:
        progress.show()
        await asyncio.sleep(PROGRESS_EVERY_S)


async def _closed_loop(one: Callable[[int], Awaitable[None]], n: int, concurrency: int) -> None:
    queue = iter(range(n))

    async def worker() -> None:
        for i in queue:
            await one(i)

    await asyncio.gather(*(worker() for _ in range(min(concurrency, n))))


async def _open_loop(one: Callable[[int], Awaitable[None]], arrivals: Sequence[float], start: float) -> None:
    tasks = []
    for i in sorted(range(len(arrivals)), key=arrivals.__getitem__):
        delay = arrivals[i] - (time.perf_counter() - start)
        if delay > 0:
            await asyncio.sleep(delay)
        tasks.append(asyncio.ensure_future(one(i)))
    await asyncio.gather(*tasks)
