"""Allocation-log tools: read RMM's CSV logs (``reader``), summarize them (``summary``), draw
bytes in use over time (``timeline``) and re-issue them on a fresh resource (``replay``).
No Dask; ``dask rmm log ...`` is their command line.
"""

from dask_rmm.logs.reader import (
    HEADER,
    WORKER_COLUMN,
    Action,
    LiveAllocations,
    LogEvent,
    LogFormatError,
    LogReader,
    TruncatedLogWarning,
    default_source_name,
    format_event,
    format_time,
    iter_rows,
    merge_logs,
    parse_time,
    read_log,
    read_logs,
)

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
    "iter_rows",
    "merge_logs",
    "parse_time",
    "read_log",
    "read_logs",
]
