"""The Conductor's pools: quarantined and excluded instances out, suspects last; waiting for a worker."""

import asyncio

from scheduler.cost_model import DecodeModel, PrefillModel
from services.common.instance_record import CostModels, KVShape, WorkerRecord
from services.common.registry import InstanceEvent
from services.conductor.cluster_view import ClusterView


def _put(instance_id, port=1):
    role = instance_id.split("-")[0]
    record = WorkerRecord(
        role=role, instance_id=instance_id, address=f"127.0.0.1:{port}", block_size=16, num_blocks=64,
        kv_layout=KVShape(1, 1, 1, "float32", 1),
        cost_model=CostModels(PrefillModel(1e-3, 1e-5, 0.0), DecodeModel(1e-3, 1e-5, 0.0)),
    )  # fmt: skip
    return InstanceEvent("put", role, instance_id, record)


def _view(*instance_ids):
    view = ClusterView()
    for port, instance_id in enumerate(instance_ids, 1):
        view._apply(_put(instance_id, port))
    return view


def _ids(pool):
    return [v.instance_id for v in pool]


async def test_a_suspect_gets_no_work_while_another_instance_of_its_role_is_usable():
    view = _view("decode-0", "decode-1", "prefill-0")
    view.suspect("decode-0")
    assert _ids(view.pool("decode")) == ["decode-1"]
    assert _ids(view.pool("prefill")) == ["prefill-0"]


async def test_the_last_usable_instances_of_a_role_serve_even_when_suspect():
    view = _view("decode-0", "decode-1")
    view.suspect("decode-0")
    view.quarantine("decode-1", 60)
    assert _ids(view.pool("decode")) == ["decode-0"]  # slowly rather than not at all
    assert view.can_serve() is False  # no prefill instance at all
    view.suspect("decode-1")
    assert _ids(view.pool("decode")) == ["decode-0"]  # quarantine is still honoured


async def test_excluded_instances_are_out_even_when_the_rest_are_suspect():
    view = _view("prefill-0", "prefill-1")
    view.suspect("prefill-1")
    assert _ids(view.pool("prefill", exclude={"prefill-0"})) == ["prefill-1"]
    assert _ids(view.pool("prefill", exclude={"prefill-0", "prefill-1"})) == []


async def test_waiting_for_a_worker_ends_when_one_registers_or_a_quarantine_ends():
    view = _view("decode-0")
    assert await view.wait_for(lambda: bool(view.pool("prefill")), 0.2) is False
    asyncio.get_running_loop().call_later(0.05, view._apply, _put("prefill-0", 2))  # a lease came back
    assert await view.wait_for(lambda: bool(view.pool("prefill")), 30) is True
    view.quarantine("decode-0", 0.3)
    assert not view.pool("decode")
    assert await view.wait_for(lambda: bool(view.pool("decode")), 30) is True  # no event: the quarantine ended


async def test_a_retry_with_nowhere_else_goes_back_to_a_failed_instance_that_lives_on_after_its_quarantine():
    view = _view("decode-0", "decode-1")
    assert _ids(await view.pool_after_failures("decode", {"decode-0"}, 30)) == ["decode-1"]  # elsewhere first
    view = _view("decode-0")
    view.quarantine("decode-0", 0.3)  # it failed this request (a KV write cut short)
    assert _ids(await view.pool_after_failures("decode", {"decode-0"}, 30)) == ["decode-0"]  # once the quarantine ends
    view.quarantine("decode-0", 60)
    asyncio.get_running_loop().call_later(0.05, view._apply, InstanceEvent("delete", "decode", "decode-0", None))
    assert await view.pool_after_failures("decode", {"decode-0"}, 0.5) == []  # it died: its lease expired meanwhile


async def test_an_instance_back_after_its_lease_expired_keeps_its_channel_and_bookings():
    view = _view("decode-0")
    before = view.instances["decode-0"]
    view._apply(InstanceEvent("delete", "decode", "decode-0", None))
    assert "decode-0" not in view.instances
    view._apply(_put("decode-0", 1))  # the same process, same address: a request planned there can still call it
    after = view.instances["decode-0"]
    assert after.channel is before.channel and after.state.decoding is before.state.decoding
    view._apply(InstanceEvent("delete", "decode", "decode-0", None))
    view._apply(_put("decode-0", 9))  # another address: a new process, a new channel
    assert view.instances["decode-0"].channel is not before.channel


async def test_a_departed_instances_channel_closes_after_its_grace_and_the_view_is_forgotten(monkeypatch):
    from services.conductor import cluster_view

    monkeypatch.setattr(cluster_view, "CHANNEL_CLOSE_GRACE_S", 0.05)
    view = _view("decode-0")
    departed = view.instances["decode-0"]
    view._apply(InstanceEvent("delete", "decode", "decode-0", None))
    for _ in range(3000):  # polls for up to 30 s
        if not view._departed:
            break
        await asyncio.sleep(0.01)
    assert not view._departed
    view._apply(_put("decode-0", 1))  # back after the grace: a fresh channel, not the closed one
    assert view.instances["decode-0"].channel is not departed.channel
