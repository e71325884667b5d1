"""Memory admission on a real device: honest peaks (a task's growth in bytes in use across
every library, also when its blocks come from a cache), and tasks held back by them."""

from __future__ import annotations

import time

import pytest
from distributed.utils_test import gen_cluster

from tests.worker.test_admission import CONFIG, HOLD, _reset, _states, until  # noqa: F401

pytestmark = pytest.mark.gpu

MiB, GiB = 1 << 20, 1 << 30


def one_gib(library: str, seconds: float = 0.2) -> int:
    """Hold 1 GiB through ``library`` for ``seconds`` (0.2: longer than the admission
    sampler's interval; 0: freed before its next tick), then free it: a temporary, as most
    tasks' memory is."""
    if library == "torch":
        import torch

        x = torch.ones(GiB // 4, dtype=torch.float32, device="cuda")
        torch.cuda.synchronize()
    elif library == "devicebuffer":
        from dask_rmm import DeviceBuffer

        x = DeviceBuffer(size=GiB)
    else:
        import cupy

        x = cupy.ones(GiB // 8, dtype="float64")
        cupy.cuda.runtime.deviceSynchronize()
    time.sleep(seconds)
    del x
    return 1


@pytest.mark.parametrize(
    "library, allocators, seconds",
    [
        ("cupy", ["cupy"], 0.2),
        ("devicebuffer", [], 0.2),
        ("torch", ["torch"], 0.2),
        ("cupy-exact", ["cupy"], 0.2),
        # brief: freed between two ticks; CuPy's cache serves the array from the 2nd run on
        ("cupy", ["cupy"], 0),
        ("devicebuffer", [], 0),
    ],
    ids=["cupy", "devicebuffer", "torch", "cupy-exact", "cupy-brief", "devicebuffer-brief"],
)
def test_a_task_is_learned_at_its_peak_on_its_2nd_10th_and_100th_run(library, allocators, seconds):
    if library.startswith("cupy"):
        pytest.importorskip("cupy")
    if library == "torch":
        pytest.importorskip("torch")
    from dask_rmm import RMMPlugin
    from dask_rmm.worker.admission import admission_of

    @gen_cluster(client=True, nthreads=[("127.0.0.1", 1)], config=CONFIG, timeout=300)
    async def run(c, s, a):
        exact = ["cupy"] if library == "cupy-exact" else None
        await c.register_plugin(
            RMMPlugin(
                pool_size="2GiB",
                maximum_pool_size="4GiB",
                allocators=allocators,
                exact_allocators=exact,
                memory_admission=True,
            )
        )
        name = library.split("-")[0]
        peaks = admission_of(a).peaks
        for i in range(1, 101):
            assert await c.submit(one_gib, name, seconds, key=f"gib-{i}") == 1
            if i in (2, 10, 100):
                # the peak of this run alone: the table keeps the largest of the last 16
                assert peaks._peaks["gib"][-1] >= GiB, (i, list(peaks._peaks["gib"]))

    run()


def hold_cupy(nbytes: int, i: int) -> int:
    import cupy

    x = cupy.ones(nbytes // 8, dtype="float64")
    HOLD.wait(30)
    value = int(x[:1].get()[0])
    del x
    return i * value


@gen_cluster(client=True, nthreads=[("127.0.0.1", 4)], config=CONFIG)
async def test_cupy_tasks_served_by_its_cache_wait_until_their_peak_fits_the_pool(c, s, a):
    pytest.importorskip("cupy")
    from dask_rmm import RMMPlugin

    await c.register_plugin(
        RMMPlugin(
            pool_size="64MiB", maximum_pool_size="64MiB", allocators=["cupy"], memory_admission=True
        )
    )
    HOLD.set()
    for i in range(30):  # CuPy's pool serves them from its cache after the first
        assert await c.submit(hold_cupy, 24 * MiB, 1, key=f"cupyhold-{100 + i}") == 1
    HOLD.clear()
    futures = c.map(hold_cupy, [24 * MiB] * 6, range(6), key=[f"cupyhold-{i}" for i in range(6)])
    # 64 MiB: two of 24 MiB fit; the other four wait, though CuPy's cache served them all
    await until(lambda: _states(a)["constrained"] == 4, "4 constrained")
    HOLD.set()
    assert await c.gather(futures) == list(range(6))
    from dask_rmm.worker.admission import admission_of

    assert admission_of(a).pressure.metrics()[0].oom_count == 0
