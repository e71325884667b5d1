"""Dask serialization of DeviceBuffer: both serializer families, pickling, and transfers
between workers. Host memory everywhere; the GPU variants use device memory."""

from __future__ import annotations

import pickle
import subprocess
import sys

import pytest

pytest.importorskip("distributed")

from conftest import HAS_GPU, log_records  # noqa: E402
from distributed.protocol import deserialize, serialize  # noqa: E402
from distributed.utils_test import gen_cluster  # noqa: E402

from dask_rmm.device_buffer import DeviceBuffer  # noqa: E402
from dask_rmm.mr import (  # noqa: E402
    PoolMemoryResource,
    StatisticsResourceAdaptor,
    SystemMemoryResource,
    set_current_device_resource,
)

PAYLOAD = bytes(range(256)) * 40 + b"tail"


@pytest.fixture
def host_mr():
    mr = StatisticsResourceAdaptor(
        PoolMemoryResource(SystemMemoryResource(), initial_pool_size=1 << 20)
    )
    set_current_device_resource(mr)
    return mr


@pytest.mark.parametrize("payload", [PAYLOAD, b""])
def test_dask_family_round_trip(host_mr, payload):
    buf = DeviceBuffer.to_device(payload)
    header, frames = serialize(buf, serializers=("dask",))
    assert header["serializer"] == "dask"
    assert all(isinstance(f, (bytes, bytearray, memoryview)) for f in frames)
    assert sum(memoryview(f).nbytes for f in frames) == len(payload)
    out = deserialize(header, frames, deserializers=("dask",))
    assert isinstance(out, DeviceBuffer)
    assert out.ptr != buf.ptr or not payload
    assert out.tobytes() == payload
    assert host_mr.allocation_counts.current_bytes == 2 * len(payload)


def test_dask_family_survives_bytes_frames(host_mr):
    """Frames that went over a socket arrive as bytes."""
    buf = DeviceBuffer.to_device(PAYLOAD)
    header, frames = serialize(buf, serializers=("dask",))
    out = deserialize(header, [bytes(f) for f in frames], deserializers=("dask",))
    assert out.tobytes() == PAYLOAD


def test_cuda_family_passes_the_buffer_itself(host_mr):
    buf = DeviceBuffer.to_device(PAYLOAD)
    header, frames = serialize(buf, serializers=("cuda",))
    assert header["serializer"] == "cuda"
    assert frames == [buf]
    assert header["sub-header"]["size"] == len(PAYLOAD)
    out = deserialize(header, frames, deserializers=("cuda",))
    assert out is buf


def test_cuda_deserialize_copies_foreign_frames(host_mr):
    """A comm's receive buffer of another type is copied into a DeviceBuffer."""
    src = DeviceBuffer.to_device(PAYLOAD)

    class ForeignFrame:
        __cuda_array_interface__ = src.__cuda_array_interface__

    header, _ = serialize(src, serializers=("cuda",))
    out = deserialize(header, [ForeignFrame()], deserializers=("cuda",))
    assert isinstance(out, DeviceBuffer) and out.ptr != src.ptr
    assert out.tobytes() == PAYLOAD
    host = deserialize(header, [memoryview(PAYLOAD)], deserializers=("cuda",))
    assert host.tobytes() == PAYLOAD


def test_size_mismatch_is_refused(host_mr):
    buf = DeviceBuffer.to_device(PAYLOAD)
    header, frames = serialize(buf, serializers=("dask",))
    with pytest.raises(ValueError, match="header says"):
        deserialize(header, [b"short"], deserializers=("dask",))


def test_pickle_family_and_pickle(host_mr):
    buf = DeviceBuffer.to_device(PAYLOAD)
    header, frames = serialize(buf, serializers=("pickle",))
    assert deserialize(header, frames).tobytes() == PAYLOAD
    assert pickle.loads(pickle.dumps(buf)).tobytes() == PAYLOAD


def test_default_serializers_pick_dask_family(host_mr):
    buf = DeviceBuffer.to_device(PAYLOAD)
    header, frames = serialize(buf)
    assert header["serializer"] == "dask"
    assert deserialize(header, frames).tobytes() == PAYLOAD


@pytest.mark.parametrize("first", ["import dask_rmm.device_buffer", "import distributed.protocol"])
def test_serializers_are_registered_whichever_is_imported_first(first):
    """DeviceBuffer before distributed (the CuPy allocator, or a test run, loads it first):
    distributed's dispatchers did not exist yet; the dask family still serves it."""
    code = (
        "import sys, dask_rmm\n"
        "assert 'distributed' not in sys.modules, 'import dask_rmm imported distributed'\n"
        f"{first}\n"
        "from distributed.protocol import serialize, deserialize\n"
        "dask_rmm.reinitialize(base_resource='system')\n"
        "buf = dask_rmm.DeviceBuffer.to_device(b'abc')\n"
        "for family in ('dask', 'cuda'):\n"
        "    header, frames = serialize(buf, serializers=(family, 'pickle'))\n"
        "    assert header['serializer'] == family, header\n"
        "    assert deserialize(header, frames).tobytes() == b'abc'\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True, timeout=120)


def _install_host_resource():
    from dask_rmm.mr import SystemMemoryResource, set_current_device_resource

    set_current_device_resource(SystemMemoryResource())


def _make_buffer(payload):
    from dask_rmm.device_buffer import DeviceBuffer

    return DeviceBuffer.to_device(payload)


def _read(buf):
    return type(buf).__name__, buf.tobytes()


@gen_cluster(client=True, nthreads=[("127.0.0.1", 1), ("127.0.0.1", 1)])
async def test_buffers_move_between_workers(c, s, a, b):
    await c.run(_install_host_resource)
    _install_host_resource()
    x = c.submit(_make_buffer, PAYLOAD, workers=[a.address], pure=False)
    y = c.submit(_read, x, workers=[b.address])
    assert await y == ("DeviceBuffer", PAYLOAD)
    assert x.key in a.data and x.key in b.data  # b fetched it from a
    assert isinstance(b.data[x.key], DeviceBuffer)
    assert b.data[x.key].ptr != a.data[x.key].ptr
    result = await x  # and to the client
    assert isinstance(result, DeviceBuffer) and result.tobytes() == PAYLOAD


# --- GPU --------------------------------------------------------------------------------------


@pytest.fixture
def gpu_mr():
    from dask_rmm.mr import CudaMemoryResource

    mr = StatisticsResourceAdaptor(
        PoolMemoryResource(CudaMemoryResource(), initial_pool_size=1 << 24)
    )
    set_current_device_resource(mr)
    return mr


@pytest.mark.gpu
@pytest.mark.parametrize("family", ["dask", "cuda", "pickle"])
def test_gpu_round_trip(gpu_mr, family):
    buf = DeviceBuffer.to_device(PAYLOAD)
    assert not buf.mr.is_host_memory
    header, frames = serialize(buf, serializers=(family,))
    out = deserialize(header, frames)
    assert isinstance(out, DeviceBuffer)
    assert out.tobytes() == PAYLOAD


@pytest.mark.gpu
def test_gpu_cuda_deserialize_from_cupy_frame(gpu_mr):
    cupy = pytest.importorskip("cupy")
    src = DeviceBuffer.to_device(PAYLOAD)
    frame = cupy.asarray(memoryview(PAYLOAD)).view(cupy.uint8)
    header, _ = serialize(src, serializers=("cuda",))
    out = deserialize(header, [frame])
    assert out.tobytes() == PAYLOAD


def _install_gpu_pool():
    from dask_rmm.mr import CudaMemoryResource, PoolMemoryResource, set_current_device_resource

    set_current_device_resource(PoolMemoryResource(CudaMemoryResource(), initial_pool_size=1 << 24))


def _is_device_memory(buf):
    return not buf.mr.is_host_memory


@pytest.mark.gpu
@gen_cluster(client=True, nthreads=[("127.0.0.1", 1), ("127.0.0.1", 1)])
async def test_gpu_buffers_move_between_workers(c, s, a, b):
    await c.run(_install_gpu_pool)
    _install_gpu_pool()
    x = c.submit(_make_buffer, PAYLOAD, workers=[a.address], pure=False)
    y = c.submit(_read, x, workers=[b.address])
    assert await y == ("DeviceBuffer", PAYLOAD)
    assert await c.submit(_is_device_memory, x, workers=[b.address])
    assert (await x).tobytes() == PAYLOAD


# -- a process without a GPU receiving a DeviceBuffer ----------------------------------------


def _host_buffer(nbytes: int) -> DeviceBuffer:
    """A task result in host memory, whatever the worker's current resource."""
    return DeviceBuffer.to_device(PAYLOAD[:nbytes], mr=SystemMemoryResource())


@pytest.mark.skipif(HAS_GPU, reason="checks a process without a GPU; this host has one")
@pytest.mark.parametrize("family", ["dask", "cuda"])
def test_receiving_without_a_gpu_is_one_error_naming_the_fix(family):
    """Both families, host frames: the default CudaMemoryResource cannot be made here."""
    from dask_rmm._cuda import CUDAUnavailableError
    from dask_rmm.device_buffer import NoMemoryForDeviceBufferError

    header, frames = serialize(_host_buffer(1000), serializers=(family,))
    if family == "cuda":  # what a comm hands over: host bytes for the device frame
        frames = [bytes(memoryview(f)) if not isinstance(f, DeviceBuffer) else f.tobytes()
                  for f in frames]  # fmt: skip
    with pytest.raises(NoMemoryForDeviceBufferError) as info:
        deserialize(header, frames, deserializers=(family,))
    message = str(info.value)
    assert 'dask_rmm.reinitialize(base_resource="system")' in message
    assert "(0.98 kiB)" in message and "\n" not in message
    assert isinstance(info.value, CUDAUnavailableError)


@pytest.mark.skipif(HAS_GPU, reason="checks a client without a GPU; this host has one")
@gen_cluster(client=True, nthreads=[("127.0.0.1", 1)])
async def test_a_client_without_a_gpu_logs_one_line_then_works_after_reinitialize(c, s, a):
    """It logged CRITICAL "Failed to deserialize" with a traceback, then raised
    CUDAUnavailableError naming SystemMemoryResource() (not what a client should call)."""

    import dask_rmm
    from dask_rmm.device_buffer import NoMemoryForDeviceBufferError

    with log_records("distributed.protocol.core") as records:
        future = c.submit(_host_buffer, 1000)
        with pytest.raises(NoMemoryForDeviceBufferError, match="reinitialize"):
            await future
    failed = [r for r in records if "Failed to deserialize" in r.getMessage()]
    assert failed, records
    for record in failed:
        assert record.exc_info is None and record.exc_text is None
        assert 'dask_rmm.reinitialize(base_resource="system")' in record.getMessage()
    dask_rmm.reinitialize(base_resource="system")
    assert (await future).tobytes() == PAYLOAD[:1000]
