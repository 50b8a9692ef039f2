"""Bounds on what one client request may ask of the Conductor, checked before any work is done for it.

Everything a client sizes is bounded here or by the model: prompt bytes (a text prompt is tokenized on a
thread), stop strings (count and bytes: each is scanned for at every token on the Conductor's loop), stop token
ids, and the client's request id (a label). Prompt tokens and max_tokens are bounded by the context length in
admission. The gRPC message itself is bounded by the server's receive limit (4 MiB). A request beyond a bound
gets INVALID_ARGUMENT naming the ``[scheduler]`` key that sets it (HTTP 400 through the gateway).
"""

from __future__ import annotations

from kvconductor.v1 import conductor_pb2
from services.common.config import SchedulerConfig


def check_limits(request: conductor_pb2.GenerateRequest, limits: SchedulerConfig) -> None:
    """Raise ValueError (INVALID_ARGUMENT) naming the first bound ``request`` exceeds."""
    _at_most(len(request.request_id.encode()), limits.max_request_id_bytes, "request id bytes", "max_request_id_bytes")
    if request.WhichOneof("prompt") == "text":
        _at_most(len(request.text.encode()), limits.max_prompt_bytes, "prompt bytes", "max_prompt_bytes")
    _at_most(len(request.stop), limits.max_stop_strings, "stop strings", "max_stop_strings")
    for stop in request.stop:
        _at_most(len(stop.encode()), limits.max_stop_bytes, "bytes in a stop string", "max_stop_bytes")
    _at_most(len(request.sampling.stop_token_ids), limits.max_stop_token_ids, "stop token ids", "max_stop_token_ids")


def _at_most(value: int, bound: int, what: str, key: str) -> None:
    if value > bound:
        raise ValueError(f"{value} {what} exceed the limit of {bound} ([scheduler] {key})")
