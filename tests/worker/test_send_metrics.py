"""A worker's metrics go to the scheduler at once after a change, without a second
``Worker.heartbeat`` beside the periodic one (which closed workers on GPU machines)."""

from __future__ import annotations

import asyncio

from distributed.utils_test import gen_cluster

from dask_rmm import RMMPlugin
from dask_rmm.wire import METRICS_HANDLER

MiB = 1 << 20


async def _reserved(c) -> list[int]:
    from dask_rmm import cluster_report

    return [d.reserved_bytes for d in (await cluster_report(c)).devices]


@gen_cluster(client=True, nthreads=[("127.0.0.1", 1)])
async def test_a_change_while_a_heartbeat_waits_on_an_awaitable_metric_keeps_the_worker(c, s, a):
    """distributed's ``gpu`` metric (NVML) is awaitable: a heartbeat waits there after taking
    the spans' digests. A second heartbeat started then (dask-rmm sent one after a setup, a
    trim and a flush, and a teardown) failed distributed's spans check and closed the worker."""
    from dask_rmm import release_unused

    a.periodic_callbacks["heartbeat"].stop()  # the one heartbeat below is the periodic one
    entered, gate = asyncio.Event(), asyncio.Event()

    async def awaitable_metric(worker):
        entered.set()
        await gate.wait()
        return 0

    a.metrics = {**a.metrics, "awaitable": awaitable_metric}
    beat = asyncio.ensure_future(a.heartbeat())
    await entered.wait()
    await c.register_plugin(RMMPlugin(base_resource="system", pool_size="8MiB"))
    assert await _reserved(c) == [8 * MiB]  # shown at once, the heartbeat still waiting
    await release_unused(c)
    await c.unregister_worker_plugin("dask-rmm")
    assert await _reserved(c) == []  # gone at once too
    gate.set()
    await beat
    assert a.status.name == "running"
    assert await c.submit(int, 1) == 1


@gen_cluster(client=True, nthreads=[("127.0.0.1", 1)])
async def test_metrics_sent_for_another_address_or_malformed_change_nothing(c, s, a):
    await c.register_plugin(RMMPlugin(base_resource="system", pool_size="8MiB"))
    handler = s.handlers[METRICS_HANDLER]
    assert handler(address="tcp://127.0.0.1:1", metrics={}) is False
    assert handler(address=["not", "an", "address"], metrics={}) is False
    assert await _reserved(c) == [8 * MiB]
    assert handler(address=a.address, metrics={"devices": "x" * 100}) is True
    # the malformed entry is this worker's error, not the cluster's numbers
    from dask_rmm import cluster_report

    doc = await cluster_report(c)
    assert [d.reserved_bytes for d in doc.devices] == []
    assert [e for e in doc.errors if a.address in e], doc.errors
    await a.heartbeat()  # the next real heartbeat replaces it
    assert await _reserved(c) == [8 * MiB]
