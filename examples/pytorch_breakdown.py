"""Where a worker's device memory is when PyTorch, CuPy and DeviceBuffers share one budget: the
picture in docs/pytorch.md.

    python examples/pytorch_breakdown.py --svg breakdown.svg

One worker with ``RMMPlugin(allocators=["torch", "cupy"])`` and a pool whose maximum is the
worker's budget: PyTorch's own caching allocator beside the pool (capped to what the maximum
leaves), CuPy's pool in front of it. Tasks keep a tensor, a CuPy array and a DeviceBuffer; others
free temporaries, which the caches keep. The report's breakdown then shows, per library, bytes
in use and held free, the pool's free bytes and the device memory outside dask-rmm. Needs a GPU
and PyTorch; elsewhere it says so and exits.
"""

from __future__ import annotations

import argparse
import importlib.util
import sys
import time

MiB = 1 << 20


def keep_tensor(nbytes: int):
    import torch

    kept = torch.ones(nbytes, dtype=torch.uint8, device="cuda")
    tmp = torch.empty(nbytes, dtype=torch.uint8, device="cuda")  # freed: PyTorch keeps it cached
    del tmp
    return kept


def keep_cupy(nbytes: int):
    import cupy

    kept = cupy.ones(nbytes, dtype="uint8")
    tmp = cupy.empty(nbytes // 2, dtype="uint8")  # freed into CuPy's pool, which keeps it
    del tmp
    return kept


def keep_buffer(nbytes: int):
    from dask_rmm import DeviceBuffer

    return DeviceBuffer(size=nbytes)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--svg", default="pytorch-breakdown.svg", help="the picture to write")
    args = ap.parse_args()

    from dask_rmm import _cuda

    missing = [
        what
        for what, ok in (
            ("a GPU", _cuda.is_available()),
            ("PyTorch", importlib.util.find_spec("torch") is not None),
            ("CuPy", importlib.util.find_spec("cupy") is not None),
        )
        if not ok
    ]
    if missing:
        print(f"This example shows PyTorch's bytes on a device: it needs {', '.join(missing)}.")
        return 0

    from distributed import Client, LocalCluster, wait

    from dask_rmm import RMMPlugin
    from dask_rmm.client.fetch import cluster_report
    from dask_rmm.plotting.svg import breakdown_svg

    with (
        LocalCluster(n_workers=1, threads_per_worker=2, dashboard_address=":0") as cluster,
        Client(cluster) as client,
    ):
        client.register_plugin(
            RMMPlugin(pool_size="1GiB", maximum_pool_size="8GiB", allocators=["torch", "cupy"])
        )
        held = [
            client.submit(keep_tensor, 2048 * MiB, pure=False),
            client.submit(keep_cupy, 768 * MiB, pure=False),
            client.submit(keep_buffer, 256 * MiB, pure=False),
        ]
        wait(held)
        deadline = time.monotonic() + 30
        while True:  # the next heartbeats carry the libraries' bytes
            report = cluster_report(client)
            device = report.running[0] if report.running else None
            names = {lib[0] for lib in device.libraries} if device is not None else set()
            if {"torch", "cupy"} <= names or time.monotonic() > deadline:
                break
            time.sleep(0.5)
        if device is None:
            print("no dask-rmm worker reported", file=sys.stderr)
            return 1
        with open(args.svg, "w") as f:
            f.write(breakdown_svg([(device.label, device.breakdown(), device.device_total_bytes)]))
        print("\n".join(report.breakdown_lines()))
        print(f"wrote {args.svg}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
