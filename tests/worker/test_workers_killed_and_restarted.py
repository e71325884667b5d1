"""The Dask layer the way users break it: a worker killed mid-run and restarted by its nanny,
restarts under the same name, commands run twice, bad arguments. Each test is a defect found by
probing, or a probe that must keep passing (host memory, no GPU)."""

from __future__ import annotations

import asyncio
import os
import re
import signal
import subprocess
import sys

import pytest
from conftest import HAS_GPU, hold, local_process_cluster, wait_until
from distributed import Worker, wait
from distributed.utils_test import gen_cluster
from fake_metrics import FakeRMMMetrics

from dask_rmm.client.fetch import cluster_report
from dask_rmm.plugin import RMMPlugin
from dask_rmm.scheduler import install_scheduler_plugin

MiB = 1 << 20


@gen_cluster(client=True, nthreads=[("127.0.0.1", 1)])
async def test_a_worker_back_under_its_name_is_one_row(c, s, a):
    """A nanny restart or ``client.restart()`` brings a worker back under its name at a new
    address: the report listed it twice, ``running`` and ``gone``."""
    await install_scheduler_plugin(c)
    for incarnation in range(3):
        async with Worker(s.address, nthreads=1, name="w") as w:
            w.metrics["dask-rmm"] = fake = FakeRMMMetrics(("0",))
            fake["0"].allocate((incarnation + 1) * MiB)
            await w.heartbeat()
            report = await cluster_report(c)
            rows = [d for d in report.devices if d.name == "w"]
            assert [(d.worker, d.status) for d in rows] == [(w.address, "running")]
            assert rows[0].current_bytes == (incarnation + 1) * MiB
        while len(s.workers) > 1:
            await asyncio.sleep(0.01)
    report = await cluster_report(c)
    assert [d.status for d in report.devices if d.name == "w"] == ["gone"]
    assert report.totals.gone_workers == 1


@pytest.mark.slow
def test_a_worker_killed_mid_run_comes_back_as_one_row_and_every_tool_still_works(tmp_path):
    """SIGKILL a worker process while its tasks hold memory: the report, ``dask rmm report``
    and ``dask rmm log summary`` work, and after the nanny's restart the worker is one row."""
    with local_process_cluster() as (cluster, client):
        client.register_plugin(
            RMMPlugin(
                base_resource="cuda" if HAS_GPU else "system",
                pool_size="16MiB",
                log_directory=str(tmp_path),
            )
        )
        info = client.scheduler_info()["workers"]
        victim, name = sorted((a, w["name"]) for a, w in info.items())[0]
        held = client.map(hold, [MiB] * 3, workers=[victim], pure=False)
        wait(held)
        wait_until(
            lambda: any(
                d.worker == victim and d.current_bytes == 3 * MiB
                for d in cluster_report(client).devices
            ),
            what="the victim's held memory in the report",
        )
        pid = client.run(os.getpid, workers=[victim])[victim]
        os.kill(pid, signal.SIGKILL)

        def back():
            workers = client.scheduler_info()["workers"]
            new = [a for a, w in workers.items() if w["name"] == name and a != victim]
            if not new:
                return None
            report = cluster_report(client)
            return report if any(d.worker == new[0] for d in report.devices) else None

        report = wait_until(back, 60, "the restarted worker's first dask-rmm heartbeat")
        rows = [d for d in report.devices if d.name == str(name)]
        assert [d.status for d in rows] == ["running"], report
        assert report.totals.gone_workers == 0
        client.cancel(held)
        cli = [sys.executable, "-m", "dask_rmm.cli"]
        out = subprocess.run(
            [*cli, "report", cluster.scheduler_address, "--timeout", "20"],
            capture_output=True, text=True, timeout=60,
        )  # fmt: skip
        assert out.returncode == 0, out.stderr
        # One table row for the worker; on a GPU a footnote per device ("addr (name)/dev0: ...
        # outside dask-rmm") names it too, and is not a row.
        rows = re.findall(rf"\({re.escape(str(name))}\)(?!/dev)", out.stdout)
        assert len(rows) == 1, out.stdout
        logs = sorted(str(p) for p in tmp_path.iterdir())
        out = subprocess.run(
            [*cli, "log", "summary", *logs], capture_output=True, text=True, timeout=60
        )
        assert out.returncode == 0, out.stderr


def _registered_token(s):
    from distributed.protocol.pickle import loads

    plugin = s.worker_plugins.get("dask-rmm")
    return (
        None if plugin is None else (loads(plugin) if isinstance(plugin, bytes) else plugin).token
    )


@pytest.mark.parametrize("late", [False, True])
def test_two_registrations_arriving_in_different_orders_leave_the_schedulers(late):
    """Two clients register at once (or a script is re-run while the first registration still
    sets up): the scheduler keeps the one it stored last, but the two ``plugin_add`` messages
    travel on separate connections and may reach the workers in different orders. Each worker
    installed whichever setup finished voting last, so the workers disagreed with each other and
    with the scheduler (workers added later start with the scheduler's). Seen with a process
    LocalCluster; here the arrival orders are made explicit (``late``: the earlier registration
    reaches b only after the later one was installed there)."""

    @gen_cluster(client=True, nthreads=[("127.0.0.1", 1)] * 2)
    async def run(c, s, a, b):
        from distributed.protocol.pickle import dumps

        from dask_rmm.worker.stacks import worker_stack

        first, last = (RMMPlugin(base_resource="system", pool_size=f"{n}MiB") for n in (8, 12))
        s.worker_plugins["dask-rmm"] = dumps(last)  # what register_worker_plugin stores

        async def deliver(worker, order, one_by_one=False):
            tasks = []
            for plugin in order:
                message = dict(plugin=dumps(plugin), name="dask-rmm")
                tasks.append(asyncio.ensure_future(worker.plugin_add(**message)))
                if one_by_one:
                    await tasks[-1]
                await asyncio.sleep(0)  # the first message is handled (up to its vote) first
            await asyncio.gather(*tasks)

        await asyncio.gather(deliver(a, [first, last]), deliver(b, [last, first], late))
        for w in (a, b):
            assert worker_stack(w).token == last.token, w.address
            assert worker_stack(w).options.pool_size == 12 * MiB
            assert "dask-rmm" in w.metrics
        await a.heartbeat()
        await b.heartbeat()
        report = await cluster_report(c)
        assert {d.reserved_bytes for d in report.devices} == {12 * MiB}
        await c.unregister_worker_plugin("dask-rmm")
        while any(worker_stack(w).active for w in (a, b)):  # removed on the next loop turn
            await asyncio.sleep(0.01)
        for w in (a, b):  # nothing left behind by the registration that lost
            assert "dask-rmm" not in w.metrics

    run()


@gen_cluster(client=True, nthreads=[("127.0.0.1", 1)] * 3)
async def test_two_registrations_at_once_leave_one_setup_everywhere(c, s, *workers):
    """Two clients registering at once (or a script re-run while the first still sets up):
    each worker installed whichever setup finished voting last, while the scheduler kept the
    one registered last, so workers added later started unlike the others."""
    from dask_rmm.worker.stacks import worker_stack

    for round_ in range(2):
        plugins = [
            RMMPlugin(base_resource="system", pool_size=f"{8 + 2 * round_ + i}MiB") for i in (0, 1)
        ]
        await asyncio.gather(*(c.register_plugin(p) for p in plugins))
        tokens = {w.address: worker_stack(w).token for w in workers}
        assert set(tokens.values()) == {_registered_token(s)}, (round_, tokens)
    async with Worker(s.address, nthreads=1) as late:
        await c.wait_for_workers(4)
        assert worker_stack(late).token == _registered_token(s)


def _reinitialize_in_a_task():
    import dask_rmm

    dask_rmm.reinitialize(base_resource="system", pool_allocator=True, initial_pool_size="4MiB")
    return True


@gen_cluster(client=True, nthreads=[("127.0.0.1", 1)])
async def test_a_task_that_replaces_the_resource_is_not_hidden(c, s, a):
    """A task calling ``reinitialize`` (or ``set_current_device_resource``) on a worker moved
    every later allocation to a resource dask-rmm does not count, while the report kept
    showing the old stack's numbers as if nothing had changed."""
    await c.register_plugin(RMMPlugin(base_resource="system", pool_size="8MiB"))
    await a.heartbeat()
    assert (await cluster_report(c)).device(a.address).error is None
    assert await c.submit(_reinitialize_in_a_task, pure=False)
    await a.heartbeat()
    error = (await cluster_report(c)).device(a.address).error
    assert "current resource was replaced outside dask-rmm" in error, error
    await c.register_plugin(RMMPlugin(base_resource="system", pool_size="8MiB"))
    await a.heartbeat()
    assert (await cluster_report(c)).device(a.address).error is None


def _wrap_in_statistics():
    import dask_rmm.statistics

    dask_rmm.statistics.enable_statistics()
    return True


@gen_cluster(client=True, nthreads=[("127.0.0.1", 1)])
async def test_an_adaptor_wrapped_over_the_workers_stack_is_not_a_replacement(c, s, a):
    await c.register_plugin(RMMPlugin(base_resource="system", pool_size="8MiB"))
    assert await c.submit(_wrap_in_statistics, pure=False)
    await a.heartbeat()
    assert (await cluster_report(c)).device(a.address).error is None


@gen_cluster(client=True, nthreads=[("127.0.0.1", 1)] * 2)
async def test_registering_the_same_plugin_again_after_fixing_the_cause_succeeds(c, s, a, b):
    """``plugin = RMMPlugin(...)`` in one notebook cell, ``client.register_plugin(plugin)`` in
    the next: after a failure, fixing its cause and re-running the second cell failed again with
    the first attempt's reason (the vote answered from the first attempt's round)."""
    import shutil
    import tempfile

    from dask_rmm.stack.build import log_file_path
    from dask_rmm.worker.stacks import worker_stack

    with tempfile.TemporaryDirectory() as d:
        blocker = log_file_path(d, b.name, 0)
        os.makedirs(blocker)  # b cannot open its log
        plugin = RMMPlugin(base_resource="system", pool_size="8MiB", log_directory=d)
        with pytest.raises(Exception, match="OSError: `log_directory`"):
            await c.register_plugin(plugin)
        shutil.rmtree(blocker)
        await c.register_plugin(plugin)
        assert [worker_stack(w).token for w in (a, b)] == [plugin.token] * 2
        await c.unregister_worker_plugin("dask-rmm")
