"""Dask workloads that tell allocators apart, every configuration interleaved in one run (GPU).

Each configuration gets its own single-worker LocalCluster (one process, ``--threads`` threads),
all started up front; then the workloads run round by round, every configuration once per round
in a rotating order, so that drift of the machine (clocks, other load) hits them all alike.
Reported: median, min and max seconds per workload and configuration, and the ratios the
speed target is about (dask-rmm with statistics on against no plugin and dask-cuda).

Workloads (CuPy arrays through dask.array):

- ``chain``: an elementwise chain of ``--chain`` steps on each small chunk (256^2 float32); every
  step makes three temporaries, so a task allocates and frees ~100 small arrays.
- ``scatter``: a groupby-like scatter: each chunk's values are binned into 64 groups with
  ``cupy.bincount`` (keys and weights made per chunk), the per-chunk (64,) partial sums are
  tree-reduced: many tiny arrays.
- ``anchor``: the anchor workload of bench/dask_workload.py, ``((x + x.T) * 2 -
  x.mean(axis=0)).sum()`` on a 16000^2 float64 array in 500^2 chunks.

Configurations: no plugin (CuPy's own MemoryPool); dask-rmm ``RMMPlugin`` with a pool and with
the async resource, statistics on and off each; dask-cuda's RMM pool (``RMMSetup``
with real RMM and ``rmm_cupy_allocator``) when importable. Results go to stdout and, after every
round, to ``--json`` (a timeout still leaves the rounds done).

    python bench/dask_alloc_heavy.py [--rounds 3] [--anchor-rounds 2] [--budget 190] [--json PATH]
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import sys
import time
from contextlib import ExitStack
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))
from dask_workload import dask_cuda_rmm_pool  # noqa: E402

STATS_ON = "dask-rmm pool, statistics on"


# -- workloads (built on the client, run on the worker) -------------------------------------------


def _chain_block(block, steps):
    import cupy

    y = block
    for _ in range(steps):
        y = cupy.abs(y * 0.999 + 0.001) - 0.0005  # three temporaries per step
    return y


def _fill(dtype, block_info=None):
    import cupy

    return cupy.full(block_info[None]["chunk-shape"], 1.0, dtype=dtype)


def _ones(shape: tuple[int, int], chunks: tuple[int, int], dtype: str):
    """A dask array of CuPy ones: cheap to make (one fill kernel per chunk), unlike a random
    array, whose per-chunk CuPy RandomState (a cuRAND generator each) took longer than the
    workload itself in GPU run 2."""
    import cupy
    import dask.array as da

    blocks = tuple((c,) * (s // c) for s, c in zip(shape, chunks, strict=True))
    return da.map_blocks(
        _fill, dtype, chunks=blocks, dtype=dtype, meta=cupy.empty((0, 0), dtype=dtype)
    )


def chain(n: int, chunk: int, steps: int):
    x = _ones((n, n), (chunk, chunk), "float32")
    return x.map_blocks(_chain_block, steps, dtype="float32").sum()


def _scatter_block(block, groups):
    import cupy

    flat = block.ravel()
    idx = cupy.arange(flat.size, dtype=cupy.int64)
    keys = (idx * 7919) % groups  # a fixed, well-mixed group of each element
    values = flat * 0.5 + idx * 1e-6
    sums = cupy.bincount(keys, weights=values, minlength=groups)
    counts = cupy.bincount(keys, minlength=groups)
    return cupy.concatenate([sums, counts.astype(sums.dtype)])[None, :]


def scatter(n: int, chunk: int, groups: int = 64):

    blocks = n * n // (chunk * chunk)
    x = _ones((blocks, chunk * chunk), (1, chunk * chunk), "float64")
    parts = x.map_blocks(
        _scatter_block, groups, dtype="float64", chunks=((1,) * blocks, (2 * groups,))
    )
    return parts.sum(axis=0, split_every=8)


def anchor(n: int, chunk: int):
    import cupy
    import dask.array as da

    rs = da.random.RandomState(42, RandomState=cupy.random.RandomState)
    x = rs.random_sample((n, n), chunks=(chunk, chunk))
    return ((x + x.T) * 2 - x.mean(axis=0)).sum()


# -- configurations -------------------------------------------------------------------------------


def configurations(pool):
    """(label, configure(client) -> description) pairs; rows that cannot be made are skipped."""
    from dask_rmm import RMMPlugin

    def none(client):
        return "CuPy's default allocator (its MemoryPool)"

    def ours(**kwargs):
        def configure(client):
            plugin = RMMPlugin(allocators=["cupy"], **kwargs)
            client.register_plugin(plugin)
            return f"RMMPlugin({', '.join(f'{k}={v!r}' for k, v in kwargs.items())}, allocators=['cupy'])"

        return configure

    configs = [
        ("no plugin", none),
        (STATS_ON, ours(pool_size=pool, statistics=True)),
        ("dask-rmm pool, statistics off", ours(pool_size=pool, statistics=False)),
    ]
    try:
        RMMPlugin(async_alloc=True, statistics=True, allocators=["cupy"])
    except TypeError as e:  # the plugin's options changed: say so, run the rest
        print(f"dask-rmm async row skipped: {e}", file=sys.stderr)
    else:
        configs.append(("dask-rmm async, statistics on", ours(async_alloc=True, statistics=True)))
        configs.append(("dask-rmm async, statistics off", ours(async_alloc=True, statistics=False)))
    dask_cuda = dask_cuda_rmm_pool(pool)
    if dask_cuda is not None:
        configs.append(("dask-cuda RMM pool", dask_cuda))
    return configs


# -- running --------------------------------------------------------------------------------------


def _allocations_made(dask_worker=None) -> int:
    """Allocations counted so far by the worker's dask-rmm statistics (-1 without them)."""
    from dask_rmm.worker.stacks import worker_stack

    total = -1
    for stack in worker_stack(dask_worker).active:
        if stack.statistics is not None:
            total = max(total, 0) + stack.statistics.allocation_counts.total_count
    return total


def _count_allocations(client) -> int:
    try:
        return sum(client.run(_allocations_made).values())
    except Exception:  # not a dask-rmm configuration
        return -1


def _time(client, make) -> float:
    t0 = time.perf_counter()
    client.compute(make()).result()
    return time.perf_counter() - t0


def _summary(times: list[float]) -> dict:
    med = statistics.median(times)
    return {
        "times_s": times,
        "median_s": med,
        "min_s": min(times),
        "max_s": max(times),
        "spread": (max(times) - min(times)) / med if med else 0.0,
    }


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=3, help="rounds of chain and scatter")
    ap.add_argument("--anchor-rounds", type=int, default=2, help="rounds of the anchor")
    ap.add_argument("--threads", type=int, default=4)
    ap.add_argument("--pool", default="8GiB", help="pool size of every pooled configuration")
    ap.add_argument("--chain-n", type=int, default=4096)
    ap.add_argument("--chain-chunk", type=int, default=256)
    ap.add_argument("--chain", type=int, default=20, help="steps of the elementwise chain")
    ap.add_argument("--scatter-n", type=int, default=4096)
    ap.add_argument("--scatter-chunk", type=int, default=128)
    ap.add_argument("--anchor-n", type=int, default=16000)
    ap.add_argument("--anchor-chunk", type=int, default=500)
    ap.add_argument(
        "--budget",
        type=float,
        default=0.0,
        help="seconds: start no round that would likely end after this (0: no limit)",
    )
    ap.add_argument(
        "--configs",
        default="",
        help="comma-separated substrings: run only the configurations named so",
    )
    ap.add_argument(
        "--labels",
        default="",
        help="semicolon-separated exact configuration labels to run (labels hold "
        "commas, e.g. 'no plugin;dask-rmm pool, statistics on')",
    )
    ap.add_argument("--json", type=Path, default=None)
    args = ap.parse_args()
    only = [s.strip() for s in args.configs.split(",") if s.strip()]
    labels_only = [s.strip() for s in args.labels.split(";") if s.strip()]
    start = time.perf_counter()

    from distributed import Client, LocalCluster

    workloads = {
        "chain": lambda: chain(args.chain_n, args.chain_chunk, args.chain),
        "scatter": lambda: scatter(args.scatter_n, args.scatter_chunk),
        "anchor": lambda: anchor(args.anchor_n, args.anchor_chunk),
    }
    results: dict[str, dict[str, list[float]]] = {}
    allocations: dict[str, int] = {}  # per run of each workload, counted by dask-rmm's statistics
    details: dict[str, str] = {}
    doc = {
        "benchmark": "dask_alloc_heavy",
        "args": {k: str(v) for k, v in vars(args).items()},
        "python": platform.python_version(),
        "host": platform.node(),
    }

    def write():
        if args.json is None:
            return
        doc["results"] = {
            c: {w: _summary(t) for w, t in per.items() if t} for c, per in results.items()
        }
        doc["details"] = details
        doc["allocations_per_run"] = allocations
        doc["elapsed_s"] = time.perf_counter() - start
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(doc, indent=1) + "\n")

    with ExitStack() as stack:
        clients = {}
        for label, configure in configurations(args.pool):
            if only and not any(s in label for s in only):
                continue
            if labels_only and label not in labels_only:
                continue
            try:
                cluster = stack.enter_context(
                    LocalCluster(
                        n_workers=1,
                        threads_per_worker=args.threads,
                        processes=True,
                        dashboard_address=":0",
                        worker_dashboard_address=None,
                    )
                )
                client = stack.enter_context(Client(cluster))
                details[label] = configure(client)
            except Exception as e:  # a configuration that fails to start is reported, not fatal
                print(f"{label}: could not be set up: {type(e).__name__}: {e}", file=sys.stderr)
                continue
            clients[label] = client
            results[label] = {w: [] for w in workloads}
        print(
            f"# {len(clients)} configurations up after {time.perf_counter() - start:.0f} s",
            file=sys.stderr,
        )
        labels = list(clients)
        last: dict[str, float] = {}  # seconds of the latest run of each workload
        # Warm-up: kernels compiled (CuPy's cache is shared), pools grown, imports done.
        for label in labels:
            for name in ("chain", "scatter"):
                last[name] = _time(clients[label], workloads[name])
                print(f"warm-up {label:<32} {name:<8} {last[name]:7.3f} s", file=sys.stderr)
            small = _time(clients[label], lambda: anchor(args.anchor_n // 4, args.anchor_chunk))
            last.setdefault("anchor", 16 * small)  # a guess until the first real run
        print(f"# warm after {time.perf_counter() - start:.0f} s", file=sys.stderr)

        rounds = max(args.rounds, args.anchor_rounds)
        for r in range(rounds):
            names = [
                n
                for n, k in (
                    ("chain", args.rounds),
                    ("scatter", args.rounds),
                    ("anchor", args.anchor_rounds),
                )
                if r < k
            ]
            order = labels[r % len(labels) :] + labels[: r % len(labels)]
            for name in names:
                for label in order:
                    elapsed = time.perf_counter() - start
                    if args.budget and elapsed + 1.2 * last[name] > args.budget:
                        print(
                            f"# skipped round {r} {label} {name}: {elapsed:.0f} s + "
                            f"~{last[name]:.0f} s > budget",
                            file=sys.stderr,
                        )
                        continue
                    counted = _count_allocations(clients[label]) if label == STATS_ON else -1
                    t = last[name] = _time(clients[label], workloads[name])
                    results[label][name].append(t)
                    if counted >= 0:  # outside the timed span
                        allocations[name] = _count_allocations(clients[label]) - counted
                    print(f"round {r} {label:<32} {name:<8} {t:7.3f} s", file=sys.stderr)
                    write()

    print(
        f"\n# bench/dask_alloc_heavy.py: 1 worker x {args.threads} threads per configuration, "
        f"configurations interleaved; chain {args.chain_n}^2 f32 in {args.chain_chunk}^2 chunks "
        f"x {args.chain} steps; scatter {args.scatter_n}^2 in {args.scatter_chunk}^2 chunks; "
        f"anchor {args.anchor_n}^2 f64 in {args.anchor_chunk}^2 chunks; pool {args.pool}"
    )
    print(
        f"{'configuration':<32} {'workload':<8} {'median s':>9} {'min':>7} {'max':>7} "
        f"{'runs':>4}  {'vs none':>7}  {'vs dask-cuda':>12}"
    )
    for name in workloads:
        base = results.get("no plugin", {}).get(name)
        cuda = results.get("dask-cuda RMM pool", {}).get(name)
        for label, per in results.items():
            t = per[name]
            if not t:
                continue
            med = statistics.median(t)
            vs_none = f"{med / statistics.median(base):.2f}x" if base else "-"
            vs_cuda = f"{med / statistics.median(cuda):.2f}x" if cuda else "-"
            print(
                f"{label:<32} {name:<8} {med:>9.3f} {min(t):>7.3f} {max(t):>7.3f} "
                f"{len(t):>4}  {vs_none:>7}  {vs_cuda:>12}"
            )
    for name, n in allocations.items():
        per = results.get(STATS_ON, {}).get(name)
        if per and n > 0:
            print(
                f"{name}: {n} allocations per run ({STATS_ON}), i.e. one per "
                f"{statistics.median(per) / n * 1e6:.1f} us of the run's wall time"
            )
    ours = results.get(STATS_ON, {})
    for name, want in (("chain", 0.9), ("scatter", 0.9), ("anchor", 1.0)):
        mine = ours.get(name)
        refs = [results.get(k, {}).get(name) for k in ("no plugin", "dask-cuda RMM pool")]
        if not mine or not all(refs):
            continue
        worst = max(statistics.median(mine) / statistics.median(ref) for ref in refs)
        verdict = "met" if worst <= want else "missed"
        print(
            f"target {name}: {STATS_ON} <= {want:.2f}x of both references: {worst:.2f}x, {verdict}"
        )
    write()
    return 0


if __name__ == "__main__":
    sys.exit(main())
