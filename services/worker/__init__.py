"""The engine worker process (prefill, decode or colocated), by concern.

The services at this level (``prefill.py``, ``decode.py``, ``colocated.py`` over ``worker.py``, started by
``main.py``; ``ledger.py`` holds what the Conductors booked) use three subpackages: ``engines/`` (the
``EnginePort`` and its adapters), ``kv/`` (the KV data plane) and ``profiling/`` (the cost models).
"""
