"""dask_rmm._cuda: checked runtime calls, typed errors, and the one clear error without a GPU."""

from __future__ import annotations

import ctypes
import pickle
import subprocess
import sys

import pytest

from dask_rmm import _cuda
from dask_rmm._cuda import CUDAError, CUDAUnavailableError, check

HAS_GPU = _cuda.is_available()
no_gpu_only = pytest.mark.skipif(HAS_GPU, reason="checks the no-GPU path; this host has a GPU")


def test_import_touches_no_driver():
    code = (
        "import sys, dask_rmm, dask_rmm._cuda, dask_rmm.mr, dask_rmm.stream\n"
        "assert 'cuda.bindings.runtime' not in sys.modules, 'cuda-python imported at import time'\n"
        "assert 'distributed' not in sys.modules\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True)


def test_check_unpacks_values():
    assert check((0,), "f") is None
    assert check((0, 5), "f") == 5
    assert check((0, 1, 2), "f") == (1, 2)


def test_generated_calls_have_their_names_parameters_and_pickle_by_reference():
    import inspect

    assert str(inspect.signature(_cuda.mem_pool_trim_to)) == "(pool, min_bytes_to_keep, /)"
    assert _cuda.free.__doc__.startswith("``cudaFree``")
    for name in ("get_device", "free", "memset_async", "mem_pool_trim_to", "stream_wait_event"):
        function = getattr(_cuda, name)
        assert function.__qualname__ == name and pickle.loads(pickle.dumps(function)) is function


def test_check_raises_named_error():
    from cuda.bindings import runtime

    with pytest.raises(CUDAError) as info:
        check((runtime.cudaError_t.cudaErrorInvalidValue, None), "cudaSomething")
    if HAS_GPU:
        assert type(info.value) is CUDAError
        assert info.value.error_name == "cudaErrorInvalidValue"
        assert info.value.call == "cudaSomething"
        assert "cudaErrorInvalidValue" in str(info.value)
    else:
        assert isinstance(info.value, CUDAUnavailableError)


def test_cuda_error_pickles():
    for cls in (CUDAError, CUDAUnavailableError):
        e = cls("cudaErrorMemoryAllocation", "cudaMalloc", "custom message")
        e2 = pickle.loads(pickle.dumps(e))
        assert type(e2) is cls
        assert (e2.error_name, e2.call, str(e2)) == (e.error_name, e.call, "custom message")


def test_bad_arguments_refused_before_cuda():
    with pytest.raises(ValueError, match="NoSuchAttribute"):
        _cuda.get_device_attribute("NoSuchAttribute")
    with pytest.raises(TypeError, match="device"):
        _cuda.device_total_memory("0")
    with pytest.raises(ValueError, match="Bogus"):
        _cuda.mem_pool_get_attribute(0, "Bogus")


def test_a_device_attribute_is_also_taken_as_rmms_enum():
    from cuda.bindings import runtime

    attr = runtime.cudaDeviceAttr.cudaDevAttrManagedMemory  # tools/rmm_compat passes these
    if _cuda.is_available():
        assert _cuda.get_device_attribute(attr) in (0, 1)
    else:
        with pytest.raises(CUDAUnavailableError):
            _cuda.get_device_attribute(attr)


# Every wrapper, called the way a caller would; without a GPU each must raise the one clear error.
CALLS = {
    "get_device": lambda: _cuda.get_device(),
    "set_device": lambda: _cuda.set_device(0),
    "device_synchronize": lambda: _cuda.device_synchronize(),
    "mem_get_info": lambda: _cuda.mem_get_info(),
    "device_total_memory": lambda: _cuda.device_total_memory(0),
    "get_device_attribute": lambda: _cuda.get_device_attribute("ManagedMemory"),
    "malloc": lambda: _cuda.malloc(256),
    "free": lambda: _cuda.free(256),
    "malloc_managed": lambda: _cuda.malloc_managed(256),
    "malloc_host": lambda: _cuda.malloc_host(256),
    "free_host": lambda: _cuda.free_host(256),
    "malloc_from_pool_async": lambda: _cuda.malloc_from_pool_async(256, 1, 0),
    "free_async": lambda: _cuda.free_async(256, 0),
    "mem_pool_create": lambda: _cuda.mem_pool_create(),
    "mem_pool_destroy": lambda: _cuda.mem_pool_destroy(1),
    "device_get_default_mem_pool": lambda: _cuda.device_get_default_mem_pool(),
    "mem_pool_set_release_threshold": lambda: _cuda.mem_pool_set_release_threshold(1, 0),
    "mem_pool_get_attribute": lambda: _cuda.mem_pool_get_attribute(1, "ReleaseThreshold"),
    "mem_pool_trim_to": lambda: _cuda.mem_pool_trim_to(1, 0),
    "memcpy": lambda: _cuda.memcpy(256, 512, 1),
    "memcpy_async": lambda: _cuda.memcpy_async(256, 512, 1, 0),
    "memset": lambda: _cuda.memset(256, 0, 1),
    "memset_async": lambda: _cuda.memset_async(256, 0, 1, 0),
    "mem_prefetch_async": lambda: _cuda.mem_prefetch_async(256, 1, 0, 0),
    "pointer_attributes": lambda: _cuda.pointer_attributes(256),
    "stream_create": lambda: _cuda.stream_create(),
    "stream_destroy": lambda: _cuda.stream_destroy(12345),
    "stream_synchronize": lambda: _cuda.stream_synchronize(0),
    "stream_wait_event": lambda: _cuda.stream_wait_event(0, 12345),
    "event_create": lambda: _cuda.event_create(),
    "event_record": lambda: _cuda.event_record(12345, 0),
    "event_destroy": lambda: _cuda.event_destroy(12345),
}


@no_gpu_only
@pytest.mark.parametrize("name", sorted(CALLS))
def test_every_call_raises_clear_error_without_gpu(name):
    with pytest.raises(CUDAUnavailableError, match="needs a CUDA device") as info:
        CALLS[name]()
    assert "SystemMemoryResource" in str(info.value)


@no_gpu_only
def test_device_count_is_zero_without_gpu():
    assert _cuda.get_device_count() == 0
    assert _cuda.is_available() is False


# --- on a GPU ------------------------------------------------------------------------------------


@pytest.mark.gpu
def test_device_queries():
    assert _cuda.get_device_count() >= 1
    d = _cuda.get_device()
    _cuda.set_device(d)
    free_bytes, total = _cuda.mem_get_info()
    assert 0 < free_bytes <= total == _cuda.device_total_memory(d)
    assert _cuda.get_device_attribute("ManagedMemory") in (0, 1)
    from cuda.bindings import runtime

    # RMM's getDeviceAttribute takes the enum (tools/rmm_compat maps it to this function)
    assert _cuda.get_device_attribute(runtime.cudaDeviceAttr.cudaDevAttrMultiProcessorCount) > 0


@pytest.mark.gpu
def test_unknown_device_is_value_error():
    n = _cuda.get_device_count()
    with pytest.raises(ValueError, match=f"device {n} does not exist"):
        _cuda.set_device(n)
    with pytest.raises(ValueError, match="does not exist"):
        _cuda.device_total_memory(n + 5)
    assert _cuda.get_device() < n


@pytest.mark.gpu
def test_malloc_memcpy_memset_roundtrip():
    n = 4096
    ptr = _cuda.malloc(n)
    try:
        assert ptr % 256 == 0
        host = (ctypes.c_ubyte * n)(*(i % 251 for i in range(n)))
        _cuda.memcpy(ptr, ctypes.addressof(host), n)
        back = (ctypes.c_ubyte * n)()
        _cuda.memcpy(ctypes.addressof(back), ptr, n)
        assert bytes(back) == bytes(host)
        _cuda.memset(ptr, 7, 100)
        _cuda.memcpy(ctypes.addressof(back), ptr, n)
        assert bytes(back[:100]) == b"\x07" * 100 and bytes(back[100:]) == bytes(host[100:])
    finally:
        _cuda.free(ptr)


@pytest.mark.gpu
def test_async_copies_on_a_stream():
    n = 1 << 20
    s = _cuda.stream_create()
    ptr = _cuda.malloc_from_pool_async(n, _cuda.device_get_default_mem_pool(), s)
    try:
        _cuda.memset_async(ptr, 3, n, s)
        back = (ctypes.c_ubyte * n)()
        _cuda.memcpy_async(ctypes.addressof(back), ptr, n, s)
        _cuda.stream_synchronize(s)
        assert bytes(back) == b"\x03" * n
    finally:
        _cuda.free_async(ptr, s)
        _cuda.stream_synchronize(s)
        _cuda.stream_destroy(s)


@pytest.mark.gpu
def test_events_order_streams():
    a, b = _cuda.stream_create(), _cuda.stream_create(0)
    ev = _cuda.event_create()
    try:
        _cuda.event_record(ev, a)
        _cuda.stream_wait_event(b, ev)
        _cuda.stream_synchronize(b)
    finally:
        _cuda.event_destroy(ev)
        _cuda.stream_destroy(a)
        _cuda.stream_destroy(b)


@pytest.mark.gpu
def test_errors_arrive_named():
    with pytest.raises(CUDAError) as info:
        _cuda.free(0xDEAD0000)
    assert info.value.error_name.startswith("cudaError")
    assert info.value.call == "cudaFree"
    with pytest.raises(CUDAError) as info:
        _cuda.malloc(1 << 60)
    assert info.value.error_name == "cudaErrorMemoryAllocation"
    # The handled failure left no sticky error: the next call works.
    _cuda.free(_cuda.malloc(256))


@pytest.mark.gpu
def test_pointer_attributes_tell_memory_apart():
    d = _cuda.get_device()
    dev, man, pin = _cuda.malloc(256), _cuda.malloc_managed(256), _cuda.malloc_host(256)
    plain = ctypes.create_string_buffer(256)
    try:
        assert _cuda.pointer_attributes(dev).type == "device"
        assert _cuda.pointer_attributes(dev).device == d
        assert _cuda.pointer_attributes(man).type == "managed"
        assert _cuda.pointer_attributes(pin).type == "host"
        assert _cuda.pointer_attributes(ctypes.addressof(plain)).type == "unregistered"
        _cuda.mem_prefetch_async(man, 256, d, 0)
        _cuda.mem_prefetch_async(man, 256, _cuda.CPU_DEVICE_ID, 0)
        _cuda.device_synchronize()
    finally:
        _cuda.free(dev)
        _cuda.free(man)
        _cuda.free_host(pin)


@pytest.mark.gpu
def test_memory_pool_lifecycle():
    if not _cuda.get_device_attribute("MemoryPoolsSupported"):
        pytest.skip("device does not support memory pools")
    pool = _cuda.mem_pool_create(release_threshold=1 << 20)
    try:
        assert _cuda.mem_pool_get_attribute(pool, "ReleaseThreshold") == 1 << 20
        _cuda.mem_pool_set_release_threshold(pool, 1 << 30)
        assert _cuda.mem_pool_get_attribute(pool, "ReleaseThreshold") == 1 << 30
        ptr = _cuda.malloc_from_pool_async(1 << 20, pool, 0)
        assert _cuda.mem_pool_get_attribute(pool, "UsedMemCurrent") >= 1 << 20
        _cuda.free_async(ptr, 0)
        _cuda.stream_synchronize(0)
        assert _cuda.mem_pool_get_attribute(pool, "ReservedMemCurrent") >= 1 << 20
        _cuda.mem_pool_trim_to(pool, 0)
        assert _cuda.mem_pool_get_attribute(pool, "ReservedMemCurrent") < 1 << 20
    finally:
        _cuda.mem_pool_destroy(pool)
    assert _cuda.device_get_default_mem_pool() != 0
