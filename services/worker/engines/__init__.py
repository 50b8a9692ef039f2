"""Engine adapters: the one port a worker uses (``port.py``) and the engines behind it.

``builtin.py`` runs the built-in torch engine (and the emulated one) on its own thread (``loop.py``);
``vllm_*.py`` run vLLM's AsyncLLM (``vllm_start.py`` builds it; ``vllm_connector.py`` is loaded inside vLLM's
processes). The worker's services never import an adapter's internals, only ``EnginePort``.
"""
