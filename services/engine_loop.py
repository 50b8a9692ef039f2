"""Runs an LLMEngine on its own thread and connects it to asyncio handlers.

The engine is single-threaded: only the engine thread touches it. Handlers submit commands
(``call``) that run between steps, and read each request's step outputs from a per-request
asyncio queue (``open``/``close``). The thread steps while any request is unfinished and sleeps
on the command queue otherwise, so an idle worker burns no CPU.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import queue
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future
from typing import TypeVar

from engine.llm_engine import LLMEngine, StepOutput

log = logging.getLogger(__name__)
T = TypeVar("T")


class EngineLoop:
    """An engine thread plus the plumbing from its step outputs to asyncio queues."""

    def __init__(
        self, engine: LLMEngine, on_step: Callable[[tuple[tuple[int, int], ...], float], None] | None = None
    ) -> None:
        self.engine = engine
        self.on_step = on_step  # called on the engine thread with each step's shape and duration
        self._commands: queue.Queue[Callable[[], None] | None] = queue.Queue()
        self._outputs: dict[str, asyncio.Queue[StepOutput | Exception]] = {}
        self._aloop: asyncio.AbstractEventLoop | None = None
        self._thread = threading.Thread(target=self._run, name="engine", daemon=True)

    def start(self) -> None:
        """Start the engine thread; call from the event loop that will consume outputs."""
        self._aloop = asyncio.get_running_loop()
        self._thread.start()

    def stop(self) -> None:
        """Stop the engine thread after the current step."""
        self._commands.put(None)
        self._thread.join(timeout=10)

    async def call(self, fn: Callable[[LLMEngine], T]) -> T:
        """Run ``fn(engine)`` on the engine thread and return its result (or raise its exception)."""
        future: Future[T] = Future()

        def command() -> None:
            try:
                future.set_result(fn(self.engine))
            except BaseException as e:  # noqa: BLE001 - handed back to the caller
                future.set_exception(e)

        self._commands.put(command)
        return await asyncio.wrap_future(future)

    async def call_now(self, fn: Callable[[LLMEngine], T]) -> T:
        """Run a thread-safe engine method now, from a worker thread, without waiting for the current step."""
        return await asyncio.to_thread(fn, self.engine)

    def open(self, request_id: str) -> asyncio.Queue[StepOutput | Exception]:
        """A queue receiving every step output of ``request_id``."""
        if request_id in self._outputs:
            raise ValueError(f"request id {request_id!r} is already in flight on this worker")
        q: asyncio.Queue[StepOutput | Exception] = asyncio.Queue()
        self._outputs[request_id] = q
        return q

    def close(self, request_id: str) -> None:
        """Stop routing outputs of ``request_id``."""
        self._outputs.pop(request_id, None)

    def _run(self) -> None:
        while self._run_commands(wait=not self.engine.has_unfinished_requests()):
            if self.engine.has_unfinished_requests():
                self._step()

    def _run_commands(self, wait: bool) -> bool:
        """Run queued commands (waiting a while for one when idle); False once stop() was called."""
        try:
            command = self._commands.get(timeout=0.5) if wait else self._commands.get_nowait()
        except queue.Empty:
            return True
        while command is not None:
            command()
            try:
                command = self._commands.get_nowait()
            except queue.Empty:
                return True
        return False

    def _step(self) -> None:
        start = time.perf_counter()
        try:
            outputs: list[StepOutput] | Exception = self.engine.step()
        except Exception as e:  # noqa: BLE001 - fail the requests in flight, keep the worker alive
            log.exception("engine step failed; aborting the requests in flight")
            outputs = e
        seconds = time.perf_counter() - start
        if self.on_step is not None and not isinstance(outputs, Exception):
            self.on_step(self.engine.last_step, seconds)
        if self._aloop is not None:
            self._aloop.call_soon_threadsafe(self._dispatch, outputs)

    def _dispatch(self, outputs: list[StepOutput] | Exception) -> None:
        if isinstance(outputs, Exception):
            for request_id, q in list(self._outputs.items()):
                self._commands.put(functools.partial(self.engine.abort, request_id))
                q.put_nowait(outputs)
            return
        for out in outputs:
            target = self._outputs.get(out.request_id)
            if target is not None:
                target.put_nowait(out)


async def next_output(q: asyncio.Queue[StepOutput | Exception]) -> StepOutput:
    """The next step output of a request; raises if the engine failed while running it."""
    out = await q.get()
    if isinstance(out, Exception):
        raise RuntimeError(f"engine step failed: {out}") from out
    return out
