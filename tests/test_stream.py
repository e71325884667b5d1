"""dask_rmm.stream: wrapping foreign streams, default streams, CudaStreamPool."""

from __future__ import annotations

import ctypes
import threading

import pytest

from dask_rmm import _cuda
from dask_rmm.stream import (
    DEFAULT_STREAM,
    LEGACY_DEFAULT_STREAM,
    PER_THREAD_DEFAULT_STREAM,
    CudaStreamFlags,
    CudaStreamPool,
    Stream,
    as_stream,
)

HAS_GPU = _cuda.is_available()


class ProtocolStream:
    def __init__(self, handle):
        self.handle_value = handle

    def __cuda_stream__(self):
        return (0, self.handle_value)


class CupyLike:
    ptr = 0x1234


class NumbaLike:
    handle = ctypes.c_void_p(0x5678)


def test_wrapping_foreign_streams():
    assert Stream(0x42).handle == 0x42
    assert Stream(ProtocolStream(0x99)).handle == 0x99
    assert Stream(CupyLike()).handle == 0x1234
    assert Stream(NumbaLike()).handle == 0x5678
    from cuda.bindings import driver, runtime

    assert Stream(runtime.cudaStream_t(7)).handle == 7
    assert Stream(driver.CUstream(8)).handle == 8
    wrapped = Stream(0x42)
    assert Stream(wrapped).handle == 0x42
    assert Stream(wrapped) == wrapped and hash(Stream(0x42)) == hash(wrapped)
    assert wrapped.__cuda_stream__() == (0, 0x42)
    assert int(wrapped) == wrapped.value == 0x42


@pytest.mark.parametrize(
    "bad",
    [
        True,
        -1,
        "stream",
        1.5,
        object(),
    ],
)
def test_bad_streams_refused(bad):
    with pytest.raises((TypeError, ValueError)):
        Stream(bad)


def test_default_streams():
    assert DEFAULT_STREAM.is_default() and LEGACY_DEFAULT_STREAM.is_default()
    assert (
        PER_THREAD_DEFAULT_STREAM.is_default() and PER_THREAD_DEFAULT_STREAM.is_per_thread_default()
    )
    assert not Stream(0x1000).is_default()
    assert as_stream(None) is DEFAULT_STREAM
    assert as_stream(DEFAULT_STREAM) is DEFAULT_STREAM
    assert as_stream(0x77).handle == 0x77
    assert "DEFAULT_STREAM" in repr(DEFAULT_STREAM)


def test_per_thread_default_stream_is_one_stream_per_thread():
    keys = []
    t = threading.Thread(target=lambda: keys.append(PER_THREAD_DEFAULT_STREAM.order_key()))
    t.start()
    t.join()
    here = PER_THREAD_DEFAULT_STREAM.order_key()
    assert here != keys[0] and here[0] == keys[0][0] == "ptds"
    assert DEFAULT_STREAM.order_key() == 0 and Stream(0x50).order_key() == 0x50


@pytest.mark.skipif(HAS_GPU, reason="checks the no-GPU path")
def test_without_gpu():
    DEFAULT_STREAM.synchronize()  # nothing can be queued: a no-op
    PER_THREAD_DEFAULT_STREAM.synchronize()
    with pytest.raises(_cuda.CUDAUnavailableError):
        Stream()
    with pytest.raises(_cuda.CUDAUnavailableError):
        Stream(0x1000).synchronize()
    with pytest.raises(_cuda.CUDAUnavailableError):
        CudaStreamPool(2)


@pytest.mark.parametrize("bad", [0, -3, True, 1.5, "4"])
def test_stream_pool_refuses_bad_sizes(bad):
    with pytest.raises(ValueError, match="pool_size"):
        CudaStreamPool(bad)


@pytest.mark.gpu
def test_created_stream_works():
    s = Stream()
    assert not s.is_default() and s.handle != 0
    s.synchronize()
    from cuda.bindings import runtime

    assert runtime.cudaStreamQuery(s.handle) == (runtime.cudaError_t.cudaSuccess,)


@pytest.mark.gpu
def test_stream_pool_round_robin_and_wrap():
    pool = CudaStreamPool(3)
    assert pool.get_pool_size() == 3
    streams = [pool.get_stream() for _ in range(6)]
    assert len({s.handle for s in streams}) == 3
    assert streams[0] is streams[3]
    assert pool.get_stream(4) is pool.get_stream(1)
    for s in streams[:3]:
        s.synchronize()


def test_stream_flags_are_rmms():
    assert CudaStreamFlags.SYNC_DEFAULT == 0 and CudaStreamFlags.NON_BLOCKING == 1
    assert [m.name for m in CudaStreamFlags] == ["SYNC_DEFAULT", "NON_BLOCKING"]


def test_flags_only_for_new_streams():
    with pytest.raises(ValueError, match="flags may only be specified when obj is None"):
        Stream(0x42, flags=CudaStreamFlags.NON_BLOCKING)
    with pytest.raises(ValueError, match="flags may only be specified when obj is None"):
        Stream(DEFAULT_STREAM, flags=CudaStreamFlags.SYNC_DEFAULT)


@pytest.mark.parametrize(
    "bad, exc",
    [(2, ValueError), (-1, ValueError), ("1", TypeError), (True, TypeError), (1.0, TypeError)],
)
def test_bad_flags_refused_before_cuda(bad, exc):
    with pytest.raises(exc, match="flags"):
        Stream(flags=bad)
    with pytest.raises(exc, match="flags"):
        CudaStreamPool(2, flags=bad)


def test_stream_protocol_version_other_than_0_refused():
    class V1Stream:
        def __cuda_stream__(self):
            return (1, 2)

    with pytest.raises(NotImplementedError, match="version: '1'"):
        Stream(V1Stream())


def _stream_flags(handle: int) -> int:
    from cuda.bindings import runtime

    err, flags = runtime.cudaStreamGetFlags(handle)
    assert err == runtime.cudaError_t.cudaSuccess
    return int(flags)


@pytest.mark.gpu
def test_new_stream_synchronizes_with_default_stream_as_rmm():
    # RMM's Stream() is made with cudaStreamDefault: a copy on the legacy default stream then
    # waits for work queued on it (a non-blocking Stream() once let copy_to_host read zeros).
    assert _stream_flags(Stream().handle) == 0
    assert _stream_flags(Stream(flags=CudaStreamFlags.SYNC_DEFAULT).handle) == 0
    assert _stream_flags(Stream(flags=CudaStreamFlags.NON_BLOCKING).handle) == 1


@pytest.mark.gpu
@pytest.mark.parametrize("flags", list(CudaStreamFlags))
def test_stream_pool_flags(flags):
    pool = CudaStreamPool(pool_size=4, flags=flags)
    streams = [pool.get_stream() for _ in range(4)]
    assert len({s.handle for s in streams}) == 4
    assert all(_stream_flags(s.handle) == int(flags) for s in streams)
    assert all(s != DEFAULT_STREAM for s in streams)


def test_a_thread_that_used_its_per_thread_stream_drains_it_before_join_returns(monkeypatch):
    """A thread exiting with work on its per-thread stream left the driver holding a mutex on
    the H200, and every later device synchronization in the process blocked behind it. So the
    first use of the key arms a drain that runs in the exiting thread, before ``join`` returns;
    a thread that never used its per-thread stream through dask-rmm drains nothing, and a
    failing drain does not escape the thread's exit."""
    from dask_rmm import _cuda

    drained = []
    monkeypatch.setattr(_cuda, "is_available", lambda: True)

    def fake_sync(handle):
        drained.append((threading.get_ident(), handle))
        if len(drained) == 2:
            raise _cuda.CUDAError("cudaStreamSynchronize failed (on purpose)")

    monkeypatch.setattr(_cuda, "stream_synchronize", fake_sync)
    idents = []

    def use_ptds():
        idents.append(threading.get_ident())
        PER_THREAD_DEFAULT_STREAM.order_key()

    for target in (use_ptds, lambda: idents.append(threading.get_ident()), use_ptds):
        t = threading.Thread(target=target)
        t.start()
        t.join()
    assert drained == [(idents[0], 2), (idents[2], 2)]
