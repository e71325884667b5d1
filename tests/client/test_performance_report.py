"""dask_rmm.performance_report: the GPU memory section (built from known samples and reports),
where it goes in distributed's page, and end to end on a LocalCluster: the file is
self-contained, holds distributed's report and ours, and renders in headless Chromium."""

from __future__ import annotations

import html
import json
import re
import shutil
import subprocess

import pytest
from conftest import HAS_GPU, hold, local_process_cluster
from distributed import wait
from distributed.utils_test import gen_cluster

from dask_rmm.client.performance import SECTION_ID, gpu_section_html, performance_report
from dask_rmm.client.sampler import DeviceSeries, GPUSamples
from dask_rmm.plotting.svg import PALETTE
from dask_rmm.plugin import RMMPlugin
from dask_rmm.report.memory_report import ClusterMemoryReport

MiB = 1 << 20


def _report(t: float, spilled: int, ooms: list[dict], groups: list) -> ClusterMemoryReport:
    device = {
        "current_bytes": 4 * MiB,
        "total_spilled_bytes": spilled,
        "oom_count": len(ooms),
        "oom_events": ooms,
        "task_groups": groups,
    }
    return ClusterMemoryReport.from_dict(
        {
            "time": t,
            "workers": [{"address": "tcp://w:1", "name": "w", "devices": {"0": device}}],
        }
    )


def _block() -> GPUSamples:
    s = GPUSamples("performance report", start=100.0, stop=110.0)
    d = s.devices[("tcp://w:1", "0")] = DeviceSeries("tcp://w:1", "w", "0")
    d.add_used([(101.0, MiB, 2 * MiB), (105.0, 3 * MiB, 9 * MiB)], 100.0, 110.0)
    d.add_reserved(100.0, 16 * MiB)
    return s


def test_the_section_shows_the_blocks_peak_timeline_task_groups_ooms_in_it_and_spills():
    oom_before = {"time": 50.0, "verdict": "demand", "requested": MiB, "task_key": "old"}
    oom = {"time": 104.0, "verdict": "fragmentation", "requested": 3 * MiB, "task_key": "x-1"}
    begin = _report(100.0, 2 * MiB, [oom_before], [["load", 0, 5 * MiB], ["old", 0, MiB]])
    end = _report(110.0, 7 * MiB, [oom_before, oom], [["load", 0, 8 * MiB], ["old", 0, MiB]])
    section = gpu_section_html(_block(), begin, end)
    assert section.startswith(f'<section id="{SECTION_ID}"')
    assert "at most <b>9.00 MiB</b> in use at once" in section
    assert "<b>16.00 MiB</b> reserved" in section
    assert section.count("<polyline") >= 2  # the cluster's line and the device's
    assert "<td>load</td><td>8.00 MiB</td><td>yes</td>" in section
    assert "<td>old</td><td>1.00 MiB</td><td>before it</td>" in section
    assert "<td>x-1</td><td>fragmentation</td>" in section
    assert "old</td><td>demand" not in section  # an OOM from before the block
    assert "Spilled 5.00 MiB to host" in section
    assert "<script" not in section


@pytest.mark.parametrize(
    "names, title",
    [(["host"], "Host memory"), (["NVIDIA H200"], "GPU memory"),
     (["host", "NVIDIA H200"], "GPU and host memory"), ([], "GPU memory")],
)  # fmt: skip
def test_the_section_is_titled_by_the_memory_the_stacks_hand_out(names, title):
    """It said "GPU memory" on host memory (base_resource="system")."""
    report = ClusterMemoryReport.from_dict(
        {
            "time": 110.0,
            "workers": [
                {"address": f"tcp://w:{i}", "name": f"w{i}", "devices": {"0": {"gpu_name": n}}}
                for i, n in enumerate(names)
            ],
        }
    )
    section = gpu_section_html(_block(), None, report)
    assert f"<h2>{title} (dask-rmm)</h2>" in section


def _summary_text(page: str) -> str:
    """The Summary tab's HTML: the text in the page's bokeh document that holds the title."""

    def texts(node):
        if isinstance(node, str):
            yield node
        for value in (
            node.values() if isinstance(node, dict) else node if isinstance(node, list) else ()
        ):
            yield from texts(value)

    for m in re.finditer(r'<script type="application/json"[^>]*>(.*?)</script>', page, re.S):
        for text in texts(json.loads(html.unescape(m.group(1)))):
            if "Dask Performance Report" in text:
                return text
    raise AssertionError("no Summary tab in the page's bokeh document")


def burst(nbytes: int) -> int:
    from dask_rmm import DeviceBuffer

    b = DeviceBuffer(size=nbytes)
    del b
    return nbytes


@gen_cluster(client=True, nthreads=[("127.0.0.1", 1)])
async def test_async_with_writes_the_report_with_the_gpu_section(c, s, a):
    pytest.importorskip("bokeh", reason="distributed's performance report needs bokeh")
    import tempfile
    from pathlib import Path

    await c.register_plugin(RMMPlugin(base_resource="system", pool_size="8MiB"))
    with tempfile.TemporaryDirectory() as d:
        path = Path(d) / "async.html"
        async with performance_report(str(path), interval=0.05) as pr:
            assert await c.submit(burst, 6 * MiB, pure=False) == 6 * MiB  # a < b
        summary = _summary_text(path.read_text())
    assert "<h2>Host memory (dask-rmm)</h2>" in summary
    # after the calling code (this test's, escaped), inside the Summary tab's HTML
    assert summary.index("# a &lt; b") < summary.index(f'<section id="{SECTION_ID}"')
    assert pr.sampler.samples["performance report"].peak_used >= 6 * MiB


@gen_cluster(client=True, nthreads=[("127.0.0.1", 1)])
async def test_the_task_group_table_shows_the_blocks_peaks_not_those_since_setup(c, s, a):
    """After a larger earlier run every row said "before it", with the earlier peak."""
    pytest.importorskip("bokeh", reason="distributed's performance report needs bokeh")
    import tempfile
    from pathlib import Path

    await c.register_plugin(RMMPlugin(base_resource="system", pool_size="16MiB"))
    await c.submit(burst, 12 * MiB, pure=False)  # before the block: a larger peak
    with tempfile.TemporaryDirectory() as d:
        path = Path(d) / "block.html"
        async with performance_report(str(path), interval=0.05) as pr:
            await c.submit(burst, 3 * MiB, pure=False)
        summary = _summary_text(path.read_text())
    summary = summary[summary.index(f'<section id="{SECTION_ID}"') :]  # not the calling code
    assert pr.block_peaks == {a.address: {"0": {"burst": 3 * MiB}}}
    assert "<td>burst</td><td>3.00 MiB</td>" in summary
    assert "12.00 MiB" not in summary.split("Task groups")[1].split("</table>")[0]
    assert "Peaks over this block only" in summary
    # the peaks since setup are still what the cluster report says
    stack = a.plugins["dask-rmm"].resources()[0]
    assert {m.owner: m.peak_bytes for m in stack.get_attribution()}["burst"] == 12 * MiB


@pytest.fixture(scope="module")
def report_file(tmp_path_factory):
    pytest.importorskip("bokeh", reason="distributed's performance report needs bokeh")
    path = tmp_path_factory.mktemp("perf") / "report.html"
    with local_process_cluster() as (cluster, client):
        client.register_plugin(
            RMMPlugin(base_resource="cuda" if HAS_GPU else "system", pool_size="32MiB")
        )
        with performance_report(str(path)) as pr:
            held = client.map(hold, [8 * MiB, 4 * MiB], pure=False)
            wait(held)
            wait(client.map(burst, [20 * MiB] * 4, pure=False))
            del held
    return path, pr


@pytest.mark.slow
def test_the_report_file_is_distributeds_report_with_the_gpu_section_and_needs_no_network(
    report_file,
):
    path, pr = report_file
    page = path.read_text()
    summary = _summary_text(page)
    assert "Dask Performance Report" in summary
    kind = "GPU memory" if HAS_GPU else "Host memory"
    assert f"<h2>{kind} (dask-rmm)</h2>" in summary and "<polyline" in summary
    samples = pr.sampler.samples["performance report"]
    assert samples.peak_used >= 20 * MiB + 8 * MiB
    assert "<td>burst</td><td>20.00 MiB</td>" in summary  # the block's own peak
    assert "wait(client.map(burst, [20 * MiB] * 4" in summary  # the calling code: the fixture's
    # bokeh's JavaScript is inline: no script or style sheet is loaded from elsewhere (only
    # distributed's favicon link is)
    assert not re.search(r'<script[^>]+src="', page)
    assert not re.search(r'<link[^>]+rel="stylesheet"', page)


def _chromium() -> str:
    for name in ("chromium", "chromium-browser", "google-chrome", "chrome"):
        found = shutil.which(name)
        if found:
            return found
    pytest.skip("no Chromium on this host (apt-get install chromium) to render the report in")


@pytest.mark.slow
def test_the_report_renders_in_headless_chromium_with_the_gpu_plot_drawn(report_file, tmp_path):
    browser = _chromium()
    path, _ = report_file
    shot = tmp_path / "report.png"
    args = [browser, "--headless", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage"]
    args += ["--hide-scrollbars", "--window-size=1300,1800", "--virtual-time-budget=10000"]
    out = subprocess.run(
        [*args, f"--screenshot={shot}", path.as_uri()], capture_output=True, text=True, timeout=120
    )
    assert out.returncode == 0, out.stderr
    dom = subprocess.run(
        [*args, "--dump-dom", path.as_uri()], capture_output=True, text=True, timeout=120
    )
    assert dom.returncode == 0, dom.stderr
    assert "<title>Dask Performance Report</title>" in dom.stdout
    from matplotlib.image import imread

    pixels = imread(str(shot))[..., :3]
    # The timeline's lines (the cluster's, its reserved bytes, each device's; one may hide
    # another) in the palette's colours, drawn by bokeh's Div at run time: the section lives in
    # bokeh's document, not in the page's own HTML. The Summary tab draws nothing else in them.
    drawn = 0
    for colour in PALETTE[:4]:
        rgb = tuple(int(colour[i : i + 2], 16) / 255 for i in (1, 3, 5))
        drawn += int((abs(pixels - rgb) < 0.02).all(axis=-1).sum())
    assert drawn > 300, f"no timeline in the rendered report ({drawn} pixels in its colours)"
