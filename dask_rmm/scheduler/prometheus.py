"""Prometheus metrics for dask-rmm (needs prometheus_client): cluster totals on /metrics, per-device
series there up to ``prometheus-device-limit`` devices and at any size on /dask-rmm/metrics
(docs/reports.md). Not here: the pages (``http.py``)."""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, Any

import dask.config
from prometheus_client import REGISTRY, Metric, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

from dask_rmm.report import ClusterTotals
from dask_rmm.scheduler.report_build import ReportRequest, Snapshot
from dask_rmm.wire import GAUGES, DeviceSample, device_entries

if TYPE_CHECKING:
    from dask_rmm.scheduler.timeline import SchedulerTimelinePlugin

__all__ = ["DEFAULT_DEVICE_LIMIT", "REGISTRY", "DaskRMMCollector"]

#: A device's labels: the worker's address and name, the device id on the worker, ``gpu`` (its
#: UUID, or its name without one), and DCGM exporter's ``UUID``, ``modelName``, ``pci_bus_id``
#: and ``Hostname``, so that a query can join dask-rmm's series with DCGM's.
LABELS = ["worker", "name", "device", "gpu", "UUID", "modelName", "pci_bus_id", "Hostname"]
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
        if not (plugin.large and _in_loop()):
            if not plugin.poll():
                return
            request = ReportRequest(timeline=False)
            yield from _families(
                _kept_totals(plugin),
                plugin._total.peak,
                lambda: device_families(plugin.snapshot(request)),
            )
            return
        if not plugin.active:
            plugin.poll()  # stops it
            return
        # The families of the shared snapshot (at most SNAPSHOT_INTERVAL old), made in the
        # report thread: a scrape costs the loop the same at any size and scrape rate. Until the
        # first is made (a moment after the first scrape), the totals alone, from the kept
        # entries: a scrape is never empty.
        made = plugin.exported_now("families", snapshot_families)
        if made is None:
            made = _families(_kept_totals(plugin), plugin._total.peak, list)
        yield from made


def _kept_totals(plugin: Any) -> ClusterTotals:
    """The cluster totals from the kept device entries, with no snapshot."""
    records = list(plugin._records.values())
    return ClusterTotals.over(
        (
            (r.address, r.status == "running", d, 0)
            for r in records
            for d in device_entries(r.metrics).values()
        ),
        None,
    )


def _in_loop() -> bool:
    try:
        asyncio.get_running_loop()
    except RuntimeError:
        return False
    return True


def snapshot_families(snap: Snapshot) -> list:
    """Every family of ``/metrics`` made from ``snap`` (any thread): the workers, devices and
    cluster totals, and the per-device families up to ``prometheus-device-limit`` devices."""
    devices = snap.devices()
    peak = snap.total.peak if snap.total is not None else 0
    return _families(snap.totals(devices, None), peak, lambda: device_families(snap, devices))


def _families(totals: ClusterTotals, peak: int, per_device: Callable[[], list]) -> list:
    """The workers, devices and cluster totals, the cluster's ``peak``, and ``per_device()`` up
    to ``prometheus-device-limit`` devices."""
    workers = GaugeMetricFamily(
        "dask_rmm_workers", "Workers reporting dask-rmm metrics", labels=["status"]
    )
    workers.add_metric(["running"], totals.workers)
    workers.add_metric(["gone"], totals.gone_workers)
    count = GaugeMetricFamily("dask_rmm_devices", "Devices of running dask-rmm workers")
    count.add_metric([], totals.devices)
    made = [workers, count]
    # A total that leaves out devices of statistics=False (the report's "n/a") is not exported,
    # nor the cluster peak then (such a device has no timeline).
    for field in (f for f in _CLUSTER if getattr(totals, f) is not None):
        family = GaugeMetricFamily(
            f"dask_rmm_cluster_{field}", f"Sum of {field} over the running devices"
        )
        family.add_metric([], getattr(totals, field))
        made.append(family)
    if not totals.unmeasured_devices:
        family = GaugeMetricFamily(
            "dask_rmm_cluster_peak_bytes",
            "Most bytes all devices held at once (peak of the summed timelines)",
        )
        family.add_metric([], peak)
        made.append(family)
    limit = dask.config.get("dask-rmm.scheduler.prometheus-device-limit", DEFAULT_DEVICE_LIMIT)
    if totals.devices <= limit:
        made += per_device()
    return made


def device_families(snap: Snapshot, devices: list | None = None) -> list:
    """One series per running device of ``snap`` (of ``devices``, its devices, when given) for
    each :data:`dask_rmm.wire.GAUGES` field, fragmentation, each library's bytes and the memory
    outside dask-rmm (any thread)."""
    running = [x for x in (snap.devices() if devices is None else devices) if x.running]
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
        "Device memory of the worker's process outside dask-rmm (its use per NVML less what "
        "the stack and the libraries beside it hold: CUDA contexts, workspaces; without NVML's "
        "figure, the device's use less those: other processes included)",
        labels=LABELS,
    )
    for x in running:
        sample = DeviceSample.from_dict(x.d)
        labels = [
            x.rec.address,
            x.rec.name,
            x.dev,
            sample.gpu_uuid or sample.gpu_name,
            sample.gpu_uuid,
            sample.gpu_name,
            sample.pci_bus_id,
            _host(x.rec.address),
        ]
        skip = sample.unmeasured  # statistics=False: not exported
        for field, family in gauges:
            if field in skip:
                continue
            value = x.peak if field == "peak_bytes" else getattr(sample, field)
            family.add_metric(labels, value)
        if x.frag is not None:  # no figure while none of the pool is in use
            frag.add_metric(labels, x.frag)
        for share in sample.libraries:
            where = [share.library, "1" if share.outside_stack else "0"]
            in_use.add_metric(labels + where, share.in_use_bytes)
            held_free.add_metric(labels + where, share.cached_bytes)
        if (outside_bytes := sample.outside_dask_rmm_bytes) is not None:
            outside.add_metric(labels, outside_bytes)
    return [family for _, family in gauges] + [frag, in_use, held_free, outside]


def device_text(snap: Snapshot) -> list[bytes]:
    """:func:`device_families` in the Prometheus text format (what /dask-rmm/metrics serves),
    one piece a family: each piece is joined and encoded in one C call that holds the GIL, a
    family of 16,000 devices a few MB, the whole text a hundred."""
    return [generate_latest(_Made(family)) for family in device_families(snap)]


class _Made(Collector):
    """A collector of one family already made."""

    def __init__(self, family: Metric) -> None:
        self.family = family

    def collect(self) -> Iterator[Metric]:
        yield self.family


def _host(address: str) -> str:
    """The host of a worker address ("tcp://10.0.0.1:4000" -> "10.0.0.1")."""
    rest = address.split("://", 1)[-1]
    return rest.rsplit(":", 1)[0].strip("[]") if ":" in rest else rest
