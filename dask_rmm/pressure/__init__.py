"""GPU memory pressure on Dask workers: spill task outputs from device to host over a device
limit and on out-of-memory (then retry), pause a worker whose device is nearly full, and record
what the memory looked like when an out-of-memory error still reached a task.

Layers: ``device_objects`` (what can be spilled, and how), ``victims`` (which), ``store`` (the
worker's data mapping that spills), ``adaptor`` (the resource on top of the stack), ``device``
(policy and forensics per device), ``forensics``, ``metrics``, ``worker`` (wiring on a worker).
Only ``worker`` imports distributed, and only when used.
"""

from __future__ import annotations

from dask_rmm.pressure.adaptor import SpillOnDemandResourceAdaptor
from dask_rmm.pressure.device import DevicePressure
from dask_rmm.pressure.device_objects import HostCopy, device_allocations, to_host
from dask_rmm.pressure.forensics import DEMAND, FRAGMENTATION, OOMEvent, oom_verdict
from dask_rmm.pressure.metrics import PressureCounters, PressureMetrics
from dask_rmm.pressure.store import DeviceSpillStore

__all__ = [
    "DEMAND",
    "FRAGMENTATION",
    "DevicePressure",
    "DeviceSpillStore",
    "HostCopy",
    "OOMEvent",
    "PressureCounters",
    "PressureMetrics",
    "SpillOnDemandResourceAdaptor",
    "device_allocations",
    "oom_verdict",
    "to_host",
]
