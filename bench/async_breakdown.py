"""Where CudaAsyncMemoryResource's nanoseconds go, above the binding call itself.

Rows, each the workload of bench/alloc.py (W=1000 live blocks, log-uniform sizes,
ns per allocate+deallocate pair), interleaved over 7 rounds:

- the bare cudaMallocFromPoolAsync/cudaFreeAsync pair with cached handle objects, on the
  device's default pool and on the resource's own pool (does the pool matter?);
- the same plus a dict store and pop per pair (the owned-pointer table that lets a wrong free
  raise instead of corrupting memory);
- the same plus the Stream argument's handle looked up in a dict of cached stream objects;
- the resource itself (its fast path adds the argument checks and method dispatch).

Usage: python bench/async_breakdown.py [--steps N] [--rounds R]   (needs a GPU)
"""

from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import alloc as bench_alloc  # noqa: E402

from dask_rmm import _cuda, mr  # noqa: E402
from dask_rmm.stream import DEFAULT_STREAM  # noqa: E402


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=200_000)
    ap.add_argument("--rounds", type=int, default=7)
    args = ap.parse_args(argv)
    if not _cuda.is_available():
        sys.exit("bench/async_breakdown.py needs a CUDA device; none is usable on this host")
    from cuda.bindings import runtime

    malloc, free_async = runtime.cudaMallocFromPoolAsync, runtime.cudaFreeAsync
    stream_object = runtime.cudaStream_t(0)
    stream_objects = {DEFAULT_STREAM.handle: stream_object}

    def bare(pool):
        def make():
            def allocate(n):
                return malloc(n, pool, stream_object)[1]

            def deallocate(p, n):
                free_async(p, stream_object)

            return allocate, deallocate, None

        return make

    def with_table(pool, stream_lookup: bool):
        def make():
            sizes: dict[int, int] = {}

            def allocate(n, stream=DEFAULT_STREAM):
                s = stream_objects[stream.handle] if stream_lookup else stream_object
                p = malloc(n, pool, s)[1]
                sizes[p] = n
                return p

            def deallocate(p, n, stream=DEFAULT_STREAM):
                sizes.pop(p)
                free_async(p, stream_objects[stream.handle] if stream_lookup else stream_object)

            return allocate, deallocate, None

        return make

    resource = mr.CudaAsyncMemoryResource()
    own_pool = runtime.cudaMemPool_t(resource.pool_handle())
    default_pool = runtime.cudaDeviceGetDefaultMemPool(resource.device_id)[1]
    rows = [
        ("bare pair, default pool", bare(default_pool)),
        ("bare pair, the resource's pool", bare(own_pool)),
        ("+ owned-pointer table", with_table(own_pool, False)),
        ("+ table + stream-object lookup", with_table(own_pool, True)),
        ("CudaAsyncMemoryResource", lambda: (resource.allocate, resource.deallocate, None)),
    ]
    samples: dict[str, list[float]] = {name: [] for name, _ in rows}
    for r in range(args.rounds):
        for name, make in rows:
            samples[name].append(bench_alloc.measure_once(make, args.steps, 1, r))
    base = statistics.median(samples["bare pair, the resource's pool"])
    print(f"{'row':40s} {'median':>7s} {'min':>7s} {'max':>7s}  vs bare pair on its pool")
    for name, v in samples.items():
        m = statistics.median(v)
        print(
            f"{name:40s} {m:7.0f} {min(v):7.0f} {max(v):7.0f}  {m / base:5.2f}x ({m - base:+.0f} ns)"
        )


if __name__ == "__main__":
    main()
