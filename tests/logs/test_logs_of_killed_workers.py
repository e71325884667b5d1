"""Allocation logs the way users break them: a worker killed mid-row then restarted under the
same name, and buffers still held when the plugin is registered again. Each test is a defect
found by probing (host memory, no cluster needed)."""

from __future__ import annotations

import gc

from dask_rmm.device_buffer import DeviceBuffer
from dask_rmm.logs.summary import summarize
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
    assert text.count("Thread,Time,Action") == 1
    assert text.startswith(HEADER + "11,10:00:00.000001,allocate,0x1000,4096,0\n")  # kept
    summary = summarize([str(path)]).files[0]
    assert (summary.allocations, summary.frees) == (2, 1)


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
