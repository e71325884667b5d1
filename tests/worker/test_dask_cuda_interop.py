"""dask-rmm beside dask-cuda: RMMPlugin on a ``LocalCUDACluster`` (a CuPy dask.array workload,
the report), and what happens when dask-cuda has set compiled RMM up first.

dask-cuda's ``rmm_pool_size`` builds compiled RMM's pool (``rmm.reinitialize``) and
``rmm_allocator_external_lib_list=["cupy"]`` points CuPy at ``rmm.allocators.cupy``. dask-rmm is
a separate allocator stack with its own per-device registry: RMMPlugin does not replace or
touch compiled RMM's resource (its pool stays reserved, and cuDF and anything else that
allocates through compiled RMM keep using it, uncounted by dask-rmm); with
``allocators=["cupy"]`` it points CuPy at dask-rmm's stack, and unregistering gives CuPy back
the allocator it had (compiled RMM's). The plugin logs which one CuPy allocates through.
Needs dask_cuda, CuPy and a GPU; skips with a reason otherwise.
"""

from __future__ import annotations

import pytest
from conftest import wait_until
from distributed import Client, wait
from gpu_cluster import (
    beat,
    capture_dask_rmm_logs,
    compiled_rmm_state,
    cupy_allocator_name,
    cupy_ones,
    dask_rmm_logs,
    gpu_name,
)

from dask_rmm.client.fetch import cluster_report
from dask_rmm.plugin import RMMPlugin

pytestmark = [pytest.mark.gpu, pytest.mark.slow]

MiB = 1 << 20
OURS = "dask_rmm.allocators.cupy.CupyPoolCache"  # what allocators=["cupy"] installs
COMPILED = "rmm.allocators.cupy.rmm_cupy_allocator"


@pytest.fixture(scope="module")
def dask_cuda():
    pytest.importorskip("cupy")
    from dask_rmm import _cuda

    if not _cuda.is_available():
        pytest.skip("needs a CUDA device")
    return pytest.importorskip("dask_cuda", reason="needs dask_cuda (pip install dask-cuda)")


def test_rmm_plugin_on_local_cuda_cluster(dask_cuda):
    import cupy
    import dask.array as da

    n = 1 << 21
    with (
        dask_cuda.LocalCUDACluster(n_workers=1, protocol="tcp", dashboard_address=":0") as cluster,
        Client(cluster) as client,
    ):
        client.register_plugin(RMMPlugin(pool_size="1GiB", allocators=["cupy"]))
        (w,) = client.scheduler_info()["workers"]
        assert client.run(cupy_allocator_name) == {w: OURS}

        x = da.arange(n, chunks=n // 8).map_blocks(cupy.asarray)
        y = (x * 2 + 1).persist()
        wait(y)
        assert int(y.sum().compute()) == n * n  # sum of the first n odd numbers
        assert isinstance(y.blocks[0].compute(), cupy.ndarray)

        client.run(beat)
        report = cluster_report(client)
        assert report.workers == [w]
        dev = report.device(w, 0)
        assert dev.gpu_name == client.run(gpu_name)[w] and dev.gpu_name != "host"
        assert dev.gpu_uuid.startswith("GPU-")
        assert dev.reserved_bytes == 1 << 30
        assert dev.current_bytes >= n * 8  # the persisted int64 chunks live in the pool
        groups = {g.prefix: g for g in dev.task_groups}
        assert groups and sum(g.current_bytes for g in groups.values()) >= n * 8
        assert max(g.peak_bytes for g in groups.values()) >= n // 8 * 8
        del x, y


def test_rmm_plugin_beside_dask_cudas_compiled_rmm_pool(dask_cuda):
    with (
        dask_cuda.LocalCUDACluster(
            n_workers=1,
            protocol="tcp",
            dashboard_address=":0",
            rmm_pool_size="512MiB",
            rmm_allocator_external_lib_list=["cupy"],
        ) as cluster,
        Client(cluster) as client,
    ):
        (w,) = client.scheduler_info()["workers"]
        before = client.run(compiled_rmm_state)[w]
        assert before["allocator"] == COMPILED
        assert before["pool_size"] is not None and before["pool_size"] >= 512 * MiB, before

        client.run(capture_dask_rmm_logs)
        client.register_plugin(RMMPlugin(pool_size="256MiB", allocators=["cupy"]))
        logs = client.run(dask_rmm_logs)[w]
        assert any("CuPy allocates through" in line and OURS in line for line in logs), logs

        # CuPy now allocates through dask-rmm (counted); compiled RMM's pool is left alone.
        held = client.submit(cupy_ones, 700 * MiB, key="big-through-dask-rmm")
        wait(held)
        during = client.run(compiled_rmm_state)[w]
        assert during == dict(before, allocator=OURS)
        client.run(beat)
        assert cluster_report(client).device(w, 0).current_bytes == 700 * MiB
        del held

        # Unregistering gives CuPy back compiled RMM's allocator; its pool serves CuPy again.
        client.unregister_worker_plugin("dask-rmm")
        wait_until(
            lambda: client.run(cupy_allocator_name)[w] == COMPILED,
            what="CuPy's allocator to be compiled RMM's again",
        )
        held = client.submit(cupy_ones, 700 * MiB, key="big-through-compiled-rmm")
        wait(held)
        after = client.run(compiled_rmm_state)[w]
        assert after["resource_id"] == before["resource_id"]
        assert after["pool_size"] > before["pool_size"]  # 700 MiB did not fit in 512 MiB
        client.run(beat)
        assert w in cluster_report(client).workers_without_dask_rmm
        del held
