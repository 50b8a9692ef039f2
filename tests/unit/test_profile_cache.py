"""The kept start-up profile: reused only when nothing it was measured on changed."""

from __future__ import annotations

import json
import os

from services.common.config import load_config
from services.worker.profiling import cache as profile_cache
from services.worker.profiling.refiner import CostRefiner

PREFILL = [(16, 256.0, 0.01), (256, 65536.0, 0.1)]
DECODE = [(1, 64, 0.02), (8, 512, 0.03)]


def setup(tmp_path, *overrides):
    model = tmp_path / "model"
    model.mkdir(exist_ok=True)
    for name in ("config.json", "model.safetensors"):
        if not (model / name).exists():
            (model / name).write_text("{}")
    config = load_config(None, [f'model.path="{model}"', f'engine.profile_cache_dir="{tmp_path / "kept"}"',
                                *overrides])  # fmt: skip
    return config, profile_cache.fingerprint(config, "prefill", config.prefill)


def test_a_kept_profile_comes_back_for_the_same_fingerprint_only(tmp_path):
    config, key = setup(tmp_path)
    assert profile_cache.load(config, key) is None  # nothing kept yet
    profile_cache.save(config, key, CostRefiner(PREFILL, DECODE))
    kept = profile_cache.load(config, key)
    assert kept is not None and kept.prefill_profile == PREFILL and kept.decode_profile == DECODE
    assert profile_cache.fingerprint(config, "prefill", config.prefill) == key  # stable across calls
    blocks = (f"{pool}.prefix_cache_block_size=32" for pool in ("prefill", "decode", "colocated"))
    for changed in (setup(tmp_path, *blocks)[1],
                    setup(tmp_path, "prefill.torch_threads=2")[1], setup(tmp_path, 'model.dtype="bfloat16"')[1],
                    profile_cache.fingerprint(config, "decode", config.prefill)):  # fmt: skip
        assert changed != key and profile_cache.load(config, changed) is None
    weights = tmp_path / "model" / "model.safetensors"
    os.utime(weights, ns=(1, 1))  # new weights (same size): another model
    assert profile_cache.load(config, profile_cache.fingerprint(config, "prefill", config.prefill)) is None


def test_a_damaged_or_foreign_file_is_ignored_and_a_read_only_place_costs_only_the_reuse(tmp_path, caplog):
    config, key = setup(tmp_path)
    profile_cache.save(config, key, CostRefiner(PREFILL, DECODE))
    (kept,) = (tmp_path / "kept").iterdir()
    kept.write_text("{not json")
    assert profile_cache.load(config, key) is None and "ignoring the kept profile" in caplog.text
    kept.write_text(json.dumps({"fingerprint": {"other": 1}, "prefill": PREFILL, "decode": DECODE}))
    assert profile_cache.load(config, key) is None
    blocked, _ = setup(tmp_path, f'engine.profile_cache_dir="{kept}/below-a-file"')
    profile_cache.save(blocked, key, CostRefiner(PREFILL, DECODE))  # logs, never raises
    assert "could not keep the start-up profile" in caplog.text
    off, _ = setup(tmp_path, 'engine.profile_cache_dir=""')
    profile_cache.save(off, key, CostRefiner(PREFILL, DECODE))
    assert profile_cache.load(off, key) is None
