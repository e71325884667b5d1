"""docs/reports.md shows the report as the code prints it: its sample table is compared with a
real rendering of the same numbers, and what it tells users to look for is there."""

from __future__ import annotations

import re
import time
from pathlib import Path

from dask_rmm.mr.attribution_adaptor import UNATTRIBUTED
from dask_rmm.report.memory_report import ClusterMemoryReport

DOC = Path(__file__).resolve().parents[2] / "docs" / "reports.md"
MiB = 1 << 20


def _device(current, peak, total, free, largest, uuid, groups, timeline_max) -> dict:
    return {
        "current_bytes": current * MiB,
        "peak_bytes": peak * MiB,
        "total_bytes": total * MiB,
        "reserved_bytes": 512 * MiB,
        "pool_free_bytes": free * MiB,
        "largest_free_block": largest * MiB,
        "failed_allocations": 0,
        "gpu_name": "NVIDIA H200",
        "gpu_uuid": uuid,
        "task_groups": [[g, 0, p * MiB] for g, p in groups],
        "timeline_max": timeline_max,
    }


def sample_report() -> ClusterMemoryReport:
    """The numbers of the sample in docs/reports.md: two H200 workers, whose peaks (288 and
    114 MiB at that moment) came together."""
    t = time.mktime(time.strptime("2026-11-29 12:25:14", "%Y-%m-%d %H:%M:%S"))  # local time
    a = _device(117, 288, 807, 395, 255, "GPU-5f3c1a2b-9d4e-4c1f-8a77-1b2c3d4e5f60",
                [("transform", 148), ("load", 140)], 288)  # fmt: skip
    b = _device(50, 228, 486, 462, 348, "GPU-0b7e44c1-0211-4f6e-9c3d-7a8b9c0d1e2f",
                [("transform", 128), ("load", 100)], 114)  # fmt: skip
    workers = []
    for address, d in (("tcp://10.0.0.2:35983", a), ("tcp://10.0.0.3:44111", b)):
        at_peak = d.pop("timeline_max") * MiB
        d["timeline"] = [[t - 10, 0, at_peak], [t, d["current_bytes"], d["current_bytes"]]]
        workers.append({"address": address, "name": address, "devices": {"0": d}})
    return ClusterMemoryReport.from_dict(
        {"version": 2, "time": t, "scheduler": "tcp://10.0.0.1:8786", "workers": workers}
    )


def _doc_sample() -> str:
    text = DOC.read_text()
    m = re.search(r"```\n(dask-rmm cluster memory report:.*?)```", text, re.S)
    assert m, "docs/reports.md lost its sample report"
    return m.group(1)


def test_the_sample_report_in_the_docs_is_what_the_code_prints():
    real = str(sample_report()) + "\n"
    assert _doc_sample() == real, (
        "docs/reports.md's sample differs from the real output; paste this there:\n" + real
    )


def test_the_docs_explain_no_task():
    text = DOC.read_text()
    assert f"`{UNATTRIBUTED}`" in text
    line = next(x for x in text.splitlines() if f"`{UNATTRIBUTED}`" in x)
    assert "no task was running" in line
