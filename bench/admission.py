"""Memory admission on a device that is itself short (issue 42, Deliver 4 (b) and (c)).

(b) concurrency-bound: tasks that each hold ~30 % of the device's free memory while they copy
    an input to the device, compute on it and copy a result back, so that more threads help
    (copies overlap compute) until memory runs out. A separate process holds all of the device
    but ``--free-gib`` (bench/admission_ballast.py). One worker: 8 threads, 8 threads with
    ``memory_admission=True``, and fixed 1, 2, 3 and 4 threads. Target: admission completes
    every round within 10 % of the best fixed thread count.
(c) fits: the CuPy chain of bench/dask_workload.py (12000^2 in 500^2 chunks) at 4 and 8 threads,
    admission off and on, no ballast. Target: <= 2 % or inside noise.

Every round runs every configuration once, the order reversed every other round; the table
gives per configuration the median and range of the rounds that completed, the failed rounds,
the failed tasks, the out-of-memory events and the bytes spilled. In (b) each configuration's
turn starts its own LocalCluster (one worker process), runs an untimed warm-up (admission learns
its peaks there), the timed run, and stops it: the configuration has the short device alone. In
(c) each configuration's cluster stays up for the part and is warmed up once. ``--host-memory`` runs the same shapes on host memory
(``base_resource="system"``, NumPy and DeviceBuffers, tiny sizes) to check the script on a CPU
host: its figures say nothing of a GPU. ``--dry-run`` prints the configurations and exits.

    python bench/admission.py --parts b --rounds 5 --free-gib 24 [--json out.json]
    python bench/admission.py --parts c --rounds 5
    python bench/admission.py --host-memory --rounds 2
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.admission_ballast import ballast  # noqa: E402

MiB, GiB = 1 << 20, 1 << 30


@dataclass
class Config:
    """One configuration: a name, how to start its cluster, and what its rounds gave."""

    name: str
    threads: int
    plugin: dict  # RMMPlugin options
    times: list[float] = field(default_factory=list)
    failed_rounds: int = 0
    failed_tasks: int = 0
    ooms: int = 0
    spilled: int = 0
    learned: int = 0  # the largest expected peak the worker's admission had learned
    cluster: Any = None
    client: Any = None

    def start(self) -> None:
        from distributed import Client, LocalCluster

        from dask_rmm import RMMPlugin

        self.cluster = LocalCluster(
            n_workers=1,
            threads_per_worker=self.threads,
            processes=True,
            dashboard_address=":0",
            worker_dashboard_address=None,
            host="127.0.0.1",
        )
        self.client = Client(self.cluster)
        self.client.register_plugin(RMMPlugin(**self.plugin))

    def stop(self) -> None:
        if self.client is not None:
            self.client.close()
            self.cluster.close()

    def counters(self) -> tuple[int, int]:
        """(out-of-memory events, bytes spilled) on the worker since setup."""

        def read(dask_worker):
            wp = getattr(dask_worker.plugins.get("dask-rmm"), "worker_pressure", None)
            if wp is None:
                return 0, 0
            m = wp.metrics()
            return sum(x.oom_count for x in m), sum(x.total_spilled_bytes for x in m)

        try:
            values = list(self.client.run(read).values())
            return sum(v[0] for v in values), sum(v[1] for v in values)
        except Exception:
            return 0, 0

    def learned_peak(self) -> int:
        """The largest expected peak admission learned on the worker (0: admission off)."""

        def read(dask_worker):
            from dask_rmm.pressure.admission import admission_of

            admission = admission_of(dask_worker)
            return max((p[1] for p in admission.peaks.top(1)), default=0) if admission else 0

        try:
            return max(self.client.run(read).values(), default=0)
        except Exception:
            return 0


def release(client) -> None:
    """Give every free byte the worker holds back to the device (the next configuration's)."""
    from dask_rmm import release_unused

    release_unused(client)


# -- (b) the concurrency-bound task ---------------------------------------------------------------


def copy_compute_copy(i: int, nbytes: int, work: int, host: bool) -> float:
    """Copy ``nbytes / 4`` in, grow it to ``nbytes`` on the device, compute ``work`` passes, copy
    a quarter back; the value every run must return for ``i``."""
    import numpy as np

    part = nbytes // 4 // 8
    data = np.full(part, float(i + 1))
    if host:
        from dask_rmm import DeviceBuffer

        buf = DeviceBuffer(size=nbytes)  # what the task holds in the worker's budget
        x = np.tile(data, 4)
        for _ in range(work):
            x *= 1.0001
        back = x[:part].copy()
        del buf, x
    else:
        import cupy

        # the task's whole footprint at once (its peak is what it holds: a transient input
        # copy beside it made the peak 1.25x the holding), filled a quarter at a time
        x = cupy.empty(4 * part)
        for k in range(4):
            x[k * part : (k + 1) * part].set(data)  # host to device
        for _ in range(work):
            x *= 1.0001
        back = cupy.asnumpy(x[:part])  # device to host
        del x
    return float(back[0])


def expected(i: int, work: int) -> float:
    v = float(i + 1)
    for _ in range(work):
        v *= 1.0001
    return v


def round_b(config: Config, tasks: int, nbytes: int, work: int, host: bool, tag: str) -> bool:
    from distributed import wait

    c = config.client
    futures = c.map(
        copy_compute_copy, range(tasks), nbytes=nbytes, work=work, host=host,
        key=[f"ccc-{tag}-{i}" for i in range(tasks)],
    )  # fmt: skip
    wait(futures, timeout=240)
    bad = [f for f in futures if f.status != "finished"]
    ok = not bad and all(abs(f.result() - expected(i, work)) < 1e-6 for i, f in enumerate(futures))
    config.failed_tasks += len(bad)
    del futures
    return ok


# -- (c) the chain --------------------------------------------------------------------------------


def chain(n: int, chunk: int, host: bool, seed: int):
    import dask.array as da

    if host:
        x = da.random.RandomState(seed).random_sample((n, n), chunks=(chunk, chunk))
    else:
        import cupy

        rs = da.random.RandomState(seed, RandomState=cupy.random.RandomState)
        x = rs.random_sample((n, n), chunks=(chunk, chunk))
    return ((x + x.T) * 2 - x.mean(axis=0)).sum()


def round_c(config: Config, n: int, chunk: int, host: bool, seed: int) -> bool:
    value = float(config.client.compute(chain(n, chunk, host, seed)).result(timeout=240))
    return abs(value - 1.5 * n * n) < 10 * 0.87 * n  # 10 standard deviations


# -- rounds and the table -------------------------------------------------------------------------


def _warm(config: Config, one) -> None:
    """One untimed run (admission learns its peaks there); its failures and OOMs are not the
    rounds'."""
    failed_tasks = config.failed_tasks
    try:
        one(config, "w0")  # a tag key_split drops, as r0, r1, ...: the same prefixes
    except Exception as e:
        print(f"{config.name}: warm-up: {type(e).__name__}: {e}", file=sys.stderr)
    config.failed_tasks = failed_tasks
    release(config.client)


def _timed(config: Config, one, r: int) -> None:
    before = config.counters()
    start = time.perf_counter()
    try:
        ok = one(config, f"r{r}")
    except Exception as e:  # a task failing, a timeout
        print(f"{config.name}: round {r}: {type(e).__name__}: {e}", file=sys.stderr)
        ok = False
    took = time.perf_counter() - start
    after = config.counters()
    if ok:
        config.times.append(took)
    else:
        config.failed_rounds += 1
    config.learned = max(config.learned, config.learned_peak())
    config.ooms += after[0] - before[0]
    config.spilled += after[1] - before[1]
    print(f"round {r} {config.name}: {took:.3f} s {'ok' if ok else 'FAILED'}", file=sys.stderr)
    release(config.client)


def rounds(configs: list[Config], rounds: int, one, save=None, fresh: bool = False) -> None:
    """``rounds`` interleaved rounds of ``one(config, tag) -> ok``, the order reversed every
    other round. ``fresh``: each configuration's turn starts its own cluster, warms it up and
    stops it after its timed run, so that it has the device alone (the caches of a cluster
    kept alive hold device memory the next configuration then lacks); otherwise every cluster
    stays up and is warmed up once before the first round."""
    if not fresh:
        for config in configs:
            _warm(config, one)
    for r in range(rounds):
        for config in configs if r % 2 == 0 else configs[::-1]:
            if fresh:
                config.start()
                try:
                    _warm(config, one)
                    _timed(config, one, r)
                finally:
                    config.stop()
            else:
                _timed(config, one, r)
        if save:
            save(configs)


def table(configs: list[Config], title: str) -> str:
    lines = [
        title,
        f"{'configuration':28} {'median s':>9} {'range':>17} {'failed rounds':>14} "
        f"{'failed tasks':>13} {'OOMs':>5} {'spilled':>10} {'learned':>9}",
    ]
    for c in configs:
        t = c.times
        med = f"{statistics.median(t):.3f}" if t else "-"
        spread = f"{min(t):.3f}-{max(t):.3f}" if t else "-"
        n = len(t) + c.failed_rounds
        lines.append(
            f"{c.name:28} {med:>9} {spread:>17} {c.failed_rounds:>7}/{n:<6} {c.failed_tasks:>13} "
            f"{c.ooms:>5} {c.spilled / GiB:>8.2f}Gi "
            + (f"{c.learned / GiB:>7.2f}Gi" if c.learned else f"{'-':>9}")
        )
    done = [c for c in configs if c.times and not c.failed_rounds]
    if done:
        best = min(done, key=lambda c: statistics.median(c.times))
        lines.append(f"fastest that completed every round: {best.name}")
    return "\n".join(lines)


def to_json(configs: list[Config]) -> list[dict]:
    keys = (
        "name",
        "threads",
        "times",
        "failed_rounds",
        "failed_tasks",
        "ooms",
        "spilled",
        "learned",
    )
    return [{k: getattr(c, k) for k in keys} for c in configs]


def part_b(args) -> list[Config]:
    host = args.host_memory
    free = 64 * MiB if host else int(args.free_gib * GiB)
    base: dict = {"allocators": [] if host else ["cupy"]}
    if host:
        base.update(base_resource="system", pool_size=free, maximum_pool_size=free)
    names = [("8 threads", 8, False), ("8 threads + admission", 8, True)]
    names += [(f"{n} threads", n, False) for n in (1, 2, 3, 4)]
    if not host:  # the budget: what the ballast leaves, less the worker's CUDA context
        base.update(device_memory_limit=int(free - 0.75 * GiB))
    nbytes = int(free * 0.3)
    configs = [Config(n, t, {**base, "memory_admission": a}) for n, t, a in names]
    if args.dry_run:
        return configs
    tasks, work = (12, 3) if host else (args.tasks, args.work)
    with ballast(None if host else args.free_gib):
        rounds(
            configs,
            args.rounds,
            # the warm-up runs one task a thread: enough to learn, compile and draw
            lambda c, tag: round_b(
                c, min(tasks, c.threads) if tag == "w0" else tasks, nbytes, work, host, tag
            ),
            args.save,
            fresh=True,
        )
    return configs


def part_c(args) -> list[Config]:
    host = args.host_memory
    base: dict = {"allocators": [] if host else ["cupy"]}
    if host:
        base.update(base_resource="system")
    configs = [
        Config(f"{t} threads{' + admission' * a}", t, {**base, "memory_admission": a})
        for t in (4, 8)
        for a in (False, True)
    ]
    if args.dry_run:
        return configs
    n, chunk = (2000, 250) if host else (12000, 500)
    seeds = iter(range(10_000))
    for c in configs:
        c.start()
    try:
        rounds(
            configs, args.rounds, lambda c, tag: round_c(c, n, chunk, host, next(seeds)), args.save
        )
    finally:
        for c in configs:
            c.stop()
    return configs


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--parts", default="bc", help="which parts: b, c or bc")
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--free-gib", type=float, default=24.0, help="(b) device GiB the ballast leaves")
    p.add_argument("--tasks", type=int, default=8, help="(b) tasks per round")
    p.add_argument("--work", type=int, default=40, help="(b) compute passes per task")
    p.add_argument("--host-memory", action="store_true", help="host memory, tiny sizes (CPU)")
    p.add_argument("--dry-run", action="store_true", help="print the configurations and exit")
    p.add_argument("--json", help="write the rounds here (after every round)")
    args = p.parse_args()
    results: dict[str, list] = {}

    def saver(part: str):
        def save(configs: list[Config]) -> None:
            results[part] = to_json(configs)
            if args.json:
                Path(args.json).write_text(json.dumps(results, indent=1))

        return save

    for part, fn, title in (
        (
            "b",
            part_b,
            "(b) concurrency-bound: ~30 % of the free device per task, copies in and out",
        ),
        ("c", part_c, "(c) fits: the CuPy chain, 4 and 8 threads, admission off and on"),
    ):
        if part not in args.parts:
            continue
        args.save = saver(part)
        configs = fn(args)
        if args.dry_run:
            print(title)
            for c in configs:
                print(f"  {c.name}: {c.threads} threads, RMMPlugin({c.plugin})")
            continue
        args.save(configs)
        print(table(configs, title + (" [host memory]" if args.host_memory else "")))


if __name__ == "__main__":
    main()
