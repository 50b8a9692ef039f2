"""The committed neighbours results (bench/results/neighbours) say what their JSON says."""

import json
from pathlib import Path

import pytest

RESULTS = Path(__file__).resolve().parents[2] / "bench" / "results" / "neighbours"
RUNS = {"": "python -m bench.serve.neighbours", "flood": "python -m bench.serve.neighbours --hostile-rate 0"}


@pytest.mark.parametrize("folder", list(RUNS))
def test_each_run_names_clean_code_its_command_and_its_tables(folder):
    record = json.loads((RESULTS / folder / "neighbours.json").read_text())
    assert record["code"] and "uncommitted" not in record["code"]
    assert record["command"].startswith(RUNS[folder])
    assert record["verdict"]["refused"]
    markdown = (RESULTS / folder / "neighbours.md").read_text()
    assert record["verdict"]["line"] in markdown


def test_readme_numbers_come_from_the_json():
    readme = " ".join((RESULTS / "README.md").read_text().split())
    for folder in RUNS:
        record = json.loads((RESULTS / folder / "neighbours.json").read_text())
        verdict = record["verdict"]
        hostile = [p for p in record["phases"] if p["phase"].startswith("hostile")]
        rates = [len(p["answers"]) / p["wall_s"] for p in hostile]
        quiet = verdict["quiet_p99_ms"]
        claims = [
            record["code"],
            ", ".join(f"{v:.1f}" for v in verdict["hostile_p99_ms"]),
            f"{min(quiet):.1f}-{max(quiet):.1f} ms",
            f"bound {verdict['bound_ms']:.1f} ms",
            f"{min(rates):.1f}-{max(rates):.1f}",
            f"{sum(len(p['answers']) for p in hostile)} hostile requests"
            if not folder
            else f"{sum(len(p['answers']) for p in hostile)} hostile requests were refused",
        ]
        for claim in claims:
            assert claim in readme, f"README.md ({folder or 'default'}) lacks {claim!r}"
