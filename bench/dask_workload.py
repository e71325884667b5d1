"""The anchor Dask workload with and without dask-rmm (GPU host).

One worker process with 4 threads runs CuPy ``((x + x.T) * 2 - x.mean(axis=0)).sum()`` on a
16000 x 16000 float64 array in 500 x 500 chunks; the time is the median of 3 runs after a
warm-up. Configurations: no plugin; RMMPlugin (pool + statistics + attribution, CuPy pointed at
the pool); dask-cuda's ``rmm_pool_size`` (its RMMSetup plugin with real RMM) when importable.
Prints a table and, with ``--json PATH``, writes the results.

    python bench/dask_workload.py [--n 16000] [--chunk 500] [--pool 0.5] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from dask_rmm.wire import device_entries  # noqa: E402


def _workload(n: int, chunk: int):
    import cupy
    import dask.array as da

    rs = da.random.RandomState(42, RandomState=cupy.random.RandomState)
    x = rs.random_sample((n, n), chunks=(chunk, chunk))
    return ((x + x.T) * 2 - x.mean(axis=0)).sum()


def _run(client, n: int, chunk: int, repeats: int) -> list[float]:
    client.compute(_workload(n, chunk)).result()  # warm-up: kernels, pool growth, imports
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        client.compute(_workload(n, chunk)).result()
        times.append(time.perf_counter() - t0)
    return times


def _configurations(pool):
    def none(client):
        return "CuPy's default allocator"

    def dask_rmm(client):
        from dask_rmm import RMMPlugin

        client.register_plugin(RMMPlugin(pool_size=pool, allocators=["cupy"], statistics=True))
        return f"RMMPlugin(pool_size={pool!r}, allocators=['cupy'], statistics=True)"

    configs = [("no plugin", none), ("dask-rmm RMMPlugin", dask_rmm)]
    dask_cuda = dask_cuda_rmm_pool(pool)
    if dask_cuda is not None:
        configs.append(("dask-cuda rmm_pool_size", dask_cuda))
    return configs


def dask_cuda_rmm_pool(pool, libs=("cupy",)):
    """``configure(client)`` registering dask-cuda's RMMSetup with an RMM pool of ``pool`` and
    the libraries ``libs`` on RMM (as ``LocalCUDACluster(rmm_pool_size=pool)``, CuPy by
    default), or None without dask-cuda/rmm."""
    try:
        import rmm  # noqa: F401
        from dask_cuda.plugins import RMMSetup
    except ImportError as e:
        print(f"dask-cuda/rmm not importable, its row skipped: {e}", file=sys.stderr)
        return None
    import inspect

    def dask_cuda(client):
        kwargs = dict(
            initial_pool_size=pool,
            maximum_pool_size=None,
            managed_memory=False,
            async_alloc=False,
            release_threshold=None,
            log_directory=None,
            track_allocations=False,
            external_lib_list=list(libs),
        )
        params = inspect.signature(RMMSetup).parameters
        client.register_plugin(RMMSetup(**{k: v for k, v in kwargs.items() if k in params}))
        described = (
            f"dask_cuda RMMSetup(initial_pool_size={pool!r}, external_lib_list={list(libs)})"
        )
        if "external_lib_list" not in params and "cupy" in libs:  # an older dask-cuda
            client.run(_cupy_to_rmm)
            described += " + rmm_cupy_allocator"
        return described

    return dask_cuda


def one_worker_cluster(threads: int):
    """A LocalCluster of one worker process with ``threads`` threads and no dashboards: a fresh
    process per configuration, so no allocator or pool state carries over between them."""
    from distributed import LocalCluster

    return LocalCluster(
        n_workers=1,
        threads_per_worker=threads,
        processes=True,
        dashboard_address=":0",
        worker_dashboard_address=None,
    )


def _cupy_to_rmm():
    import cupy
    from rmm.allocators.cupy import rmm_cupy_allocator

    cupy.cuda.set_allocator(rmm_cupy_allocator)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--n", type=int, default=16000)
    parser.add_argument("--chunk", type=int, default=500)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--threads", type=int, default=4)
    parser.add_argument("--pool", default="0.5", help="pool size: bytes, '40GiB' or a fraction")
    parser.add_argument("--json", type=Path, default=None, help="also write the results here")
    args = parser.parse_args()
    pool = (
        float(args.pool)
        if args.pool.replace(".", "", 1).isdigit() and "." in args.pool
        else args.pool
    )

    from distributed import Client

    rows = []
    for label, configure in _configurations(pool):
        # A fresh worker process each: no allocator or pool state carries over.
        with one_worker_cluster(args.threads) as cluster, Client(cluster) as client:
            detail = configure(client)
            times = _run(client, args.n, args.chunk, args.repeats)
            extra = ""
            if label.startswith("dask-rmm"):
                m = client.run(lambda dask_worker: dask_worker.metrics["dask-rmm"](dask_worker))
                d = device_entries(next(iter(m.values())))["0"]
                extra = f"peak {d['peak_bytes'] / 2**30:.2f} GiB, {d['total_count']} allocations"
            rows.append(
                {
                    "config": label,
                    "detail": detail,
                    "times_s": times,
                    "median_s": statistics.median(times),
                    "note": extra,
                }
            )
            print(f"{label}: {', '.join(f'{t:.2f}' for t in times)} s", file=sys.stderr)

    base = rows[0]["median_s"]
    print(
        f"\n{args.n}^2 float64, {args.chunk}^2 chunks, 1 worker x {args.threads} threads, "
        f"median of {args.repeats} after a warm-up"
    )
    print(f"{'configuration':<26} {'median s':>9} {'vs none':>8}  notes")
    for r in rows:
        print(f"{r['config']:<26} {r['median_s']:>9.3f} {r['median_s'] / base:>7.2f}x  {r['note']}")
    if args.json is not None:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(
            json.dumps(
                {
                    "benchmark": "dask_workload",
                    "n": args.n,
                    "chunk": args.chunk,
                    "threads": args.threads,
                    "repeats": args.repeats,
                    "pool": args.pool,
                    "python": platform.python_version(),
                    "host": platform.node(),
                    "rows": rows,
                },
                indent=2,
            )
        )
        print(f"results written to {args.json}")


if __name__ == "__main__":
    main()
