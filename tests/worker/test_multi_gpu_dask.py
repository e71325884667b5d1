"""RMMPlugin across GPUs: one worker process per GPU (each seeing its GPU as device 0, as under
dask-cuda), one worker with two devices, and all-or-nothing setup across the two GPUs. Needs
two CUDA devices and CuPy; skips with a reason otherwise."""

from __future__ import annotations

import pytest
from conftest import wait_until
from distributed import wait
from gpu_cluster import (
    beat,
    collect_garbage,
    cupy_ones,
    device_total_memory,
    device_used_bytes,
    occupy,
    one_worker_per_gpu,
    release_occupied,
    worker_setup,
)

from dask_rmm.client.fetch import cluster_report
from dask_rmm.plugin import RMMPlugin, RMMSetupError

pytestmark = [pytest.mark.gpu, pytest.mark.slow]

MiB = 1 << 20


@pytest.fixture(scope="module")
def two_gpus():
    """Skips unless this process sees two CUDA devices and CuPy imports."""
    pytest.importorskip("cupy")
    from dask_rmm import _cuda

    n = _cuda.get_device_count() if _cuda.is_available() else 0
    if n < 2:
        pytest.skip(f"needs two CUDA devices; this process sees {n}")
    from dask_rmm.worker.metrics import device_identity

    return {device_identity(d, False)["gpu_uuid"] for d in (0, 1)}


@pytest.fixture(scope="module")
def per_gpu_cluster(two_gpus):
    with one_worker_per_gpu(2) as (cluster, client, addresses):
        yield client, addresses


def _report(client):
    client.run(beat)
    return cluster_report(client)


def test_one_worker_per_gpu_each_reports_its_own_gpu(per_gpu_cluster, two_gpus):
    client, (w0, w1) = per_gpu_cluster
    client.register_plugin(RMMPlugin(pool_size="256MiB", allocators=["cupy"]))
    held = [
        client.submit(cupy_ones, 3 * MiB, key="onfirst-gpu", workers=[w0]),
        client.submit(cupy_ones, 5 * MiB, key="onsecond-gpu", workers=[w1]),
    ]
    wait(held)
    report = _report(client)
    assert sorted(report.workers) == sorted([w0, w1])
    assert [d.device for d in report.running] == ["0", "0"]  # each sees its GPU as device 0
    d0, d1 = report.device(w0, 0), report.device(w1, 0)
    # two physical GPUs, the two this process sees as devices 0 and 1
    assert d0.gpu_uuid != d1.gpu_uuid
    assert {d0.gpu_uuid, d1.gpu_uuid} == two_gpus
    for d, nbytes, group in ((d0, 3 * MiB, "onfirst-gpu"), (d1, 5 * MiB, "onsecond-gpu")):
        assert d.gpu_name and d.gpu_name != "host"
        assert d.reserved_bytes == 256 * MiB  # each worker's pool is counted on its row
        assert d.current_bytes == nbytes  # CuPy allocated through the pool
        assert {g.prefix: g.current_bytes for g in d.task_groups}[group] == nbytes
    assert report.totals.reserved_bytes == 512 * MiB
    del held


def test_all_or_nothing_across_two_gpus(per_gpu_cluster):
    client, (w0, w1) = per_gpu_cluster
    first = RMMPlugin(pool_size="128MiB", allocators=["cupy"])
    client.register_plugin(first)
    before = client.run(worker_setup)
    assert {s["token"] for s in before.values()} == {first.token}
    assert all(s["pool_size"] == {"0": 128 * MiB} for s in before.values())

    # Larger than either GPU: both fail (checked before any memory is taken).
    with pytest.raises(RMMSetupError, match="failed on 2 workers,") as info:
        client.register_plugin(RMMPlugin(pool_size="1PiB", allocators=["cupy"]))
    assert f"{w0}: " in str(info.value) and f"{w1}: " in str(info.value)
    assert client.run(worker_setup) == before

    # Fits the first GPU but not the second, whose memory is mostly held outside any
    # resource: the first builds its pool, the vote fails, and neither changes.
    total = client.run(device_total_memory, workers=[w1])[w1]
    client.run(occupy, int(total * 0.7), workers=[w1])
    try:
        with pytest.raises(RMMSetupError, match="failed on 1 worker,") as info:
            client.register_plugin(RMMPlugin(pool_size=0.5, allocators=["cupy"]))
        message = str(info.value)
        assert f"{w1}: " in message and f"{w0}: " not in message, message
        assert client.run(worker_setup) == before
        # the first GPU's pool that was built for nothing is given back
        total0 = client.run(device_total_memory, workers=[w0])[w0]

        def released():
            client.run(collect_garbage, workers=[w0])
            return client.run(device_used_bytes, workers=[w0])[w0] < total0 * 0.4

        wait_until(released, what="the discarded 50% pool on the first GPU to be freed")
    finally:
        client.run(release_occupied, workers=[w1])

    # the previous setup still serves and counts allocations on both GPUs
    # (task prefixes are key_split's: alphabetic words only)
    groups = {w0: "afterfail-first", w1: "afterfail-second"}
    held = [client.submit(cupy_ones, 2 * MiB, key=g, workers=[w]) for w, g in groups.items()]
    wait(held)
    report = _report(client)
    for w, group in groups.items():
        d = report.device(w, 0)
        assert d.reserved_bytes == 128 * MiB
        assert {g.prefix: g.current_bytes for g in d.task_groups}[group] == 2 * MiB
    del held


def test_one_worker_two_devices_counts_each_device_on_its_row(two_gpus):
    from distributed import Client, LocalCluster

    from dask_rmm.worker.metrics import device_identity

    with (
        LocalCluster(
            n_workers=1, threads_per_worker=1, dashboard_address=":0", worker_dashboard_address=None
        ) as cluster,
        Client(cluster) as client,
    ):
        (w,) = client.scheduler_info()["workers"]
        client.register_plugin(RMMPlugin(pool_size="128MiB", devices=[0, 1], allocators=["cupy"]))
        setup = client.run(worker_setup, workers=[w])[w]
        assert setup["pool_size"] == {"0": 128 * MiB, "1": 128 * MiB}  # one stack per device
        held = [
            client.submit(cupy_ones, 4 * MiB, 1, key=f"ondevice-one-{i}", workers=[w])
            for i in range(3)
        ]
        wait(held)
        report = _report(client)
        dev0, dev1 = report.device(w, 0), report.device(w, 1)
        assert dev1.current_bytes == 12 * MiB and dev0.current_bytes == 0
        assert {g.prefix: g.current_bytes for g in dev1.task_groups} == {"ondevice-one": 12 * MiB}
        assert "ondevice-one" not in {g.prefix for g in dev0.task_groups}
        assert dev0.reserved_bytes == dev1.reserved_bytes == 128 * MiB
        assert (dev0.gpu_uuid, dev1.gpu_uuid) == (
            device_identity(0, False)["gpu_uuid"],
            device_identity(1, False)["gpu_uuid"],
        )
        del held
