"""``LoggingResourceAdaptor``: writes every allocation, free and failed allocation to a CSV file
in RMM's format (docs/internals.md, Logs). Reading the logs back is :mod:`dask_rmm.logs`'s job."""

from __future__ import annotations

import os
import threading
import warnings
from collections.abc import Callable
from datetime import datetime
from typing import Any, TextIO

from dask_rmm.mr import registry
from dask_rmm.mr.base import DeviceMemoryResource, UpstreamResourceAdaptor
from dask_rmm.stream import DEFAULT_STREAM, Stream

__all__ = [
    "CSV_HEADER",
    "LoggingResourceAdaptor",
    "disable_logging",
    "enable_logging",
    "format_pointer",
    "format_stream",
    "get_log_filenames",
]

#: The first line of every log file.
CSV_HEADER = "Thread,Time,Action,Pointer,Size,Stream"


def format_pointer(ptr: int) -> str:
    """A pointer as glibc's ``printf("%p")`` writes it."""
    return f"{ptr:#x}" if ptr else "(nil)"


def format_stream(handle: int) -> str:
    """A stream handle as RMM writes it (a C++ ``ostream`` of the ``cudaStream_t``)."""
    return f"{handle:#x}" if handle else "0"


def _drop_cut_off_line(path: str) -> None:
    """Remove a last line without its newline (a writer killed mid-row) from ``path``."""
    try:
        f = open(path, "r+b")  # noqa: SIM115
    except (FileNotFoundError, IsADirectoryError):
        return  # nothing to repair; open() below reports what is wrong
    with f:
        end = f.seek(0, os.SEEK_END)
        start = f.seek(max(0, end - (1 << 16)))  # a row is far shorter than 64 KiB
        tail = f.read()
        if not tail.endswith(b"\n"):
            f.truncate(start + tail.rfind(b"\n") + 1)


class LoggingResourceAdaptor(UpstreamResourceAdaptor):
    """Logs every allocation and free (once the upstream accepted it) made through it to a CSV
    file in RMM's format, named as RMM's with ``.dev{device_id}`` (``rmm.csv``: ``rmm.dev0.csv``).

    Parameters
    ----------
    log_file_name : str or os.PathLike, optional
        Where to log; default the ``RMM_LOG_FILE`` environment variable (ValueError if neither
        names a file).
    auto_flush : bool, default False
        Flush the file after every row (slow, but nothing is lost if the process dies).
    append : bool, default False
        Add to an existing file instead of truncating it as RMM does (a restarted worker keeps
        its rows): a last row cut off mid-row is removed first, and the header is written
        again, the restart marker for the log tools.
    open_on_first_row : bool, default False
        Open the file when the first row is written: a resource that never allocates leaves
        no file.
    claim : callable, optional
        ``claim(file_name) -> (file_name, fd or None)``, called just before the file is opened:
        reserves a name (maybe another) and returns a descriptor held until :meth:`close`.

    Examples
    --------
    >>> import os, tempfile
    >>> from dask_rmm.mr import LoggingResourceAdaptor, SystemMemoryResource
    >>> path = os.path.join(tempfile.mkdtemp(), "rmm.csv")
    >>> mr = LoggingResourceAdaptor(SystemMemoryResource(), log_file_name=path)
    >>> mr.deallocate(mr.allocate(100), 100)
    >>> mr.close()
    >>> with open(mr.get_file_name()) as f:
    ...     f.readline().strip()
    'Thread,Time,Action,Pointer,Size,Stream'
    """

    def __init__(
        self,
        upstream_mr: DeviceMemoryResource,
        log_file_name: str | os.PathLike | None = None,
        auto_flush: bool = False,
        append: bool = False,
        *,
        open_on_first_row: bool = False,
        claim: Callable[[str], tuple[str, int | None]] | None = None,
    ):
        super().__init__(upstream_mr)
        name, ext = os.path.splitext(_log_file_name(log_file_name, "LoggingResourceAdaptor"))
        self._file_name = os.path.abspath(f"{name}.dev{self.device_id}{ext}")  # RMM's per device
        self.auto_flush = bool(auto_flush)
        self._lock = threading.Lock()
        #: Writes to the file that failed (a full disk): their rows are lost.
        self.write_errors = 0
        self._append = bool(append)
        self._claim = claim
        self._lock_fd: int | None = None
        self._file: TextIO | None = None
        self._closed = False
        if not open_on_first_row:
            self._open()

    def _open(self) -> TextIO:
        """Claim, create or truncate (or append to) the file and write its header."""
        if self._claim is not None:
            self._file_name, self._lock_fd = self._claim(self._file_name)
        try:
            if self._append:
                _drop_cut_off_line(self._file_name)
            else:
                open(self._file_name, "w").close()  # RMM truncates; rows are appended below
            # O_APPEND: an adaptor logging into a file another one truncated since (buffers of
            # an earlier reinitialize alive) adds its rows at the end, not at its old offset.
            f = open(self._file_name, "a", encoding="ascii", newline="")  # noqa: SIM115
        except BaseException:
            self._release_claim()
            raise
        f.write(CSV_HEADER + "\n")
        f.flush()
        self._file = f
        return f

    def _release_claim(self) -> None:
        fd, self._lock_fd = self._lock_fd, None
        if fd is not None:
            os.close(fd)

    def _write(self, action: str, ptr: int, nbytes: int, stream: Stream) -> None:
        handle = int(stream)  # a Stream's handle (a bare int handle is taken as is)
        now = datetime.now().isoformat(timespec="microseconds")[11:]  # local HH:MM:SS.micros
        row = (
            f"{threading.get_native_id()},{now},{action},"
            f"{format_pointer(ptr)},{nbytes},{format_stream(handle)}\n"
        )
        with self._lock:
            f = self._file
            if f is None:
                if self._closed:
                    return
                try:
                    f = self._open()
                except (OSError, RuntimeError) as e:  # no file: this row and the later ones lost
                    self._closed = True
                    self._write_failed(e)
                    return
            try:
                f.write(row)
                if self.auto_flush:
                    f.flush()
            except OSError as e:
                self._write_failed(e)

    def _write_failed(self, error: Exception) -> None:
        # A full disk never fails the allocation: the row is lost, as RMM's logger loses it.
        self.write_errors += 1
        if self.write_errors == 1:
            warnings.warn(
                f"LoggingResourceAdaptor: cannot write {self._file_name} ({error}); allocation "
                "rows are lost until it can",
                RuntimeWarning,
                stacklevel=4,
            )

    def allocate(self, nbytes: int, stream: Stream = DEFAULT_STREAM) -> int:
        try:
            ptr = self._upstream_allocate(nbytes, stream)
        except Exception:
            self._write("allocate failure", 0, nbytes, stream)
            raise
        self._write("allocate", ptr, nbytes, stream)
        return ptr

    def deallocate(self, ptr: int, nbytes: int, stream: Stream = DEFAULT_STREAM) -> None:
        self._upstream_deallocate(ptr, nbytes, stream)
        self._write("free", ptr, nbytes, stream)

    def flush(self) -> None:
        """Write buffered rows to the file."""
        with self._lock:
            if self._file is not None:
                try:
                    self._file.flush()
                except OSError as e:
                    self._write_failed(e)

    def plan_file_name(self, file_name: str) -> bool:
        """With ``open_on_first_row`` and no row yet: where the file is expected to be (until the
        first row claims its name). False, and nothing changed, once it was opened or closed."""
        with self._lock:
            if self._file is not None or self._closed:
                return False
            self._file_name = os.fspath(file_name)
            return True

    def get_file_name(self) -> str:
        """The absolute path of the log file (with the ``.dev{id}`` suffix)."""
        return self._file_name

    def close(self) -> None:
        """Flush and close the file; later rows are dropped. Allocation keeps working."""
        with self._lock:
            f, self._file = self._file, None
            self._closed = True
        if f is not None:
            try:
                f.close()
            except OSError as e:  # the last rows could not be written; the file is closed
                self._write_failed(e)
        self._release_claim()

    def __del__(self):
        try:
            self.close()
        except Exception:
            pass

    def _repr_fields(self) -> str:
        return f"file={self._file_name!r}"


def _log_file_name(log_file_name: Any, needed_by: str = "logging=True") -> str:
    """``log_file_name``, or ``$RMM_LOG_FILE`` when None; errors name ``needed_by``."""
    if log_file_name is None:
        log_file_name = os.environ.get("RMM_LOG_FILE") or None
    if log_file_name is None:
        raise ValueError(
            f"{needed_by} needs a log file: pass log_file_name=... or set the RMM_LOG_FILE "
            "environment variable"
        )
    if not isinstance(log_file_name, (str, os.PathLike)) or not os.fspath(log_file_name):
        raise TypeError(f"log_file_name must be a non-empty path, got {log_file_name!r}")
    return os.fspath(log_file_name)


def _registered_devices() -> list[int]:
    return registry.registered_devices() or [0]  # what RMM's logging functions walk over


def enable_logging(log_file_name: str | os.PathLike | None = None) -> None:
    """Wrap the resource of every device that has one (device 0 if none has) in a
    :class:`~dask_rmm.mr.LoggingResourceAdaptor` writing to ``log_file_name`` (default
    ``RMM_LOG_FILE``; ``ValueError`` if neither is set); resources that log are left alone."""
    log_file_name = _log_file_name(log_file_name)
    for device in _registered_devices():
        mr = registry.get_per_device_resource(device)
        if not isinstance(mr, LoggingResourceAdaptor):
            registry.set_per_device_resource(
                device, LoggingResourceAdaptor(mr, log_file_name=log_file_name)
            )


def disable_logging() -> None:
    """Unwrap every device's :class:`~dask_rmm.mr.LoggingResourceAdaptor` (flushing its file);
    buffers allocated while logging still log their frees."""
    for device in _registered_devices():
        mr = registry.get_per_device_resource(device)
        if isinstance(mr, LoggingResourceAdaptor):
            mr.flush()
            registry.set_per_device_resource(device, mr.get_upstream())


def get_log_filenames() -> dict[int, str | None]:
    """``{device: absolute log file name or None}`` for each device with a resource.

    Examples
    --------
    >>> import dask_rmm, tempfile, os
    >>> path = os.path.join(tempfile.mkdtemp(), "rmm.log")
    >>> dask_rmm.reinitialize(base_resource="system", logging=True, log_file_name=path)
    >>> dask_rmm.get_log_filenames()[0].endswith("rmm.dev0.log")
    True
    """
    out: dict[int, str | None] = {}
    for device in registry.registered_devices():
        mr = registry.get_per_device_resource(device)
        out[device] = mr.get_file_name() if isinstance(mr, LoggingResourceAdaptor) else None
    return out
