"""dask_rmm.mr.registry: per-device current resources."""

from __future__ import annotations

import threading

import pytest

from dask_rmm import _cuda, mr
from dask_rmm.mr import registry

HAS_GPU = _cuda.is_available()


def test_set_returns_previous_and_none_restores_default():
    a, b = mr.SystemMemoryResource(), mr.SystemMemoryResource()
    assert mr.set_current_device_resource(a) is None
    assert mr.get_current_device_resource() is a
    assert mr.is_initialized()
    assert mr.set_current_device_resource(b) is a
    assert mr.get_current_device_resource() is b
    assert mr.set_current_device_resource(None) is b
    assert not mr.is_initialized()


def test_per_device_is_keyed_by_device():
    a = mr.SystemMemoryResource()
    mr.set_per_device_resource(0, a)
    assert mr.get_per_device_resource(0) is a
    mr.reset_per_device_resource(0)
    assert registry._resources.get(0) is None


def test_reset_current():
    mr.set_current_device_resource(mr.SystemMemoryResource())
    mr.reset_current_device_resource()
    assert not mr.is_initialized()


@pytest.mark.parametrize("bad", [-1, 10_000, True, "0", None, 1.0])
def test_unknown_devices_refused(bad):
    with pytest.raises((TypeError, ValueError), match="device"):
        mr.set_per_device_resource(bad, mr.SystemMemoryResource())
    with pytest.raises((TypeError, ValueError), match="device"):
        mr.get_per_device_resource(bad)


def test_refuses_non_resources():
    with pytest.raises(TypeError, match="DeviceMemoryResource"):
        mr.set_current_device_resource(object())


def test_threads_see_one_registry():
    a = mr.SystemMemoryResource()
    mr.set_current_device_resource(a)
    seen = []
    threads = [
        threading.Thread(target=lambda: seen.append(mr.get_current_device_resource()))
        for _ in range(8)
    ]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert all(s is a for s in seen) and len(seen) == 8


def test_reset_for_tests_clears():
    mr.set_current_device_resource(mr.SystemMemoryResource())
    registry._reset_for_tests()
    assert not mr.is_initialized()


@pytest.mark.skipif(HAS_GPU, reason="checks the no-GPU path")
def test_no_gpu_default_is_clear_error():
    with pytest.raises(_cuda.CUDAUnavailableError, match="SystemMemoryResource"):
        mr.get_current_device_resource()
    with pytest.raises(_cuda.CUDAUnavailableError):
        mr.available_device_memory()
    assert not mr.is_initialized()


@pytest.mark.gpu
def test_default_is_lazily_made_cuda_resource():
    assert not mr.is_initialized()
    r = mr.get_current_device_resource()
    assert type(r) is mr.CudaMemoryResource
    assert r is mr.get_current_device_resource()
    assert r.device_id == _cuda.get_device()
    assert mr.is_initialized()


@pytest.mark.gpu
def test_lazy_default_made_once_under_threads():
    got = []
    threads = [
        threading.Thread(target=lambda: got.append(mr.get_per_device_resource(0))) for _ in range(8)
    ]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len({id(r) for r in got}) == 1


@pytest.mark.gpu
def test_available_device_memory():
    free_bytes, total = mr.available_device_memory()
    assert 0 < free_bytes <= total
