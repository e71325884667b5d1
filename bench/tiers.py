"""Native caches in front of dask-rmm's stack against the per-allocation path and the native
peers, at 1/4/8 threads per worker, every configuration interleaved (GPU).

Workloads:

- ``cupy``: a CuPy dask.array elementwise chain (``--chain`` steps of three temporaries on each
  256^2 float32 chunk of a 4096^2 array), one worker with ``--threads`` threads.
- ``cudf``: dask-cudf groupby-aggregate and merge-groupby over ``--cudf-parts`` partitions of
  ``--cudf-rows`` rows (needs cudf and dask_cudf on the worker).
- ``torch``: a PyTorch MLP training step (1024-4096-1024, batch 256, AdamW), ``--threads``
  threads each training their own model at once, one process per configuration and round
  (PyTorch takes an allocator once per process): PyTorch's caching allocator against
  ``rmm_torch_allocator`` over statistics(pool).

Configurations per workload: no plugin (the library's own allocator), dask-cuda's ``RMMSetup``
pool (compiled RMM), dask-rmm's default ``RMMPlugin`` (native cache over the stack), the same
with ``statistics=False``, and the per-allocation path (``exact_allocators=[...]``). Every
configuration is its own LocalCluster (one worker process), all up at once per thread count;
rounds rotate the order. Medians of ``--rounds``; results to stdout and ``--json``.
``--configs`` keeps only the named configurations (labels as printed, separated by ";", e.g.
``"no plugin;dask-cuda RMM pool;dask-rmm default"``) to fit a time budget.

    python bench/tiers.py [--workloads cupy,cudf,torch] [--threads 1,4,8] [--rounds 3]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import time
from contextlib import ExitStack
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from dask_workload import dask_cuda_rmm_pool, one_worker_cluster  # noqa: E402

POOL = "4GiB"


# -- workloads -------------------------------------------------------------------------------------


def _chain_block(block, steps):
    import cupy

    y = block
    for _ in range(steps):
        y = cupy.abs(y * 0.999 + 0.001) - 0.0005
    return y


def _fill(dtype, block_info=None):
    import cupy

    return cupy.full(block_info[None]["chunk-shape"], 1.0, dtype=dtype)


def cupy_chain(n: int = 4096, chunk: int = 256, steps: int = 20):
    import cupy
    import dask.array as da

    blocks = ((chunk,) * (n // chunk),) * 2
    x = da.map_blocks(
        _fill, "float32", chunks=blocks, dtype="float32", meta=cupy.empty((0, 0), "float32")
    )
    return x.map_blocks(_chain_block, steps, dtype="float32").sum()


def _cudf_part(i: int, rows: int):
    import cudf
    import cupy

    rs = cupy.random.RandomState(i)
    return cudf.DataFrame(
        {
            "key": rs.randint(0, 10_000, rows).astype("int64"),
            "k2": rs.randint(0, 100, rows).astype("int32"),
            "x": rs.random_sample(rows),
            "y": rs.random_sample(rows).astype("float32"),
        }
    )


def _cudf_frames(parts: int, rows: int):
    import dask.dataframe as dd

    return dd.from_map(_cudf_part, range(parts), rows=rows)


def cudf_groupby(parts: int, rows: int):
    df = _cudf_frames(parts, rows)
    return df.groupby("key").agg({"x": "sum", "y": "mean"})


def cudf_merge(parts: int, rows: int):
    df = _cudf_frames(parts, rows)
    small = df.groupby("key").agg({"y": "max"}).reset_index()
    return df.merge(small, on="key", how="inner").groupby("k2").x.sum()


# -- configurations ----------------------------------------------------------------------------


def _plugin(**kwargs):
    def configure(client):
        from dask_rmm import RMMPlugin

        client.register_plugin(RMMPlugin(**kwargs))
        return f"RMMPlugin({', '.join(f'{k}={v!r}' for k, v in kwargs.items())})"

    return configure


def _none(client):
    return "the library's own allocator"


#: Labels kept by --configs (None: all).
KEEP: set[str] | None = None


def configurations(lib: str, pool: str) -> list[tuple[str, object]]:
    configs: list[tuple[str, object]] = [("no plugin", _none)]
    peer = dask_cuda_rmm_pool(pool, ["cupy"] if lib == "cupy" else [])
    if peer is not None:
        configs.append(("dask-cuda RMM pool", peer))
    configs += [
        ("dask-rmm default", _plugin(pool_size=pool, allocators=[lib])),
        (
            "dask-rmm default, stats off",
            _plugin(pool_size=pool, allocators=[lib], statistics=False),
        ),
        ("dask-rmm exact", _plugin(pool_size=pool, allocators=[lib], exact_allocators=[lib])),
        (
            "dask-rmm exact, stats off",
            _plugin(pool_size=pool, allocators=[lib], exact_allocators=[lib], statistics=False),
        ),
    ]
    if KEEP is not None:
        unknown = KEEP - {label for label, _ in configs} - {"dask-cuda RMM pool"}
        if unknown:
            raise SystemExit(f"--configs: no configuration named {sorted(unknown)}")
        configs = [(label, make) for label, make in configs if label in KEEP]
    return configs


# -- running Dask workloads -----------------------------------------------------------------------


def _time(client, make) -> float:
    t0 = time.perf_counter()
    client.compute(make()).result()
    return time.perf_counter() - t0


def _worker_numbers(dask_worker=None) -> dict:
    """The heartbeat's numbers of device 0 (empty without dask-rmm)."""
    metric = dask_worker.metrics.get("dask-rmm")
    if metric is None:
        return {}
    from dask_rmm.wire import device_entries

    d = device_entries(metric(dask_worker)).get("0", {})
    keep = ("current_bytes", "peak_bytes", "total_count", "library_cached_bytes", "resource")
    return {k: d.get(k) for k in keep}


def run_dask(lib, workloads, threads_list, rounds, pool, results, details, write):
    from distributed import Client

    for threads in threads_list:
        with ExitStack() as stack:
            clients = {}
            for label, configure in configurations(lib, pool):
                try:
                    cluster = stack.enter_context(one_worker_cluster(threads))
                    client = stack.enter_context(Client(cluster))
                    details[label] = configure(client)
                except Exception as e:
                    print(f"{lib} {label}: not set up: {type(e).__name__}: {e}", file=sys.stderr)
                    continue
                clients[label] = client
            labels = list(clients)
            for label in labels:  # warm-up: kernels, pools, imports
                for name, make in workloads.items():
                    t = _time(clients[label], make)
                    print(f"warm-up {threads}t {label:<30} {name:<8} {t:7.3f}", file=sys.stderr)
            for r in range(rounds):
                order = labels[r % len(labels) :] + labels[: r % len(labels)]
                for name, make in workloads.items():
                    for label in order:
                        t = _time(clients[label], make)
                        key = f"{name} {threads}t"
                        results.setdefault(key, {}).setdefault(label, []).append(t)
                        print(f"round {r} {key:<14} {label:<30} {t:7.3f}", file=sys.stderr)
                write()
            for label in labels:
                try:
                    numbers = clients[label].run(_worker_numbers)
                    details[f"{label} {threads}t numbers"] = next(iter(numbers.values()))
                except Exception as e:
                    details[f"{label} {threads}t numbers"] = repr(e)


# -- torch: one process per configuration and round ------------------------------------------------


TORCH_CONFIGS = ("torch caching allocator", "dask-rmm rmm_torch_allocator")


def _torch_child(kind: str, steps: int, threads: int) -> None:
    """``threads`` threads each train their own MLP for ``steps`` steps at once (what a worker
    with that many task threads does); the time is from all starting to all finishing."""
    import threading

    import torch

    stats = None
    if kind != "torch caching allocator":
        from dask_rmm import mr
        from dask_rmm.allocators.torch import set_torch_allocator

        stats = mr.StatisticsResourceAdaptor(
            mr.PoolMemoryResource(mr.CudaMemoryResource(), initial_pool_size=1 << 30)
        )
        mr.set_current_device_resource(stats)
        set_torch_allocator(cache=False)  # the per-tensor path
    barrier = threading.Barrier(threads + 1)

    def train(seed: int) -> None:
        torch.manual_seed(seed)
        model = torch.nn.Sequential(
            torch.nn.Linear(1024, 4096), torch.nn.ReLU(), torch.nn.Linear(4096, 1024)
        ).cuda()
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
        x = torch.randn(256, 1024, device="cuda")
        y = torch.randn(256, 1024, device="cuda")

        def step():
            opt.zero_grad(set_to_none=True)
            loss = torch.nn.functional.mse_loss(model(x), y)
            loss.backward()
            opt.step()

        for _ in range(20):
            step()
        torch.cuda.synchronize()
        barrier.wait()
        for _ in range(steps):
            step()
        torch.cuda.synchronize()
        barrier.wait()

    workers = [threading.Thread(target=train, args=(i,)) for i in range(threads)]
    for w in workers:
        w.start()
    barrier.wait()
    before = stats.allocation_counts.total_count if stats is not None else 0
    t0 = time.perf_counter()
    barrier.wait()
    elapsed = time.perf_counter() - t0
    for w in workers:
        w.join()
    counted = (stats.allocation_counts.total_count - before) if stats is not None else -1
    print(
        "RESULT"
        + json.dumps({"s": elapsed, "stack_allocations": counted, "torch": torch.__version__})
    )


def run_torch(rounds, steps, threads_list, results, details, write):
    for threads in threads_list:
        for r in range(rounds):
            order = TORCH_CONFIGS[r % 2 :] + TORCH_CONFIGS[: r % 2]
            for kind in order:
                cmd = [sys.executable, __file__, "--torch-child", kind]
                cmd += ["--torch-steps", str(steps), "--threads", str(threads)]
                proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
                lines = [s for s in proc.stdout.splitlines() if s.startswith("RESULT")]
                if not lines:
                    print(f"torch {kind}: failed: {proc.stderr[-2000:]}", file=sys.stderr)
                    continue
                out = json.loads(lines[-1][6:])
                key = f"torch MLP step {threads}t"
                results.setdefault(key, {}).setdefault(kind, []).append(out["s"])
                details[f"torch {kind} {threads}t"] = out
                print(f"round {r} {key} {kind:<32} {out['s']:.3f} s {out}", file=sys.stderr)
                write()


# -- main -----------------------------------------------------------------------------------------


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--workloads", default="cupy,cudf,torch")
    ap.add_argument("--threads", default="1,4,8")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--pool", default=POOL)
    ap.add_argument("--chain", type=int, default=20)
    ap.add_argument("--cudf-parts", type=int, default=64)
    ap.add_argument("--cudf-rows", type=int, default=2_000_000)
    ap.add_argument("--torch-steps", type=int, default=200)
    ap.add_argument("--torch-child", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--json", type=Path, default=None)
    ap.add_argument("--configs", default=None, help='labels to keep, separated by ";"')
    args = ap.parse_args()
    global KEEP
    if args.configs:
        KEEP = {c.strip() for c in args.configs.split(";") if c.strip()}
    if args.torch_child:
        _torch_child(args.torch_child, args.torch_steps, int(args.threads))
        return 0
    start = time.perf_counter()
    threads = [int(t) for t in args.threads.split(",") if t]
    wanted = [w for w in args.workloads.split(",") if w]
    results: dict[str, dict[str, list[float]]] = {}
    details: dict[str, object] = {}
    doc = {
        "benchmark": "tiers",
        "args": {k: str(v) for k, v in vars(args).items()},
        "python": platform.python_version(),
        "commit": os.environ.get("BENCH_COMMIT", ""),
    }

    def write():
        if args.json is not None:
            doc["results"] = results
            doc["details"] = details
            doc["elapsed_s"] = time.perf_counter() - start
            args.json.write_text(json.dumps(doc, indent=1, default=str) + "\n")

    if "cupy" in wanted:
        run_dask(
            "cupy",
            {"chain": lambda: cupy_chain(steps=args.chain)},
            threads,
            args.rounds,
            args.pool,
            results,
            details,
            write,
        )
    if "torch" in wanted:
        run_torch(args.rounds, args.torch_steps, threads, results, details, write)
    if "cudf" in wanted:
        p, n = args.cudf_parts, args.cudf_rows
        run_dask(
            "rmm",
            {"groupby": lambda: cudf_groupby(p, n), "merge": lambda: cudf_merge(p, n)},
            threads,
            args.rounds,
            "20GiB",
            results,
            details,
            write,
        )
    write()
    refs = ("no plugin", "dask-cuda RMM pool", "torch caching allocator")
    print(f"\n# bench/tiers.py, medians of {args.rounds} interleaved rounds")
    print(f"{'workload':<18} {'configuration':<32} {'median s':>9} {'runs':>4}  vs references")
    for key, per in results.items():
        meds = {label: statistics.median(t) for label, t in per.items() if t}
        for label, med in meds.items():
            vs = "  ".join(f"{med / meds[r]:.3f}x {r}" for r in refs if r in meds)
            print(f"{key:<18} {label:<32} {med:>9.3f} {len(per[label]):>4}  {vs}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
