"""Engine benchmark: prefill and decode throughput against transformers on the same checkpoint."""
