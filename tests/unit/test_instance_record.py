"""The etcd record: a worker's record survives JSON, and a malformed one names what is wrong."""

import dataclasses
import json

import pytest

from scheduler.cost_model import DecodeModel, PrefillModel
from services.common.instance_record import CostModels, InstanceRecord, KVShape, RecordError, WorkerRecord

WORKER = WorkerRecord(
    role="prefill", instance_id="prefill-0", address="127.0.0.1:5000", metrics_address="127.0.0.1:5001",
    model="tiny-llama", transfer_endpoint="127.0.0.1:5002", block_size=16, num_blocks=100, max_model_len=2048,
    vocab_size=256, max_num_batched_tokens=512, max_concurrent_requests=8,
    kv_layout=KVShape(num_layers=2, num_kv_heads=2, head_dim=16, dtype="float32", bytes_per_block=8192),
    cost_model=CostModels(PrefillModel(1e-3, 2e-5, 3e-9), DecodeModel(4e-3, 5e-5, 6e-8),
                          (PrefillModel(1e-3, 1e-5, 0.0), DecodeModel(4e-3, 0.0, 0.0))),
    engine="vllm", kv_bootstrap="http://127.0.0.1:5003",
)  # fmt: skip


def test_worker_record_round_trips_through_json():
    data = json.loads(json.dumps(WORKER.to_json()))
    assert data["cost_model"]["profile"]["prefill"] == {"c0": 1e-3, "c1": 1e-5, "c2": 0.0}
    assert data["kv_layout"]["bytes_per_block"] == 8192
    assert InstanceRecord.from_json(data) == WORKER
    # A vLLM prefill worker exports and imports prefixes through its KV connector (it has a bootstrap server);
    # a vLLM worker without one (colocated) takes part in no copy.
    assert WORKER.exports_kv and WORKER.moves_kv_itself
    assert not dataclasses.replace(WORKER, kv_bootstrap="").exports_kv


def test_other_roles_are_plain_records():
    record = InstanceRecord("kvmeta", "kvmeta-0", "127.0.0.1:6000")
    assert InstanceRecord.from_json(record.to_json()) == record
    assert type(InstanceRecord.from_json(record.to_json())) is InstanceRecord


@pytest.mark.parametrize(
    ("drop", "message"),
    [("num_blocks", "without 'num_blocks'"), ("cost_model", "without 'cost_model'"), ("address", "without 'address'")],
)
def test_a_missing_key_is_named(drop, message):
    data = WORKER.to_json()
    del data[drop]
    with pytest.raises(RecordError, match=message):
        InstanceRecord.from_json(data)


def test_a_malformed_value_is_an_error_not_a_crash():
    data = WORKER.to_json()
    data["kv_layout"] = {"num_layers": 2}
    with pytest.raises(RecordError, match="malformed"):
        InstanceRecord.from_json(data)
    data = WORKER.to_json() | {"num_blocks": "many"}
    with pytest.raises(RecordError, match="malformed"):
        InstanceRecord.from_json(data)
    with pytest.raises(RecordError, match="JSON object"):
        InstanceRecord.from_json([1, 2])
