"""Prometheus metrics for dask-rmm on the scheduler's /metrics: cluster totals
(``dask_rmm_cluster_*``, worker and device counts) always, and one series per running worker
device for each :data:`dask_rmm.wire.GAUGES` field plus fragmentation while the cluster has at
most ``dask-rmm.scheduler.prometheus-device-limit`` devices (a scrape formats every series on the
event loop; its cost a series is in bench/README.md). Needs prometheus_client (an optional dependency).
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import TYPE_CHECKING

import dask.config
from prometheus_client import REGISTRY
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from dask_rmm.scheduler.report_build import ReportRequest
from dask_rmm.wire import GAUGES, DeviceSample, to_int, unmeasured_fields

if TYPE_CHECKING:
    from dask_rmm.scheduler.timeline import SchedulerTimelinePlugin

__all__ = ["DEFAULT_DEVICE_LIMIT", "REGISTRY", "DaskRMMCollector"]

LABELS = ["worker", "name", "device", "gpu"]
#: Per-device series up to this many devices when the config does not say.
DEFAULT_DEVICE_LIMIT = 500
#: Totals exported as ``dask_rmm_cluster_<field>`` (summed over running devices).
_CLUSTER: tuple[str, ...] = ("current_bytes", "reserved_bytes", "pool_free_bytes", "retired_bytes")
_CLUSTER += ("failed_allocations", "spilled_bytes", "oom_count", "ooms_avoided")


class DaskRMMCollector:
    """Yields the ``dask_rmm_*`` families of one SchedulerTimelinePlugin (none once it is
    unregistered from its scheduler)."""

    def __init__(self, plugin: SchedulerTimelinePlugin):
        self.plugin = plugin

    def describe(self) -> list:
        # Describing none keeps registration from calling collect() and several schedulers
        # in one process (tests) from clashing over the names.
        return []

    def collect(self) -> Iterator[GaugeMetricFamily]:
        plugin = self.plugin
        if not plugin.poll():  # stops a plugin that was unregistered
            return
        # The totals are kept up to date as heartbeats arrive: no pass over every device on
        # the event loop (the final peak: the not-yet-final samples would take a sort of every
        # waiting sample; the next scrape has them).
        sums = plugin.cluster_sums()
        workers = GaugeMetricFamily(
            "dask_rmm_workers", "Workers reporting dask-rmm metrics", labels=["status"]
        )
        workers.add_metric(["running"], sums["workers"])
        workers.add_metric(["gone"], sums["gone_workers"])
        yield workers
        count = GaugeMetricFamily("dask_rmm_devices", "Devices of running dask-rmm workers")
        count.add_metric([], sums["devices"])
        yield count
        for field in _CLUSTER:
            family = GaugeMetricFamily(
                f"dask_rmm_cluster_{field}", f"Sum of {field} over the running devices"
            )
            family.add_metric([], sums[field])
            yield family
        # A device with statistics=False has no timeline: a cluster peak without it is no peak.
        if not sums["unmeasured_devices"]:
            peak = GaugeMetricFamily(
                "dask_rmm_cluster_peak_bytes",
                "Most bytes all devices held at once (peak of the summed timelines)",
            )
            peak.add_metric([], plugin.cluster_peak)
            yield peak

        limit = dask.config.get(
            "dask-rmm.scheduler.prometheus-device-limit", default=DEFAULT_DEVICE_LIMIT
        )
        if sums["devices"] > limit:
            return
        snap = plugin.snapshot(ReportRequest(timeline=False))
        running = [x for x in snap.devices() if x.running]
        kinds = {"gauge": GaugeMetricFamily, "counter": CounterMetricFamily}
        gauges = [(f, kinds[kind](name, text, labels=LABELS)) for f, name, text, kind in GAUGES]
        frag = GaugeMetricFamily(
            "dask_rmm_fragmentation_ratio",
            "1 - largest free block / free bytes in the pool (absent while none of it is in use)",
            labels=LABELS,
        )
        in_use = GaugeMetricFamily(
            "dask_rmm_library_in_use_bytes",
            "Bytes in a library's objects (arrays, tensors) on the device",
            labels=[*LABELS, "library", "beside_stack"],
        )
        held_free = GaugeMetricFamily(
            "dask_rmm_library_cache_free_bytes",
            "Bytes a library's cache holds free on the device",
            labels=[*LABELS, "library", "beside_stack"],
        )
        outside = GaugeMetricFamily(
            "dask_rmm_outside_bytes",
            "Device memory in use outside dask-rmm (used less what the stack and the libraries "
            "beside it hold: CUDA contexts, workspaces, other processes)",
            labels=LABELS,
        )
        for x in running:
            d = x.d
            labels = [
                x.rec.address,
                x.rec.name,
                x.dev,
                str(d.get("gpu_uuid") or d.get("gpu_name") or ""),
            ]
            skip = unmeasured_fields(d.get("measured"))  # statistics=False: not exported
            for field, family in gauges:
                if field in skip:
                    continue
                value = x.row_peak() if field == "peak_bytes" else to_int(d.get(field))
                family.add_metric(labels, value)
            if x.frag is not None:  # no figure while none of the pool is in use
                frag.add_metric(labels, x.frag)
            sample = DeviceSample.from_dict(d)
            for share in sample.libraries:
                where = [share.library, "1" if share.outside_stack else "0"]
                in_use.add_metric(labels + where, share.in_use_bytes)
                held_free.add_metric(labels + where, share.cached_bytes)
            outside_bytes = sample.outside_dask_rmm_bytes
            if outside_bytes is not None:
                outside.add_metric(labels, outside_bytes)
        for _, family in gauges:
            yield family
        yield frag
        yield in_use
        yield held_free
        yield outside
