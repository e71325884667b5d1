"""End to end on host memory: a LocalCluster (worker processes) with base_resource="system" and a
16 MiB pool persists 48 MiB of outputs. Without the pressure options it runs out of memory; with
``device_memory_limit`` and, separately, ``spill_on_oom`` it completes with correct results. A
request larger than the pool fails with a "demand" OOM event; built fragmentation gives
"fragmentation"."""

from __future__ import annotations

import pytest
from distributed import wait

from dask_rmm import RMMPlugin
from tests.conftest import local_process_cluster
from tests.pressure_helpers import (
    MiB,
    allocate_once,
    expected_checksum,
    fragment_then_allocate,
    make_output,
    output_checksum,
    worker_pressure_state,
)

pytestmark = pytest.mark.slow

POOL = dict(base_resource="system", pool_size="16MiB", maximum_pool_size="16MiB")
N, SIZE = 24, 2 * MiB  # 48 MiB of outputs over 2 workers: 24 MiB each, 1.5x the pool


def _workload(client, tag: str) -> None:
    keys = [f"out-{tag}-{i}" for i in range(N)]
    outputs = client.map(make_output, [SIZE] * N, range(N), key=keys)
    wait(outputs)
    sums = client.gather(client.map(output_checksum, outputs, range(N)))
    assert sums == [expected_checksum(SIZE, i) for i in range(N)]
    del outputs


def test_outputs_beyond_the_pool_fail_without_the_options_and_complete_with_them():
    from dask_rmm.mr.base import OutOfMemoryError

    with local_process_cluster() as (cluster, client):
        client.register_plugin(RMMPlugin(**POOL))
        with pytest.raises(OutOfMemoryError):
            _workload(client, "plain")
        assert not any(s["installed"] for s in client.run(worker_pressure_state).values())

        client.register_plugin(RMMPlugin(**POOL, device_memory_limit="12MiB"))
        _workload(client, "limit")
        states = client.run(worker_pressure_state).values()
        assert all(s["installed"] and s["data"] == "DeviceSpillStore" for s in states)
        assert sum(s["metrics"][0]["total_spilled_count"] for s in states) > 0
        assert all(s["metrics"][0]["device_memory_limit"] == 12 * MiB for s in states)

        # No pause: its periodic check would spill too; here only failed allocations do.
        client.register_plugin(RMMPlugin(**POOL, spill_on_oom=True, device_pause_fraction=None))
        _workload(client, "oom")
        states = client.run(worker_pressure_state).values()
        assert sum(s["metrics"][0]["ooms_avoided"] for s in states) > 0

        # Teardown gave the workers their own mapping back.
        client.register_plugin(RMMPlugin(**POOL))
        assert all(s["data"] != "DeviceSpillStore" for s in client.run(worker_pressure_state).values())


def test_oom_events_and_their_verdicts():
    from dask_rmm.mr.base import OutOfMemoryError

    with local_process_cluster() as (cluster, client):
        client.register_plugin(RMMPlugin(**POOL, spill_on_oom=True))
        with pytest.raises(OutOfMemoryError):
            client.submit(allocate_once, 17 * MiB, key="too-big-1").result()
        with pytest.raises(OutOfMemoryError):
            client.submit(fragment_then_allocate, MiB, 16, 2 * MiB, key="fragmented-1").result()
        events = [e for s in client.run(worker_pressure_state).values() for e in s["oom_events"]]
        by_task = {e["task_key"]: e for e in events}
        assert by_task["too-big-1"]["verdict"] == "demand"
        assert by_task["too-big-1"]["requested"] == 17 * MiB
        frag = by_task["fragmented-1"]
        assert frag["verdict"] == "fragmentation" and frag["task_prefix"] == "fragmented"
        assert frag["free_bytes"] >= 2 * MiB > frag["largest_free_block"]
