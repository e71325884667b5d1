"""One worker, cuDF then PyTorch, the device tight (issue 43, Deliver 5).

A ballast process (bench/admission_ballast.py) leaves ``--free-gib`` GiB of the device free. Per
round, on one worker with 4 threads: ``--parts`` tables whose rows together fill ``--fill`` of
that memory are made and grouped by key (cuDF's ``groupby().agg``; with cuDF not importable, the
same with CuPy's ``bincount``: the script says which ran), then a PyTorch model step (forward,
backward, SGD) runs on each grouped output. Under:

1. dask-cuda: ``LocalCUDACluster(rmm_pool_size=..., rmm_allocator_external_lib_list=["cupy",
   "torch"])`` (RMM's PyTorch allocator, as RMM documents);
2. cuDF spilling alone: ``LocalCUDACluster(enable_cudf_spill=True)`` (cuDF runs only);
3. dask-rmm: ``LocalCluster`` + ``RMMPlugin(allocators=["rmm", "cupy", "torch"],
   exact_allocators=["rmm"], device_memory_limit=..., spill_on_oom=True,
   memory_admission=True)`` (cuDF's spilling on too, when cuDF runs; compiled RMM without its
   pool, whose free blocks no other library can use).

Per setup: rounds completed, median and range of their times, failed rounds, bytes spilled
(dask-rmm's outputs, and cuDF's spilled buffers as its spill manager counts them: "n/a" for
dask-cuda's own device-to-host spilling, which it does not count), tasks re-run (dask-rmm's
``task_retries``). Setups run interleaved, each round on a fresh cluster; every round checks the
model steps' row count. Each turn first runs an untimed warm-up round of ``--warm-parts`` tables of
the same size (the same task names and shapes: admission learns the peaks it needs, kernels and
libraries load); its spills and re-runs are not counted. (Without it, every fresh cluster met the
timed round knowing nothing: admission let 4 groupbys run at once, H100, 2026-12-07.)

    python bench/one_budget.py                      # 5 rounds, --free-gib 8 (~7 minutes, H100)
    python bench/one_budget.py --rounds 7 --free-gib 12 --json $OUT/one_budget.json
    python bench/one_budget.py --dry-run
"""

from __future__ import annotations

import argparse
import importlib.util
import statistics
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.admission_ballast import (  # noqa: E402
    ballast,
    client_context_first,
    close_cluster,
    computed,
    dask_cuda_pool_size,
    end_turn,
    interleaved_rounds,
    one_worker_cluster,
    resume_rounds,
    run_on_worker,
    save_rounds,
    watch_turn,
)

GiB = 1 << 30
ROW = 16  # bytes a table row: int64 key + two float32 values
THREADS = 4


@dataclass
class Setup:
    name: str
    kind: str  # "dask-cuda" or "dask-rmm"
    options: dict
    times: list[float] = field(default_factory=list)
    failed_rounds: int = 0
    spilled: list[int] = field(default_factory=list)
    reruns: int = 0
    error: str = ""
    env: dict = field(default_factory=dict)
    cluster: Any = None
    client: Any = None

    def start(self) -> None:
        self.cluster, self.client = one_worker_cluster(self.kind, THREADS, self.options, self.env)

    def stop(self) -> None:
        if self.client is not None:
            close_cluster(self.cluster, self.client)
        self.client = self.cluster = None

    def figures(self) -> tuple[int, int]:
        """(bytes spilled, tasks re-run) on the worker so far."""
        try:
            got = run_on_worker(self.client, _worker_figures)
        except Exception:
            return 0, 0
        return sum(g[0] for g in got.values()), sum(g[1] for g in got.values())


def _worker_figures(dask_worker) -> tuple[int, int]:
    """On the worker: bytes of outputs dask-rmm spilled plus cuDF's spilled buffers; re-runs."""
    from dask_rmm.allocators import caches

    spilled = caches.spilled_by_libraries().get("cudf", (0, 0))[0]
    reruns = 0
    wp = getattr(dask_worker.plugins.get("dask-rmm"), "worker_pressure", None)
    if wp is not None:
        for m in wp.metrics():
            spilled += m.total_spilled_bytes
            reruns += m.task_retries
    return spilled, reruns


# -- the workload -------------------------------------------------------------------------------


def make_table(i: int, rows: int, groups: int, use_cudf: bool):
    import cupy

    rs = cupy.random.RandomState(i)
    key = rs.permutation(rows).astype("int64") % groups  # every key, rows // groups times
    a = rs.random_sample(rows, dtype="float32")
    b = rs.random_sample(rows, dtype="float32")
    if use_cudf:
        import cudf

        # A deep copy: cuDF owns (and can spill) its buffers; made from CuPy's arrays they stay
        # external, permanently exposed, never spillable (H100, 2026-12-07: 1.4-2.1 GiB of them).
        return cudf.DataFrame({"key": key, "a": a, "b": b}).copy(deep=True)
    return key, a, b


def group(table, groups: int, use_cudf: bool):
    """Per key: sum, mean and max of ``a``, sum and count of ``b``: a float32 (groups, 5)."""
    import cupy

    if use_cudf:
        g = table.groupby("key").agg({"a": ["sum", "mean", "max"], "b": ["sum", "count"]})
        return g.sort_index().to_cupy(dtype="float32")
    key, a, b = table
    count = cupy.bincount(key, minlength=groups).astype("float32")
    sum_a = cupy.bincount(key, weights=a, minlength=groups).astype("float32")
    import cupyx

    max_a = cupy.zeros(groups, dtype="float32")
    cupyx.scatter_max(max_a, key, a)
    sum_b = cupy.bincount(key, weights=b, minlength=groups).astype("float32")
    return cupy.stack([sum_a, sum_a / cupy.maximum(count, 1), max_a, sum_b, count], axis=1)


def model_step(features, hidden: int) -> int:
    """One forward/backward/SGD step of a small MLP on every row; the rows it saw."""
    import torch

    x = torch.as_tensor(features, device="cuda")
    torch.manual_seed(0)
    model = torch.nn.Sequential(
        torch.nn.Linear(x.shape[1], hidden), torch.nn.ReLU(), torch.nn.Linear(hidden, 1)
    ).cuda()
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    loss = model(x).square().mean()
    loss.backward()
    opt.step()
    torch.cuda.synchronize()
    return int(x.shape[0])


def run_round(client, args, rows: int, groups: int, use_cudf: bool, tag: str, parts: int) -> int:
    from dask import delayed

    steps = []
    for i in range(parts):
        table = delayed(make_table)(i, rows, groups, use_cudf, dask_key_name=f"table-{tag}-{i}")
        feats = delayed(group)(table, groups, use_cudf, dask_key_name=f"group-{tag}-{i}")
        steps.append(delayed(model_step)(feats, args.hidden, dask_key_name=f"step-{tag}-{i}"))
    return sum(computed(client, steps, args.round_timeout))


def setups(free: int, use_cudf: bool) -> list[Setup]:
    limit = int(free * 0.8)
    pool = dask_cuda_pool_size(free)
    out = [
        Setup(
            "dask-cuda pool + rmm torch",
            "dask-cuda",
            {"rmm_pool_size": pool, "rmm_allocator_external_lib_list": ["cupy", "torch"]},
        ),
        Setup(
            "dask-rmm",
            "dask-rmm",
            {
                # compiled RMM without its pool: what cuDF frees is the stack's, for PyTorch too
                # (compiled RMM's pool keeps it: docs/memory-pressure.md)
                "allocators": ["rmm", "cupy", "torch"] if use_cudf else ["cupy", "torch"],
                "exact_allocators": ["rmm"] if use_cudf else None,
                "device_memory_limit": limit,
                "spill_on_oom": True,
                "memory_admission": True,
            },
            env={"CUDF_SPILL": "on"} if use_cudf else {},
        ),
    ]
    if use_cudf:
        out.insert(1, Setup("cuDF spilling alone", "dask-cuda", {"enable_cudf_spill": True}))
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--free-gib", type=float, default=8.0, help="device GiB the ballast leaves")
    p.add_argument("--fill", type=float, default=0.7, help="share of it the tables fill")
    p.add_argument("--parts", type=int, default=8, help="tables (each grouped, then a step)")
    p.add_argument("--warm-parts", type=int, default=2, help="tables of each turn's warm-up")
    p.add_argument("--rows-per-group", type=int, default=8)
    p.add_argument("--hidden", type=int, default=16, help="the model's hidden width")
    p.add_argument("--round-timeout", type=float, default=20.0, help="seconds; then failed")
    p.add_argument("--arrays", action="store_true", help="CuPy for the first half even with cuDF")
    p.add_argument("--dry-run", action="store_true", help="print the setups and exit")
    p.add_argument("--json", help="write the rounds here (after every round)")
    p.add_argument("--resume", help="go on from the rounds an earlier call wrote (its --json)")
    p.add_argument(
        "--time-budget", type=float, help="seconds: start no round that would end after them"
    )
    args = p.parse_args()
    use_cudf = not args.arrays and importlib.util.find_spec("cudf") is not None
    free = int(args.free_gib * GiB)
    rows = int(free * args.fill) // ROW // args.parts
    groups = max(1, rows // args.rows_per_group)
    what = "cuDF groupby" if use_cudf else "CuPy bincount (cuDF not importable or --arrays)"
    configs = setups(free, use_cudf)
    print(
        f"ran: {what}, then a PyTorch step; {args.parts} tables of {rows} rows "
        f"({args.parts * rows * ROW / GiB:.2f} GiB of {args.free_gib} GiB free), "
        f"{groups} groups each, {THREADS} threads"
    )
    if args.dry_run:
        for c in configs:
            print(f"  {c.name}: {c.kind} {c.options}")
        return
    keys = ("name", "times", "failed_rounds", "spilled", "reruns", "error")
    first = resume_rounds(args.resume, what, configs, keys) if args.resume else 0
    client_context_first(use_cudf)
    with ballast(args.free_gib):
        for r, order in interleaved_rounds(configs, first, args.rounds, args.time_budget):
            for c in order:
                start, warm = time.perf_counter(), (0, 0)
                watch_turn(args.round_timeout, show_free=use_cudf)
                try:
                    c.start()
                    try:  # key_split drops "w0" as it does "r0": the same prefixes
                        run_round(c.client, args, rows, groups, use_cudf, f"w{r}", args.warm_parts)
                    except Exception as e:
                        print(f"{c.name}: warm-up: {type(e).__name__}: {e}", file=sys.stderr)
                    warm = c.figures()
                    start = time.perf_counter()
                    seen = run_round(c.client, args, rows, groups, use_cudf, f"r{r}", args.parts)
                    ok = seen == args.parts * groups
                    if not ok:
                        c.error = f"the steps saw {seen} rows, expected {args.parts * groups}"
                except Exception as e:
                    ok = False
                    c.error = f"{type(e).__name__}: {str(e)[:200]}"
                took = time.perf_counter() - start
                if c.client is not None:
                    spilled, reruns = c.figures()
                    c.spilled.append(spilled - warm[0])
                    c.reruns += reruns - warm[1]
                end_turn(c, r, ok, took)
            save_rounds(args.json, what, configs, keys)
    print(
        f"{'setup':28} {'completed':>9} {'median s':>9} {'range':>13} "
        f"{'spilled/round':>13} {'re-runs':>7}"
    )
    for c in configs:
        t = c.times
        med = f"{statistics.median(t):.2f}" if t else "-"
        spread = f"{min(t):.2f}-{max(t):.2f}" if t else "-"
        if c.kind == "dask-cuda" and "enable_cudf_spill" not in c.options:
            spilled = "n/a"
        else:
            spilled = f"{statistics.median(c.spilled) / GiB:.2f}Gi" if c.spilled else "-"
        done = f"{len(t)}/{len(t) + c.failed_rounds}"
        print(f"{c.name:28} {done:>9} {med:>9} {spread:>13} {spilled:>13} {c.reruns:>7}")


if __name__ == "__main__":
    main()
