"""Prefill-choice rules: Algorithm 1's least predicted TTFT, the baselines, and the peers' published rules.

Every rule sees the same per-candidate estimates (``PrefillEstimate``: T_queue, T_transfer, T_prefill,
T_send) and candidates (``PrefillCandidate``: prefix_len, in-flight load) and returns one estimate; the
decode choice and SLO admission around it are the policy's, the same for every rule. Only Algorithm 1
plans KV copies (``copies``). Selectable live and in the simulator by ``[scheduler] policy``.

- ``kvcache_centric``: least predicted TTFT (Mooncake FAST'25, Algorithm 1); on colocated instances the
  cost adds the request's decode time there and the delay it imposes on the requests decoding there
  (``policy.shared_delay``).
- ``round_robin``, ``random``, ``least_loaded`` (least T_queue), ``cache_aware`` (longest prefix, then T_queue).
- ``dynamo`` (NVIDIA Dynamo's KV router): ``cost = prefill_load_scale * max(prefill_blocks - overlap, 0)``,
  lowest wins, ties at random. ``prefill_blocks`` is the request's prompt blocks plus the blocks still to
  compute for the requests in flight on the worker; ``overlap`` the request's blocks the worker holds
  (decode blocks count 0: Dynamo's prefill router runs without active-block tracking).
- ``sglang`` (SGLang router, cache-aware): load = requests in flight. When the cluster is imbalanced
  (``max - min > 64`` and ``max > 1.5 * min``) the least-loaded worker wins; else the longest prefix match
  if it covers over 30% of the prompt; else the least-loaded worker. (The real router matches against its
  own approximate radix tree of what it routed; here it sees the workers' true caches.)
"""

from __future__ import annotations

import itertools
import math
import random
from collections.abc import Callable, Sequence
from typing import Protocol

from scheduler.candidates import PrefillCandidate, PrefillEstimate, RequestShape


class PrefillRule(Protocol):
    """Chooses the prefill instance among the estimates."""

    copies: bool  # whether KV-copy plans are considered
    explanation: str  # how the choice is described in a decision's reason ("{shared}": on colocated instances)

    def choose(
        self, estimates: Sequence[PrefillEstimate], candidates: Sequence[PrefillCandidate], request: RequestShape
    ) -> PrefillEstimate:
        """One of ``estimates`` (same order as ``candidates``)."""


class KvCacheCentric:
    """Least predicted TTFT (colocated: plus the decode time shared there); ties to the longer prefix, then the id."""

    copies = True
    explanation = "least predicted TTFT{shared}"

    def choose(  # noqa: D102
        self, estimates: Sequence[PrefillEstimate], candidates: Sequence[PrefillCandidate], request: RequestShape
    ) -> PrefillEstimate:
        return min(estimates, key=lambda e: (e.cost, -e.prefix_len, e.instance_id))


class RoundRobin:
    """Each instance in turn."""

    copies = False
    explanation = "round-robin turn"

    def __init__(self) -> None:
        self._turn = itertools.count()

    def choose(  # noqa: D102
        self, estimates: Sequence[PrefillEstimate], candidates: Sequence[PrefillCandidate], request: RequestShape
    ) -> PrefillEstimate:
        return estimates[next(self._turn) % len(estimates)]


class RandomChoice:
    """Uniformly at random (seeded)."""

    copies = False
    explanation = "random choice"

    def __init__(self, seed: int = 0) -> None:
        self._rng = random.Random(seed)

    def choose(  # noqa: D102
        self, estimates: Sequence[PrefillEstimate], candidates: Sequence[PrefillCandidate], request: RequestShape
    ) -> PrefillEstimate:
        return self._rng.choice(list(estimates))


class LeastLoaded:
    """Least T_queue."""

    copies = False
    explanation = "least T_queue"

    def choose(  # noqa: D102
        self, estimates: Sequence[PrefillEstimate], candidates: Sequence[PrefillCandidate], request: RequestShape
    ) -> PrefillEstimate:
        return min(estimates, key=lambda e: (e.t_queue, e.instance_id))


class CacheAware:
    """Longest cached prefix (what the instance's cache holds now), then least T_queue."""

    copies = False
    explanation = "longest cached prefix"

    def choose(  # noqa: D102
        self, estimates: Sequence[PrefillEstimate], candidates: Sequence[PrefillCandidate], request: RequestShape
    ) -> PrefillEstimate:
        pairs = zip(estimates, candidates, strict=True)
        return min(pairs, key=lambda ec: (-ec[1].cached, ec[0].t_queue, ec[0].instance_id))[0]


class Dynamo:
    """Dynamo's KV-router cost, lowest wins (ties at random, seeded)."""

    copies = False
    explanation = "Dynamo's KV-router cost"

    def __init__(self, seed: int = 0, prefill_load_scale: float = 1.0) -> None:
        self._rng = random.Random(seed)
        self.prefill_load_scale = prefill_load_scale

    def choose(  # noqa: D102
        self, estimates: Sequence[PrefillEstimate], candidates: Sequence[PrefillCandidate], request: RequestShape
    ) -> PrefillEstimate:
        request_blocks = math.ceil(request.num_prompt_tokens / request.block_size)

        def cost(p: PrefillCandidate) -> float:
            queued = math.ceil(p.queued_new_tokens / request.block_size)
            # its overlap comes from the workers' KV events: blocks cached now, not those queued prompts will leave
            return self.prefill_load_scale * max(request_blocks + queued - p.cached // request.block_size, 0)

        costs = [cost(p) for p in candidates]
        lowest = min(costs)
        return self._rng.choice([e for e, c in zip(estimates, costs, strict=True) if c == lowest])


class Sglang:
    """SGLang router's cache-aware rule.

    Its approximate tree takes each prompt in when it routes it, so a queued prompt's prefix counts (``prefix_len``).
    """

    copies = False
    explanation = "SGLang's cache-aware rule"

    def __init__(self, balance_abs: int = 64, balance_rel: float = 1.5, cache_threshold: float = 0.3) -> None:
        self.balance_abs, self.balance_rel, self.cache_threshold = balance_abs, balance_rel, cache_threshold

    def choose(  # noqa: D102
        self, estimates: Sequence[PrefillEstimate], candidates: Sequence[PrefillCandidate], request: RequestShape
    ) -> PrefillEstimate:
        pairs = list(zip(estimates, candidates, strict=True))
        least = min(pairs, key=lambda ec: ec[1].in_flight)[0]
        loads = [c.in_flight for c in candidates]
        if max(loads) - min(loads) > self.balance_abs and max(loads) > self.balance_rel * min(loads):
            return least
        best, candidate = max(pairs, key=lambda ec: ec[1].prefix_len)
        return best if candidate.prefix_len / request.num_prompt_tokens > self.cache_threshold else least


RULES: dict[str, Callable[[int], PrefillRule]] = {
    "kvcache_centric": lambda seed: KvCacheCentric(),
    "round_robin": lambda seed: RoundRobin(),
    "random": lambda seed: RandomChoice(seed),
    "least_loaded": lambda seed: LeastLoaded(),
    "cache_aware": lambda seed: CacheAware(),
    "dynamo": lambda seed: Dynamo(seed),
    "sglang": lambda seed: Sglang(),
}
