"""Mixed dask-rmm versions: this scheduler with workers of the previous wire format (version 2:
samples as lists) and of this one (version 3: packed), from heartbeats recorded from real
workers of each version (data/record_heartbeat.py; version 2 from commit d145dc3^)."""

from __future__ import annotations

import asyncio
from pathlib import Path

import msgpack
import pytest
from distributed.utils_test import gen_cluster

from dask_rmm.client.fetch import cluster_report
from dask_rmm.scheduler import install_scheduler_plugin
from dask_rmm.wire import METRICS_VERSION

DATA = Path(__file__).parent / "data"
MiB = 1 << 20


def _recorded(version: int) -> dict:
    beat = msgpack.unpackb((DATA / f"heartbeat_v{version}.msgpack").read_bytes(), raw=False)
    assert beat["version"] == version
    return beat


def test_the_recordings_are_of_the_previous_and_this_wire_version():
    assert {_recorded(2)["version"], _recorded(3)["version"]} == {
        METRICS_VERSION - 1,
        METRICS_VERSION,
    }
    assert isinstance(_recorded(2)["devices"]["0"]["samples"], list)
    assert isinstance(_recorded(3)["devices"]["0"]["samples"], bytes)


@pytest.mark.parametrize("version", [2, 3])
@gen_cluster(client=True)
async def test_a_worker_of_each_wire_version_is_read_in_full(c, s, a, b, version):
    beat = _recorded(version)
    a.metrics["dask-rmm"] = lambda worker: beat
    await install_scheduler_plugin(c)
    await a.heartbeat()
    report = await cluster_report(c)
    assert report.errors == ()
    d = report.device(a.address)
    assert d.current_bytes == 2 * MiB and d.peak_bytes == 3 * MiB
    assert len(d.timeline) == 5 and all(p[1] == 2 * MiB for p in d.timeline)
    assert d.resource.endswith("PoolMemoryResource>SystemMemoryResource")
    assert [g.prefix for g in d.task_groups] == ["work"]


@gen_cluster(client=True)
async def test_workers_of_both_versions_at_once_sum_into_one_cluster(c, s, a, b):
    old, new = _recorded(2), _recorded(3)
    a.metrics["dask-rmm"] = lambda worker: old
    b.metrics["dask-rmm"] = lambda worker: new
    await install_scheduler_plugin(c)
    await asyncio.gather(a.heartbeat(), b.heartbeat())
    report = await cluster_report(c)
    assert report.errors == ()
    assert report.totals.current_bytes == 4 * MiB and report.totals.devices == 2
    assert report.totals.peak_bytes == 4 * MiB  # both held 2 MiB while their samples overlap
