"""A second stream, the way users get it wrong: memory freed on one stream while a kernel on it
still runs, then handed to another stream; buffers copied on a stream other than their own;
resources set per device from many threads.

The GPU tests launch a kernel that spins for ~0.1 s and then fills the block, so an allocator
that hands the block to another stream without making it wait lets that stream's write land
*before* the spinning kernel's: the block then reads back with the first kernel's value.
"""

from __future__ import annotations

import subprocess
import sys
import threading

import numpy as np
import pytest
from conftest import HAS_GPU

from dask_rmm import mr
from dask_rmm.device_buffer import DeviceBuffer
from dask_rmm.stream import PER_THREAD_DEFAULT_STREAM, CudaStreamFlags, Stream

N = 32 << 20  # above the pool's size classes: the exact block is reused
SPIN_NS = 100_000_000  # 0.1 s of GPU time

_SPIN_FILL = r"""
extern "C" __global__ void spin_fill(unsigned char* p, unsigned long long n, unsigned char v,
                                     unsigned long long ns) {
    // %globaltimer: one nanosecond clock for the whole GPU, so the spin lasts 0.1 s of wall time
    // whatever the SM clock and wherever a block preempted by another process resumes
    // (clock64() counts cycles of one SM, and the SMs' counters differ by milliseconds).
    unsigned long long start, now;
    asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(start));
    do {
        asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(now));
    } while (now - start < ns);
    for (unsigned long long i = blockIdx.x * (unsigned long long)blockDim.x + threadIdx.x;
         i < n; i += (unsigned long long)gridDim.x * blockDim.x) {
        p[i] = v;
    }
}
"""


def _cupy():
    return pytest.importorskip("cupy")


def _view(ptr: int, n: int):
    cupy = _cupy()
    mem = cupy.cuda.UnownedMemory(ptr, n, None)
    return cupy.ndarray(n, dtype=cupy.uint8, memptr=cupy.cuda.MemoryPointer(mem, 0))


def spin_fill(ptr: int, n: int, value: int, stream: Stream) -> None:
    """On ``stream``: spin ~0.1 s, then write ``value`` to ``n`` bytes at ``ptr``."""
    cupy = _cupy()
    kernel = cupy.RawKernel(_SPIN_FILL, "spin_fill")
    with cupy.cuda.Stream.from_external(stream):  # through Stream.__cuda_stream__
        kernel((264,), (256,), (_view(ptr, n), np.uint64(n), np.uint8(value), np.uint64(SPIN_NS)))


def fill(ptr: int, n: int, value: int, stream: Stream) -> None:
    """On ``stream``: write ``value`` to ``n`` bytes at ``ptr`` at once."""
    from dask_rmm import _cuda

    _cuda.memset_async(ptr, value, n, stream.handle)


def read(ptr: int, n: int) -> np.ndarray:
    from dask_rmm import _cuda

    _cuda.device_synchronize()
    return _view(ptr, n).get()


def _suballocator(kind: str):
    if kind == "pool":
        return mr.PoolMemoryResource(mr.CudaMemoryResource(), N, N)
    if kind == "fixed_size":
        return mr.FixedSizeMemoryResource(
            mr.CudaMemoryResource(), block_size=N, blocks_to_preallocate=1
        )
    if kind == "binning":
        return mr.BinningMemoryResource(mr.PoolMemoryResource(mr.CudaMemoryResource(), N, N))
    if kind == "statistics(pool)":
        return mr.StatisticsResourceAdaptor(mr.PoolMemoryResource(mr.CudaMemoryResource(), N, N))
    if kind == "async":
        return mr.CudaAsyncMemoryResource()
    raise ValueError(kind)


SUBALLOCATORS = ["pool", "fixed_size", "binning", "statistics(pool)", "async"]
REUSES_THE_BLOCK = {"pool", "fixed_size", "binning", "statistics(pool)"}


@pytest.mark.gpu
def test_the_spinning_kernel_outlasts_an_unordered_write():
    """The control: without ordering, the other stream's write lands first and is overwritten,
    so the tests below fail for an allocator that does not order the reuse."""
    res = mr.CudaMemoryResource()
    a = Stream(flags=CudaStreamFlags.NON_BLOCKING)
    b = Stream(flags=CudaStreamFlags.NON_BLOCKING)
    p = res.allocate(N, a)
    spin_fill(p, N, 1, a)
    fill(p, N, 2, b)
    assert np.unique(read(p, N)).tolist() == [1]
    res.deallocate(p, N, a)


@pytest.mark.gpu
@pytest.mark.parametrize("kind", SUBALLOCATORS)
def test_a_block_freed_while_its_stream_works_is_not_overwritten_by_the_next_stream(kind):
    res = _suballocator(kind)
    a = Stream(flags=CudaStreamFlags.NON_BLOCKING)
    b = Stream(flags=CudaStreamFlags.NON_BLOCKING)
    for round_ in range(3):
        p = res.allocate(N, a)
        spin_fill(p, N, 1, a)
        res.deallocate(p, N, a)  # stream-ordered: the kernel on a still uses the block
        q = res.allocate(N, b)
        if kind in REUSES_THE_BLOCK:
            assert q == p, "the only block was not reused: this test would prove nothing"
        fill(q, N, 2, b)
        values = np.unique(read(q, N))
        res.deallocate(q, N, b)
        assert values.tolist() == [2], f"round {round_}: b's write was overwritten by a's kernel"


@pytest.mark.gpu
def test_cupy_arrays_through_the_allocator_reuse_a_pool_block_across_streams_in_order():
    """CuPy frees an array on the stream it was allocated on: a kernel still writing it on
    stream a must finish before an array allocated on stream b gets the block."""
    cupy = _cupy()
    from dask_rmm.allocators.cupy import rmm_cupy_allocator

    res = _suballocator("pool")
    previous = mr.get_current_device_resource()
    mr.set_current_device_resource(res)
    old_allocator = cupy.cuda.get_allocator()
    cupy.cuda.set_allocator(rmm_cupy_allocator)
    try:
        a = cupy.cuda.Stream(non_blocking=True)
        b = cupy.cuda.Stream(non_blocking=True)
        with a:
            x = cupy.empty(N, dtype=cupy.uint8)
            ptr = x.data.ptr
            spin_fill(ptr, N, 1, Stream(a))
            del x
        with b:
            y = cupy.empty(N, dtype=cupy.uint8)
            assert y.data.ptr == ptr
            y.fill(2)
            b.synchronize()
        a.synchronize()
        # Checked on the host: cupy.unique needs device temporaries the 32 MiB pool lacks.
        assert np.unique(cupy.asnumpy(y, stream=b)).tolist() == [2]
        del y
    finally:
        cupy.cuda.set_allocator(old_allocator)
        mr.set_current_device_resource(previous)


@pytest.mark.gpu
def test_a_buffer_freed_on_another_stream_orders_the_next_owner_after_that_stream():
    """Allocated on a, freed on b (which waits for a): the pool must order c after b."""
    from dask_rmm import _cuda

    res = _suballocator("pool")
    a, b, c = (Stream(flags=CudaStreamFlags.NON_BLOCKING) for _ in range(3))
    p = res.allocate(N, a)
    spin_fill(p, N, 1, a)
    event = _cuda.event_create()
    _cuda.event_record(event, a.handle)
    _cuda.stream_wait_event(b.handle, event)
    _cuda.event_destroy(event)
    res.deallocate(p, N, b)
    q = res.allocate(N, c)
    assert q == p
    fill(q, N, 3, c)
    assert np.unique(read(q, N)).tolist() == [3]
    res.deallocate(q, N, c)


@pytest.mark.gpu
def test_device_buffers_on_two_streams_reuse_a_pool_block_in_order():
    res = _suballocator("pool")
    a = Stream(flags=CudaStreamFlags.NON_BLOCKING)
    b = Stream(flags=CudaStreamFlags.NON_BLOCKING)
    first = DeviceBuffer(size=N, stream=a, mr=res)
    ptr = first.ptr
    spin_fill(ptr, N, 1, a)
    del first
    second = DeviceBuffer(size=N, stream=b, mr=res)
    assert second.ptr == ptr
    fill(second.ptr, N, 2, b)
    assert np.unique(second.copy_to_host()).tolist() == [2]


@pytest.mark.gpu
def test_per_thread_default_streams_of_two_threads_reuse_a_block_in_order():
    """A block freed on one thread's per-thread stream while its kernel still runs is taken by
    another thread's per-thread stream only after that kernel. The first thread stays alive
    until the second has queued its write, as in a thread pool (a thread that exits waits for
    its per-thread stream first, so the kernel would be over before the second thread came)."""
    res = _suballocator("pool")
    got = {}
    freed, taken = threading.Event(), threading.Event()

    def first():
        p = res.allocate(N, PER_THREAD_DEFAULT_STREAM)
        spin_fill(p, N, 1, PER_THREAD_DEFAULT_STREAM)
        res.deallocate(p, N, PER_THREAD_DEFAULT_STREAM)
        got["p"] = p
        freed.set()
        taken.wait(120)

    def second():
        q = res.allocate(N, PER_THREAD_DEFAULT_STREAM)
        fill(q, N, 2, PER_THREAD_DEFAULT_STREAM)
        got["q"] = q
        taken.set()

    one = threading.Thread(target=first)
    one.start()
    assert freed.wait(120)
    two = threading.Thread(target=second)
    two.start()
    two.join()
    taken.set()
    one.join()
    assert got["q"] == got["p"]
    assert np.unique(read(got["q"], N)).tolist() == [2]
    res.deallocate(got["q"], N, PER_THREAD_DEFAULT_STREAM)


@pytest.mark.gpu
@pytest.mark.parametrize("kind", ["pool", "cuda", "async"])
def test_copies_of_a_buffer_with_pending_work_on_a_non_blocking_stream(kind):
    """``copy()``, ``copy_to_host`` on another stream and ``tobytes`` right after a kernel on
    the buffer's own non-blocking stream see what the kernel wrote."""
    res = {"pool": lambda: mr.PoolMemoryResource(mr.CudaMemoryResource(), 4 * N),
           "cuda": mr.CudaMemoryResource, "async": mr.CudaAsyncMemoryResource}[kind]()  # fmt: skip
    a = Stream(flags=CudaStreamFlags.NON_BLOCKING)
    b = Stream(flags=CudaStreamFlags.NON_BLOCKING)
    buf = DeviceBuffer(size=N, stream=a, mr=res)
    spin_fill(buf.ptr, N, 7, a)
    twin = buf.copy()
    spin_fill(buf.ptr, N, 8, a)
    out = np.empty(N, np.uint8)
    buf.copy_to_host(out, stream=b)
    b.synchronize()
    assert np.unique(out).tolist() == [8]
    assert np.unique(twin.copy_to_host()).tolist() == [7]
    spin_fill(buf.ptr, N, 9, a)
    assert set(buf.tobytes()[:: 1 << 20]) == {9}
    moved = DeviceBuffer.to_device(np.full(N, 5, np.uint8), stream=b, mr=res)
    assert np.unique(moved.copy_to_host()).tolist() == [5]


def _thread_resources(base):
    return [mr.StatisticsResourceAdaptor(base()) for _ in range(8)]


@pytest.mark.parametrize("base", ["system"] + (["cuda"] if HAS_GPU else []))
def test_threads_setting_the_current_resource_free_into_the_resource_they_allocated_from(base):
    """Eight threads each set their own current resource (RMM's registry is per device, so they
    overwrite one another) and allocate: every buffer frees into the resource it came from."""
    make = mr.SystemMemoryResource if base == "system" else mr.CudaMemoryResource
    resources = _thread_resources(make)
    previous = mr.get_current_device_resource() if base == "cuda" else None
    errors = []
    start = threading.Barrier(len(resources))

    def work(own):
        try:
            start.wait()
            for _ in range(200):
                mr.set_current_device_resource(own)
                buf = DeviceBuffer(size=4096)
                assert buf.mr in resources
                del buf
        except BaseException as e:  # pragma: no cover - reported below
            errors.append(e)

    threads = [threading.Thread(target=work, args=(r,)) for r in resources]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    mr.set_current_device_resource(previous)
    assert not errors, errors
    assert sum(r.allocation_counts.total_count for r in resources) == 8 * 200
    assert [r.allocation_counts.current_bytes for r in resources] == [0] * 8


_IMPORT_ORDERS = {
    "allocator before cupy": (
        "from dask_rmm.allocators.cupy import rmm_cupy_allocator\n"
        "import cupy\n"
        "cupy.cuda.set_allocator(rmm_cupy_allocator)\n"
    ),
    "cupy before dask_rmm": (
        "import cupy\nimport dask_rmm\n"
        "from dask_rmm.allocators.cupy import rmm_cupy_allocator\n"
        "cupy.cuda.set_allocator(rmm_cupy_allocator)\n"
    ),
    "distributed, numba, cupy, then dask_rmm": (
        "import distributed, numba.cuda, cupy\n"
        "from dask_rmm.allocators.cupy import rmm_cupy_allocator\n"
        "cupy.cuda.set_allocator(rmm_cupy_allocator)\n"
    ),
    "rmm before dask_rmm": (
        "import rmm, cupy\n"
        "from dask_rmm.allocators.cupy import rmm_cupy_allocator\n"
        "cupy.cuda.set_allocator(rmm_cupy_allocator)\n"
    ),
    "dask_rmm before rmm": (
        "import dask_rmm, cupy\n"
        "from dask_rmm.allocators.cupy import rmm_cupy_allocator\n"
        "import rmm, rmm.allocators.cupy\n"
        "cupy.cuda.set_allocator(rmm_cupy_allocator)\n"
    ),
}
_CHECK = (
    "import dask_rmm\n"
    "stats = dask_rmm.mr.StatisticsResourceAdaptor(dask_rmm.mr.CudaMemoryResource())\n"
    "dask_rmm.mr.set_current_device_resource(stats)\n"
    "x = cupy.arange(1000, dtype='f8'); assert float(x.sum()) == 499500.0\n"
    "assert stats.allocation_counts.current_bytes >= 8000, stats.allocation_counts\n"
    "print('ok')\n"
)


@pytest.mark.gpu
@pytest.mark.parametrize("order", sorted(_IMPORT_ORDERS))
def test_the_cupy_allocator_works_whatever_the_import_order(order):
    if "rmm" in order.replace("dask_rmm", ""):
        pytest.importorskip("rmm")
    out = subprocess.run(
        [sys.executable, "-c", _IMPORT_ORDERS[order] + _CHECK],
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert out.returncode == 0 and out.stdout.strip().endswith("ok"), out.stderr[-3000:]


def test_threads_reusing_an_id_get_per_thread_stream_keys_of_their_own(monkeypatch):
    """CPython hands an exited thread's id to the next thread while the old thread's work on its
    per-thread stream may still run. Free lists were keyed ``("ptds", id)``, so a new thread
    took such a block with no wait (on the H200 it read back the old kernel's bytes), and the
    fix, a device synchronization on the first use of a reused id, stalled for over 45 s on the
    H200 when the previous thread was still exiting. Now each thread gets a number of its own:
    no key is ever shared, and a thread's first use of its key synchronizes nothing."""
    from dask_rmm import _cuda

    synced = []
    monkeypatch.setattr(_cuda, "is_available", lambda: True)
    monkeypatch.setattr(_cuda, "device_synchronize", lambda: synced.append(threading.get_ident()))
    idents, keys = [], []

    def use_ptds():
        key = PER_THREAD_DEFAULT_STREAM.order_key()
        assert PER_THREAD_DEFAULT_STREAM.order_key() is key  # decided once per thread
        idents.append(threading.get_ident())
        keys.append(key)

    for _ in range(6):
        t = threading.Thread(target=use_ptds)
        t.start()
        t.join()
    assert len(set(keys)) == 6 and all(k[0] == "ptds" for k in keys)
    assert PER_THREAD_DEFAULT_STREAM.order_key() not in keys
    assert synced == []
    if len(set(idents)) == 6:
        pytest.skip("no thread id was reused by a later thread (keys were checked)")


def test_a_block_freed_by_an_exited_thread_is_taken_after_a_device_sync(monkeypatch):
    """The block an exited thread freed on its per-thread stream sits under that thread's key; a
    later thread with the same id takes it through ``order_after`` (another thread's per-thread
    stream cannot be recorded on), which synchronizes the device first. The decision only, on
    host memory with CUDA faked (the GPU test checks the bytes)."""
    from dask_rmm import _cuda

    calls = []
    monkeypatch.setattr(_cuda, "device_synchronize", lambda: calls.append("device sync"))
    monkeypatch.setattr(_cuda, "event_create", lambda **_: calls.append("event") or 1)
    res = mr.PoolMemoryResource(mr.SystemMemoryResource(), 1 << 20, 1 << 20)
    res._ordered = True
    got = []

    def first():
        p = res.allocate(1 << 20, PER_THREAD_DEFAULT_STREAM)
        res.deallocate(p, 1 << 20, PER_THREAD_DEFAULT_STREAM)
        got.append(p)

    def second():
        got.append(res.allocate(1 << 20, PER_THREAD_DEFAULT_STREAM))
        res.deallocate(got[-1], 1 << 20, PER_THREAD_DEFAULT_STREAM)

    for target in (first, second):
        t = threading.Thread(target=target)
        t.start()
        t.join()
    assert got[0] == got[1]  # the only block, taken over
    assert calls == ["device sync"]
    res._ordered = False
