"""Allocation logs of RMMPlugin's ``log_directory``: a place that takes the file but keeps no row
fails the registration on the client (all or nothing); after a re-registration the INFO line
names the file the rows go to; ``dask rmm log summary`` does not call a re-registration a new
process."""

from __future__ import annotations

import asyncio
import os
import sys
import time

import pytest
from conftest import hold, log_records
from distributed import wait
from distributed.utils_test import gen_cluster

from dask_rmm.mr.registry import get_per_device_resource
from dask_rmm.plugin import RMMPlugin, RMMSetupError
from dask_rmm.stack.build import log_file_path
from dask_rmm.worker.stacks import worker_stack


def _sink_file(target):
    def make(tmp_path, worker_name):
        os.symlink(target, log_file_path(tmp_path, worker_name, 0))
        return str(tmp_path), "not a regular file"

    return make


def _fifo(tmp_path, worker_name):
    os.mkfifo(log_file_path(tmp_path, worker_name, 0))
    return str(tmp_path), "not a regular file"


def _pseudo_filesystem(directory):
    def make(tmp_path, worker_name):
        if not os.path.isdir(directory):
            pytest.skip(f"{directory} is not on this host")
        return directory, directory

    return make


SINKS = {
    "dev-full": _sink_file("/dev/full"),
    "dev-null": _sink_file("/dev/null"),
    "fifo": _fifo,
    "proc": _pseudo_filesystem("/proc/self"),
    "sys": _pseudo_filesystem("/sys/kernel"),
}


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="Linux pseudo-files")
@pytest.mark.parametrize("sink", sorted(SINKS))
def test_a_log_directory_that_keeps_no_row_fails_the_registration(sink, tmp_path):
    """It registered OK, and each worker only warned at its first row that every row is lost."""

    @gen_cluster(client=True, nthreads=[("127.0.0.1", 1)])
    async def run(c, s, a):
        directory, named = SINKS[sink](tmp_path, a.name)
        await c.register_plugin(RMMPlugin(base_resource="system", pool_size="8MiB"))
        before = get_per_device_resource(0)
        with pytest.raises(RMMSetupError, match=rf"{a.address}: .*`log_directory`") as info:
            await c.register_plugin(RMMPlugin(base_resource="system", log_directory=directory))
        assert named in str(info.value)
        assert get_per_device_resource(0) is before  # the previous setup stays
        assert worker_stack(a).active[0].logging is None
        assert not [n for n in os.listdir(tmp_path) if n.startswith(".rmm_log_probe")]

    run()


@gen_cluster(client=True, nthreads=[("127.0.0.1", 1)])
async def test_after_a_re_registration_the_info_line_names_the_file_the_rows_go_to(
    c, s, a, tmp_path_factory=None
):
    import tempfile

    with log_records("distributed.worker.dask_rmm") as records:
        with tempfile.TemporaryDirectory() as d:
            await c.register_plugin(RMMPlugin(base_resource="system", log_directory=d))
            first_task = c.submit(hold, 1000, pure=False)
            await wait(first_task)  # the first stack makes its file
            first = log_file_path(d, a.name, 0)
            assert os.path.exists(first)
            # Its buffer must be gone before the stack is replaced: a buffer still held keeps
            # the replaced stack's file (and name) open, and the new stack rightly takes another.
            del first_task
            deadline = time.monotonic() + 30
            while a.data:
                assert time.monotonic() < deadline, "the first task's output was never released"
                await asyncio.sleep(0.01)
            records.clear()
            await c.register_plugin(RMMPlugin(base_resource="system", log_directory=d))
            (line,) = [r.getMessage() for r in records if "installed" in r.getMessage()]
            assert line.endswith(f"log {first}"), line
            ws = worker_stack(a)
            # on the H100 (-n 16) ``active`` was empty here once: say what the worker held
            state = (
                ws.token,
                ws._released,
                ws.plugin,
                a.plugins,
                [r.getMessage() for r in records],
            )
            assert ws.active and ws.active[0].log_path == first, state
            held = c.submit(hold, 3000, pure=False)
            await wait(held)
            worker_stack(a).flush_logs()
            assert os.listdir(d) == [os.path.basename(first)]
            with open(first) as f:
                assert ",3000," in f.read()
            del held


def test_log_summary_does_not_call_a_new_writer_a_new_process(tmp_path):
    from dask_rmm.logs.summary import format_summary, summarize

    header = "Thread,Time,Action,Pointer,Size,Stream\n"
    path = tmp_path / "rmm_log_w.dev0.csv"
    path.write_text(
        header + "11,10:00:00.000001,allocate,0x1000,4096,0\n"
        "11,10:00:00.000002,free,0x1000,4096,0\n"
        + header + "11,10:00:01.000001,allocate,0x1000,4096,0\n"
    )  # fmt: skip
    text = format_summary(summarize([str(path)]).files[0])
    assert "a new process" not in text
    assert "1 new writers appended to the log (a worker restarted, or the plugin " in text


def test_the_log_directory_probe_has_no_name_a_killed_worker_could_leave(tmp_path, monkeypatch):
    """A worker killed during setup left ``.rmm_log_probe-*`` files: the probe had a name while
    it was written and synced."""
    from dask_rmm.stack import build

    seen = []
    fsync = os.fsync
    monkeypatch.setattr(os, "fsync", lambda fd: (seen.append(os.listdir(tmp_path)), fsync(fd)))
    build.check_log_file_keeps_rows(log_file_path(str(tmp_path), "w", 0))
    assert seen == [[]]
