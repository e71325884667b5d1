"""Memory-pressure counters of one worker, per device: what is spilled now, what was spilled and
brought back, the time it took, OOMs avoided and OOMs that reached a task, pauses. Dask-free;
``PressureMetrics.to_dict()`` is the form that travels in the heartbeat."""

from __future__ import annotations

import threading
from dataclasses import asdict, dataclass

__all__ = ["PressureCounters", "PressureMetrics"]


@dataclass(frozen=True)
class PressureMetrics:
    """One device's memory-pressure counters at one moment (bytes are device bytes)."""

    device: int = 0
    #: Bytes and objects on host (or disk) now that were moved off the device.
    spilled_bytes: int = 0
    spilled_count: int = 0
    #: Totals since setup: moved off the device, and brought back.
    total_spilled_bytes: int = 0
    total_spilled_count: int = 0
    total_unspilled_bytes: int = 0
    total_unspilled_count: int = 0
    #: Seconds spent copying to host and back.
    spill_seconds: float = 0.0
    unspill_seconds: float = 0.0
    #: Allocations that failed, then succeeded after spilling.
    ooms_avoided: int = 0
    #: OutOfMemoryErrors that reached the caller (each has an entry in the OOM events).
    oom_count: int = 0
    #: Tasks that raised an out-of-memory error (of any library) and were run once more after
    #: room was made (memory admission / spill_on_oom), and those of them that then succeeded.
    task_retries: int = 0
    task_retries_succeeded: int = 0
    #: Times the worker was paused for device memory, and whether it is paused now.
    pauses: int = 0
    paused: bool = False
    #: The device_memory_limit in bytes (None: no limit).
    device_memory_limit: int | None = None

    def to_dict(self) -> dict:
        return asdict(self)


class PressureCounters:
    """The mutable counters behind :class:`PressureMetrics`, one set per device, thread safe."""

    def __init__(self):
        self._lock = threading.Lock()
        self._by_device: dict[int, dict] = {}

    def _row(self, device: int) -> dict:
        row = self._by_device.get(device)
        if row is None:
            row = self._by_device[device] = asdict(PressureMetrics(device=device))
        return row

    def _moved(self, device: int, nbytes: int, seconds: float, way: str) -> None:
        """``way``: "spill" (off the device), "unspill" (back) or "forget" (deleted spilled)."""
        with self._lock:
            r = self._row(device)
            sign = 1 if way == "spill" else -1
            r["spilled_bytes"] += sign * nbytes
            r["spilled_count"] += sign
            if way != "forget":
                r[f"total_{way}ed_bytes"] += nbytes
                r[f"total_{way}ed_count"] += 1
                r[f"{way}_seconds"] += seconds

    def spilled(self, device: int, nbytes: int, seconds: float) -> None:
        self._moved(device, nbytes, seconds, "spill")

    def unspilled(self, device: int, nbytes: int, seconds: float) -> None:
        self._moved(device, nbytes, seconds, "unspill")

    def forgotten(self, device: int, nbytes: int) -> None:
        """A spilled object was deleted without being brought back."""
        self._moved(device, nbytes, 0.0, "forget")

    def add(self, device: int, field: str, n: int = 1) -> None:
        with self._lock:
            self._row(device)[field] += n

    def set_paused(self, device: int, paused: bool) -> None:
        with self._lock:
            r = self._row(device)
            if paused and not r["paused"]:
                r["pauses"] += 1
            r["paused"] = paused

    def set_limit(self, device: int, limit: int | None) -> None:
        with self._lock:
            self._row(device)["device_memory_limit"] = limit

    def snapshot(self, device: int) -> PressureMetrics:
        with self._lock:
            return PressureMetrics(**self._row(device))
