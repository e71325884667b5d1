"""Allocation statistics for the current device's resource, as RMM's ``rmm.statistics``:
enable/disable, the ``statistics()`` context, the counter stack and the memory profiler.

The counting itself is :class:`~dask_rmm.mr.StatisticsResourceAdaptor`'s; cluster-wide
reports are :mod:`dask_rmm.report`'s.
"""

from __future__ import annotations

import dataclasses
import functools
import inspect
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Literal, TypeVar

from dask_rmm.mr import registry
from dask_rmm.mr.statistics_adaptor import Statistics, StatisticsResourceAdaptor

__all__ = [
    "ProfilerContext",
    "ProfilerRecords",
    "Statistics",
    "default_profiler_records",
    "disable_statistics",
    "enable_statistics",
    "get_statistics",
    "pop_statistics",
    "profiler",
    "push_statistics",
    "statistics",
]

F = TypeVar("F", bound=Callable)


def _current_stats_mr() -> StatisticsResourceAdaptor | None:
    mr = registry.get_current_device_resource()
    return mr if isinstance(mr, StatisticsResourceAdaptor) else None


def enable_statistics() -> None:
    """Count allocations on the current device from now on: wrap its resource in a
    :class:`StatisticsResourceAdaptor` (which must stay on top), unless it is one already.

    >>> from dask_rmm import statistics
    >>> from dask_rmm.mr import SystemMemoryResource, set_current_device_resource
    >>> _ = set_current_device_resource(SystemMemoryResource())
    >>> statistics.enable_statistics()
    >>> statistics.get_statistics().current_bytes
    0
    """
    mr = registry.get_current_device_resource()
    if not isinstance(mr, StatisticsResourceAdaptor):
        registry.set_current_device_resource(StatisticsResourceAdaptor(mr))


def disable_statistics() -> None:
    """Make the upstream of the current :class:`StatisticsResourceAdaptor`, if it is one, the
    current resource (buffers allocated through the adaptor still free through it)."""
    if (mr := _current_stats_mr()) is not None:
        registry.set_current_device_resource(mr.get_upstream())


def get_statistics() -> Statistics | None:
    """The current counters, or ``None`` when statistics are not enabled."""
    return None if (mr := _current_stats_mr()) is None else mr.allocation_counts


def push_statistics() -> Statistics | None:
    """Push a fresh set of counters; returns the counters before the push (``None`` if
    statistics are not enabled, in which case nothing happens)."""
    return None if (mr := _current_stats_mr()) is None else mr.push_counters()


def pop_statistics() -> Statistics | None:
    """Pop the top counters and fold them into the ones below; returns the popped counters
    (``None`` if statistics are not enabled; IndexError when nothing was pushed)."""
    return None if (mr := _current_stats_mr()) is None else mr.pop_counters()


@contextmanager
def statistics() -> Iterator[None]:
    """Gather statistics inside a ``with`` block: a counter frame pushed and popped if they are
    enabled, else a :class:`StatisticsResourceAdaptor` current for the block. ValueError on
    exit when the block changed the current resource (nothing is restored over that change)."""
    previous = registry.get_current_device_resource()
    inside = (
        previous
        if isinstance(previous, StatisticsResourceAdaptor)
        else StatisticsResourceAdaptor(previous)
    )
    pushed = inside is previous
    if pushed:
        inside.push_counters()
    else:
        registry.set_current_device_resource(inside)
    try:
        yield
    finally:
        now = registry.get_current_device_resource()
        if pushed:
            inside.pop_counters()
        if now is not inside:
            raise ValueError(
                "the current memory resource was changed inside dask_rmm.statistics.statistics(): "
                f"expected {inside!r} on exit, found {now!r}; the previous resource was not "
                "restored"
            )
        if not pushed:
            registry.set_current_device_resource(previous)


class ProfilerRecords:
    """Memory statistics per profiled function or code block (thread-safe)."""

    @dataclass
    class MemoryRecord:
        """One name's calls, bytes allocated over all of them and largest peak of any one."""

        num_calls: int = 0
        memory_total: int = 0
        memory_peak: int = 0

        def add(self, memory_total: int, memory_peak: int) -> None:
            self.num_calls += 1
            self.memory_total += memory_total
            self.memory_peak = max(self.memory_peak, memory_peak)

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._records: dict[str, ProfilerRecords.MemoryRecord] = {}

    def add(self, name: str, data: Statistics) -> None:
        """Record one call of ``name`` that allocated ``data.total_bytes`` with peak
        ``data.peak_bytes``."""
        with self._lock:
            record = self._records.setdefault(name, ProfilerRecords.MemoryRecord())
            record.add(memory_total=data.total_bytes, memory_peak=data.peak_bytes)

    @property
    def records(self) -> dict[str, ProfilerRecords.MemoryRecord]:
        """``{name: MemoryRecord}`` (a copy)."""
        with self._lock:
            return {k: dataclasses.replace(v) for k, v in self._records.items()}

    def clear(self) -> None:
        """Forget every record."""
        with self._lock:
            self._records.clear()

    def report(
        self, ordered_by: Literal["num_calls", "memory_peak", "memory_total"] = "memory_peak"
    ) -> str:
        """The records as RMM's text table, largest ``ordered_by`` first."""
        if ordered_by not in ("num_calls", "memory_peak", "memory_total"):
            raise ValueError(
                f"ordered_by must be 'num_calls', 'memory_peak' or 'memory_total', got {ordered_by!r}"
            )
        records = sorted(
            self.records.items(), key=lambda kv: getattr(kv[1], ordered_by), reverse=True
        )
        lines = ["Memory Profiling", "================", ""]
        if not records:
            lines.append("No data, maybe profiling wasn't enabled?")
            return "\n".join(lines)
        lines += [
            f"Ordered by:   {ordered_by}",
            "Memory units: bytes",
            "",
            "ncalls     memory_peak    memory_total  filename:lineno(function)",
        ]
        for name, d in records:
            lines.append(f"{d.num_calls:6,d} {d.memory_peak:15,d} {d.memory_total:15,d}  {name}")
        return "\n".join(lines)

    #: RMM's older name for :meth:`report`.
    pretty_print = report

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.records})"

    def __str__(self) -> str:
        return self.report()


def _get_descriptive_name_of_object(func: Callable) -> str:
    """``file:line(qualname)`` of ``func``, the record name of an unnamed profiler (RMM's name)."""
    func = inspect.unwrap(func)
    try:
        _, line = inspect.getsourcelines(func)
        path = inspect.getfile(func)
    except (OSError, TypeError):
        return getattr(func, "__qualname__", repr(func))
    return f"{path}:{line}({func.__qualname__})"


#: The records :func:`profiler` writes to unless given others.
default_profiler_records = ProfilerRecords()


class ProfilerContext:
    """Record the memory statistics of a function or ``with`` block in ``records`` (default
    :data:`default_profiler_records`) under ``name`` (required for a block; a function's
    defaults to ``"file:line(qualname)"``); nested profilers each count. What :func:`profiler`
    returns (RMM's name); does nothing while statistics are disabled."""

    def __init__(self, records: ProfilerRecords | None = None, name: str = ""):
        if records is not None and not isinstance(records, ProfilerRecords):
            raise TypeError(f"records must be a ProfilerRecords, got {type(records).__name__}")
        if not isinstance(name, str):
            raise TypeError(f"name must be a str, got {name!r}")
        self.records = default_profiler_records if records is None else records
        self.name = name
        self._pushed: list[StatisticsResourceAdaptor | None] = []

    def __call__(self, func: F) -> F:
        name = self.name or _get_descriptive_name_of_object(func)
        records = self.records

        @functools.wraps(func)
        def wrapper(*args, **kwargs):
            with ProfilerContext(records, name):
                return func(*args, **kwargs)

        return wrapper  # type: ignore[return-value]

    def __enter__(self) -> ProfilerContext:
        if not self.name:
            raise ValueError("profiler used as a context manager needs a name: profiler(name=...)")
        mr = _current_stats_mr()
        if mr is not None:
            mr.push_counters()
        self._pushed.append(mr)
        return self

    def __exit__(self, *exc) -> Literal[False]:
        if (mr := self._pushed.pop()) is not None:
            self.records.add(self.name, mr.pop_counters())
        return False


def profiler(*, records: ProfilerRecords | None = None, name: str = "") -> ProfilerContext:
    """Decorator and context manager: a :class:`ProfilerContext`."""
    return ProfilerContext(records, name)
