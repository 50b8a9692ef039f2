"""Work that must run to its end: awaited though its caller is cancelled (``complete``), or in the background."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable
from typing import TypeVar

T = TypeVar("T")

log = logging.getLogger(__name__)
_running: set[asyncio.Future[None]] = set()  # spawned work, kept from garbage collection until it ends


async def complete(work: Awaitable[T]) -> T:
    """Await ``work`` to its end even if the caller is cancelled meanwhile; then re-raise the cancellation.

    For steps whose side effects must be known before cleanup runs: a pin taken on a worker thread, a
    transfer writing into blocks that the cleanup would free.
    """
    task = asyncio.ensure_future(work)
    try:
        return await asyncio.shield(task)
    except asyncio.CancelledError:
        await asyncio.gather(task, return_exceptions=True)
        raise


def spawn(work: Awaitable[None], what: str) -> asyncio.Future[None]:
    """Run ``work`` in the background, to its end; a failure is logged as ``what`` failed, never raised."""
    task = asyncio.ensure_future(work)
    _running.add(task)
    task.add_done_callback(lambda t: _finished(t, what))
    return task


def _finished(task: asyncio.Future[None], what: str) -> None:
    _running.discard(task)
    if not task.cancelled() and task.exception() is not None:
        log.warning("%s failed: %r", what, task.exception())
