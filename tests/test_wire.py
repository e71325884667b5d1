"""dask_rmm.wire: the one definition of the heartbeat and report fields."""

from __future__ import annotations

import dataclasses

from dask_rmm import wire
from dask_rmm.wire import DeviceSample, TaskGroup


def test_round_trip_and_defaults():
    d = DeviceSample(
        resource="Pool",
        current_bytes=5,
        reserved_bytes=200,
        pool_free_bytes=100,
        largest_free_block=25,
        retired_bytes=7,
        gpu_name="NVIDIA H200",
        task_groups=(TaskGroup("inc", 1, 2),),
    )
    data = d.to_dict()
    assert data["fragmentation"] == 0.75 and data["task_groups"] == [["inc", 1, 2]]
    assert DeviceSample.from_dict(data) == d
    assert DeviceSample.from_dict({}) == DeviceSample()
    idle = DeviceSample(reserved_bytes=200, pool_free_bytes=200, largest_free_block=100)
    assert idle.to_dict()["fragmentation"] is None  # none of the pool in use: no figure
    assert DeviceSample.from_dict(idle.to_dict()) == idle


def test_readers_tolerate_unknown_missing_and_malformed_fields():
    d = DeviceSample.from_dict(
        {"current_bytes": "12", "peak_bytes": None, "future_field": 1, "task_groups": [["x"], 3]}
    )
    assert (d.current_bytes, d.peak_bytes, d.task_groups) == (12, 0, ())


def test_every_field_is_on_the_wire_and_counters_are_ints():
    names = {f.name for f in dataclasses.fields(DeviceSample)}
    assert names - {"error"} <= set(DeviceSample().to_dict())
    assert all(isinstance(getattr(DeviceSample(), n), int) for n in wire.COUNTERS)
    assert {g[0] for g in wire.GAUGES} <= set(wire.COUNTERS)
    assert all(g[1].startswith("dask_rmm_") and g[3] in ("gauge", "counter") for g in wire.GAUGES)


def test_heartbeat_envelope():
    hb = wire.heartbeat("w0", 1.5, {"0": DeviceSample().to_dict()})
    assert hb["version"] == wire.METRICS_VERSION and hb["worker"] == "w0" and "0" in hb["devices"]


def test_the_heartbeat_sends_the_devices_as_columns_and_reads_them_back():
    """A column a field, whatever the devices (numbers packed, text, rows, samples), through
    msgpack as distributed's comm sends it; what is no column goes in ``other``."""
    import struct

    import msgpack

    groups = (TaskGroup("inc", 1, 2), TaskGroup("sum", 3, 4))
    a = DeviceSample(current_bytes=5, spill_seconds=0.5, gpu_name="H200", task_groups=groups)
    b = DeviceSample(measured="pool", reserved_bytes=2**62, oom_events=({"time": 1.0},))
    devices = {"0": a.to_dict() | {"samples": b"x" * 24}, "1": b.to_dict()}
    hb = wire.heartbeat("w0", 1.5, devices)
    assert hb["devices"] == ["0", "1"] and len(hb["numbers"]) == 2 * wire.NUMBERS_STRUCT.size
    assert hb["task_groups"] == [[2, 0], ["inc", "sum"], struct.pack("<4q", 1, 2, 3, 4)]
    assert "libraries" not in hb and hb["other"] == {"1": {"oom_events": [{"time": 1.0}]}}
    back = wire.device_entries(msgpack.unpackb(msgpack.packb(hb), use_list=False))
    assert [DeviceSample.from_dict(d) for d in back.values()] == [a, b]
    assert back["0"]["samples"] == b"x" * 24 and "pool_free_bytes" not in back["0"]
    # A worker's heartbeat never raises: what is no number, or beyond int64, sends 0 or the limit.
    junk = {"current_bytes": "x", "peak_bytes": 2**70, "spill_seconds": None, "task_groups": 7}
    (back,) = wire.device_entries(wire.heartbeat("w", 1.0, {"0": junk})).values()
    assert back["peak_bytes"] == 2**63 - 1 and "current_bytes" not in back
    assert wire.device_entries(None) == {} == wire.device_entries({"devices": {}})
