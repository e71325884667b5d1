"""reinitialize, hooks, per-device logging, is_initialized."""

from __future__ import annotations

import csv

import pytest

import dask_rmm
from dask_rmm import _cuda, initialize
from dask_rmm.device_buffer import DeviceBuffer
from dask_rmm.mr import (
    LoggingResourceAdaptor,
    PoolMemoryResource,
    SystemMemoryResource,
    get_current_device_resource,
    get_per_device_resource,
)

HAS_GPU = _cuda.is_available()


@pytest.fixture(autouse=True)
def _hooks():
    yield
    initialize._reinitialize_hooks.clear()


@pytest.fixture(params=["system"] + (["cuda", "managed", "async"] if HAS_GPU else []))
def base(request):
    return request.param


def test_plain_base(base):
    dask_rmm.reinitialize(base_resource=base)
    mr = get_current_device_resource()
    expected = {
        "system": "SystemMemoryResource",
        "cuda": "CudaMemoryResource",
        "managed": "ManagedMemoryResource",
        "async": "CudaAsyncMemoryResource",
    }[base]
    assert type(mr).__name__ == expected
    assert dask_rmm.is_initialized()


def test_pool_with_sizes(base):
    dask_rmm.reinitialize(
        pool_allocator=True,
        initial_pool_size="16MiB",
        maximum_pool_size=64 << 20,
        base_resource=base,
    )
    mr = get_current_device_resource()
    if base == "async":  # the sizes are cudaMallocAsync's own pool's, as in dask-cuda
        assert type(mr).__name__ == "LimitingResourceAdaptor"
        assert mr.get_allocation_limit() == 64 << 20
        return
    assert isinstance(mr, PoolMemoryResource)
    assert mr.pool_size() == 16 << 20 and mr.maximum_pool_size == 64 << 20


def test_initial_above_maximum_is_a_value_and_runtime_error():
    dask_rmm.reinitialize(base_resource="system")
    before = get_current_device_resource()
    with pytest.raises(
        ValueError,
        match="Initial pool size exceeds the maximum pool size: `maximum_pool_size` .*smaller than `pool_size`",
    ) as info:
        dask_rmm.reinitialize(
            pool_allocator=True,
            initial_pool_size="64MiB",
            maximum_pool_size="16MiB",
            base_resource="system",
        )
    assert isinstance(info.value, RuntimeError)  # what RMM raises
    assert get_current_device_resource() is before


def test_live_buffers_survive_reinitialize(base):
    dask_rmm.reinitialize(pool_allocator=True, initial_pool_size="8MiB", base_resource=base)
    old = get_current_device_resource()
    p = old.allocate(4096)
    dask_rmm.reinitialize(base_resource=base)
    assert get_current_device_resource() is not old
    q = get_current_device_resource().allocate(4096)
    old.deallocate(p, 4096)  # the old pool is still alive and takes it back
    get_current_device_resource().deallocate(q, 4096)


def test_live_device_buffer_survives_reinitialize():
    dask_rmm.reinitialize(pool_allocator=True, initial_pool_size="8MiB", base_resource="system")
    old = get_current_device_resource()
    assert isinstance(old, PoolMemoryResource)
    buf = DeviceBuffer.to_device(b"\x07" * 1000)
    dask_rmm.reinitialize(base_resource="system")
    assert get_current_device_resource() is not old
    assert buf.mr is old  # the buffer keeps the resource it came from
    assert buf.tobytes() == b"\x07" * 1000
    assert len(old.live_allocations()) == 1
    del buf  # a failing free would be an unraisable exception: an error under the warning filter
    assert old.live_allocations() == {}  # freed through the old pool


def test_logging_one_file_per_device(tmp_path, base):
    dask_rmm.reinitialize(logging=True, log_file_name=tmp_path / "rmm.csv", base_resource=base)
    names = dask_rmm.get_log_filenames()
    assert names == {0: str(tmp_path / "rmm.dev0.csv")}
    mr = get_current_device_resource()
    assert isinstance(mr, LoggingResourceAdaptor)
    mr.deallocate(mr.allocate(256), 256)
    mr.flush()
    with open(names[0]) as f:
        assert [r[2] for r in csv.reader(f)] == ["Action", "allocate", "free"]


@pytest.mark.gpu
def test_logging_file_per_gpu(tmp_path):
    n = _cuda.get_device_count()
    dask_rmm.reinitialize(devices=list(range(n)), logging=True, log_file_name=tmp_path / "r.log")
    assert dask_rmm.get_log_filenames() == {d: str(tmp_path / f"r.dev{d}.log") for d in range(n)}
    for d in range(n):
        assert get_per_device_resource(d).device_id == d


def test_logging_from_env(tmp_path, monkeypatch):
    monkeypatch.setenv("RMM_LOG_FILE", str(tmp_path / "env.log"))
    dask_rmm.reinitialize(logging=True, base_resource="system")
    assert dask_rmm.get_log_filenames()[0] == str(tmp_path / "env.dev0.log")


def test_logging_without_name_fails_before_anything(monkeypatch):
    monkeypatch.delenv("RMM_LOG_FILE", raising=False)
    ran = []
    dask_rmm.register_reinitialize_hook(ran.append, 1)
    dask_rmm.reinitialize(base_resource="system")
    ran.clear()
    before = get_current_device_resource()
    with pytest.raises(ValueError, match="RMM_LOG_FILE"):
        dask_rmm.reinitialize(logging=True, base_resource="system")
    assert ran == [] and get_current_device_resource() is before


def test_enable_disable_logging(tmp_path):
    dask_rmm.reinitialize(base_resource="system")
    base = get_current_device_resource()
    assert dask_rmm.get_log_filenames() == {0: None}
    dask_rmm.enable_logging(tmp_path / "on.csv")
    logging_mr = get_current_device_resource()
    assert logging_mr.get_upstream() is base
    dask_rmm.enable_logging(tmp_path / "other.csv")  # already logging: unchanged
    assert get_current_device_resource() is logging_mr
    assert dask_rmm.get_log_filenames() == {0: str(tmp_path / "on.dev0.csv")}
    dask_rmm.disable_logging()
    assert get_current_device_resource() is base
    assert dask_rmm.get_log_filenames() == {0: None}


def test_hooks_run_in_reverse_order_with_args():
    calls = []
    dask_rmm.register_reinitialize_hook(lambda *a, **k: calls.append(("first", a, k)), 1, x=2)
    second = dask_rmm.register_reinitialize_hook(lambda: calls.append(("second", (), {})))
    dask_rmm.reinitialize(base_resource="system")
    assert calls == [("second", (), {}), ("first", (1,), {"x": 2})]
    dask_rmm.unregister_reinitialize_hook(second)
    calls.clear()
    dask_rmm.reinitialize(base_resource="system")
    assert [c[0] for c in calls] == ["first"]


def test_unregister_removes_every_registration():
    calls = []
    dask_rmm.register_reinitialize_hook(calls.append, "a")
    dask_rmm.register_reinitialize_hook(calls.append, "b")
    dask_rmm.unregister_reinitialize_hook(calls.append)
    dask_rmm.unregister_reinitialize_hook(calls.append)  # no error
    dask_rmm.reinitialize(base_resource="system")
    assert calls == []


def test_hook_may_free_old_buffers():
    dask_rmm.reinitialize(base_resource="system")
    old = get_current_device_resource()
    held = [old.allocate(512)]
    dask_rmm.register_reinitialize_hook(lambda: old.deallocate(held.pop(), 512))
    dask_rmm.reinitialize(base_resource="system")
    assert held == [] and old.live_allocations == 0


@pytest.mark.parametrize(
    "kwargs, exc, match",
    [
        ({"base_resource": "tpu"}, ValueError, "must be one of"),
        ({"base_resource": "system", "managed_memory": True}, ValueError, "conflicts"),
        ({"base_resource": "system", "devices": "0"}, TypeError, "devices"),
        ({"base_resource": "system", "devices": [0, True]}, TypeError, "devices"),
        ({"base_resource": "system", "devices": 99}, ValueError, "does not exist"),
        ({"base_resource": "system", "devices": []}, ValueError, "at least one"),
        (
            {"base_resource": "system", "pool_allocator": True, "initial_pool_size": "lots"},
            ValueError,
            "pool_size='lots'",
        ),
        (
            {"base_resource": "system", "pool_allocator": True, "initial_pool_size": "GiB"},
            ValueError,
            "pool_size='GiB'",
        ),
    ],
)
def test_bad_input(kwargs, exc, match):
    dask_rmm.reinitialize(base_resource="system")
    before = get_current_device_resource()
    with pytest.raises(exc, match=match):
        dask_rmm.reinitialize(**kwargs)
    assert get_current_device_resource() is before


@pytest.mark.skipif(HAS_GPU, reason="checks the no-GPU error")
@pytest.mark.parametrize("base", ["cuda", "managed", "async", "pinned", None])
def test_gpu_bases_need_a_gpu(base):
    with pytest.raises(_cuda.CUDAUnavailableError, match="system"):
        dask_rmm.reinitialize(base_resource=base)


def test_hook_must_be_callable():
    with pytest.raises(TypeError):
        dask_rmm.register_reinitialize_hook(5)


def test_rmm_error():
    import pickle

    e = dask_rmm.RMMError(3, "bad")
    assert e.errcode == 3 and str(e) == "bad"
    e2 = pickle.loads(pickle.dumps(e))
    assert e2.errcode == 3 and str(e2) == "bad"


def test_devices_none_means_device_zero():
    dask_rmm.reinitialize(devices=None, base_resource="system")
    assert isinstance(get_per_device_resource(0), SystemMemoryResource)
