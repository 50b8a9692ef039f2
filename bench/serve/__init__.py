"""``kvconductor bench serve``: streaming load against any OpenAI-compatible base URL.

``workloads`` builds the requests (shared prefix, random lengths, Mooncake trace replay), ``client``
streams one request and times it, ``runner`` paces the arrivals (closed loop, Poisson, trace
timestamps), ``metrics`` summarizes, and ``cli`` wires the flags. ``neighbours`` (``python -m
bench.serve.neighbours``) times streams beside hostile requests (issue 27's bounds) against quiet runs.
"""
