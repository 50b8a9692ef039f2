"""Shared by every kind of test: the kind (unit, integration, e2e) is the folder, and one test model per session.

``pytest tests/unit`` or ``pytest -m unit`` select a kind; the markers come from the folders.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")
KINDS = ("unit", "integration", "e2e")


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """Mark every test with its kind, the name of its folder."""
    for item in items:
        kind = item.path.parent.name
        assert kind in KINDS, f"{item.path}: tests live in tests/unit, tests/integration or tests/e2e"
        item.add_marker(getattr(pytest.mark, kind))


@pytest.fixture(scope="session")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The default model (what `make run` generates), made once."""
    import torch

    from engine.checkpoint import make_model

    torch.set_num_threads(1)
    path = tmp_path_factory.mktemp("model") / "tiny-llama"
    make_model(path)
    return path
