"""Out-of-core merge on a device that is itself short (issue 42, Deliver 4 (a)).

Two tables whose total is ~2x the device memory a ballast process leaves free
(bench/admission_ballast.py, ``--free-gib``), joined on a skewed key (``--skew`` of the left
rows share one key; the shape of dask-cuda's ``local_cudf_merge`` benchmark), under:

1. dask-cuda: ``LocalCUDACluster(rmm_pool_size=..., device_memory_limit=...)``;
2. cuDF spilling: ``LocalCUDACluster(enable_cudf_spill=True)`` (cuDF runs only);
3. dask-rmm: ``LocalCluster`` + ``RMMPlugin(device_memory_limit=..., spill_on_oom=True)``;
4. dask-rmm with ``memory_admission=True``.

With cuDF and dask_cudf importable, the tables are dask_cudf DataFrames merged by
``DataFrame.merge`` (a task shuffle); otherwise CuPy arrays of the same shape, hash-partitioned
and joined per partition by sort and search (the script says which ran). Every round checks the
join's row count and checksum against the expected ones. Per configuration: rounds completed,
median and range of their times, failed rounds, out-of-memory errors seen, bytes spilled (where
the setup reports them). Each configuration's turn has the device alone: it starts its own
one-worker cluster, runs an untimed warm-up merge of ``--warm-parts`` partitions of the same size
(same task names and shapes: admission learns the peaks; kernels, imports and pools warm up),
then the timed merge, and closes the cluster. (Kept across rounds, clusters held their caches and
CUDA contexts side by side: on an H100 with 4 GiB free, the second dask-rmm worker could not
start, cudaErrorDevicesUnavailable, 2026-12-07.) A setup whose worker does not come up (in 90
s) and a merge not done in ``--round-timeout`` seconds count as a failed round.

    python bench/ooc_merge.py --rounds 5 --free-gib 4 [--json out.json]
    python bench/ooc_merge.py --host-memory --rounds 2     # a CPU check of the script
    python bench/ooc_merge.py --dry-run
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

MiB, GiB = 1 << 20, 1 << 30
ROW = 16  # bytes a row: int64 key + float64 payload


@dataclass
class Setup:
    name: str
    kind: str  # "dask-cuda", "cudf-spill", "dask-rmm"
    options: dict
    times: list[float] = field(default_factory=list)
    failed_rounds: int = 0
    ooms: int = 0
    spilled: int = 0
    cluster: Any = None
    client: Any = None
    error: str = ""

    def start(self, threads: int, host: bool) -> None:
        self.cluster, self.client = one_worker_cluster(self.kind, threads, self.options)

    def stop(self) -> None:
        if self.client is not None:
            close_cluster(self.cluster, self.client)
        self.client = self.cluster = None

    def spilled_bytes(self) -> int:
        """Bytes the worker spilled so far (dask-rmm's counters; 0 where not reported)."""
        if self.kind != "dask-rmm":
            return 0

        def read(dask_worker):
            wp = getattr(dask_worker.plugins.get("dask-rmm"), "worker_pressure", None)
            return 0 if wp is None else sum(m.total_spilled_bytes for m in wp.metrics())

        try:
            return sum(run_on_worker(self.client, read).values())
        except Exception:
            return 0


# -- the CuPy (or NumPy, on host memory) version ------------------------------------------------


def _xp(host: bool):
    if host:
        import numpy

        return numpy
    import cupy

    return cupy


def make_part(side: str, i: int, rows: int, keys: int, skew: float, host: bool):
    """One partition of a table: keys (int64) and payload (float64). Left keys: ``skew`` of the
    rows on key 0, the rest uniform; right keys: each key once, spread over the partitions."""
    xp = _xp(host)
    rs = xp.random.RandomState(1000 * (side == "left") + i)
    if side == "right":
        k = xp.arange(i, keys, max(1, keys // rows), dtype="int64")[:rows]
    else:
        k = rs.randint(0, keys, size=rows).astype("int64")
        k[: int(rows * skew)] = 0
    return xp.stack([k.astype("float64"), xp.ones(len(k))])  # 2 x rows, float64


def split(part, nparts: int, host: bool) -> list:
    """A partition's rows by hash bucket (key mod ``nparts``)."""
    xp = _xp(host)
    bucket = part[0].astype("int64") % nparts
    order = xp.argsort(bucket)
    part, bucket = part[:, order], bucket[order]
    edges = xp.searchsorted(bucket, xp.arange(nparts + 1))
    edges = [int(e) for e in (edges.get() if hasattr(edges, "get") else edges)]
    return [part[:, edges[j] : edges[j + 1]].copy() for j in range(nparts)]


def pick(pieces: list, j: int):
    return pieces[j]


def join(lefts: list, rights: list, host: bool) -> tuple[int, float]:
    """Rows of the inner join of one bucket, and the sum of the joined payload products."""
    xp = _xp(host)
    left = xp.concatenate(lefts, axis=1)
    right = xp.concatenate(rights, axis=1)
    rk = right[0]
    order = xp.argsort(rk)
    rk, rv = rk[order], right[1][order]
    pos = xp.searchsorted(rk, left[0])
    pos = xp.minimum(pos, max(len(rk) - 1, 0))
    hit = rk[pos] == left[0] if len(rk) else xp.zeros(left.shape[1], dtype=bool)
    joined = left[1][hit] * rv[pos[hit]]  # the join's output, materialised
    return int(hit.sum()), float(joined.sum())


def arrays_merge(client, nparts: int, rows: int, keys: int, skew: float, host: bool, tag: str,
                 timeout: float):  # fmt: skip
    from dask import delayed

    def table(side: str) -> list:
        parts = [
            delayed(make_part)(
                side, i, rows, keys, skew, host, dask_key_name=f"make-{side}-{tag}-{i}"
            )
            for i in range(nparts)
        ]
        return [
            delayed(split)(p, nparts, host, dask_key_name=f"split-{side}-{tag}-{i}")
            for i, p in enumerate(parts)
        ]

    left, right = table("left"), table("right")
    joins = [
        delayed(join)(
            [
                delayed(pick)(p, j, dask_key_name=f"pick-l-{tag}-{i}-{j}")
                for i, p in enumerate(left)
            ],
            [
                delayed(pick)(p, j, dask_key_name=f"pick-r-{tag}-{i}-{j}")
                for i, p in enumerate(right)
            ],
            host,
            dask_key_name=f"join-{tag}-{j}",
        )
        for j in range(nparts)
    ]
    results = computed(client, joins, timeout)
    return sum(r[0] for r in results), sum(r[1] for r in results)


def expected_arrays(nparts: int, rows: int, keys: int, skew: float) -> int:
    """The join's row count, computed on the host without Dask."""
    import numpy as np

    right = np.concatenate(
        [make_part("right", i, rows, keys, skew, True)[0] for i in range(nparts)]
    )
    present = np.zeros(keys, dtype=bool)
    present[right.astype("int64")] = True
    total = 0
    for i in range(nparts):
        total += int(present[make_part("left", i, rows, keys, skew, True)[0].astype("int64")].sum())
    return total


# -- the cuDF version -----------------------------------------------------------------------------


def cudf_merge(client, nparts: int, rows: int, keys: int, skew: float, tag: str, timeout: float):
    import cudf
    import dask.dataframe as dd
    from dask import delayed

    def frame(side: str, i: int):
        import cudf

        part = make_part(side, i, rows, keys, skew, False)
        frame = cudf.DataFrame({"key": part[0].astype("int64"), f"v_{side}": part[1]})
        return frame.copy(deep=True)  # cuDF's own buffers: spillable (CuPy's stay exposed)

    def meta(side: str):
        return cudf.DataFrame(
            {"key": cudf.Series([], dtype="int64"), f"v_{side}": cudf.Series([], dtype="float64")}
        )

    left = dd.from_delayed(
        [delayed(frame)("left", i, dask_key_name=f"l-{tag}-{i}") for i in range(nparts)],
        meta=meta("left"),
    )
    right = dd.from_delayed(
        [delayed(frame)("right", i, dask_key_name=f"r-{tag}-{i}") for i in range(nparts)],
        meta=meta("right"),
    )
    merged = left.merge(right, on="key", how="inner", shuffle_method="tasks")
    rows_out, total = computed(
        client, [merged.shape[0], (merged.v_left * merged.v_right).sum()], timeout
    )
    return int(rows_out), float(total)


def release(c: Setup) -> None:
    """The worker's free memory back to the device (for the next setup's turn)."""
    from dask_rmm import release_unused

    try:
        release_unused(c.client)
    except Exception as e:
        print(f"{c.name}: release_unused: {type(e).__name__}: {e}", file=sys.stderr)


# -- rounds ---------------------------------------------------------------------------------------


def setups(args, free: int, use_cudf: bool) -> list[Setup]:
    limit = int(free * 0.8)
    if args.host_memory:
        base = {"base_resource": "system", "pool_size": "8MiB", "maximum_pool_size": free}
        return [
            Setup(
                "dask-rmm", "dask-rmm", {**base, "device_memory_limit": limit, "spill_on_oom": True}
            ),
            Setup(
                "dask-rmm + admission",
                "dask-rmm",
                {
                    **base,
                    "device_memory_limit": limit,
                    "spill_on_oom": True,
                    "memory_admission": True,
                },
            ),
        ]
    pool = dask_cuda_pool_size(free)
    limit = int(pool * 0.8)  # below dask-cuda's pool (room for a merge's temporaries); one for all
    # cuDF through compiled RMM without its pool (exact_allocators): every free reaches the
    # worker's stack, so an allocation that fails waits for the frees of the tasks beside it,
    # and admission counts each task's bytes (compiled RMM's pool keeps what it frees).
    rmm_libs = {
        "allocators": ["rmm", "cupy"] if use_cudf else ["cupy"],
        "exact_allocators": ["rmm"] if use_cudf else None,
    }
    out = [
        Setup(
            "dask-cuda pool + limit",
            "dask-cuda",
            {"rmm_pool_size": pool, "device_memory_limit": limit},
        ),
        Setup(
            "dask-rmm",
            "dask-rmm",
            {**rmm_libs, "device_memory_limit": limit, "spill_on_oom": True},
        ),
        Setup(
            "dask-rmm + admission",
            "dask-rmm",
            {
                **rmm_libs,
                "device_memory_limit": limit,
                "spill_on_oom": True,
                "memory_admission": True,
            },
        ),
    ]
    if use_cudf:
        out.insert(1, Setup("cuDF spilling", "dask-cuda", {"enable_cudf_spill": True}))
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--free-gib", type=float, default=4.0, help="device GiB the ballast leaves")
    p.add_argument("--parts", type=int, default=16, help="partitions of each table")
    p.add_argument("--skew", type=float, default=0.2, help="share of left rows on one key")
    p.add_argument("--threads", type=int, default=8)
    p.add_argument(
        "--warm-parts", type=int, default=2, help="partitions of each turn's untimed warm-up merge"
    )
    p.add_argument("--arrays", action="store_true", help="the CuPy version even with cuDF")
    p.add_argument("--host-memory", action="store_true", help="host memory, tiny sizes (CPU)")
    p.add_argument("--dry-run", action="store_true", help="print the setups and exit")
    p.add_argument("--round-timeout", type=float, default=150.0, help="seconds; then failed")
    p.add_argument("--json", help="write the rounds here (after every configuration's turn)")
    p.add_argument("--resume", help="go on from the rounds an earlier call wrote (its --json)")
    p.add_argument(
        "--time-budget", type=float, help="seconds: start no round that would end after them"
    )
    args = p.parse_args()
    host = args.host_memory
    use_cudf = (
        not host
        and not args.arrays
        and all(importlib.util.find_spec(m) for m in ("cudf", "dask_cudf"))
    )
    free = 64 * MiB if host else int(args.free_gib * GiB)
    rows = 2 * free // 2 // ROW // args.parts  # both tables: ~2x the free memory
    keys = rows * args.parts
    what = (
        "cuDF (dask_cudf merge)"
        if use_cudf
        else ("NumPy on host memory" if host else "CuPy arrays")
    )
    configs = setups(args, free, use_cudf)
    print(
        f"ran: {what}; {args.parts} partitions of {rows} rows a table, {2 * rows * args.parts * ROW / GiB:.2f} GiB in all, skew {args.skew}"
    )
    if args.dry_run:
        for c in configs:
            print(f"  {c.name}: {c.kind} {c.options}")
        return
    want = expected_arrays(args.parts, rows, keys, args.skew)

    timeout = args.round_timeout

    def merge(c: Setup, tag: str, parts: int) -> tuple[int, float]:
        # The same rows a partition (and so the same task sizes) whatever the partition count.
        if use_cudf:
            return cudf_merge(c.client, parts, rows, rows * parts, args.skew, tag, timeout)
        return arrays_merge(c.client, parts, rows, rows * parts, args.skew, host, tag, timeout)

    def turn(c: Setup, r: int) -> None:
        """One configuration's turn: its own cluster, an untimed warm-up, the timed merge."""
        ok, took = False, 0.0
        watch_turn(args.round_timeout, show_free=use_cudf)
        try:
            c.start(args.threads, host)
        except Exception as e:
            c.error = f"setup: {type(e).__name__}: {str(e)[:200]}"
        else:
            try:
                merge(c, f"w{r}", min(args.warm_parts, args.parts))  # key_split: the same prefixes
            except Exception as e:
                print(f"{c.name}: warm-up: {type(e).__name__}: {e}", file=sys.stderr)
            release(c)
            before = c.spilled_bytes()
            start = time.perf_counter()
            try:
                got = merge(c, f"r{r}", args.parts)
                ok = got[0] == want and abs(got[1] - want) < 1e-6 * max(want, 1)
                if not ok:
                    c.error = f"wrong result {got}, expected {want} rows"
            except Exception as e:
                c.error = f"{type(e).__name__}: {str(e)[:200]}"
                c.ooms += "out of memory" in str(e).lower() or "OutOfMemory" in type(e).__name__
            took = time.perf_counter() - start
            c.spilled += c.spilled_bytes() - before
        end_turn(c, r, ok, took)
        # After every turn: a run cut short still says what it saw.
        save_rounds(args.json, what, configs, fields)

    fields = ("name", "times", "failed_rounds", "ooms", "spilled", "error")
    first = resume_rounds(args.resume, what, configs, fields) if args.resume else 0
    client_context_first(use_cudf)
    with ballast(None if host else args.free_gib):
        for r, order in interleaved_rounds(configs, first, args.rounds, args.time_budget):
            for c in order:
                turn(c, r)
    print(
        f"{'setup':26} {'completed':>9} {'median s':>9} {'range':>15} {'OOM rounds':>10} {'spilled':>9}"
    )
    for c in configs:
        t = c.times
        med = f"{statistics.median(t):.2f}" if t else "-"
        spread = f"{min(t):.2f}-{max(t):.2f}" if t else "-"
        print(
            f"{c.name:26} {len(t):>4}/{len(t) + c.failed_rounds:<4} {med:>9} {spread:>15} {c.ooms:>10} {c.spilled / GiB:>7.2f}Gi"
        )


if __name__ == "__main__":
    main()
