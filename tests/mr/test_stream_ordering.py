"""Stream ordering of DeviceBuffer copies on every CUDA base resource.

The defect: with ``CudaAsyncMemoryResource`` current and ``s = Stream()``,
``DeviceBuffer.to_device(h, stream=s).copy_to_host()`` returned zeros for most sizes, because
``Stream()`` made a non-blocking stream, so the copy back on the legacy default stream did not
wait for the copy in on ``s``. These tests copy in on one stream and read right after on
another (the default stream, another stream, CuPy), over many sizes and resources.
"""

from __future__ import annotations

import numpy as np
import pytest

from dask_rmm import mr
from dask_rmm.device_buffer import DeviceBuffer
from dask_rmm.stream import (
    DEFAULT_STREAM,
    PER_THREAD_DEFAULT_STREAM,
    CudaStreamFlags,
    Stream,
)

pytestmark = pytest.mark.gpu

SIZES = [1, 7, 255, 256, 257, 4097, 10**5, 10**6, 10**7, 10**8]
RESOURCES = ["cuda", "pool", "async", "managed", "async_managed"]
STREAM_KINDS = ["sync_default", "non_blocking", "cupy_non_blocking", "cupy_blocking", "ptds"]


def _resource(kind: str):
    if kind == "cuda":
        return mr.CudaMemoryResource()
    if kind == "pool":
        return mr.PoolMemoryResource(mr.CudaMemoryResource(), initial_pool_size=1 << 20)
    if kind == "async":
        return mr.CudaAsyncMemoryResource()
    if kind == "managed":
        return mr.ManagedMemoryResource()
    from dask_rmm._cuda import CUDAError
    from dask_rmm.mr.experimental import CudaAsyncManagedMemoryResource

    try:
        return CudaAsyncManagedMemoryResource()
    except CUDAError as e:
        pytest.skip(str(e))


def _stream(kind: str):
    """A Stream and the object keeping its handle alive."""
    if kind == "sync_default":
        s = Stream()
        return s, s
    if kind == "non_blocking":
        s = Stream(flags=CudaStreamFlags.NON_BLOCKING)
        return s, s
    if kind == "ptds":
        return PER_THREAD_DEFAULT_STREAM, None
    cupy = pytest.importorskip("cupy")
    cs = cupy.cuda.Stream(non_blocking=kind == "cupy_non_blocking")
    return Stream(cs), cs


@pytest.fixture(params=RESOURCES)
def resource(request):
    previous = mr.get_current_device_resource()
    res = _resource(request.param)
    mr.set_current_device_resource(res)
    yield res
    mr.set_current_device_resource(previous)


@pytest.mark.parametrize("stream_kind", STREAM_KINDS)
def test_copy_in_on_stream_read_back_on_default_stream(resource, stream_kind):
    s, _keep = _stream(stream_kind)
    wrong = []
    for i, n in enumerate(SIZES):
        value = 1 + i % 250
        dbuf = DeviceBuffer.to_device(np.full(n, value, "u1"), stream=s)
        result = np.asarray(dbuf.copy_to_host())
        if result.shape != (n,) or not (result == value).all():
            wrong.append(n)
        del dbuf
    assert not wrong, f"sizes read back wrong on {stream_kind}: {wrong}"


@pytest.mark.parametrize("stream_kind", STREAM_KINDS)
def test_cupy_reads_right_after_copy_in(resource, stream_kind):
    cupy = pytest.importorskip("cupy")
    s, _keep = _stream(stream_kind)
    for i, n in enumerate(SIZES[:-1]):
        value = 3 + i % 250
        dbuf = DeviceBuffer.to_device(np.full(n, value, "u1"), stream=s)
        # CuPy consumes the buffer's __cuda_array_interface__ (which names the buffer's stream)
        arr = cupy.asarray(dbuf)
        assert int((arr == value).sum()) == n, f"{n} bytes on {stream_kind}"
        del arr, dbuf


def test_many_streams_copy_in_then_read_in_another_order(resource):
    streams = [Stream(flags=CudaStreamFlags(i % 2)) for i in range(16)]
    sizes = [10**k + k for k in range(1, 8)]
    buffers = []
    for i, s in enumerate(streams):
        n = sizes[i % len(sizes)]
        buffers.append((n, 1 + i, DeviceBuffer.to_device(np.full(n, 1 + i, "u1"), stream=s)))
    other = Stream(flags=CudaStreamFlags.NON_BLOCKING)
    for n, value, dbuf in reversed(buffers):
        out = np.empty(n, "u1")
        # a copy on a stream other than the buffer's: ordered after the copy in, then read
        dbuf.copy_to_host(out, stream=other)
        other.synchronize()
        assert (out == value).all(), f"{n} bytes, value {value}"
        assert (np.asarray(dbuf.copy_to_host()) == value).all()


def test_reused_memory_is_ordered_after_the_previous_owner(resource):
    # Free on one stream, allocate the same size on another at once: a resource that hands the
    # block out again must order the new owner's copy after the old owner's work.
    a = Stream(flags=CudaStreamFlags.NON_BLOCKING)
    b = Stream(flags=CudaStreamFlags.NON_BLOCKING)
    n = 10**7
    for round_ in range(8):
        first = DeviceBuffer.to_device(np.full(n, 10 + round_, "u1"), stream=a)
        del first
        second = DeviceBuffer.to_device(np.full(n, 100 + round_, "u1"), stream=b)
        assert (np.asarray(second.copy_to_host()) == 100 + round_).all()


def test_a_buffer_copied_to_a_new_stream_reads_back_its_bytes_on_the_async_resource():
    # The reported defect, as reported: the async resource current, s = Stream(), to_device on s, read back.
    previous = mr.get_current_device_resource()
    mr.set_current_device_resource(mr.CudaAsyncMemoryResource())
    try:
        s = Stream()
        for n in [1, 10, 100, 1000, 10**4, 10**5, 10**6, 10**7, 10**8]:
            dbuf = DeviceBuffer.to_device(np.full(n, 5, "u1"), stream=s)
            np.testing.assert_array_equal(np.asarray(dbuf.copy_to_host()), np.full(n, 5, "u1"))
    finally:
        mr.set_current_device_resource(previous)


def test_copy_from_host_after_work_on_buffer_stream(resource):
    s = Stream(flags=CudaStreamFlags.NON_BLOCKING)
    n = 10**7
    dbuf = DeviceBuffer.to_device(np.full(n, 1, "u1"), stream=s)
    # a write on the default stream must land after the copy in on s, not under it
    dbuf.copy_from_host(np.full(n, 2, "u1"), stream=DEFAULT_STREAM)
    assert (np.asarray(dbuf.copy_to_host()) == 2).all()
