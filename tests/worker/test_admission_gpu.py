"""Memory admission on a real device: CuPy tasks are charged their own arrays (CuPy per
allocation through the stack), so a worker with 4 threads runs only the tasks whose learned
peaks fit its pool."""

from __future__ import annotations

import pytest
from distributed.utils_test import gen_cluster

from tests.worker.test_admission import CONFIG, HOLD, _reset, _running_and_held, until  # noqa: F401

pytestmark = pytest.mark.gpu

MiB = 1 << 20


def hold_cupy(nbytes: int, i: int, wait: bool = True) -> int:
    """A CuPy array of ``nbytes`` kept until HOLD is set."""
    import cupy

    x = cupy.ones(nbytes // 8, dtype="float64")
    if wait:
        HOLD.wait(30)
    value = int(x[:1].get()[0])
    del x
    return i * value


@gen_cluster(client=True, nthreads=[("127.0.0.1", 4)], config=CONFIG)
async def test_cupy_tasks_wait_until_their_learned_peak_fits_the_pool(c, s, a):
    pytest.importorskip("cupy")
    from dask_rmm import RMMPlugin
    from dask_rmm.worker.admission import admission_of

    await c.register_plugin(
        RMMPlugin(
            pool_size="64MiB",
            maximum_pool_size="64MiB",
            allocators=["cupy"],
            exact_allocators=["cupy"],
            memory_admission=True,
        )
    )
    HOLD.set()
    assert await c.submit(hold_cupy, 24 * MiB, 1, False, key="cupyhold-100") == 1
    assert 24 * MiB <= admission_of(a).gate.peaks.expected("cupyhold") < 25 * MiB
    HOLD.clear()
    futures = c.map(hold_cupy, [24 * MiB] * 6, range(6), key=[f"cupyhold-{i}" for i in range(6)])
    await until(lambda: _running_and_held(a) == (2, 2), "2 running, 2 held back")
    HOLD.set()
    assert await c.gather(futures) == list(range(6))
    assert admission_of(a).pressure.metrics()[0].oom_count == 0
