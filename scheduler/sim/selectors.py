"""Peers' published prefill-routing rules, for comparison with Algorithm 1.

Each rule picks one prefill instance; the simulator then hands that single candidate to
``ConductorPolicy.schedule`` (as a no-copy baseline), so the decode choice and the SLO admission are
exactly ours and only the prefill choice differs.

- Dynamo KV router: ``cost = prefill_load_scale * max(prefill_blocks - overlap_credit, 0) + decode_blocks``,
  lowest cost wins, ties broken at random. ``prefill_blocks`` is the request's prompt blocks plus the
  blocks still to be computed for the requests queued or running on the worker; ``overlap_credit`` is
  the request's blocks the worker holds; ``decode_blocks`` is 0, because Dynamo's prefill router runs
  with active-block tracking off (prefill workers do not decode).
- SGLang router, cache-aware: load = requests in flight on the worker. When the cluster is imbalanced
  (``max_load - min_load > 64`` and ``max_load > 1.5 * min_load``) the least-loaded worker wins; else the
  worker with the longest prefix match wins if its match rate (matched / prompt tokens) exceeds 0.3;
  else the least-loaded worker. (The router matches against its own approximate radix tree of what it
  routed; here it sees the workers' true caches, which can only help it.)
"""

from __future__ import annotations

import math
import random
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from scheduler.policy import PrefillCandidate, RequestShape

PEER_RULES = ("dynamo", "sglang")


@dataclass(frozen=True)
class WorkerLoad:
    """What the peers' routers track per prefill worker."""

    in_flight: int  # requests queued or running
    queued_new_tokens: int  # tokens still to compute for them


def dynamo_select(
    prefills: Sequence[PrefillCandidate],
    request: RequestShape,
    loads: Mapping[str, WorkerLoad],
    rng: random.Random,
    prefill_load_scale: float = 1.0,
) -> PrefillCandidate:
    """Dynamo's KV-router cost, lowest wins."""
    request_blocks = math.ceil(request.num_prompt_tokens / request.block_size)

    def cost(p: PrefillCandidate) -> float:
        queued_blocks = math.ceil(loads[p.instance_id].queued_new_tokens / request.block_size)
        overlap = p.prefix_len // request.block_size
        return prefill_load_scale * max(request_blocks + queued_blocks - overlap, 0)

    costs = [cost(p) for p in prefills]
    lowest = min(costs)
    return rng.choice([p for p, c in zip(prefills, costs, strict=True) if c == lowest])


def sglang_select(
    prefills: Sequence[PrefillCandidate],
    request: RequestShape,
    loads: Mapping[str, WorkerLoad],
    balance_abs_threshold: int = 64,
    balance_rel_threshold: float = 1.5,
    cache_threshold: float = 0.3,
) -> PrefillCandidate:
    """SGLang router's cache-aware rule."""
    load = {p.instance_id: loads[p.instance_id].in_flight for p in prefills}
    least = min(prefills, key=lambda p: load[p.instance_id])
    high, low = max(load.values()), min(load.values())
    if high - low > balance_abs_threshold and high > balance_rel_threshold * low:
        return least
    best = max(prefills, key=lambda p: p.prefix_len)
    if best.prefix_len / request.num_prompt_tokens > cache_threshold:
        return best
    return least
