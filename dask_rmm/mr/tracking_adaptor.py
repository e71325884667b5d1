"""``TrackingResourceAdaptor``: remembers every live allocation (and optionally the Python stack
that made it) so leaks can be listed. Counting without per-pointer records is the statistics
adaptor's job."""

from __future__ import annotations

import traceback

from dask_rmm import logger
from dask_rmm.mr.base import DeviceMemoryResource, UpstreamResourceAdaptor, deallocate_refused
from dask_rmm.mr.pool import PoolMemoryResource
from dask_rmm.stream import DEFAULT_STREAM, Stream

__all__ = ["TrackingResourceAdaptor"]


class TrackingResourceAdaptor(UpstreamResourceAdaptor):
    """Tracks the outstanding allocations made through it.

    Unlike RMM, which logs and carries on, a wrong free raises ``ValueError`` before the
    upstream is called. Directly over a :class:`PoolMemoryResource` with nothing live, without
    ``capture_stacks``, it reads the pool's live table, allocations made on the pool directly
    too (:attr:`tracking_pool`).

    Parameters
    ----------
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
        self._capture_stacks = capture_stacks
        # ptr -> nbytes; dict stores and pops are atomic: no lock.
        self._allocations: dict[int, int] = {}
        self._stacks: dict[int, str] = {}  # ptr -> formatted stack, when capturing
        self._tracking_pool: PoolMemoryResource | None = None
        if (
            not capture_stacks
            and type(upstream_mr) is PoolMemoryResource
            and not upstream_mr.live_allocations()
        ):
            self._tracking_pool = upstream_mr  # its live table is this adaptor's
            self._fuse(upstream_mr)

    @property
    def capture_stacks(self) -> bool:
        """Whether the Python stack of each allocation is recorded (fixed at construction)."""
        return self._capture_stacks

    @property
    def tracking_pool(self) -> PoolMemoryResource | None:
        """The pool whose live-block table this adaptor reads (its ``allocate``/``deallocate``
        are then the pool's), or None when the adaptor keeps its own."""
        return self._tracking_pool

    def allocate(self, nbytes: int, stream: Stream = DEFAULT_STREAM) -> int:
        ptr = self._upstream_allocate(nbytes, stream)
        if nbytes:
            if self._capture_stacks:
                self._stacks[ptr] = "".join(traceback.format_stack()[:-1])
            self._allocations[ptr] = nbytes
        return ptr

    def deallocate(self, ptr: int, nbytes: int, stream: Stream = DEFAULT_STREAM) -> None:
        allocations = self._allocations
        # Taken out before the upstream call so that a concurrent double free is refused.
        n = allocations.pop(ptr, None)
        if n != nbytes:
            if n is not None:
                allocations[ptr] = n
            return deallocate_refused(self, "TrackingResourceAdaptor", ptr, nbytes, n, stream)
        # Its stack goes too, before the address can be handed out again.
        stack = self._stacks.pop(ptr, None) if self._stacks else None
        try:
            self._upstream_deallocate(ptr, nbytes, stream)
        except BaseException:
            allocations[ptr] = n
            if stack is not None:
                self._stacks[ptr] = stack
            raise

    def _snapshot(self) -> dict[int, int]:
        if self._tracking_pool is not None:
            return self._tracking_pool.live_allocations()
        while True:
            try:
                return dict(self._allocations)
            except RuntimeError:  # changed by another thread while copied (free-threaded)
                continue

    def get_allocated_bytes(self) -> int:
        """Bytes currently allocated through this adaptor (sizes as requested)."""
        return sum(self._snapshot().values())

    def get_outstanding_allocations(self) -> dict[int, int]:
        """``{pointer: nbytes}`` of every live allocation."""
        return self._snapshot()

    def get_outstanding_allocations_str(self) -> str:
        """One line per live allocation by address, as RMM prints them (``0x7f...: 1024 B``, then
        ``: callstack:`` and the stack when captured)."""
        stacks = dict(self._stacks)
        return "".join(
            f"{ptr:#x}: {nbytes} B"
            + (" : callstack:\n" + stacks[ptr].rstrip("\n") if ptr in stacks else "")
            + "\n"
            for ptr, nbytes in sorted(self._snapshot().items())
        )

    def log_outstanding_allocations(self) -> None:
        """Write :meth:`get_outstanding_allocations_str` to the debug logger at debug level."""
        log = logger.get_logger()
        if log.isEnabledFor(logger.DEBUG):
            log.debug("Outstanding Allocations: %s", self.get_outstanding_allocations_str())
