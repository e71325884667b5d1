"""GPU memory pressure (GPU host): a Dask CuPy workload whose persisted data is 2-3x the pool's
maximum, with dask-rmm's ``device_memory_limit`` / ``spill_on_oom`` against dask-cuda's
``device_memory_limit``; and the options' cost on the anchor workload when nothing spills.

Part 1: ``x`` (n x n float64 in chunk^2 blocks, random) is persisted on one worker with 4
threads, then ``(x + x.T).sum()`` and ``x.sum()`` are computed and checked against each other.
Rows: dask-rmm with ``device_memory_limit`` (and ``spill_on_oom``), dask-cuda's LocalCUDACluster
with the same pool maximum and ``device_memory_limit`` (when importable; it may fail), dask-rmm
with ``spill_on_oom`` only, and dask-rmm without the options (expected to fail).

Part 2: the anchor workload of bench/dask_workload.py (16000^2, 500^2 chunks) on one cluster,
alternating RMMPlugin(pool_size=0.3) and the same with device_memory_limit=0.9, spill_on_oom=True;
medians of ``--repeats`` runs each after a warm-up.

    python bench/memory_pressure.py [--n 20000] [--chunk 2500] [--pool-max 1.25GiB]
        [--anchor-n 16000] [--repeats 3] [--skip-anchor] [--json bench/results/x.json]
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import sys
import time
import traceback
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

GiB = 1 << 30


def _random(n: int, chunk: int):
    import cupy
    import dask.array as da

    rs = da.random.RandomState(42, RandomState=cupy.random.RandomState)
    return rs.random_sample((n, n), chunks=(chunk, chunk))


def _pressure_workload(client, n: int, chunk: int) -> dict:
    from distributed import wait

    t0 = time.perf_counter()
    x = _random(n, chunk).persist()
    wait(x)
    t_persist = time.perf_counter() - t0
    s_sym, s = client.compute([(x + x.T).sum(), x.sum()], sync=True)
    elapsed = time.perf_counter() - t0
    s_sym, s = float(s_sym), float(s)
    ok = abs(s_sym - 2 * s) <= 1e-9 * abs(s_sym)
    del x
    return {"seconds": elapsed, "persist_seconds": t_persist, "correct": ok, "sum": s}


def _worker_pressure(dask_worker) -> dict:
    plugin = dask_worker.plugins.get("dask-rmm")
    wp = getattr(plugin, "worker_pressure", None)
    if wp is None:
        return {}
    out = {m.device: m.to_dict() for m in wp.metrics()}
    out["oom_events"] = [e.to_dict() for e in wp.oom_events()][-3:]
    return out


def _dask_rmm_cluster(threads: int):
    from distributed import Client, LocalCluster

    cluster = LocalCluster(
        n_workers=1,
        threads_per_worker=threads,
        processes=True,
        dashboard_address=":0",
        worker_dashboard_address=None,
    )
    return cluster, Client(cluster)


def part1(args, save=lambda rows: None) -> list[dict]:
    from dask_rmm import RMMPlugin
    from dask_rmm.sizes import parse_device_bytes

    pool_max = parse_device_bytes(args.pool_max, total_memory=1 << 50, alignment=256)
    working_set = args.n * args.n * 8
    limit = int(pool_max * 0.8)
    base = dict(pool_size=min(pool_max, 512 << 20), maximum_pool_size=pool_max, allocators=["cupy"])
    configs = [
        ("dask-rmm device_memory_limit", dict(base, device_memory_limit=limit, spill_on_oom=True)),
        ("dask-cuda device_memory_limit", None),
        ("dask-rmm spill_on_oom only", dict(base, spill_on_oom=True)),
        ("dask-rmm, no options", dict(base)),
    ]
    rows = []
    for label, options in configs:
        if options is None:
            rows.append(_dask_cuda_row(args, pool_max, limit))
            save(rows)
            continue
        row = {"config": label, "options": {k: v for k, v in options.items()}}
        try:
            cluster, client = _dask_rmm_cluster(args.threads)
            with cluster, client:
                client.register_plugin(RMMPlugin(**options))
                row.update(_pressure_workload(client, args.n, args.chunk))
                row["worker"] = next(iter(client.run(_worker_pressure).values()))
        except Exception as e:
            row["error"] = f"{type(e).__name__}: {str(e)[:300]}"
        rows.append(row)
        save(rows)
        print(f"{label}: {row.get('seconds', 'failed')} {row.get('error', '')}", file=sys.stderr)

    print(
        f"\nPart 1: {args.n}^2 float64 in {args.chunk}^2 chunks = {working_set / GiB:.2f} GiB "
        f"persisted, pool maximum {pool_max / GiB:.2f} GiB ({working_set / pool_max:.1f}x), "
        f"limit {limit / GiB:.2f} GiB, 1 worker x {args.threads} threads"
    )
    print(f"{'configuration':<32} {'seconds':>8} {'correct':>8}  spilled / OOMs avoided / error")
    for r in rows:
        w = r.get("worker", {}).get(0, {})
        note = r.get("error") or ("(no dask-rmm metrics)" if not w else None) or (
            f"{w.get('total_spilled_bytes', 0) / GiB:.2f} GiB spilled, "
            f"{w.get('total_unspilled_bytes', 0) / GiB:.2f} GiB back, "
            f"{w.get('ooms_avoided', 0)} OOMs avoided, "
            f"spill {w.get('spill_seconds', 0):.2f}s unspill {w.get('unspill_seconds', 0):.2f}s"
        )
        secs = f"{r['seconds']:.2f}" if "seconds" in r else "-"
        print(f"{r['config']:<32} {secs:>8} {str(r.get('correct', '-')):>8}  {note}")
    return rows


def _dask_cuda_row(args, pool_max: int, limit: int) -> dict:
    """The workload on dask-cuda's LocalCUDACluster with the same pool maximum and its
    ``device_memory_limit`` (spilling by ``sizeof`` of task outputs)."""
    row = {"config": "dask-cuda device_memory_limit"}
    try:
        from dask_cuda import LocalCUDACluster
        from distributed import Client

        kwargs = dict(
            n_workers=1,
            threads_per_worker=args.threads,
            rmm_pool_size=min(pool_max, 512 << 20),
            rmm_maximum_pool_size=pool_max,
            device_memory_limit=limit,
            dashboard_address=":0",
            CUDA_VISIBLE_DEVICES="0",
        )
        import inspect

        if "rmm_allocator_external_lib_list" in inspect.signature(LocalCUDACluster).parameters:
            kwargs["rmm_allocator_external_lib_list"] = ["cupy"]
        with LocalCUDACluster(**kwargs) as cluster, Client(cluster) as client:
            if "rmm_allocator_external_lib_list" not in kwargs:
                client.run(_cupy_to_rmm)
            row.update(_pressure_workload(client, args.n, args.chunk))
    except ImportError as e:
        row["error"] = f"not importable: {e}"
    except Exception as e:
        row["error"] = f"{type(e).__name__}: {str(e)[:300]}"
    print(f"dask-cuda: {row.get('seconds', 'failed')} {row.get('error', '')}", file=sys.stderr)
    return row


def _cupy_to_rmm():
    import cupy
    from rmm.allocators.cupy import rmm_cupy_allocator

    cupy.cuda.set_allocator(rmm_cupy_allocator)


def _anchor(n: int, chunk: int):
    x = _random(n, chunk)
    return ((x + x.T) * 2 - x.mean(axis=0)).sum()


def part2(args, save=lambda partial: None) -> dict:
    from dask_rmm import RMMPlugin

    # 0.3: a re-registration builds the new pool before the old one goes (two at once).
    plain = dict(pool_size=0.3, allocators=["cupy"])
    pressure = dict(plain, device_memory_limit=0.9, spill_on_oom=True)
    times: dict[str, list[float]] = {"pool": [], "pool + pressure options": []}
    cluster, client = _dask_rmm_cluster(args.threads)
    with cluster, client:
        for i in range(args.repeats + 1):
            for label, options in (("pool", plain), ("pool + pressure options", pressure)):
                client.register_plugin(RMMPlugin(**options))
                t0 = time.perf_counter()
                client.compute(_anchor(args.anchor_n, args.anchor_chunk)).result()
                if i:  # the first round warms up kernels and the pool
                    times[label].append(time.perf_counter() - t0)
                    save({"times_s": times})
        worker = next(iter(client.run(_worker_pressure).values()))
    medians = {k: statistics.median(v) for k, v in times.items()}
    ratio = medians["pool + pressure options"] / medians["pool"]
    print(
        f"\nPart 2: anchor {args.anchor_n}^2 in {args.anchor_chunk}^2 chunks, no pressure, "
        f"alternating, median of {args.repeats}"
    )
    for k, v in times.items():
        print(f"{k:<26} {medians[k]:>8.3f} s   ({', '.join(f'{t:.2f}' for t in v)})")
    print(f"cost of the options: {100 * (ratio - 1):+.1f}% (target <= 2%)")
    return {"times_s": times, "medians_s": medians, "ratio": ratio, "worker": worker}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--n", type=int, default=20000)
    parser.add_argument("--chunk", type=int, default=2500)
    parser.add_argument("--pool-max", default="1.25GiB")
    parser.add_argument("--threads", type=int, default=4)
    parser.add_argument("--anchor-n", type=int, default=16000)
    parser.add_argument("--anchor-chunk", type=int, default=500)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--skip-anchor", action="store_true")
    parser.add_argument("--skip-pressure", action="store_true")
    parser.add_argument("--json", type=Path, default=None)
    args = parser.parse_args()

    result: dict = {
        "benchmark": "memory_pressure",
        "args": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()},
        "python": platform.python_version(),
        "host": platform.node(),
    }

    def save() -> None:  # after every row: a run stopped by a timeout keeps what it measured
        if args.json is not None:
            args.json.parent.mkdir(parents=True, exist_ok=True)
            args.json.write_text(json.dumps(result, indent=2, default=str))

    def save_rows(rows: list[dict]) -> None:
        result["pressure"] = rows
        save()

    try:
        if not args.skip_pressure:
            result["pressure"] = part1(args, save_rows)
            save()
        if not args.skip_anchor:

            def save_anchor(partial: dict) -> None:
                result["anchor"] = partial
                save()

            result["anchor"] = part2(args, save_anchor)
            save()
    except Exception:
        result["error"] = traceback.format_exc()
        save()
        raise
    if args.json is not None:
        print(f"results written to {args.json}")


if __name__ == "__main__":
    main()
