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


def test_the_heartbeat_leaves_out_the_fields_at_their_default():
    groups = (TaskGroup("inc", 1, 2), TaskGroup("sum", 3, 4))
    d = DeviceSample(current_bytes=5, measured="pool", task_groups=groups)
    sent = d.to_dict(defaults=False)
    # rows flat: one list to decode and bound, not one a row
    assert sent == {
        "measured": "pool",
        "current_bytes": 5,
        "task_groups": ["inc", 1, 2, "sum", 3, 4],
    }
    assert DeviceSample.from_dict(sent) == d
    assert d.to_dict()["task_groups"] == [["inc", 1, 2], ["sum", 3, 4]]  # the report's rows
    # Empty lists as well as tuples, False as 0; fields it does not know are kept.
    assert wire.compact({"libraries": (), "paused": False, "samples": b"", "x": 0}) == {"x": 0}
