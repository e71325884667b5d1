"""Decides which base resources this host can make, and resets global state after each test.

"system" always; "cuda", "managed", "async" (and "pinned" for host-side tests) when a CUDA
device is present. Suballocator, adaptor and Dask tests parametrize over ``base_resource``.
"""

from __future__ import annotations

import pytest

from dask_rmm import _cuda

HAS_GPU = _cuda.is_available()

#: Base resources usable as a suballocator's upstream on this host.
BASE_RESOURCES = ["system"] + (["cuda", "managed", "async"] if HAS_GPU else [])


def make_base_resource(name: str):
    """A fresh base resource by short name ("system", "cuda", "managed", "async", "pinned")."""
    from dask_rmm import mr

    if name == "system":
        return mr.SystemMemoryResource()
    if name == "cuda":
        return mr.CudaMemoryResource()
    if name == "managed":
        return mr.ManagedMemoryResource()
    if name == "async":
        return mr.CudaAsyncMemoryResource()
    if name == "pinned":
        return mr.PinnedHostMemoryResource()
    raise ValueError(name)


def pytest_collection_modifyitems(config, items):
    if HAS_GPU:
        return
    skip = pytest.mark.skip(reason="needs a CUDA device; this host has none (cuda-python reports no usable GPU)")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(params=BASE_RESOURCES)
def base_resource_name(request):
    return request.param


@pytest.fixture
def base_resource(base_resource_name):
    return make_base_resource(base_resource_name)


@pytest.fixture(autouse=True)
def _reset_global_state():
    """Every test starts and ends with the default per-device resources."""
    yield
    try:
        from dask_rmm.mr import registry
    except ImportError:
        return
    reset = getattr(registry, "_reset_for_tests", None)
    if reset is not None:
        reset()
