"""``FailureCallbackResourceAdaptor``: when the upstream runs out of memory, asks a callback
whether to try again (the callback can free caches, spill, or wait first)."""

from __future__ import annotations

from collections.abc import Callable

from dask_rmm.mr.base import DeviceMemoryResource, UpstreamResourceAdaptor
from dask_rmm.stream import DEFAULT_STREAM, Stream

__all__ = ["FailureCallbackResourceAdaptor"]


class FailureCallbackResourceAdaptor(UpstreamResourceAdaptor):
    """Calls ``callback(nbytes) -> bool`` each time the upstream raises ``MemoryError``: true
    retries the allocation, false re-raises.

    Examples
    --------
    >>> from dask_rmm.mr import FailureCallbackResourceAdaptor, SystemMemoryResource
    >>> calls = []
    >>> def retry_once(nbytes):
    ...     calls.append(nbytes)
    ...     return len(calls) < 2
    >>> mr = FailureCallbackResourceAdaptor(SystemMemoryResource(), retry_once)
    """

    def __init__(self, upstream_mr: DeviceMemoryResource, callback: Callable[[int], bool]):
        super().__init__(upstream_mr)
        if not callable(callback):
            raise TypeError(
                f"callback must be callable as callback(nbytes) -> bool, got {callback!r}"
            )
        self._callback = callback

    @property
    def callback(self) -> Callable[[int], bool]:
        return self._callback

    def allocate(self, nbytes: int, stream: Stream = DEFAULT_STREAM) -> int:
        while True:
            try:
                return self._upstream_allocate(nbytes, stream)
            except MemoryError:
                if not self._callback(nbytes):
                    raise
