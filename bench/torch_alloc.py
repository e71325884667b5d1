"""Cost of one ``torch.empty(n, device="cuda"); del`` through different PyTorch allocators
(needs a GPU and a CUDA build of torch).

Rows: PyTorch's own caching allocator; RMM's compiled ``rmm.allocators.torch`` allocator over
RMM's pool (when ``import rmm`` works); dask-rmm's pure-Python ``rmm_torch_allocator`` over
``PoolMemoryResource``, ``StatisticsResourceAdaptor(PoolMemoryResource)`` and
``CudaAsyncMemoryResource``. PyTorch takes a new allocator only once per process and before its
first CUDA allocation, so every row runs in its own process. Prints median ns per iteration.

    python bench/torch_alloc.py [--iterations 20000] [--repeat 5] [--sizes 8,1024,1048576]
                                [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys

ROWS = {
    "torch caching allocator": "torch",
    "rmm compiled allocator + rmm pool": "rmm",
    "dask-rmm + pool": "pool",
    "dask-rmm + statistics(pool)": "statistics",
    "dask-rmm + async": "async",
}


def _setup(kind: str) -> None:
    """Install the allocator of one row (in this process, before any CUDA tensor)."""
    if kind == "torch":
        return
    import torch

    if kind == "rmm":
        import rmm
        from rmm.allocators.torch import rmm_torch_allocator

        rmm.reinitialize(pool_allocator=True, initial_pool_size=1 << 30)
        torch.cuda.memory.change_current_allocator(rmm_torch_allocator)
        return
    from dask_rmm import mr
    from dask_rmm.allocators import set_allocators

    if kind == "async":
        res = mr.CudaAsyncMemoryResource()
    else:
        res = mr.PoolMemoryResource(mr.CudaMemoryResource(), initial_pool_size=1 << 30)
        if kind == "statistics":
            res = mr.StatisticsResourceAdaptor(res)
    mr.set_current_device_resource(res)
    set_allocators(["torch"], exact=["torch"])  # every tensor through the resource


def _child(kind: str, sizes: list[int], iterations: int, repeat: int) -> None:
    import statistics
    import time

    _setup(kind)
    import torch

    empty, uint8, device = torch.empty, torch.uint8, torch.device("cuda")

    def churn(n: int, k: int) -> float:
        t0 = time.perf_counter_ns()
        for _ in range(k):
            t = empty(n, dtype=uint8, device=device)
            del t
        return (time.perf_counter_ns() - t0) / k

    result = []
    for n in sizes:
        churn(n, 500)  # warm up: pool growth, first-call binding, stream cache
        result.append(statistics.median(churn(n, iterations) for _ in range(repeat)))
    torch.cuda.synchronize()
    print("RESULT" + json.dumps({"ns": result, "device": torch.cuda.get_device_name()}))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--iterations", type=int, default=20_000)
    parser.add_argument("--repeat", type=int, default=5)
    parser.add_argument("--sizes", default="8,1024,1048576", help="comma-separated bytes")
    parser.add_argument("--json", default=None, help="also write the results here")
    parser.add_argument("--timeout", type=float, default=60.0, help="seconds per row")
    parser.add_argument("--child", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args()
    sizes = [int(s) for s in args.sizes.split(",")]
    if args.child:
        _child(args.child, sizes, args.iterations, args.repeat)
        return

    results: dict[str, list[float] | str] = {}
    device = "?"
    for label, kind in ROWS.items():
        cmd = [
            sys.executable,
            __file__,
            "--child",
            kind,
            "--sizes",
            args.sizes,
            "--iterations",
            str(args.iterations),
            "--repeat",
            str(args.repeat),
        ]
        try:
            proc = subprocess.run(
                cmd, capture_output=True, text=True, timeout=args.timeout, env=dict(os.environ)
            )
        except subprocess.TimeoutExpired:
            results[label] = "timed out"
            continue
        lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT")]
        if proc.returncode != 0 or not lines:
            last = (proc.stderr.strip().splitlines() or ["no output"])[-1]
            results[label] = f"failed (rc {proc.returncode}): {last[:150]}"
            continue
        data = json.loads(lines[-1][len("RESULT") :])
        results[label] = data["ns"]
        device = data["device"]

    print(f"torch.empty(n, uint8, device='cuda'); del  -- median ns per iteration on {device}")
    header = f"{'allocator':<36}" + "".join(f"{f'n={n}':>14}" for n in sizes)
    print(header)
    print("-" * len(header))
    for label, row in results.items():
        if isinstance(row, str):
            print(f"{label:<36}  {row}")
        else:
            print(f"{label:<36}" + "".join(f"{v:>14.0f}" for v in row))
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"device": device, "sizes": sizes, "ns_per_iteration": results}, f, indent=1)


if __name__ == "__main__":
    main()
