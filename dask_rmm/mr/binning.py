"""BinningMemoryResource: routes each request to the smallest bin that fits, larger ones upstream."""

from __future__ import annotations

import threading
from bisect import bisect_left
from collections.abc import Callable

from dask_rmm.mr.base import (
    DeviceMemoryResource,
    ReservedMemoryInfo,
    UpstreamResourceAdaptor,
    check_nbytes,
)
from dask_rmm.mr.fixed_size import FixedSizeMemoryResource
from dask_rmm.sizes import align_up
from dask_rmm.stream import DEFAULT_STREAM, Stream

__all__ = ["BinningMemoryResource"]


class BinningMemoryResource(UpstreamResourceAdaptor):
    """Size-binned allocation, as RMM's ``BinningMemoryResource``.

    A request (and its free) goes to the smallest bin that fits it, a larger one upstream.

    Parameters
    ----------
    upstream_mr : DeviceMemoryResource
        Serves requests larger than the largest bin, and backs the default bins.
    min_size_exponent, max_size_exponent : int
        When both are >= 0, a :class:`FixedSizeMemoryResource` bin of ``2**i`` bytes is added
        for every ``i`` from ``min_size_exponent`` to ``max_size_exponent``. -1 (the default)
        adds none; use :meth:`add_bin`.

    Examples
    --------
    >>> from dask_rmm.mr import BinningMemoryResource, SystemMemoryResource
    >>> mr = BinningMemoryResource(SystemMemoryResource(), 10, 16)  # 1 KiB ... 64 KiB bins
    >>> [b.block_size for b in mr.bin_mrs][:2]
    [1024, 2048]
    >>> mr.deallocate(mr.allocate(3000), 3000)
    """

    def __init__(
        self,
        upstream_mr: DeviceMemoryResource,
        min_size_exponent: int = -1,
        max_size_exponent: int = -1,
    ):
        super().__init__(upstream_mr)
        self._lock = threading.Lock()
        # (sorted sizes, resources): swapped as one tuple, read without the lock.
        self._table: tuple[tuple[int, ...], tuple[DeviceMemoryResource, ...]] = ((), ())
        # The hot path's (sizes, bound allocate and deallocate methods ending with upstream's).
        self._routes: tuple[
            tuple[int, ...],
            tuple[Callable[[int, Stream], int], ...],
            tuple[Callable[[int, int, Stream], None], ...],
        ] = ((), (upstream_mr.allocate,), (upstream_mr.deallocate,))
        if min_size_exponent >= 0 and max_size_exponent >= 0:
            if min_size_exponent > max_size_exponent:
                raise ValueError(
                    f"min_size_exponent ({min_size_exponent}) > max_size_exponent "
                    f"({max_size_exponent})"
                )
            for i in range(min_size_exponent, max_size_exponent + 1):
                self.add_bin(1 << i)

    def add_bin(self, allocation_size: int, bin_resource: DeviceMemoryResource | None = None):
        """Serve requests up to ``allocation_size`` (above the next smaller bin) from
        ``bin_resource`` (default: a :class:`FixedSizeMemoryResource` of that block size over
        the upstream). As in RMM, a bin that already exists for this size is kept."""
        allocation_size = check_nbytes(allocation_size, "allocation_size")
        if allocation_size == 0:
            raise ValueError("allocation_size must be positive")
        if bin_resource is not None and not isinstance(bin_resource, DeviceMemoryResource):
            raise TypeError(
                f"bin_resource must be a DeviceMemoryResource, got {type(bin_resource).__name__}"
            )
        with self._lock:
            sizes, mrs = self._table
            if allocation_size in sizes:
                return
            if bin_resource is None:
                bin_resource = FixedSizeMemoryResource(
                    self.upstream_mr, block_size=align_up(allocation_size)
                )
            i = bisect_left(sizes, allocation_size)
            sizes = sizes[:i] + (allocation_size,) + sizes[i:]
            mrs = mrs[:i] + (bin_resource,) + mrs[i:]
            self._table = (sizes, mrs)
            targets = (*mrs, self.upstream_mr)
            self._routes = (
                sizes,
                tuple(m.allocate for m in targets),
                tuple(m.deallocate for m in targets),
            )

    @property
    def bin_mrs(self) -> list[DeviceMemoryResource]:
        """The bin resources, smallest allocation size first."""
        return list(self._table[1])

    @property
    def bin_sizes(self) -> list[int]:
        """The bins' allocation sizes, ascending."""
        return list(self._table[0])

    def allocate(self, nbytes: int, stream: Stream = DEFAULT_STREAM) -> int:
        if type(nbytes) is not int or nbytes <= 0:
            nbytes = check_nbytes(nbytes)
            if nbytes == 0:
                return 0
        sizes, allocs, _ = self._routes
        return allocs[bisect_left(sizes, nbytes)](nbytes, stream)

    def deallocate(self, ptr: int, nbytes: int, stream: Stream = DEFAULT_STREAM) -> None:
        if type(nbytes) is not int or nbytes <= 0:
            if ptr == 0 and nbytes == 0:
                return
            nbytes = check_nbytes(nbytes)
        sizes, _, deallocs = self._routes
        deallocs[bisect_left(sizes, nbytes)](ptr, nbytes, stream)

    def reserved_memory_info(self) -> ReservedMemoryInfo | None:
        """The bins' reservations added up (requests served upstream are not reserved)."""
        infos = [i for i in (m.reserved_memory_info() for m in self._table[1]) if i is not None]
        if not infos:
            return None
        return ReservedMemoryInfo(
            sum(i.reserved_bytes for i in infos),
            sum(i.free_bytes for i in infos),
            max(i.largest_free_block for i in infos),
        )

    def _repr_fields(self) -> str:
        return f"bins={self.bin_sizes}"
