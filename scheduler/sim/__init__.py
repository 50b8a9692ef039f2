"""A discrete-event simulator that drives the live Conductor policy against simulated instances.

The simulator imports ``scheduler.policy``, ``scheduler.cost_model`` and ``scheduler.kv_index`` and runs
them unchanged; only the instances (prefill FIFO with an LRU prefix cache, continuously batched decode,
colocated prefill+decode) and the clock are simulated. One concept per module:

- ``trace``: the Mooncake trace format (512-token hash blocks)
- ``profiles``: cost-model coefficients, measured or derived from an analytic GPU model
- ``prefix_cache``: one instance's LRU cache of KV blocks, with the events it sends to the KV index
- ``prefill_instance``, ``decode_instance``: the simulated workers (a decode instance with a prefill
  queue is the colocated worker)
- ``simulator``: the event loop that asks the policy and books its plans
- ``metrics``: TTFT / TBT / SLO summaries of a run
"""
