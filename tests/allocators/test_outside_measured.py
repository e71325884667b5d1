"""The report's "outside dask-rmm" is measured per process where the driver tells (the
process's device memory less what the stack and every known library hold, labelled
"(measured)", other processes a part of their own), and cuDF's spilled and spillable bytes
reach the heartbeat and the report (host memory; a stand-in of cuDF's spill manager)."""

from __future__ import annotations

from dask_rmm import wire
from dask_rmm.stack.build import build_stack
from dask_rmm.stack.options import RMMOptions
from dask_rmm.worker.metrics import WorkerMetrics, _DeviceSamples, process_used_bytes
from dask_rmm.worker.stacks import install_stack, uninstall_stack
from tests.allocators.test_library_breakdown import _FIELDS, _report_with
from tests.pressure.test_cudf_spilling import _Buffer, cudf  # noqa: F401 (a fixture)

MiB = 1 << 20


def test_outside_dask_rmm_is_the_processs_memory_less_what_is_held_and_says_so():
    sample = wire.DeviceSample(**_FIELDS, process_used_bytes=30 * MiB)
    assert sample.outside_measured
    assert sample.outside_dask_rmm_bytes == 30 * MiB - 16 * MiB - 7 * MiB  # not a remainder
    parts = dict(sample.breakdown())
    assert parts["outside dask-rmm (measured)"] == 7 * MiB
    assert parts["other processes"] == 10 * MiB and "outside dask-rmm" not in parts
    assert sum(parts.values()) == 40 * MiB
    again = wire.DeviceSample.from_dict(sample.to_dict())
    assert again.process_used_bytes == 30 * MiB and again.outside_measured
    report = _report_with({**_FIELDS, "process_used_bytes": 30 * MiB})
    line = [ln for ln in str(report).splitlines() if "(gpu)/dev0:" in ln][-1]
    assert "7.00 MiB outside dask-rmm (measured), 10.00 MiB other processes" in line
    unmeasured = wire.DeviceSample(**_FIELDS)  # no figure from the driver: the old remainder
    assert not unmeasured.outside_measured
    assert dict(unmeasured.breakdown())["outside dask-rmm"] == 17 * MiB


def test_without_a_driver_the_process_figure_is_zero():
    assert process_used_bytes("0000:00:00.0") == 0


def test_cudfs_spilled_and_spillable_bytes_reach_the_heartbeat_and_the_report(cudf):  # noqa: F811
    stack = build_stack(RMMOptions(base_resource="system", pool_size=16 * MiB), 0)
    install_stack(stack)
    try:
        cudf._buffers += [_Buffer(MiB), _Buffer(2 * MiB)]
        cudf.spill_device_memory(MiB)
        d = WorkerMetrics._device_metrics(_DeviceSamples(stack), 10, [])
    finally:
        cudf._buffers.clear()
        uninstall_stack(stack)
    assert (d["cudf_spilled_bytes"], d["cudf_spillable_bytes"]) == (MiB, 2 * MiB)
    cudf_fields = {k: d[k] for k in ("cudf_spilled_bytes", "cudf_spillable_bytes")}
    report = str(_report_with({**_FIELDS, **cudf_fields}))
    assert "cuDF: 1.00 MiB spilled, 2.00 MiB spillable" in report
