"""Prometheus gauges for dask-rmm on the scheduler's /metrics (``dask_rmm_*``, one series per
running worker and device). Registered once per process by SchedulerTimelinePlugin; the data
comes from dask_rmm.cluster. Needs prometheus_client (an optional dependency).
"""

from __future__ import annotations

import threading
import weakref
from collections.abc import Iterator
from typing import TYPE_CHECKING

from prometheus_client import REGISTRY
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

if TYPE_CHECKING:
    from dask_rmm.cluster import SchedulerTimelinePlugin

__all__ = ["GAUGES", "DaskRMMCollector", "register_plugin", "unregister_plugin"]

LABELS = ["worker", "name", "device"]

#: gauge name -> (heartbeat field, help text)
GAUGES = {
    "dask_rmm_used_bytes": ("current_bytes", "Bytes allocated through RMM now"),
    "dask_rmm_peak_bytes": (
        "peak_bytes",
        "Largest bytes allocated at once since the resource was made",
    ),
    "dask_rmm_reserved_bytes": ("reserved_bytes", "Bytes the pool holds from its upstream"),
    "dask_rmm_pool_free_bytes": ("pool_free_bytes", "Bytes free inside the pool"),
    "dask_rmm_largest_free_block_bytes": ("largest_free_block", "Largest free block in the pool"),
    "dask_rmm_device_total_bytes": ("device_total_bytes", "Total device memory (0 on host memory)"),
}
FAILURES = (
    "dask_rmm_failed_allocations",
    "failed_allocations",
    "Allocations whose upstream raised",
)


class DaskRMMCollector:
    """Yields the dask_rmm_* families for every live SchedulerTimelinePlugin in this process."""

    def __init__(self) -> None:
        self.plugins: weakref.WeakSet[SchedulerTimelinePlugin] = weakref.WeakSet()

    def describe(self) -> list:
        # Names are fixed, but describing none keeps registration from calling collect().
        return []

    def collect(self) -> Iterator[GaugeMetricFamily | CounterMetricFamily]:
        gauges = {
            name: GaugeMetricFamily(name, text, labels=LABELS) for name, (_, text) in GAUGES.items()
        }
        failures = CounterMetricFamily(FAILURES[0], FAILURES[2], labels=LABELS)
        frag = GaugeMetricFamily(
            "dask_rmm_fragmentation_ratio",
            "1 - largest free block / free bytes in the pool",
            labels=LABELS,
        )
        workers = GaugeMetricFamily(
            "dask_rmm_workers", "Workers reporting dask-rmm metrics", labels=["status"]
        )
        running = gone = 0
        for plugin in list(self.plugins):
            if plugin.scheduler is None or plugin.scheduler.plugins.get(plugin.name) is not plugin:
                continue
            for rec in list(plugin._records.values()):
                if rec.status == "running":
                    running += 1
                else:
                    gone += 1
            for rec, dev, d in plugin.running_devices():
                labels = [rec.address, rec.name, dev]
                for name, (field, _) in GAUGES.items():
                    gauges[name].add_metric(labels, _number(d.get(field)))
                failures.add_metric(labels, _number(d.get(FAILURES[1])))
                free = _number(d.get("pool_free_bytes"))
                frag.add_metric(
                    labels,
                    max(0.0, 1 - _number(d.get("largest_free_block")) / free) if free > 0 else 0.0,
                )
        workers.add_metric(["running"], running)
        workers.add_metric(["gone"], gone)
        yield workers
        yield from gauges.values()
        yield failures
        yield frag


def _number(value: object) -> float:
    try:
        return float(value)  # type: ignore[arg-type]
    except (TypeError, ValueError):
        return 0.0


_lock = threading.Lock()
_collector: DaskRMMCollector | None = None


def register_plugin(plugin: SchedulerTimelinePlugin) -> None:
    """Export ``plugin``'s data; the collector is registered with prometheus_client only once."""
    global _collector
    with _lock:
        if _collector is None:
            _collector = DaskRMMCollector()
            REGISTRY.register(_collector)
        _collector.plugins.add(plugin)


def unregister_plugin(plugin: SchedulerTimelinePlugin) -> None:
    with _lock:
        if _collector is not None:
            _collector.plugins.discard(plugin)
