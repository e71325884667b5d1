"""GPU memory where Dask users look: GPUMemorySampler over two runs, a performance report with
the GPU section, sizing advice from the live cluster, and giving pooled memory back.

    python examples/gpu_memory_tools.py                  # device memory (host memory without a GPU)
    python examples/gpu_memory_tools.py --host-memory    # host memory, any machine
    python examples/gpu_memory_tools.py --out docs/      # where the PNGs and the HTML go
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import time

from _host_memory import use_host_memory
from distributed import Client, LocalCluster, wait

import dask_rmm
from dask_rmm.client.advice import advise_from_report, format_advice

MiB = 1 << 20


def step(i: int, nbytes: int, hold: float):
    """A task that needs scratch space for a while and keeps a quarter of it."""
    scratch = dask_rmm.DeviceBuffer(size=nbytes)
    time.sleep(hold)  # the work the scratch space is for
    del scratch
    return dask_rmm.DeviceBuffer(size=nbytes // 4)


def run(client: Client, n: int, nbytes: int) -> None:
    futures = client.map(step, range(n), nbytes=nbytes, hold=0.2, pure=False)
    wait(futures)
    del futures


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--host-memory", action="store_true", help="SystemMemoryResource, no GPU")
    ap.add_argument("--out", default=".", help="directory for the PNGs and the report")
    args = ap.parse_args()
    os.makedirs(args.out, exist_ok=True)
    base = "system" if use_host_memory(args.host_memory) else "cuda"

    with (
        LocalCluster(n_workers=2, threads_per_worker=2, dashboard_address=":0") as cluster,
        Client(cluster) as client,
    ):
        client.register_plugin(dask_rmm.RMMPlugin(base_resource=base, pool_size="64MiB"))

        # 1. GPUMemorySampler: two runs side by side
        ms = dask_rmm.GPUMemorySampler()
        with ms.sample("16 tasks x 16 MiB", interval=0.2):
            run(client, 16, 16 * MiB)
        with ms.sample("16 tasks x 48 MiB", interval=0.2):
            run(client, 16, 48 * MiB)
        print(ms.summary().to_string())
        ms.plot(align=True, measure="used_max", path=os.path.join(args.out, "gpu-sampler.png"))

        # 2. the performance report with its GPU memory section
        report = os.path.join(args.out, "performance-report.html")
        if importlib.util.find_spec("bokeh") is None:
            print(
                "skipped the performance report: distributed draws it with bokeh (pip install bokeh)"
            )
        else:
            with dask_rmm.performance_report(report):
                run(client, 24, 32 * MiB)
            print(f"wrote {report}")

        # 3. sizing advice from the live cluster
        print(format_advice(advise_from_report(dask_rmm.cluster_report(client))))

        # 4. giving memory back: the pools grew for the 48 MiB run; release what is free
        ms2 = dask_rmm.GPUMemorySampler()
        with ms2.sample("reserved", interval=0.1):
            run(client, 8, 96 * MiB)
            time.sleep(1)
            released = dask_rmm.release_unused(client)
            time.sleep(1.5)
        for worker, results in released.items():
            for r in results:
                print(worker, r)
        ax = ms2.plot(align=True, measure="reserved", label="reserved")
        ms2.plot(align=True, measure="used_max", ax=ax, label="in use (max per interval)")
        ax.set_title("release_unused(client) after a peak: the pools shrink to their initial size")
        ax.set_ylabel("RMM bytes, summed over the workers")
        ax.legend(["reserved", "in use (max per interval)"])
        ax.figure.savefig(os.path.join(args.out, "release-unused.png"), dpi=100)


if __name__ == "__main__":
    main()
