"""What the fuzz suites share: the bounded, reproducible hypothesis settings and the test model's limits."""

import os

from hypothesis import HealthCheck, settings

# `make test` runs 25 examples per test; `make fuzz` sets KVCONDUCTOR_FUZZ_EXAMPLES higher.
EXAMPLES = int(os.environ.get("KVCONDUCTOR_FUZZ_EXAMPLES", "25"))
FUZZ = settings(
    max_examples=EXAMPLES,
    deadline=None,
    derandomize=True,
    database=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture],
)
MODEL = "tiny-llama"
CONTEXT = 4096  # the test model's context length, tokens
VOCAB = 261  # 256 bytes + special tokens
MAX_NEW = 4  # max_tokens of requests that may be valid: no example runs long
