"""Compare two source trees on bench/alloc.py's workload in process CPU time (noisy hosts).

Each tree's ``dask_rmm`` is imported in its own interpreter; the trees run alternately, round
by round, and each run times the steady-state loop with ``time.process_time_ns`` (CPU time of
this process: other jobs on a shared machine inflate it far less than wall time). Resources are
over ``SystemMemoryResource``, so it runs on any host.

    python bench/alloc_ab.py BEFORE_TREE AFTER_TREE [--rounds 4] [--repeats 3] [--rows dict,pool,...]

A tree is a directory holding ``dask_rmm/`` (``git archive <commit> | tar -x -C DIR``).
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROWS = ("dict", "pool", "stats", "worker", "tracking", "binning", "arena", "fixed")

_CHILD = r"""
import gc, json, sys, time
tree, bench, rows, repeats, steps = sys.argv[1], sys.argv[2], sys.argv[3].split(","), int(sys.argv[4]), int(sys.argv[5])
sys.path.insert(0, tree)
import dask_rmm
from dask_rmm import mr
from dask_rmm.mr.attribution_adaptor import AttributionResourceAdaptor
assert dask_rmm.__file__.startswith(tree), dask_rmm.__file__
sys.path.insert(0, bench)
import alloc as B

def loop(alloc, free, initial, victims, sizes):
    return B.run_loop(alloc, free, initial, victims, sizes, clock=time.process_time_ns)

def make(name):
    up = mr.SystemMemoryResource()
    pool = lambda: mr.PoolMemoryResource(up, initial_pool_size=B.POOL_SIZE)
    return {
        "dict": lambda: B.DictBaseline(),
        "pool": pool,
        "stats": lambda: mr.StatisticsResourceAdaptor(pool()),
        # the worker stack: owners charged (attribution) over statistics over the pool
        "worker": lambda: AttributionResourceAdaptor(
            mr.StatisticsResourceAdaptor(pool()), lambda: "task-0", owner_name=str
        ),
        "tracking": lambda: mr.TrackingResourceAdaptor(pool()),
        "binning": lambda: mr.BinningMemoryResource(pool(), 18, 22),
        "arena": lambda: mr.ArenaMemoryResource(up, arena_size=B.POOL_SIZE),
        "fixed": lambda: mr.FixedSizeMemoryResource(up, block_size=B.MAX_SIZE, blocks_to_preallocate=B.W + 64),
    }[name]()

out = {}
for name in rows:
    runs = []
    for rep in range(repeats):
        r = make(name)
        runs.append(loop(r.allocate, r.deallocate, *B.draw(steps, B.W, rep)) / steps)
        del r
        gc.collect()
    out[name] = runs
print(json.dumps(out))
"""


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("before", type=Path)
    ap.add_argument("after", type=Path)
    ap.add_argument("--rounds", type=int, default=4)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--steps", type=int, default=100_000)
    ap.add_argument("--rows", default=",".join(ROWS))
    ap.add_argument("--json", type=Path, default=None)
    args = ap.parse_args()
    trees = {"before": args.before.resolve(), "after": args.after.resolve()}
    runs: dict[str, dict[str, list[float]]] = {t: {} for t in trees}
    for _ in range(args.rounds):
        for label, tree in trees.items():
            res = subprocess.run(
                [
                    sys.executable,
                    "-c",
                    _CHILD,
                    str(tree),
                    str(HERE),
                    args.rows,
                    str(args.repeats),
                    str(args.steps),
                ],
                capture_output=True,
                text=True,
                check=True,
            )
            for name, values in json.loads(res.stdout).items():
                runs[label].setdefault(name, []).extend(values)
    print(
        f"# ns per pair in process CPU time, min (median) of {args.rounds} x {args.repeats} "
        "runs; ratio: min / the dict baseline's min of the same tree"
    )
    print(f"{'row':<10} {'before':>16} {'after':>16} {'before/dict':>12} {'after/dict':>11}")
    base = {t: min(runs[t].get("dict", [float("nan")])) for t in trees}
    for name in args.rows.split(","):
        cells = []
        for t in trees:
            v = runs[t][name]
            cells.append(f"{min(v):>7.0f} ({statistics.median(v):>6.0f})")
        ratios = [min(runs[t][name]) / base[t] for t in trees]
        print(f"{name:<10} {cells[0]:>16} {cells[1]:>16} {ratios[0]:>12.2f} {ratios[1]:>11.2f}")
    if args.json:
        args.json.write_text(
            json.dumps({"trees": {k: str(v) for k, v in trees.items()}, "runs": runs}, indent=1)
            + "\n"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
