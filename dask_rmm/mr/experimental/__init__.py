"""Experimental memory resources, as RMM's ``rmm.mr.experimental``: they may change or go."""

from __future__ import annotations

from dask_rmm.mr.experimental.cuda_async_managed import CudaAsyncManagedMemoryResource

__all__ = ["CudaAsyncManagedMemoryResource"]
