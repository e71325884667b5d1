"""DeviceSpillStore and SpillOnDemandResourceAdaptor on host memory: spilling to a limit and on
out-of-memory, bit-identical reads, referenced values left alone, OOM snapshots and verdicts,
and several threads allocating while spilling."""

from __future__ import annotations

import json
import threading
import time

import pytest
from distributed.spill import SpillBuffer

from dask_rmm import DeviceBuffer
from dask_rmm.mr.base import OutOfMemoryError
from dask_rmm.pressure import HostCopy
from dask_rmm.pressure.forensics import DEMAND, FRAGMENTATION, OOMEvent
from dask_rmm.stack.build import DeviceStack
from tests.pressure_helpers import MiB, check_buffer, patterned_buffer, pressure_stack


def test_store_is_a_mapping_over_the_inner_one():
    wp, top = pressure_stack()
    store = wp.store
    store["plain"] = 5
    store["buf"] = patterned_buffer(1000, 1)
    assert store.inner == {"plain": 5}  # device values stay in the store itself
    assert sorted(store) == ["buf", "plain"] and len(store) == 2 and "buf" in store
    check_buffer(store["buf"], 1)
    store["buf"] = 7  # replacing a device value by a host one
    assert store.inner == {"plain": 5, "buf": 7} and store.device_bytes() == 0
    del store["buf"]
    del store["plain"]
    assert len(store) == 0
    with pytest.raises(KeyError):
        store["buf"]


def test_spill_on_oom_serves_more_than_the_pool_bit_identical():
    wp, top = pressure_stack(4 * MiB, spill_on_oom=True)
    store = wp.store
    for i in range(12):  # 3x the pool
        store[f"x-{i}"] = patterned_buffer(MiB, i)
    m = wp.metrics()[0]
    assert m.spilled_count >= 8 and m.ooms_avoided >= 8 and m.oom_count == 0
    assert all(isinstance(store.inner[k], HostCopy) for k in store.spilled_keys())
    for i in range(12):
        check_buffer(store[f"x-{i}"], i)
    m = wp.metrics()[0]
    assert m.total_unspilled_count >= 8
    assert m.spilled_bytes == m.spilled_count * MiB


def test_without_spilling_the_same_work_fails():
    wp, top = pressure_stack(4 * MiB, spill_on_oom=False)
    with pytest.raises(OutOfMemoryError):
        for i in range(12):
            wp.store[f"x-{i}"] = patterned_buffer(MiB, i)
    assert wp.metrics()[0].oom_count == 1


def test_limit_keeps_device_bytes_under_it():
    wp, top = pressure_stack(8 * MiB, limit=3 * MiB, spill_on_oom=False)
    store = wp.store
    dp = wp.devices[0]
    for i in range(10):
        store[f"x-{i}"] = patterned_buffer(MiB, i)
        assert dp.current_bytes() <= 3 * MiB
    assert wp.metrics()[0].device_memory_limit == 3 * MiB
    # least recently used first: the newest are on the device
    assert sorted(store.spilled_keys()) == sorted(f"x-{i}" for i in range(7))
    for i in range(10):
        check_buffer(store[f"x-{i}"], i)


def test_referenced_values_are_not_spilled():
    wp, top = pressure_stack(4 * MiB, spill_on_oom=True)
    store = wp.store
    held = [patterned_buffer(MiB, i) for i in range(3)]
    for i, b in enumerate(held):
        store[f"held-{i}"] = b  # also referenced by ``held``, like a running task's argument
    store["free"] = patterned_buffer(MiB, 9)
    patterned_buffer(MiB, 10)  # fits after spilling "free" only
    assert store.spilled_keys() == ["free"]
    with pytest.raises(OutOfMemoryError):
        DeviceBuffer(size=2 * MiB)  # only held values are left
    (event,) = wp.oom_events()
    assert event.requested == 2 * MiB


def test_demand_verdict_and_snapshot_contents(tmp_path):
    keys = iter(["big-task-1"] * 100)
    wp, top = pressure_stack(4 * MiB, spill_on_oom=True, task_key=lambda: "load-1")
    store = wp.store
    store["a"] = patterned_buffer(MiB, 1)
    wp.devices[0].task_key = lambda: next(keys)
    with pytest.raises(OutOfMemoryError):
        DeviceBuffer(size=5 * MiB)
    (event,) = wp.oom_events()
    assert event.verdict == DEMAND
    assert event.requested == 5 * MiB and event.maximum_pool_size == 4 * MiB
    assert event.task_key == "big-task-1" and event.task_prefix == "big-task"
    assert event.spilled_trying == 0 and store.spilled_keys() == []  # hopeless: nothing moved
    assert ("load", MiB) in event.live_bytes_by_prefix
    assert event.recent_events[-1][1:3] == ("fail", 5 * MiB)
    assert any(e[1] == "alloc" and e[2] == MiB for e in event.recent_events)
    assert sum(c for _, c, _ in event.free_block_histogram) >= 1
    event.save(tmp_path / "oom.json")
    assert OOMEvent.from_dict(json.loads((tmp_path / "oom.json").read_text())) == event


def test_fragmentation_verdict():
    wp, top = pressure_stack(4 * MiB, spill_on_oom=False)
    blocks = [DeviceBuffer(size=512 << 10) for _ in range(8)]
    del blocks[::2]  # 2 MiB free in four 512 KiB holes
    with pytest.raises(OutOfMemoryError):
        DeviceBuffer(size=MiB)
    (event,) = wp.oom_events()
    assert event.verdict == FRAGMENTATION
    assert event.free_bytes == 2 * MiB and event.largest_free_block == 512 << 10
    assert event.free_block_histogram == [(512 << 10, 4, 2 * MiB)]


def test_spill_on_oom_cures_fragmentation_with_the_fewest_bytes():
    wp, top = pressure_stack(4 * MiB, spill_on_oom=True)
    store = wp.store
    held = []
    for i in range(8):
        b = patterned_buffer(512 << 10, i)
        if i in (1, 3, 5):
            store[f"s-{i}"] = b  # spillable
        elif i in (0, 2, 4, 6):
            held.append(b)  # referenced elsewhere
        # block 7 is freed: a 512 KiB hole at the end, next to block 6 (held) only
    del b
    # Freeing s-5 merges with nothing; the only 1 MiB window is s-? + hole... build one:
    del held[3]  # block 6 freed: blocks 6 and 7 form a 1 MiB hole
    big = DeviceBuffer(size=MiB + (256 << 10))  # needs block 5 + the hole
    assert store.spilled_keys() == ["s-5"]  # not the least recently used s-1
    assert wp.metrics()[0].ooms_avoided == 1
    del big
    for i in (1, 3, 5):
        check_buffer(store[f"s-{i}"], i)


def test_spilled_values_go_on_to_disk_through_a_spill_buffer(tmp_path):
    wp, top = pressure_stack(4 * MiB, spill_on_oom=True)
    store = wp.store
    store.inner = SpillBuffer(str(tmp_path), target=MiB)
    for i in range(8):
        store[f"x-{i}"] = patterned_buffer(MiB, i)
    assert store.inner.slow  # distributed's own host spilling moved host copies to disk
    assert store.fast is store.inner.fast  # its attributes are reachable for the memory monitor
    for i in range(8):
        check_buffer(store[f"x-{i}"], i)


def test_threads_allocating_while_spilling_neither_deadlock_nor_corrupt():
    wp, top = pressure_stack(8 * MiB, spill_on_oom=True)
    store = wp.store
    errors = []
    kept: dict[str, int] = {}
    lock = threading.Lock()

    def work(t: int) -> None:
        try:
            for i in range(40):
                value = t * 1000 + i
                size = (64 << 10) * (1 + (i * 7 + t) % 8)
                buf = patterned_buffer(size, value)
                tmp = patterned_buffer(128 << 10, value + 1)  # a temporary, as in a task
                check_buffer(tmp, value + 1)
                del tmp
                key = f"t{t}-{i}"
                with lock:
                    store[key] = buf
                    kept[key] = value
                del buf
                if i % 5 == 4:  # read an older one back: unspills while others spill
                    old = f"t{t}-{i - 3}"
                    check_buffer(store[old], kept[old])
        except BaseException as e:  # pragma: no cover - reported below
            errors.append(e)

    threads = [threading.Thread(target=work, args=(t,)) for t in range(4)]
    for th in threads:
        th.start()
    for th in threads:
        th.join(120)
    assert not any(th.is_alive() for th in threads), "deadlock: threads still running"
    # At most 4 x (512 + 128 + 512) KiB is referenced by the threads at any time, well under
    # the 8 MiB pool: every allocation can be served by spilling (or by waiting for another
    # thread to let go of a block), so no OutOfMemoryError at all.
    assert not errors, errors
    assert wp.oom_events() == []
    assert wp.metrics()[0].total_spilled_count > 0
    for key, value in kept.items():
        check_buffer(store[key], value)


def test_a_value_referenced_while_being_copied_does_not_end_spill_on_oom():
    """A sampling profiler (distributed's worker samples its task threads every 10 ms with
    ``sys._current_frames()``) makes frame objects of the spilling thread's stack; such a
    frame object outlives its call and keeps its locals, the value being spilled among them,
    so the value looks referenced right after its copy and is kept on the device. That spill
    freed nothing; spill-on-OOM used to give up there (an OutOfMemoryError with nothing
    referenced by any task). Here the first copies of all four values are "sampled" and
    another thread drops the samples whenever it gets to run: the allocation must succeed."""
    import sys

    from dask_rmm.pressure import device_objects

    wp, top = pressure_stack(4 * MiB, spill_on_oom=True)
    store = wp.store
    store.wait_retries = 10_000  # when the other thread runs is up to the OS, not this test
    store.wait_limit = 120.0
    for i in range(4):
        store[f"x-{i}"] = patterned_buffer(MiB, i)
    samples = []
    allocations, spill = device_objects._handlers(DeviceBuffer)

    def sampled_spill(buf):
        if dropper.ident is None:  # a profiler tick during each of the first four copies
            samples.append(sys._getframe())
            if len(samples) == 4:
                dropper.start()
        return spill(buf)

    dropper = threading.Thread(target=samples.clear)
    rebuild = device_objects._REBUILD["DeviceBuffer"]
    device_objects.register_device_type(
        DeviceBuffer, allocations, sampled_spill, "DeviceBuffer", rebuild
    )
    try:
        big = patterned_buffer(2 * MiB, 9)
    finally:
        device_objects.register_device_type(
            DeviceBuffer, allocations, spill, "DeviceBuffer", rebuild
        )
        dropper.join(30)
    check_buffer(big, 9)
    assert wp.oom_events() == [] and wp.metrics()[0].ooms_avoided == 1
    del big
    for i in range(4):
        check_buffer(store[f"x-{i}"], i)


def test_spill_on_oom_keeps_waiting_while_its_victims_are_let_go_and_taken_again():
    """A value let go and referenced again by the time it is copied (a profiler that samples
    every copy and drops its samples while the allocation waits) is memory that changes:
    each wait finds the same state as the last, yet spill-on-OOM must not count that as
    nothing happening and give up after ``wait_retries`` polls."""
    import sys

    from dask_rmm.pressure import device_objects

    wp, top = pressure_stack(4 * MiB, spill_on_oom=True)
    store = wp.store
    store.wait_retries = 3
    store.wait_limit = 120.0
    for i in range(4):
        store[f"x-{i}"] = patterned_buffer(MiB, i)
    samples = []
    copies = 0
    allocations, spill = device_objects._handlers(DeviceBuffer)

    def sampled_spill(buf):
        nonlocal copies
        copies += 1
        if copies <= 24:  # six rounds of four copies, then the profiler stops
            samples.append(sys._getframe())
        return spill(buf)

    def activity() -> int:  # called once per poll of the wait: the samples are dropped there
        samples.clear()
        return 0

    pool = top.handler.pool
    rebuild = device_objects._REBUILD["DeviceBuffer"]
    device_objects.register_device_type(
        DeviceBuffer, allocations, sampled_spill, "DeviceBuffer", rebuild
    )
    try:
        ptr, error, spilled = store.spill_until(
            lambda: pool.allocate(2 * MiB),
            2 * MiB,
            device=0,
            layout=pool.memory_layout,
            activity=activity,
        )
    finally:
        device_objects.register_device_type(
            DeviceBuffer, allocations, spill, "DeviceBuffer", rebuild
        )
    assert error is None and spilled == 2 * MiB and copies > 24
    pool.deallocate(ptr, 2 * MiB)
    for i in range(4):
        check_buffer(store[f"x-{i}"], i)


def _thread_task() -> str | None:
    """Each thread but the main one a task (its name the key): a worker's task threads; the
    main thread plays the event loop (no task)."""
    thread = threading.current_thread()
    return None if thread is threading.main_thread() else thread.name


def test_an_allocation_waits_for_another_threads_temporary():
    """Nothing to spill, but another thread is about to free its temporary: the failed
    allocation retries while memory changes instead of giving up at once."""
    wp, top = pressure_stack(4 * MiB, spill_on_oom=True)
    wp.store.wait_retries = 10_000  # this test is not about how long a wait lasts
    holding = threading.Event()

    def task():
        tmp = DeviceBuffer(size=3 * MiB)
        holding.set()
        for _ in range(20):  # works a little (small allocations), then lets go
            DeviceBuffer(size=256)
            threading.Event().wait(0.002)
        del tmp

    th = threading.Thread(target=task)
    th.start()
    holding.wait(30)
    buf = DeviceBuffer(size=2 * MiB)
    th.join(30)
    assert buf.size == 2 * MiB and wp.oom_events() == []


def test_an_allocation_waits_for_a_running_task_that_frees_nothing_for_a_while():
    """Nothing to spill and no free for longer than ``wait_retries`` polls, but another task
    runs (the first wave of a graph: every task making its input, none done): the failed
    allocation keeps waiting while a task not waiting itself runs, and gets the memory when that
    task ends. Before, it gave up after ``wait_retries`` quiet polls (an H100 merge failed so)."""
    wp, top = pressure_stack(4 * MiB, spill_on_oom=True)
    store = wp.store
    store.wait_retries, store.wait_limit = 5, 60.0  # 10 ms of quiet, a minute at most
    running = {"waiting task"}
    store.running_tasks = lambda: len(running)
    holding, done = threading.Event(), threading.Event()

    def task():
        running.add("holding task")
        tmp = DeviceBuffer(size=3 * MiB)
        holding.set()
        done.wait(30)  # works without allocating, far longer than 5 quiet polls
        del tmp
        running.discard("holding task")

    th = threading.Thread(target=task)
    th.start()
    holding.wait(30)
    threading.Timer(0.5, done.set).start()
    t0 = time.monotonic()
    buf = DeviceBuffer(size=2 * MiB)
    waited = time.monotonic() - t0
    th.join(30)
    assert buf.size == 2 * MiB and wp.oom_events() == []
    assert waited >= 0.4  # it did wait for the task's end
    assert store._waiters == {}


@pytest.mark.parametrize("in_task", [True, False])
def test_a_tasks_allocation_waits_while_memory_keeps_changing_past_the_wait_limit(in_task):
    """Another task frees a piece every 0.1 s for about a second, and only then what this one
    needs: a task's allocation waits on while memory changes (``wait_limit`` counts from the last
    change), where the event loop's (no task) gives up after ``wait_limit`` (its waits stall the
    heartbeat). Before, a task gave up after ``wait_limit`` from its first wait, with frees still
    coming: an 8-thread merge's long waiters all failed together after 5 s of tasks giving way."""
    wp, top = pressure_stack(
        4 * MiB, spill_on_oom=True, task_key=(lambda: "join-1") if in_task else None
    )
    store = wp.store
    store.wait_limit = 0.3
    store.running_tasks = lambda: 2  # the freeing task runs beside the waiting one
    holding = threading.Event()

    def task():
        pieces = [DeviceBuffer(size=MiB // 8) for _ in range(10)]
        tmp = DeviceBuffer(size=2 * MiB)
        holding.set()
        while pieces:  # 10 frees 0.1 s apart, each too small for the 2 MiB asked
            threading.Event().wait(0.1)
            del pieces[-1]
        del tmp

    th = threading.Thread(target=task)
    th.start()
    holding.wait(30)
    t0 = time.monotonic()
    try:
        buf = DeviceBuffer(size=2 * MiB)
    except MemoryError:
        buf = None
    waited = time.monotonic() - t0
    th.join(30)
    if in_task:
        assert buf is not None and buf.size == 2 * MiB and wp.oom_events() == []
        assert waited >= 0.8  # past three wait_limits, while the frees came
    else:
        assert buf is None and waited < 0.8 and len(wp.oom_events()) == 1
    assert store._waiters == {}


def test_the_event_loops_wait_waits_for_a_running_task_and_takes_no_turn_to_give_way():
    """The event loop bringing an input back (no task on its thread: the reading task executes
    meanwhile) while another task holds the memory and runs: the loop waits for it. Its wait
    takes no give-way turn (its failure frees nothing)."""
    wp, top = pressure_stack(4 * MiB, spill_on_oom=True, task_key=_thread_task)
    store = wp.store
    store.wait_retries, store.wait_limit = 5, 30.0
    running = set()  # the task whose input the loop brings back has no thread yet
    store.running_tasks = lambda: len(running)
    holding = threading.Event()

    def task():
        running.add("holder")
        tmp = DeviceBuffer(size=3 * MiB)
        holding.set()
        time.sleep(0.5)  # works without allocating
        del tmp
        running.discard("holder")

    th = threading.Thread(target=task, name="holder")
    th.start()
    holding.wait(30)
    buf = DeviceBuffer(size=2 * MiB)  # on the main thread: the event loop's read-back
    th.join(30)
    assert buf.size == 2 * MiB and wp.oom_events() == []
    assert store._give_way_until == 0.0 and store._waiters == {}


def test_of_a_task_and_the_event_loop_waiting_for_each_other_the_task_gives_way():
    """A task holding 3 MiB of a 4 MiB pool and needing 1.5 MiB more, and the event loop bringing
    back another task's 2 MiB input: each waits for what the other would free. The task gives
    way (noted for a run again) and the loop's read-back then gets its memory. Before, the loop
    could take the give-way turn itself, failing its task and freeing nothing."""
    wp, top = pressure_stack(4 * MiB, spill_on_oom=True, task_key=_thread_task)
    store = wp.store
    store.wait_retries, store.wait_limit = 5, 30.0
    running = {"holder"}  # the reading task has no thread yet
    store.running_tasks = lambda: len(running)
    holding, failed = threading.Event(), []

    def task():
        tmp = DeviceBuffer(size=3 * MiB)
        holding.set()
        time.sleep(0.05)  # the loop waits first
        try:
            DeviceBuffer(size=MiB + MiB // 2)
        except MemoryError:
            failed.append(True)
        finally:
            del tmp
            running.discard("holder")

    th = threading.Thread(target=task, name="holder")
    th.start()
    holding.wait(30)
    buf = DeviceBuffer(size=2 * MiB)  # the event loop's read-back
    th.join(30)
    assert buf.size == 2 * MiB and failed == [True]
    assert list(store.gave_way) == ["holder"] and store._waiters == {}


def test_allocations_that_wait_for_each_other_give_up():
    """Two running tasks, both waiting for memory the other holds: neither may wait for the
    other's end (each counts as waiting), so both give up after ``wait_retries`` quiet polls
    instead of waiting until ``wait_limit``."""
    wp, top = pressure_stack(4 * MiB, spill_on_oom=True, task_key=_thread_task)
    store = wp.store
    store.wait_retries, store.wait_limit = 5, 60.0
    running = {0, 1}  # a task ends when its allocation fails (a worker's executing tasks)
    store.running_tasks = lambda: len(running)
    held = [DeviceBuffer(size=MiB + MiB // 2) for _ in range(2)]
    both = threading.Barrier(2)
    results: dict = {}

    def task(i: int) -> None:
        both.wait(30)
        t0 = time.monotonic()
        try:
            DeviceBuffer(size=2 * MiB)
        except MemoryError as e:
            results[i] = (e, time.monotonic() - t0)
        finally:
            running.discard(i)

    threads = [threading.Thread(target=task, args=(i,)) for i in range(2)]
    for th in threads:
        th.start()
    for th in threads:
        th.join(60)
    assert sorted(results) == [0, 1]
    assert all(took < 30 for _, took in results.values())  # not the minute of wait_limit
    del held
    assert store._waiters == {}


@pytest.mark.parametrize("spill_on_oom", [True, False])
def test_a_task_whose_allocation_failed_frees_its_buffers_as_the_error_leaves_it(spill_on_oom):
    """The error of an allocation that failed (after waiting, or at once) holds no frame that
    holds it: when it leaves the task, the task's buffers are freed at once, not when the cyclic
    collector runs (a task that gave way must free what the others wait for)."""
    import gc

    wp, top = pressure_stack(4 * MiB, spill_on_oom=spill_on_oom)
    wp.store.wait_retries = 2

    def task() -> None:
        mine = DeviceBuffer(size=2 * MiB)
        DeviceBuffer(size=3 * MiB)
        del mine

    gc.disable()
    try:
        try:
            task()
        except MemoryError:
            pass  # the error is let go here (pytest.raises would keep it)
        else:
            pytest.fail("the allocation of 3 MiB did not fail")
        assert wp.devices[0].current_bytes() == 0
    finally:
        gc.enable()


def test_of_tasks_waiting_for_each_others_memory_one_gives_way_and_the_others_go_on():
    """Two running tasks, each holding 1.5 MiB of a 4 MiB pool and needing 1.25 MiB more (what
    either frees makes room, wherever the pool put it): both wait for each other. One gives up
    (and is noted as having given way, for a run again); the other waits on for its frees (which
    come 0.1 s after its error, as a task's exception unwinds) and then completes. Before, both
    gave up after ``wait_retries`` quiet polls (the first wave of an H100 merge failed so,
    2026-12-07)."""
    wp, top = pressure_stack(4 * MiB, spill_on_oom=True, task_key=_thread_task)
    store = wp.store
    store.wait_retries, store.wait_limit = 5, 30.0
    running = {0, 1}
    store.running_tasks = lambda: len(running)
    both = threading.Barrier(2)
    failed: list = []

    def task(i: int) -> None:
        mine = DeviceBuffer(size=MiB + MiB // 2)
        both.wait(30)
        try:
            more = DeviceBuffer(size=MiB + MiB // 4)
            del more
        except MemoryError:  # the adaptor noted the task (its thread's name) as giving way
            failed.append(i)
            time.sleep(0.1)  # the error unwinds before the task's buffers are freed
        finally:
            del mine
            running.discard(i)

    threads = [threading.Thread(target=task, args=(i,), name=f"task-{i}") for i in range(2)]
    for th in threads:
        th.start()
    for th in threads:
        th.join(60)
    assert len(failed) == 1, failed
    assert list(store.gave_way) == [f"task-{failed[0]}"]
    assert store._waiters == {}


def test_an_allocation_holding_a_lock_its_spill_needs_fails_instead_of_stalling(caplog):
    """cuDF unspills a buffer holding that buffer's lock while it allocates, and spilling an
    output that holds the buffer takes the same lock. Thread A holds such a lock and runs out
    of memory while thread B spills and waits for that lock: A stops waiting for B's spilling
    after ``spill_lock_wait`` (its allocation fails), lets the lock go, and B's spill and
    allocation complete. Before, both waited for ever (a worker stalled on an H100)."""
    from dask_rmm.pressure import device_objects

    wp, top = pressure_stack(4 * MiB, spill_on_oom=True)
    store = wp.store
    store.spill_lock_wait = 0.5
    store["x"] = patterned_buffer(2 * MiB, 1)
    library_lock = threading.RLock()
    a_holds, b_spilling = threading.Event(), threading.Event()
    results: dict = {}
    allocations, spill = device_objects._handlers(DeviceBuffer)
    rebuild = device_objects._REBUILD["DeviceBuffer"]

    def locked_spill(buf):  # a library's serializer: takes the buffer's lock
        b_spilling.set()
        with library_lock:
            return spill(buf)

    def a():
        with library_lock:  # as cuDF's unspill holds it while allocating
            a_holds.set()
            b_spilling.wait(30)
            try:
                results["a"] = DeviceBuffer(size=3 * MiB)
            except MemoryError as e:
                results["a"] = e

    def b():
        results["b"] = DeviceBuffer(size=3 * MiB)

    device_objects.register_device_type(
        DeviceBuffer, allocations, locked_spill, "DeviceBuffer", rebuild
    )
    try:
        with caplog.at_level("WARNING", logger="dask_rmm.pressure.store"):
            threads = [threading.Thread(target=a, daemon=True)]
            threads[0].start()
            assert a_holds.wait(30)
            threads.append(threading.Thread(target=b, daemon=True))
            threads[1].start()
            for th in threads:
                th.join(30)
            assert not any(th.is_alive() for th in threads), "both threads still waiting"
    finally:
        device_objects.register_device_type(
            DeviceBuffer, allocations, spill, "DeviceBuffer", rebuild
        )
    assert isinstance(results["a"], MemoryError)
    assert results.pop("b").size == 3 * MiB
    assert "not waiting for it longer" in caplog.text
    check_buffer(store["x"], 1)  # spilled by B, read back


def test_a_demand_nothing_can_relieve_still_fails_after_a_short_wait():
    wp, top = pressure_stack(4 * MiB, spill_on_oom=True)
    held = DeviceBuffer(size=3 * MiB)  # referenced here, not a stored value: never released
    with pytest.raises(OutOfMemoryError):
        DeviceBuffer(size=2 * MiB)
    (event,) = wp.oom_events()
    assert event.verdict == DEMAND and event.requested == 2 * MiB
    del held


def test_statistics_are_added_when_the_stack_has_none():
    from dask_rmm import mr
    from dask_rmm.pressure.worker import WorkerPressure

    pool = mr.PoolMemoryResource(mr.SystemMemoryResource(), 4 * MiB, 4 * MiB)
    wp = WorkerPressure()
    top = wp.wrap(DeviceStack(0, pool, pool=pool), capacity=4 * MiB, limit=2 * MiB)
    mr.set_per_device_resource(0, top)
    assert isinstance(top.upstream_mr, mr.StatisticsResourceAdaptor)
    for i in range(4):
        wp.store[f"x-{i}"] = patterned_buffer(MiB, i)
    assert wp.devices[0].current_bytes() == 2 * MiB


def test_oom_while_reading_back_names_the_key():
    wp, top = pressure_stack(4 * MiB, spill_on_oom=True)
    store = wp.store
    store["old"] = patterned_buffer(MiB, 1)
    store["new"] = patterned_buffer(3 * MiB + MiB // 2, 2)  # spills "old"
    held = store["new"]  # referenced: cannot make room for "old"
    with pytest.raises(OutOfMemoryError):
        store["old"]
    assert wp.oom_events()[-1].task_key == "(reading back old)"
    del held
    check_buffer(store["old"], 1)


def test_a_failed_read_back_is_noted_until_the_output_comes_back_or_goes():
    """``unread`` (its readers run again under admission) holds a key whose read-back failed
    until the output comes back, and forgets it when the output is deleted or replaced, so
    that a later reader of that key failing for its own reasons is not taken for one."""
    wp, top = pressure_stack(4 * MiB, spill_on_oom=True)
    store = wp.store
    for gone in (False, True):
        store["old"] = patterned_buffer(MiB, 1)
        store["new"] = patterned_buffer(3 * MiB + MiB // 2, 2)  # spills "old"
        held = store["new"]
        with pytest.raises(OutOfMemoryError):
            store["old"]
        assert dict(store.unread) == {"old": MiB}
        del held
        if gone:
            del store["old"]
        else:
            check_buffer(store["old"], 1)
        assert not store.unread
        del store["new"]


def test_a_growing_pool_whose_upstream_is_full_gets_chunks_back():
    from dask_rmm import mr
    from dask_rmm.pressure.worker import WorkerPressure

    # The "device" holds 3 MiB; the pool (no maximum) ends up with three 1 MiB chunks.
    device = mr.LimitingResourceAdaptor(mr.SystemMemoryResource(), allocation_limit=3 * MiB)
    pool = mr.PoolMemoryResource(device, initial_pool_size=MiB)
    wp = WorkerPressure(spill_on_oom=True)
    top = wp.wrap(DeviceStack(0, pool, pool=pool), capacity=3 * MiB)
    mr.set_per_device_resource(0, top)
    for i in range(3):
        wp.store[f"x-{i}"] = patterned_buffer(MiB, i)
    assert [size for _, size in pool.memory_layout()[0]] == [MiB] * 3
    big = DeviceBuffer(size=2 * MiB)  # no chunk is 2 MiB: spill, release chunks, grow
    assert wp.store.spilled_keys() == ["x-0", "x-1"] and wp.metrics()[0].ooms_avoided == 1
    assert sorted(size for _, size in pool.memory_layout()[0]) == [MiB, 2 * MiB]
    del big
    for i in range(3):
        check_buffer(wp.store[f"x-{i}"], i)


def test_heartbeat_fields_are_plain_data():
    import json as _json

    wp, top = pressure_stack(4 * MiB, spill_on_oom=True, limit=3 * MiB)
    wp.store["a"] = patterned_buffer(MiB, 1)
    with pytest.raises(OutOfMemoryError):
        DeviceBuffer(size=8 * MiB)
    d = wp.devices[0].heartbeat_fields(max_recent=2)
    assert d["oom_count"] == 1 and d["device_memory_limit"] == 3 * MiB and "device" not in d
    assert len(d["oom_events"]) == 1 and len(d["oom_events"][0]["recent_events"]) == 2
    assert _json.loads(_json.dumps(d)) == d


def test_allocation_errors_that_are_not_oom_pass_straight_through():
    from dask_rmm import mr
    from dask_rmm.mr.base import CUDAAllocationError
    from dask_rmm.pressure.worker import WorkerPressure

    class Broken(mr.SystemMemoryResource):
        def allocate(self, nbytes, stream=None):
            raise CUDAAllocationError("cudaErrorInvalidValue", "cudaMallocFromPoolAsync")

    wp = WorkerPressure(spill_on_oom=True)
    top = wp.wrap(DeviceStack(0, Broken()), capacity=MiB)
    with pytest.raises(CUDAAllocationError):
        top.allocate(256)
    assert wp.oom_events() == [] and wp.metrics()[0].oom_count == 0


def test_clear_does_not_bring_spilled_values_back():
    wp, top = pressure_stack(4 * MiB, spill_on_oom=True)
    store = wp.store
    for i in range(8):
        store[f"x-{i}"] = patterned_buffer(MiB, i)
    store["plain"] = 1
    store.clear()
    assert len(store) == 0 and store.inner == {}
    m = wp.metrics()[0]
    assert m.total_unspilled_count == 0 and m.spilled_count == 0 and m.spilled_bytes == 0


def test_a_value_brought_back_and_spilled_again_is_not_copied_again():
    from dask_rmm.pressure import device_objects

    wp, top = pressure_stack(4 * MiB, spill_on_oom=True)
    store = wp.store
    copies = []
    allocations, spill = device_objects._handlers(DeviceBuffer)
    rebuild = device_objects._REBUILD["DeviceBuffer"]

    def counted_spill(buf):
        copies.append(buf.size)
        return spill(buf)

    device_objects.register_device_type(
        DeviceBuffer, allocations, counted_spill, "DeviceBuffer", rebuild
    )
    try:
        for i in range(8):  # twice the pool: x-0 .. x-3 spilled, one copy each
            store[f"x-{i}"] = patterned_buffer(MiB, i)
        assert len(copies) == 4
        for _ in range(3):  # read all back, in turn: each read spills another
            for i in range(8):
                check_buffer(store[f"x-{i}"], i)
        # Every value was copied to host once; later spills dropped the device copy only.
        assert len(copies) == 8
        assert store.spilled_without_copy > 0
        m = wp.metrics()[0]
        assert m.total_spilled_count > 8 and m.total_unspilled_count > 8
        # A replaced value forgets its host copy: the new one is copied when spilled.
        store["x-7"] = patterned_buffer(MiB, 70)
        for i in range(7):
            check_buffer(store[f"x-{i}"], i)
        check_buffer(store["x-7"], 70)
        assert len(copies) == 9
    finally:
        device_objects.register_device_type(
            DeviceBuffer, allocations, spill, "DeviceBuffer", rebuild
        )
    assert store._clean_bytes <= store.keep_host_copies == 4 * MiB


def test_threads_crossing_the_limit_together_spill_the_excess_once():
    """A thread over the limit waits while another spills; once its turn comes, it spills what
    is still over the limit then (here nothing), not what was over when it started waiting."""
    import sys

    wp, top = pressure_stack(8 * MiB, limit=4 * MiB, spill_on_oom=False)
    store = wp.store
    for i in range(4):
        store[f"x-{i}"] = patterned_buffer(MiB, i)  # 4 MiB: at the limit
    result = {}

    def allocate():
        result["buf"] = DeviceBuffer(size=MiB)  # 1 MiB over: must wait for the spill lock

    with store._spill_lock:  # another thread is spilling
        th = threading.Thread(target=allocate)
        th.start()
        # Until the thread waits for the lock (innermost frame: DeviceSpillStore's lock taking).
        for _ in range(10_000):
            frame = sys._current_frames().get(th.ident)
            if frame is not None and frame.f_code.co_name == "_lock_for_spilling":
                break
            threading.Event().wait(0.001)
        else:
            raise AssertionError("the allocating thread never reached the spill lock")
        del frame
        # Meanwhile the other thread's spill freed room: 1 MiB gone from the device.
        victim = store._device.pop("x-0")
        store._lru.pop("x-0")
        store.inner["x-0"] = victim.copy_to_host()
        del victim
    th.join(30)
    assert result["buf"].size == MiB
    assert store.spilled_keys() == []  # nothing more spilled: the excess was gone
    assert sorted(store._device) == ["x-1", "x-2", "x-3"]


def test_a_wait_for_memory_does_not_rescan_every_stored_value_at_each_poll():
    """Each 2 ms poll of a failed allocation's wait rebuilt the list of spillable values (and
    each retry chose victims from a fresh one): with 10,000 stored values, milliseconds per
    poll. Now a poll that finds nothing changed rechecks only the values that were referenced."""
    wp, top = pressure_stack(4 * MiB, spill_on_oom=True)
    store = wp.store
    store.wait_retries = 30
    store.wait_limit = 120.0
    refs = []
    for i in range(4):
        store[f"x-{i}"] = patterned_buffer(MiB, i)
        refs.append(store[f"x-{i}"])  # a running task holds every one: nothing to spill
    scans = 0
    candidates = store.candidates

    def counted(device=None):
        nonlocal scans
        scans += 1
        return candidates(device)

    store.candidates = counted
    pool = top.handler.pool
    ptr, error, spilled = store.spill_until(
        lambda: pool.allocate(2 * MiB), 2 * MiB, device=0, layout=pool.memory_layout
    )
    assert ptr is None and isinstance(error, MemoryError) and spilled == 0
    assert scans <= 2, scans  # not one per poll (31 polls)
    del refs
