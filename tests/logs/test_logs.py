"""Tests of dask_rmm.logs: the reader, summary, timeline and replay modules."""

from __future__ import annotations

import gzip
import json
import pickle
import tracemalloc
import warnings

import pytest
from logdata import (
    logging_adaptor,
    run_workload,
    synthetic_events,
    write_log,
    write_synthetic,
)

from dask_rmm import logs
from dask_rmm.logs import Action, LogEvent, LogFormatError, TruncatedLogWarning, replay
from dask_rmm.logs import summary as log_summary
from dask_rmm.logs import timeline as log_timeline

HEADER_LINE = "Thread,Time,Action,Pointer,Size,Stream\n"


def _write(tmp_path, text, name="log.csv"):
    p = tmp_path / name
    p.write_text(text)
    return p


# --- reading -----------------------------------------------------------------------------------


def test_parse_time_formats():
    assert logs.parse_time("01:00:02.500000") == 3602.5
    assert logs.parse_time("01:00:02:500000") == 3602.5  # RMM's older HH:MM:SS:us
    assert logs.parse_time("23:59:59.999999") == pytest.approx(86399.999999)
    assert logs.format_time(3602.5) == "01:00:02.500000"
    assert logs.format_time(86400 + 1.25) == "00:00:01.250000"
    with pytest.raises(ValueError):
        logs.parse_time("yesterday")


def test_reads_rmm_rows_typed(tmp_path):
    p = _write(
        tmp_path,
        HEADER_LINE
        + "140298510948160,14:03:07.413285,allocate,0x7f9b4c000000,1048576,0\n"
        + "140298510948161,14:03:07.413301,free,0x7f9b4c000000,1048576,7f9b40001230\n"
        + "140298510948160,14:03:07.413320,allocate failure,(nil),68719476736,0x2\n"
        + "140298510948160,14:03:07.413330,allocate failure,0x0,5,2\n",
        "worker-1.csv",
    )
    events = list(logs.read_log(p))
    assert [e.action for e in events] == [
        Action.ALLOCATE,
        Action.FREE,
        Action.ALLOCATE_FAILURE,
        Action.ALLOCATE_FAILURE,
    ]
    e0, e1, e2, e3 = events
    assert e0 == LogEvent(
        140298510948160,
        14 * 3600 + 3 * 60 + 7.413285,
        Action.ALLOCATE,
        0x7F9B4C000000,
        1048576,
        0,
        2,
        "worker-1",
        str(p),
    )
    assert e1.stream == 0x7F9B40001230  # RMM writes the stream handle in hex
    assert e1.thread == 140298510948161
    assert (e2.pointer, e2.size, e2.stream, e2.line) == (0, 68719476736, 2, 4)
    assert e3.pointer == 0
    with pytest.raises(AttributeError):
        e0.size = 3  # events are immutable


def test_columns_found_by_name_and_gzip(tmp_path):
    p = tmp_path / "log.csv.gz"
    with gzip.open(p, "wt") as f:
        f.write("Size,Stream,Thread,Time,Action,Pointer\n5,0,7,00:00:01.000000,allocate,0x100\n")
    (e,) = logs.read_log(p)
    assert (e.size, e.thread, e.pointer, e.source) == (5, 7, 0x100, "log")


def test_malformed_line_names_file_and_line(tmp_path):
    p = _write(
        tmp_path,
        HEADER_LINE
        + "1,00:00:01.000000,allocate,0x100,256,0\n"
        + "1,00:00:01.000001,allocate,0x200,lots,0\n"
        + "1,00:00:01.000002,free,0x100,256,0\n",
    )
    with pytest.raises(LogFormatError, match=r"log\.csv:3: malformed row") as info:
        list(logs.read_log(p))
    assert info.value.line == 3
    assert info.value.path == str(p)
    assert "lots" in str(info.value)
    again = pickle.loads(pickle.dumps(info.value))  # as it travels from a worker
    assert (again.path, again.line, str(again)) == (str(p), 3, str(info.value))


@pytest.mark.parametrize(
    "row, problem",
    [
        ("1,00:00:01.0,reallocate,0x1,1,0", "unknown action"),
        ("1,00:00:01.0,allocate,0x1,1", "expected 6 comma-separated fields"),
        ("1,noon,allocate,0x1,1,0", "malformed"),
        ("1,00:00:01.0,allocate,0x1,-5,0", "negative size"),
    ],
)
def test_malformed_rows(tmp_path, row, problem):
    p = _write(tmp_path, HEADER_LINE + row + "\n1,00:00:02.0,free,0x1,1,0\n")
    with pytest.raises(LogFormatError, match=problem) as info:
        list(logs.read_log(p))
    assert info.value.line == 2


def test_not_a_log(tmp_path):
    p = _write(tmp_path, "a,b,c\n1,2,3\n")
    with pytest.raises(LogFormatError, match=r":1: not an RMM allocation log"):
        list(logs.read_log(p))
    empty = _write(tmp_path, "", "empty.csv")
    with pytest.raises(LogFormatError, match="empty log"):
        list(logs.read_log(empty))


@pytest.mark.parametrize(
    "tail",
    [
        "140001,12:00:01.0000",  # cut inside the time
        "140001,12:00:01.000000,allocate,0x7f00",  # cut before the size
        "140001,12:00:01.000000,allocate,0x7f0000000000,10",  # cut before the stream
        "\x00\x00\x00\x00",  # the file system's zero fill after a crash
    ],
)
def test_truncated_last_line_still_summarizes(tmp_path, tail):
    events, exp = synthetic_events(500, seed=3)
    p = tmp_path / "cut.csv"
    write_log(p, events)
    with open(p, "a") as f:
        f.write(tail)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        reader = logs.LogReader(p)
        got = list(reader)
    assert len(got) == 500
    if tail.strip("\x00"):
        assert reader.truncated == (502, tail)
        assert any(issubclass(w.category, TruncatedLogWarning) for w in caught)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        s = log_summary.summarize(p).files[0]
    assert s.peak_bytes == exp.peak_bytes
    assert s.rows == 500
    assert bool(s.truncated) == bool(tail.strip("\x00"))


def test_last_line_without_newline_kept_when_whole(tmp_path):
    p = _write(tmp_path, HEADER_LINE + "1,00:00:01.000000,allocate,0x100,256,0")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        (e,) = logs.read_log(p)
    assert e.size == 256


def test_blank_lines_skipped_and_a_repeated_header_read_as_a_restart(tmp_path):
    p = _write(
        tmp_path,
        "\n"
        + HEADER_LINE
        + "1,00:00:01.000000,allocate,0x100,256,0\n\n"
        + HEADER_LINE
        + "1,00:00:01.000002,free,0x100,256,0\r\n",
    )
    events = [(e.line, e.action, e.time) for e in logs.read_log(p)]
    restart = (5, logs.Action.RESTART, 1.000002)  # at the time of the new writer's first row
    assert events == [(3, logs.Action.ALLOCATE, 1.0), restart, (6, logs.Action.FREE, 1.000002)]


def test_midnight_keeps_time_increasing(tmp_path):
    p = _write(
        tmp_path,
        HEADER_LINE
        + "1,23:59:59.900000,allocate,0x100,256,0\n"
        + "1,00:00:00.100000,free,0x100,256,0\n",
    )
    a, b = logs.read_log(p)
    assert b.time - a.time == pytest.approx(0.2)
    s = log_summary.summarize(p).files[0]
    assert s.duration == pytest.approx(0.2)


def test_reading_is_bounded_in_memory(tmp_path):
    p = tmp_path / "big.csv"
    write_synthetic(p, 60_000, seed=1)
    tracemalloc.start()
    try:
        n = sum(1 for _ in logs.read_log(p))
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert n == 60_000
    assert peak < 2 << 20, f"reading held {peak} bytes"


# --- summaries ---------------------------------------------------------------------------------


def test_summary_matches_the_workload(tmp_path):
    p = tmp_path / "w.csv"
    exp = write_synthetic(p, 20_000, seed=7)
    s = log_summary.summarize(p, top=5).files[0]
    assert s.allocations == exp.allocations
    assert s.frees == exp.frees
    assert s.failures == exp.failures
    assert s.peak_bytes == exp.peak_bytes
    assert s.peak_line == exp.peak_line
    assert s.outstanding_bytes == exp.outstanding_bytes
    assert s.outstanding_count == exp.outstanding_count
    assert s.histogram == dict(sorted(exp.histogram.items()))
    assert {k: v.allocated_bytes for k, v in s.threads.items()} == exp.thread_allocated
    assert {k: v.allocations for k, v in s.streams.items() if v.allocations} == exp.stream_allocs
    assert len(s.largest_outstanding) == 5
    sizes = [o.size for o in s.largest_outstanding]
    assert sizes == sorted(sizes, reverse=True)
    assert s.unmatched_frees == 0
    assert s.end == pytest.approx(exp.end_time)
    json.dumps(s.to_dict())  # JSON-friendly
    text = log_summary.format_summary(s)
    assert f"{exp.peak_bytes:,} B" in text


def test_summary_counts_frees_of_unknown_pointers(tmp_path):
    p = _write(
        tmp_path,
        HEADER_LINE
        + "1,00:00:01.000000,free,0x900,512,0\n"
        + "1,00:00:01.000001,allocate,0x100,256,0\n",
    )
    s = log_summary.summarize(p).files[0]
    assert (s.unmatched_frees, s.peak_bytes, s.outstanding_bytes) == (1, 256, 256)


def test_summary_of_several_files_combines_by_time(tmp_path):
    a = _write(
        tmp_path,
        HEADER_LINE
        + "1,00:00:01.000000,allocate,0x100,1000,0\n"
        + "1,00:00:02.000000,free,0x100,1000,0\n"
        + "1,00:00:05.000000,allocate,0x100,300,0\n",
        "a.csv",
    )
    b = _write(
        tmp_path,
        HEADER_LINE
        + "2,00:00:03.000000,allocate,0x100,700,0\n"  # same address, other worker
        + "2,00:00:06.000000,free,0x100,700,0\n",
        "b.csv",
    )
    report = log_summary.summarize([a, b])
    sa, sb = report.files
    assert (sa.name, sa.peak_bytes, sb.name, sb.peak_bytes) == ("a", 1000, "b", 700)
    c = report.combined
    assert c.peak_bytes == 1000  # 1000 alone at t=1; 700 + 300 = 1000 again at t=5, not 1700
    assert c.peak_time == 1.0
    assert (c.allocations, c.frees, c.outstanding_bytes) == (3, 2, 300)
    assert c.duration == 5.0
    assert c.paths == (str(a), str(b))


@pytest.mark.parametrize("threads", [1, 4])
def test_summary_matches_statistics_of_a_real_run(tmp_path, threads):
    """The log of a real resource stack says what StatisticsResourceAdaptor said live.

    With several threads the order of rows in the log and the order in which statistics
    counted can differ (each is a valid order of the same calls), so the peak is compared
    exactly only for one thread; totals must agree always.
    """
    from dask_rmm.mr import StatisticsResourceAdaptor, SystemMemoryResource

    path = tmp_path / "real.csv"
    logged = logging_adaptor(SystemMemoryResource(), path)
    stats = StatisticsResourceAdaptor(logged)
    kept = run_workload(stats, steps=1500, seed=2, threads=threads)
    at_end = stats.allocation_counts
    for blk in kept:
        stats.deallocate(*blk)
    logged.flush()
    s = log_summary.summarize(logged.get_file_name()).files[0]
    assert s.allocations == at_end.total_count
    assert s.allocated_bytes == at_end.total_bytes
    assert s.freed_bytes == s.allocated_bytes  # everything was freed by the end
    assert s.outstanding_bytes == 0
    assert s.unmatched_frees == 0
    assert sum(1 for t in s.threads.values() if t.allocations) == threads
    if threads == 1:
        assert s.peak_bytes == at_end.peak_bytes
        assert s.peak_count == at_end.peak_count


def test_free_row_written_after_the_next_allocate_of_its_address(tmp_path):
    """Thread B frees P, thread A gets P and writes its row before B writes the free row."""
    p = _write(
        tmp_path,
        HEADER_LINE
        + "1,00:00:01.000000,allocate,0x100,1000,0\n"
        + "2,00:00:01.000001,allocate,0x100,300,0\n"  # P again: the 1000 B block is gone
        + "1,00:00:01.000002,free,0x100,1000,0\n"  # the late row of that free
        + "2,00:00:01.000003,allocate,0x900,50,0\n",
    )
    s = log_summary.summarize(p).files[0]
    assert (s.peak_bytes, s.outstanding_bytes, s.outstanding_count) == (1000, 350, 2)
    assert s.reallocated_live_pointers == 1 and s.unmatched_frees == 0
    (tl,) = log_timeline.in_use_timeline(p)
    assert tl.bytes[-1] == 350
    r = replay.replay(p, "cuda", gpu=False)
    assert (r.peak_bytes, r.final_upstream_bytes, r.skipped_frees) == (1000, 350, 0)


def test_rows_of_our_logging_adaptor_read_back(tmp_path):
    from dask_rmm.mr import LimitingResourceAdaptor, SystemMemoryResource
    from dask_rmm.stream import Stream

    logged = logging_adaptor(
        LimitingResourceAdaptor(SystemMemoryResource(), 4096), tmp_path / "a.csv"
    )
    s = Stream._from_handle(0x7F3A40001230)
    ptr = logged.allocate(1000, s)
    with pytest.raises(MemoryError):
        logged.allocate(10_000)
    logged.deallocate(ptr, 1000)
    logged.flush()
    a, f, d = logs.read_log(logged.get_file_name())
    assert (a.action, a.pointer, a.size, a.stream, a.line) == (
        Action.ALLOCATE,
        ptr,
        1000,
        s.handle,
        2,
    )
    assert (f.action, f.pointer, f.size, f.stream) == (Action.ALLOCATE_FAILURE, 0, 10_000, 0)
    assert (d.action, d.pointer, d.size) == (Action.FREE, ptr, 1000)
    import threading

    assert a.thread == threading.get_native_id()
    assert a.time <= f.time <= d.time


# --- merge -------------------------------------------------------------------------------------


def test_merge_orders_by_time_with_worker_column(tmp_path):
    ea, _ = synthetic_events(300, seed=1, threads=(11,))
    eb, _ = synthetic_events(200, seed=2, threads=(22,), start=12 * 3600.0 + 0.005)
    (tmp_path / "w0").mkdir()
    (tmp_path / "w1").mkdir()
    a, b = tmp_path / "w0" / "rmm_log.dev0.csv", tmp_path / "w1" / "rmm_log.dev0.csv"
    write_log(a, ea)
    write_log(b, eb)
    out = tmp_path / "merged.csv"
    assert logs.merge_logs([a, b], out) == 500
    header = out.read_text().splitlines()[0]
    assert header == "Thread,Time,Action,Pointer,Size,Stream,Worker"
    merged = list(logs.read_log(out))
    times = [e.time for e in merged]
    assert times == sorted(times)
    # same file names: the folder tells the workers apart
    assert {e.source for e in merged} == {"w0/rmm_log.dev0", "w1/rmm_log.dev0"}
    assert {e.thread for e in merged if e.source.startswith("w0")} == {11}
    # each worker's rows keep their order and values
    from_a = [(e.action, e.pointer, e.size) for e in merged if e.source.startswith("w0")]
    assert from_a == [(e.action, e.pointer, e.size) for e in ea]
    # a merged log summarizes like its parts
    report = log_summary.summarize([a, b])
    s = log_summary.summarize(out).files[0]
    assert s.peak_bytes == report.combined.peak_bytes
    assert s.outstanding_bytes == report.combined.outstanding_bytes


# --- timeline and plot -------------------------------------------------------------------------


def test_timeline_is_bounded_and_keeps_the_peak(tmp_path):
    p = tmp_path / "t.csv"
    exp = write_synthetic(p, 20_000, seed=5)
    (tl,) = log_timeline.in_use_timeline(p, max_points=200)
    assert len(tl.times) <= 400
    assert tl.peak_bytes == exp.peak_bytes
    assert max(tl.bytes) == exp.peak_bytes
    assert tl.times == sorted(tl.times)


def test_plot_writes_png(tmp_path):
    pytest.importorskip("matplotlib")
    a, b = tmp_path / "a.csv", tmp_path / "b.csv"
    write_synthetic(a, 3000, seed=1)
    write_synthetic(b, 3000, seed=2, start=12 * 3600.0 + 0.02)
    out = tmp_path / "plot.png"
    timelines = log_timeline.plot_logs([a, b], out)
    assert [t.source for t in timelines] == ["a", "b"]
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


# --- replay ------------------------------------------------------------------------------------


def test_replay_reproduces_the_peak(tmp_path):
    p = tmp_path / "w.csv"
    exp = write_synthetic(p, 5000, seed=11, failure_rate=0.0)
    r = replay.replay(p, "cuda", gpu=False)
    assert r.host_memory
    assert r.peak_bytes == exp.peak_bytes
    assert r.peak_upstream_bytes == exp.peak_bytes  # no suballocator: footprint = in use
    assert r.final_upstream_bytes == exp.outstanding_bytes
    assert (r.allocations, r.frees) == (exp.allocations, exp.frees)
    assert r.new_failures == 0 and not r.failed
    assert r.streams == 1 + 3  # one real handle + the per-thread stream of each of 3 threads


def test_replay_on_the_same_pool_reproduces_its_footprint(tmp_path):
    """Record a run on a pool, replay the log on a fresh pool of the same size: same peak in
    use (what statistics said) and the same footprint taken from upstream."""
    from dask_rmm.mr import PoolMemoryResource, StatisticsResourceAdaptor, SystemMemoryResource

    path = tmp_path / "pool.csv"
    counter = StatisticsResourceAdaptor(SystemMemoryResource())
    pool = PoolMemoryResource(counter, initial_pool_size=8 << 20)
    logged = logging_adaptor(pool, path)
    stats = StatisticsResourceAdaptor(logged)
    kept = run_workload(stats, steps=3000, seed=4, threads=1)
    for blk in kept:
        stats.deallocate(*blk)
    logged.flush()
    r = replay.replay(logged.get_file_name(), "pool", gpu=False, initial_pool_size=8 << 20)
    assert r.peak_bytes == stats.allocation_counts.peak_bytes
    assert r.peak_upstream_bytes == counter.allocation_counts.peak_bytes
    assert r.peak_upstream_bytes > 8 << 20  # the pool had to grow: the check means something


def test_replay_reports_new_failures_with_their_row(tmp_path):
    p = tmp_path / "w.csv"
    write_synthetic(p, 3000, seed=12, failure_rate=0.0)
    r = replay.replay(p, "pool", gpu=False, initial_pool_size=1 << 20, maximum_pool_size=4 << 20)
    assert r.failed and r.new_failures > 0
    f = r.failures[0]
    assert not f.original_failed
    assert f.line >= 2 and f.size > 0
    events = {e.line: e for e in logs.read_log(p)}
    assert events[f.line].action is Action.ALLOCATE
    assert events[f.line].size == f.size
    assert "line" in replay.format_result(r)


def test_replay_of_the_original_failures(tmp_path):
    p = _write(
        tmp_path,
        HEADER_LINE
        + "1,00:00:01.000000,allocate,0x100,256,0\n"
        + "1,00:00:01.000001,allocate failure,(nil),1024,0\n"
        + "2,00:00:01.000002,free,0x100,256,7f00\n",  # freed by another thread, stream
    )
    r = replay.replay(p, "cuda", gpu=False, retry_failures=True)
    assert (r.original_failures, r.original_failures_succeeded, r.new_failures) == (1, 1, 0)
    assert (r.allocations, r.frees, r.skipped_frees) == (1, 1, 0)
    assert r.peak_upstream_bytes == 256 + 1024  # the retried block was really allocated
    r = replay.replay(p, "cuda", gpu=False)  # by default failure rows are counted, not re-issued
    assert (r.original_failures, r.original_failures_succeeded, r.peak_upstream_bytes) == (
        1,
        0,
        256,
    )
    assert "not re-issued" in replay.format_result(r)


@pytest.mark.parametrize("name", ["pool", "arena", "binning", "fixed_size"])
def test_replay_each_suballocator(tmp_path, name):
    module = {"pool": "pool", "arena": "arena", "binning": "binning", "fixed_size": "fixed_size"}
    pytest.importorskip(f"dask_rmm.mr.{module[name]}")
    p = tmp_path / "w.csv"
    exp = write_synthetic(p, 2000, seed=13, failure_rate=0.0)
    r = replay.replay(p, name, gpu=False)
    assert r.peak_bytes == exp.peak_bytes or r.failed
    assert r.rows == 2000
    assert r.peak_upstream_bytes > 0


def test_replay_async_needs_a_gpu(tmp_path):
    p = tmp_path / "w.csv"
    write_synthetic(p, 10)
    with pytest.raises(RuntimeError, match="needs a CUDA device"):
        replay.replay(p, "async", gpu=False)


def test_comparison_table(tmp_path):
    p = tmp_path / "w.csv"
    write_synthetic(p, 1000, seed=14, failure_rate=0.0)
    results = [replay.replay(p, name, gpu=False) for name in ("pool", "cuda")]
    text = replay.format_comparison(results)
    assert "pool" in text and "cuda" in text and "smallest footprint" in text


def test_log_plot_legend_sits_outside_the_data_and_the_peak_labels(tmp_path):
    pytest.importorskip("matplotlib")
    from matplotlib.text import Annotation

    paths = []
    for i in range(3):  # peaks early, in the upper left where a legend used to go
        p = tmp_path / f"worker-{i}.csv"
        write_synthetic(p, 3000, seed=i + 1, start=12 * 3600.0 + 0.01 * i)
        paths.append(p)
    fig = log_timeline.timelines_figure(log_timeline.in_use_timeline(paths))
    fig.canvas.draw()
    renderer = fig.canvas.get_renderer()
    (ax,) = fig.axes
    data_area = ax.get_window_extent(renderer)
    legend = ax.get_legend().get_window_extent(renderer)
    assert not legend.overlaps(data_area)
    assert fig.bbox.contains(legend.x1 - 1, legend.y0 + 1)  # not cut off by the figure
    labels = [a for a in ax.texts if isinstance(a, Annotation)]
    assert len(labels) == 3
    for label in labels:
        box = label.get_window_extent(renderer)
        assert not box.overlaps(legend), label.get_text()
        assert data_area.x0 <= box.x0 and box.x1 <= data_area.x1, label.get_text()


_MALFORMED_COMPLETE_ROWS = [
    "1,00:00:02.0,reallocate,0x1,1,0",  # unknown action
    "1,00:00:02.0,allocate,0x1,1",  # a field short
    "1,00:00:02.0,allocate,0x1,1,0,7",  # a field too many
    "1,25:99:99.0,allocate,0x1,1,0",  # no time of day
    "1,00:00:02.0,allocate,0x1,-5,0",  # negative size
    "x,00:00:02.0,allocate,0x1,1,0",  # thread not a number
]


@pytest.mark.parametrize("ending", ["\n", "\r\n"])
@pytest.mark.parametrize("row", _MALFORMED_COMPLETE_ROWS)
def test_a_complete_malformed_last_row_is_an_error_not_a_cut_off_line(tmp_path, row, ending):
    p = _write(tmp_path, HEADER_LINE + "1,00:00:01.0,allocate,0x1,1,0\n" + row + ending)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no TruncatedLogWarning either
        with pytest.raises(LogFormatError, match="malformed row") as info:
            list(logs.read_log(p))
    assert info.value.line == 3
    # the same row followed by blank lines, or NUL fill after its newline: still complete
    p = _write(tmp_path, HEADER_LINE + row + ending + "\n\n", "blank-after.csv")
    with pytest.raises(LogFormatError, match="malformed row"):
        list(logs.read_log(p))


@pytest.mark.parametrize("row", _MALFORMED_COMPLETE_ROWS)
def test_the_same_rows_without_their_newline_are_cut_off(tmp_path, row):
    p = _write(tmp_path, HEADER_LINE + "1,00:00:01.0,allocate,0x1,1,0\n" + row)
    reader = logs.LogReader(p)
    with pytest.warns(TruncatedLogWarning):
        assert len(list(reader)) == 1
    assert reader.truncated == (3, row)


@pytest.mark.parametrize(
    "text",
    ["25:99:99", "24:00:00.000000", "12:60:00.000000", "12:00:60.000000", "12:-1:00.0",
     "-1:00:00.0", "12:00:-0.5", "99:00:00.0", "12:00:nan", "12:00:inf"],
)  # fmt: skip
def test_times_that_are_no_time_of_day_are_rejected(tmp_path, text):
    with pytest.raises(ValueError, match="not a time of day"):
        logs.parse_time(text)
    p = _write(tmp_path, HEADER_LINE + f"1,{text},allocate,0x1,1,0\n1,00:00:02.0,free,0x1,1,0\n")
    with pytest.raises(LogFormatError, match="not a time of day") as info:
        list(logs.read_log(p))
    assert info.value.line == 2


@pytest.mark.parametrize("text", ["00:00:00.000000", "23:59:59.999999", "12:30:15:250000"])
def test_times_of_day_still_read(text):
    h, m, s = (float(x) for x in text.replace(":", " ", 2).replace(":", ".").split())
    assert logs.parse_time(text) == pytest.approx(h * 3600 + m * 60 + s)


@pytest.mark.parametrize("gz", [False, True])
@pytest.mark.parametrize("newline", ["\n", "\r\n"])
def test_a_byte_order_mark_before_the_header_is_accepted(tmp_path, gz, newline):
    text = (
        HEADER_LINE + "1,00:00:01.000000,allocate,0x100,256,0\n1,00:00:02.000000,free,0x100,256,0\n"
    )
    data = ("\ufeff" + text.replace("\n", newline)).encode("utf-8")
    p = tmp_path / ("bom.csv.gz" if gz else "bom.csv")
    p.write_bytes(gzip.compress(data) if gz else data)
    events = [(e.action, e.size) for e in logs.read_log(p)]
    assert events == [(Action.ALLOCATE, 256), (Action.FREE, 256)]
    assert log_summary.summarize(p).files[0].peak_bytes == 256


@pytest.mark.parametrize("size", [1 << 64, 10**23])
def test_a_size_beyond_size_t_is_a_malformed_row(tmp_path, size):
    p = _write(
        tmp_path, HEADER_LINE + f"1,00:00:01.0,allocate,0x1,{size},0\n1,00:00:02.0,free,0x1,1,0\n"
    )
    with pytest.raises(LogFormatError, match="larger than any size RMM logs") as info:
        list(logs.read_log(p))
    assert info.value.line == 2
    largest = _write(
        tmp_path, HEADER_LINE + f"1,00:00:01.0,allocate,0x1,{(1 << 64) - 1},0\n", "max.csv"
    )
    assert [e.size for e in logs.read_log(largest)] == [(1 << 64) - 1]


def test_merge_logs_refuses_a_file_given_twice(tmp_path):
    p = tmp_path / "w0.csv"
    write_synthetic(p, 50, seed=4)
    for inputs in ([p, p], [p, str(p)], [p, tmp_path / "." / "w0.csv"]):
        with pytest.raises(ValueError, match="is given twice"):
            logs.merge_logs(inputs, tmp_path / "out.csv")
        assert not (tmp_path / "out.csv").exists()
