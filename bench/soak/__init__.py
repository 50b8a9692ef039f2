"""``python -m bench.soak.run``: a bounded soak benchmark against a local cluster.

``probe`` reads RSS and open file descriptors of the cluster's processes (``/proc``) and the free KV
blocks of its workers (``Worker/GetLoad``); ``report`` holds the pure parts (latency per time window,
resource deltas, the verdict, the markdown and the plot); ``run`` wires the flags, the cluster, the
sampler thread and ``bench.serve``'s open-loop runner.
"""
