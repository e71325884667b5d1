"""PrefetchResourceAdaptor: passes allocations through, prefetches managed memory on a GPU."""

from __future__ import annotations

import pytest

from dask_rmm import _cuda
from dask_rmm.mr import ManagedMemoryResource, PrefetchResourceAdaptor


def test_pass_through(base_resource):
    mr = PrefetchResourceAdaptor(base_resource)
    p = mr.allocate(4096)
    assert p % 256 == 0
    with pytest.raises(ValueError):
        mr.deallocate(p, 1)
    mr.deallocate(p, 4096)
    assert mr.allocate(0) == 0
    assert mr.device_id == base_resource.device_id


def test_no_prefetch_without_cuda(monkeypatch, base_resource):
    monkeypatch.setattr(_cuda, "is_available", lambda: False)
    called = []
    monkeypatch.setattr(_cuda, "mem_prefetch_async", lambda *a: called.append(a), raising=False)
    mr = PrefetchResourceAdaptor(base_resource)
    mr.deallocate(mr.allocate(512), 512)
    assert called == [] and mr.prefetch_count == 0


def test_prefetch_called_with_device_and_stream(monkeypatch, base_resource):
    monkeypatch.setattr(_cuda, "is_available", lambda: True)
    called = []
    monkeypatch.setattr(_cuda, "mem_prefetch_async", lambda *a: called.append(a), raising=False)
    mr = PrefetchResourceAdaptor(base_resource)
    p = mr.allocate(512)
    assert called == [(p, 512, base_resource.device_id, 0)]
    mr.deallocate(p, 512)


def test_invalid_value_is_ignored_other_errors_free_and_raise(monkeypatch, base_resource):
    monkeypatch.setattr(_cuda, "is_available", lambda: True)

    def invalid(*a):
        raise _cuda.CUDAError("cudaErrorInvalidValue", "cudaMemPrefetchAsync")

    monkeypatch.setattr(_cuda, "mem_prefetch_async", invalid, raising=False)
    mr = PrefetchResourceAdaptor(base_resource)
    mr.deallocate(mr.allocate(256), 256)

    def broken(*a):
        raise _cuda.CUDAError("cudaErrorIllegalAddress", "cudaMemPrefetchAsync")

    monkeypatch.setattr(_cuda, "mem_prefetch_async", broken, raising=False)
    with pytest.raises(_cuda.CUDAError, match="IllegalAddress"):
        mr.allocate(256)
    if hasattr(base_resource, "live_allocations"):
        assert base_resource.live_allocations == 0  # the failed allocation was given back


@pytest.mark.gpu
def test_prefetches_managed_memory():
    mr = PrefetchResourceAdaptor(ManagedMemoryResource())
    p = mr.allocate(1 << 20)
    assert mr.prefetch_count == 1
    _cuda.device_synchronize()
    mr.deallocate(p, 1 << 20)
