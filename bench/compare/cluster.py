"""The two deployments `bench compare` sets side by side: the same two worker processes, one torch thread each."""

COLOCATED = ("prefill.node_count=0", "decode.node_count=0", "colocated.node_count=2")
DISAGGREGATED = ("prefill.node_count=1", "decode.node_count=1", "colocated.node_count=0")
