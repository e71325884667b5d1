"""RMMPlugin's guarantees: all-or-nothing registration, live memory of replaced stacks, one INFO
line per installed stack, allocation logs flushed while the worker runs and kept across a
restart under the same name."""

from __future__ import annotations

import asyncio
import gc
import os
import pathlib
import signal
import tempfile
import time
import weakref

import pytest
from conftest import hold, local_process_cluster, wait_until
from distributed import Worker, wait
from distributed.protocol.pickle import loads
from distributed.utils_test import captured_logger, gen_cluster

from dask_rmm.mr.registry import get_per_device_resource
from dask_rmm.plugin import RMMPlugin, RMMSetupError
from dask_rmm.stack.build import log_file_path
from dask_rmm.wire import device_entries
from dask_rmm.worker.stacks import worker_stack

MiB = 1 << 20


def _registered(s):
    plugin = s.worker_plugins.get("dask-rmm")
    return None if plugin is None else loads(plugin) if isinstance(plugin, bytes) else plugin


@gen_cluster(client=True, nthreads=[("127.0.0.1", 1)] * 3)
async def test_a_failure_on_one_worker_changes_no_worker(c, s, a, b, w, tmp_path_factory=None):

    first = RMMPlugin(base_resource="system", pool_size="8MiB")
    await c.register_plugin(first)
    before = {x.address: worker_stack(x).active[0] for x in (a, b, w)}
    with tempfile.TemporaryDirectory() as d:
        # b cannot open its log: a directory has its log file's name.
        os.makedirs(log_file_path(d, b.name, 0))
        with pytest.raises(RMMSetupError) as info:
            await c.register_plugin(
                RMMPlugin(base_resource="system", pool_size="16MiB", log_directory=d)
            )
    message = str(info.value)
    assert f"worker {b.address}: OSError: `log_directory`" in message and "on 1 worker," in message
    for x in (a, b, w):  # every worker kept its stacks, installed
        assert worker_stack(x).active == [before[x.address]]
        assert worker_stack(x).options.pool_size == 8 * MiB
    assert get_per_device_resource(0) in {st.top for st in before.values()}
    assert _registered(s).token == first.token  # the scheduler kept the previous registration
    async with Worker(s.address, nthreads=1) as late:  # a worker added later starts like the rest
        await c.wait_for_workers(4)
        assert worker_stack(late).options.pool_size == 8 * MiB
    # the workers still run tasks through their pools
    assert (await c.submit(hold, 1000)).size == 1000


@gen_cluster(client=True, nthreads=[("127.0.0.1", 1)] * 2)
async def test_a_failed_first_registration_is_forgotten(c, s, a, b):
    with pytest.raises(RMMSetupError, match="`pool_size` .* is larger than"):
        await c.register_plugin(RMMPlugin(base_resource="system", pool_size="1PiB"))
    assert "dask-rmm" not in s.worker_plugins
    assert worker_stack(a).active == [] and worker_stack(b).active == []
    async with Worker(s.address, nthreads=1) as late:
        await c.wait_for_workers(3)
        assert "dask-rmm" not in late.plugins and worker_stack(late).active == []


@gen_cluster(client=True, nthreads=[("127.0.0.1", 1)])
async def test_memory_held_from_a_replaced_stack_stays_counted(c, s, a):
    await c.register_plugin(RMMPlugin(base_resource="system", pool_size="8MiB"))
    held = c.submit(hold, 3 * MiB, workers=[a.address])
    await wait(held)
    old = worker_stack(a).active[0]
    old_pool = weakref.ref(old.top)
    await c.register_plugin(RMMPlugin(base_resource="system", pool_size="16MiB"))
    assert worker_stack(a).retired == [old] and old.live_bytes == 3 * MiB
    # the heartbeat still counts them, beside the new stack's own bytes
    device = device_entries(a.metrics["dask-rmm"](a))["0"]
    assert device["retired_bytes"] == 3 * MiB and "current_bytes" not in device  # 0: left out
    del held
    deadline = time.monotonic() + 10
    while worker_stack(a).retired:
        assert time.monotonic() < deadline, "the freed buffer is still counted"
        await asyncio.sleep(0.02)
    gc.collect()
    assert old_pool() is None  # the replaced pool went with its last buffer


@gen_cluster(client=True, nthreads=[("127.0.0.1", 1)])
async def test_each_worker_logs_the_stack_it_installed(c, s, a):
    with captured_logger("distributed.worker") as log:
        await c.register_plugin(RMMPlugin(base_resource="system", pool_size="8MiB"))
    lines = [line for line in log.getvalue().splitlines() if "installed" in line]
    assert len(lines) == 1
    assert "pool 8.00 MiB, maximum none, base resource system, log none" in lines[0]


@gen_cluster(client=True, nthreads=[("127.0.0.1", 1)])
async def test_the_stack_line_is_in_the_worker_logs_the_client_reads(c, s, a):
    """``Client.get_worker_logs()`` holds what distributed's worker logger took at INFO: the
    line must be there without any logging configuration of the user's."""
    await c.register_plugin(RMMPlugin(base_resource="system", pool_size="8MiB"))
    logs = await c.get_worker_logs()
    lines = [(level, m) for level, m in logs[a.address] if "dask-rmm: worker" in m]
    assert [level for level, m in lines if "installed" in m] == ["INFO"], logs[a.address]
    assert any("pool 8.00 MiB" in m for _, m in lines)


@gen_cluster(client=True, nthreads=[("127.0.0.1", 1)] * 3)
async def test_a_failure_on_several_workers_names_each_worker_and_its_reason(c, s, a, b, w):
    await c.register_plugin(RMMPlugin(base_resource="system", pool_size="8MiB"))
    with tempfile.TemporaryDirectory() as d:
        for x in (a, b):  # a and b cannot open their logs: directories have the files' names
            os.makedirs(log_file_path(d, x.name, 0))
        with pytest.raises(RMMSetupError) as info:
            await c.register_plugin(
                RMMPlugin(base_resource="system", pool_size="16MiB", log_directory=d)
            )
    message = str(info.value)
    assert "failed on 2 workers, so every worker keeps its previous setup" in message
    for x in (a, b):
        assert f"worker {x.address}: OSError: `log_directory`" in message
        assert log_file_path(d, x.name, 0) in message
    assert w.address not in message  # only the workers that failed are named
    assert set(info.value.failures) == {a.address, b.address}


@gen_cluster(client=True, nthreads=[("127.0.0.1", 1)] * 3)
async def test_a_host_memory_fraction_that_the_workers_on_a_host_overcommit_is_warned(
    c, s, a, b, w
):
    """Each worker takes its fraction of the whole host: three workers at 0.4 ask for 120 %."""
    with captured_logger("distributed.worker") as log:
        await c.register_plugin(RMMPlugin(base_resource="system", pool_size=0.4))
    warned = [line for line in log.getvalue().splitlines() if "more than the host's" in line]
    assert len(warned) == 3, log.getvalue()
    assert "the 3 workers on host 127.0.0.1" in warned[0] and "0.33 or less" in warned[0]
    await c.unregister_worker_plugin("dask-rmm")
    with captured_logger("distributed.worker") as log:  # 3 x 0.3 fits
        await c.register_plugin(RMMPlugin(base_resource="system", pool_size=0.3))
    assert "more than the host's" not in log.getvalue()


@gen_cluster(client=True, nthreads=[("127.0.0.1", 1)])
async def test_logs_reach_the_file_while_the_worker_runs(c, s, a):

    with tempfile.TemporaryDirectory() as d:
        await c.register_plugin(RMMPlugin(base_resource="system", log_directory=d))
        held = c.submit(hold, 4096)
        await wait(held)
        path = log_file_path(d, a.name, 0)
        deadline = time.monotonic() + 10
        while ",allocate,0x" not in pathlib.Path(path).read_text():
            assert time.monotonic() < deadline, "no row reached the file"
            await asyncio.sleep(0.05)


def _rows(path) -> list[str]:
    with open(path) as f:
        return [line for line in f if ",allocate," in line]


@pytest.mark.slow
def test_a_killed_worker_keeps_its_rows_and_its_restart_appends(tmp_path):
    with local_process_cluster() as (cluster, client):
        client.register_plugin(RMMPlugin(base_resource="system", log_directory=str(tmp_path)))
        info = client.scheduler_info()["workers"]
        address, name = next((a, w["name"]) for a, w in info.items())
        futures = client.map(hold, [4096] * 5, workers=[address], pure=False)
        wait(futures)
        path = log_file_path(tmp_path, name, 0)
        wait_until(lambda: len(_rows(path)) >= 5, 10, "rows flushed while the worker runs")
        pid = client.run(os.getpid, workers=[address])[address]
        os.kill(pid, signal.SIGKILL)
        assert len(_rows(path)) >= 5  # nothing lost that was flushed
        # the nanny restarts it under the same name; its setup appends to the same file
        wait_until(
            lambda: any(
                w["name"] == name and a != address
                for a, w in client.scheduler_info()["workers"].items()
            ),
            60,
            "the restarted worker",
        )
        restarted = next(
            a for a, w in client.scheduler_info()["workers"].items() if w["name"] == name
        )
        wait(client.submit(hold, 8192, workers=[restarted], pure=False))
        wait_until(lambda: any(",8192," in r for r in _rows(path)), 10, "the restart's rows")
        assert len(_rows(path)) >= 6
        with open(path) as f:
            assert f.read().count("Thread,Time,Action") == 2  # the header, the restart marker
        from dask_rmm.logs.summary import summarize

        summary = summarize([path]).files[0]
        # the five buffers the killed process held ended with it, they did not leak
        assert summary.restarts == 1 and summary.ended_with_process_bytes >= 5 * 4096


@gen_cluster(client=True, nthreads=[("127.0.0.1", 1)] * 2)
async def test_stacks_built_by_a_failed_registration_are_freed_at_once(c, s, a, b):
    """The workers that built their stacks give the memory back when the vote fails, without
    waiting for a garbage collection, although the worker's log keeps the error's traceback
    (and so the setup frame). Seen on two H200s: a discarded 70 GiB pool stayed."""

    import dask_rmm.plugin as plugin_module

    built = []
    real_build_stack = plugin_module.build_stack

    def recording_build_stack(*args, **kwargs):
        stack = real_build_stack(*args, **kwargs)
        built.append(weakref.ref(stack.top))
        return stack

    plugin_module.build_stack = recording_build_stack
    gc.disable()
    try:
        with tempfile.TemporaryDirectory() as d:
            os.makedirs(log_file_path(d, b.name, 0))  # b fails, a builds its stack
            with pytest.raises(RMMSetupError):
                await c.register_plugin(
                    RMMPlugin(base_resource="system", pool_size="16MiB", log_directory=d)
                )
        assert len(built) == 1  # a built its stack; b failed in building
        alive = [r for r in built if r() is not None]
        assert not alive, f"{len(alive)} discarded stack(s) still alive"
    finally:
        gc.enable()
        plugin_module.build_stack = real_build_stack


@gen_cluster(client=True, nthreads=[("127.0.0.1", 1)])
async def test_registering_never_changes_the_metrics_dict_a_heartbeat_is_reading(c, s, a):
    # Worker.get_metrics iterates worker.metrics across awaits; a setup or teardown that changed
    # that dict in place made the heartbeat raise and closed the worker (seen on two H200s).
    reading = a.metrics
    await c.register_plugin(RMMPlugin(base_resource="system", pool_size="8MiB"))
    assert "dask-rmm" not in reading and "dask-rmm" in a.metrics
    reading = a.metrics
    await c.unregister_worker_plugin("dask-rmm")
    assert "dask-rmm" in reading and "dask-rmm" not in a.metrics


@gen_cluster(client=True, nthreads=[("127.0.0.1", 1)])
async def test_a_superseded_registration_arriving_late_leaves_the_current_plugin_in_place(c, s, a):
    """Two registrations at once: the later one (the scheduler's) reached this worker first.
    The earlier one, arriving after it, changed nothing but left ``worker.plugins["dask-rmm"]``
    describing its own options while the later one's stacks stayed installed."""
    from distributed.protocol.pickle import dumps

    from dask_rmm.worker.stacks import worker_stack

    earlier = RMMPlugin(base_resource="system", pool_size="8MiB")
    later = RMMPlugin(base_resource="system", pool_size="16MiB")
    await c.register_plugin(later)
    await a.plugin_add(plugin=dumps(earlier), name="dask-rmm")  # as distributed delivers it
    plugin = a.plugins["dask-rmm"]
    assert plugin.token == later.token and plugin.options.pool_size == 16 << 20
    ws = worker_stack(a)
    assert ws.token == later.token and ws.active[0].pool_size == 16 << 20
    assert "dask-rmm" in a.metrics  # the restored plugin publishes its metrics again


@gen_cluster(client=True, nthreads=[("127.0.0.1", 1)])
async def test_a_worker_that_joins_and_cannot_set_the_registered_plugin_up_stops(c, s, a):
    """A worker added (or restarted by its nanny) after the registration succeeded gets the
    plugin when it registers; distributed would log its failure and run it without dask-rmm."""
    with tempfile.TemporaryDirectory() as d:
        await c.register_plugin(RMMPlugin(base_resource="system", log_directory=d))
        os.makedirs(log_file_path(d, "late", 0))  # its log file's name is a directory
        with captured_logger("distributed.worker") as log:
            late = Worker(s.address, nthreads=1, name="late")
            await late
            deadline = time.monotonic() + 20
            while late.status.name not in ("closed", "failed"):
                assert time.monotonic() < deadline, "the worker without its setup runs on"
                await asyncio.sleep(0.02)
        (said,) = [line for line in log.getvalue().splitlines() if "stopping worker late" in line]
        assert "dask-rmm setup failed" in said and "cannot write the allocation log" in said
        assert worker_stack(a).active  # the others keep theirs
        while "late" in {w.name for w in s.workers.values()}:
            assert time.monotonic() < deadline, "the scheduler still lists the stopped worker"
            await asyncio.sleep(0.02)


def _hang_setup(worker):
    """Make ``worker`` receive the plugin and never answer, as a worker that dies mid-setup."""
    never = asyncio.Event()

    async def plugin_add(**kwargs):
        await never.wait()

    worker.handlers["plugin-add"] = plugin_add


async def _close_when_others_voted(s, dying, others: int):
    from dask_rmm.scheduler.setup_vote import SetupCoordinator

    deadline = time.monotonic() + 20
    while True:
        coordinator = s.plugins.get(SetupCoordinator.name)
        rounds = [] if coordinator is None else list(coordinator.rounds.values())
        if rounds and len(rounds[-1].votes) >= others:
            break
        assert time.monotonic() < deadline, "the other workers never voted"
        await asyncio.sleep(0.01)
    await dying.close()


@gen_cluster(client=True, nthreads=[("127.0.0.1", 1)] * 3)
async def test_a_worker_dying_during_the_registration_is_named_and_the_others_set_up(c, s, a, b, w):
    """distributed's own registration raised the dying worker's comm error to the client
    although every live worker installed the setup."""
    _hang_setup(w)
    plugin = RMMPlugin(base_resource="system", pool_size="8MiB")
    with captured_logger("distributed.scheduler.dask_rmm") as log:
        registering = asyncio.ensure_future(c.register_plugin(plugin))
        await _close_when_others_voted(s, w, others=2)
        assert await registering is None
    assert "1 lost during the registration" in log.getvalue() and w.address in log.getvalue()
    (event,) = [e for _, e in await c.get_events("dask-rmm")]
    assert event["action"] == "registration-lost-workers" and set(event["lost"]) == {w.address}
    for x in (a, b):
        assert (
            worker_stack(x).token == plugin.token and worker_stack(x).options.pool_size == 8 * MiB
        )
    assert _registered(s).token == plugin.token  # workers joining later get it
    assert not [p for p in s.plugins.values() if isinstance(p, RMMPlugin)]
    assert (await c.submit(hold, 1000, workers=[a.address])).size == 1000


@gen_cluster(client=True, nthreads=[("127.0.0.1", 1)] * 3)
async def test_a_worker_dying_while_another_fails_gives_the_setup_error(c, s, a, b, w):
    first = RMMPlugin(base_resource="system", pool_size="8MiB")
    await c.register_plugin(first)
    _hang_setup(w)
    with tempfile.TemporaryDirectory() as d:
        os.makedirs(log_file_path(d, b.name, 0))  # b cannot open its log
        registering = asyncio.ensure_future(
            c.register_plugin(RMMPlugin(base_resource="system", pool_size="16MiB", log_directory=d))
        )
        await _close_when_others_voted(s, w, others=2)
        with pytest.raises(RMMSetupError) as info:
            await registering
    assert f"worker {b.address}: OSError: `log_directory`" in str(info.value)
    for x in (a, b):
        assert worker_stack(x).token == first.token and worker_stack(x).options.pool_size == 8 * MiB
    assert _registered(s).token == first.token


@gen_cluster(client=True, nthreads=[("127.0.0.1", 1)])
async def test_registering_leaves_no_scheduler_plugin_and_warns_nothing(c, s, a):
    """RMMPlugin reaches the scheduler as a SchedulerPlugin (that is how the registration runs
    there); the scheduler keeps the worker plugin only, also for registrations back to back."""
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("error")
        plugins = [RMMPlugin(base_resource="system", pool_size=f"{n}MiB") for n in (8, 16, 8)]
        await asyncio.gather(*(c.register_plugin(p) for p in plugins))
        await c.register_plugin(RMMPlugin(base_resource="system", pool_size="8MiB"))
    await asyncio.sleep(0)
    assert not [p for p in s.plugins.values() if isinstance(p, RMMPlugin)]
    assert worker_stack(a).token == _registered(s).token
    await c.unregister_worker_plugin("dask-rmm")
    assert "dask-rmm" not in s.worker_plugins and worker_stack(a).active == []


@pytest.mark.timeout(420)  # two nanny restarts and a cluster close, on a loaded host
def test_a_worker_killed_during_register_plugin_never_gives_a_comm_error():
    """kill -9 of a worker process while ``register_plugin`` runs, at several moments: the
    registration succeeds on the others or raises RMMSetupError, and in the end every worker,
    the restarted one included, runs what the scheduler holds."""
    import threading

    with local_process_cluster(n_workers=3) as (cluster, client):
        for delay in (0.0, 0.05):  # the previous code raised the comm error at the first
            client.wait_for_workers(3, timeout=60)
            victim = sorted(client.scheduler_info()["workers"])[0]
            pid = client.run(os.getpid, workers=[victim])[victim]
            plugin = RMMPlugin(base_resource="system", pool_size="8MiB")
            outcome: list = []

            def register(plugin=plugin, outcome=outcome):
                try:
                    outcome.append(client.register_plugin(plugin))
                except Exception as e:  # judged below
                    outcome.append(e)

            thread = threading.Thread(target=register)
            thread.start()
            time.sleep(delay)
            os.kill(pid, signal.SIGKILL)
            thread.join(120)
            assert not thread.is_alive(), "register_plugin hangs"
            (result,) = outcome
            assert result is None or isinstance(result, RMMSetupError), repr(result)
            wait_until(
                lambda victim=victim: (
                    victim not in (w := client.scheduler_info()["workers"]) and len(w) == 3
                ),
                60,
                "the nanny's restart of the killed worker",
            )
        client.wait_for_workers(3, timeout=60)

        def state(dask_worker):
            return worker_stack(dask_worker).token

        registered = client.run_on_scheduler(
            lambda dask_scheduler: _registered(dask_scheduler).token
        )
        wait_until(
            lambda: set(client.run(state).values()) == {registered} and len(client.run(state)) == 3,
            60,
            "every worker running the registered setup",
        )


@gen_cluster(client=True, nthreads=[("127.0.0.1", 1)])
async def test_a_peak_sampled_just_before_a_registration_reaches_the_report(c, s, a):
    """Peaks were lost after concurrent registrations: a teardown dropped the samples the
    heartbeat had not sent yet (the peak among them), a plugin put back published again over its
    own, and one displaced by a later registration kept sampling, unsent. Here the teardown comes
    between the sample of a peak and the next heartbeat."""
    from distributed.protocol.pickle import dumps

    from dask_rmm import DeviceBuffer, cluster_report

    await c.register_plugin(RMMPlugin(base_resource="system"))
    await a.heartbeat()
    first = a.plugins["dask-rmm"]
    DeviceBuffer(size=4 * MiB)  # allocated and freed: only a sample has this peak
    first.worker_metrics.sample()
    later = RMMPlugin(base_resource="system", pool_size="8MiB")  # a new stack, a new peak count
    s.worker_plugins["dask-rmm"] = dumps(later)  # what the scheduler holds
    await a.plugin_add(plugin=dumps(later), name="dask-rmm")  # tears `first` down at once
    await a.heartbeat()
    report = await cluster_report(c)
    assert report.device(a.address).peak_bytes == report.totals.peak_bytes == 4 * MiB


@gen_cluster(client=True, nthreads=[("127.0.0.1", 1)] * 2)
async def test_a_plugin_displaced_by_a_concurrent_registration_stops_sampling(c, s, a, b):
    """Put back by a superseded registration, the previous plugin published its metrics again;
    the registration that won then displaced it without a teardown: its sampler ran on, its
    samples never sent."""
    from distributed.protocol.pickle import dumps

    from dask_rmm.worker.metrics import METRICS_KEY, WorkerMetrics

    await c.register_plugin(RMMPlugin(base_resource="system", pool_size="6MiB"))
    first, last = (RMMPlugin(base_resource="system", pool_size=f"{n}MiB") for n in (8, 12))
    s.worker_plugins["dask-rmm"] = dumps(last)  # what the scheduler holds

    async def deliver(worker, order):
        tasks = []
        for plugin in order:
            message = dict(plugin=dumps(plugin), name="dask-rmm")
            tasks.append(asyncio.ensure_future(worker.plugin_add(**message)))
            await asyncio.sleep(0)  # the first message is handled (up to its vote) first
        await asyncio.gather(*tasks)

    await asyncio.gather(deliver(a, [last, first]), deliver(b, [first, last]))
    # type(), not isinstance(): isinstance reads __class__, which some objects (torch's deprecated
    # reduce_op) answer with a FutureWarning, an error under this suite's warning filter.
    sampling = {m for m in gc.get_objects() if type(m) is WorkerMetrics and m._sampler}
    assert sampling == {w.metrics[METRICS_KEY].__self__ for w in (a, b)}


@gen_cluster(client=True, nthreads=[("127.0.0.1", 1)])
async def test_a_report_right_after_a_change_shows_it(c, s, a):
    """The report lagged a heartbeat (0.4-0.5 s) behind register_plugin, release_unused and
    unregistering, and did not say so."""
    from dask_rmm import DeviceBuffer, cluster_report, release_unused

    async def reserved():
        return [d.reserved_bytes for d in (await cluster_report(c)).devices]

    for n in (8, 12):
        await c.register_plugin(
            RMMPlugin(base_resource="system", pool_size=f"{n}MiB", maximum_pool_size="64MiB")
        )
        assert await reserved() == [n * MiB]
    DeviceBuffer(size=30 * MiB)  # the pool grows, and keeps the chunk
    await a.heartbeat()
    assert (await reserved())[0] > 12 * MiB
    await release_unused(c)
    assert await reserved() == [12 * MiB]
    await c.unregister_worker_plugin("dask-rmm")
    assert await reserved() == []
