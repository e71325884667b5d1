"""Allocator micro-benchmark: ns per allocate+deallocate pair from Python, single and 8 threads.

Every row of the speed table in bench/README.md (pool, statistics, tracking, binning, arena,
async, DeviceBuffer, 8 threads) is measured in one run with its peers beside it: RMM's compiled resources, CuPy's
MemoryPool, a bare cuMemAllocAsync/cuMemFreeAsync pair and a plain dict+lock resource.

Workload: W=1000 live blocks; each step frees a random live block and allocates
a log-uniform size in [256 B, 4 MiB]; sizes and victims are drawn before timing; the figure is
the median over 5 runs of (wall time / steps). With T threads, each thread runs the same loop
on its own W/T live blocks against one shared resource and the figure is the wall time of the
steady state (from all threads holding their blocks to the last loop's end) over total steps.
Rows whose library is missing (RMM, CuPy, cuda.bindings on a GPU-less host) are skipped with
the reason.

Usage: python bench/alloc.py [--steps N] [--threads T] [--only NAME,...] [--json] [--out PATH]
"""

from __future__ import annotations

import argparse
import functools
import gc
import json
import math
import platform
import random
import statistics
import sys
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from dask_rmm import _cuda  # noqa: E402
from dask_rmm.mr.base import DeviceMemoryResource  # noqa: E402

W = 1000
MIN_SIZE, MAX_SIZE = 256, 4 << 20
POOL_SIZE = 2 << 30


@functools.lru_cache(maxsize=64)
def draw(steps: int, live: int, seed: int) -> tuple[list[int], list[int], list[int]]:
    """Initial sizes, per-step victims and per-step sizes (the same draws for every row;
    callers only read them)."""
    rng = random.Random(seed)
    lo, hi = math.log(MIN_SIZE), math.log(MAX_SIZE)

    def size():
        return int(math.exp(rng.uniform(lo, hi)))

    return (
        [size() for _ in range(live)],
        [rng.randrange(live) for _ in range(steps)],
        [size() for _ in range(steps)],
    )


def _steady_state(alloc, free, ptrs, live, victims, sizes) -> None:
    """The measured loop: free victim ``victims[k]``'s block, allocate ``sizes[k]`` in its place."""
    for k in range(len(victims)):
        i = victims[k]
        free(ptrs[i], live[i])
        ptrs[i] = None
        n = sizes[k]
        ptrs[i] = alloc(n)
        live[i] = n


def run_loop(alloc, free, initial, victims, sizes, clock=time.perf_counter_ns) -> int:
    """Time the steady-state loop with ``clock``; returns ns for ``len(victims)`` pairs."""
    live = list(initial)
    ptrs = [alloc(n) for n in live]
    t0 = clock()
    _steady_state(alloc, free, ptrs, live, victims, sizes)
    elapsed = clock() - t0
    for p, n in zip(ptrs, live, strict=True):
        free(p, n)
    return elapsed


def _worker(barrier, alloc, free, load, ends):
    """One thread's share: its initial blocks, then (all threads together) the timed loop;
    records when its loop ended, before it frees its blocks."""
    initial, victims, sizes = load
    live = list(initial)
    ptrs = [alloc(n) for n in live]
    barrier.wait()  # every thread's blocks are live: the steady state starts for all at once
    _steady_state(alloc, free, ptrs, live, victims, sizes)
    ends.append(time.perf_counter_ns())
    for p, n in zip(ptrs, live, strict=True):
        free(p, n)


def measure_once(make, steps: int, threads: int, r: int) -> float:
    """ns per pair of one run (repeat ``r``) of resource factory ``make() -> (alloc, free, keep)``."""
    alloc, free, keep = make()
    per = W // threads
    loads = [draw(steps // threads, per, seed=1000 * r + t) for t in range(threads)]
    if threads == 1:
        ns = run_loop(alloc, free, *loads[0])
    else:
        # Timed like the single-thread loop: from the moment every thread holds its initial
        # blocks to the end of the last thread's loop (thread start-up, the initial
        # allocations and the final frees are outside, as they are for one thread).
        barrier = threading.Barrier(threads + 1)
        ends: list[int] = []
        ts = [
            threading.Thread(target=_worker, args=(barrier, alloc, free, ld, ends)) for ld in loads
        ]
        for t in ts:
            t.start()
        barrier.wait()
        t0 = time.perf_counter_ns()
        for t in ts:
            t.join()
        ns = max(ends) - t0
    del alloc, free, keep
    gc.collect()
    return ns / (steps // threads * threads)


def measure(make, steps: int, threads: int, repeats: int = 5) -> float:
    """Median ns per pair over ``repeats`` runs of one row (rows measured alone; main() instead
    interleaves every row's repeats)."""
    return statistics.median(measure_once(make, steps, threads, r) for r in range(repeats))


# -- rows ---------------------------------------------------------------------------------------


class DictBaseline(DeviceMemoryResource):
    """The floor: a Python resource whose whole job is one dict insert and one dict delete."""

    def __init__(self):
        super().__init__()
        self._live = {}
        self._next = 1 << 40
        self._lock = threading.Lock()

    def allocate(self, nbytes, stream=None):
        with self._lock:
            p = self._next
            self._next = p + ((nbytes + 255) & -256)
            self._live[p] = nbytes
        return p

    def deallocate(self, ptr, nbytes, stream=None):
        with self._lock:
            del self._live[ptr]


def base():
    from dask_rmm import mr

    return mr.CudaMemoryResource() if _cuda.is_available() else mr.SystemMemoryResource()


def ours(name):
    def make():
        from dask_rmm import mr

        up = base()
        if name == "pool":
            r = mr.PoolMemoryResource(up, initial_pool_size=POOL_SIZE)
        elif name == "pool+statistics":
            r = mr.StatisticsResourceAdaptor(mr.PoolMemoryResource(up, initial_pool_size=POOL_SIZE))
        elif name == "pool+tracking":
            r = mr.TrackingResourceAdaptor(mr.PoolMemoryResource(up, initial_pool_size=POOL_SIZE))
        elif name == "arena":
            r = mr.ArenaMemoryResource(up, arena_size=POOL_SIZE)
        elif name == "binning":
            r = mr.BinningMemoryResource(
                mr.PoolMemoryResource(up, initial_pool_size=POOL_SIZE), 18, 22
            )
        elif name == "fixed_size":
            r = mr.FixedSizeMemoryResource(up, block_size=MAX_SIZE, blocks_to_preallocate=W + 64)
        elif name == "async":
            _cuda.require_cuda("CudaAsyncMemoryResource")
            r = mr.CudaAsyncMemoryResource()
        else:
            raise ValueError(name)
        return r.allocate, r.deallocate, r

    return make


def ours_device_buffer():
    """``DeviceBuffer(size=n)`` over a pool set as the current resource; freed by dropping it."""
    from dask_rmm import mr
    from dask_rmm.device_buffer import DeviceBuffer

    pool = mr.PoolMemoryResource(base(), initial_pool_size=POOL_SIZE)
    previous = mr.set_current_device_resource(pool)

    def alloc(n):
        return DeviceBuffer(size=n)

    def free(p, n):
        pass  # the loop drops the buffer, which frees it

    return alloc, free, _Restore(lambda: mr.set_current_device_resource(previous), pool)


class _Restore:
    """Keeps a row's objects alive and runs ``undo`` when the row is done with them."""

    def __init__(self, undo, *keep):
        self.undo, self.keep = undo, keep

    def __del__(self):
        self.undo()


def rmm_row(name):
    def make():
        import rmm

        cuda = rmm.mr.CudaMemoryResource()
        if name == "pool":
            r = rmm.mr.PoolMemoryResource(cuda, initial_pool_size=POOL_SIZE)
        elif name == "pool+statistics":
            r = rmm.mr.StatisticsResourceAdaptor(
                rmm.mr.PoolMemoryResource(cuda, initial_pool_size=POOL_SIZE)
            )
        elif name == "pool+tracking":
            r = rmm.mr.TrackingResourceAdaptor(
                rmm.mr.PoolMemoryResource(cuda, initial_pool_size=POOL_SIZE)
            )
        elif name == "arena":
            r = rmm.mr.ArenaMemoryResource(cuda, arena_size=POOL_SIZE)
        elif name == "binning":
            r = rmm.mr.BinningMemoryResource(
                rmm.mr.PoolMemoryResource(cuda, initial_pool_size=POOL_SIZE), 18, 22
            )
        elif name == "async":
            r = rmm.mr.CudaAsyncMemoryResource()
        else:
            raise ValueError(name)
        return r.allocate, r.deallocate, (r, cuda)

    return make


def rmm_device_buffer():
    import rmm

    pool = rmm.mr.PoolMemoryResource(rmm.mr.CudaMemoryResource(), initial_pool_size=POOL_SIZE)
    previous = rmm.mr.get_current_device_resource()
    rmm.mr.set_current_device_resource(pool)
    DeviceBuffer = rmm.DeviceBuffer

    def alloc(n):
        return DeviceBuffer(size=n)

    def free(p, n):
        pass

    return alloc, free, _Restore(lambda: rmm.mr.set_current_device_resource(previous), pool)


def cupy_row():
    import cupy

    pool = cupy.cuda.MemoryPool()

    def free(p, n):
        pass  # the loop drops the MemoryPointer, which returns it to the pool

    return pool.malloc, free, pool


def raw_async_row():
    """The floor of any async resource from Python: cuMemAllocAsync/cuMemFreeAsync called
    straight through cuda.bindings' driver API on the legacy default stream."""
    from cuda.bindings import driver

    _cuda.require_cuda("cuMemAllocAsync")
    malloc, freeasync = driver.cuMemAllocAsync, driver.cuMemFreeAsync
    stream = driver.CUstream(0)

    def alloc(n):
        return malloc(n, stream)[1]

    def free(p, n):
        freeasync(p, stream)

    return alloc, free, None


def raw_runtime_async_row():
    """The same floor through the runtime API (what dask-rmm's async resource calls):
    cudaMallocFromPoolAsync on the device's default pool and cudaFreeAsync, int pointers and
    an int stream handle (converted by cuda-python on every call)."""
    from cuda.bindings import runtime

    _cuda.require_cuda("cudaMallocFromPoolAsync")
    err, pool = runtime.cudaDeviceGetDefaultMemPool(0)
    malloc, freeasync = runtime.cudaMallocFromPoolAsync, runtime.cudaFreeAsync

    def alloc(n):
        return malloc(n, pool, 0)[1]

    def free(p, n):
        freeasync(p, 0)

    return alloc, free, None


def raw_runtime_objects_row():
    """The floor of dask-rmm's async fast path: cudaMallocFromPoolAsync/cudaFreeAsync with
    every handle a cached cuda-python object (no int conversion per call)."""
    from cuda.bindings import runtime

    _cuda.require_cuda("cudaMallocFromPoolAsync")
    err, pool = runtime.cudaDeviceGetDefaultMemPool(0)
    stream = runtime.cudaStream_t(0)
    malloc, freeasync = runtime.cudaMallocFromPoolAsync, runtime.cudaFreeAsync

    def alloc(n):
        return malloc(n, pool, stream)[1]

    def free(p, n):
        freeasync(p, stream)

    return alloc, free, None


def dict_row():
    r = DictBaseline()
    return r.allocate, r.deallocate, r


#: (row name, factory, measured with threads too). Each row of the table sits with its peers.
ROWS = [
    ("dict+lock baseline", dict_row, True),
    ("dask-rmm pool", ours("pool"), True),
    ("rmm pool", rmm_row("pool"), True),
    ("cupy MemoryPool", cupy_row, True),
    ("dask-rmm statistics(pool)", ours("pool+statistics"), True),
    ("rmm statistics(pool)", rmm_row("pool+statistics"), False),
    ("dask-rmm tracking(pool)", ours("pool+tracking"), False),
    ("rmm tracking(pool)", rmm_row("pool+tracking"), False),
    ("dask-rmm binning(pool, 2^18..2^22)", ours("binning"), False),
    ("rmm binning(pool, 2^18..2^22)", rmm_row("binning"), False),
    ("dask-rmm arena", ours("arena"), True),
    ("rmm arena", rmm_row("arena"), False),
    ("dask-rmm async", ours("async"), False),
    ("rmm async", rmm_row("async"), False),
    ("cuMemAllocAsync+cuMemFreeAsync", raw_async_row, False),
    ("cudaMallocFromPoolAsync+cudaFreeAsync", raw_runtime_async_row, False),
    ("cudaMallocFromPoolAsync+cudaFreeAsync, objects", raw_runtime_objects_row, False),
    ("dask-rmm DeviceBuffer(size=n) over pool", ours_device_buffer, False),
    ("rmm DeviceBuffer(size=n) over pool", rmm_device_buffer, False),
    ("dask-rmm fixed_size (4 MiB blocks)", ours("fixed_size"), False),
]


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=100_000, help="steps per run (default 100000)")
    ap.add_argument("--threads", type=int, default=8, help="threads for the threaded column")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument(
        "--all-threaded",
        action="store_true",
        help="measure every row with threads too (default: the marked rows)",
    )
    ap.add_argument("--only", default="", help="comma-separated substrings of row names")
    ap.add_argument("--json", action="store_true", help="also print the results as JSON")
    ap.add_argument("--out", default="", help="write the results as JSON to this path")
    args = ap.parse_args(argv)
    only = [s.strip() for s in args.only.split(",") if s.strip()]

    host = "GPU" if _cuda.is_available() else "no GPU: our rows run on SystemMemoryResource"
    print(
        f"# bench/alloc.py  W={W}  sizes log-uniform [256 B, 4 MiB]  steps={args.steps}  "
        f"median of {args.repeats} (repeats interleaved across rows)  python {platform.python_version()}  ({host})"
    )
    print(f"{'resource':<48} {'ns/pair 1 thread':>17} {f'ns/pair {args.threads} threads':>18}")
    # Repeats are the outer loop and rows the inner one, so that a machine drifting during the
    # run (clock boost, other load) spreads over every row alike instead of favouring the last.
    columns = [("ns_per_pair", 1)]
    if args.threads > 1:
        columns.append((f"ns_per_pair_{args.threads}_threads", args.threads))
    rows = [(n, m, t) for n, m, t in ROWS if not only or any(s in n for s in only)]
    runs: dict[tuple[str, str], list[float]] = {}
    skipped: dict[str, str] = {}
    for r in range(args.repeats):
        for name, make, threaded in rows:
            if name in skipped:
                continue
            for column, threads in columns:
                if threads > 1 and not (threaded or args.all_threaded):
                    continue
                try:
                    runs.setdefault((name, column), []).append(
                        measure_once(make, args.steps, threads, r)
                    )
                except Exception as e:  # a library or device that this host lacks
                    skipped[name] = f"{type(e).__name__}: {e}".splitlines()[0][:120]
                    break
        print(f"# repeat {r + 1}/{args.repeats} done", file=sys.stderr, flush=True)
    results = []
    for name, _make, _threaded in rows:
        row: dict = {"resource": name}
        if name in skipped:
            row["skipped"] = skipped[name]
            print(f"{name:<48} {'skipped: ' + row['skipped']}")
            results.append(row)
            continue
        for column, _threads in columns:
            values = runs.get((name, column))
            if values:
                row[column] = statistics.median(values)
                row[column + "_runs"] = values
        threads_ns = row.get(f"ns_per_pair_{args.threads}_threads")
        print(
            f"{name:<48} {row['ns_per_pair']:>17.0f} "
            f"{'-' if threads_ns is None else f'{threads_ns:.0f}':>18}"
        )
        results.append(row)
    sys.stdout.flush()
    doc = {
        "benchmark": "alloc",
        "workload": {
            "live_blocks": W,
            "min_size": MIN_SIZE,
            "max_size": MAX_SIZE,
            "steps": args.steps,
            "repeats": args.repeats,
            "threads": args.threads,
        },
        "python": platform.python_version(),
        "gpu": _cuda.is_available(),
        "rows": results,
    }
    if args.json:
        print(json.dumps(doc, indent=1))
    if args.out:
        Path(args.out).write_text(json.dumps(doc, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
