"""Prometheus metrics for dask-rmm on the scheduler's /metrics: one series per running worker
device for each :data:`dask_rmm.wire.GAUGES` field, plus fragmentation and worker counts.
Needs prometheus_client (an optional dependency).
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import TYPE_CHECKING

from prometheus_client import REGISTRY
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from dask_rmm.wire import GAUGES

if TYPE_CHECKING:
    from dask_rmm.scheduler.timeline import SchedulerTimelinePlugin

__all__ = ["REGISTRY", "DaskRMMCollector"]

LABELS = ["worker", "name", "device", "gpu"]


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
        kinds = {"gauge": GaugeMetricFamily, "counter": CounterMetricFamily}
        gauges = [(f, kinds[kind](name, text, labels=LABELS)) for f, name, text, kind in GAUGES]
        frag = GaugeMetricFamily(
            "dask_rmm_fragmentation_ratio",
            "1 - largest free block / free bytes in the pool",
            labels=LABELS,
        )
        workers = GaugeMetricFamily(
            "dask_rmm_workers", "Workers reporting dask-rmm metrics", labels=["status"]
        )
        report = plugin.memory_report(timeline=False)
        for d in report.running:
            labels = [d.worker, d.name, d.device, d.gpu_uuid or d.gpu_name]
            for field, family in gauges:
                family.add_metric(labels, getattr(d, field))
            frag.add_metric(labels, d.fragmentation)
        totals = report.totals
        workers.add_metric(["running"], totals.workers)
        workers.add_metric(["gone"], totals.gone_workers)
        yield workers
        for _, family in gauges:
            yield family
        yield frag
