"""Memory admission on workers (host memory): tasks wait until their learned or annotated peak
fits; held-back tasks stay in the worker's task states, so that none is lost or run twice when
the plugin is unregistered or replaced or the worker closes; a task that raises an
out-of-memory error of another library runs once more after the caches gave memory back. The
distributed details the admission executor relies on are checked here too."""

from __future__ import annotations

import asyncio
import threading
import time
from collections import Counter

import dask
import pytest
from distributed import Worker, wait
from distributed.utils_test import gen_cluster
from distributed.worker import thread_state

from dask_rmm import RMMPlugin
from dask_rmm.worker.admission import AdmissionThreadPoolExecutor, admission_of

MiB = 1 << 20
POOL = dict(base_resource="system", pool_size="8MiB", maximum_pool_size="8MiB")
#: No work stealing: a stolen task would leave the worker whose gate holds it.
CONFIG = {"distributed.scheduler.work-stealing": False}

HOLD = threading.Event()
RUNS: Counter = Counter()
_runs_lock = threading.Lock()


def hold(nbytes: int, i: int, wait: bool = True) -> int:
    """Allocate ``nbytes`` from the worker's stack and keep them until HOLD is set."""
    from dask_rmm import DeviceBuffer

    with _runs_lock:
        RUNS[thread_state.key] += 1
    buf = DeviceBuffer(size=nbytes) if nbytes else None
    if wait:
        HOLD.wait(30)
    del buf
    return i


async def until(predicate, what: str, timeout: float = 20.0) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        await asyncio.sleep(0.01)


@pytest.fixture(autouse=True)
def _reset():
    HOLD.clear()
    RUNS.clear()
    yield
    HOLD.set()


async def _learn(c, nbytes: int = 3 * MiB) -> None:
    """One task of prefix "hold" runs alone: its peak is learned."""
    assert await c.submit(hold, nbytes, -1, False, key="hold-100") == -1


def _running_and_held(worker: Worker) -> tuple[int, int]:
    gate = admission_of(worker).gate
    return len(gate.running_keys()), gate.metrics().held_tasks


@gen_cluster(client=True, nthreads=[("127.0.0.1", 4)], config=CONFIG)
async def test_tasks_wait_until_their_learned_peak_fits(c, s, a):
    await c.register_plugin(RMMPlugin(**POOL, memory_admission=True))
    executor = admission_of(a)
    assert isinstance(executor, AdmissionThreadPoolExecutor)
    await _learn(c)
    assert executor.gate.peaks.expected("hold") == 3 * MiB
    futures = c.map(hold, [3 * MiB] * 6, range(6), key=[f"hold-{i}" for i in range(6)])
    # 8 MiB: two tasks of 3 MiB fit, a third would not; the worker executes 4 at a time.
    await until(lambda: _running_and_held(a) == (2, 2), "2 running, 2 held back")
    # Held back, the tasks are "executing" in the worker's state machine, as running ones.
    executing = [k for k, ts in a.state.tasks.items() if ts.state == "executing"]
    assert len(executing) == 4 and set(admission_of(a).gate.waiting_keys()) <= set(executing)
    HOLD.set()
    assert await c.gather(futures) == list(range(6))
    assert all(RUNS[f"hold-{i}"] == 1 for i in range(6))
    m = executor.gate.metrics()
    assert m.held_tasks == 0 and m.total_held >= 2 and m.longest_wait_seconds > 0
    assert executor.pressure.metrics()[0].oom_count == 0


@gen_cluster(client=True, nthreads=[("127.0.0.1", 4)], config=CONFIG)
async def test_without_admission_the_same_tasks_run_out_of_memory(c, s, a):
    await c.register_plugin(RMMPlugin(**POOL))
    assert admission_of(a) is None
    futures = c.map(hold, [3 * MiB] * 4, range(4), key=[f"hold-{i}" for i in range(4)])
    # 4 threads start 4 tasks; the pool holds two of them.
    await until(lambda: sum(f.status == "error" for f in futures) == 2, "two failures")
    HOLD.set()
    await wait(futures)
    assert sorted(f.status for f in futures) == ["error", "error", "finished", "finished"]


@gen_cluster(client=True, nthreads=[("127.0.0.1", 4)], config=CONFIG)
async def test_an_annotated_peak_holds_tasks_back_before_any_is_learned(c, s, a):
    await c.register_plugin(RMMPlugin(**POOL, memory_admission=True))
    with dask.annotate(gpu_memory="3MiB"):
        futures = c.map(hold, [0] * 5, range(5), key=[f"noted-{i}" for i in range(5)])
    await until(lambda: _running_and_held(a) == (2, 2), "2 running, 2 held back")
    HOLD.set()
    assert await c.gather(futures) == list(range(5))


@gen_cluster(client=True, nthreads=[("127.0.0.1", 4)], config=CONFIG)
async def test_tasks_needing_no_memory_pass_held_back_ones(c, s, a):
    await c.register_plugin(RMMPlugin(**POOL, memory_admission=True))
    await c.submit(hold, 0, -1, False, key="light-100")  # learned: needs nothing
    with dask.annotate(gpu_memory="5MiB"):
        big = c.map(hold, [0] * 3, range(3), key=[f"big-{i}" for i in range(3)])
    await until(lambda: _running_and_held(a) == (1, 2), "1 running, 2 held back")
    # One thread is free: the light tasks run there while the big ones wait.
    light = c.map(hold, [0] * 2, range(2), [False] * 2, key=[f"light-{i}" for i in range(2)])
    await until(lambda: sum(RUNS[f"light-{i}"] for i in range(2)) == 2, "the light tasks to run")
    assert _running_and_held(a)[1] == 2  # the big ones still wait
    HOLD.set()
    await c.gather(big + light)


@gen_cluster(client=True, nthreads=[("127.0.0.1", 4)], config=CONFIG)
async def test_held_tasks_run_once_when_the_plugin_is_unregistered(c, s, a):
    await c.register_plugin(RMMPlugin(**POOL, memory_admission=True))
    with dask.annotate(gpu_memory="3MiB"):
        futures = c.map(hold, [0] * 5, range(5), key=[f"noted-{i}" for i in range(5)])
    await until(lambda: _running_and_held(a) == (2, 2), "2 running, 2 held back")
    await c.unregister_worker_plugin("dask-rmm")
    assert admission_of(a) is None
    assert not isinstance(a.executors["default"], AdmissionThreadPoolExecutor)
    await until(lambda: sum(RUNS.values()) == 4, "the held tasks to start")
    HOLD.set()
    assert await c.gather(futures) == list(range(5))
    assert all(RUNS[f"noted-{i}"] == 1 for i in range(5))


@gen_cluster(client=True, nthreads=[("127.0.0.1", 4)], config=CONFIG)
async def test_held_tasks_run_once_when_the_plugin_is_replaced(c, s, a):
    await c.register_plugin(RMMPlugin(**POOL, memory_admission=True))
    first = admission_of(a)
    with dask.annotate(gpu_memory="3MiB"):
        futures = c.map(hold, [0] * 5, range(5), key=[f"noted-{i}" for i in range(5)])
    await until(lambda: _running_and_held(a) == (2, 2), "2 running, 2 held back")
    await c.register_plugin(RMMPlugin(**POOL, memory_admission=True))
    second = admission_of(a)
    assert second is not None and second is not first
    assert second.inner is first.inner  # one gate in front of the pool, never two
    await until(lambda: sum(RUNS.values()) == 4, "the held tasks to start")
    HOLD.set()
    assert await c.gather(futures) == list(range(5))
    assert all(RUNS[f"noted-{i}"] == 1 for i in range(5))


@gen_cluster(client=True, nthreads=[("127.0.0.1", 4), ("127.0.0.1", 4)], config=CONFIG)
async def test_held_tasks_move_to_another_worker_when_theirs_closes(c, s, a, b):
    await c.register_plugin(RMMPlugin(**POOL, memory_admission=True))
    with dask.annotate(gpu_memory="3MiB"):
        futures = c.map(
            hold,
            [0] * 5,
            range(5),
            key=[f"noted-{i}" for i in range(5)],
            workers=[a.address],
            allow_other_workers=True,
        )
    await until(lambda: _running_and_held(a) == (2, 2), "2 running, 3 held back on a")
    held = admission_of(a).gate.waiting_keys()
    closing = asyncio.ensure_future(a.close())
    # The closing worker drops what it holds back (the scheduler hands those keys to b); the
    # running ones end when let go.
    await until(lambda: a.status.name in ("closing", "closed"), "a to close")
    HOLD.set()
    await closing
    assert await c.gather(futures) == list(range(5))
    assert all(RUNS[k] == 1 for k in held), {k: RUNS[k] for k in held}


@gen_cluster(client=True, nthreads=[("127.0.0.1", 2)], config=CONFIG)
async def test_the_executor_sees_each_tasks_key_and_its_thread_state(c, s, a):
    """distributed runs a task with its key in thread_state only through an executor whose type
    name says ThreadPoolExecutor, and submits it just after adding the key to active_keys: the
    gate's learned peak is that task's own allocation."""
    await c.register_plugin(RMMPlugin(**POOL, memory_admission=True))
    await c.submit(hold, 2 * MiB, 0, False, key="two-0")
    await c.submit(hold, 1 * MiB, 0, False, key="one-0")
    peaks = admission_of(a).gate.peaks
    assert peaks.expected("two") == 2 * MiB and peaks.expected("one") == 1 * MiB
    assert "ThreadPoolExecutor" in str(type(a.executors["default"]))


class OutOfMemoryError(RuntimeError):
    """Named as PyTorch's and CuPy's errors are: told by name, neither library imported."""


def torch_like(nbytes: int, limit: int) -> int:
    """A library with its own allocator over the device (as PyTorch's): it fails when the
    device has no room, without asking dask-rmm for any."""
    from dask_rmm import DeviceBuffer
    from dask_rmm.mr.registry import get_per_device_resource

    used = get_per_device_resource(0).handler.statistics.current_bytes
    if used + nbytes > limit:
        raise OutOfMemoryError(f"CUDA out of memory. Tried to allocate {nbytes} bytes")
    return DeviceBuffer(size=nbytes).size


@pytest.mark.parametrize("admission", [True, False])
def test_a_task_out_of_memory_in_another_library_runs_again_after_the_caches_give_back(
    admission,
):
    from library_cache_helpers import HostLibraryCache

    from dask_rmm.allocators import arbitration, caches

    @gen_cluster(client=True, nthreads=[("127.0.0.1", 1)], config=CONFIG)
    async def run(c, s, a):
        await c.register_plugin(RMMPlugin(**POOL, memory_admission=admission))
        cache = HostLibraryCache()
        caches.register_cache(cache)
        cache.free(cache.malloc(6 * MiB))  # 6 of the 8 MiB held free in another library
        future = c.submit(torch_like, 4 * MiB, 8 * MiB, key="torchlike-0")
        await wait(future)
        if not admission:  # today's behaviour: the error reaches the task
            assert future.status == "error" and cache.cached_bytes(0) == 6 * MiB
            return
        assert await future == 4 * MiB
        assert cache.cached_bytes(0) == 0
        room = arbitration.recent_rooms()[-1]
        assert room.library == "task" and room.released == {"fakelib": 6 * MiB}
        m = admission_of(a).pressure.metrics()[0]
        assert (m.task_retries, m.task_retries_succeeded) == (1, 1)

    run()


@gen_cluster(client=True, nthreads=[("127.0.0.1", 4)], config=CONFIG)
async def test_held_back_figures_reach_the_report_page_and_prometheus(c, s, a):
    from dask_rmm.client.fetch import fetch_report_data
    from dask_rmm.report.memory_report import ClusterMemoryReport

    await c.register_plugin(RMMPlugin(**POOL, memory_admission=True))
    await _learn(c)
    futures = c.map(hold, [3 * MiB] * 4, range(4), key=[f"hold-{i}" for i in range(4)])
    await until(lambda: _running_and_held(a) == (2, 2), "2 running, 2 held back")
    d = a.metrics["dask-rmm"](a)["devices"]["0"]
    assert d["admission_held_tasks"] == 2 and d["admission_total_held"] == 2
    assert d["admission_expected_peaks"] == [["hold", 3 * MiB, 1]]
    await a.heartbeat()
    report = ClusterMemoryReport.from_dict(await fetch_report_data(c.scheduler, timeline=False))
    dev = report.device(a.address)
    assert dev.admission_held_tasks == 2 and dev.admission_expected_peaks == (("hold", 3 * MiB, 1),)
    text = str(report)
    assert "memory admission:" in text and "2 held back now" in text and "hold 3.00 MiB" in text
    assert "<h4>Memory admission</h4>" in report.to_html()
    assert report.to_dict()["workers"][0]["devices"]["0"]["admission_held_tasks"] == 2
    pytest.importorskip("prometheus_client")
    from prometheus_client.parser import text_string_to_metric_families
    from tornado.httpclient import AsyncHTTPClient

    r = await AsyncHTTPClient().fetch(f"http://127.0.0.1:{s.http_server.port}/metrics")
    families = {f.name: f for f in text_string_to_metric_families(r.body.decode())}
    assert [x.value for x in families["dask_rmm_admission_held_tasks"].samples] == [2]
    assert [x.value for x in families["dask_rmm_admission_held"].samples] == [2]  # a counter
    HOLD.set()
    await c.gather(futures)


def test_the_option_means_the_same_everywhere(monkeypatch):
    from dask_rmm.preload import plugin_from_flags
    from dask_rmm.stack.options import RMMOptions

    assert RMMPlugin(memory_admission=True).options.memory_admission
    assert plugin_from_flags(rmm_memory_admission=True).options.memory_admission
    from dask_rmm.preload import PROG, dask_setup

    with dask_setup.make_context(PROG, ["--rmm-memory-admission"]) as ctx:
        assert ctx.params["rmm_memory_admission"] is True
    assert not RMMOptions().memory_admission
    with dask.config.set({"dask-rmm.memory-admission": True}):
        assert RMMPlugin().options.memory_admission
    with pytest.raises(TypeError, match="memory_admission"):
        RMMOptions(memory_admission="sometimes")


CHILD_RAN = threading.Event()


def child() -> None:
    CHILD_RAN.set()


def parent() -> bool:
    """Leave the thread (as worker_client does) and wait for a child task."""
    from distributed import secede

    secede()
    return CHILD_RAN.wait(15)


@gen_cluster(client=True, nthreads=[("127.0.0.1", 2)], config=CONFIG)
async def test_a_task_that_left_its_thread_does_not_hold_back_the_tasks_it_waits_for(c, s, a):
    CHILD_RAN.clear()
    await c.register_plugin(RMMPlugin(**POOL, memory_admission=True))
    waiting = c.submit(parent, key="parent-0")  # a prefix never seen: it would run alone
    await until(
        lambda: (
            a.state.tasks.get("parent-0") is not None
            and a.state.tasks["parent-0"].state == "long-running"
        ),
        "the parent to secede",
    )
    await c.submit(child, key="child-0")
    assert await waiting is True


async def _coroutine_task() -> int:
    await asyncio.sleep(0.5)
    return 1


@gen_cluster(client=True, nthreads=[("127.0.0.1", 4)], config=CONFIG)
async def test_tasks_of_other_executors_do_not_hide_the_submitted_key(c, s, a):
    await c.register_plugin(RMMPlugin(**POOL, memory_admission=True))
    slow = c.submit(_coroutine_task, key="coro-0")  # executing on the event loop meanwhile
    await until(lambda: "coro-0" in a.active_keys, "the coroutine task to start")
    await c.submit(hold, 2 * MiB, 0, False, key="two-0")
    assert admission_of(a).gate.peaks.expected("two") == 2 * MiB
    assert await slow == 1


FAILED_ONCE: set = set()


def grab_then_fail(nbytes: int) -> int:
    """Hold ``nbytes`` in a local, then (the first time) fail as PyTorch does."""
    from dask_rmm import DeviceBuffer

    keep = DeviceBuffer(size=nbytes)
    if thread_state.key not in FAILED_ONCE:
        FAILED_ONCE.add(thread_state.key)
        raise OutOfMemoryError("CUDA out of memory. Tried to allocate 1.00 MiB")
    return keep.size


@gen_cluster(client=True, nthreads=[("127.0.0.1", 1)], config=CONFIG)
async def test_the_failed_runs_memory_is_free_before_the_task_runs_again(c, s, a):
    """The failed run's frames, kept by its error's traceback, hold its arrays: the second run
    needs that memory (5 MiB twice do not fit in 8)."""
    FAILED_ONCE.clear()
    await c.register_plugin(RMMPlugin(**POOL, memory_admission=True))
    assert await c.submit(grab_then_fail, 5 * MiB, key="grab-0") == 5 * MiB
    assert "grab-0" in FAILED_ONCE
