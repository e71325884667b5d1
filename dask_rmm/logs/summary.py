"""Summaries of RMM allocation logs (counts, peak and when, leaks, size histogram, per-thread and
per-stream totals), typed and as text. Reading logs is :mod:`dask_rmm.logs`; no plotting here.
"""

from __future__ import annotations

import heapq
import os
from collections import Counter, defaultdict
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from typing import Any

from dask_rmm.logs.reader import (
    Action,
    LiveAllocations,
    LogEvent,
    LogReader,
    format_time,
    read_logs,
)
from dask_rmm.sizes import format_bytes

__all__ = [
    "LogSummary",
    "Outstanding",
    "Summarizer",
    "SummaryReport",
    "Totals",
    "format_size",
    "format_summary",
    "summarize",
]

_ALLOCATE = Action.ALLOCATE
_FREE = Action.FREE
_RESTART = Action.RESTART
_LATE = LiveAllocations.LATE_FREE


@dataclass
class Totals:
    """Counts and bytes of one thread, stream or file."""

    allocations: int = 0
    allocated_bytes: int = 0
    frees: int = 0
    freed_bytes: int = 0
    failures: int = 0
    failed_bytes: int = 0


@dataclass(frozen=True)
class Outstanding:
    """An allocation never freed in the log (a leak, or still live when the log ended)."""

    source: str
    pointer: int
    size: int
    line: int
    time: float
    thread: int
    stream: int


@dataclass(frozen=True)
class LogSummary:
    """What a log (or several, combined) says about memory use. Byte counts are requested
    sizes, as logged (what ``StatisticsResourceAdaptor`` counts), not what the resource reserved;
    times are seconds since midnight."""

    name: str  #: the file's worker name, or ``"combined"``
    paths: tuple[str, ...]  #: the files summarized
    rows: int
    start: float | None  #: the first time
    end: float | None  #: the last time
    duration: float
    allocations: int  #: rows per action ...
    frees: int
    failures: int
    allocated_bytes: int  #: ... and their bytes
    freed_bytes: int
    failed_bytes: int
    peak_bytes: int  #: the largest sum of live allocations
    peak_count: int  #: most allocations live at once (not necessarily at ``peak_bytes``)
    peak_time: float | None  #: when the peak was first reached, by the row ...
    peak_line: int | None
    peak_source: str | None
    outstanding_bytes: int  #: allocated and never freed by the end of the log
    outstanding_count: int
    largest_outstanding: tuple[Outstanding, ...]  #: the largest of those, biggest first
    unmatched_frees: int  #: frees of pointers never allocated in the log, not counted
    #: allocations of a live address (its free row came later): the old block freed there
    reallocated_live_pointers: int
    size_mismatched_frees: int  #: frees whose size differs from the allocation's
    histogram: dict[int, int]  #: allocations per bucket: ``2**k`` counts ``(2**(k-1), 2**k]``
    threads: dict[int, Totals]  #: totals per thread id ...
    streams: dict[int, Totals]  #: ... and per stream handle
    truncated: tuple[str, ...] = ()  #: ``"path:line"`` of each cut-off last line skipped
    notes: tuple[str, ...] = ()  #: what the reader should know (the peak against the report's)
    #: restart markers (a new writer appended to the log) and the allocations the previous
    #: writer's process still held then, which ended with it (not counted as outstanding)
    restarts: int = 0
    ended_with_process_count: int = 0
    ended_with_process_bytes: int = 0

    def to_dict(self) -> dict[str, Any]:
        """JSON-friendly dict (times also as ``HH:MM:SS.ffffff``; dict keys as strings)."""
        times = {"start_time": self.start, "end_time": self.end, "peak_time_of_day": self.peak_time}
        d = asdict(self) | {k: None if t is None else format_time(t) for k, t in times.items()}
        d["histogram"] = {str(k): v for k, v in self.histogram.items()}
        d["threads"] = {str(k): asdict(v) for k, v in self.threads.items()}
        d["streams"] = {hex(k): asdict(v) for k, v in self.streams.items()}
        d["largest_outstanding"] = [
            {**asdict(o), "pointer": hex(o.pointer), "stream": hex(o.stream)}
            for o in self.largest_outstanding
        ]
        return d


#: What :class:`LogSummary` takes as a :class:`Summarizer` counts it, under the same name.
_KEPT = "name rows start end peak_count unmatched_frees restarts size_mismatched_frees".split()
_KEPT += ["ended_with_process_count", "ended_with_process_bytes"]


class Summarizer:
    """Accumulates a :class:`LogSummary` from events fed one at a time, in file order, in memory
    bounded by the live allocations (keyed by ``(source, pointer)``: several workers' logs can be
    fed interleaved). ``top``: how many of the largest outstanding allocations to list."""

    def __init__(self, name: str, top: int = 10):
        self.name, self.top = name, top
        self.paths: dict[str, None] = {}
        self.start: float | None = None
        self.end: float | None = None
        self.rows = self.current = self.peak = self.peak_count = 0
        self.peak_event: LogEvent | None = None
        self.table = LiveAllocations()
        self.live: dict[tuple[str, int], LogEvent] = self.table.live
        self.total = Totals()
        self.unmatched_frees = self.size_mismatched_frees = 0
        self.histogram: Counter[int] = Counter()  # allocations per power-of-two bucket
        self.threads: defaultdict[int, Totals] = defaultdict(Totals)
        self.streams: defaultdict[int, Totals] = defaultdict(Totals)
        self.truncated: list[str] = []
        self.restarts = self.ended_with_process_count = self.ended_with_process_bytes = 0

    def add(self, e: LogEvent) -> None:
        """Account for one event."""
        if e.action is _RESTART:
            self.restarts += 1
            for old in self.table.end_source(e.source):
                self.current -= old.size
                self.ended_with_process_count += 1
                self.ended_with_process_bytes += old.size
            return
        self.rows += 1
        self.paths.setdefault(e.path, None)
        t = e.time
        self.start = t if self.start is None or t < self.start else self.start
        self.end = t if self.end is None or t > self.end else self.end
        thread, stream = self.threads[e.thread], self.streams[e.stream]
        size = e.size
        if e.action is _ALLOCATE:
            for tot in (self.total, thread, stream):
                tot.allocations += 1
                tot.allocated_bytes += size
            bucket = 1 << (size - 1).bit_length() if size > 0 else 0
            self.histogram[bucket] += 1
            if size == 0:
                return
            old = self.table.allocate((e.source, e.pointer), e)
            if old is not None:
                self.current -= old.size
            self.current += size
            if self.current > self.peak:
                self.peak = self.current
                self.peak_event = e
            if len(self.live) > self.peak_count:
                self.peak_count = len(self.live)
        elif e.action is _FREE:
            for tot in (self.total, thread, stream):
                tot.frees += 1
                tot.freed_bytes += size
            if e.pointer == 0 and size == 0:
                return
            old = self.table.free((e.source, e.pointer))
            if old is None or old is _LATE:
                self.unmatched_frees += old is None
                return
            if old.size != size:
                self.size_mismatched_frees += 1
            self.current -= old.size
        else:
            for tot in (self.total, thread, stream):
                tot.failures += 1
                tot.failed_bytes += size

    def add_truncated(self, reader: LogReader) -> None:
        """Record a reader's file (also one without rows) and its skipped cut-off last line."""
        self.paths.setdefault(reader.path, None)
        if reader.truncated is not None:
            self.truncated.append(f"{reader.path}:{reader.truncated[0]}")

    def result(self) -> LogSummary:
        """The summary of everything added so far."""
        largest = heapq.nlargest(self.top, self.live.values(), key=lambda e: e.size)
        pe = self.peak_event
        return LogSummary(
            **{k: getattr(self, k) for k in _KEPT},
            paths=tuple(self.paths),
            duration=(self.end or 0.0) - (self.start or 0.0),
            **asdict(self.total),
            peak_bytes=self.peak,
            peak_time=pe.time if pe else None,
            peak_line=pe.line if pe else None,
            peak_source=pe.source if pe else None,
            outstanding_bytes=self.current,
            outstanding_count=len(self.live),
            largest_outstanding=tuple(
                Outstanding(e.source, e.pointer, e.size, e.line, e.time, e.thread, e.stream)
                for e in largest
            ),
            reallocated_live_pointers=self.table.retired,
            histogram=dict(sorted(self.histogram.items())),
            threads=dict(sorted(self.threads.items())),
            streams=dict(sorted(self.streams.items())),
            truncated=tuple(self.truncated),
            notes=self._notes(),
        )

    def _notes(self) -> tuple[str, ...]:
        """Why the peak may differ from the report's (docs/internals.md, Logs)."""
        allocating = sum(1 for tot in self.threads.values() if tot.allocations)
        if allocating < 2:
            return ()
        return (
            f"peak in the order the {allocating} allocating threads wrote their rows; the "
            "report's peak (a counter in the worker) orders the same concurrent calls its own "
            "way and can differ by the blocks in flight at the peak",
        )


@dataclass(frozen=True)
class SummaryReport:
    """Summaries of each file and, for several files, ``combined``: all rows merged by time (its
    peak is the most all workers held at one moment, not the sum of their peaks)."""

    files: tuple[LogSummary, ...]
    combined: LogSummary | None = None

    def to_dict(self) -> dict[str, Any]:
        return {
            "files": [s.to_dict() for s in self.files],
            "combined": self.combined.to_dict() if self.combined is not None else None,
        }


def summarize(
    paths: Sequence[str | os.PathLike] | str | os.PathLike, top: int = 10, *, progress: bool = False
) -> SummaryReport:
    """Summarize one or several logs (one per worker, or merged logs) in one streaming pass:
    ``files`` in the order given, and ``combined`` when there are several files; ``top`` largest
    outstanding allocations listed. ``progress`` draws click's progress bar on stderr.
    ValueError for a ``top`` that is not an int >= 0, :class:`LogFormatError` for a bad row."""
    if isinstance(top, bool) or not isinstance(top, int) or top < 0:
        raise ValueError(f"top must be a number of allocations to list (an int >= 0), got {top!r}")
    paths = [paths] if isinstance(paths, (str, os.PathLike)) else list(paths)
    readers: list[LogReader] = []
    events = read_logs(paths, readers, progress="reading logs" if progress else None)
    per_file = {r.path: Summarizer(r.source, top) for r in readers}
    combined = Summarizer("combined", top) if len(readers) > 1 else None
    for e in events:
        per_file[e.path].add(e)
        if combined is not None:
            combined.add(e)
    for r in readers:
        for s in filter(None, (per_file[r.path], combined)):
            s.add_truncated(r)
    return SummaryReport(
        tuple(s.result() for s in per_file.values()),
        combined.result() if combined is not None else None,
    )


def format_size(n: int) -> str:
    """``format_bytes(n)``, with the exact count from 1 KiB up: ``"1.50 MiB (1,572,864 B)"``."""
    return format_bytes(n) if n < 1024 else f"{format_bytes(n)} ({n:,} B)"


def format_summary(summary: LogSummary, top_rows: int = 8) -> str:
    """A human-readable text block for one :class:`LogSummary`: every one of its largest
    outstanding allocations (as many as :func:`summarize` was asked for), the first
    ``top_rows`` threads and streams."""
    s = summary
    lines = [f"== {s.name} ({', '.join(s.paths)})"]
    if s.start is not None and s.end is not None:
        lines.append(
            f"  time          {format_time(s.start)} .. {format_time(s.end)}  ({s.duration:.6f} s)"
        )
    peak = f"  peak          {format_size(s.peak_bytes)}"
    if s.peak_time is not None:
        rel = s.peak_time - s.start if s.start is not None else 0.0
        peak += f" at {format_time(s.peak_time)} (+{rel:.6f} s, line {s.peak_line}"
        peak += f" of {s.peak_source})" if s.name == "combined" else ")"
    lines += [
        f"  rows          {s.rows:,}",
        f"  allocations   {s.allocations:,} ({format_size(s.allocated_bytes)})   "
        f"frees {s.frees:,} ({format_size(s.freed_bytes)})   "
        f"failures {s.failures:,} ({format_size(s.failed_bytes)})",
        peak,
        f"  most live     {s.peak_count:,} allocations at once",
        f"  outstanding   {format_size(s.outstanding_bytes)} in {s.outstanding_count:,} "
        "allocations never freed",
    ]
    for o in s.largest_outstanding:
        where = f"{o.source} " if s.name == "combined" else ""
        lines.append(
            f"      {format_size(o.size):>28}  ptr {o.pointer:#x}  {where}line {o.line}  "
            f"thread {o.thread}  stream {o.stream:#x}"
        )
    unlisted = s.outstanding_count - len(s.largest_outstanding)
    if s.largest_outstanding and unlisted > 0:
        lines.append(f"      ... and {unlisted:,} smaller ones (--top lists more)")
    notes = [
        (s.unmatched_frees, "frees of pointers never allocated in the log"),
        (s.reallocated_live_pointers, "allocations of an address whose free row came later "
            "(threads' rows out of order)"),
        (s.size_mismatched_frees, "frees with a size other than allocated"),
        (s.restarts, "new writers appended to the log (a worker restarted, or the plugin "
            "registered again in the same process)"),
        (s.ended_with_process_count, f"allocations ({format_size(s.ended_with_process_bytes)}) "
            "still live when their process ended at a restart: freed by its end, not leaked"),
    ]  # fmt: skip
    lines += [f"  note          {n:,} {what}" for n, what in notes if n]
    lines += [f"  note          cut-off last line skipped: {t}" for t in s.truncated]
    lines += [f"  note          {n}" for n in s.notes]
    if s.histogram:
        lines.append("  sizes         bucket (<=)        allocations")
        width = max(s.histogram.values())
        for bucket, count in s.histogram.items():
            bar = "#" * max(1, round(30 * count / width))
            lines.append(f"                {format_bytes(bucket):>12} {count:>14,}  {bar}")
    lines.extend(_totals_table("thread", s.threads, str, top_rows))
    lines.extend(_totals_table("stream", s.streams, hex, top_rows))
    return "\n".join(lines)


def _totals_table(what: str, totals: dict[int, Totals], key_fmt, top_rows: int) -> list[str]:
    if not totals:
        return []
    rows = sorted(totals.items(), key=lambda kv: -kv[1].allocated_bytes)
    out = [
        f"  per {what:<8}  {what:>18} {'allocs':>10} {'allocated':>12} {'frees':>10} {'failures':>9}"
    ]
    for k, t in rows[:top_rows]:
        out.append(
            f"                {key_fmt(k):>18} {t.allocations:>10,} {format_bytes(t.allocated_bytes):>12} "
            f"{t.frees:>10,} {t.failures:>9,}"
        )
    if len(rows) > top_rows:
        out.append(f"                ... and {len(rows) - top_rows} more")
    return out
