"""pytest imports test files by basename (rootdir-relative without packages): two with one name break collection."""

from __future__ import annotations

import collections
from pathlib import Path

TESTS = Path(__file__).resolve().parents[1]


def test_no_two_test_files_share_a_basename():
    names = collections.Counter(p.name for p in TESTS.rglob("test_*.py"))
    assert not [n for n, count in names.items() if count > 1], names.most_common(3)
