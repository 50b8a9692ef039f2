"""The colocated worker: prefill and decode in one engine, the non-disaggregated baseline.

Prefill chunks and decode steps of different requests share one engine loop, so a long prompt stalls
the decode steps of everyone else: the interference that disaggregation removes. Beside prefill workers
(conditional disaggregation, ``scheduler/disaggregation.py``) it also serves ``Decode``: a request the
Conductor chose to prefill on a prefill worker has its KV written into blocks reserved here and decodes here.
"""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator
from typing import Any

from kvconductor.v1 import colocated_pb2, colocated_pb2_grpc, common_pb2
from services.common.rpc import Service
from services.worker import decode
from services.worker.worker import Worker, sampling_from_proto, token_chunk


class ColocatedServicer(colocated_pb2_grpc.ColocatedServicer):
    """``Colocated.Generate``."""

    def __init__(self, worker: Worker) -> None:
        self.worker = worker

    async def Generate(  # noqa: N802
        self, request: colocated_pb2.ColocatedRequest, context: Any
    ) -> AsyncIterator[common_pb2.TokenChunk]:
        """Prefill and decode one request, streaming tokens (cached prompt tokens on the first chunk)."""
        w, rid = self.worker, request.request_id
        prompt, params = list(request.prompt_token_ids), sampling_from_proto(request.sampling)
        first = True
        with w.ledger.holding(rid, request.booking):
            async with contextlib.aclosing(w.engine.generate(rid, prompt, params)) as outputs:
                async for out in outputs:
                    if out.new_token_ids:
                        w.ledger.prefill_done(rid)
                        w.ledger.produced(rid, len(out.new_token_ids))
                    if out.new_token_ids or out.finished:
                        yield token_chunk(list(out.new_token_ids), out.finish_reason,
                                          out.num_cached_tokens if first else 0)  # fmt: skip
                    if first:  # the prompt's blocks are cached now: let the Conductor see them
                        await w.publish_kv_events()
                        first = False


def services(worker: Worker) -> tuple[list[Service], decode.DecodeServicer]:
    """Everything a colocated worker serves (``Colocated``, ``Decode``, ``Worker``), and its decode servicer.

    The caller runs the servicer's expiry task.
    """
    colocated = Service(
        "kvconductor.v1.Colocated",
        ColocatedServicer(worker),
        colocated_pb2_grpc.add_ColocatedServicer_to_server,
    )
    decoding, decoder = decode.services(worker)
    return [colocated, *decoding], decoder
