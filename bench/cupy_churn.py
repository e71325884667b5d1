"""Cost of one ``cupy.empty(n); del`` through different CuPy allocators (needs a GPU).

Rows: CuPy's own pool, RMM's ``rmm_cupy_allocator`` over RMM's pool (when ``import rmm`` works),
dask-rmm's ``rmm_cupy_allocator`` and ``lean_cupy_allocator`` (what ``set_cupy_allocator`` and
the Dask plugin install) over ``PoolMemoryResource`` and over
``StatisticsResourceAdaptor(PoolMemoryResource)``. Prints a table of median ns per
allocate+free for each size (the target: ours <= CuPy's own pool).

    python bench/cupy_churn.py [--iterations 100000] [--repeat 7] [--sizes 8,1024,1048576]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from collections.abc import Callable

import cupy


def _churn(n: int, iterations: int) -> float:
    empty, uint8 = cupy.empty, cupy.uint8
    t0 = time.perf_counter_ns()
    for _ in range(iterations):
        a = empty(n, dtype=uint8)
        del a
    return (time.perf_counter_ns() - t0) / iterations


def _cupy_pool() -> Callable[[], None]:
    pool = cupy.cuda.MemoryPool()
    cupy.cuda.set_allocator(pool.malloc)
    return pool.free_all_blocks


def _rmm_pool() -> Callable[[], None]:
    import rmm
    from rmm.allocators.cupy import rmm_cupy_allocator

    rmm.reinitialize(pool_allocator=True, initial_pool_size=1 << 30)
    cupy.cuda.set_allocator(rmm_cupy_allocator)
    return lambda: rmm.reinitialize()


def _ours(statistics_adaptor: bool, lean: bool = False) -> Callable[[], Callable[[], None]]:
    def setup() -> Callable[[], None]:
        from dask_rmm.allocators import cupy as hook
        from dask_rmm.mr import (
            CudaMemoryResource,
            PoolMemoryResource,
            StatisticsResourceAdaptor,
            set_current_device_resource,
        )

        mr = PoolMemoryResource(CudaMemoryResource(), initial_pool_size=1 << 30)
        if statistics_adaptor:
            mr = StatisticsResourceAdaptor(mr)
        previous = set_current_device_resource(mr)
        cupy.cuda.set_allocator(hook.lean_cupy_allocator if lean else hook.rmm_cupy_allocator)
        return lambda: set_current_device_resource(previous)

    return setup


def _prototype_function_allocator(statistics_adaptor: bool) -> Callable[[], Callable[[], None]]:
    """A candidate design for rmm_cupy_allocator, measured beside it: CuPy's
    ``PythonFunctionAllocator`` (its C-level memory object calls ``malloc(nbytes, device)`` and
    ``free(ptr, device)``) with a ``ptr -> (nbytes, stream)`` table, so that no Python object
    with a finalizer and no CuPy memory object are made from Python per allocation."""

    def setup() -> Callable[[], None]:
        from dask_rmm.mr import CudaMemoryResource, PoolMemoryResource, StatisticsResourceAdaptor
        from dask_rmm.stream import Stream

        mr = PoolMemoryResource(CudaMemoryResource(), initial_pool_size=1 << 30)
        if statistics_adaptor:
            mr = StatisticsResourceAdaptor(mr)
        allocate, deallocate = mr.allocate, mr.deallocate
        get_stream = cupy.cuda.get_current_stream
        streams: dict = {}
        live: dict = {}

        def malloc(nbytes, device_id):
            cupy_stream = get_stream(device_id)
            handle = cupy_stream.ptr
            stream = streams.get(handle)
            if stream is None:
                stream = streams[handle] = Stream(cupy_stream)
            ptr = allocate(nbytes, stream)
            live[ptr] = (nbytes, stream)
            return ptr

        def free(ptr, device_id):
            nbytes, stream = live.pop(ptr)
            deallocate(ptr, nbytes, stream)

        allocator = cupy.cuda.memory.PythonFunctionAllocator(malloc, free)
        cupy.cuda.set_allocator(allocator.malloc)
        return lambda: mr

    return setup


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--iterations", type=int, default=100_000)
    parser.add_argument("--repeat", type=int, default=7)
    parser.add_argument("--sizes", default="8,1024,1048576", help="comma-separated bytes")
    parser.add_argument("--json", default="", help="also write the results as JSON here")
    parser.add_argument(
        "--prototypes",
        action="store_true",
        help="also measure the PythonFunctionAllocator prototype (run 2)",
    )
    args = parser.parse_args()
    sizes = [int(s) for s in args.sizes.split(",")]

    rows: list[tuple[str, Callable[[], Callable[[], None]]]] = [("cupy MemoryPool", _cupy_pool)]
    try:
        import rmm  # noqa: F401

        rows.append(("rmm allocator + rmm pool", _rmm_pool))
    except ImportError:
        print("rmm is not importable: skipping its row")
    rows.append(("dask-rmm rmm_cupy_allocator + pool", _ours(False)))
    rows.append(("dask-rmm rmm_cupy_allocator + stats(pool)", _ours(True)))
    rows.append(("dask-rmm lean_cupy_allocator + pool", _ours(False, lean=True)))
    rows.append(("dask-rmm lean_cupy_allocator + stats(pool)", _ours(True, lean=True)))
    if args.prototypes and hasattr(cupy.cuda.memory, "PythonFunctionAllocator"):
        rows.append(("prototype: function allocator + pool", _prototype_function_allocator(False)))
        rows.append(
            ("prototype: function allocator + stats(pool)", _prototype_function_allocator(True))
        )

    device = cupy.cuda.runtime.getDeviceProperties(cupy.cuda.Device().id)["name"]
    device = device.decode() if isinstance(device, bytes) else device
    original = cupy.cuda.get_allocator()
    # Repeats outer, rows inner: drift of the machine during the run hits every row alike.
    runs: dict[str, list[list[float]]] = {label: [[] for _ in sizes] for label, _ in rows}
    start = time.perf_counter()
    for r in range(args.repeat):
        for label, setup in rows:
            t0 = time.perf_counter()
            teardown = setup()
            try:
                for k, n in enumerate(sizes):
                    _churn(n, 1000)  # warm up: pool growth, stream cache, first-call binding
                    runs[label][k].append(_churn(n, args.iterations))
            finally:
                cupy.cuda.set_allocator(original)
                teardown()
            print(f"# repeat {r} {label}: {time.perf_counter() - t0:.1f} s", file=sys.stderr)
        _report(args, device, sizes, runs, time.perf_counter() - start, final=r == args.repeat - 1)


def _report(args, device, sizes, runs, elapsed: float, final: bool) -> None:
    """Print the table (at the end) and write the JSON (after every repeat, so that a timeout
    still leaves the repeats done)."""
    results = {
        label: [statistics.median(v) if v else float("nan") for v in per]
        for label, per in runs.items()
    }
    if final:
        print(f"cupy.empty(n, uint8); del  -- median ns per iteration on {device}")
        header = f"{'allocator':<44}" + "".join(f"{f'n={n}':>14}" for n in sizes)
        print(header)
        print("-" * len(header))
        for label, per_size in results.items():
            print(f"{label:<44}" + "".join(f"{v:>14.0f}" for v in per_size))
    if args.json:
        import json
        import platform

        doc = {
            "benchmark": "cupy_churn",
            "device": device,
            "sizes": sizes,
            "iterations": args.iterations,
            "repeat": args.repeat,
            "elapsed_s": elapsed,
            "python": platform.python_version(),
            "cupy": cupy.__version__,
            "rows": [{"allocator": k, "ns": v, "runs": runs[k]} for k, v in results.items()],
        }
        with open(args.json, "w") as f:
            json.dump(doc, f, indent=1)


if __name__ == "__main__":
    main()
