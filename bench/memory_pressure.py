"""GPU memory pressure (GPU host): a Dask CuPy workload whose persisted data is 2-3x the pool's
maximum, with dask-rmm's ``device_memory_limit`` / ``spill_on_oom`` against dask-cuda's
``device_memory_limit``; and the options' cost on the anchor workload when nothing spills.

Part 1: ``x`` (n x n float64 in chunk^2 blocks, random) is persisted on one worker with 4
threads, then ``(x + x.T).sum()`` and ``x.sum()`` are computed and checked against each other.
Rows: dask-rmm with ``device_memory_limit`` (and ``spill_on_oom``), dask-cuda's LocalCUDACluster
with the same pool maximum and ``device_memory_limit`` (when importable; it may fail), dask-rmm
with ``spill_on_oom`` only, and dask-rmm without the options (expected to fail).

Part 2: the anchor workload of bench/dask_workload.py (16000^2, 500^2 chunks) on one cluster,
interleaving RMMPlugin(pool_size=0.3) and the same with device_memory_limit=0.9,
spill_on_oom=True in rounds (ABBA order) after a warm-up round: medians, quartiles and the
median of the per-round ratios.

``--host``: part 1's pattern on host memory (``base_resource="system"``, DeviceBuffers, no GPU
needed): blocks persisted, then every pair (i, j) + (j, i) summed through a temporary.

    python bench/memory_pressure.py [--n 20000] [--chunk 2500] [--pool-max 1.25GiB]
        [--anchor-n 16000] [--repeats 10] [--anchor-seconds S] [--skip-anchor]
        [--skip-pressure] [--json out.json]
    python bench/memory_pressure.py --host [--host-blocks 8] [--host-block 16777216]
        [--pool-max 400MiB] [--host-repeats 2]
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
    out["spilled_without_copy_bytes"] = getattr(wp.store, "spilled_without_copy", 0)
    out["oom_events"] = [e.to_dict() for e in wp.oom_events()][-3:]
    return out


def _keep_no_host_copies(dask_worker) -> None:
    dask_worker.plugins["dask-rmm"].worker_pressure.store.keep_host_copies = 0


def _dask_rmm_cluster(threads: int):
    from dask_workload import one_worker_cluster
    from distributed import Client

    cluster = one_worker_cluster(threads)
    return cluster, Client(cluster)


# -- the same pattern on host memory (base_resource="system", no GPU) -------------------------


def _host_view(buf):
    """The bytes of a DeviceBuffer of the system resource, as a uint64 array (no copy)."""
    import ctypes

    import numpy as np

    raw = (ctypes.c_uint8 * buf.size).from_address(buf.ptr)
    return np.frombuffer(raw, dtype=np.uint64)


def _host_block(nbytes: int, seed: int):
    """A task output of ``nbytes``, made with a temporary of the same size (as random
    generation on a GPU makes one)."""
    from dask_rmm import DeviceBuffer

    tmp = DeviceBuffer(size=nbytes)
    _host_view(tmp)[:] = seed
    out = DeviceBuffer(size=nbytes)
    view = _host_view(out)
    view[:] = _host_view(tmp)
    view[::4096] += 1  # the block is ``seed`` with every 4096th word one more
    del tmp
    return out


def _host_pair_sum(a, b) -> int:
    """``a + b`` into a temporary, then its sum (as ``(x + x.T).sum()`` per block)."""
    from dask_rmm import DeviceBuffer

    tmp = DeviceBuffer(size=a.size)
    t = _host_view(tmp)
    t[:] = _host_view(a)
    t += _host_view(b)
    return int(t.sum())


def _host_sum(a) -> int:
    return int(_host_view(a).sum())


def _host_workload(client, blocks: int, nbytes: int) -> dict:
    """``blocks`` x ``blocks`` outputs persisted, then every pair (i, j) + (j, i) summed and
    every block summed; checked against the closed form."""
    from distributed import wait

    t0 = time.perf_counter()
    grid = {
        (i, j): client.submit(_host_block, nbytes, i * blocks + j, key=f"block-{i}-{j}", pure=False)
        for i in range(blocks)
        for j in range(blocks)
    }
    wait(list(grid.values()))
    t_persist = time.perf_counter() - t0
    pairs = [
        client.submit(_host_pair_sum, grid[i, j], grid[j, i], key=f"pair-{i}-{j}", pure=False)
        for i in range(blocks)
        for j in range(blocks)
    ]
    sums = [client.submit(_host_sum, grid[k], key=f"sum-{k[0]}-{k[1]}") for k in grid]
    s_pairs = sum(client.gather(pairs))
    s = sum(client.gather(sums))
    elapsed = time.perf_counter() - t0
    words = nbytes // 8
    bumps = len(range(0, words, 4096))
    expect = sum(seed * words + bumps for seed in range(blocks * blocks))
    ok = s == expect and s_pairs == 2 * expect
    del grid, pairs, sums
    return {"seconds": elapsed, "persist_seconds": t_persist, "correct": ok}


def part1_host(args, save=lambda rows: None) -> list[dict]:
    """Part 1's pattern without a GPU: DeviceBuffers on host memory, a fixed pool per worker."""
    from dask_rmm import RMMPlugin
    from dask_rmm.sizes import parse_device_bytes

    pool_max = parse_device_bytes(args.pool_max, total_memory=1 << 50, alignment=256)
    nbytes = args.host_block
    working_set = args.host_blocks**2 * nbytes
    limit = int(pool_max * 0.8)
    base = dict(base_resource="system", pool_size=pool_max, maximum_pool_size=pool_max)
    with_limit = dict(base, device_memory_limit=limit, spill_on_oom=True)
    configs = [
        ("limit", "dask-rmm device_memory_limit", with_limit),
        ("limit-nokeep", "dask-rmm limit, no kept host copies", with_limit),
        ("oom", "dask-rmm spill_on_oom only", dict(base, spill_on_oom=True)),
    ]
    rows = []
    # Repeats interleaved (a drifting machine affects all rows alike), then one run without
    # the options (it fails).
    runs = [c for _ in range(args.host_repeats) for c in configs]
    runs.append(("none", "dask-rmm, no options", dict(base)))
    for name, label, options in runs:
        row = {"config": label, "options": dict(options)}
        try:
            cluster, client = _dask_rmm_cluster(args.threads)
            with cluster, client:
                client.register_plugin(RMMPlugin(**options))
                if name == "limit-nokeep":
                    client.run(_keep_no_host_copies)
                row.update(_host_workload(client, args.host_blocks, nbytes))
                row["worker"] = next(iter(client.run(_worker_pressure).values()))
        except Exception as e:
            row["error"] = f"{type(e).__name__}: {str(e)[:300]}"
        rows.append(row)
        save(rows)
    print(
        f"\nPart 1 on host memory: {args.host_blocks}^2 blocks of {nbytes / (1 << 20):.0f} MiB = "
        f"{working_set / GiB:.2f} GiB persisted, pool {pool_max / GiB:.2f} GiB "
        f"({working_set / pool_max:.1f}x), limit {limit / GiB:.2f} GiB, 1 worker x "
        f"{args.threads} threads"
    )
    _print_rows(rows)
    return rows


def part1(args, save=lambda rows: None) -> list[dict]:
    from dask_rmm import RMMPlugin
    from dask_rmm.sizes import parse_device_bytes

    pool_max = parse_device_bytes(args.pool_max, total_memory=1 << 50, alignment=256)
    working_set = args.n * args.n * 8
    limit = int(pool_max * 0.8)
    base = dict(pool_size=min(pool_max, 512 << 20), maximum_pool_size=pool_max, allocators=["cupy"])
    with_limit = dict(base, device_memory_limit=limit, spill_on_oom=True)
    configs = {
        "limit": ("dask-rmm device_memory_limit", with_limit),
        "limit-nokeep": ("dask-rmm limit, no kept host copies", with_limit),
        "dask-cuda": ("dask-cuda device_memory_limit", None),
        "oom": ("dask-rmm spill_on_oom only", dict(base, spill_on_oom=True)),
        "none": ("dask-rmm, no options", dict(base)),
    }
    rows = []
    for name in args.configs.split(","):
        label, options = configs[name]
        if options is None:
            rows.append(_dask_cuda_row(args, pool_max, limit))
            save(rows)
            continue
        row = {"config": label, "options": {k: v for k, v in options.items()}}
        try:
            cluster, client = _dask_rmm_cluster(args.threads)
            with cluster, client:
                client.register_plugin(RMMPlugin(**options))
                if name == "limit-nokeep":  # the A/B of kept host copies
                    client.run(_keep_no_host_copies)
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
    _print_rows(rows)
    return rows


def _print_rows(rows: list[dict]) -> None:
    print(f"{'configuration':<32} {'seconds':>8} {'correct':>8}  spilled / OOMs avoided / error")
    for r in rows:
        w = r.get("worker", {}).get(0, {})
        note = (
            r.get("error")
            or ("(no dask-rmm metrics)" if not w else None)
            or (
                f"{w.get('total_spilled_bytes', 0) / GiB:.2f} GiB spilled "
                f"({r['worker'].get('spilled_without_copy_bytes', 0) / GiB:.2f} without a copy), "
                f"{w.get('total_unspilled_bytes', 0) / GiB:.2f} GiB back, "
                f"{w.get('ooms_avoided', 0)} OOMs avoided, "
                f"spill {w.get('spill_seconds', 0):.2f}s unspill {w.get('unspill_seconds', 0):.2f}s"
            )
        )
        secs = f"{r['seconds']:.2f}" if "seconds" in r else "-"
        print(f"{r['config']:<32} {secs:>8} {str(r.get('correct', '-')):>8}  {note}")


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


def _spread(values: list[float]) -> dict:
    """Median, quartiles, min and max of ``values``."""
    v = sorted(values)
    if not v:
        return {}
    q = statistics.quantiles(v, n=4, method="inclusive") if len(v) > 1 else [v[0]] * 3
    return {"n": len(v), "median": q[1], "q1": q[0], "q3": q[2], "min": v[0], "max": v[-1]}


def part2(args, save=lambda partial: None) -> dict:
    """Interleaved rounds on one cluster: each round runs the anchor once with the plain pool
    and once with the pressure options, in alternating order (ABBA: a drift of the machine
    cancels out); the first round is a warm-up. Rounds continue until ``--repeats`` rounds or
    ``--anchor-seconds`` are spent. Reported: each configuration's median and quartiles, and
    the median of the per-round ratios (options / plain) with its quartiles."""
    from dask_rmm import RMMPlugin

    # 0.3: a re-registration builds the new pool before the old one goes (two at once).
    plain = dict(pool_size=0.3, allocators=["cupy"])
    pressure = dict(plain, device_memory_limit=0.9, spill_on_oom=True)
    configs = (("pool", plain), ("pool + pressure options", pressure))
    times: dict[str, list[float]] = {label: [] for label, _ in configs}
    ratios: list[float] = []
    deadline = time.perf_counter() + args.anchor_seconds
    cluster, client = _dask_rmm_cluster(args.threads)
    with cluster, client:
        for i in range(args.repeats + 1):
            if i > 1 and time.perf_counter() > deadline:
                break
            order = configs if i % 2 == 0 else configs[::-1]
            round_times = {}
            for label, options in order:
                client.register_plugin(RMMPlugin(**options))
                t0 = time.perf_counter()
                client.compute(_anchor(args.anchor_n, args.anchor_chunk)).result()
                round_times[label] = time.perf_counter() - t0
            if i:  # the first round warms up kernels and the pool
                for label, t in round_times.items():
                    times[label].append(t)
                ratios.append(round_times["pool + pressure options"] / round_times["pool"])
                save({"times_s": times, "ratios": ratios})
        worker = next(iter(client.run(_worker_pressure).values()))
    stats = {k: _spread(v) for k, v in times.items()}
    ratio = _spread(ratios)
    print(
        f"\nPart 2: anchor {args.anchor_n}^2 in {args.anchor_chunk}^2 chunks, no pressure, "
        f"{len(ratios)} interleaved rounds (ABBA) after a warm-up"
    )
    for k, st in stats.items():
        print(
            f"{k:<26} median {st['median']:.3f} s  quartiles {st['q1']:.3f}-{st['q3']:.3f}  "
            f"range {st['min']:.3f}-{st['max']:.3f}"
        )
    print(
        f"cost of the options, median of per-round ratios: {100 * (ratio['median'] - 1):+.1f}% "
        f"(quartiles {100 * (ratio['q1'] - 1):+.1f}% to {100 * (ratio['q3'] - 1):+.1f}%, "
        f"range {100 * (ratio['min'] - 1):+.1f}% to {100 * (ratio['max'] - 1):+.1f}%; "
        "target <= 2%)"
    )
    return {"times_s": times, "stats": stats, "ratios": ratios, "ratio": ratio, "worker": worker}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--n", type=int, default=20000)
    parser.add_argument("--chunk", type=int, default=2500)
    parser.add_argument("--pool-max", default="1.25GiB")
    parser.add_argument("--threads", type=int, default=4)
    parser.add_argument(
        "--configs",
        default="limit,dask-cuda,oom,none",
        help="part 1 rows, in order: limit, limit-nokeep, dask-cuda, oom, none",
    )
    parser.add_argument("--anchor-n", type=int, default=16000)
    parser.add_argument("--anchor-chunk", type=int, default=500)
    parser.add_argument("--repeats", type=int, default=10, help="interleaved rounds, part 2")
    parser.add_argument(
        "--anchor-seconds", type=float, default=1e9, help="stop part 2's rounds after this"
    )
    parser.add_argument("--skip-anchor", action="store_true")
    parser.add_argument("--skip-pressure", action="store_true")
    parser.add_argument("--json", type=Path, default=None)
    parser.add_argument(
        "--host", action="store_true", help="part 1's pattern on host memory (no GPU needed)"
    )
    parser.add_argument("--host-blocks", type=int, default=8)
    parser.add_argument("--host-block", type=int, default=16 << 20)
    parser.add_argument("--host-repeats", type=int, default=2)
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
        if args.host:
            result["pressure"] = part1_host(args, save_rows)
            save()
            args.skip_pressure = args.skip_anchor = True
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
