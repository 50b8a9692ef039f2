"""Runs an LLMEngine on its own thread and connects it to asyncio handlers.

The engine is single-threaded: only the engine thread touches it. Handlers submit commands
(``call``) that run between steps, and read each request's step outputs from a per-request
asyncio queue (``open``/``close``). The thread steps while any request is unfinished and sleeps
on the command queue otherwise, so an idle worker burns no CPU.

Invariants:

* A caller cannot hurt the engine thread. A command always runs once submitted (a handler that is
  cancelled while its ``abort`` is queued still frees the blocks); its result goes back through the
  event loop, which drops it when the caller has gone.
* The thread beats (``heartbeat``, ``beats``) on every loop turn, idle turns included (at least every
  ``IDLE_WAIT_S``), so a frozen engine shows as a stale heartbeat while the process looks alive.
* Any exception on the engine thread is fatal: the loop marks itself dead, every request in flight
  and every pending command fails with :class:`EngineDied`, and ``died`` resolves, which the worker
  answers by leaving the cluster and exiting (its requests resume elsewhere).
"""

from __future__ import annotations

import asyncio
import logging
import queue
import threading
import time
from collections.abc import Callable
from typing import Any, TypeVar

import grpc

from engine.llm_engine import LLMEngine, StepOutput
from services.common.rpc import RpcError

log = logging.getLogger(__name__)
T = TypeVar("T")
IDLE_WAIT_S = 0.5  # an idle engine thread wakes (and beats) this often
FAULTS = ("raise", "freeze", "thaw")


class EngineDied(RpcError):
    """The engine thread is gone: UNAVAILABLE, so the Conductor resumes the request on another worker."""

    def __init__(self, cause: BaseException) -> None:
        super().__init__(grpc.StatusCode.UNAVAILABLE, f"engine thread died: {type(cause).__name__}: {cause}")


class EngineLoop:
    """An engine thread plus the plumbing from its step outputs to asyncio queues."""

    def __init__(
        self, engine: LLMEngine, on_step: Callable[[tuple[tuple[int, int], ...], float], None] | None = None
    ) -> None:
        self.engine = engine
        self.on_step = on_step  # called on the engine thread with each step's shape and duration
        self.heartbeat = time.monotonic()  # last turn of the engine loop
        self.beats = 0  # turns of the engine loop so far
        self.failure: BaseException | None = None
        self.died: asyncio.Future[BaseException] | None = None  # resolves when the engine thread dies
        self._commands: queue.Queue[Callable[[], None] | None] = queue.Queue()
        self._pending: set[asyncio.Future[Any]] = set()  # results of submitted commands not yet delivered
        self._outputs: dict[str, asyncio.Queue[StepOutput | Exception]] = {}
        self._aloop: asyncio.AbstractEventLoop | None = None
        self._thaw = threading.Event()
        self._thaw.set()
        self._fault = ""  # test-only fault to act on at the next turn: "raise" or "freeze"
        self._thread = threading.Thread(target=self._run, name="engine", daemon=True)

    def start(self) -> None:
        """Start the engine thread; call from the event loop that will consume outputs."""
        self._aloop = asyncio.get_running_loop()
        self.died = self._aloop.create_future()
        self._thread.start()

    def stop(self) -> None:
        """Stop the engine thread after the current step."""
        self._thaw.set()
        self._commands.put(None)
        self._thread.join(timeout=10)

    def heartbeat_age(self) -> float:
        """Seconds since the engine loop last turned."""
        return time.monotonic() - self.heartbeat

    async def call(self, fn: Callable[[LLMEngine], T]) -> T:
        """Run ``fn(engine)`` on the engine thread and return its result (or raise its exception).

        ``fn`` runs even if the caller is cancelled meanwhile: cleanup such as ``abort`` is never lost.
        """
        if self.failure is not None:
            raise EngineDied(self.failure)
        assert self._aloop is not None, "EngineLoop.start() was not called"
        result: asyncio.Future[T] = self._aloop.create_future()
        self._pending.add(result)
        result.add_done_callback(self._pending.discard)

        def command() -> None:
            try:
                value, error = fn(self.engine), None
            except Exception as e:  # noqa: BLE001 - handed back to the caller
                value, error = None, e
            self._post(_settle, result, value, error)

        self._commands.put(command)
        return await result

    async def call_now(self, fn: Callable[[LLMEngine], T]) -> T:
        """Run a thread-safe engine method now, from a worker thread, without waiting for the current step."""
        if self.failure is not None:
            raise EngineDied(self.failure)
        return await asyncio.to_thread(fn, self.engine)

    def open(self, request_id: str) -> asyncio.Queue[StepOutput | Exception]:
        """A queue receiving every step output of ``request_id``."""
        if self.failure is not None:
            raise EngineDied(self.failure)
        if request_id in self._outputs:
            raise ValueError(f"request id {request_id!r} is already in flight on this worker")
        q: asyncio.Queue[StepOutput | Exception] = asyncio.Queue()
        self._outputs[request_id] = q
        return q

    def close(self, request_id: str) -> None:
        """Stop routing outputs of ``request_id``."""
        self._outputs.pop(request_id, None)

    def inject_fault(self, kind: str) -> None:
        """Test-only: make the engine thread raise at its next turn, freeze there, or thaw (any thread)."""
        if kind not in FAULTS:
            raise ValueError(f"fault must be one of {', '.join(FAULTS)}, got {kind!r}")
        if kind == "thaw":
            self._thaw.set()
            return
        if kind == "freeze":
            self._thaw.clear()
        self._fault = kind
        self._commands.put(lambda: None)  # wake an idle thread

    # -- the engine thread ----------------------------------------------------------------------

    def _run(self) -> None:
        try:
            while self._turn():
                pass
        except BaseException as e:  # noqa: BLE001 - any death of the engine thread is the worker's death
            log.critical("engine thread died: %s: %s", type(e).__name__, e, exc_info=True)
            self.failure = e
            self._post(self._on_death, e)

    def _turn(self) -> bool:
        """One turn: commands (waiting a while when idle), then a step if there is work; False on stop()."""
        self._beat()
        if not self._run_commands(wait=not self.engine.has_unfinished_requests()):
            return False
        if self.engine.has_unfinished_requests():
            self._step()
        return True

    def _beat(self) -> None:
        self.heartbeat = time.monotonic()
        self.beats += 1
        fault, self._fault = self._fault, ""
        if fault == "raise":
            raise RuntimeError("injected engine fault")
        if fault == "freeze":
            log.warning("engine thread frozen by an injected fault")
            self._thaw.wait()

    def _run_commands(self, wait: bool) -> bool:
        """Run queued commands (waiting a while for one when idle); False once stop() was called."""
        try:
            command = self._commands.get(timeout=IDLE_WAIT_S) if wait else self._commands.get_nowait()
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
        outputs = self.engine.step()
        if self.on_step is not None:
            self.on_step(self.engine.last_step, time.perf_counter() - start)
        self._post(self._dispatch, outputs)

    def _post(self, fn: Callable[..., None], *args: Any) -> None:
        """Run ``fn(*args)`` on the event loop (from the engine thread); a closed loop is ignored."""
        if self._aloop is not None and not self._aloop.is_closed():
            self._aloop.call_soon_threadsafe(fn, *args)

    # -- the event loop ---------------------------------------------------------------------------

    def _dispatch(self, outputs: list[StepOutput]) -> None:
        for out in outputs:
            target = self._outputs.get(out.request_id)
            if target is not None:
                target.put_nowait(out)

    def _on_death(self, cause: BaseException) -> None:
        error = EngineDied(cause)
        for q in self._outputs.values():
            q.put_nowait(error)
        for result in list(self._pending):
            if not result.done():
                result.set_exception(error)
        if self.died is not None and not self.died.done():
            self.died.set_result(cause)


def _settle(result: asyncio.Future[Any], value: Any, error: BaseException | None) -> None:
    """Deliver a command's outcome unless its caller has gone."""
    if result.done():
        return
    if error is not None:
        result.set_exception(error)
    else:
        result.set_result(value)


async def next_output(q: asyncio.Queue[StepOutput | Exception]) -> StepOutput:
    """The next step output of a request; raises if the engine died while running it."""
    out = await q.get()
    if isinstance(out, Exception):
        raise out
    return out
