"""Cluster memory report: run a small workload on a LocalCluster with RMMPlugin, then read the
report (table, DataFrame, PNG plot) and the scheduler's /dask-rmm page.

    python examples/cluster_report.py                    # device memory (host memory without a GPU)
    python examples/cluster_report.py --host-memory      # host memory, any machine
    python examples/cluster_report.py --plot report.png --html report.html --keep-open 60
"""

from __future__ import annotations

import argparse
import time

from _host_memory import use_host_memory
from distributed import Client, LocalCluster, wait

import dask_rmm

MiB = 1 << 20


def load(i: int, nbytes: int):
    """Allocate a chunk through the worker's resource and keep it (the result)."""
    return dask_rmm.DeviceBuffer(size=nbytes)


def transform(chunk, scratch: int):
    """Allocate temporary scratch space (raises the peak), keep a smaller result."""
    tmp = dask_rmm.DeviceBuffer(size=scratch)
    time.sleep(0.3)
    del tmp
    return dask_rmm.DeviceBuffer(size=chunk.size // 2)


def reduce(*parts):
    return dask_rmm.DeviceBuffer(size=sum(p.size for p in parts) // 4)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument(
        "--host-memory", action="store_true", help="SystemMemoryResource, no GPU needed"
    )
    ap.add_argument("--workers", type=int, default=3)
    ap.add_argument("--plot", default="cluster-report.png", help="PNG to write")
    ap.add_argument("--html", default=None, help="also write the report as a standalone HTML page")
    ap.add_argument(
        "--keep-open",
        type=float,
        default=0,
        help="seconds to keep the cluster up (to browse /dask-rmm)",
    )
    args = ap.parse_args()
    host_memory = use_host_memory(args.host_memory)

    with (
        LocalCluster(
            n_workers=args.workers, threads_per_worker=2, dashboard_address=":0"
        ) as cluster,
        Client(cluster) as client,
    ):
        # One call sets up every worker's pool and the scheduler side of the reports.
        client.register_plugin(
            dask_rmm.RMMPlugin(
                base_resource="system" if host_memory else "cuda",
                pool_size="512MiB",
            )
        )

        chunks = [
            client.submit(load, i, (8 + 4 * (i % 5)) * MiB, key=f"load-{i}") for i in range(24)
        ]
        wait(chunks)
        time.sleep(1.5)
        parts = [
            client.submit(transform, c, 48 * MiB, key=f"transform-{i}")
            for i, c in enumerate(chunks)
        ]
        wait(parts)
        time.sleep(1.5)
        del chunks  # frees the loaded chunks on the workers
        total = client.submit(reduce, *parts, key="reduce-0")
        wait(total)
        time.sleep(2)  # let a few heartbeats carry the samples

        report = dask_rmm.cluster_report(client)
        print(report)
        print()
        print(
            report.to_frame()[
                [
                    "worker",
                    "gpu_name",
                    "current_bytes",
                    "peak_bytes",
                    "reserved_bytes",
                    "fragmentation",
                ]
            ]
        )
        t = report.totals
        print(
            f"cluster peak {t.peak_bytes} B (at once) vs {t.sum_of_device_peaks} B (sum of peaks)"
        )
        report.plot(args.plot)
        print(f"\nwrote {args.plot}")
        if args.html:
            with open(args.html, "w") as f:
                f.write(report.to_html(full_page=True))
            print(f"wrote {args.html}")
        port = cluster.scheduler.http_server.port
        print(f"dashboard page: http://127.0.0.1:{port}/dask-rmm  (JSON: /dask-rmm/report.json)")
        print(f"command line:   dask rmm report {cluster.scheduler_address}")
        if args.keep_open:
            time.sleep(args.keep_open)


if __name__ == "__main__":
    main()
