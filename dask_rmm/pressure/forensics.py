"""OOM forensics: what the device's memory looked like when an ``OutOfMemoryError`` reached a
task, and why it failed ("fragmentation" or "demand"). Dask-free; the snapshot is a frozen
dataclass with ``to_dict()`` and ``save(path)`` (JSON)."""

from __future__ import annotations

import json
import os
import time
from collections.abc import Iterable
from dataclasses import asdict, dataclass, field
from typing import Any

from dask_rmm._output import atomic_output
from dask_rmm.sizes import align_up, format_bytes

__all__ = ["DEMAND", "FRAGMENTATION", "OOMEvent", "free_block_histogram", "oom_verdict"]

#: The free bytes would have fit the request, but no single free block did.
FRAGMENTATION = "fragmentation"
#: Not enough free memory: more was asked for than the device (or pool maximum) had free.
DEMAND = "demand"


def oom_verdict(requested: int, free_bytes: int | None, largest_free_block: int | None) -> str:
    """``"fragmentation"`` when ``free_bytes`` would fit the (256-aligned) request but the
    largest free block would not; ``"demand"`` otherwise (also when the numbers are unknown)."""
    need = align_up(requested)
    enough_free = free_bytes is not None and free_bytes >= need
    no_block_fits = largest_free_block is not None and largest_free_block < need
    return FRAGMENTATION if enough_free and no_block_fits else DEMAND


def free_block_histogram(sizes: Iterable[int]) -> list[tuple[int, int, int]]:
    """Free blocks by power-of-two size class: ``[(class floor in bytes, count, bytes), ...]``,
    smallest first, empty classes left out."""
    buckets: dict[int, list[int]] = {}
    for s in sizes:
        if s <= 0:
            continue
        floor = 1 << (s.bit_length() - 1)
        b = buckets.setdefault(floor, [0, 0])
        b[0] += 1
        b[1] += s
    return [(floor, c, n) for floor, (c, n) in sorted(buckets.items())]


@dataclass(frozen=True)
class OOMEvent:
    """One out-of-memory failure that reached a caller, with the state of the device's memory.

    ``recent_events`` are the last allocation events before it, oldest first, as
    ``(unix time, "alloc" | "free" | "fail", nbytes, pointer, task key)``.
    """

    time: float
    device: int
    task_key: str | None
    task_prefix: str | None
    requested: int
    resource: str
    message: str
    pool_size: int | None
    maximum_pool_size: int | None
    free_bytes: int | None
    largest_free_block: int | None
    verdict: str
    #: Bytes moved off the device while trying to serve this request before giving up.
    spilled_trying: int = 0
    #: Bytes each library cache gave back while trying (arbitration), by library.
    released_by_library: dict[str, int] = field(default_factory=dict)
    free_block_histogram: list[tuple[int, int, int]] = field(default_factory=list)
    live_bytes_by_prefix: list[tuple[str, int]] = field(default_factory=list)
    recent_events: list[tuple[float, str, int, int, str | None]] = field(default_factory=list)
    worker: str | None = None

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        for k in ("free_block_histogram", "live_bytes_by_prefix", "recent_events"):
            d[k] = [list(x) for x in d[k]]
        return d

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> OOMEvent:
        d = dict(d)
        for k in ("free_block_histogram", "live_bytes_by_prefix", "recent_events"):
            d[k] = [tuple(x) for x in d.get(k, [])]
        known = cls.__dataclass_fields__
        return cls(**{k: v for k, v in d.items() if k in known})

    def save(self, path: str | os.PathLike) -> str:
        """Write the snapshot as JSON to ``path``, never half-written (``atomic_output``)."""
        with atomic_output(path) as tmp, open(tmp, "w") as f:
            json.dump(self.to_dict(), f, indent=1)
        return os.fspath(path)

    def summary(self) -> str:
        """One line: when, which task, what was asked, the verdict and the free memory."""
        when = time.strftime("%H:%M:%S", time.localtime(self.time))
        return (
            f"{when} {self.task_key or '(no task)'}: requested {format_bytes(self.requested)}, "
            f"{self.verdict}; free {format_bytes(self.free_bytes)}, largest free block "
            f"{format_bytes(self.largest_free_block)}, pool {format_bytes(self.pool_size)} of "
            f"{format_bytes(self.maximum_pool_size)}"
        )
