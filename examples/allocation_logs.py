"""Record allocation logs of two simulated workers, then read them with ``dask rmm log``.

Each "worker" is a process whose pool (on host memory here, so it runs anywhere) is wrapped in
LoggingResourceAdaptor; it runs three phases of work whose live memory rises and falls. Then:

    dask rmm log summary  OUT/worker-*.csv
    dask rmm log plot     OUT/worker-*.csv -o OUT/log-plot.png
    dask rmm log replay   OUT/worker-0.dev0.csv --compare pool,cuda
    dask rmm log merge    OUT/worker-*.csv -o OUT/merged.csv

    python examples/allocation_logs.py OUT
"""

from __future__ import annotations

import multiprocessing
import os
import random
import sys
import time


def worker(out_dir: str, index: int) -> str:
    from dask_rmm.mr import LoggingResourceAdaptor, PoolMemoryResource, SystemMemoryResource
    from dask_rmm.stream import PER_THREAD_DEFAULT_STREAM, Stream

    pool = PoolMemoryResource(
        SystemMemoryResource(), initial_pool_size="64MiB", maximum_pool_size="96MiB"
    )
    mr = LoggingResourceAdaptor(pool, os.path.join(out_dir, f"worker-{index}.csv"))
    rng = random.Random(index)
    streams = [PER_THREAD_DEFAULT_STREAM, Stream._from_handle(0x7F3A40001230 + 0x1000 * index)]
    live: list[tuple[int, int, Stream]] = []
    # (steps, target live MiB): tasks arrive, hold intermediate results, then release them
    phases = [(600, 40 + 25 * index), (400, 10), (800, 70 - 20 * index), (300, 5), (200, 30)]
    for steps, target_mib in phases:
        for _ in range(steps):
            held = sum(size for _, size, _ in live)
            if live and (held > target_mib << 20 or rng.random() < 0.3):
                ptr, size, s = live.pop(rng.randrange(len(live)))
                mr.deallocate(ptr, size, s)
            else:
                size = int(2 ** rng.uniform(10, 21))
                s = rng.choice(streams)
                live.append((mr.allocate(size, s), size, s))
            time.sleep(0.0004)
    try:
        mr.allocate(128 << 20)  # more than the pool may hold: an "allocate failure" row
    except MemoryError:
        pass
    for ptr, size, s in live[: len(live) // 2]:
        mr.deallocate(ptr, size, s)  # the rest stay live: "leaks" for the summary to list
    mr.flush()
    return mr.get_file_name()


def main(out_dir: str) -> None:
    os.makedirs(out_dir, exist_ok=True)
    with multiprocessing.get_context("spawn").Pool(2) as procs:
        files = procs.starmap(worker, [(out_dir, 0), (out_dir, 1)])
    print("\n".join(files))


if __name__ == "__main__":
    main(sys.argv[1] if len(sys.argv) > 1 else "rmm-logs")
