"""Memory admission on workers (host memory, ``base_resource="system"``): a task waits in the
worker's ``constrained`` state until its learned or annotated peak fits, through distributed's
worker resources, so that the scheduler and the worker's state machine both know it: it can be
cancelled without running, moved when its worker closes, and placed on a worker with room.
Nested work completes; a blocked task is admitted after a bounded wait; a failed task teaches
nothing; a device out-of-memory error (not a host one) runs the task once more."""

from __future__ import annotations

import asyncio
import functools
import logging
import sys
import threading
import time
from collections import Counter

import dask
import pytest
from conftest import HAS_GPU
from distributed import Worker, wait
from distributed.utils_test import gen_cluster
from distributed.worker import thread_state

from dask_rmm import RMMPlugin
from dask_rmm.pressure.admission import RESOURCE
from dask_rmm.wire import DeviceSample, device_entries
from dask_rmm.worker import admission as worker_admission
from dask_rmm.worker.admission import admission_of
from tests.worker.test_preload import scheduler, scheduler_process  # noqa: F401 (fixtures)

MiB = 1 << 20
POOL = dict(base_resource="system", pool_size="8MiB", maximum_pool_size="8MiB")
CONFIG = {"distributed.scheduler.work-stealing": False}

HOLD = threading.Event()
RUNS: Counter = Counter()
_lock = threading.Lock()
_running = [0, 0]  # now, most at once


def hold(nbytes: int, i: int, wait: bool = True) -> int:
    """Allocate ``nbytes`` from the worker's stack and keep them until HOLD is set."""
    from dask_rmm import DeviceBuffer

    with _lock:
        RUNS[thread_state.key] += 1
        _running[0] += 1
        _running[1] = max(_running)
    try:
        buf = DeviceBuffer(size=nbytes) if nbytes else None
        if wait:
            HOLD.wait(30)
        del buf
    finally:
        with _lock:
            _running[0] -= 1
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
    _running[:] = [0, 0]
    yield
    HOLD.set()
    # Every way a worker's admission ends (teardown, close, re-registration) ends its CuPy watch.
    cupy_hook = sys.modules.get("dask_rmm.allocators.cupy")
    left = list(cupy_hook._watchers) if cupy_hook is not None else []
    for owner in left:  # (then only the test that left it fails)
        cupy_hook.unwatch_cupy_allocations(owner)
    assert not left, "admission still watches CuPy"


def _states(worker: Worker) -> Counter:
    return Counter(ts.state for ts in worker.state.tasks.values())


async def _learn(c, nbytes: int = 3 * MiB, key: str = "hold-100") -> None:
    assert await c.submit(hold, nbytes, -1, False, key=key) == -1


@gen_cluster(client=True, nthreads=[("127.0.0.1", 4)], config=CONFIG)
async def test_tasks_wait_constrained_until_their_learned_peak_fits(c, s, a):
    await c.register_plugin(RMMPlugin(**POOL, memory_admission=True))
    assert a.state.total_resources[RESOURCE] == 8 * MiB
    await _learn(c)
    assert admission_of(a).peaks.expected("hold") >= 3 * MiB
    futures = c.map(hold, [3 * MiB] * 6, range(6), key=[f"hold-{i}" for i in range(6)])
    # 8 MiB: two tasks of 3 MiB fit; the others wait where distributed keeps tasks waiting
    # for resources, without a thread and without having run.
    await until(
        lambda: _states(a)["constrained"] == 4 and sum(RUNS.values()) == 3, "2 running, 4 waiting"
    )
    assert _states(a)["executing"] == 2
    assert s.tasks["hold-5"].resource_restrictions == {RESOURCE: 3 * MiB}
    HOLD.set()
    assert await c.gather(futures) == list(range(6))
    assert all(RUNS[f"hold-{i}"] == 1 for i in range(6))
    assert admission_of(a).metrics()["admission_total_held"] >= 4
    assert admission_of(a).pressure.metrics()[0].oom_count == 0


def hold_with(data, nbytes: int, i: int, wait: bool = True) -> int:
    """:func:`hold`, of a task that has an input (``data``: on the device beside it)."""
    return hold(nbytes, i, wait)


@gen_cluster(client=True, nthreads=[("127.0.0.1", 4)], config=CONFIG)
async def test_a_tasks_amount_counts_its_inputs_beside_its_learned_peak(c, s, a):
    """Tasks that grow by 2 MiB each and read a 1 MiB input: 3 of them need 9 MiB of the 8 MiB
    pool. Their amounts are the learned 2 MiB plus the input's bytes, so two run and one waits
    (before, amounts of 2 MiB let all three start, and the third ran out of memory)."""
    await c.register_plugin(RMMPlugin(**POOL, memory_admission=True))
    small = c.submit(make, 64, key="input-100")
    assert await c.submit(hold_with, small, 2 * MiB, -1, False, key="holdin-100") == -1
    learned = admission_of(a).peaks.expected("holdin")
    assert 2 * MiB <= learned < 3 * MiB
    inputs = c.map(make, [MiB] * 3, key=[f"input-{i}" for i in range(3)])
    await wait(inputs)
    futures = [c.submit(hold_with, inputs[i], 2 * MiB, i, key=f"holdin-{i}") for i in range(3)]
    await until(lambda: _states(a)["constrained"] == 1 and sum(RUNS.values()) == 3, "2 running")
    assert _states(a)["executing"] == 2
    amount = s.tasks["holdin-2"].resource_restrictions[RESOURCE]
    assert amount == learned + s.tasks["input-2"].nbytes and s.tasks["input-2"].nbytes >= MiB
    HOLD.set()
    assert await c.gather(futures) == [0, 1, 2]
    assert admission_of(a).pressure.metrics()[0].oom_count == 0


@gen_cluster(client=True, nthreads=[("127.0.0.1", 4)], config=CONFIG)
async def test_without_admission_the_same_tasks_run_out_of_memory(c, s, a):
    await c.register_plugin(RMMPlugin(**POOL))
    assert admission_of(a) is None and RESOURCE not in a.state.total_resources
    futures = c.map(hold, [3 * MiB] * 4, range(4), key=[f"hold-{i}" for i in range(4)])
    await until(lambda: sum(f.status == "error" for f in futures) == 2, "two failures")
    HOLD.set()
    await wait(futures)


@gen_cluster(client=True, nthreads=[("127.0.0.1", 4)], config=CONFIG)
async def test_an_annotated_peak_holds_tasks_back_before_any_is_learned(c, s, a):
    await c.register_plugin(RMMPlugin(**POOL, memory_admission=True))
    with dask.annotate(gpu_memory="3MiB"):
        futures = c.map(hold, [0] * 5, range(5), key=[f"noted-{i}" for i in range(5)])
    await until(lambda: _states(a)["constrained"] == 3, "3 constrained")
    assert _states(a)["executing"] == 2
    HOLD.set()
    assert await c.gather(futures) == list(range(5))


@gen_cluster(client=True, nthreads=[("127.0.0.1", 4)], config=CONFIG)
async def test_tasks_needing_no_memory_pass_held_back_ones(c, s, a):
    await c.register_plugin(RMMPlugin(**POOL, memory_admission=True))
    await _learn(c, 0, key="light-100")  # learned: needs nothing, never restricted
    with dask.annotate(gpu_memory="5MiB"):
        big = c.map(hold, [0] * 3, range(3), key=[f"big-{i}" for i in range(3)])
    await until(lambda: _states(a)["constrained"] == 2, "2 big ones constrained")
    light = c.map(hold, [0] * 2, range(2), [False] * 2, key=[f"light-{i}" for i in range(2)])
    assert await c.gather(light) == [0, 1]
    assert _states(a)["constrained"] == 2  # the big ones still wait
    HOLD.set()
    await c.gather(big)


@gen_cluster(client=True, nthreads=[("127.0.0.1", 4)], config=CONFIG)
async def test_custom_keys_with_numeric_tails_share_a_peak_and_fitting_tasks_run_side_by_side(
    c, s, a
):
    await c.register_plugin(RMMPlugin(**POOL, memory_admission=True))
    await _learn(c, 3 * MiB // 2, key="job_100")
    # job_0 .. job_3 are one prefix ("job"), learned at 1.5 MiB: all four fit in 8 MiB.
    futures = c.map(hold, [3 * MiB // 2] * 4, range(4), key=[f"job_{i}" for i in range(4)])
    await until(lambda: _running[0] == 4, "4 running at once")
    assert all(s.tasks[f"job_{i}"].resource_restrictions for i in range(4))
    HOLD.set()
    await c.gather(futures)


@gen_cluster(client=True, nthreads=[("127.0.0.1", 4)], config=CONFIG)
async def test_a_cancelled_waiting_task_never_runs(c, s, a):
    await c.register_plugin(RMMPlugin(**POOL, memory_admission=True))
    with dask.annotate(gpu_memory="5MiB"):
        futures = c.map(hold, [0] * 3, range(3), key=[f"big-{i}" for i in range(3)])
    await until(lambda: _states(a)["constrained"] == 2, "2 constrained")
    waiting = [f for f in futures if a.state.tasks[f.key].state == "constrained"]
    await waiting[0].cancel()
    await until(lambda: waiting[0].key not in a.state.tasks, "the worker to forget it")
    HOLD.set()
    await wait([f for f in futures if f is not waiting[0]])
    await asyncio.sleep(0.2)
    assert RUNS[waiting[0].key] == 0 and sum(RUNS.values()) == 2


@gen_cluster(client=True, nthreads=[("127.0.0.1", 2), ("127.0.0.1", 2)], config=CONFIG)
async def test_waiting_tasks_move_to_another_worker_when_theirs_closes(c, s, a, b):
    await c.register_plugin(RMMPlugin(**POOL, memory_admission=True))
    with dask.annotate(gpu_memory="5MiB", workers=[a.address], allow_other_workers=True):
        futures = c.map(hold, [0] * 2, range(2), key=[f"big-{i}" for i in range(2)])
    await until(lambda: _states(a)["constrained"] == 1, "1 constrained on a")
    (waiting,) = [f.key for f in futures if a.state.tasks[f.key].state == "constrained"]
    await a.close(executor_wait=False)
    HOLD.set()
    assert await c.gather(futures) == [0, 1]
    assert RUNS[waiting] == 1


CHILD_RAN = threading.Event()


def child() -> int:
    CHILD_RAN.set()
    return 1


def seceding_parent() -> bool:
    from distributed import secede

    secede()
    return CHILD_RAN.wait(15)


def worker_client_parent() -> int:
    from distributed import worker_client

    with worker_client() as client:
        with dask.annotate(gpu_memory="5MiB"):
            return client.submit(child, key="child-2").result(timeout=15)


def blocking_parent() -> int:
    from distributed import get_client

    with dask.annotate(gpu_memory="5MiB"):
        return get_client().submit(child, key="child-3").result(timeout=15)


@gen_cluster(client=True, nthreads=[("127.0.0.1", 2)], config=CONFIG)
async def test_a_task_that_secedes_gives_its_budget_to_the_tasks_it_waits_for(c, s, a):
    CHILD_RAN.clear()
    await c.register_plugin(RMMPlugin(**POOL, memory_admission=True))
    with dask.annotate(gpu_memory="5MiB"):
        parent = c.submit(seceding_parent, key="parent-1")
        await until(lambda: CHILD_RAN.is_set() or a.state.long_running, "the parent to secede")
        kid = c.submit(child, key="child-1")
    assert await parent is True and await kid == 1
    assert await c.submit(worker_client_parent, key="parent-2") == 1


@gen_cluster(client=True, nthreads=[("127.0.0.1", 2)], config=CONFIG)
async def test_a_task_blocked_without_seceding_is_let_through_after_a_bounded_wait(
    c, s, a, monkeypatch, caplog
):
    monkeypatch.setattr(worker_admission, "STALL_SECONDS", 0.5)
    await c.register_plugin(RMMPlugin(**POOL, memory_admission=True))
    with caplog.at_level(logging.WARNING, logger="dask_rmm.worker.admission"):
        with dask.annotate(gpu_memory="5MiB"):
            assert await c.submit(blocking_parent, key="parent-3") == 1
    (record,) = [r for r in caplog.records if "waited" in r.getMessage()]
    assert "child-3" in record.getMessage() and "parent-3" in record.getMessage()


def fails_once(error: BaseException) -> int:
    with _lock:
        RUNS[thread_state.key] += 1
        first = RUNS[thread_state.key] == 1
    if first:
        raise error
    return 1


class OutOfMemoryError(RuntimeError):
    """Named and placed as PyTorch's (``torch.OutOfMemoryError``): it does not pickle by
    reference here, so the worker tells it by its text."""

    __module__ = "torch"


def _torch_oom() -> BaseException:
    return OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")


@pytest.mark.parametrize(
    "make_error, runs_again, options, annotations",
    [
        # through the stack: room was made and the allocation retried in place already
        (
            lambda: __import__("dask_rmm.mr.base").mr.base.OutOfMemoryError("out of memory"),
            False,
            {},
            {},
        ),
        (_torch_oom, True, {}, {}),
        (
            lambda: RuntimeError(
                "CUDA error: CUBLAS_STATUS_ALLOC_FAILED when calling `cublasCreate(handle)`"
            ),
            True,
            {},
            {},
        ),
        (_torch_oom, False, {}, {"gpu_retry": False}),
        (_torch_oom, False, {"oom_retry": False}, {}),
        (lambda: MemoryError("Unable to allocate 8.00 GiB for an array"), False, {}, {}),  # NumPy's
    ],
    ids=["dask-rmm", "torch", "torch-cublas", "torch-annotated-off", "torch-option-off", "host"],
)
def test_only_pytorchs_own_device_out_of_memory_error_runs_the_task_again(
    make_error, runs_again, options, annotations, caplog
):
    @gen_cluster(client=True, nthreads=[("127.0.0.1", 1)], config=CONFIG)
    async def run(c, s, a):
        await c.register_plugin(RMMPlugin(**POOL, memory_admission=True, **options))
        with dask.annotate(**annotations):
            future = c.submit(fails_once, make_error(), key="once-0")
        await wait(future)
        assert RUNS["once-0"] == (2 if runs_again else 1)
        assert future.status == ("finished" if runs_again else "error")
        m = admission_of(a).pressure.metrics()[0]
        assert (m.task_retries, m.task_retries_succeeded) == (int(runs_again),) * 2
        logged = [r.getMessage() for r in caplog.records if "once more" in r.getMessage()]
        assert len(logged) == int(runs_again) and all("'once-0'" in m for m in logged)

    with caplog.at_level(logging.WARNING, logger="dask_rmm.worker.admission"):
        run()


def two_steps(nbytes: int, i: int) -> int:
    """Allocate ``nbytes``, work a while, then ``nbytes`` more (a merge's task making its input)."""
    from dask_rmm import DeviceBuffer

    with _lock:
        RUNS[thread_state.key] += 1
    first = DeviceBuffer(size=nbytes)
    time.sleep(0.3)
    second = DeviceBuffer(size=nbytes)
    del first, second
    return i


@gen_cluster(client=True, nthreads=[("127.0.0.1", 2)], config=CONFIG)
async def test_tasks_that_wait_for_each_others_memory_complete_one_giving_way_and_running_again(
    c, s, a
):
    """Two tasks of 3 MiB then 3 MiB more on an 8 MiB pool, at once, nothing learned yet: both
    wait for memory the other holds. One gives way (its allocation fails, freeing its first
    3 MiB), the other completes, and the one that gave way runs once more (counted, logged).
    Before, both gave up and both tasks failed."""
    await c.register_plugin(RMMPlugin(**POOL, memory_admission=True, spill_on_oom=True))
    futures = c.map(two_steps, [3 * MiB] * 2, range(2), key=["steps-0", "steps-1"])
    assert await c.gather(futures) == [0, 1]
    assert sorted(RUNS.values()) == [1, 2]
    m = admission_of(a).pressure.metrics()[0]
    assert (m.task_retries, m.task_retries_succeeded) == (1, 1)
    assert not admission_of(a).pressure.store.gave_way  # taken by the run again


@gen_cluster(client=True, nthreads=[("127.0.0.1", 2)], config=CONFIG)
async def test_a_task_whose_spilled_input_finds_no_room_to_come_back_runs_again(c, s, a):
    """A task of a learned 2 MiB reads a spilled 2 MiB input while a task of an unknown prefix
    holds 6 of the 8 MiB (no amount: its budget looks free): the input cannot come back, so the
    task fails before it starts. It runs once more (nothing of it ran), waiting until the holder
    ends, and then reads its input back. Before, the task failed for good."""
    await c.register_plugin(RMMPlugin(**POOL, memory_admission=True, spill_on_oom=True))
    store = admission_of(a).pressure.store
    small = c.submit(make, 64, key="input-100")
    assert await c.submit(hold_with, small, 2 * MiB, -1, False, key="holdin-100") == -1
    x = c.submit(make, 2 * MiB, key="input-0")
    await wait(x)
    holder = c.submit(hold, 6 * MiB, 0, key="unknown-0")  # spills input-0 to make room
    await until(lambda: RUNS["unknown-0"] == 1 and "input-0" in store.spilled_keys(), "spilled")
    store.wait_limit = 0.3  # the read-back's wait, on the event loop
    future = c.submit(hold_with, x, 2 * MiB, 1, False, key="holdin-1")
    await until(lambda: admission_of(a).pressure.metrics()[0].task_retries == 1, "a retry")
    assert future.status == "pending" and list(store.unread) == ["input-0"]
    HOLD.set()
    assert await future == 1 and await holder == 0
    assert not store.unread  # read back at last
    assert RUNS["holdin-1"] == 1  # its first try never started
    m = admission_of(a).pressure.metrics()[0]
    assert (m.task_retries, m.task_retries_succeeded) == (1, 1)


def test_the_oom_retry_option_means_the_same_everywhere():
    from dask_rmm.preload import PROG, dask_setup, plugin_from_flags
    from dask_rmm.stack.options import RMMOptions

    assert RMMOptions().oom_retry and not RMMPlugin(oom_retry=False).options.oom_retry
    assert not plugin_from_flags(rmm_oom_retry=False).options.oom_retry
    with dask_setup.make_context(PROG, ["--no-rmm-oom-retry"]) as ctx:
        assert ctx.params["rmm_oom_retry"] is False
    with dask.config.set({"dask-rmm.oom-retry": False}):
        assert not RMMPlugin().options.oom_retry
    with pytest.raises(TypeError, match="oom_retry"):
        RMMOptions(oom_retry="sometimes")


def fails(nbytes: int) -> None:
    from dask_rmm import DeviceBuffer

    buf = DeviceBuffer(size=nbytes)
    raise ValueError(f"failed holding {buf.size}")


@gen_cluster(client=True, nthreads=[("127.0.0.1", 2)], config=CONFIG)
async def test_a_failed_task_teaches_nothing(c, s, a):
    await c.register_plugin(RMMPlugin(**POOL, memory_admission=True))
    await wait(c.submit(fails, 3 * MiB, key="fails-0"))
    await _learn(c, 3 * MiB, key="ok-0")
    assert admission_of(a).peaks.expected("fails") is None
    assert admission_of(a).peaks.expected("ok") >= 3 * MiB


@gen_cluster(client=True, nthreads=[("127.0.0.1", 4)], config=CONFIG)
async def test_registering_while_tasks_run_guards_later_tasks_and_unregistering_frees_them(c, s, a):
    running = c.submit(hold, 0, -1, key="early-0")
    await until(lambda: RUNS["early-0"] == 1, "a task running before the registration")
    await c.register_plugin(RMMPlugin(**POOL, memory_admission=True))
    with dask.annotate(gpu_memory="3MiB"):
        futures = c.map(hold, [0] * 3, range(3), key=[f"late-{i}" for i in range(3)])
    await until(lambda: _states(a)["constrained"] == 1, "a later task constrained")
    await c.unregister_worker_plugin("dask-rmm")
    await until(lambda: sum(RUNS[f"late-{i}"] for i in range(3)) == 3, "all 3 running")
    HOLD.set()
    assert await c.gather(futures) == list(range(3)) and await running == -1
    assert all(RUNS[f"late-{i}"] == 1 for i in range(3))


def make(nbytes: int) -> bytes:
    from dask_rmm import DeviceBuffer

    return DeviceBuffer(size=nbytes)


def use(x, nbytes: int) -> int:
    return hold(nbytes, 0, False)


def _free_budgets(dask_scheduler) -> dict:
    plugin = dask_scheduler.plugins.get("dask-rmm-admission")
    return {} if plugin is None else {w: plugin.free(w) for w in plugin.limits}


class HostBlockCache:
    """A library cache on host memory, in the place of CuPy's ``MemoryPool``: blocks drawn from
    the worker's stack, kept when their arrays go, handed out again without the stack seeing
    it; CuPy allocates through :meth:`malloc`."""

    name = "host-blocks"

    def __init__(self) -> None:
        self.free: list[tuple[int, int]] = []  # (ptr, nbytes)

    def draw(self, nbytes: int) -> None:
        from dask_rmm.mr import get_current_device_resource

        self.free.append((get_current_device_resource().allocate(nbytes), nbytes))

    def malloc(self, nbytes: int):
        import cupy

        (block,) = [b for b in self.free if b[1] == nbytes][:1]
        self.free.remove(block)
        back = functools.partial(self.free.append, block)  # when CuPy drops the memory
        memory = cupy.cuda.memory.UnownedMemory(block[0], nbytes, _Owner(back), 0)
        return cupy.cuda.MemoryPointer(memory, 0)

    def cached_bytes(self, device: int) -> int:
        return sum(n for _, n in self.free)

    def release(self, device: int) -> int:
        from dask_rmm.mr import get_current_device_resource

        mr, free = get_current_device_resource(), list(self.free)
        for block in free:
            self.free.remove(block)
            mr.deallocate(*block)
        return sum(n for _, n in free)


class _Owner:
    def __init__(self, on_drop) -> None:
        self.on_drop = on_drop

    def __del__(self) -> None:
        self.on_drop()


def brief_cupy(nbytes: int) -> int:
    """An array served by the cache, gone long before the next tick."""
    import cupy

    x = cupy.empty(nbytes, dtype="uint8")
    del x
    return nbytes


@gen_cluster(client=True, nthreads=[("127.0.0.1", 1)], config=CONFIG)
async def test_a_brief_cupy_task_served_by_a_cache_is_learned_at_its_peak(c, s, a):
    cupy = pytest.importorskip("cupy")
    from dask_rmm.allocators import caches

    cache, original = HostBlockCache(), cupy.cuda.get_allocator()
    cupy.cuda.set_allocator(cache.malloc)  # CuPy's choice before the worker's setup
    try:
        await c.register_plugin(RMMPlugin(**POOL, memory_admission=True))
        caches.register_cache(cache)
        cache.draw(3 * MiB)  # drawn before: the tasks' arrays come from the cache alone
        stack = admission_of(a).pressure.devices[0].statistics
        for i in range(5):
            assert await c.submit(brief_cupy, 3 * MiB, key=f"brief-{i}") == 3 * MiB
            assert admission_of(a).peaks.expected("brief") >= 3 * MiB, i
        assert stack.allocation_counts.total_count == 1  # the one draw
        assert cache.release(0) == 3 * MiB
        await c.unregister_worker_plugin("dask-rmm")
        assert cupy.cuda.get_allocator() == cache.malloc  # the watch is off
    finally:
        cupy.cuda.set_allocator(original)


#: The stacks placement runs on: a pool of 8 MiB, and no pool under a device_memory_limit of
#: 8 MiB (two workers sharing one device, each with its own limit).
PLACEMENT_STACKS = {
    "pool": dict(pool_size="8MiB", maximum_pool_size="8MiB"),
    "limit": dict(device_memory_limit="8MiB"),
}


@pytest.mark.parametrize("base", ["system"] + (["cuda"] if HAS_GPU else []))
@pytest.mark.parametrize("stack, admission", [("pool", True), ("limit", True), ("limit", False)])
def test_a_task_goes_to_the_worker_whose_free_budget_fits_it(base, stack, admission):
    """Two worker processes (each its own stack; on a GPU host, sharing the device): a holds 5 of
    its 8 MiB in an output; a task needing 4 MiB whose input is on a goes to b, where
    distributed alone picks a (the input's worker)."""
    from distributed import Client, LocalCluster

    with (
        dask.config.set(CONFIG),
        LocalCluster(
            n_workers=2, threads_per_worker=2, processes=True, host="127.0.0.1",
            dashboard_address=":0", worker_dashboard_address=None,
        ) as cluster,
        Client(cluster) as c,
    ):  # fmt: skip
        options = PLACEMENT_STACKS[stack]
        c.register_plugin(RMMPlugin(base_resource=base, **options, memory_admission=admission))
        a, b = sorted(c.scheduler_info()["workers"])
        # Kept: a future dropped here releases the output, and a's 5 MiB with it.
        held = c.submit(make, 5 * MiB, key="held-0", workers=[a])
        wait(held)
        deadline = time.monotonic() + 20
        while admission and c.run_on_scheduler(_free_budgets).get(a, 8 * MiB) > 3 * MiB:
            assert time.monotonic() < deadline, c.run_on_scheduler(_free_budgets)
            time.sleep(0.05)
        small = c.submit(int, 1, key="small-0", workers=[a])
        with dask.annotate(gpu_memory="4MiB"):
            task = c.submit(use, small, MiB, key="use-0")
        wait(task)
        assert task.status == "finished" and held.status == "finished"
        assert c.who_has(task)["use-0"] == ((b,) if admission else (a,))


@gen_cluster(client=True, nthreads=[("127.0.0.1", 4)], config=CONFIG)
async def test_held_back_figures_reach_the_heartbeat_and_the_report(c, s, a):
    from dask_rmm.client.fetch import fetch_report_data
    from dask_rmm.report.memory_report import ClusterMemoryReport

    await c.register_plugin(RMMPlugin(**POOL, memory_admission=True))
    await _learn(c)
    futures = c.map(hold, [3 * MiB] * 4, range(4), key=[f"hold-{i}" for i in range(4)])
    await until(lambda: _states(a)["constrained"] == 2, "2 constrained")
    d = device_entries(a.metrics["dask-rmm"](a))["0"]
    # a task that passed "constrained" on its way to a free thread on a loaded host counts
    # as held back too (it waited more than the threshold): at least the 2 waiting now
    assert d["admission_held_tasks"] == 2 and d["admission_total_held"] >= 2
    assert DeviceSample.from_dict(d).admission_expected_peaks == (("hold", 3 * MiB, 1),)
    await a.heartbeat()
    report = ClusterMemoryReport.from_dict(await fetch_report_data(c.scheduler, timeline=False))
    assert report.device(a.address).admission_held_tasks == 2
    assert "memory admission:" in str(report) and "2 held back now" in str(report)
    HOLD.set()
    await c.gather(futures)


def test_the_option_means_the_same_everywhere():
    from dask_rmm.preload import PROG, dask_setup, plugin_from_flags
    from dask_rmm.stack.options import RMMOptions

    assert RMMPlugin(memory_admission=True).options.memory_admission
    assert plugin_from_flags(rmm_memory_admission=True).options.memory_admission
    with dask_setup.make_context(PROG, ["--rmm-memory-admission"]) as ctx:
        assert ctx.params["rmm_memory_admission"] is True
    assert not RMMOptions().memory_admission
    with dask.config.set({"dask-rmm.memory-admission": True}):
        assert RMMPlugin().options.memory_admission
    with pytest.raises(TypeError, match="memory_admission"):
        RMMOptions(memory_admission="sometimes")


@pytest.mark.slow
def test_a_preloaded_worker_supplies_its_budget_and_holds_tasks_back(scheduler):  # noqa: F811
    """``dask worker --preload dask_rmm.preload --rmm-memory-admission``: set up before the
    worker registers, it supplies its budget with its registration."""
    from distributed import Client

    from tests.worker.test_preload import _start_worker, _stop

    flags = ["--rmm-base-resource", "system", "--rmm-pool-size", "8MiB"]
    flags += ["--rmm-maximum-pool-size", "8MiB", "--rmm-memory-admission", "--nthreads", "2"]
    worker = _start_worker(scheduler, *flags, name="admission-1")
    try:
        with Client(scheduler, timeout="60s") as c:
            c.wait_for_workers(1, timeout=60)
            (resources,) = c.run(_total_resources).values()
            assert resources == {RESOURCE: 8 * MiB}
            with dask.annotate(gpu_memory="5MiB"):
                naps = c.map(time.sleep, [0.2] * 2, key=["nap-0", "nap-1"])
            wait(naps)
            (spans,) = c.run(_compute_spans).values()  # while naps holds them on the worker
            first, second = sorted(spans.values())
            assert second[0] >= first[1]  # one after the other: 2 x 5 MiB do not fit in 8
    finally:
        _stop(worker)


# Lambdas are pickled by value: this test module is not importable in the worker process.
_total_resources = lambda dask_worker: dict(dask_worker.state.total_resources)  # noqa: E731
_compute_spans = lambda dask_worker: {  # noqa: E731
    k: next((s["start"], s["stop"]) for s in ts.startstops if s["action"] == "compute")
    for k, ts in dask_worker.state.tasks.items()
}
