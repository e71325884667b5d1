"""Giving the workers' pooled memory back, end to end on a LocalCluster of worker processes
(host memory without a GPU): ``release_unused(client)`` now, reported per worker, never touching
buffers in use; and ``release_threshold`` with a pool trimming on its own."""

from __future__ import annotations

import pytest
from conftest import HAS_GPU, local_process_cluster, wait_until
from distributed import wait

import dask_rmm
from dask_rmm.client.fetch import cluster_report
from dask_rmm.plugin import RMMPlugin

MiB = 1 << 20
BASE = "cuda" if HAS_GPU else "system"


def burst(nbytes: int) -> int:
    """Allocate and free: the pool grows and keeps the memory."""
    from dask_rmm import DeviceBuffer

    b = DeviceBuffer(size=nbytes)
    del b
    return nbytes


def pattern(seed: int) -> object:
    """A 1 MiB buffer holding a known pattern, kept on the worker."""
    from dask_rmm import DeviceBuffer

    return DeviceBuffer.to_device(bytes([seed % 251]) * MiB)


def read(buf: object) -> bytes:
    return buf.tobytes()


def _reserved(client) -> dict[str, int]:
    return {d.worker: d.reserved_bytes for d in cluster_report(client, timeline=False).devices}


async def _beat(dask_worker=None) -> None:
    await dask_worker.heartbeat()


@pytest.fixture(scope="module")
def cluster():
    with local_process_cluster() as (cluster, client):
        yield cluster, client


@pytest.mark.slow
def test_release_unused_gives_each_workers_grown_pool_back_and_keeps_buffers_in_use(cluster):
    _, client = cluster
    client.register_plugin(RMMPlugin(base_resource=BASE, pool_size="8MiB"))
    workers = sorted(client.scheduler_info()["workers"])
    kept = [client.submit(pattern, i, workers=[w], pure=False) for i, w in enumerate(workers)]
    wait(kept)
    wait([client.submit(burst, 64 * MiB, workers=[w], pure=False) for w in workers])
    released = dask_rmm.release_unused(client)
    assert sorted(released) == workers
    for w in workers:
        [r] = released[w]
        assert r.resource == "PoolMemoryResource"
        assert r.released_bytes == 64 * MiB, r
        assert (r.reserved_before, r.reserved_after) == (72 * MiB, 8 * MiB)
        assert r.in_use_bytes >= MiB
    assert client.gather([client.submit(read, k) for k in kept]) == [
        bytes([i % 251]) * MiB for i in range(len(workers))
    ]
    client.run(_beat)
    assert set(_reserved(client).values()) == {8 * MiB}
    # nothing more to give back
    again = dask_rmm.release_unused(client, size=0)
    assert all(r.released_bytes == 0 for rs in again.values() for r in rs)
    del kept


@pytest.mark.slow
def test_release_threshold_with_a_pool_trims_it_back_on_its_own(cluster):
    _, client = cluster
    client.register_plugin(
        RMMPlugin(base_resource=BASE, pool_size="8MiB", release_threshold="16MiB")
    )
    workers = sorted(client.scheduler_info()["workers"])
    wait([client.submit(burst, 64 * MiB, workers=[w], pure=False) for w in workers])

    def trimmed() -> bool:
        client.run(_beat)
        reserved = _reserved(client)
        return sorted(reserved) == workers and all(v <= 16 * MiB for v in reserved.values())

    wait_until(trimmed, 30, "every worker's pool trimmed to its release_threshold")
    # a plugin without release_threshold stops the trimming
    client.register_plugin(RMMPlugin(base_resource=BASE, pool_size="8MiB"))
    wait([client.submit(burst, 64 * MiB, workers=[w], pure=False) for w in workers])
    has_trimmer = client.run(lambda dask_worker: "dask-rmm-trim" in dask_worker.periodic_callbacks)
    assert set(has_trimmer.values()) == {False}
