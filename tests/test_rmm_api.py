"""Names and behaviours RMM's Python API has that code written for RMM may rely on:
version constants, pickle protocol 5, experimental resources, profiler names, error types."""

from __future__ import annotations

import pickle

import numpy as np
import pytest

import dask_rmm
from dask_rmm import _cuda, mr, statistics
from dask_rmm.device_buffer import DeviceBuffer

HAS_GPU = _cuda.is_available()


def test_version_constants():
    assert isinstance(dask_rmm.__version__, str) and dask_rmm.__version__
    assert isinstance(dask_rmm.__git_commit__, str)


@pytest.fixture
def host_mr():
    previous = mr.get_current_device_resource() if HAS_GPU else None
    res = mr.SystemMemoryResource()
    mr.set_current_device_resource(res)
    yield res
    mr.set_current_device_resource(previous)


@pytest.mark.parametrize("hb", [b"", b"123", bytes(range(256)) * 5])
def test_pickle_protocol_5_hands_out_one_out_of_band_buffer(host_mr, hb):
    db = DeviceBuffer.to_device(hb, mr=host_mr)
    assert pickle.loads(pickle.dumps(db)).tobytes() == hb
    buffers: list[pickle.PickleBuffer] = []
    payload = pickle.dumps(db, protocol=5, buffer_callback=buffers.append)
    assert len(buffers) == 1
    assert isinstance(buffers[0], pickle.PickleBuffer)
    assert bytes(buffers[0]) == hb
    # the bytes travel out of band, not inside the pickle
    assert len(payload) < 200
    assert pickle.loads(payload, buffers=buffers).tobytes() == hb


def test_experimental_names():
    from dask_rmm.mr.experimental import CudaAsyncManagedMemoryResource

    assert mr.experimental.CudaAsyncManagedMemoryResource is CudaAsyncManagedMemoryResource
    assert issubclass(CudaAsyncManagedMemoryResource, mr.CudaAsyncViewMemoryResource)
    assert "experimental" in mr.__all__


def test_rmm_mr_logging_names():
    from dask_rmm import initialize

    assert mr.enable_logging is initialize.enable_logging
    assert mr.disable_logging is initialize.disable_logging
    assert mr.get_log_filenames is initialize.get_log_filenames


def test_profiler_names_follow_rmm(host_mr):
    records = statistics.ProfilerRecords()
    with statistics.statistics():
        ctx = statistics.profiler(records=records, name="block")
        assert isinstance(ctx, statistics.ProfilerContext)
        with ctx:
            buf = DeviceBuffer(size=512)
            del buf
        with statistics.ProfilerContext(records, "positional"):
            pass

        @statistics.ProfilerContext(records, "")
        def f():
            return DeviceBuffer(size=256)

        f()
    assert records.records["block"] == statistics.ProfilerRecords.MemoryRecord(1, 512, 512)
    assert records.records["positional"] == statistics.ProfilerRecords.MemoryRecord(1, 0, 0)
    assert records.records[statistics._get_descriptive_name_of_object(f)].num_calls == 1
    with pytest.raises(ValueError, match="needs a name"):
        with statistics.ProfilerContext(records, ""):
            pass


def test_allocation_error_is_memory_error_and_cuda_error():
    e = mr.CUDAAllocationError(
        "cudaErrorInvalidValue",
        "cudaMallocFromPoolAsync",
        "CudaAsyncViewMemoryResource.allocate(256) failed",
    )
    assert isinstance(e, MemoryError) and isinstance(e, _cuda.CUDAError)
    assert e.error_name == "cudaErrorInvalidValue"
    again = pickle.loads(pickle.dumps(e))
    assert type(again) is mr.CUDAAllocationError and again.error_name == e.error_name
    assert not issubclass(mr.OutOfMemoryError, _cuda.CUDAError)
    assert issubclass(mr.OutOfMemoryError, MemoryError)


def test_flush_logs_flushes_registered_logging_adaptors(tmp_path, host_mr):
    from dask_rmm.mr.registry import _flush_logs

    log = mr.LoggingResourceAdaptor(host_mr, log_file_name=str(tmp_path / "log.csv"))
    mr.set_current_device_resource(log)
    log.deallocate(log.allocate(256), 256)
    _flush_logs()
    with open(log.get_file_name()) as f:
        assert f.read().count(",allocate,") == 1


# --- on a GPU ----------------------------------------------------------------------------------


@pytest.mark.gpu
def test_allocating_from_a_destroyed_pool_raises_memory_error():
    pool = _cuda.mem_pool_create()
    view = mr.CudaAsyncViewMemoryResource(pool)
    view.deallocate(view.allocate(1024), 1024)
    _cuda.device_synchronize()
    _cuda.mem_pool_destroy(pool)
    with pytest.raises(MemoryError) as info:
        view.allocate(1024)
    assert isinstance(info.value, mr.CUDAAllocationError)
    assert not isinstance(info.value, mr.OutOfMemoryError)
    assert info.value.error_name.startswith("cudaError")
    assert "CudaAsyncViewMemoryResource.allocate(1024)" in str(info.value)
    assert view.live_allocations == 0


@pytest.mark.gpu
@pytest.mark.parametrize(
    "make", [mr.CudaMemoryResource, mr.CudaAsyncMemoryResource, mr.ManagedMemoryResource]
)
def test_out_of_memory_is_out_of_memory_error(make):
    res = make()
    with pytest.raises(mr.OutOfMemoryError):
        res.allocate(1 << 60)


@pytest.mark.gpu
def test_enable_fabric_as_rmm():
    # Either the device exports fabric handles, or the error is RMM's (a RuntimeError ending in
    # RMM's sentence); never anything else.
    try:
        res = mr.CudaAsyncMemoryResource(enable_fabric=True)
    except RuntimeError as e:
        assert str(e).endswith("Requested IPC memory handle type not supported")
        mask = _cuda.get_device_attribute("MemoryPoolSupportedHandleTypes")
        assert not mask & 8
    else:
        res.deallocate(res.allocate(1 << 20), 1 << 20)


def test_enable_ipc_and_fabric_together_refused_before_cuda():
    with pytest.raises(ValueError, match="enable_ipc and enable_fabric"):
        mr.CudaAsyncMemoryResource(enable_ipc=True, enable_fabric=True)
    with pytest.raises(TypeError, match="enable_fabric"):
        mr.CudaAsyncMemoryResource(enable_fabric="yes")


@pytest.mark.gpu
def test_async_managed_resource():
    from dask_rmm.mr.experimental import CudaAsyncManagedMemoryResource

    try:
        res = CudaAsyncManagedMemoryResource()
    except _cuda.CUDAError as e:
        assert "CUDA 13.0" in str(e) or "concurrent managed access" in str(e)
        pytest.skip(str(e))
    assert isinstance(res.pool_handle(), int) and res.pool_handle() != 0
    db = DeviceBuffer.to_device(np.arange(1000, dtype="u1").tobytes(), mr=res)
    assert _cuda.pointer_attributes(db.ptr).type == "managed"
    assert db.tobytes() == np.arange(1000, dtype="u1").tobytes()


def test_stream_none_refused_as_rmm(host_mr):
    from dask_rmm.device_buffer import copy_device_to_ptr, copy_host_to_ptr, copy_ptr_to_host

    match = "stream argument cannot be None"
    with pytest.raises(TypeError, match=match):
        DeviceBuffer(size=10, stream=None)
    with pytest.raises(TypeError, match=match):
        DeviceBuffer.to_device(b"abc", stream=None)
    db = DeviceBuffer.to_device(b"abcdefgh")
    calls = [
        lambda: db.copy_to_host(stream=None),
        lambda: db.copy_from_host(b"x", stream=None),
        lambda: db.copy_from_device(db, stream=None),
        lambda: db.tobytes(stream=None),
        lambda: db.reserve(100, stream=None),
        lambda: db.resize(4, stream=None),
        lambda: copy_ptr_to_host(db.ptr, bytearray(3), stream=None),
        lambda: copy_host_to_ptr(b"abc", db.ptr, stream=None),
        lambda: copy_device_to_ptr(db.ptr, db.ptr, 3, stream=None),
    ]
    for call in calls:
        with pytest.raises(TypeError, match=match):
            call()
    assert db.tobytes() == b"abcdefgh" and db.capacity() == 8


@pytest.mark.gpu
def test_cuda_resources_refuse_stream_none_and_keep_the_pointer():
    res = mr.CudaMemoryResource()
    with pytest.raises(TypeError, match="stream argument cannot be None"):
        res.allocate(1024, stream=None)
    ptr = res.allocate(1024)
    with pytest.raises(TypeError, match="stream argument cannot be None"):
        res.deallocate(ptr, 1024, stream=None)
    assert res.live_allocations == 1
    res.deallocate(ptr, 1024)
    assert res.live_allocations == 0
