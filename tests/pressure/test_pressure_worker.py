"""WorkerPressure on a real (in-process) worker: the store in front of worker.data and back on
detach, tasks reading spilled inputs, the GPU-aware pause and resume."""

from __future__ import annotations

import asyncio

from distributed import Worker, wait
from distributed.core import Status
from distributed.utils_test import gen_cluster

from dask_rmm.pressure.store import DeviceSpillStore
from tests.pressure_helpers import MiB, check_buffer, patterned_buffer, pressure_stack


def _sum_bytes(buf) -> int:
    return int(buf.copy_to_host().astype("int64").sum())


@gen_cluster(client=True, nthreads=[("127.0.0.1", 1)])
async def test_attach_spill_compute_detach(c, s, a: Worker):
    wp, top = pressure_stack(4 * MiB, spill_on_oom=True)
    inner = a.data
    wp.attach(a)
    try:
        assert isinstance(a.data, DeviceSpillStore) and a.state.data is a.data
        futures = c.map(patterned_buffer, [MiB] * 10, range(10), key=[f"b-{i}" for i in range(10)])
        await wait(futures)  # 10 MiB of outputs in a 4 MiB pool: the oldest are on host now
        assert wp.metrics()[0].spilled_count >= 6
        sums = await c.gather(c.map(_sum_bytes, futures))
        expected = [
            int(patterned_buffer(MiB, i).copy_to_host().astype("int64").sum()) for i in range(10)
        ]
        assert sums == expected
        assert wp.metrics()[0].total_spilled_count > 0
        assert wp.metrics()[0].total_unspilled_count > 0
        # Keep 3 of the 10: they fit back on the device at teardown.
        for f in futures[3:]:
            f.release()
        del sums
        while len(a.data) > 3:
            await asyncio.sleep(0.01)
    finally:
        wp.detach(a)
    assert a.data is inner and a.state.data is inner
    # Spilled outputs came back: the worker's own mapping holds device buffers again.
    for i in range(3):
        check_buffer(a.data[f"b-{i}"], i)
    del futures


@gen_cluster(client=True, nthreads=[("127.0.0.1", 1)])
async def test_detach_keeps_the_store_when_outputs_do_not_fit_back(c, s, a: Worker):
    wp, top = pressure_stack(4 * MiB, spill_on_oom=True)
    wp.attach(a)
    futures = c.map(patterned_buffer, [MiB] * 6, range(6), key=[f"b-{i}" for i in range(6)])
    await wait(futures)
    wp.detach(a)
    assert isinstance(a.data, DeviceSpillStore)  # draining: still reads spilled values back
    assert wp.oom_events() == []  # what did not fit back at teardown is no task's OOM
    assert "b-0" in a.data.spilled_keys()
    futures.pop().release()  # b-5 was on the device: room for one to come back
    while "b-5" in a.data:
        await asyncio.sleep(0.01)
    check_buffer(a.data["b-0"], 0)
    # A new setup takes the leftovers over.
    wp2, _ = pressure_stack(4 * MiB, spill_on_oom=True)
    wp2.attach(a)
    assert wp2.metrics()[0].spilled_count >= 1
    for i in range(5):
        check_buffer(a.data[f"b-{i}"], i)
    assert await c.gather(c.map(_sum_bytes, futures)) == [
        _sum_bytes(patterned_buffer(MiB, i)) for i in range(5)
    ]
    del futures
    wp2.detach(a)


@gen_cluster(client=True, nthreads=[("127.0.0.1", 1)])
async def test_pause_while_over_the_fraction_and_resume(c, s, a: Worker):
    wp, top = pressure_stack(4 * MiB, spill_on_oom=False, pause_fraction=0.5, limit=None)
    wp.monitor_interval = 0  # checks are driven by the test
    wp.attach(a)
    try:
        held = [patterned_buffer(MiB, i) for i in range(3)]  # 75%, nothing spillable
        wp.check()
        assert a.status == Status.paused
        assert wp.metrics()[0].paused and wp.metrics()[0].pauses == 1
        a.status = Status.running  # e.g. distributed's host-memory monitor resuming it
        wp.check()
        assert a.status == Status.paused and wp.metrics()[0].pauses == 1
        del held[:2]
        wp.check()
        assert a.status == Status.running and not wp.metrics()[0].paused
    finally:
        wp.detach(a)


@gen_cluster(
    client=True,
    nthreads=[("127.0.0.1", 1)],
    worker_kwargs={"memory_limit": "64GiB"},  # host memory far below distributed's pause
    config={"distributed.worker.memory.monitor-interval": "10ms"},
)
async def test_distributeds_host_memory_monitor_leaves_a_device_pause_alone(c, s, a: Worker):
    """distributed's monitor resumes any paused worker whose host memory is low, logging a
    warning each time (every 100 ms: a worker paused for device memory flapped and logged
    without end); while dask-rmm holds its pause it is left alone, and afterwards works again."""
    from distributed.utils_test import captured_logger

    wp, top = pressure_stack(4 * MiB, spill_on_oom=False, pause_fraction=0.5, limit=None)
    wp.monitor_interval = 0  # checks are driven by the test: nothing re-pauses behind it
    wp.attach(a)
    try:
        with captured_logger("distributed.worker.memory") as log:
            held = [patterned_buffer(MiB, i) for i in range(3)]
            wp.check()
            await asyncio.sleep(0.3)  # 30 host-memory checks
            assert a.status == Status.paused
            del held[:]
            wp.check()
            assert a.status == Status.running
        assert "Resuming worker" not in log.getvalue()
        a.status = Status.paused  # as if paused for host memory: distributed resumes it again
        while a.status != Status.running:
            await asyncio.sleep(0.01)
    finally:
        wp.detach(a)


@gen_cluster(client=True, nthreads=[("127.0.0.1", 1)])
async def test_pause_spills_unreferenced_outputs_first(c, s, a: Worker):
    wp, top = pressure_stack(4 * MiB, spill_on_oom=False, pause_fraction=0.5)
    wp.monitor_interval = 0
    wp.attach(a)
    try:
        for i in range(3):
            a.data[f"x-{i}"] = patterned_buffer(MiB, i)
        wp.check()  # 3 MiB > 2 MiB: spills one instead of pausing
        assert a.status == Status.running
        assert a.data.spilled_keys() == ["x-0"]
    finally:
        wp.detach(a)
    check_buffer(a.data["x-0"], 0)
    for i in range(3):  # not tasks: the worker's end-of-test validation would trip on them
        del a.data[f"x-{i}"]


@gen_cluster(client=True, nthreads=[("127.0.0.1", 1)])
async def test_detach_resumes_a_worker_it_paused(c, s, a: Worker):
    wp, top = pressure_stack(4 * MiB, pause_fraction=0.1)
    wp.monitor_interval = 0
    wp.attach(a)
    held = patterned_buffer(MiB, 1)
    wp.check()
    assert a.status == Status.paused
    wp.detach(a)
    assert a.status == Status.running
    del held


@gen_cluster(client=True, nthreads=[("127.0.0.1", 1)])
async def test_a_closing_worker_does_not_copy_spilled_outputs_back(c, s, a: Worker):
    from dask_rmm import RMMPlugin

    await c.register_plugin(
        RMMPlugin(base_resource="system", pool_size="4MiB", maximum_pool_size="4MiB",
                  spill_on_oom=True)
    )  # fmt: skip
    wp = a.plugins["dask-rmm"].worker_pressure
    futures = c.map(patterned_buffer, [MiB] * 8, range(8), key=[f"b-{i}" for i in range(8)])
    await wait(futures)
    spilled = wp.metrics()[0].spilled_count
    assert spilled >= 4
    await a.close()
    m = wp.metrics()[0]
    assert m.total_unspilled_count == 0 and m.oom_count == 0  # nothing tried to come back
    del futures
