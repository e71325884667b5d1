"""Mixed dask-rmm versions: this scheduler with workers of the previous wire format (version 2:
samples as lists) and of this one (version 3: packed), from heartbeats recorded from real
workers of each version (data/record_heartbeat.py; version 2 from commit d145dc3^); and the
reverse, a scheduler of the previous version (its reader copied from d145dc3^) with workers of
this one, which send it version 2 because it announces no newer."""

from __future__ import annotations

import asyncio
import time
from array import array
from pathlib import Path

import msgpack
import pytest
from distributed.diagnostics.plugin import SchedulerPlugin
from distributed.utils_test import gen_cluster

from dask_rmm.client.fetch import cluster_report
from dask_rmm.plugin import RMMPlugin
from dask_rmm.scheduler import install_scheduler_plugin
from dask_rmm.wire import METRICS_VERSION, PLUGIN_NAME, READS_VERSION_KEYS, DeviceSample

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


# -- the reverse: a scheduler of the previous version with workers of this one ------------------


class _Timeline:
    """The previous version's timeline (commit d145dc3^, dask_rmm/scheduler/timeline.py),
    copied: it reads ``samples`` as ``[time, current, max]`` rows."""

    def __init__(self, capacity: int):
        self.capacity = capacity
        self.columns = (array("d"), array("q"), array("q"))

    def extend(self, samples) -> None:
        times = self.columns[0]
        if times:
            samples = [s for s in samples if s[0] > times[-1]]
        new = [array(col.typecode, [s[i] for s in samples]) for i, col in enumerate(self.columns)]
        for col, values in zip(self.columns, new, strict=True):
            col.extend(values)
            del col[: max(0, len(col) - self.capacity)]


class PreviousVersionReader(SchedulerPlugin):
    """The scheduler plugin of the previous version as far as the wire goes (commit d145dc3^):
    the same name, no announcement of what it reads, and its reading of each worker's
    heartbeat (``_ingest``), copied; a heartbeat it cannot read becomes the worker's error."""

    name = PLUGIN_NAME
    idempotent = True

    def __init__(self) -> None:
        self.timelines: dict[tuple[str, str], _Timeline] = {}
        self.errors: dict[str, str] = {}

    async def start(self, scheduler) -> None:
        self.scheduler = scheduler

    def read(self) -> None:
        for ws in self.scheduler.workers.values():
            m = ws.metrics.get("dask-rmm")
            if m is None:
                continue
            self.errors.pop(ws.address, None)
            try:
                for dev, d in m["devices"].items():
                    samples = d.get("samples")
                    if samples:
                        tl = self.timelines.get((ws.address, dev))
                        if tl is None:
                            tl = self.timelines[ws.address, dev] = _Timeline(3600)
                        tl.extend(samples)
            except Exception as e:
                self.errors[ws.address] = f"malformed dask-rmm metrics: {e!r}"


#: Buffers the in-process workers of a test keep (so that their heartbeats show bytes in use).
_HELD: list = []


def _hold(nbytes: int) -> int:
    from dask_rmm import DeviceBuffer

    _HELD.append(DeviceBuffer(size=nbytes))
    return nbytes


@gen_cluster(client=True, nthreads=[("127.0.0.1", 1)])
async def test_a_scheduler_of_the_previous_version_reads_the_workers_of_this_one(c, s, a):
    """A scheduler that announces nothing gets version 2, which its reader takes in full."""
    reader = PreviousVersionReader()
    await s.register_scheduler_plugin(reader, idempotent=True)
    await c.register_plugin(RMMPlugin(base_resource="system"))
    assert s.plugins[PLUGIN_NAME] is reader  # the worker's install found it there
    await c.submit(_hold, 2 * MiB, pure=False)
    try:
        deadline = time.monotonic() + 20
        while True:
            await a.heartbeat()
            reader.read()
            assert reader.errors == {}
            tl = reader.timelines.get((a.address, "0"))
            if tl is not None and tl.columns[1] and tl.columns[1][-1] == 2 * MiB:
                break
            assert time.monotonic() < deadline, "the 2 MiB never reached the previous reader"
            await asyncio.sleep(0.1)
        beat = s.workers[a.address].metrics["dask-rmm"]
        assert beat["version"] == 2  # samples as rows (distributed's msgpack makes them tuples)
        assert isinstance(beat["devices"]["0"]["samples"], (list, tuple))
        assert list(tl.columns[0]) == sorted(set(tl.columns[0]))  # every sample once, in order
    finally:
        _HELD.clear()  # freed while the worker and its resource still stand


@gen_cluster(client=True, nthreads=[("127.0.0.1", 1)])
async def test_this_scheduler_announces_what_it_reads_and_gets_packed_samples(c, s, a):
    await c.register_plugin(RMMPlugin(base_resource="system"))
    assert await c.get_metadata(list(READS_VERSION_KEYS)) == METRICS_VERSION
    await a.heartbeat()
    beat = s.workers[a.address].metrics["dask-rmm"]
    assert beat["version"] == METRICS_VERSION
    assert isinstance(beat["devices"]["0"]["samples"], bytes)


def test_a_version_2_heartbeat_has_the_recorded_version_2_form():
    """What this worker sends a previous scheduler has the fields, and the types, of the
    heartbeat recorded from a real worker of the previous version."""
    from dask_rmm.wire import heartbeat, pack_samples

    recorded = _recorded(2)
    rows = [[1e9, 2 * MiB, 3 * MiB], [1e9 + 0.1, 2 * MiB, 2 * MiB]]
    in_use = DeviceSample(current_bytes=2 * MiB, reserved_bytes=4 * MiB, pool_free_bytes=2 * MiB)
    device = dict(in_use.to_dict(), samples=pack_samples(rows))
    sent = msgpack.unpackb(
        msgpack.packb(heartbeat("w", 1e9, {"0": device}, version=2), use_bin_type=True),
        raw=False,
    )
    assert sent["version"] == recorded["version"] == 2
    assert set(sent) == set(recorded)
    old, new = recorded["devices"]["0"], sent["devices"]["0"]
    assert new["samples"] == rows
    assert {k: type(v) for k, v in old.items()} == {k: type(new[k]) for k in old}


@pytest.mark.parametrize(
    "announced, sent",
    [(None, 2), ("3", 2), (1, 2), (True, 2), (2.5, 2), (3, 3), (99, METRICS_VERSION)],
)
@gen_cluster(nthreads=[("127.0.0.1", 1)])
async def test_a_worker_sends_what_the_scheduler_announces_it_reads(s, a, announced, sent):
    from dask_rmm.worker.metrics import scheduler_reads_version

    if announced is not None:
        s.set_metadata(keys=list(READS_VERSION_KEYS), value=announced)
    assert await scheduler_reads_version(a) == sent


def test_a_scheduler_that_does_not_answer_in_time_gets_the_previous_version(monkeypatch):
    """The question is bounded: a scheduler slow to answer does not hold the worker's setup,
    and gets what every scheduler reads."""
    from types import SimpleNamespace

    from dask_rmm import wire
    from dask_rmm.worker import metrics

    async def never(**_):
        await asyncio.sleep(3600)

    monkeypatch.setattr(metrics, "ASK_VERSION_TIMEOUT", 0.05)
    worker = SimpleNamespace(scheduler=SimpleNamespace(get_metadata=never))
    started = time.monotonic()
    assert asyncio.run(metrics.scheduler_reads_version(worker)) == wire.UNANNOUNCED_VERSION
    assert time.monotonic() - started < 30
