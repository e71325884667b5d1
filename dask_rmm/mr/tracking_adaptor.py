"""``TrackingResourceAdaptor``: remembers every live allocation (and optionally the Python stack
that made it) so leaks can be listed. Counting without per-pointer records is the statistics
adaptor's job."""

from __future__ import annotations

import threading
import traceback

from dask_rmm.mr.base import DeviceMemoryResource, UpstreamResourceAdaptor
from dask_rmm.stream import DEFAULT_STREAM, Stream

__all__ = ["TrackingResourceAdaptor"]


class TrackingResourceAdaptor(UpstreamResourceAdaptor):
    """Tracks the outstanding allocations made through it.

    Unlike RMM, which logs and carries on, a deallocation of a pointer this adaptor did not hand
    out, or with a size other than the allocated one, raises ``ValueError`` before the upstream is
    called, and nothing changes.

    Parameters
    ----------
    upstream_mr : DeviceMemoryResource
        The resource that allocates.
    capture_stacks : bool, default False
        Record the Python stack of each allocation (slow; for hunting leaks).

    Examples
    --------
    >>> from dask_rmm.mr import SystemMemoryResource, TrackingResourceAdaptor
    >>> mr = TrackingResourceAdaptor(SystemMemoryResource())
    >>> p = mr.allocate(100)
    >>> mr.get_allocated_bytes()
    100
    >>> mr.deallocate(p, 100)
    >>> mr.get_outstanding_allocations_str()
    ''
    """

    def __init__(self, upstream_mr: DeviceMemoryResource, capture_stacks: bool = False):
        super().__init__(upstream_mr)
        if not isinstance(capture_stacks, bool):
            raise TypeError(f"capture_stacks must be a bool, got {capture_stacks!r}")
        self.capture_stacks = capture_stacks
        self._lock = threading.Lock()
        # ptr -> (nbytes, formatted stack or None)
        self._allocations: dict[int, tuple[int, str | None]] = {}
        self._allocated_bytes = 0
        self._upstream_allocate = upstream_mr.allocate
        self._upstream_deallocate = upstream_mr.deallocate

    def allocate(self, nbytes: int, stream: Stream = DEFAULT_STREAM) -> int:
        ptr = self._upstream_allocate(nbytes, stream)
        if nbytes:
            stack = "".join(traceback.format_stack()[:-1]) if self.capture_stacks else None
            with self._lock:
                if ptr in self._allocations:  # pragma: no cover - an upstream bug
                    raise RuntimeError(
                        f"TrackingResourceAdaptor: upstream returned {ptr:#x}, which is already "
                        "tracked as live"
                    )
                self._allocations[ptr] = (nbytes, stack)
                self._allocated_bytes += nbytes
        return ptr

    def deallocate(self, ptr: int, nbytes: int, stream: Stream = DEFAULT_STREAM) -> None:
        if not nbytes and not ptr:
            self._upstream_deallocate(ptr, nbytes, stream)
            return
        with self._lock:
            record = self._allocations.get(ptr)
            if record is None:
                raise ValueError(
                    f"TrackingResourceAdaptor.deallocate({ptr:#x}, {nbytes}): pointer not "
                    "allocated through this adaptor (foreign pointer or double free)"
                )
            if record[0] != nbytes:
                raise ValueError(
                    f"TrackingResourceAdaptor.deallocate({ptr:#x}, {nbytes}): wrong size, the "
                    f"pointer was allocated with {record[0]} bytes"
                )
            # Taken out before the upstream call so that a concurrent double free is refused.
            del self._allocations[ptr]
            self._allocated_bytes -= nbytes
        try:
            self._upstream_deallocate(ptr, nbytes, stream)
        except BaseException:
            with self._lock:
                self._allocations[ptr] = record
                self._allocated_bytes += nbytes
            raise

    def get_allocated_bytes(self) -> int:
        """Bytes currently allocated through this adaptor (sizes as requested)."""
        return self._allocated_bytes

    def get_outstanding_allocations(self) -> dict[int, int]:
        """``{pointer: nbytes}`` of every live allocation."""
        with self._lock:
            return {p: n for p, (n, _) in self._allocations.items()}

    def get_outstanding_allocations_str(self) -> str:
        """One line per live allocation, in address order, as RMM prints them:
        ``0x7f...: 1024 B``, followed by ``: callstack:`` and the stack when captured."""
        with self._lock:
            items = sorted(self._allocations.items())
        out = []
        for ptr, (nbytes, stack) in items:
            line = f"{ptr:#x}: {nbytes} B"
            if stack is not None:
                line += " : callstack:\n" + stack.rstrip("\n")
            out.append(line + "\n")
        return "".join(out)

    def log_outstanding_allocations(self) -> None:
        """Write :meth:`get_outstanding_allocations_str` to the debug logger at debug level."""
        from dask_rmm import logger

        log = logger.get_logger()
        if log.isEnabledFor(logger.DEBUG):
            log.debug("Outstanding Allocations: %s", self.get_outstanding_allocations_str())
