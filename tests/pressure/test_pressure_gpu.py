"""Memory pressure on a real device: CuPy and Numba arrays spilled and brought back bit for bit
(dtype, shape, strides, order), and a device pool served several times over by spilling."""

from __future__ import annotations

import pprint

import pytest

pytestmark = pytest.mark.gpu

MiB = 1 << 20


@pytest.fixture(params=["cache", "exact"])
def cupy_on_pool(request):
    """CuPy allocating through a 64 MiB device pool with spill-on-OOM on top, through CuPy's
    pool in front of it (the default) and per allocation; yields ``(cupy, WorkerPressure)``."""
    cupy = pytest.importorskip("cupy")
    from dask_rmm.allocators.cupy import reset_cupy_allocator, set_cupy_allocator
    from tests.pressure_helpers import pressure_stack

    wp, top = pressure_stack(64 * MiB, base="cuda", spill_on_oom=True)
    set_cupy_allocator(cache=request.param == "cache")
    try:
        yield cupy, wp
    finally:
        reset_cupy_allocator()


def _same(cupy, a, b) -> None:
    assert type(b) is type(a)
    assert (b.shape, b.strides, b.dtype) == (a.shape, a.strides, a.dtype)
    assert (b.flags.c_contiguous, b.flags.f_contiguous) == (
        a.flags.c_contiguous,
        a.flags.f_contiguous,
    )
    assert cupy.asnumpy(a).tobytes() == cupy.asnumpy(b).tobytes()


@pytest.mark.parametrize(
    "make",
    [
        lambda cp: cp.arange(1000, dtype="float32").reshape(10, 100),
        lambda cp: cp.asfortranarray(cp.arange(1000, dtype="int16").reshape(20, 50)),
        lambda cp: cp.arange(1000, dtype="float64")[::3],
        lambda cp: cp.arange(1000, dtype="int32")[::-2],
        lambda cp: cp.arange(600, dtype="complex64").reshape(20, 30).T[2:9, ::4],
        lambda cp: cp.arange(100) % 3 == 0,
        lambda cp: cp.empty((0, 5), dtype="float32"),
        lambda cp: cp.asarray(7.5),
    ],
    ids=["c", "f", "step", "reversed", "transposed-slice", "bool", "empty", "0d"],
)
def test_cupy_roundtrip_is_bit_identical(cupy_on_pool, make):
    from dask_rmm.pressure.device_objects import device_allocations, to_host

    cupy, _wp = cupy_on_pool
    a = make(cupy)
    assert device_allocations(a) is not None
    b = to_host(a).to_device()
    _same(cupy, a, b)


def test_cupy_outputs_several_times_the_pool(cupy_on_pool):
    cupy, wp = cupy_on_pool
    store = wp.store
    for i in range(12):  # 12 x 16 MiB in a 64 MiB pool
        store[f"x-{i}"] = cupy.full(2 * MiB, i, dtype="float64")
    assert wp.metrics()[0].spilled_count >= 8
    for i in range(12):
        x = store[f"x-{i}"]
        assert float(x.min()) == float(x.max()) == i
        del x


def test_a_batch_of_cupy_victims_synchronizes_the_device_once(cupy_on_pool, monkeypatch):
    from dask_rmm import _cuda

    cupy, wp = cupy_on_pool
    store = wp.store
    for i in range(3):
        store[f"x-{i}"] = cupy.full(MiB, i, dtype="float64")
    calls = []
    real = _cuda.device_synchronize

    def counted(*args):
        calls.append(args)
        return real(*args)

    monkeypatch.setattr(_cuda, "device_synchronize", counted)
    assert store.spill(3 * 8 * MiB) == 3 * 8 * MiB  # one batch of three victims
    assert len(calls) == 1
    for i in range(3):
        assert float(store[f"x-{i}"].max()) == i


def test_cupy_request_larger_than_the_pool_is_a_demand_oom(cupy_on_pool):
    cupy, wp = cupy_on_pool
    with pytest.raises(MemoryError):
        cupy.empty(80 * MiB, dtype="u1")
    assert wp.oom_events()[-1].verdict == "demand"


def test_numba_roundtrip_is_bit_identical():
    numba_cuda = pytest.importorskip("numba.cuda")
    import numpy as np

    from dask_rmm.pressure.device_objects import device_allocations, to_host

    host = np.arange(2000, dtype="float32").reshape(40, 50)
    for d in (
        numba_cuda.to_device(host),
        numba_cuda.to_device(host)[::2, 3:30:3],
        numba_cuda.to_device(np.asfortranarray(host)),
        numba_cuda.to_device(np.zeros((0, 3), "int8")),
    ):
        assert device_allocations(d) is not None
        back = to_host(d).to_device()
        assert (back.shape, back.strides, back.dtype) == (d.shape, d.strides, d.dtype)
        assert np.array_equal(back.copy_to_host(), d.copy_to_host())


def _cupy_chunks(n: int, chunk: int):
    import cupy
    import dask.array as da

    return da.arange(n, chunks=chunk, dtype="f8").map_blocks(cupy.asarray)


@pytest.mark.slow
@pytest.mark.parametrize("exact", [[], ["cupy"]], ids=["cache", "exact"])
@pytest.mark.parametrize(
    "options",
    [
        {},
        {"device_memory_limit": "48MiB"},
        {"spill_on_oom": True, "device_pause_fraction": None},
    ],
    ids=["no-options", "device_memory_limit", "spill_on_oom"],
)
def test_cupy_workload_four_times_the_pool(options, exact):
    """256 MiB of persisted CuPy chunks per 64 MiB device pool: out of memory without the
    options, exact results with either of them."""
    pytest.importorskip("cupy")
    from distributed import Client, LocalCluster, wait

    from dask_rmm import RMMPlugin
    from tests.pressure_helpers import capture_oom_layout, oom_layouts, worker_pressure_state

    n, chunk = 32 << 20, 1 << 20  # 256 MiB in 8 MiB chunks
    with (
        LocalCluster(
            n_workers=1, threads_per_worker=1, processes=True,
            dashboard_address=":0", worker_dashboard_address=None,
        ) as cluster,
        Client(cluster) as client,
    ):  # fmt: skip
        client.register_plugin(
            RMMPlugin(
                pool_size="64MiB",
                maximum_pool_size="64MiB",
                allocators=["cupy"],
                exact_allocators=exact,
                **options,
            )
        )
        x = _cupy_chunks(n, chunk).persist()
        if not options:
            with pytest.raises(MemoryError):
                wait(x)
                x.sum().compute()
            return
        assert client.run(capture_oom_layout) == {a: True for a in client.run(lambda: 0)}
        try:
            wait(x)
            total = float((x * 2).sum().compute())
        except MemoryError as e:
            # What held the pool at each OOM that got through: the failure says why.
            pictures = client.run(oom_layouts)
            raise AssertionError(f"{e}\n{pprint.pformat(pictures, width=160)}") from e
        assert total == float(n) * (n - 1)
        (state,) = client.run(worker_pressure_state).values()
        assert state["metrics"][0]["total_spilled_bytes"] >= 128 << 20
