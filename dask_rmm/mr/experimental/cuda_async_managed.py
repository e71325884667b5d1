"""``CudaAsyncManagedMemoryResource``: stream-ordered allocation of managed (unified) memory
from the device's default managed memory pool (CUDA 13). Only the base resource; the pool's
own attributes are left as CUDA made them."""

from __future__ import annotations

from dask_rmm import _cuda
from dask_rmm.mr.cuda import CudaAsyncViewMemoryResource

__all__ = ["CudaAsyncManagedMemoryResource"]

_MIN_CUDA_VERSION = 13000


def _unsupported_reason(device: int) -> str | None:
    """Why this device cannot allocate from a managed memory pool, or None when it can."""
    runtime = _cuda.runtime_get_version()
    driver = _cuda.driver_get_version()
    if min(runtime, driver) < _MIN_CUDA_VERSION:
        return f"needs CUDA 13.0 or newer (runtime {runtime}, driver {driver})"
    if not _cuda.get_device_attribute("ConcurrentManagedAccess", device):
        return f"device {device} has no concurrent managed access (e.g. WSL2)"
    return None


class CudaAsyncManagedMemoryResource(CudaAsyncViewMemoryResource):
    """Managed memory from ``cudaMallocFromPoolAsync`` on the current device's default managed
    memory pool (the device's, never destroyed here), freed with ``cudaFreeAsync``; readable
    from host and device. A :class:`CUDAError` (RuntimeError) where the CUDA runtime or driver
    is older than 13.0 or the device has no concurrent managed access says which.

    Examples
    --------
    Needs a CUDA device (the doctest run skips these lines):

    >>> from dask_rmm.mr import set_current_device_resource
    >>> mr = CudaAsyncManagedMemoryResource()  # doctest: +SKIP
    >>> set_current_device_resource(mr)  # doctest: +SKIP
    >>> mr.pool_handle() != 0  # doctest: +SKIP
    True
    """

    def __init__(self):
        _cuda.require_cuda("CudaAsyncManagedMemoryResource")
        device = _cuda.get_device()
        reason = _unsupported_reason(device)
        if reason is not None:
            raise _cuda.CUDAError(
                "cudaErrorNotSupported",
                "CudaAsyncManagedMemoryResource",
                f"CudaAsyncManagedMemoryResource {reason}",
            )
        super().__init__(_cuda.device_get_default_managed_mem_pool(device))
