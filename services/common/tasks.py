"""Awaiting work that must finish even when its caller is cancelled."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable
from typing import TypeVar

T = TypeVar("T")


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
