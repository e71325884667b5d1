"""ClusterMemoryReport: construction, totals and every rendering (text, HTML, JSON, frame, PNG)."""

from __future__ import annotations

import itertools
import json
import sys

import pytest

from dask_rmm.plotting.svg import bucket_maxima, timeline_svg
from dask_rmm.report.memory_report import ClusterMemoryReport, DeviceMemory, peak_of_sum


def _data(**overrides) -> dict:
    dev = {
        "current_bytes": 3 << 20,
        "current_count": 3,
        "peak_bytes": 5 << 20,
        "peak_count": 5,
        "total_bytes": 9 << 20,
        "total_count": 9,
        "reserved_bytes": 8 << 20,
        "pool_free_bytes": 5 << 20,
        "largest_free_block": 4 << 20,
        "failed_allocations": 1,
        "device_used_bytes": 0,
        "device_total_bytes": 0,
        "resource": "StatisticsResourceAdaptor>PoolMemoryResource>SystemMemoryResource",
        "task_groups": [["matmul", 2 << 20, 4 << 20], ["<script>", 1 << 20, 1 << 20]],
        "timeline": [
            [100.0, 1 << 20, 1 << 20],
            [100.1, 5 << 20, 5 << 20],
            [100.2, 3 << 20, 3 << 20],
        ],
    }
    data = {
        "version": 2,
        "time": 1700000000.0,
        "scheduler": "tcp://10.0.0.1:8786",
        "timeline_length": 3600,
        "workers": [
            {
                "address": "tcp://10.0.0.10:4000",
                "name": "w10",
                "status": "running",
                "devices": {"0": dev},
            },
            {
                "address": "tcp://10.0.0.2:4000",
                "name": "w2",
                "status": "running",
                "devices": {"0": dict(dev, current_bytes=1 << 20)},
            },
            {
                "address": "tcp://10.0.0.3:4000",
                "name": "w3",
                "status": "gone",
                "devices": {"0": dev},
            },
        ],
        "workers_without_dask_rmm": ["tcp://10.0.0.9:4000"],
    }
    data.update(overrides)
    return data


def test_from_dict_orders_running_by_address_then_gone():
    r = ClusterMemoryReport.from_dict(_data())
    assert [d.name for d in r.devices] == ["w2", "w10", "w3"]
    assert [d.status for d in r.devices] == ["running", "running", "gone"]
    assert r.workers == ["tcp://10.0.0.2:4000", "tcp://10.0.0.10:4000", "tcp://10.0.0.3:4000"]
    assert r.device("w10").current_bytes == 3 << 20
    with pytest.raises(KeyError, match="no dask-rmm data"):
        r.device("nope")
    # Host names with numbers and names at one place: numbers first, never compared with names.
    addresses = ["tcp://gpu.b:1", "tcp://gpu.7:1", "x"]
    workers = [dict(w, address=a) for w, a in zip(_data()["workers"], addresses, strict=True)]
    r = ClusterMemoryReport.from_dict(_data(workers=workers))
    assert r.workers == ["tcp://gpu.7:1", "tcp://gpu.b:1", "x"]


def test_totals_cover_running_workers_only():
    t = ClusterMemoryReport.from_dict(_data()).totals
    assert (t.workers, t.gone_workers, t.devices) == (2, 1, 2)
    assert t.current_bytes == 4 << 20
    assert t.peak_bytes == 10 << 20
    assert t.reserved_bytes == 16 << 20
    assert t.largest_free_block == 4 << 20
    assert t.failed_allocations == 2


def test_fragmentation():
    def frag(**fields):
        return DeviceMemory("w", "0", **fields).fragmentation

    assert frag(reserved_bytes=200, pool_free_bytes=100, largest_free_block=25) == 0.75
    assert frag(reserved_bytes=200, pool_free_bytes=100, largest_free_block=100) == 0.0
    assert frag(reserved_bytes=200, pool_free_bytes=0, largest_free_block=0) == 0.0
    # nothing in use (free chunks of an idle pool, or no pool at all): no figure
    assert frag(reserved_bytes=100, pool_free_bytes=100, largest_free_block=50) is None
    assert frag() is None


@pytest.mark.parametrize("chunks", [1, 2, 3, 5])
def test_an_idle_pool_in_separate_chunks_reads_no_fragmentation_anywhere(chunks):
    """A pool grown in ``chunks`` pieces, everything freed again (the issue's 50 % with two)."""
    from dask_rmm import mr

    MiB = 1 << 20
    pool = mr.PoolMemoryResource(mr.SystemMemoryResource(), 4 * MiB, 256 * MiB)
    blocks = [(pool.allocate(4 * MiB * (i + 1)), 4 * MiB * (i + 1)) for i in range(chunks)]
    busy = pool.reserved_memory_info()
    for ptr, n in blocks:
        pool.deallocate(ptr, n)
    info = pool.reserved_memory_info()
    assert info.reserved_bytes == info.free_bytes > info.largest_free_block or chunks == 1
    assert info.fragmentation is None
    assert busy.fragmentation is not None  # while in use, a figure
    device = {
        "reserved_bytes": info.reserved_bytes,
        "pool_free_bytes": info.free_bytes,
        "largest_free_block": info.largest_free_block,
    }
    r = ClusterMemoryReport.from_dict(
        {"workers": [{"address": "tcp://w:1", "devices": {"0": device}}]}
    )
    (d,) = r.devices
    assert d.fragmentation is None
    header, row = r.table_rows()[:2]
    assert row[header.index("frag")] == "-" and "%" not in " ".join(row)
    assert json.loads(r.to_json())["workers"][0]["devices"]["0"]["fragmentation"] is None


def test_dict_and_json_round_trip():
    r = ClusterMemoryReport.from_dict(_data())
    again = ClusterMemoryReport.from_dict(json.loads(r.to_json()))
    assert again == r
    d = r.to_dict()
    assert d["totals"]["current_bytes"] == 4 << 20
    assert d["workers"][0]["devices"]["0"]["fragmentation"] == pytest.approx(0.2)
    assert "timeline" not in r.to_dict(timeline=False)["workers"][0]["devices"]["0"]


def test_version_mismatch_is_explained():
    with pytest.raises(ValueError, match="same dask-rmm version"):
        ClusterMemoryReport.from_dict(_data(version=99))


def test_text_table():
    text = str(ClusterMemoryReport.from_dict(_data()))
    lines = text.splitlines()
    assert "tcp://10.0.0.1:8786" in lines[0]
    assert lines[1].split()[:3] == ["worker", "dev", "status"]
    assert "10.0.0.2:4000 (w2)" in text and "3.00 MiB" in text and "20%" in text
    assert "matmul 4.00 MiB" in text
    assert lines[-4].startswith("total (2 workers)") and "1 gone" in lines[-4]
    assert lines[-3].startswith("peak: the most each device held at once since the scheduler")
    assert lines[-2].startswith("* total peak")
    # the report names the workers that run without dask-rmm, not only how many
    assert lines[-1] == "1 worker(s) without dask-rmm (no dask-rmm metrics): tcp://10.0.0.9:4000"
    assert "2 workers (1 gone)" in repr(ClusterMemoryReport.from_dict(_data()))


def test_html_escapes_and_draws_svg():
    html = ClusterMemoryReport.from_dict(_data())._repr_html_()
    assert "&lt;script&gt;" in html and "<script>" not in html
    assert html.count("<tr") == 5 and '<tr class="gone"' in html
    assert "<svg" in html and html.count("<polyline") == 3
    report = ClusterMemoryReport.from_dict(_data())
    page = report.to_html(full_page=True, json_href="dask-rmm/report.json")
    assert page.startswith("<!DOCTYPE html>") and 'href="dask-rmm/report.json"' in page


def test_html_has_a_pressure_and_an_admission_section_only_when_something_happened():
    quiet = ClusterMemoryReport.from_dict(_data()).to_html()
    assert "<h4>Memory pressure</h4>" not in quiet and "<h4>Memory admission</h4>" not in quiet
    device = {"pauses": 2, "admission_total_held": 3, "admission_held_tasks": 1}
    busy = ClusterMemoryReport.from_dict(
        {"workers": [{"address": "tcp://w:1", "devices": {"0": device}}]}
    ).to_html()
    assert "<h4>Memory pressure</h4><ul><li>w:1/dev0: " in busy and "2 pauses" in busy
    assert "<h4>Memory admission</h4><ul><li>w:1: 1 held back now, 3 waited" in busy


def test_a_page_saved_elsewhere_names_the_json_command_instead_of_a_missing_file():
    """A standalone page linked to dask-rmm/report.json, which exists only on the scheduler."""
    report = ClusterMemoryReport.from_dict(_data())
    page = report.to_html(full_page=True)
    assert "report.json" not in page and "<a href" not in page.split('class="foot"')[1]
    assert f"dask rmm report {report.scheduler} --json" in page


def test_empty_report_renders():
    r = ClusterMemoryReport.from_dict(_data(workers=[], workers_without_dask_rmm=[]))
    assert "no dask-rmm workers" in str(r)
    assert "No dask-rmm workers" in r._repr_html_()
    assert r.to_frame().empty
    assert r.totals.current_bytes == 0


def test_to_frame():
    df = ClusterMemoryReport.from_dict(_data()).to_frame()
    assert list(df["name"]) == ["w2", "w10", "w3"]
    assert df.loc[df.name == "w10", "current_bytes"].item() == 3 << 20
    assert df["fragmentation"].iloc[0] == pytest.approx(0.2)


def test_to_frame_without_pandas(monkeypatch):
    monkeypatch.setitem(sys.modules, "pandas", None)
    with pytest.raises(ImportError, match="needs pandas: pip install pandas"):
        ClusterMemoryReport.from_dict(_data()).to_frame()


def test_plot_without_matplotlib(monkeypatch):
    monkeypatch.setitem(sys.modules, "matplotlib", None)
    with pytest.raises(ImportError, match="needs matplotlib"):
        ClusterMemoryReport.from_dict(_data()).plot()


def test_plot_writes_png(tmp_path):
    pytest.importorskip("matplotlib")
    out = tmp_path / "report.png"
    fig = ClusterMemoryReport.from_dict(_data()).plot(str(out))
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert len(fig.axes) == 2
    ClusterMemoryReport.from_dict(_data(workers=[])).plot(str(tmp_path / "empty.png"))


def test_svg_bucket_maxima_keep_extremes():
    pts = [[float(i), 0, (i * 7919) % 1000] for i in range(10000)]
    pts[5001][2] = 10**6
    buckets = bucket_maxima(pts, 0.0, 9999.0, 100)
    assert len(buckets) == 100 and None not in buckets
    assert max(buckets) == 10**6 and buckets.count(10**6) <= 2  # the spike's bucket(s) only


# The SVG's plot area (timeline_svg's defaults): x from 78 over 632 px, y = 0 bytes at 246.
_LEFT, _PW, _BASE = 78, 632, 246.0


def _polylines(svg: str) -> list[list[tuple[float, float]]]:
    import re

    return [
        [tuple(map(float, xy.split(","))) for xy in m.split()]
        for m in re.findall(r'<polyline[^>]*points="([^"]*)"', svg)
    ]


def _height(lines: list[list[tuple[float, float]]], xq: float) -> float:
    """The drawn height (pixels above zero bytes) at ``xq``: the highest of the lines' segments
    there (a vertical step counts at its top)."""
    best = 0.0
    for pts in lines:
        for (x0, y0), (x1, y1) in itertools.pairwise(pts):
            if x0 <= xq <= x1:
                yq = min(y0, y1) if x1 == x0 else y0 + (y1 - y0) * (xq - x0) / (x1 - x0)
                best = max(best, _BASE - yq)
    return best


def _x(t: float, t0: float, t1: float) -> float:
    return _LEFT + (t - t0) / (t1 - t0) * _PW


@pytest.mark.parametrize("burst_at", [3, 10, 20])
@pytest.mark.parametrize("spacing", [6.4, 3.0])
def test_svg_draws_a_burst_between_coarse_samples_as_a_burst_not_a_triangle(burst_at, spacing):
    """Samples ``spacing`` s apart, each the most in use since the one before; a burst of 1.5 s
    falls into the interval ending at sample ``burst_at``."""
    samples = [[i * spacing, 0, 100 << 20 if i == burst_at else 1 << 20] for i in range(30)]
    t0, t1 = samples[0][0], samples[-1][0]
    lines = _polylines(timeline_svg([("w/dev0", "running", samples)]))
    top = max(_height(lines, _x(t, t0, t1)) for t, _, _ in samples)
    start, end = (burst_at - 1) * spacing, burst_at * spacing
    px = _PW / (t1 - t0)  # pixels per second
    # the burst's height over its whole interval (the samples say no more of when it was) ...
    for f in (0.1, 0.5, 0.9):
        assert _height(lines, _x(start + f * spacing, t0, t1)) == pytest.approx(top, abs=0.5)
    # ... and nowhere else: half an interval after it, the floor again (a line sloping down
    # to the next sample read half the burst there)
    for t in (start - 0.5 * spacing, end + 0.5 * spacing, end + 2 / px):
        assert _height(lines, _x(t, t0, t1)) < 0.05 * top


def test_svg_device_lines_never_rise_above_the_total_line():
    """Two devices sampled at their heartbeats, one joining late, and the cluster total at the
    same times (the most of the sum in each interval), each cut to the page's buckets as the
    scheduler does: every device's line stays at or under the total's."""
    import numpy as np

    from dask_rmm.scheduler.resolution import SAMPLE_DTYPE, downsample

    times = np.arange(0.0, 3600.0, 0.5)

    def in_use(seed: int, joined: float) -> np.ndarray:
        rng = np.random.default_rng(seed)
        fine = rng.integers(0, 50, len(times)).astype(np.int64) << 20
        for start in rng.uniform(joined, 3600, 12):  # 1.5 s bursts
            fine[(times >= start) & (times < start + 1.5)] += 400 << 20
        fine[times < joined] = 0
        return fine

    a, b = in_use(1, 0.0), in_use(2, 1234.5)

    def series(values: np.ndarray, since: float) -> list[list[float]]:
        keep = times >= since
        pts = np.zeros(int(keep.sum()), SAMPLE_DTYPE)
        pts["t"], pts["c"], pts["m"] = times[keep], values[keep], values[keep]
        return downsample(pts, 640).tolist()

    total = series(a + b, 0.0)
    dev_a, dev_b = series(a, 0.0), series(b, 1234.5)
    svg = timeline_svg(
        [("total", "total", total), ("a/dev0", "running", dev_a), ("b/dev0", "running", dev_b)]
    )
    total_line, line_a, line_b = _polylines(svg)
    # Within a pixel: the three series were cut into time buckets of their own spans.
    for xq in np.arange(_LEFT + 0.25, _LEFT + _PW, 0.5):
        cluster = max(_height([total_line], xq + dx) for dx in (-1.0, -0.5, 0.0, 0.5, 1.0))
        assert _height([line_a], xq) <= cluster + 0.5, xq
        assert _height([line_b], xq) <= cluster + 0.5, xq


def test_svg_without_samples_and_single_sample():
    assert "no samples yet" in timeline_svg([])
    assert "<circle" in timeline_svg([("w/dev0", "running", [[1.0, 5, 5]])])


def test_totals_peak_is_the_peak_of_the_sum_not_the_sum_of_peaks():
    # w2 peaks at 5 MiB at t=100.1; w10 peaks at 5 MiB at t=200.1: never both at once.
    late = [[t + 100, cur, mx] for t, cur, mx in _data()["workers"][0]["devices"]["0"]["timeline"]]
    data = _data()
    data["workers"][0]["devices"]["0"] = dict(data["workers"][0]["devices"]["0"], timeline=late)
    t = ClusterMemoryReport.from_dict(data).totals
    assert t.sum_of_device_peaks == 2 * (5 << 20)
    # At t=200.1: w10 holds 5 MiB, w2 still 3 MiB (its last sample).
    assert t.peak_bytes == (5 << 20) + (3 << 20)
    assert peak_of_sum([]) is None
    no_timeline = ClusterMemoryReport.from_dict(_data()).to_dict(timeline=False)
    r = ClusterMemoryReport.from_dict(no_timeline)
    assert r.totals.peak_bytes is None and "total peak: needs the timelines" in str(r)


def test_physical_gpu_and_retired_bytes_are_shown():
    data = _data()
    gpu = {"gpu_name": "NVIDIA H200", "gpu_uuid": "GPU-5f3c1a2b-0000", "retired_bytes": 300 << 20}
    data["workers"][0]["devices"]["0"] = dict(data["workers"][0]["devices"]["0"], **gpu)
    r = ClusterMemoryReport.from_dict(data)
    text = str(r)
    assert "0 NVIDIA H200 GPU-5f3c1a2b" in text and "+300.00 MiB retired" in text
    assert r.totals.retired_bytes == 300 << 20
    row = r.to_frame().set_index("name").loc["w10"]
    assert (row["gpu_name"], row["retired_bytes"]) == ("NVIDIA H200", 300 << 20)


def test_plot_legends_sit_outside_the_data():
    pytest.importorskip("matplotlib")
    fig = ClusterMemoryReport.from_dict(_data()).plot()
    fig.canvas.draw()
    renderer = fig.canvas.get_renderer()
    for ax in fig.axes:
        legend = ax.get_legend()
        assert legend is not None
        box = legend.get_window_extent(renderer)
        assert not box.overlaps(ax.get_window_extent(renderer)), ax.get_title()
        assert fig.bbox.contains(box.x1 - 1, box.y0 + 1), ax.get_title()


def test_bytes_held_free_in_library_caches_are_told_apart_from_bytes_in_arrays():
    data = _data()
    cache = {"library_cached_bytes": 2 << 20, "library_caches": "cupy,rmm"}
    data["workers"][0]["devices"]["0"] = dict(data["workers"][0]["devices"]["0"], **cache)
    r = ClusterMemoryReport.from_dict(data)
    d = r.device("tcp://10.0.0.10:4000", 0)
    assert (d.current_bytes, d.library_cached_bytes, d.in_array_bytes) == (
        3 << 20,
        2 << 20,
        1 << 20,
    )
    text = str(r)
    assert "library caches (allocated = in arrays + held free in the caches" in text
    assert "w10)/dev0: 1.00 MiB in arrays, 2.00 MiB held free in the cupy,rmm cache(s)" in text
    assert text.count("MiB held free in the") == 1  # devices without a cache get no line
    row = r.to_frame().set_index("name").loc["w10"]
    assert row["library_cached_bytes"] == 2 << 20
    again = ClusterMemoryReport.from_dict(json.loads(r.to_json()))
    assert again.device("tcp://10.0.0.10:4000", 0).library_caches == "cupy,rmm"


def test_a_total_peak_above_the_rows_peaks_is_explained():
    """After an unregistration the total row's peak (384 MiB) stood far above the rows' peaks
    (36 + 64 MiB) with nothing saying why."""
    data = _data()
    rows = ClusterMemoryReport.from_dict(data).totals
    data["totals"] = dict(rows.to_dict(), peak_bytes=384 << 20, sum_of_device_peaks=100 << 20)
    data["totals_cover"] = "cluster"
    text = str(ClusterMemoryReport.from_dict(data))
    assert "total peak 384.00 MiB is above the sum of the rows' peaks (100.00 MiB)" in text
    assert "no longer listed" in text
    assert "is above the sum" not in str(ClusterMemoryReport.from_dict(_data()))
