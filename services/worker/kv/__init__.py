"""The worker's KV data plane: bytes between instances and the index that says where they are.

``transfer.py`` (the Mooncake Transfer Engine, kept on ``[cluster] host`` by ``bind_guard.py``), ``stream.py``
(prompt KV to a decode worker chunk by chunk), ``copy.py`` (a cached prefix from a peer or the Store),
``store.py`` (the Mooncake Store tier), ``events.py`` (blocks stored / evicted, to kvmeta) and
``zmq_events.py`` (the same events in vLLM's ZMQ format).
"""
