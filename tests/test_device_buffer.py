"""DeviceBuffer and the pointer copy helpers: bytes round-trip on host memory here, and on
device memory on default and non-default streams on a GPU."""

from __future__ import annotations

import copy
import gc
import pickle

import numpy as np
import pytest

from dask_rmm import _cuda, mr
from dask_rmm.device_buffer import (
    DeviceBuffer,
    copy_device_to_ptr,
    copy_host_to_ptr,
    copy_ptr_to_host,
    to_device,
)
from dask_rmm.stream import DEFAULT_STREAM, PER_THREAD_DEFAULT_STREAM, Stream

HAS_GPU = _cuda.is_available()
PAYLOAD = bytes(range(256)) * 40 + b"tail"


def _streams():
    out = [pytest.param("default", id="default-stream"), pytest.param("ptds", id="per-thread")]
    out.append(pytest.param("new", id="new-stream", marks=pytest.mark.gpu))
    return out


def _make_stream(kind):
    return {"default": DEFAULT_STREAM, "ptds": PER_THREAD_DEFAULT_STREAM}.get(kind) or Stream()


def _resources():
    out = [pytest.param("system", id="system")]
    for name in ("cuda", "managed", "async", "pinned"):
        out.append(pytest.param(name, id=name, marks=pytest.mark.gpu))
    return out


@pytest.fixture(params=_resources())
def resource(request):
    from conftest import make_base_resource

    return make_base_resource(request.param)


@pytest.fixture(params=_streams())
def stream(request):
    return _make_stream(request.param)


def test_roundtrip(resource, stream):
    buf = to_device(PAYLOAD, stream, resource)
    assert (buf.size, buf.nbytes, len(buf), buf.capacity(), buf.__sizeof__()) == (len(PAYLOAD),) * 5
    assert buf.ptr % 256 == 0
    stream.synchronize()
    assert buf.tobytes(stream) == PAYLOAD
    host = buf.copy_to_host(stream=stream)
    stream.synchronize()
    assert isinstance(host, np.ndarray) and host.dtype == np.uint8 and host.tobytes() == PAYLOAD
    out = bytearray(len(PAYLOAD) + 10)
    assert buf.copy_to_host(out, stream) is out
    stream.synchronize()
    assert bytes(out[: len(PAYLOAD)]) == PAYLOAD and bytes(out[len(PAYLOAD) :]) == b"\0" * 10


def test_copy_from_host_and_device(resource, stream):
    buf = DeviceBuffer(size=10, stream=stream, mr=resource)
    buf.copy_from_host(b"abcdef", stream)
    buf.copy_from_host(np.array([1, 2], dtype=np.uint8)[:1], stream)
    stream.synchronize()
    assert buf.tobytes()[:6] == b"\x01bcdef"
    other = DeviceBuffer(size=12, stream=stream, mr=resource)
    other.copy_from_device(buf, stream)
    stream.synchronize()
    assert other.tobytes()[:10] == buf.tobytes()
    with pytest.raises(ValueError, match="too large"):
        buf.copy_from_device(other)
    with pytest.raises(ValueError, match="__cuda_array_interface__"):
        buf.copy_from_device(b"abc")


def test_copy_is_deep(resource):
    buf = to_device(b"hello", mr=resource)
    dup = buf.copy()
    assert dup.ptr != buf.ptr and dup.mr is buf.mr and dup.stream is buf.stream
    buf.copy_from_host(b"J")
    assert dup.tobytes() == b"hello" and buf.tobytes() == b"Jello"
    assert copy.copy(buf).tobytes() == b"Jello"


def test_pointer_constructor_copies(resource):
    src = to_device(b"0123456789", mr=resource)
    buf = DeviceBuffer(ptr=src.ptr, size=4, mr=resource)
    assert buf.tobytes() == b"0123"
    host = np.frombuffer(b"host bytes", dtype=np.uint8)
    assert DeviceBuffer(ptr=host.ctypes.data, size=4, mr=resource).tobytes() == b"host"


def test_resize_and_reserve_keep_contents(resource, stream):
    buf = to_device(b"abcdefgh", stream, resource)
    buf.resize(4, stream)
    assert (buf.size, buf.capacity()) == (4, 8)
    buf.resize(8, stream)  # within capacity: the old bytes are still there
    stream.synchronize()
    assert buf.tobytes() == b"abcdefgh"
    buf.reserve(1000, stream)
    assert (buf.size, buf.capacity()) == (8, 1000)
    buf.resize(2000, stream)
    assert (buf.size, buf.capacity()) == (2000, 2000)
    stream.synchronize()
    assert buf.tobytes()[:8] == b"abcdefgh"
    buf.reserve(10, stream)  # never shrinks
    assert buf.capacity() == 2000
    assert buf.stream is stream
    buf.resize(0)
    assert buf.tobytes() == b""


def test_frees_on_delete_with_its_resource(resource):
    bufs = [DeviceBuffer(size=n, mr=resource) for n in (1, 300, 5000)]
    assert resource.live_allocations == 3
    bufs[1].reserve(9000)
    assert resource.live_allocations == 3
    del bufs
    gc.collect()
    assert resource.live_allocations == 0


def test_buffer_keeps_resource_and_stream_alive():
    r = mr.SystemMemoryResource()
    mr.set_current_device_resource(r)
    buf = DeviceBuffer(size=100)
    assert buf.mr is r
    mr.set_current_device_resource(mr.SystemMemoryResource())
    del r
    buf.copy_from_host(b"still valid")
    assert buf.tobytes()[:11] == b"still valid"
    s = Stream(0x1234)
    b2 = DeviceBuffer(size=0, stream=s, mr=buf.mr)
    assert b2.stream is s


def test_del_never_raises(caplog):
    r = mr.SystemMemoryResource()
    buf = DeviceBuffer(size=256, mr=r)
    r.deallocate(buf.ptr, 256)  # someone freed it behind the buffer's back
    with caplog.at_level("WARNING", logger="dask_rmm.device_buffer"):
        del buf
        gc.collect()
    assert "freeing" in caplog.text


_SHUTDOWN_SCRIPT = """
import collections
import dask_rmm
from dask_rmm import mr
from dask_rmm.mr.attribution_adaptor import AttributionResourceAdaptor
from dask_rmm.plugin import current_task_key, task_prefix
from dask_rmm.stream import Stream

pool = mr.PoolMemoryResource(mr.SystemMemoryResource(), initial_pool_size=32 << 20)
top = AttributionResourceAdaptor(
    mr.StatisticsResourceAdaptor(pool), current_task_key, owner_name=task_prefix
)
mr.set_current_device_resource(top)
bufs = [dask_rmm.DeviceBuffer(size=n) for n in (100, 5000, 1 << 20)]
moved = dask_rmm.DeviceBuffer(size=4096, stream=Stream._from_handle(0x1234))
moved.stream = Stream._from_handle(0x5678)
# Held by a module imported before dask_rmm: finalized after dask_rmm's globals became None.
collections._held_buffers = [*bufs, moved]
"""


def test_buffers_alive_at_interpreter_shutdown_exit_silently():
    # A worker exiting with DeviceBuffers still in its data used to print
    # "Exception ignored in DeviceBuffer.__del__ ... TypeError" from cleared module globals.
    import subprocess
    import sys

    out = subprocess.run(
        [sys.executable, "-c", _SHUTDOWN_SCRIPT], capture_output=True, text=True, timeout=120
    )
    assert out.returncode == 0, out.stderr
    assert "Exception ignored" not in out.stderr and "Error" not in out.stderr, out.stderr


def test_pickle_copies_bytes():
    mr.set_current_device_resource(mr.SystemMemoryResource())
    buf = to_device(PAYLOAD)
    again = pickle.loads(pickle.dumps(buf))
    assert again.tobytes() == PAYLOAD and again.ptr != buf.ptr


def test_cuda_array_interface():
    r = mr.SystemMemoryResource()
    buf = to_device(b"abc", mr=r)
    cai = buf.__cuda_array_interface__
    assert cai["version"] == 3 and cai["data"] == (buf.ptr, False)
    assert cai["shape"] == (3,) and cai["typestr"] == "|u1" and cai["strides"] is None
    assert cai["stream"] == 1  # handle 0 is reserved by the interface: the legacy stream
    ptds = to_device(b"abc", PER_THREAD_DEFAULT_STREAM, r)
    assert ptds.__cuda_array_interface__["stream"] == 2
    empty = DeviceBuffer(mr=r)
    assert empty.__cuda_array_interface__["data"] == (0, False) and empty.ptr == 0


def test_module_copy_helpers(resource, stream):
    buf = DeviceBuffer(size=16, stream=stream, mr=resource)
    copy_host_to_ptr(b"0123456789abcdef", buf.ptr, stream)
    out = bytearray(16)
    copy_ptr_to_host(buf.ptr, out, stream)
    stream.synchronize()
    assert out == b"0123456789abcdef"
    other = DeviceBuffer(size=16, stream=stream, mr=resource)
    copy_device_to_ptr(buf.ptr, other.ptr, 8, stream)
    stream.synchronize()
    assert other.tobytes()[:8] == b"01234567"


def test_staticmethod_to_device():
    r = mr.SystemMemoryResource()
    assert DeviceBuffer.to_device(b"xy", mr=r).tobytes() == b"xy"
    assert to_device(bytearray(b""), mr=r).size == 0


@pytest.mark.parametrize(
    "kwargs, exc",
    [
        ({"size": -1}, ValueError),
        ({"size": 1.5}, TypeError),
        ({"size": True}, TypeError),
        ({"ptr": -5, "size": 4}, ValueError),
        ({"ptr": "0x10", "size": 4}, TypeError),
        ({"size": 4, "mr": "system"}, TypeError),
        ({"size": 4, "stream": "s"}, TypeError),
    ],
)
def test_bad_constructor_arguments(kwargs, exc):
    r = mr.SystemMemoryResource()
    kwargs.setdefault("mr", r)
    with pytest.raises(exc):
        DeviceBuffer(**kwargs)
    assert r.live_allocations == 0


def test_bad_host_buffers():
    r = mr.SystemMemoryResource()
    buf = to_device(b"abcd", mr=r)
    with pytest.raises(ValueError, match="too small"):
        buf.copy_to_host(bytearray(3))
    with pytest.raises(ValueError, match="read-only"):
        buf.copy_to_host(b"xxxx")
    with pytest.raises(ValueError, match="too large"):
        buf.copy_from_host(b"abcde")
    with pytest.raises(TypeError, match="bytes-like"):
        buf.copy_from_host(None)
    with pytest.raises(TypeError, match="bytes-like"):
        to_device("a str")
    with pytest.raises(ValueError, match="contiguous"):
        buf.copy_from_host(np.zeros(8, dtype=np.uint8)[::2])
    with pytest.raises(ValueError, match="C-contiguous"):  # as RMM's unsigned char[::1]
        buf.copy_from_host(np.zeros((2, 2), dtype=np.uint8).T)
    with pytest.raises(ValueError, match="1-D"):
        buf.copy_from_device(_FakeCAI((2, 2)))
    with pytest.raises(TypeError, match="bytes-like"):
        copy_ptr_to_host(buf.ptr, None)
    assert buf.tobytes() == b"abcd"


class _FakeCAI:
    def __init__(self, shape):
        self.__cuda_array_interface__ = {
            "shape": shape,
            "typestr": "|u1",
            "data": (0, False),
            "version": 3,
        }


@pytest.mark.skipif(HAS_GPU, reason="checks the no-GPU path")
def test_no_gpu_default_resource_is_clear_error():
    with pytest.raises(_cuda.CUDAUnavailableError, match="SystemMemoryResource"):
        DeviceBuffer(size=10)


@pytest.mark.gpu
def test_device_buffer_on_default_cuda_resource():
    buf = to_device(PAYLOAD)
    assert type(buf.mr) is mr.CudaMemoryResource
    assert _cuda.pointer_attributes(buf.ptr).type == "device"
    assert buf.tobytes() == PAYLOAD
    assert pickle.loads(pickle.dumps(buf)).tobytes() == PAYLOAD


@pytest.mark.gpu
def test_prefetch_managed():
    buf = to_device(PAYLOAD, mr=mr.ManagedMemoryResource())
    buf.prefetch()
    buf.prefetch(_cuda.CPU_DEVICE_ID)
    buf.stream.synchronize()
    assert buf.tobytes() == PAYLOAD
    to_device(b"abc", mr=mr.CudaMemoryResource()).prefetch()  # not managed: a no-op
