"""Base resources: allocate/deallocate, refusing wrong frees with state intact, OOM, devices."""

from __future__ import annotations

import ctypes
import threading

import pytest
from conftest import make_base_resource

from dask_rmm import _cuda, mr
from dask_rmm.mr import OutOfMemoryError

HAS_GPU = _cuda.is_available()
no_gpu_only = pytest.mark.skipif(HAS_GPU, reason="checks the no-GPU path; this host has a GPU")


def _write(resource, ptr, data: bytes):
    src = ctypes.create_string_buffer(data, len(data))
    if resource.is_host_memory:
        ctypes.memmove(ptr, src, len(data))
    else:
        _cuda.memcpy(ptr, ctypes.addressof(src), len(data))


def _read(resource, ptr, n) -> bytes:
    out = ctypes.create_string_buffer(n)
    if resource.is_host_memory:
        ctypes.memmove(out, ptr, n)
    else:
        _cuda.memcpy(ctypes.addressof(out), ptr, n)
    return out.raw


def test_allocate_aligned_and_disjoint(base_resource):
    sizes = [1, 255, 256, 257, 4096, 100_000]
    ptrs = [base_resource.allocate(n) for n in sizes]
    try:
        assert all(p % 256 == 0 and p != 0 for p in ptrs)
        for i, (p, n) in enumerate(zip(ptrs, sizes, strict=True)):
            _write(base_resource, p, bytes([i + 1]) * n)
        for i, (p, n) in enumerate(zip(ptrs, sizes, strict=True)):
            assert _read(base_resource, p, n) == bytes([i + 1]) * n
    finally:
        for p, n in zip(ptrs, sizes, strict=True):
            base_resource.deallocate(p, n)
    assert base_resource.live_allocations == 0


def test_zero_bytes(base_resource):
    assert base_resource.allocate(0) == 0
    base_resource.deallocate(0, 0)
    assert base_resource.live_allocations == 0


@pytest.mark.parametrize("bad", [-1, 1.5, "3", None, True, 1 << 64])
def test_bad_sizes(base_resource, bad):
    with pytest.raises((TypeError, ValueError), match="nbytes"):
        base_resource.allocate(bad)
    assert base_resource.live_allocations == 0


def test_wrong_frees_leave_state_intact(base_resource):
    p = base_resource.allocate(1000)
    other = base_resource.allocate(512)
    _write(base_resource, p, b"x" * 1000)
    with pytest.raises(ValueError, match="wrong size") as info:
        base_resource.deallocate(p, 999)
    assert f"{p:#x}" in str(info.value) and type(base_resource).__name__ in str(info.value)
    with pytest.raises(ValueError, match="foreign pointer"):
        base_resource.deallocate(p + 256, 1000)
    with pytest.raises(ValueError, match="foreign pointer"):
        base_resource.deallocate(0, 1000)
    assert base_resource.live_allocations == 2
    assert _read(base_resource, p, 1000) == b"x" * 1000
    base_resource.deallocate(p, 1000)
    with pytest.raises(ValueError, match="double free"):
        base_resource.deallocate(p, 1000)
    assert base_resource.live_allocations == 1
    base_resource.deallocate(other, 512)


def test_foreign_pointer_from_another_resource(base_resource_name):
    a, b = make_base_resource(base_resource_name), make_base_resource(base_resource_name)
    p = a.allocate(256)
    with pytest.raises(ValueError, match="foreign pointer"):
        b.deallocate(p, 256)
    a.deallocate(p, 256)


def test_threads_allocate_and_free(base_resource):
    errors = []

    def work(seed):
        try:
            for i in range(50):
                n = 256 * (1 + (seed * 7 + i) % 9)
                p = base_resource.allocate(n)
                base_resource.deallocate(p, n)
        except Exception as e:  # pragma: no cover - reported below
            errors.append(e)

    threads = [threading.Thread(target=work, args=(s,)) for s in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors
    assert base_resource.live_allocations == 0


def test_device_id_and_flags(base_resource_name, base_resource):
    expected = _cuda.get_device() if HAS_GPU else 0
    assert base_resource.device_id == expected
    assert base_resource.is_host_memory is (base_resource_name == "system")
    assert base_resource.reserved_memory_info() is None


def test_system_resource_out_of_memory_has_fields():
    r = mr.SystemMemoryResource()
    with pytest.raises(OutOfMemoryError) as info:
        r.allocate(1 << 62)
    assert info.value.requested == 1 << 62
    assert info.value.resource == "SystemMemoryResource"
    assert isinstance(info.value, MemoryError)
    assert r.live_allocations == 0


class Counting(mr.DeviceMemoryResource):
    """A custom resource in plain Python, as the interface promises."""

    def __init__(self, upstream):
        super().__init__(device_id=upstream.device_id)
        self.upstream, self.calls = upstream, 0

    def allocate(self, nbytes, stream=None):
        self.calls += 1
        return self.upstream.allocate(nbytes)

    def deallocate(self, ptr, nbytes, stream=None):
        self.upstream.deallocate(ptr, nbytes)


def test_custom_python_resource(base_resource):
    c = Counting(base_resource)
    p = c.allocate(300)
    c.deallocate(p, 300)
    assert c.calls == 1 and base_resource.live_allocations == 0


# --- no GPU --------------------------------------------------------------------------------------


@no_gpu_only
@pytest.mark.parametrize(
    "make",
    [
        lambda: mr.CudaMemoryResource(),
        lambda: mr.ManagedMemoryResource(),
        lambda: mr.CudaAsyncMemoryResource(),
        lambda: mr.CudaAsyncViewMemoryResource(1234),
        lambda: mr.PinnedHostMemoryResource(),
        lambda: mr.SamHeadroomMemoryResource(1 << 30),
    ],
    ids=["cuda", "managed", "async", "async_view", "pinned", "sam"],
)
def test_cuda_resources_need_gpu(make):
    with pytest.raises(_cuda.CUDAUnavailableError, match="needs a CUDA device"):
        make()


@pytest.mark.parametrize("bad", [0, True, "pool", None])
def test_async_view_refuses_bad_handles(bad):
    with pytest.raises((TypeError, ValueError), match="pool_handle"):
        mr.CudaAsyncViewMemoryResource(bad)


def test_async_refuses_bad_options():
    with pytest.raises(TypeError, match="enable_ipc"):
        mr.CudaAsyncMemoryResource(enable_ipc="yes")


# --- GPU -----------------------------------------------------------------------------------------


@pytest.mark.gpu
@pytest.mark.parametrize("name", ["cuda", "async"])
def test_out_of_memory_is_memory_error_with_fields(name):
    r = make_base_resource(name)
    with pytest.raises(OutOfMemoryError) as info:
        r.allocate(1 << 50)
    e = info.value
    assert e.requested == 1 << 50 and e.resource == type(r).__name__
    assert e.free_bytes is not None and e.free_bytes > 0
    assert "requested 1.00 PiB" in str(e)
    assert isinstance(e.__cause__, _cuda.CUDAError)
    assert r.live_allocations == 0
    r.deallocate(r.allocate(256), 256)  # still usable


@pytest.mark.gpu
def test_pinned_memory_is_host_accessible():
    r = mr.PinnedHostMemoryResource()
    p = r.allocate(1000)
    try:
        assert _cuda.pointer_attributes(p).type == "host"
        ctypes.memmove(p, b"y" * 1000, 1000)
        assert ctypes.string_at(p, 1000) == b"y" * 1000
    finally:
        r.deallocate(p, 1000)


@pytest.mark.gpu
def test_managed_memory_is_managed():
    r = mr.ManagedMemoryResource()
    p = r.allocate(4096)
    try:
        assert _cuda.pointer_attributes(p).type == "managed"
    finally:
        r.deallocate(p, 4096)


@pytest.mark.gpu
def test_sizes_given_to_device_resources_are_parsed_once_there():
    # strings and fractions of the device's memory, through the one parser
    total = _cuda.device_total_memory()
    r = mr.CudaAsyncMemoryResource(initial_pool_size="4MiB", release_threshold=0.01)
    assert r.release_threshold == int(total * 0.01)  # exact bytes: no 256-byte rounding here
    r.set_release_threshold("0.02")
    assert r.release_threshold == int(total * 0.02)
    pool = mr.PoolMemoryResource(mr.CudaMemoryResource(), initial_pool_size="0.01")
    assert pool.pool_size() == int(total * 0.01) // 256 * 256  # rounded down to 256 bytes
    with pytest.raises(ValueError, match=r"initial_pool_size='1e300GiB'.*more memory than any"):
        mr.PoolMemoryResource(mr.CudaMemoryResource(), initial_pool_size="1e300GiB")


@pytest.mark.gpu
def test_async_resource_pool():
    total = _cuda.device_total_memory()
    r = mr.CudaAsyncMemoryResource(initial_pool_size="64MiB")
    assert isinstance(r.pool_handle(), int) and r.pool_handle() != 0
    assert r.release_threshold == total
    assert r.reserved_bytes() >= 64 << 20  # primed, kept because of the threshold
    r.set_release_threshold("1MiB")
    assert r.release_threshold == 1 << 20
    s = _cuda.stream_create()
    try:
        from dask_rmm.stream import Stream

        stream = Stream(s)
        p = r.allocate(1 << 20, stream)
        assert r.used_bytes() >= 1 << 20
        r.deallocate(p, 1 << 20, stream)
        _cuda.stream_synchronize(s)
    finally:
        _cuda.stream_destroy(s)
    _cuda.device_synchronize()  # the priming free is stream-ordered too
    r.trim_to(0)
    assert r.reserved_bytes() < 64 << 20
    with pytest.raises(ValueError, match="enable_ipc"):
        r.export_pool_handle()


@pytest.mark.gpu
def test_async_resource_ipc_export():
    if not _cuda.get_device_attribute("MemoryPoolSupportedHandleTypes") & 1:
        pytest.skip("device cannot export POSIX file descriptor pool handles")
    r = mr.CudaAsyncMemoryResource(enable_ipc=True, release_threshold=0)
    fd = r.export_pool_handle()
    assert fd >= 0
    import os

    os.close(fd)


@pytest.mark.gpu
def test_async_view_of_default_pool():
    pool = _cuda.device_get_default_mem_pool()
    view = mr.CudaAsyncViewMemoryResource(pool)
    assert view.pool_handle() == pool
    p = view.allocate(4096)
    view.deallocate(p, 4096)
    _cuda.device_synchronize()
    del view  # a view never destroys the pool it was given
    _cuda.free_async(_cuda.malloc_from_pool_async(256, pool, 0), 0)
    _cuda.device_synchronize()


@pytest.mark.gpu
def test_sam_headroom():
    if not _cuda.get_device_attribute("PageableMemoryAccess"):
        pytest.skip("device cannot access system-allocated memory (no HMM/ATS)")
    free_bytes, _ = _cuda.mem_get_info()
    r = mr.SamHeadroomMemoryResource(free_bytes + (1 << 30))  # all of it must go to the host
    p = r.allocate(1 << 20)
    ctypes.memmove(p, b"z" * 100, 100)
    r.deallocate(p, 1 << 20)
    r2 = mr.SamHeadroomMemoryResource("1GiB")
    p = r2.allocate(1 << 20)
    r2.deallocate(p, 1 << 20)
    with pytest.raises(ValueError, match="foreign pointer"):
        r2.deallocate(p, 1 << 20)


@pytest.mark.gpu
def test_resource_stays_on_its_device():
    if _cuda.get_device_count() < 2:
        pytest.skip("needs two devices")
    _cuda.set_device(1)
    try:
        r = mr.CudaMemoryResource()
    finally:
        _cuda.set_device(0)
    assert r.device_id == 1
    p = r.allocate(256)
    assert _cuda.pointer_attributes(p).device == 1
    assert _cuda.get_device() == 0
    r.deallocate(p, 256)
    assert _cuda.get_device() == 0


@pytest.mark.gpu
def test_async_pool_outlives_its_finalizer_while_memory_is_live():
    """Cyclic garbage runs finalizers in any order: a suballocator may hand memory back after
    the async resource's finalizer ran. The driver pool is destroyed only by the last free."""
    r = mr.CudaAsyncMemoryResource()
    p = r.allocate(1 << 20)
    r.__del__()
    assert r._owns_pool  # still needed: p is live
    r.deallocate(p, 1 << 20)
    assert not r._owns_pool


def test_host_memory_refuses_more_than_the_host_has_even_where_the_kernel_overcommits():
    """On the GPU host (overcommitting kernel) a 100 TiB host-memory pool was handed out; it
    must be an out-of-memory error naming the host's memory, and change nothing."""
    from dask_rmm.sizes import host_total_memory

    r = mr.SystemMemoryResource()
    total = host_total_memory()
    for n in (total + 256, 100 << 40):
        with pytest.raises(OutOfMemoryError, match="more than this host's") as info:
            r.allocate(n)
        assert info.value.requested == n
        assert r.live_allocations == 0
    r.deallocate(r.allocate(256), 256)  # still usable
