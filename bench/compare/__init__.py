"""``kvconductor bench compare``: the seed's validation procedure, colocated vs. disaggregated.

``cluster`` launches ``kvconductor up`` on free ports, ``report`` writes the side-by-side table, JSON
and PNG, and ``cli`` runs the comparison (or the one-variable-at-a-time ``--sweep``).
"""
