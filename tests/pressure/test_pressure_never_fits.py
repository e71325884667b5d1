"""A request that can never fit (above the pool's maximum, or alone above the device memory
limit) spills nothing and counts as one failure, with and without ``spill_on_oom``."""

from __future__ import annotations

import pytest
from distributed import wait
from distributed.utils_test import gen_cluster

from dask_rmm import RMMPlugin
from dask_rmm.mr.base import OutOfMemoryError
from dask_rmm.worker.stacks import worker_stack
from tests.pressure_helpers import MiB, allocate_once, make_output, worker_pressure_state

SETUPS = {
    "limit": dict(device_memory_limit="96MiB"),
    "limit+spill_on_oom": dict(device_memory_limit="96MiB", spill_on_oom=True),
    "spill_on_oom": dict(spill_on_oom=True),
}


@pytest.mark.parametrize("request_mib", [129, 200, 1 << 10])
@pytest.mark.parametrize("setup", sorted(SETUPS))
def test_a_request_above_the_pools_maximum_spills_nothing_and_fails_once(setup, request_mib):
    @gen_cluster(client=True, nthreads=[("127.0.0.1", 1)])
    async def run(c, s, a):
        await c.register_plugin(
            RMMPlugin(base_resource="system", pool_size="64MiB", maximum_pool_size="128MiB",
                      device_pause_fraction=None, **SETUPS[setup])
        )  # fmt: skip
        outputs = c.map(make_output, [8 * MiB] * 4, range(4), pure=False)
        await wait(outputs)
        with pytest.raises(OutOfMemoryError):
            await c.submit(allocate_once, request_mib * MiB, pure=False)
        state = worker_pressure_state(a)
        metrics = state["metrics"][0]
        assert metrics["oom_count"] == 1, metrics
        assert metrics["total_spilled_bytes"] == 0, metrics
        assert metrics["ooms_avoided"] == 0, metrics
        assert len(state["oom_events"]) == 1
        assert state["oom_events"][0]["spilled_trying"] == 0
        # the stack's statistics saw one failed allocation, not one per (useless) retry
        assert worker_stack(a).active[0].statistics.failed_allocations == 1
        del outputs

    run()


@pytest.mark.parametrize("spill_on_oom", [False, True])
def test_a_request_alone_above_the_limit_spills_nothing_for_the_limit(spill_on_oom):
    """Spilling every output cannot bring a request larger than the limit under it."""

    @gen_cluster(client=True, nthreads=[("127.0.0.1", 1)])
    async def run(c, s, a):
        await c.register_plugin(
            RMMPlugin(base_resource="system", pool_size="64MiB", maximum_pool_size="256MiB",
                      device_memory_limit="96MiB", spill_on_oom=spill_on_oom,
                      device_pause_fraction=None)
        )  # fmt: skip
        outputs = c.map(make_output, [8 * MiB] * 4, range(4), pure=False)
        await wait(outputs)
        assert await c.submit(allocate_once, 100 * MiB, pure=False) == 100 * MiB
        metrics = worker_pressure_state(a)["metrics"][0]
        assert metrics["total_spilled_bytes"] == 0, metrics
        assert metrics["oom_count"] == 0, metrics
        del outputs

    run()


@gen_cluster(client=True, nthreads=[("127.0.0.1", 1)])
async def test_oom_events_and_totals_stay_after_a_re_registration_as_the_peaks_do(c, s, a):
    """A re-registration made the OOM events (and the counters) vanish while the peaks stayed."""
    from dask_rmm.wire import device_entries
    from dask_rmm.worker.metrics import METRICS_KEY

    options = dict(base_resource="system", pool_size="8MiB", maximum_pool_size="8MiB",
                   spill_on_oom=True, device_pause_fraction=None)  # fmt: skip
    await c.register_plugin(RMMPlugin(**options))
    with pytest.raises(OutOfMemoryError):
        await c.submit(allocate_once, 16 * MiB, pure=False)
    for again in (options, dict(options, pool_size="4MiB")):
        await c.register_plugin(RMMPlugin(**again))
        state = worker_pressure_state(a)
        assert [e["requested"] for e in state["oom_events"]] == [16 * MiB]
        assert state["metrics"][0]["oom_count"] == 1
        device = device_entries(a.metrics[METRICS_KEY](a))["0"]
        assert device["oom_count"] == 1 and len(device["oom_events"]) == 1


def test_a_request_that_waits_in_vain_counts_as_one_failed_allocation():
    """spill_until retries a failed allocation ~100 times while nothing can be spilled: the
    statistics counted each retry, a report showed 102 failed allocations for 1 OOM."""
    from dask_rmm import DeviceBuffer
    from tests.pressure_helpers import pressure_stack

    wp, top = pressure_stack(8 * MiB, spill_on_oom=True)
    held = DeviceBuffer(size=6 * MiB)  # a task's temporary: nothing to spill
    with pytest.raises(MemoryError):
        DeviceBuffer(size=4 * MiB)
    assert wp.devices[0].statistics.failed_allocations == 1
    del held
    assert DeviceBuffer(size=4 * MiB).size == 4 * MiB
