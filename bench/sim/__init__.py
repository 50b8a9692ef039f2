"""``python -m bench.sim.run``: the policy study; ``python -m bench.sim.overload``: the overload study."""
