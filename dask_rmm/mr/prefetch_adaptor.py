"""``PrefetchResourceAdaptor``: prefetches each new allocation to the resource's device on the
allocating stream (useful over managed memory). Nothing else changes."""

from __future__ import annotations

from dask_rmm import _cuda
from dask_rmm.mr.base import DeviceMemoryResource, UpstreamResourceAdaptor
from dask_rmm.stream import DEFAULT_STREAM, Stream

__all__ = ["PrefetchResourceAdaptor"]


class PrefetchResourceAdaptor(UpstreamResourceAdaptor):
    """Prefetches every allocation (usually of a ``ManagedMemoryResource``) to ``device_id``
    with ``cudaMemPrefetchAsync``; as in RMM, memory that cannot be prefetched
    (``cudaErrorInvalidValue``: plain device memory) is returned as is; without CUDA, as is too."""

    def __init__(self, upstream_mr: DeviceMemoryResource):
        super().__init__(upstream_mr)
        self.prefetch_count = 0

    def allocate(self, nbytes: int, stream: Stream = DEFAULT_STREAM) -> int:
        ptr = self._upstream_allocate(nbytes, stream)
        if nbytes and ptr and _cuda.is_available():
            try:
                _cuda.mem_prefetch_async(ptr, nbytes, self.device_id, stream.handle)
            except _cuda.CUDAError as e:
                if e.error_name != "cudaErrorInvalidValue":
                    self._upstream_deallocate(ptr, nbytes, stream)
                    raise
            else:
                self.prefetch_count += 1
        return ptr
