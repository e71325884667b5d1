"""What serving the compiled RMM's allocations from dask-rmm costs (needs a GPU and ``rmm``).

Part 1, per allocation: median ns of one ``rmm.DeviceBuffer(size=n); del`` with RMM's current
resource being
  - RMM's ``CudaMemoryResource`` (cudaMalloc/cudaFree),
  - RMM's C++ ``PoolMemoryResource``,
  - a ``CallbackMemoryResource`` whose callbacks call RMM's C++ pool (the price of two
    Python calls per allocation, whatever is behind them),
  - dask-rmm's interop (``set_allocators(["rmm"])``) over dask-rmm's ``PoolMemoryResource``,
  - the same over the stack a worker gets (attribution > statistics > pool),
and, as a yardstick without RMM in between, dask-rmm's own ``DeviceBuffer`` on its pool.

Part 2, end to end: an RMM-allocating CuPy workload (``rmm.allocators.cupy`` hands CuPy memory
from RMM's current resource; each step makes temporaries) timed with RMM's C++ pool and through
the interop, for small arrays (allocation-bound) and large ones (compute-bound).

    python bench/rmm_callback.py [--iterations 20000] [--repeat 5] [--sizes 256,65536,4194304]
                                 [--steps 2000] [--json PATH]
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

POOL_SIZE = 1 << 30


def _churn(rmm, n: int, iterations: int) -> float:
    device_buffer = rmm.DeviceBuffer
    t0 = time.perf_counter_ns()
    for _ in range(iterations):
        b = device_buffer(size=n)
        del b
    return (time.perf_counter_ns() - t0) / iterations


def _ours_churn(n: int, iterations: int) -> float:
    from dask_rmm import DeviceBuffer

    t0 = time.perf_counter_ns()
    for _ in range(iterations):
        b = DeviceBuffer(size=n)
        del b
    return (time.perf_counter_ns() - t0) / iterations


def _dask_rmm_stack(worker_stack: bool):
    from dask_rmm.mr import CudaMemoryResource, PoolMemoryResource, StatisticsResourceAdaptor

    mr = PoolMemoryResource(CudaMemoryResource(), initial_pool_size=POOL_SIZE)
    if worker_stack:
        from dask_rmm.mr.attribution_adaptor import AttributionResourceAdaptor

        mr = AttributionResourceAdaptor(
            StatisticsResourceAdaptor(mr), lambda: "bench-task", owner_name=str
        )
    return mr


class _Setup:
    """Makes RMM's current resource one configuration; ``undo()`` restores the previous."""

    def __init__(self, rmm, label: str, make: Callable[[], Callable[[], None]]):
        self.rmm, self.label, self.make = rmm, label, make

    def __enter__(self):
        self.previous = self.rmm.mr.get_current_device_resource()
        self.undo = self.make()
        return self

    def __exit__(self, *exc):
        self.undo()
        self.rmm.mr.set_current_device_resource(self.previous)


def _configurations(rmm) -> list[tuple[str, Callable[[], Callable[[], None]]]]:
    def rmm_cuda():
        rmm.mr.set_current_device_resource(rmm.mr.CudaMemoryResource())
        return lambda: None

    def rmm_pool():
        rmm.mr.set_current_device_resource(
            rmm.mr.PoolMemoryResource(rmm.mr.CudaMemoryResource(), initial_pool_size=POOL_SIZE)
        )
        return lambda: None

    def callback_to_rmm_pool():
        pool = rmm.mr.PoolMemoryResource(rmm.mr.CudaMemoryResource(), initial_pool_size=POOL_SIZE)
        rmm.mr.set_current_device_resource(
            rmm.mr.CallbackMemoryResource(
                lambda n, s: pool.allocate(n, s), lambda p, n, s: pool.deallocate(p, n, s)
            )
        )
        return lambda: None

    def interop(worker_stack: bool):
        def make():
            from dask_rmm.allocators import reset_allocators, set_allocators
            from dask_rmm.mr import set_per_device_resource

            previous = set_per_device_resource(0, _dask_rmm_stack(worker_stack))
            set_allocators(["rmm"])

            def undo():
                reset_allocators(["rmm"])
                set_per_device_resource(0, previous)

            return undo

        return make

    return [
        ("rmm CudaMemoryResource", rmm_cuda),
        ("rmm PoolMemoryResource (C++)", rmm_pool),
        ("callback -> rmm C++ pool", callback_to_rmm_pool),
        ("interop -> dask-rmm pool", interop(False)),
        ("interop -> dask-rmm worker stack", interop(True)),
    ]


def per_allocation(rmm, sizes: list[int], iterations: int, repeat: int) -> dict[str, list[float]]:
    results: dict[str, list[float]] = {}
    for label, make in _configurations(rmm):
        with _Setup(rmm, label, make):
            row = []
            for n in sizes:
                count = iterations if "Cuda" not in label else max(iterations // 10, 100)
                _churn(rmm, n, min(count, 1000))  # warm up: pool growth, stream cache
                row.append(statistics.median(_churn(rmm, n, count) for _ in range(repeat)))
            results[label] = row
    from dask_rmm.mr import set_per_device_resource

    previous = set_per_device_resource(0, _dask_rmm_stack(False))
    try:
        row = []
        for n in sizes:
            _ours_churn(n, 1000)
            row.append(statistics.median(_ours_churn(n, iterations) for _ in range(repeat)))
        results["dask-rmm DeviceBuffer, no RMM (yardstick)"] = row
    finally:
        set_per_device_resource(0, previous)
    return results


def _workload(cupy, elements: int, steps: int) -> float:
    a = cupy.arange(elements, dtype=cupy.float32)
    b = cupy.ones(elements, dtype=cupy.float32)
    cupy.cuda.Device().synchronize()
    t0 = time.perf_counter()
    total = 0.0
    for _ in range(steps):
        x = a * 2 + b  # two temporaries
        total += float((x - a).sum())  # two more, and a sync per step
    cupy.cuda.Device().synchronize()
    return time.perf_counter() - t0


def end_to_end(rmm, steps: int, repeat: int) -> dict[str, dict[int, float]]:
    import cupy
    from rmm.allocators.cupy import rmm_cupy_allocator

    chosen = {
        "rmm PoolMemoryResource (C++)",
        "interop -> dask-rmm pool",
        "interop -> dask-rmm worker stack",
    }
    sizes = [1 << 12, 1 << 24]
    results: dict[str, dict[int, float]] = {}
    previous_allocator = cupy.cuda.get_allocator()
    cupy.cuda.set_allocator(rmm_cupy_allocator)
    try:
        for label, make in _configurations(rmm):
            if label not in chosen:
                continue
            with _Setup(rmm, label, make):
                row = {}
                for elements in sizes:
                    n = steps if elements < 1 << 20 else max(steps // 10, 10)
                    _workload(cupy, elements, 10)
                    row[elements] = statistics.median(
                        _workload(cupy, elements, n) / n for _ in range(repeat)
                    )
                results[label] = row
    finally:
        cupy.cuda.set_allocator(previous_allocator)
    return results


def _device_name() -> str:
    try:
        import cupy

        name = cupy.cuda.runtime.getDeviceProperties(0)["name"]
    except Exception:  # the name is a label only
        return "device 0"
    return name.decode() if isinstance(name, bytes) else str(name)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--iterations", type=int, default=20_000)
    parser.add_argument("--repeat", type=int, default=5)
    parser.add_argument("--sizes", default="256,65536,4194304", help="comma-separated bytes")
    parser.add_argument("--steps", type=int, default=2000, help="end-to-end steps (small arrays)")
    parser.add_argument("--json", help="also write the figures to this file")
    args = parser.parse_args()
    sizes = [int(s) for s in args.sizes.split(",")]
    try:
        import rmm
    except ImportError as e:
        sys.exit(f"bench/rmm_callback.py needs the compiled rmm (pip install rmm-cu13): {e}")
    from dask_rmm import _cuda

    if not _cuda.is_available():
        sys.exit("bench/rmm_callback.py needs a CUDA device")

    device = _device_name()
    print(f"{device}, rmm {getattr(rmm, '__version__', '?')}, Python {platform.python_version()}")
    per_alloc = per_allocation(rmm, sizes, args.iterations, args.repeat)
    print(f"\nrmm.DeviceBuffer(size=n); del -- median ns per iteration ({args.repeat} runs)")
    header = f"{'RMM current resource':<44}" + "".join(f"{f'n={n}':>14}" for n in sizes)
    print(header)
    print("-" * len(header))
    for label, row in per_alloc.items():
        print(f"{label:<44}" + "".join(f"{v:>14.0f}" for v in row))

    e2e: dict[str, dict[int, float]] = {}
    try:
        import cupy  # noqa: F401
    except ImportError as e:
        print(f"\nend to end skipped: CuPy is not importable ({e})")
    else:
        e2e = end_to_end(rmm, args.steps, args.repeat)
        print("\nCuPy via rmm.allocators.cupy: x = a*2+b; float((x-a).sum()) -- us per step")
        cols = sorted({n for row in e2e.values() for n in row})
        header = f"{'RMM current resource':<44}" + "".join(f"{f'{n} floats':>16}" for n in cols)
        print(header)
        print("-" * len(header))
        base = e2e.get("rmm PoolMemoryResource (C++)", {})
        for label, row in e2e.items():
            cells = ""
            for n in cols:
                ratio = f" x{row[n] / base[n]:.2f}" if base.get(n) else ""
                cells += f"{row[n] * 1e6:>10.1f}{ratio:>6}"
            print(f"{label:<44}{cells}")

    if args.json:
        Path(args.json).write_text(
            json.dumps(
                {
                    "benchmark": "rmm_callback",
                    "device": device,
                    "python": platform.python_version(),
                    "rmm": getattr(rmm, "__version__", ""),
                    "sizes": sizes,
                    "per_allocation_ns": per_alloc,
                    "end_to_end_s_per_step": {
                        k: {str(n): v for n, v in r.items()} for k, r in e2e.items()
                    },
                },
                indent=2,
            )
        )


if __name__ == "__main__":
    main()
