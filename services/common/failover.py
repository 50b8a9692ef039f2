"""A client's side of Conductor replicas: which errors mean "try another Conductor", and the request it sends there.

A stream whose Conductor fails (the process died, its link broke) goes on at another replica with the tokens
already streamed (``resume_token_ids``), so the client's stream continues without a gap or a repeat (the
new Conductor gives it ids of its own on the workers, apart from the failed attempt's). Errors that are the
request's own (INVALID_ARGUMENT, RESOURCE_EXHAUSTED, ...) would be the same anywhere and are not retried. Used
by the gateway (``services/gateway/conductors.py``) and the Python client (``cli/client.py``).
"""

from __future__ import annotations

from collections.abc import Sequence

import grpc

from kvconductor.v1 import conductor_pb2

FAILOVER = frozenset({grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.CANCELLED, grpc.StatusCode.UNKNOWN})


def failover_request(request: conductor_pb2.GenerateRequest, streamed: Sequence[int]) -> conductor_pb2.GenerateRequest:
    """``request`` as sent to the next Conductor, ``streamed`` tokens into the stream."""
    if not streamed:
        return request
    resumed = conductor_pb2.GenerateRequest()
    resumed.CopyFrom(request)
    resumed.resume_token_ids.extend(streamed)
    return resumed
