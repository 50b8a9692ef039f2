"""The trace slice the scale benchmarks replay: a Mooncake trace's first requests, outputs capped.

Pure standard library, so that benchmarks running in another virtual environment (Dynamo's replay) cut
the same slice.
"""

from __future__ import annotations

import json
from pathlib import Path


def write_slice(trace: Path, limit: int, max_output: int, path: Path) -> int:
    """The first ``limit`` requests with outputs capped at ``max_output`` tokens, written to ``path``; the count."""
    lines: list[str] = []
    with trace.open() as f:
        for line in f:
            if len(lines) >= limit:
                break
            if line.strip():
                row = json.loads(line)
                row["output_length"] = max(1, min(int(row["output_length"]), max_output))
                lines.append(json.dumps(row))
    path.write_text("\n".join(lines) + "\n")
    return len(lines)
