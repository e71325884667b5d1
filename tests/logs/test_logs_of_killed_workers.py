"""Allocation logs the way users break them: a worker killed mid-row then restarted under the
same name, and buffers still held when the plugin is registered again. Each test is a defect
found by probing (host memory, no cluster needed)."""

from __future__ import annotations

import gc
import os

from dask_rmm.device_buffer import DeviceBuffer
from dask_rmm.logs.summary import summarize
from dask_rmm.logs.timeline import in_use_timeline
from dask_rmm.mr import LoggingResourceAdaptor, SystemMemoryResource
from dask_rmm.stack.build import build_stack
from dask_rmm.stack.options import RMMOptions
from dask_rmm.worker.stacks import WorkerStack

HEADER = "Thread,Time,Action,Pointer,Size,Stream\n"


def test_a_restart_appending_after_a_cut_off_row_keeps_the_log_readable(tmp_path):
    """A worker killed in the middle of writing a row, restarted by its nanny under the same
    name, appended its rows right after the cut-off one: the merged line made every
    ``dask rmm log`` command fail with "malformed row (expected 6 ... got 9)"."""
    path = tmp_path / "rmm_log_w.dev0.csv"
    path.write_text(
        HEADER + "11,10:00:00.000001,allocate,0x1000,4096,0\n" + "11,10:00:00.000002,allocate,0x20"
    )
    mr = LoggingResourceAdaptor(
        SystemMemoryResource(), log_file_name=str(tmp_path / "rmm_log_w.csv"), append=True
    )
    assert mr.get_file_name() == str(path)
    mr.deallocate(mr.allocate(100), 100)
    mr.close()
    text = path.read_text()
    # kept, then the restart marker, then the new writer's rows
    assert text.startswith(HEADER + "11,10:00:00.000001,allocate,0x1000,4096,0\n" + HEADER)
    summary = summarize([str(path)]).files[0]
    assert (summary.allocations, summary.frees) == (2, 1)
    assert summary.restarts == 1 and summary.ended_with_process_count == 1
    assert summary.outstanding_count == 0


def test_a_cut_off_row_after_more_than_64_kib_of_rows_is_dropped(tmp_path):
    path = tmp_path / "rmm_log_w.dev0.csv"
    rows = "".join(f"11,10:00:00.000001,allocate,{0x1000 + i:#x},256,0\n" for i in range(4000))
    path.write_text(HEADER + rows + "11,10:00:00.000002,allocate,0x20")
    assert path.stat().st_size > 1 << 17
    LoggingResourceAdaptor(
        SystemMemoryResource(), log_file_name=str(tmp_path / "rmm_log_w.csv"), append=True
    ).close()
    assert path.read_text() == HEADER + rows + HEADER


def test_a_cut_off_header_is_written_again(tmp_path):
    path = tmp_path / "rmm_log_w.dev0.csv"
    path.write_text("Thread,Ti")
    mr = LoggingResourceAdaptor(
        SystemMemoryResource(), log_file_name=str(tmp_path / "rmm_log_w.csv"), append=True
    )
    mr.deallocate(mr.allocate(64), 64)
    mr.close()
    assert path.read_text().startswith(HEADER)
    assert summarize([str(path)]).files[0].frees == 1


def test_frees_of_buffers_held_across_a_re_registration_are_logged(tmp_path):
    """Registering the plugin again (a new pool size, say) closed the replaced stack's log at
    once, so the frees of the buffers it still held were never written and ``dask rmm log
    summary`` reported every one of them as leaked."""
    options = RMMOptions(base_resource="system", pool_size=1 << 22, log_directory=str(tmp_path))
    ws = WorkerStack()
    first = build_stack(options, 0, worker_name="w")
    ws.install([first], options, "one")
    held = [DeviceBuffer(size=4096) for _ in range(3)]
    path = first.log_path
    second = build_stack(options, 0, worker_name="w")
    ws.install([second], options, "two")
    assert second.log_path != path  # the replaced stack still holds its file
    assert ws.retired == [first]
    del held
    gc.collect()
    ws.flush_logs()
    assert ws.retired == []
    report = summarize([path]).files[0]
    assert (report.allocations, report.frees) == (3, 3)
    assert report.outstanding_count == 0
    ws.retire(ws.active)


def test_reinitialize_with_the_same_log_file_twice_while_buffers_live(tmp_path):
    """A notebook cell ``reinitialize(logging=True, log_file_name=...)`` run twice while arrays
    of the first run are alive: the first adaptor kept writing at its old offset into the file
    the second had truncated, leaving NUL bytes that ``dask rmm log summary`` refused (and
    overwriting the second adaptor's rows)."""
    import dask_rmm
    from dask_rmm.mr import get_current_device_resource

    name = str(tmp_path / "rmm.csv")
    dask_rmm.reinitialize(base_resource="system", logging=True, log_file_name=name)
    first = get_current_device_resource()
    held = [DeviceBuffer(size=100 + i) for i in range(100)]
    first.flush()
    dask_rmm.reinitialize(base_resource="system", logging=True, log_file_name=name)
    second = get_current_device_resource()
    more = [DeviceBuffer(size=7) for _ in range(3)]
    del held
    gc.collect()
    first.flush()
    del more
    second.flush()
    path = tmp_path / "rmm.dev0.csv"
    data = path.read_bytes()
    assert b"\x00" not in data
    assert data.startswith(HEADER.encode()) and data.count(b"Thread,Time") == 1
    report = summarize([str(path)]).files[0]
    assert (report.allocations, report.frees) == (3, 103)
    assert report.unmatched_frees == 100  # allocated before the truncation


_FULL_DISK = """
import resource, signal, sys, warnings
signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # past the limit, write() fails with EFBIG
resource.setrlimit(resource.RLIMIT_FSIZE, (1 << 16, 1 << 16))
from dask_rmm import mr
stats = mr.StatisticsResourceAdaptor(mr.SystemMemoryResource())
log = mr.LoggingResourceAdaptor(stats, log_file_name=sys.argv[1])
with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
    for _ in range(5000):
        log.deallocate(log.allocate(64), 64)
    log.flush()
    log.close()
assert stats.allocation_counts.current_bytes == 0, stats.allocation_counts
assert stats.allocation_counts.total_count == 5000
assert log.write_errors > 0
assert [str(w.message).count("cannot write") for w in caught] == [1], caught
print("ok")
"""


def test_a_full_disk_never_fails_or_leaks_an_allocation(tmp_path):
    """With the log's disk full, the row write raised OSError out of ``allocate`` after the
    upstream had allocated: the task failed with "File too large" / "No space left on device"
    and the block leaked."""
    import subprocess
    import sys

    out = subprocess.run(
        [sys.executable, "-c", _FULL_DISK, str(tmp_path / "full.csv")],
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert out.returncode == 0 and out.stdout.strip() == "ok", out.stderr[-2000:]


def _options(log_dir) -> RMMOptions:
    return RMMOptions(base_resource="system", pool_size=1 << 22, log_directory=str(log_dir))


def test_a_stack_that_never_allocates_leaves_no_log_file(tmp_path):
    """Each registration, preload and restart made a header-only file (5 of 11 files for 3
    workers) for stacks that were replaced or torn down before any allocation."""
    stack = build_stack(_options(tmp_path), 0, worker_name="w")
    assert stack.log_path == str(tmp_path / "rmm_log_w.dev0.csv")
    stack.close_log()
    assert os.listdir(tmp_path) == []


def test_a_second_worker_under_a_taken_name_makes_no_file_until_it_allocates(tmp_path):
    """A ``dask worker --name wA`` that the scheduler refused ("name taken") still created
    ``rmm_log_wA-<pid>.dev0.csv``: its preload built the stack before the refusal."""
    ws = WorkerStack()
    first = build_stack(_options(tmp_path), 0, worker_name="wA")
    ws.install([first], first.options, "one")
    held = DeviceBuffer(size=4096)  # the live wA: its file exists and is held
    ws.flush_logs()
    second = build_stack(_options(tmp_path), 0, worker_name="wA")
    assert second.log_path == str(tmp_path / f"rmm_log_wA-{os.getpid()}.dev0.csv")
    second.close_log()  # refused: torn down without an allocation
    assert os.listdir(tmp_path) == ["rmm_log_wA.dev0.csv"]
    del held
    ws.retire(ws.active)


def test_a_restart_appends_to_its_own_file_once_the_old_process_let_go(tmp_path):
    """A worker restarted while the old process still held its log (a nanny restart: the new
    process sets up before the old one is gone) wrote a new ``-<pid>`` file instead of
    appending to its own: the name is claimed at the first row now."""
    import fcntl

    path = tmp_path / "rmm_log_wB.dev0.csv"
    path.write_text(HEADER + "11,10:00:00.000001,allocate,0x1000,4096,0\n")
    old = os.open(path, os.O_RDWR)
    fcntl.flock(old, fcntl.LOCK_EX)  # the old process, still alive
    stack = build_stack(_options(tmp_path), 0, worker_name="wB")
    os.close(old)  # ... and now gone
    stack.top.deallocate(stack.top.allocate(100), 100)
    stack.close_log()
    assert os.listdir(tmp_path) == [path.name] and stack.log_path == str(path)
    assert summarize([str(path)]).files[0].allocations == 2


_KILLED = """
import os, signal, sys
from dask_rmm.stack.build import build_stack
from dask_rmm.stack.options import RMMOptions
stack = build_stack(
    RMMOptions(base_resource="system", pool_size=1 << 22, log_directory=sys.argv[1]), 0,
    worker_name="wB",
)
top = stack.top
live = [top.allocate(1000), top.allocate(3000)]
top.deallocate(top.allocate(500), 500)
stack.flush_log()
os.kill(os.getpid(), signal.SIGKILL)
"""


def test_a_killed_processs_live_allocations_end_at_the_restart_marker(tmp_path):
    """A worker killed with live allocations, restarted under its name: the new process
    appends to the file, after the restart marker, and the log tools count the old
    process's live allocations as ended with it, not as never freed."""
    import subprocess
    import sys

    out = subprocess.run([sys.executable, "-c", _KILLED, str(tmp_path)], timeout=120)
    assert out.returncode == -9
    stack = build_stack(_options(tmp_path), 0, worker_name="wB")
    ptr = stack.top.allocate(200)
    stack.top.deallocate(ptr, 200)
    stack.close_log()
    (name,) = os.listdir(tmp_path)
    text = (tmp_path / name).read_text()
    assert name == "rmm_log_wB.dev0.csv" and text.count(HEADER) == 2
    summary = summarize([str(tmp_path / name)]).files[0]
    assert summary.restarts == 1
    assert (summary.ended_with_process_count, summary.ended_with_process_bytes) == (2, 4000)
    assert summary.outstanding_count == 0
    timeline = in_use_timeline(str(tmp_path / name))[0]
    assert timeline.bytes[-1] == 0  # the bytes in use drop at the restart
    from dask_rmm.logs.replay import replay

    assert replay(tmp_path / name, "cuda", gpu=False).final_upstream_bytes == 0
    from dask_rmm.logs import merge_logs

    merged = tmp_path.parent / f"{tmp_path.name}-merged.csv"
    merge_logs([tmp_path / name], merged)  # the marker survives as a "restart" row
    again = summarize([str(merged)]).files[0]
    assert (again.restarts, again.ended_with_process_bytes, again.outstanding_count) == (1, 4000, 0)


def test_a_log_opened_on_its_first_row_makes_no_file_before_it(tmp_path):
    from dask_rmm.mr import LoggingResourceAdaptor, SystemMemoryResource

    mr = LoggingResourceAdaptor(
        SystemMemoryResource(), log_file_name=str(tmp_path / "r.csv"), open_on_first_row=True
    )
    mr.flush()
    assert os.listdir(tmp_path) == []
    mr.deallocate(mr.allocate(64), 64)
    mr.close()
    assert (tmp_path / "r.dev0.csv").read_text().startswith(HEADER)
    assert summarize([str(tmp_path / "r.dev0.csv")]).files[0].frees == 1
