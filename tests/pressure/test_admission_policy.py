"""Memory admission's policy (no cluster): which prefix a task's peak is learned under, the
bounded table of learned peaks, the annotation, and device against host out-of-memory."""

from __future__ import annotations

import pytest

from dask_rmm.allocators.arbitration import is_device_out_of_memory, runs_again
from dask_rmm.mr.base import CUDAAllocationError, OutOfMemoryError
from dask_rmm.pressure.admission import PeakTable, annotated_peak, task_prefix

MiB = 1 << 20


@pytest.mark.parametrize(
    "key, prefix",
    [
        (("matmul-3f2a9c8d1e0b4a6f8d7c", 4, 2), "matmul"),  # key_split's grouping
        ("job_0", "job"),
        ("job_17", "job"),
        ("part.3", "part"),
        ("x_9f8e7d6c5b4a", "x"),
        ("conv2d", "conv2d"),
        ("12345678", "12345678"),  # nothing but a tail: the name stays
    ],
)
def test_custom_keys_with_numeric_or_hashed_tails_share_their_prefix(key, prefix):
    assert task_prefix(key) == prefix


def test_the_expected_peak_is_the_largest_of_the_last_peaks():
    table = PeakTable(history=3)
    for n in (5, 1, 2, 3):
        table.observe("p", n)
    assert table.expected("p") == 3  # 5 is older than the last 3
    assert table.expected("never") is None


def test_the_table_is_bounded_and_forgets_the_least_recently_used():
    table = PeakTable(size=100)
    for i in range(5000):
        table.observe(f"prefix{i}", i)
    assert len(table) == 100 and table.expected("prefix0") is None
    table.expected("prefix4900")  # used: kept over the others
    table.observe("new", 1)
    assert table.expected("prefix4900") == 4900 and table.expected("prefix4901") is None


def test_what_a_heartbeat_reads_does_not_grow_with_the_prefixes_ever_seen():
    table = PeakTable(size=64)
    for i in range(10_000):
        table.observe(f"p{i}x", i)
    assert len(table) == 64 and len(table.top(5)) == 5
    assert table.top(2) == [("p9999x", 9999, 1), ("p9998x", 9998, 1)]


def test_the_annotation_is_a_size_or_an_error_naming_it():
    assert annotated_peak({"gpu_memory": "2MiB"}) == 2 * MiB
    assert annotated_peak({"gpu_memory": 5}) == 5 and annotated_peak(None) is None
    with pytest.raises(ValueError, match="gpu_memory='lots'"):
        annotated_peak({"gpu_memory": "lots"})
    with pytest.raises(ValueError, match="negative"):
        annotated_peak({"gpu_memory": -1})


class CudaAPIError(Exception):
    __module__ = "numba.cuda.cudadrv.driver"

    def __init__(self, code: int, msg: str):
        super().__init__(code, msg)
        self.code = code


def _named(name: str, module: str, base: type = Exception) -> BaseException:
    return type(name, (base,), {"__module__": module})("out of memory")


def _cupy_cublas_alloc_failed() -> BaseException:
    error = type("CUBLASError", (RuntimeError,), {"__module__": "cupy_backends.cuda.libs.cublas"})
    return error("CUBLAS_STATUS_ALLOC_FAILED")


@pytest.mark.parametrize(
    "error, device",
    [
        (OutOfMemoryError("pool out of memory"), True),
        (_named("OutOfMemoryError", "cupy.cuda.memory", MemoryError), True),
        (_named("OutOfMemoryError", "torch", RuntimeError), True),
        (CudaAPIError(2, "CUDA_ERROR_OUT_OF_MEMORY"), True),
        (RuntimeError("CUDA error: CUBLAS_STATUS_ALLOC_FAILED when calling `cublasCreate(handle)`"), True),
        (RuntimeError("CUDA error: CUBLAS_STATUS_EXECUTION_FAILED when calling `cublasSgemm`"), False),
        (_cupy_cublas_alloc_failed(), True),
        (MemoryError("std::bad_alloc: out_of_memory: CUDA error"), True),  # compiled RMM's
        (MemoryError("Unable to allocate 8.00 GiB for an array"), False),  # NumPy's
        (_named("_ArrayMemoryError", "numpy.core._exceptions", MemoryError), False),
        (_named("OutOfMemoryError", "mylib", MemoryError), False),  # not a device library
        (CudaAPIError(700, "CUDA_ERROR_ILLEGAL_ADDRESS"), False),
        (CUDAAllocationError("cudaErrorIllegalAddress", "cudaMalloc"), False),
        (ValueError(), False),
    ],
    ids=[
        "dask-rmm", "cupy", "torch", "numba", "torch-cublas-alloc", "torch-cublas-other",
        "cupy-cublas-alloc", "rmm", "numpy-text", "numpy-type", "other-lib",
        "numba-other-code", "CUDAAllocationError", "ValueError",
    ],
)  # fmt: skip
def test_only_a_device_out_of_memory_is_one(error, device):
    assert is_device_out_of_memory(error) is device


@pytest.mark.parametrize(
    "error, again",
    [
        (_named("OutOfMemoryError", "torch", RuntimeError), True),
        (RuntimeError("CUDA error: CUBLAS_STATUS_ALLOC_FAILED when calling `cublasCreate(handle)`"), True),
        (RuntimeError("cuDNN error: CUDNN_STATUS_EXECUTION_FAILED"), False),
        (_cupy_cublas_alloc_failed(), False),  # CuPy: not re-run (only PyTorch's tasks are)
        (OutOfMemoryError("pool out of memory"), False),  # made room and retried in place
        (MemoryError("std::bad_alloc: out_of_memory: CUDA error"), False),
    ],
    ids=["torch-oom", "torch-cublas-alloc", "torch-cudnn-other", "cupy-cublas", "dask-rmm", "rmm"],
)  # fmt: skip
def test_only_pytorchs_device_allocation_failures_run_again(error, again):
    assert runs_again(error) is again
