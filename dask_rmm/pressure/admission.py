"""Memory admission's policy, without distributed: what a task is expected to need at its
peak, learned per task prefix (or given with ``dask.annotate(gpu_memory="2GiB")``), in a table
of bounded size. Holding tasks back and placing them is distributed's own work, through worker
resources (:mod:`dask_rmm.worker.admission`, :mod:`dask_rmm.scheduler.admission`).
"""

from __future__ import annotations

import heapq
import re
import weakref
from collections import OrderedDict, deque
from collections.abc import Hashable
from typing import Any

from dask.utils import key_split, parse_bytes

__all__ = [
    "ANNOTATION",
    "NO_MEMORY",
    "RESOURCE",
    "UNLIMITED",
    "PeakTable",
    "admission_of",
    "annotated_peak",
    "task_prefix",
]

#: The worker resource admission holds: bytes of device memory. A worker supplies its limit
#: (``device_memory_limit``, else the pool's maximum, else the device's memory).
RESOURCE = "dask-rmm-device-bytes"
#: What a worker supplies once admission is off there: more than any task asks for.
UNLIMITED = 1 << 50
#: The task annotation giving a task's expected peak: ``dask.annotate(gpu_memory="2GiB")``.
ANNOTATION = "gpu_memory"
#: An expected peak at most this many bytes needs no device memory: never held back.
NO_MEMORY = 1 << 20
#: Peaks kept per prefix (the newest); the expected peak is the largest of them.
HISTORY = 16
#: Prefixes kept (the least recently used go first).
MAX_PREFIXES = 1024

# A numeric or hash-like tail ("job_0", "load-17", "part.3", "x_9f8e7d6c5b"): custom keys
# that differ only there are one prefix.
_TAIL = re.compile(r"(?:[-_.]?(?:[0-9]+|[0-9a-f]{8,}))+$")


def task_prefix(key: Hashable) -> str:
    """The prefix a task's peak is learned under: ``key_split(key)`` without a numeric or
    hash-like tail.

    >>> task_prefix(("matmul-3f2a9c8d1e0b4a6f", 4, 2)), task_prefix("job_17"), task_prefix("a-1")
    ('matmul', 'job', 'a')
    """
    name = key_split(key)
    return _TAIL.sub("", name) or name


def annotated_peak(annotations: dict | None) -> int | None:
    """The bytes of a task's ``gpu_memory`` annotation; None if absent. Raises ValueError naming
    the annotation for a value that is not a size."""
    value = (annotations or {}).get(ANNOTATION)
    if value is None:
        return None
    try:
        nbytes = parse_bytes(value) if isinstance(value, str) else int(value)
    except (TypeError, ValueError) as e:
        raise ValueError(f"annotation {ANNOTATION}={value!r} is not a size: {e}") from None
    if nbytes < 0:
        raise ValueError(f"annotation {ANNOTATION}={value!r} is negative")
    return nbytes


class PeakTable:
    """Observed peak bytes per task prefix, least recently used out past ``size`` prefixes.

    >>> table = PeakTable(size=2)
    >>> table.observe("load", 30); table.observe("load", 10); table.observe("sum", 0)
    30
    30
    0
    >>> table.observe("mean", 5)  # "load" was used least recently: it goes
    5
    >>> table.expected("load"), table.expected("mean"), len(table)
    (None, 5, 2)
    """

    def __init__(self, size: int = MAX_PREFIXES, history: int = HISTORY):
        self.size = max(int(size), 1)
        self.history = max(int(history), 1)
        self._peaks: OrderedDict[str, deque[int]] = OrderedDict()

    def observe(self, prefix: str, nbytes: int) -> int:
        """Record one finished task's peak; the prefix's expected peak now."""
        peaks = self._peaks.get(prefix)
        if peaks is None:
            peaks = self._peaks[prefix] = deque(maxlen=self.history)
            if len(self._peaks) > self.size:
                self._peaks.popitem(last=False)
        else:
            self._peaks.move_to_end(prefix)
        peaks.append(max(int(nbytes), 0))
        return max(peaks)

    def expected(self, prefix: str) -> int | None:
        """The expected peak of ``prefix`` (the largest of its last peaks), None if unknown."""
        peaks = self._peaks.get(prefix)
        if peaks is None:
            return None
        self._peaks.move_to_end(prefix)
        return max(peaks)

    def top(self, n: int) -> list[tuple[str, int, int]]:
        """``(prefix, expected peak, peaks kept)`` of the ``n`` largest, largest first."""
        rows = ((max(p), k, len(p)) for k, p in self._peaks.items())
        return [(k, b, m) for b, k, m in heapq.nlargest(n, rows)]

    def __len__(self) -> int:
        return len(self._peaks)


#: Each worker's admission (``dask_rmm.worker.admission.WorkerAdmission``), by worker.
installed: weakref.WeakKeyDictionary[Any, Any] = weakref.WeakKeyDictionary()


def admission_of(worker: Any) -> Any:
    """The admission installed on ``worker`` (a ``WorkerAdmission``), or None."""
    return installed.get(worker)
