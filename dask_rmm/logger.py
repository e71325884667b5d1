"""dask-rmm's debug logger with RMM's controls (``set_logging_level``, ``flush_on``, ...) on
:mod:`logging`: to stderr or ``RMM_DEBUG_LOG_FILE``, in RMM's layout. Not here: the allocation
log (:class:`~dask_rmm.mr.LoggingResourceAdaptor`).
"""

from __future__ import annotations

import enum
import logging
import os
import sys
import threading
import time

__all__ = [
    "flush_logger",
    "flush_on",
    "get_flush_level",
    "get_logger",
    "get_logging_level",
    "level_enum",
    "set_flush_level",
    "set_logging_level",
    "should_log",
]

#: Python logging level used for RMM's ``trace`` (below ``logging.DEBUG``).
TRACE = 5
DEBUG = logging.DEBUG
LOGGER_NAME = "dask_rmm"


class level_enum(enum.IntEnum):  # noqa: N801 - RMM's name
    """RMM's debug-logging levels, least to most severe."""

    trace = 0
    debug = 1
    info = 2
    warn = 3
    error = 4
    critical = 5
    off = 6


#: Alias used in older RMM docs (``rmm.logging_level.WARN``).
logging_level = level_enum

#: level_enum -> Python's level (``off``: above ``logging.CRITICAL``).
_LEVELS = (TRACE, DEBUG, logging.INFO, logging.WARNING, logging.ERROR, logging.CRITICAL)
_TO_PY = dict(zip(level_enum, (*_LEVELS, logging.CRITICAL + 10), strict=True))
# spdlog's level names, as RMM's pattern prints them.
_NAMES = {TRACE: "trace", 10: "debug", 20: "info", 30: "warning", 40: "error", 50: "critical"}

_setup_lock = threading.Lock()
_logger: logging.Logger | None = None
_flush_level = level_enum.warn


def _as_level(level: level_enum | str) -> level_enum:
    """``level`` as a ``level_enum``: a member, or a member's exact (lower-case) name."""
    if isinstance(level, level_enum):
        return level
    if isinstance(level, str) and level in level_enum.__members__:
        return level_enum[level]
    raise TypeError(
        f"level must be a dask_rmm.level_enum or one of the names "
        f"{', '.join(repr(m.name) for m in level_enum)}; got {level!r} ({type(level).__name__})"
    )


class _FlushLevelHandler(logging.StreamHandler):
    """Writes every record in RMM's layout, flushes only those at or above the flush level (as
    spdlog)."""

    def format(self, record: logging.LogRecord) -> str:
        t = record.created
        clock = time.strftime("%H:%M:%S", time.localtime(t))
        micros = int((t - int(t)) * 1_000_000)
        tid = getattr(record, "thread_native", None) or threading.get_native_id()
        level = _NAMES.get(record.levelno, record.levelname.lower())
        return f"[{tid:>6}][{clock}:{micros:06d}][{level:<6}] {record.getMessage()}"

    def emit(self, record: logging.LogRecord) -> None:
        # Handler.handle holds self.lock around emit.
        try:
            self.stream.write(self.format(record) + self.terminator)
            if record.levelno >= _TO_PY[_flush_level]:
                self.stream.flush()
        except Exception:  # pragma: no cover - logging must not raise
            self.handleError(record)


class OneLineFor(logging.Filter):
    """Log a record whose error is one of ``errors`` as one line, its message and the error's
    (no traceback): for errors that already say it all, which a library logs with one."""

    def __init__(self, *errors: type[BaseException]) -> None:
        super().__init__()
        self.errors = errors

    def filter(self, record: logging.LogRecord) -> bool:
        if record.exc_info and isinstance(record.exc_info[1], self.errors):
            record.msg, record.args = f"{record.getMessage()}: {record.exc_info[1]}", ()
            record.exc_info = record.exc_text = None
        return True


def get_logger() -> logging.Logger:
    """The ``dask_rmm`` debug logger (made, with its stderr or file handler, on first use)."""
    global _logger
    if _logger is None:
        with _setup_lock:
            if _logger is None:
                log = logging.getLogger(LOGGER_NAME)
                path = os.environ.get("RMM_DEBUG_LOG_FILE")
                stream = open(path, "w") if path else sys.stderr  # noqa: SIM115 - lives with the process
                log.addHandler(_FlushLevelHandler(stream))
                log.propagate = False
                if log.level == logging.NOTSET:
                    log.setLevel(logging.INFO)
                _logger = log
    return _logger


def set_logging_level(level: level_enum | str) -> None:
    """Log messages at ``level`` and above.

    Parameters
    ----------
    level : level_enum or str
        ``level_enum.debug`` or its name (``"trace"``, ``"debug"``, ``"info"``, ``"warn"``,
        ``"error"``, ``"critical"``, ``"off"``).

    Examples
    --------
    >>> import dask_rmm
    >>> dask_rmm.set_logging_level(dask_rmm.level_enum.warn)
    >>> dask_rmm.get_logging_level()
    <level_enum.warn: 3>
    >>> dask_rmm.set_logging_level("info")
    """
    get_logger().setLevel(_TO_PY[_as_level(level)])


def get_logging_level() -> level_enum:
    """The current debug-logging level (``level_enum.info`` by default)."""
    py = get_logger().getEffectiveLevel()
    # Ours, or (someone set a Python level between ours) the nearest one above it.
    return min((m for m, v in _TO_PY.items() if v >= py), default=level_enum.off)


def set_flush_level(level: level_enum | str) -> None:
    """Flush the log after every message at ``level`` or above (``warn`` by default)."""
    global _flush_level
    _flush_level = _as_level(level)
    get_logger()


#: RMM's other name for :func:`set_flush_level`.
flush_on = set_flush_level


def get_flush_level() -> level_enum:
    """The level at or above which every message is flushed at once."""
    return _flush_level


def should_log(level: level_enum | str) -> bool:
    """True when a message at ``level`` would be written."""
    level = _as_level(level)
    return level is not level_enum.off and get_logger().isEnabledFor(_TO_PY[level])


def flush_logger() -> None:
    """Write out anything the debug logger has buffered."""
    for handler in get_logger().handlers:
        handler.flush()


def _reset_for_tests() -> None:
    """Back to level info and flush level warn."""
    global _flush_level
    _flush_level = level_enum.warn
    get_logger().setLevel(logging.INFO)
