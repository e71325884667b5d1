"""Reading RMM allocation logs: typed events streamed from the CSV, summaries, merging and the
bytes-in-use timeline (and its plot).

A log is what RMM's ``logging_resource_adaptor`` (and our ``LoggingResourceAdaptor``) writes::

    Thread,Time,Action,Pointer,Size,Stream
    140298510948160,14:03:07.413285,allocate,0x7f9b4c000000,1048576,0
    140298510948160,14:03:07.413301,free,0x7f9b4c000000,1048576,0
    140298510948160,14:03:07.413320,allocate failure,(nil),68719476736,7f9b40001230

Thread is the OS thread id (decimal), Time the wall-clock time of day ``HH:MM:SS.ffffff``
(RMM's pattern ``%t,%H:%M:%S.%f,%v``; the older ``HH:MM:SS:ffffff`` is read too), Pointer
``%p`` (``(nil)`` or ``0x0`` for a failure), Size the requested bytes, Stream the stream handle in
hex (``format_stream`` writes it with ``std::hex``, with or without ``0x``). Files merged by
:func:`merge_logs` carry an extra ``Worker`` column, read back as each event's ``source``.

Replaying a log against a resource lives in :mod:`dask_rmm.replay`; this module never touches a
memory resource or CUDA.
"""

from __future__ import annotations

import enum
import gzip
import heapq
import io
import os
import warnings
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, NamedTuple, TextIO

__all__ = [
    "HEADER",
    "WORKER_COLUMN",
    "Action",
    "LogEvent",
    "LogFormatError",
    "LogReader",
    "LiveAllocations",
    "LogSummary",
    "Outstanding",
    "Summarizer",
    "SummaryReport",
    "Timeline",
    "TruncatedLogWarning",
    "Totals",
    "default_source_name",
    "format_event",
    "format_summary",
    "format_time",
    "in_use_timeline",
    "iter_rows",
    "merge_logs",
    "parse_time",
    "plot_logs",
    "read_log",
    "read_logs",
    "size_bucket",
    "summarize",
]

#: RMM's header, in RMM's column order.
HEADER = ("Thread", "Time", "Action", "Pointer", "Size", "Stream")
#: The column :func:`merge_logs` appends, naming the worker (file) each row came from.
WORKER_COLUMN = "Worker"

_DAY = 86400.0
_HALF_DAY = 43200.0


class Action(enum.Enum):
    """What one log row records."""

    ALLOCATE = "allocate"
    FREE = "free"
    ALLOCATE_FAILURE = "allocate failure"

    def __str__(self) -> str:
        return self.value


_ACTIONS = {a.value: a for a in Action}
_ALLOCATE = Action.ALLOCATE
_FREE = Action.FREE
_FAILURE = Action.ALLOCATE_FAILURE


class LogEvent(NamedTuple):
    """One row of an allocation log.

    Attributes
    ----------
    thread : int
        OS thread id that made the call.
    time : float
        Seconds since midnight of the day the log started (times after a midnight in the log
        keep counting up past 86400, so ``time`` never jumps backwards by a day).
    action : Action
        Allocate, free or allocate failure.
    pointer : int
        The pointer handed out or freed (0 for a failure).
    size : int
        Requested bytes.
    stream : int
        The stream handle the call was made on.
    line : int
        1-based line number in ``path``.
    source : str
        The worker or file the row belongs to (the file's name without ``.csv``, or the
        ``Worker`` column of a merged log).
    path : str
        The file the row was read from.
    """

    thread: int
    time: float
    action: Action
    pointer: int
    size: int
    stream: int
    line: int
    source: str
    path: str


class LogFormatError(ValueError):
    """A row of a log could not be read; the message names the file and line."""

    def __init__(self, path: str, line: int, problem: str, text: str | None = None):
        self.path = path
        self.line = line
        self.problem = problem
        self.text = text
        message = f"{path}:{line}: {problem}"
        if text is not None:
            shown = text.rstrip("\r\n")
            if len(shown) > 120:
                shown = shown[:117] + "..."
            message += f": {shown!r}"
        super().__init__(message)

    def __reduce__(self):
        return (type(self), (self.path, self.line, self.problem, self.text))


class TruncatedLogWarning(UserWarning):
    """The last line of a log was cut off (a process killed mid-write) and was skipped."""


def parse_time(text: str) -> float:
    """Seconds since midnight from RMM's ``HH:MM:SS.ffffff`` (or ``HH:MM:SS:ffffff``).

    Examples
    --------
    >>> parse_time("01:00:02.500000")
    3602.5
    """
    if len(text) > 8 and text[2] == ":" and text[5] == ":":
        seconds = text[6:]
        if text[8] == ":":
            seconds = seconds[:2] + "." + seconds[3:]
        value = int(text[0:2]) * 3600 + int(text[3:5]) * 60 + float(seconds)
    else:
        parts = text.strip().split(":")
        if len(parts) == 4:
            parts = [parts[0], parts[1], parts[2] + "." + parts[3]]
        if len(parts) != 3:
            raise ValueError(f"time {text!r} is not HH:MM:SS.ffffff")
        value = int(parts[0]) * 3600 + int(parts[1]) * 60 + float(parts[2])
    if value < 0 or value != value:
        raise ValueError(f"time {text!r} is not HH:MM:SS.ffffff")
    return value


def format_time(seconds: float) -> str:
    """RMM's ``HH:MM:SS.ffffff`` for seconds since midnight (wrapping at 24 h)."""
    micros = round(seconds * 1e6) % round(_DAY * 1e6)
    secs, us = divmod(micros, 1_000_000)
    h, rest = divmod(secs, 3600)
    m, s = divmod(rest, 60)
    return f"{h:02d}:{m:02d}:{s:02d}.{us:06d}"


def _parse_pointer(text: str) -> int:
    try:
        return int(text, 16)
    except ValueError:
        text = text.strip()
        if text in ("(nil)", "nullptr", "(null)", ""):
            return 0
        raise


def _open_text(path: str) -> TextIO:
    if path.endswith(".gz"):
        return io.TextIOWrapper(gzip.open(path, "rb"), encoding="utf-8", errors="replace")
    return open(path, encoding="utf-8", errors="replace")


def _is_blank(line: str) -> bool:
    # A file cut by a crash can end in a run of NUL bytes: blank, not malformed.
    return not line.strip(" \t\r\n\x00")


class LogReader:
    """Stream the events of one log file, in file order, in bounded memory.

    Iterating reads the file line by line; nothing but the current line is held. A malformed row
    raises :class:`LogFormatError` naming the file and line, except on the last line of the file,
    which is taken to be cut off by a process that died mid-write: it is skipped, recorded in
    :attr:`truncated` and reported with a :class:`TruncatedLogWarning`.

    Parameters
    ----------
    path : str or os.PathLike
        The CSV log (``.gz`` is decompressed on the fly).
    source : str, optional
        Name for the worker the log belongs to; default the file name without ``.csv``.
        A ``Worker`` column in the file (see :func:`merge_logs`) overrides it per row.

    Attributes
    ----------
    truncated : tuple of (int, str) or None
        Line number and text of a skipped, cut-off last line.
    rows : int
        Rows yielded so far.
    bytes_read : int
        Characters consumed so far (for progress bars; equals bytes for RMM's ASCII logs).
    total_bytes : int
        Size of the file (compressed size for ``.gz``).

    Examples
    --------
    >>> for event in LogReader("rmm_log.dev0.csv"):           # doctest: +SKIP
    ...     if event.action is Action.ALLOCATE_FAILURE:
    ...         print(event.line, event.size)
    """

    def __init__(self, path: str | os.PathLike, source: str | None = None):
        self.path = os.fspath(path)
        self.source = source if source is not None else default_source_name(self.path)
        self.truncated: tuple[int, str] | None = None
        self.rows = 0
        self.bytes_read = 0
        try:
            self.total_bytes = os.path.getsize(self.path)
        except OSError:
            self.total_bytes = 0

    def __iter__(self) -> Iterator[LogEvent]:
        with _open_text(self.path) as f:
            yield from self._events(f)

    def _header(self, f: TextIO) -> tuple[int, list[int], int | None, int]:
        """Read up to the header; return its line number, the column index of each of HEADER,
        that of the Worker column and the number of columns."""
        lineno = 0
        for line in f:
            lineno += 1
            self.bytes_read += len(line)
            if _is_blank(line):
                continue
            names = [n.strip() for n in line.rstrip("\r\n").split(",")]
            missing = [n for n in HEADER if n not in names]
            if missing:
                raise LogFormatError(
                    self.path,
                    lineno,
                    f"not an RMM allocation log: the header must name the columns "
                    f"{','.join(HEADER)} (missing {','.join(missing)})",
                    line,
                )
            worker = names.index(WORKER_COLUMN) if WORKER_COLUMN in names else None
            return lineno, [names.index(n) for n in HEADER], worker, len(names)
        raise LogFormatError(self.path, max(lineno, 1), "empty log: no header line")

    def _events(self, f: TextIO) -> Iterator[LogEvent]:
        lineno, columns, worker_col, ncols = self._header(f)
        i_thread, i_time, i_action, i_pointer, i_size, i_stream = columns
        path = self.path
        source = self.source
        sources: dict[str, str] = {}
        actions = _ACTIONS
        header_start = HEADER[0] + ","
        day_offset = 0.0
        last_time = None
        pending: LogFormatError | None = None
        pending_text = ""
        for line in f:
            lineno += 1
            self.bytes_read += len(line)
            if pending is not None:
                if _is_blank(line):
                    continue
                raise pending
            fields = line.split(",")
            try:
                if len(fields) != ncols:
                    if _is_blank(line):
                        continue
                    raise ValueError(f"expected {ncols} comma-separated fields, got {len(fields)}")
                action = actions.get(fields[i_action])
                if action is None:
                    text = fields[i_action].strip()
                    action = actions.get(text)
                    if action is None:
                        raise ValueError(
                            f"unknown action {text!r} (expected allocate, free or allocate failure)"
                        )
                t = parse_time(fields[i_time])
                size = int(fields[i_size])
                if size < 0:
                    raise ValueError(f"negative size {size}")
                event_source = source
                if worker_col is not None:
                    name = fields[worker_col].strip()
                    event_source = sources.setdefault(name, name)
                event = (
                    int(fields[i_thread]),
                    t,
                    action,
                    _parse_pointer(fields[i_pointer]),
                    size,
                    int(fields[i_stream], 16),
                )
            except (ValueError, IndexError) as e:
                if line.startswith(header_start):
                    continue  # a repeated header: the log was re-opened
                pending = LogFormatError(path, lineno, f"malformed row ({e})", line)
                pending_text = line
                continue
            # Times are time of day: a backward jump of more than 12 h is a midnight.
            t += day_offset
            if last_time is not None and t < last_time - _HALF_DAY:
                day_offset += _DAY
                t += _DAY
            last_time = t
            self.rows += 1
            yield LogEvent(
                event[0], t, action, event[3], size, event[5], lineno, event_source, path
            )
        if pending is not None:
            self.truncated = (pending.line, pending_text.rstrip("\r\n"))
            warnings.warn(
                f"{path}:{pending.line}: skipped the cut-off last line "
                f"{pending_text.rstrip(chr(10))[:80]!r} (the process writing the log stopped "
                "mid-line)",
                TruncatedLogWarning,
                stacklevel=3,
            )


def default_source_name(path: str | os.PathLike) -> str:
    """The worker name of a log file: its name without ``.csv`` / ``.csv.gz``."""
    name = Path(path).name
    for suffix in (".gz", ".csv", ".log"):
        if name.endswith(suffix) and len(name) > len(suffix):
            name = name[: -len(suffix)]
    return name


def read_log(path: str | os.PathLike, source: str | None = None) -> Iterator[LogEvent]:
    """The events of one log in file order (see :class:`LogReader`).

    Examples
    --------
    >>> peak = current = 0                                     # doctest: +SKIP
    >>> for e in read_log("rmm_log.dev0.csv"):
    ...     current += e.size if e.action is Action.ALLOCATE else 0
    """
    return iter(LogReader(path, source))


def _unique_sources(paths: Sequence[str | os.PathLike]) -> list[str]:
    """A distinct source name per path: the file name, or more of the path where names clash."""
    names = [default_source_name(p) for p in paths]
    if len(set(names)) == len(names):
        return names
    out = []
    for p, name in zip(paths, names, strict=True):
        if names.count(name) > 1:
            parent = Path(p).resolve().parent.name
            name = f"{parent}/{name}" if parent else name
        out.append(name)
    if len(set(out)) != len(out):
        out = [f"{name}#{i}" for i, name in enumerate(out)]
    return out


def read_logs(
    paths: Sequence[str | os.PathLike], readers: list[LogReader] | None = None
) -> Iterator[LogEvent]:
    """The events of several logs merged by time (each file keeps its own order).

    Each file is read lazily, so memory stays bounded by the number of files. When ``readers``
    is given (an empty list) it receives the :class:`LogReader` of each path, for their
    ``truncated``, ``rows`` and progress attributes.
    """
    made = [LogReader(p, s) for p, s in zip(paths, _unique_sources(paths), strict=True)]
    if readers is not None:
        readers.extend(made)
    if len(made) == 1:
        return iter(made[0])
    return heapq.merge(*made, key=_event_time)


def _event_time(event: LogEvent) -> float:
    return event.time


# --- live allocations ------------------------------------------------------------------------

_LATE = object()


class LiveAllocations:
    """The allocations a log shows live, keyed by ``(source, pointer)``.

    A log written by several threads can show an address allocated again before the row that
    freed it: the freeing thread returned the block, another thread got it and wrote its
    ``allocate`` row first. An allocation of a live address therefore retires the old block at
    that row and the late ``free`` row that follows is absorbed (:meth:`free` returns
    :data:`LATE_FREE`) instead of freeing the new block.
    """

    LATE_FREE = _LATE

    __slots__ = ("live", "late", "retired")

    def __init__(self):
        self.live: dict[tuple[str, int], Any] = {}
        self.late: dict[tuple[str, int], int] = {}
        #: allocations of an address still live (each retired the older block)
        self.retired = 0

    def allocate(self, key: tuple[str, int], value: Any) -> Any:
        """Record ``value`` live at ``key``; return the block it retired, or None."""
        live = self.live
        old = live.get(key)
        if old is not None:
            self.retired += 1
            self.late[key] = self.late.get(key, 0) + 1
        live[key] = value
        return old

    def free(self, key: tuple[str, int]) -> Any:
        """Forget ``key``: its value, :data:`LATE_FREE` for an absorbed late row, or None when
        the log never showed it allocated."""
        late = self.late
        if late:
            n = late.get(key)
            if n is not None:
                if n == 1:
                    del late[key]
                else:
                    late[key] = n - 1
                return _LATE
        return self.live.pop(key, None)

    def __len__(self) -> int:
        return len(self.live)


# --- summaries -------------------------------------------------------------------------------


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
    """What a log (or several, combined) says about memory use.

    Byte counts are requested sizes, as logged (what ``StatisticsResourceAdaptor`` counts), not
    what the resource reserved.

    Attributes
    ----------
    name : str
        The file's worker name, or ``"combined"``.
    paths : tuple of str
        The files summarized.
    rows : int
        Rows read.
    start, end, duration : float
        First and last time (seconds since midnight) and their difference.
    allocations, frees, failures : int
        Row counts per action.
    allocated_bytes, freed_bytes, failed_bytes : int
        Bytes per action.
    peak_bytes : int
        Largest sum of live allocations.
    peak_count : int
        Most allocations live at once (not necessarily at the time of ``peak_bytes``).
    peak_time : float or None
        When the peak was first reached.
    peak_line, peak_source : int, str
        The row that reached it.
    outstanding_bytes, outstanding_count : int
        Allocated and never freed by the end of the log.
    largest_outstanding : tuple of Outstanding
        The largest of those, biggest first.
    unmatched_frees : int
        Frees of pointers the log never saw allocated (logging started late), not counted in
        bytes in use.
    reallocated_live_pointers : int
        Allocations of an address whose free row came later (rows of two threads written out
        of order); the older block counts as freed at the new allocation.
    size_mismatched_frees : int
        Frees whose size differs from the allocation's.
    histogram : dict of int to int
        Allocations per power-of-two size bucket: key ``2**k`` counts sizes in
        ``(2**(k-1), 2**k]`` (key 0 counts zero-byte allocations).
    threads, streams : dict of int to Totals
        Totals per thread id and per stream handle.
    truncated : tuple of str
        ``"path:line"`` of each cut-off last line that was skipped.
    """

    name: str
    paths: tuple[str, ...]
    rows: int
    start: float | None
    end: float | None
    duration: float
    allocations: int
    frees: int
    failures: int
    allocated_bytes: int
    freed_bytes: int
    failed_bytes: int
    peak_bytes: int
    peak_count: int
    peak_time: float | None
    peak_line: int | None
    peak_source: str | None
    outstanding_bytes: int
    outstanding_count: int
    largest_outstanding: tuple[Outstanding, ...]
    unmatched_frees: int
    reallocated_live_pointers: int
    size_mismatched_frees: int
    histogram: dict[int, int]
    threads: dict[int, Totals]
    streams: dict[int, Totals]
    truncated: tuple[str, ...] = ()

    def to_dict(self) -> dict[str, Any]:
        """JSON-friendly dict (times also as ``HH:MM:SS.ffffff``; dict keys as strings)."""
        d = asdict(self)
        d["paths"] = list(self.paths)
        d["start_time"] = format_time(self.start) if self.start is not None else None
        d["end_time"] = format_time(self.end) if self.end is not None else None
        d["peak_time_of_day"] = format_time(self.peak_time) if self.peak_time is not None else None
        d["histogram"] = {str(k): v for k, v in self.histogram.items()}
        d["threads"] = {str(k): asdict(v) for k, v in self.threads.items()}
        d["streams"] = {hex(k): asdict(v) for k, v in self.streams.items()}
        d["largest_outstanding"] = [
            {**asdict(o), "pointer": hex(o.pointer), "stream": hex(o.stream)}
            for o in self.largest_outstanding
        ]
        d["truncated"] = list(self.truncated)
        return d


def size_bucket(size: int) -> int:
    """The power-of-two histogram bucket of ``size``: the smallest ``2**k >= size`` (0 for 0)."""
    return 1 << (size - 1).bit_length() if size > 0 else 0


class Summarizer:
    """Accumulates a :class:`LogSummary` from events fed one at a time, in file order.

    Memory is bounded by the number of live allocations, not the length of the log. Live
    allocations are keyed by ``(source, pointer)``, so logs of several workers can be fed
    interleaved into one summarizer.

    Parameters
    ----------
    name : str
        Name of the summary.
    top : int
        How many of the largest outstanding allocations to list.
    """

    def __init__(self, name: str, top: int = 10):
        self.name = name
        self.top = top
        self.paths: dict[str, None] = {}
        self.rows = 0
        self.start: float | None = None
        self.end: float | None = None
        self.current = 0
        self.peak = 0
        self.peak_count = 0
        self.peak_event: LogEvent | None = None
        self.table = LiveAllocations()
        self.live: dict[tuple[str, int], LogEvent] = self.table.live
        self.total = Totals()
        self.unmatched_frees = 0
        self.size_mismatches = 0
        self.histogram: dict[int, int] = {}
        self.threads: dict[int, Totals] = {}
        self.streams: dict[int, Totals] = {}
        self.truncated: list[str] = []

    def add(self, e: LogEvent) -> None:
        """Account for one event."""
        self.rows += 1
        if e.path not in self.paths:
            self.paths[e.path] = None
        t = e.time
        if self.start is None or t < self.start:
            self.start = t
        if self.end is None or t > self.end:
            self.end = t
        thread = self.threads.get(e.thread)
        if thread is None:
            thread = self.threads[e.thread] = Totals()
        stream = self.streams.get(e.stream)
        if stream is None:
            stream = self.streams[e.stream] = Totals()
        total = self.total
        action = e.action
        size = e.size
        if action is _ALLOCATE:
            for tot in (total, thread, stream):
                tot.allocations += 1
                tot.allocated_bytes += size
            bucket = 1 << (size - 1).bit_length() if size > 0 else 0
            self.histogram[bucket] = self.histogram.get(bucket, 0) + 1
            if size == 0:
                return
            old = self.table.allocate((e.source, e.pointer), e)
            if old is not None:
                self.current -= old.size
            live = self.live
            self.current += size
            if self.current > self.peak:
                self.peak = self.current
                self.peak_event = e
            if len(live) > self.peak_count:
                self.peak_count = len(live)
        elif action is _FREE:
            for tot in (total, thread, stream):
                tot.frees += 1
                tot.freed_bytes += size
            if e.pointer == 0 and size == 0:
                return
            old = self.table.free((e.source, e.pointer))
            if old is None:
                self.unmatched_frees += 1
                return
            if old is _LATE:
                return
            if old.size != size:
                self.size_mismatches += 1
            self.current -= old.size
        else:
            for tot in (total, thread, stream):
                tot.failures += 1
                tot.failed_bytes += size

    def add_truncated(self, reader: LogReader) -> None:
        """Record a reader's skipped cut-off last line, if any."""
        if reader.truncated is not None:
            self.truncated.append(f"{reader.path}:{reader.truncated[0]}")

    def result(self) -> LogSummary:
        """The summary of everything added so far."""
        largest = heapq.nlargest(self.top, self.live.values(), key=lambda e: e.size)
        pe = self.peak_event
        return LogSummary(
            name=self.name,
            paths=tuple(self.paths),
            rows=self.rows,
            start=self.start,
            end=self.end,
            duration=(self.end - self.start) if self.start is not None else 0.0,
            allocations=self.total.allocations,
            frees=self.total.frees,
            failures=self.total.failures,
            allocated_bytes=self.total.allocated_bytes,
            freed_bytes=self.total.freed_bytes,
            failed_bytes=self.total.failed_bytes,
            peak_bytes=self.peak,
            peak_count=self.peak_count,
            peak_time=pe.time if pe else None,
            peak_line=pe.line if pe else None,
            peak_source=pe.source if pe else None,
            outstanding_bytes=self.current,
            outstanding_count=len(self.live),
            largest_outstanding=tuple(
                Outstanding(e.source, e.pointer, e.size, e.line, e.time, e.thread, e.stream)
                for e in largest
            ),
            unmatched_frees=self.unmatched_frees,
            reallocated_live_pointers=self.table.retired,
            size_mismatched_frees=self.size_mismatches,
            histogram=dict(sorted(self.histogram.items())),
            threads=dict(sorted(self.threads.items())),
            streams=dict(sorted(self.streams.items())),
            truncated=tuple(self.truncated),
        )


@dataclass(frozen=True)
class SummaryReport:
    """Summaries of each file and, for several files, of all of them together.

    ``combined`` is the summary of all rows merged by time: its peak is the largest total held
    by all workers at one moment, not the sum of their peaks.
    """

    files: tuple[LogSummary, ...]
    combined: LogSummary | None = None

    def to_dict(self) -> dict[str, Any]:
        return {
            "files": [s.to_dict() for s in self.files],
            "combined": self.combined.to_dict() if self.combined is not None else None,
        }


def summarize(
    paths: Sequence[str | os.PathLike] | str | os.PathLike, top: int = 10
) -> SummaryReport:
    """Summarize one or several logs in one streaming pass.

    Parameters
    ----------
    paths : path or sequence of paths
        The logs, one per worker (or merged logs, whose ``Worker`` column is used).
    top : int
        How many of the largest outstanding allocations to list.

    Returns
    -------
    SummaryReport
        ``files`` in the order given; ``combined`` when there are several files.

    Examples
    --------
    >>> report = summarize(["worker-0.csv", "worker-1.csv"])   # doctest: +SKIP
    >>> report.combined.peak_bytes
    """
    if isinstance(paths, (str, os.PathLike)):
        paths = [paths]
    paths = list(paths)
    readers: list[LogReader] = []
    events = read_logs(paths, readers)
    per_file = {r.path: Summarizer(r.source, top) for r in readers}
    if len(per_file) != len(readers):
        raise ValueError("the same log file was given twice")
    combined = Summarizer("combined", top) if len(readers) > 1 else None
    for e in events:
        per_file[e.path].add(e)
        if combined is not None:
            combined.add(e)
    for r in readers:
        per_file[r.path].add_truncated(r)
        per_file[r.path].paths.setdefault(r.path, None)
        if combined is not None:
            combined.add_truncated(r)
            combined.paths.setdefault(r.path, None)
    return SummaryReport(
        tuple(s.result() for s in per_file.values()),
        combined.result() if combined is not None else None,
    )


def _fmt_bytes(n: int) -> str:
    from dask_rmm.mr.base import format_bytes

    return f"{format_bytes(n)}" if n < 1024 else f"{format_bytes(n)} ({n:,} B)"


def format_summary(summary: LogSummary, top_rows: int = 8) -> str:
    """A human-readable text block for one :class:`LogSummary`."""
    s = summary
    lines = [f"== {s.name} ({', '.join(s.paths)})"]
    if s.start is not None:
        lines.append(
            f"  time          {format_time(s.start)} .. {format_time(s.end)}  ({s.duration:.6f} s)"
        )
    lines.append(f"  rows          {s.rows:,}")
    lines.append(
        f"  allocations   {s.allocations:,} ({_fmt_bytes(s.allocated_bytes)})   "
        f"frees {s.frees:,} ({_fmt_bytes(s.freed_bytes)})   "
        f"failures {s.failures:,} ({_fmt_bytes(s.failed_bytes)})"
    )
    peak = f"  peak          {_fmt_bytes(s.peak_bytes)}"
    if s.peak_time is not None:
        rel = s.peak_time - s.start if s.start is not None else 0.0
        peak += f" at {format_time(s.peak_time)} (+{rel:.6f} s, line {s.peak_line}"
        peak += f" of {s.peak_source})" if s.name == "combined" else ")"
    lines.append(peak)
    lines.append(f"  most live     {s.peak_count:,} allocations at once")
    lines.append(
        f"  outstanding   {_fmt_bytes(s.outstanding_bytes)} in {s.outstanding_count:,} "
        "allocations never freed"
    )
    for o in s.largest_outstanding[:top_rows]:
        where = f"{o.source} " if s.name == "combined" else ""
        lines.append(
            f"      {_fmt_bytes(o.size):>28}  ptr {o.pointer:#x}  {where}line {o.line}  "
            f"thread {o.thread}  stream {o.stream:#x}"
        )
    notes = []
    if s.unmatched_frees:
        notes.append(f"{s.unmatched_frees:,} frees of pointers never allocated in the log")
    if s.reallocated_live_pointers:
        notes.append(
            f"{s.reallocated_live_pointers:,} allocations of an address whose free row came "
            "later (threads' rows out of order)"
        )
    if s.size_mismatched_frees:
        notes.append(f"{s.size_mismatched_frees:,} frees with a size other than allocated")
    for t in s.truncated:
        notes.append(f"cut-off last line skipped: {t}")
    for n in notes:
        lines.append(f"  note          {n}")
    if s.histogram:
        lines.append("  sizes         bucket (<=)        allocations")
        width = max(s.histogram.values())
        for bucket, count in s.histogram.items():
            bar = "#" * max(1, round(30 * count / width))
            label = "0 B" if bucket == 0 else _pow2_label(bucket)
            lines.append(f"                {label:>12} {count:>14,}  {bar}")
    lines.extend(_totals_table("thread", s.threads, str, top_rows))
    lines.extend(_totals_table("stream", s.streams, hex, top_rows))
    return "\n".join(lines)


def _pow2_label(n: int) -> str:
    for unit, shift in (("GiB", 30), ("MiB", 20), ("KiB", 10)):
        if n >= 1 << shift:
            return (
                f"{n >> shift} {unit}" if n % (1 << shift) == 0 else f"{n / (1 << shift):g} {unit}"
            )
    return f"{n} B"


def _totals_table(what: str, totals: dict[int, Totals], key_fmt, top_rows: int) -> list[str]:
    if not totals:
        return []
    rows = sorted(totals.items(), key=lambda kv: -kv[1].allocated_bytes)
    out = [
        f"  per {what:<8}  {what:>18} {'allocs':>10} {'allocated':>12} {'frees':>10} {'failures':>9}"
    ]
    from dask_rmm.mr.base import format_bytes

    for k, t in rows[:top_rows]:
        out.append(
            f"                {key_fmt(k):>18} {t.allocations:>10,} {format_bytes(t.allocated_bytes):>12} "
            f"{t.frees:>10,} {t.failures:>9,}"
        )
    if len(rows) > top_rows:
        out.append(f"                ... and {len(rows) - top_rows} more")
    return out


# --- writing and merging ---------------------------------------------------------------------


def format_event(event: LogEvent) -> str:
    """One RMM-format CSV row (no newline) for ``event``: ``thread,time,action,ptr,size,stream``."""
    ptr = "(nil)" if event.pointer == 0 and event.action is _FAILURE else f"{event.pointer:#x}"
    return (
        f"{event.thread},{format_time(event.time)},{event.action.value},{ptr},"
        f"{event.size},{event.stream:x}"
    )


def merge_logs(paths: Sequence[str | os.PathLike], output: str | os.PathLike | TextIO) -> int:
    """Merge several workers' logs by time into one CSV with a ``Worker`` column.

    The output has RMM's six columns followed by ``Worker`` (the file's name, or the ``Worker``
    column of an input that was itself merged), so it is read back by :func:`read_log` with each
    row's source intact and stays readable by tools that look columns up by name.

    Returns
    -------
    int
        Rows written.

    Examples
    --------
    >>> merge_logs(["w0/rmm_log.dev0.csv", "w1/rmm_log.dev0.csv"], "merged.csv")  # doctest: +SKIP
    """
    own = not hasattr(output, "write")
    f = open(output, "w", newline="\n") if own else output  # noqa: SIM115
    try:
        f.write(",".join(HEADER) + "," + WORKER_COLUMN + "\n")
        n = 0
        write = f.write
        for e in read_logs(list(paths)):
            write(f"{format_event(e)},{e.source}\n")
            n += 1
        return n
    finally:
        if own:
            f.close()


# --- timeline and plot -----------------------------------------------------------------------


class _Envelope:
    """Bounded list of (time, bytes) keeping the upper envelope: when it grows past twice
    ``max_points``, neighbouring pairs merge into the higher of the two."""

    def __init__(self, max_points: int):
        self.max_points = max(16, max_points)
        self.points: list[tuple[float, int]] = []

    def add(self, t: float, v: int) -> None:
        pts = self.points
        pts.append((t, v))
        if len(pts) >= 2 * self.max_points:
            last = pts[-1]
            merged = [max(pts[i], pts[i + 1], key=_value) for i in range(0, len(pts) - 1, 2)]
            if merged[-1] is not last:
                merged.append(last)
            self.points = merged


def _value(p: tuple[float, int]) -> int:
    return p[1]


@dataclass
class Timeline:
    """Bytes in use over time for one source: ``times`` (seconds since midnight) and ``bytes``;
    the exact peak is kept even when the curve is thinned to ``max_points``; ``failures`` are
    where allocations failed."""

    source: str
    times: list[float] = field(default_factory=list)
    bytes: list[int] = field(default_factory=list)
    peak_bytes: int = 0
    peak_time: float | None = None
    #: (time, bytes in use) of the first ``max_points`` allocate failures
    failures: list[tuple[float, int]] = field(default_factory=list)


def in_use_timeline(
    paths: Sequence[str | os.PathLike] | str | os.PathLike, max_points: int = 20000
) -> list[Timeline]:
    """Bytes in use over time, one :class:`Timeline` per source (file or ``Worker`` value).

    Long logs are thinned to about ``max_points`` points per source keeping the upper envelope,
    so memory stays bounded and peaks stay visible.
    """
    if isinstance(paths, (str, os.PathLike)):
        paths = [paths]
    envelopes: dict[str, _Envelope] = {}
    current: dict[str, int] = {}
    peaks: dict[str, tuple[int, float | None]] = {}
    failures: dict[str, list[tuple[float, int]]] = {}
    table = LiveAllocations()
    for e in read_logs(list(paths)):
        src = e.source
        env = envelopes.get(src)
        if env is None:
            env = envelopes[src] = _Envelope(max_points)
            current[src] = 0
            peaks[src] = (0, e.time)
            failures[src] = []
            env.add(e.time, 0)
        if e.action is _ALLOCATE:
            if e.size == 0:
                continue
            old = table.allocate((src, e.pointer), e.size)
            if old is not None:
                current[src] -= old
            current[src] += e.size
            if current[src] > peaks[src][0]:
                peaks[src] = (current[src], e.time)
        elif e.action is _FREE:
            size = table.free((src, e.pointer))
            if size is None or size is _LATE:
                continue
            current[src] -= size
        else:
            if len(failures[src]) < max_points:
                failures[src].append((e.time, current[src]))
            continue
        env.add(e.time, current[src])
    out = []
    for src, env in sorted(envelopes.items()):
        pk, pt = peaks[src]
        xs, ys = [p[0] for p in env.points], [p[1] for p in env.points]
        out.append(Timeline(src, xs, ys, pk, pt, failures[src]))
    return out


def plot_logs(
    paths: Sequence[str | os.PathLike],
    output: str | os.PathLike,
    *,
    title: str | None = None,
    max_points: int = 20000,
) -> list[Timeline]:
    """Plot bytes in use over time, one line per worker (file), each peak marked; save to
    ``output`` (PNG, SVG or PDF by extension).

    Needs matplotlib (``pip install dask-rmm[report]``).

    Returns
    -------
    list of Timeline
        What was plotted.
    """
    try:
        import matplotlib

        matplotlib.use("Agg", force=False)
        import matplotlib.pyplot as plt
    except ImportError as e:
        raise ImportError(
            "plotting allocation logs needs matplotlib: pip install matplotlib "
            "(or pip install 'dask-rmm[report]')"
        ) from e
    timelines = in_use_timeline(paths, max_points=max_points)
    if not timelines:
        raise ValueError("no allocation rows to plot in " + ", ".join(map(str, paths)))
    t0 = min(tl.times[0] for tl in timelines if tl.times)
    top = max(tl.peak_bytes for tl in timelines)
    unit, scale = _plot_unit(top)
    fig, ax = plt.subplots(figsize=(10, 5), dpi=110)
    try:
        for tl in timelines:
            xs = [t - t0 for t in tl.times]
            ys = [b / scale for b in tl.bytes]
            (line,) = ax.step(xs, ys, where="post", linewidth=1.2, label=tl.source)
            if tl.peak_time is not None:
                px, py = tl.peak_time - t0, tl.peak_bytes / scale
                ax.plot([px], [py], marker="v", color=line.get_color(), markersize=8)
                ax.annotate(
                    f"peak {py:.3g} {unit}",
                    (px, py),
                    textcoords="offset points",
                    xytext=(4, 6),
                    fontsize=8,
                    color=line.get_color(),
                )
        fails = [(t - t0, b / scale) for tl in timelines for t, b in tl.failures]
        if fails:
            ax.scatter(
                [f[0] for f in fails],
                [f[1] for f in fails],
                marker="x",
                color="red",
                zorder=3,
                label=f"allocate failure ({len(fails)})",
            )
        ax.set_xlabel(f"seconds since {format_time(t0)}")
        ax.set_ylabel(f"bytes in use ({unit})")
        ax.set_title(title or "RMM allocations: bytes in use")
        ax.set_ylim(bottom=0, top=top / scale * 1.12 if top else 1)
        ax.grid(True, alpha=0.3)
        if len(timelines) > 1 or timelines[0].source:
            ax.legend(loc="upper left", fontsize=8)
        fig.tight_layout()
        fig.savefig(os.fspath(output))
    finally:
        plt.close(fig)
    return timelines


def _plot_unit(n: int) -> tuple[str, int]:
    for unit, shift in (("GiB", 30), ("MiB", 20), ("KiB", 10)):
        if n >= 1 << shift:
            return unit, 1 << shift
    return "B", 1


def iter_rows(events: Iterable[LogEvent]) -> Iterator[str]:
    """RMM-format CSV lines (header first, newline-terminated) for ``events``."""
    yield ",".join(HEADER) + "\n"
    for e in events:
        yield format_event(e) + "\n"
