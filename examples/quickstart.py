"""dask-rmm quickstart: a LocalCluster whose workers allocate through an RMM pool, with each
worker's memory statistics (per task prefix) read back from the scheduler.

    python examples/quickstart.py

On a GPU the tasks make CuPy arrays from the pool; on a host without a GPU the same stack is
built on host memory (``base_resource="system"``) and the tasks make DeviceBuffers.
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from distributed import Client, LocalCluster, wait  # noqa: E402

from dask_rmm import RMMPlugin, _cuda  # noqa: E402
from dask_rmm.client.fetch import cluster_report  # noqa: E402
from dask_rmm.sizes import format_bytes  # noqa: E402

MiB = 1 << 20


def make_block(n_mib: int):
    """A task that allocates ``n_mib`` MiB through the worker's resource and keeps it."""
    try:
        import cupy
    except ImportError:
        cupy = None
    if cupy is not None and _cuda.is_available():
        return cupy.ones(n_mib * MiB // 8, dtype="float64")
    from dask_rmm import DeviceBuffer

    return DeviceBuffer(size=n_mib * MiB)


def scratch(n_mib: int) -> int:
    """A task that allocates a temporary block and frees it before returning."""
    block = make_block(n_mib)
    return block.nbytes


def main() -> None:
    if _cuda.is_available():
        plugin = RMMPlugin(pool_size="256MiB", allocators=["cupy"])
        print("GPU found: workers allocate CuPy arrays from a 256 MiB device pool")
    else:
        plugin = RMMPlugin(pool_size="256MiB", base_resource="system")
        print(
            "No GPU on this host: using base_resource='system' (host memory); "
            "tasks allocate DeviceBuffers"
        )

    with (
        LocalCluster(
            n_workers=2,
            threads_per_worker=2,
            processes=True,
            dashboard_address=":0",
            worker_dashboard_address=None,
        ) as cluster,
        Client(cluster) as client,
    ):
        client.register_plugin(plugin)

        held = client.map(make_block, [8, 16, 24, 32], key=[f"load-{i}" for i in range(4)])
        temps = client.map(scratch, [64] * 6, key=[f"scratch-{i}" for i in range(6)])
        wait(held + temps)

        # Heartbeats carry the statistics to the scheduler; wait for the ones after the work.
        # cluster_report reads them back as one DeviceMemory a worker device (the public API:
        # the heartbeat's own format is packed for the scheduler, docs/reports.md).
        deadline = time.monotonic() + 20
        while True:
            report = cluster_report(client)
            # In arrays: what was allocated less what a library cache (CuPy's pool) keeps free.
            total = sum(d.in_array_bytes for d in report.running)
            if total == 80 * MiB or time.monotonic() > deadline:
                break
            time.sleep(0.2)

        for d in sorted(report.running, key=lambda d: str(d.name)):
            print(f"\nworker {d.name}: {d.resource}")
            cached, names = d.library_cached_bytes, d.library_caches
            in_arrays = (
                f" ({format_bytes(d.in_array_bytes)} in arrays, "
                f"{format_bytes(cached)} held free by the {names} cache)"
                if names
                else ""
            )
            print(
                f"  allocated {format_bytes(d.current_bytes)} in {d.current_count} blocks"
                f"{in_arrays}, peak {format_bytes(d.peak_bytes)}, "
                f"pool {format_bytes(d.reserved_bytes)} "
                f"({format_bytes(d.pool_free_bytes)} free)"
            )
            for prefix, current, peak in d.task_groups or ():
                print(
                    f"  {prefix:<12} now {format_bytes(current):>10}   peak {format_bytes(peak):>10}"
                )

        print()
        print(report)


if __name__ == "__main__":
    main()
