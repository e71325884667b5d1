"""The RMM allocation-log CSV format (``Thread,Time,Action,Pointer,Size,Stream``, as RMM's
``logging_resource_adaptor`` writes it; details in docs/internals.md, Logs): rows read as typed
events, written back, merged by time. Summaries, timelines and replay live beside it."""

from __future__ import annotations

import enum
import gzip
import heapq
import operator
import os
import sys
import warnings
import zlib
from collections import Counter
from collections.abc import Iterator, Sequence
from datetime import datetime, timedelta
from pathlib import Path
from typing import Any, NamedTuple, TextIO

from dask_rmm._output import atomic_output

__all__ = [
    "HEADER",
    "WORKER_COLUMN",
    "Action",
    "LiveAllocations",
    "LogEvent",
    "LogFormatError",
    "LogReader",
    "TruncatedLogWarning",
    "default_source_name",
    "format_event",
    "format_time",
    "merge_logs",
    "parse_time",
    "read_log",
    "read_logs",
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
    #: Not one of RMM's actions: where a new writer appended to the file (the header line
    #: repeated, or a ``restart`` row in a merged log). The previous writer's process ended
    #: there, and the allocations of this source it still held ended with it.
    RESTART = "restart"

    def __str__(self) -> str:
        return self.value


_ACTIONS = {a.value: a for a in Action}


class LogEvent(NamedTuple):
    """One row of an allocation log."""

    thread: int  #: OS thread id that made the call
    #: seconds since midnight of the day the log started (past a midnight in the log it keeps
    #: counting up past 86400: it never jumps back)
    time: float
    action: Action
    pointer: int  #: the pointer handed out or freed (0 for a failure)
    size: int  #: requested bytes
    stream: int  #: the stream handle
    line: int  #: 1-based line number in ``path``
    source: str  #: the worker: the file's name without ``.csv``, or a merged log's ``Worker``
    path: str  #: the file the row was read from


class LogFormatError(ValueError):
    """A row of a log could not be read; the message names the file and line."""

    def __init__(self, path: str, line: int, problem: str, text: str | None = None):
        super().__init__(path, line, problem, text)  # the args pickle it
        self.path, self.line, self.problem, self.text = path, line, problem, text

    def __str__(self) -> str:
        if self.text is None:
            return f"{self.path}:{self.line}: {self.problem}"
        shown = self.text.rstrip("\r\n")
        shown = shown if len(shown) <= 120 else shown[:117] + "..."
        return f"{self.path}:{self.line}: {self.problem}: {shown!r}"


class TruncatedLogWarning(UserWarning):
    """The last line of a log was cut off (a process killed mid-write) and was skipped."""


def parse_time(text: str) -> float:
    """Seconds since midnight from RMM's ``HH:MM:SS.ffffff`` (or ``HH:MM:SS:ffffff``).

    Examples
    --------
    >>> parse_time("01:00:02.500000")
    3602.5
    """
    try:
        h, m, s = text.split(":", 2)
        hours, minutes, seconds = int(h), int(m), float(s.replace(":", ".", 1))
    except ValueError:
        hours = -1
    # A time of day: 25:99:99 is no time (and NaN fails every comparison).
    if not (0 <= hours < 24 and 0 <= minutes < 60 and 0 <= seconds < 60):
        raise ValueError(f"time {text!r} is not a time of day HH:MM:SS.ffffff")
    return hours * 3600 + minutes * 60 + seconds


def format_time(seconds: float) -> str:
    """RMM's ``HH:MM:SS.ffffff`` for seconds since midnight (wrapping at 24 h)."""
    micros = round(seconds * 1e6) % round(_DAY * 1e6)
    return (datetime.min + timedelta(microseconds=micros)).strftime("%H:%M:%S.%f")


def _parse_pointer(text: str) -> int:
    try:
        return int(text, 16)
    except ValueError:
        if text.strip() in ("(nil)", "nullptr", "(null)", ""):
            return 0
        raise


def _open_text(path: str) -> TextIO:
    # utf-8-sig: a byte-order mark, as spreadsheet programs save CSV, is not part of the header.
    if path.endswith(".gz"):
        return gzip.open(path, "rt", encoding="utf-8-sig", errors="replace")
    return open(path, encoding="utf-8-sig", errors="replace")


#: The largest size a log row can hold: RMM logs a ``size_t``.
_SIZE_MAX = (1 << 64) - 1


def _is_blank(line: str) -> bool:
    # A file cut by a crash can end in a run of NUL bytes: blank, not malformed.
    return not line.strip(" \t\r\n\x00")


class LogReader:
    """Stream the events of one log file (``.gz`` too), in file order, line by line.

    A malformed row raises :class:`LogFormatError` naming the file and line, except a last line
    cut off mid-write (no newline, or NUL bytes): skipped, recorded in :attr:`truncated`, with a
    :class:`TruncatedLogWarning`. ``source`` names the worker the log belongs to (default the
    file's name without ``.csv``); a ``Worker`` column (:func:`merge_logs`) overrides it.

    Examples
    --------
    >>> import os, tempfile
    >>> from dask_rmm.mr import LoggingResourceAdaptor, SystemMemoryResource
    >>> log = os.path.join(tempfile.mkdtemp(), "rmm_log.csv")
    >>> mr = LoggingResourceAdaptor(SystemMemoryResource(), log_file_name=log)
    >>> mr.deallocate(mr.allocate(1000), 1000)
    >>> mr.close()
    >>> path = mr.get_file_name()  # RMM's per-device name: .../rmm_log.dev0.csv
    >>> for event in LogReader(path):
    ...     print(event.line, event.action, event.size)
    2 allocate 1000
    3 free 1000
    """

    def __init__(self, path: str | os.PathLike, source: str | None = None):
        self.path = os.fspath(path)
        self.source = source if source is not None else default_source_name(self.path)
        #: line number and text of a skipped, cut-off last line
        self.truncated: tuple[int, str] | None = None
        #: rows yielded, lines and characters read so far (the progress, of ``total_bytes``:
        #: the file's size, compressed for ``.gz``)
        self.rows = self.lines = self.bytes_read = 0
        self.total_bytes = os.path.getsize(self.path) if os.path.exists(self.path) else 0

    def __iter__(self) -> Iterator[LogEvent]:
        with _open_text(self.path) as f:
            try:
                yield from self._events(f)
            except (EOFError, zlib.error, gzip.BadGzipFile) as e:  # a bad .gz (or none)
                raise LogFormatError(
                    self.path,
                    self.lines + 1,
                    f"the gzip file is truncated or corrupt ({e}); read {self.rows:,} rows "
                    f"in {self.lines:,} lines before it",
                ) from e

    def _events(self, f: TextIO) -> Iterator[LogEvent]:
        path = self.path
        lineno = 0
        for line in f:  # up to the header
            lineno += 1
            self.lines = lineno
            self.bytes_read += len(line)
            if not _is_blank(line):
                break
        else:
            raise LogFormatError(path, max(lineno, 1), "empty log: no header line")
        names = [n.strip() for n in line.rstrip("\r\n").split(",")]
        if missing := [n for n in HEADER if n not in names]:
            raise LogFormatError(
                path,
                lineno,
                f"not an RMM allocation log: the header must name the columns "
                f"{','.join(HEADER)} (missing {','.join(missing)})",
                line,
            )
        worker_col = names.index(WORKER_COLUMN) if WORKER_COLUMN in names else None
        i_thread, i_time, i_action, i_pointer, i_size, i_stream = map(names.index, HEADER)
        ncols = len(names)
        source = self.source
        sources: dict[str, str] = {}
        actions = _ACTIONS
        header_start = HEADER[0] + ","
        day_offset = 0.0
        last_time = None
        pending: LogFormatError | None = None
        restart_line = 0  # the line of a repeated header not yet followed by a row
        for line in f:
            lineno += 1
            self.lines = lineno
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
                action = actions.get(fields[i_action]) or actions.get(fields[i_action].strip())
                if action is None:
                    raise ValueError(
                        f"unknown action {fields[i_action].strip()!r} (expected allocate, free "
                        "or allocate failure)"
                    )
                t = parse_time(fields[i_time])
                size = int(fields[i_size])
                if size < 0:
                    raise ValueError(f"negative size {size}")
                if size > _SIZE_MAX:
                    raise ValueError(f"size {size} is larger than any size RMM logs (2**64 - 1)")
                event_source = source
                if worker_col is not None:
                    name = fields[worker_col].strip()
                    event_source = sources.setdefault(name, name)
                thread, stream = int(fields[i_thread]), int(fields[i_stream], 16)
                pointer = _parse_pointer(fields[i_pointer])
            except (ValueError, IndexError) as e:
                if line.startswith(header_start):
                    # A repeated header: a new writer appended here (the restart marker). Its
                    # event gets the time of the next row, the first the new writer wrote.
                    restart_line = lineno
                    continue
                pending = LogFormatError(path, lineno, f"malformed row ({e})", line)
                continue
            # Times are time of day: a backward jump of more than 12 h is a midnight.
            t += day_offset
            if last_time is not None and t < last_time - _HALF_DAY:
                day_offset += _DAY
                t += _DAY
            last_time = t
            if restart_line:
                yield LogEvent(0, t, Action.RESTART, 0, 0, 0, restart_line, event_source, path)
                restart_line = 0
            self.rows += 1
            yield LogEvent(thread, t, action, pointer, size, stream, lineno, event_source, path)
        if pending is not None:
            cut_line = pending.text or ""
            # RMM ends every row with a newline; NUL bytes, as a crash leaves them, mean cut off.
            if cut_line.endswith("\n") and "\x00" not in cut_line:  # complete, still malformed
                raise pending
            self.truncated = (pending.line, cut_line.rstrip("\r\n"))
            warnings.warn(
                f"{path}:{pending.line}: skipped the cut-off last line "
                f"{cut_line.rstrip(chr(10))[:80]!r} (the process writing the log stopped "
                "mid-line)",
                TruncatedLogWarning,
                stacklevel=3,
            )


def default_source_name(path: str | os.PathLike) -> str:
    """The worker name of a log file: its name without ``.csv`` / ``.csv.gz``."""
    name = Path(path).name
    for suffix in (".gz", ".csv", ".log"):
        name = name.removesuffix(suffix) or name
    return name


def read_log(path: str | os.PathLike, source: str | None = None) -> Iterator[LogEvent]:
    """The events of one log in file order (see :class:`LogReader`)."""
    return iter(LogReader(path, source))


def _unique_sources(paths: Sequence[str | os.PathLike]) -> list[str]:
    """A distinct source name per path: the file name, or more of the path where names clash."""
    names = [default_source_name(p) for p in paths]
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
    paths: Sequence[str | os.PathLike],
    readers: list[LogReader] | None = None,
    *,
    progress: str | None = None,
) -> Iterator[LogEvent]:
    """The events of several logs merged by time (each file read lazily, in its own order).

    ``readers`` (an empty list) receives the :class:`LogReader` of each path; ``progress`` (a
    label) draws click's progress bar on stderr. ValueError when one file is among ``paths``
    twice (by any name: a link, ``./``): every row would count twice.
    """
    seen: dict[tuple[int, int], str] = {}
    for path in paths:
        st = os.stat(path)
        if (st.st_dev, st.st_ino) in seen:
            raise ValueError(
                f"{os.fspath(path)} is given twice (also as {seen[st.st_dev, st.st_ino]}); a log "
                "merged with itself would count every allocation twice"
            )
        seen[st.st_dev, st.st_ino] = os.fspath(path)
    made = [LogReader(p, s) for p, s in zip(paths, _unique_sources(paths), strict=True)]
    if readers is not None:
        readers.extend(made)
    events = (
        iter(made[0]) if len(made) == 1 else heapq.merge(*made, key=operator.attrgetter("time"))
    )
    return events if progress is None else _with_progress(events, made, progress)


def _with_progress(
    events: Iterator[LogEvent], readers: Sequence[LogReader], label: str, every: int = 8192
) -> Iterator[LogEvent]:
    import click

    total = max(sum(r.total_bytes for r in readers), 1)
    with click.progressbar(length=total, label=label, file=sys.stderr) as bar:
        for i, e in enumerate(events):
            if i % every == 0:
                bar.update(min(sum(r.bytes_read for r in readers), total) - bar.pos)
            yield e
        bar.update(total - bar.pos)


class LiveAllocations:
    """The allocations a log shows live, keyed by ``(source, pointer)``. An allocation of a live
    address (another thread wrote its row before the free's) retires the old block, and the late
    ``free`` row is absorbed (:meth:`free` returns :data:`LATE_FREE`); docs/internals.md, Logs."""

    LATE_FREE = object()

    __slots__ = ("live", "late", "retired")

    def __init__(self):
        self.live: dict[tuple[str, int], Any] = {}
        self.late: Counter[tuple[str, int]] = Counter()
        #: allocations of an address still live (each retired the older block)
        self.retired = 0

    def allocate(self, key: tuple[str, int], value: Any) -> Any:
        """Record ``value`` live at ``key``; return the block it retired, or None."""
        live = self.live
        old = live.get(key)
        if old is not None:
            self.retired += 1
            self.late[key] += 1
        live[key] = value
        return old

    def end_source(self, source: str) -> list[Any]:
        """Forget every allocation of ``source`` (its process ended: a restart); return their
        values."""
        ended = [k for k in self.live if k[0] == source]
        for k in [k for k in self.late if k[0] == source]:
            del self.late[k]
        return [self.live.pop(k) for k in ended]

    def free(self, key: tuple[str, int]) -> Any:
        """Forget ``key``: its value, :data:`LATE_FREE` for an absorbed late row, or None when
        the log never showed it allocated."""
        late = self.late
        if late and late[key] > 0:
            late[key] -= 1
            return self.LATE_FREE
        return self.live.pop(key, None)


def format_event(event: LogEvent) -> str:
    """One RMM-format CSV row (no newline) for ``event``: ``thread,time,action,ptr,size,stream``."""
    nil = event.pointer == 0 and event.action in (Action.ALLOCATE_FAILURE, Action.RESTART)
    ptr = "(nil)" if nil else f"{event.pointer:#x}"
    return (
        f"{event.thread},{format_time(event.time)},{event.action.value},{ptr},"
        f"{event.size},{event.stream:x}"
    )


def merge_logs(paths: Sequence[str | os.PathLike], output: str | os.PathLike) -> int:
    """Merge several workers' logs by time into one CSV; return the rows written.

    The output has RMM's six columns and ``Worker`` (the file's name, or an input's own
    ``Worker``), read back by :func:`read_log`. Written whole or not at all; ValueError when it
    is one of the inputs.

    Examples
    --------
    >>> import tempfile
    >>> from dask_rmm.mr import LoggingResourceAdaptor, SystemMemoryResource
    >>> folder = tempfile.mkdtemp()
    >>> for w in ("w0", "w1"):  # RMM's per-device names: w0.dev0.csv, w1.dev0.csv
    ...     mr = LoggingResourceAdaptor(SystemMemoryResource(), log_file_name=f"{folder}/{w}.csv")
    ...     mr.deallocate(mr.allocate(1000), 1000)
    ...     mr.close()
    >>> merge_logs([f"{folder}/w0.dev0.csv", f"{folder}/w1.dev0.csv"], f"{folder}/all.csv")
    4
    >>> sorted({e.source for e in read_log(f"{folder}/all.csv")})
    ['w0.dev0', 'w1.dev0']
    """
    events = read_logs(list(paths))
    n = 0
    with atomic_output(output, inputs=paths) as tmp, open(tmp, "w", newline="\n") as f:
        f.write(",".join(HEADER) + "," + WORKER_COLUMN + "\n")
        for e in events:
            f.write(f"{format_event(e)},{e.source}\n")
            n += 1
    return n
