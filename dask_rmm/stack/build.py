"""The one stack builder: options and a device id in, one device's resource stack out
(:class:`DeviceStack`, built completely, nothing installed), with its allocation log file.
Not here: the options model (``options.py``), installing stacks on a worker
(:mod:`dask_rmm.worker.stacks`).
"""

from __future__ import annotations

import fcntl
import logging
import os
import re
import stat
import tempfile
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from dask_rmm import _cuda, mr
from dask_rmm.mr.attribution_adaptor import AttributionResourceAdaptor
from dask_rmm.mr.base import upstreams
from dask_rmm.mr.logging_adaptor import CSV_HEADER
from dask_rmm.sizes import format_bytes, host_total_memory
from dask_rmm.stack.options import RMMOptions, _check_pool_sizes

if TYPE_CHECKING:
    from dask_rmm.mr.base import DeviceMemoryResource

__all__ = [
    "DeviceStack",
    "build_stack",
    "check_log_file_keeps_rows",
    "claim_log_file",
    "log_file_path",
    "make_base_resource",
    "resource_chain",
]

logger = logging.getLogger(__name__)


# -- log files ------------------------------------------------------------------------------------


def log_file_path(log_directory: str | os.PathLike, worker_name: Any, device: int) -> str:
    """``<log_directory>/rmm_log_<worker name>.dev<device>.csv``, the name made filename-safe.

    Examples
    --------
    >>> log_file_path("/logs", "tcp://10.0.0.1:4242", 0)
    '/logs/rmm_log_tcp_10.0.0.1_4242.dev0.csv'
    """
    safe = re.sub(r"[^A-Za-z0-9_.-]+", "_", str(worker_name)).strip("._") or "worker"
    return os.path.join(os.fspath(log_directory), f"rmm_log_{safe}.dev{device}.csv")


def claim_log_file(path: str, *, create: bool = True) -> tuple[str, int | None]:
    """Reserve ``path`` (or, held by another live process, ``path`` with this process's id and
    then a counter added) with an exclusive ``flock`` held until the returned descriptor is
    closed; ``create=False`` only looks: the name a claim would take now, and None."""
    stem, _, ext = path.rpartition(".dev")
    candidates = [path, f"{stem}-{os.getpid()}.dev{ext}"]
    candidates += [f"{stem}-{os.getpid()}-{i}.dev{ext}" for i in range(1, 64)]
    for candidate in candidates:
        try:
            fd = os.open(candidate, os.O_RDWR | (os.O_CREAT if create else 0), 0o644)
        except FileNotFoundError:
            if create:
                raise
            # No file yet: free. Made at the first row, so a directory it cannot be made in
            # fails now, at setup, not later with the rows lost.
            if not os.access(os.path.dirname(candidate) or ".", os.W_OK | os.X_OK):
                raise PermissionError(
                    f"cannot create {candidate}: the directory is not writable"
                ) from None
            return candidate, None
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            os.close(fd)
            continue
        if not create:
            os.close(fd)  # closing releases the lock: this was a look
            return candidate, None
        return candidate, fd
    raise RuntimeError(f"no free log file name next to {path}: all candidates are in use")


def check_log_file_keeps_rows(path: str) -> None:
    """Raise OSError unless rows written to ``path`` would be kept: an existing ``path`` must be
    a regular file (not ``/dev/null`` or a pipe), and a probe file next to it must keep what
    was written (``/proc``, ``/sys`` do not). Checked at build, so a registration fails."""
    if os.path.exists(path) and not stat.S_ISREG(os.stat(path).st_mode):
        raise OSError(
            f"{path} is not a regular file ({os.path.realpath(path)}): rows written to it "
            "would not be kept"
        )
    directory = os.path.dirname(path) or "."
    row = (CSV_HEADER + "\n").encode()
    # A file without a name (O_TMPFILE, else unlinked at once): a worker killed here leaves none.
    with tempfile.TemporaryFile(dir=directory, prefix=".rmm_log_probe-", buffering=0) as f:
        written = f.write(row)
        os.fsync(f.fileno())
        kept = os.fstat(f.fileno()).st_size
    if written != len(row) or kept != len(row):
        raise OSError(
            f"{directory} does not keep what is written to it (a test row of {len(row)} bytes "
            f"left a file of {kept}): not a place for allocation logs"
        )


# -- per-device state on one worker --------------------------------------------------------------


@dataclass
class DeviceStack:
    """What setup built for one device, and what teardown needs to undo it."""

    device: int
    top: DeviceMemoryResource
    statistics: Any = None  # StatisticsResourceAdaptor or None
    attribution: Any = None  # AttributionResourceAdaptor or None
    logging: Any = None  # LoggingResourceAdaptor or None
    pool: Any = None  # the PoolMemoryResource the stack's options made, or None
    log_path: str | None = None
    #: with ``log_directory``: the name the log file is claimed under at its first row
    log_claim_path: str | None = None
    chain: str = ""
    host_memory: bool = False
    options: RMMOptions | None = None
    pool_size: int | None = None  # bytes, as resolved on this device
    maximum_pool_size: int | None = None
    #: with a PoolMemoryResource: bytes it keeps, free chunks above go back upstream
    release_threshold: int | None = None
    pressure: Any = None  # dask_rmm.pressure.DevicePressure when the options ask for it

    @property
    def live_bytes(self) -> int:
        """Bytes allocated through this stack and not yet freed (0 without statistics)."""
        try:
            return int(self.statistics.current_bytes) if self.statistics is not None else 0
        except Exception:  # a broken counter must not break a teardown
            return 0

    def describe(self) -> str:
        """One line: resources, pool size and maximum, base resource, log file."""
        pool, maximum = (
            "none" if n is None else format_bytes(n)
            for n in (self.pool_size, self.maximum_pool_size)
        )
        base = self.options.base_resource if self.options is not None else "?"
        return (
            f"device {self.device}: {self.chain}; pool {pool}, maximum {maximum}, "
            f"base resource {base}, log {self.log_path or 'none'}"
        )

    def flush_log(self, close: bool = False) -> None:
        """Write the log's buffered rows to its file (and close it, releasing its name);
        nothing without a log, or once the adaptor of a retired stack was collected (it flushed
        and closed its file then)."""
        if self.logging is not None:
            for method in ("flush", "close") if close else ("flush",):
                try:
                    getattr(self.logging, method)()
                    # The name is claimed at the first row: another process may have taken
                    # the one chosen at build time meanwhile.
                    self.log_path = self.logging.get_file_name()
                except ReferenceError:  # a retired stack's adaptor, collected: closed already
                    break
                except Exception:  # pragma: no cover - a timer or a teardown must go on
                    logger.exception("dask-rmm: %s of %s failed", method, self.log_path)

    def plan_log_path(self) -> None:
        """Before the log's first row, name the file a claim would take now: a stack this one
        replaced may have released its name since the build, and the first row then takes it
        (the INFO line named the build-time choice, a file that never appeared)."""
        if self.logging is None or self.log_claim_path is None:
            return
        name, _ = claim_log_file(self.log_claim_path, create=False)
        if self.logging.plan_file_name(name):
            self.log_path = name

    def close_log(self) -> None:
        self.flush_log(close=True)


def resource_chain(mr: Any) -> str:
    """The class names of a resource and its upstreams, outermost first, joined by ``>``."""
    return ">".join(type(m).__name__ for m in upstreams(mr))


def make_base_resource(name: str, device: int, options: RMMOptions | None = None, total: int = 0):
    """The base resource ``name`` on ``device`` (the current CUDA device must be ``device``)."""
    if name == "system":
        return mr.SystemMemoryResource(device_id=device)
    _cuda.require_cuda(
        f"base_resource={name!r} (use base_resource='system' for host memory without a GPU)"
    )
    if name == "async" and options is not None:
        return mr.CudaAsyncMemoryResource(
            initial_pool_size=options.resolve_size("pool_size", device, total),
            release_threshold=options.resolve_size("release_threshold", device, total),
        )
    return {
        "cuda": mr.CudaMemoryResource,
        "managed": mr.ManagedMemoryResource,
        "pinned": mr.PinnedHostMemoryResource,
        "async": mr.CudaAsyncMemoryResource,
    }[name]()


def build_stack(
    options: RMMOptions,
    device: int,
    *,
    worker_name: Any = None,
    task_key: Callable[[], Any] | None = None,
    owner_name: Callable[[Any], str] | None = None,
) -> DeviceStack:
    """One device's resource stack, built completely (nothing installed); its layers are drawn
    in docs/internals.md (every adaptor above the pool: it sees requests, not the pool's growth;
    attribution, with ``task_key``, over statistics: per-task bytes add up to its counters)."""
    # A device this host lacks fails here, while building (so the vote hears it), not when the
    # built stack is installed after every worker agreed.
    _cuda.check_device(device, host_memory=True)
    with _cuda.on_device(device):
        total = host_total_memory() if options.host_memory else _cuda.device_total_memory(device)
        pool_size = options.resolve_size("pool_size", device, total)
        maximum = options.resolve_size("maximum_pool_size", device, total)
        _check_pool_sizes(pool_size, maximum, f" on device {device}")
        top = make_base_resource(options.base_resource, device, options, total)
        if options.base_resource == "async":
            if maximum is not None:
                top = mr.LimitingResourceAdaptor(top, allocation_limit=maximum)
        elif options.pool_allocator:
            top = mr.PoolMemoryResource(top, initial_pool_size=pool_size, maximum_pool_size=maximum)
    stack = DeviceStack(device=device, top=top, host_memory=top.is_host_memory, options=options)
    if isinstance(top, mr.PoolMemoryResource):
        stack.pool = top
    try:
        if options.track_allocations:
            top = mr.TrackingResourceAdaptor(top)
        if options.log_directory is not None:
            try:
                os.makedirs(options.log_directory, exist_ok=True)
                path = log_file_path(options.log_directory, worker_name, device)
                stack.log_path, _ = claim_log_file(path, create=False)
                check_log_file_keeps_rows(stack.log_path)
                stack.log_claim_path = path
                # Appended to (a restarted worker keeps its rows) and made at the first row (a
                # worker that never allocates leaves no file), claimed then; the adaptor adds
                # RMM's ".dev<id>" to the name.
                top = stack.logging = mr.LoggingResourceAdaptor(
                    top,
                    log_file_name=stack.log_path[: -len(f".dev{device}.csv")] + ".csv",
                    append=True,
                    open_on_first_row=True,
                    claim=lambda _name: claim_log_file(path),
                )
            except OSError as e:
                raise OSError(
                    f"`log_directory` {options.log_directory!r}: cannot write the allocation log "
                    f"of device {device}: {e}"
                ) from e
        elif options.log_file_name is not None:
            top = stack.logging = mr.LoggingResourceAdaptor(
                top, log_file_name=options.log_file_name
            )
        if stack.logging is not None:
            stack.log_path = stack.logging.get_file_name()
        if options.statistics:
            top = stack.statistics = mr.StatisticsResourceAdaptor(top)
            if task_key is not None:
                top = stack.attribution = AttributionResourceAdaptor(
                    top, task_key, owner_name=str if owner_name is None else owner_name
                )
    except BaseException:
        stack.close_log()
        raise
    stack.top = top
    stack.chain = resource_chain(top)
    stack.pool_size, stack.maximum_pool_size = pool_size, maximum
    if options.pool_allocator and options.base_resource != "async":
        stack.release_threshold = options.resolve_size("release_threshold", device, total)
    return stack
