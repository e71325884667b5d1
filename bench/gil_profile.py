"""Where the time of a multi-threaded Dask worker goes when each allocation runs Python (GPU;
part 1 also on CPU).

1. Python calls per allocate+free pair: through a worker-like stack (attribution > statistics >
   pool) called directly, and through CuPy with the per-allocation hook and with CuPy's pool
   in front of the stack (``sys.setprofile`` counts every Python and C call).
2. Switch-interval experiment: the CuPy chain of bench/tiers.py at ``--threads`` threads, per
   allocation path, with the worker's ``sys.setswitchinterval`` at 0.5, 5 (Python's default)
   and 50 ms. If holding the GIL per allocation is the cost, the interval moves it.
3. py-spy (when installed): ``record --gil --native`` (where the GIL holder is) and
   ``record --idle --native`` (what every thread does, waiting included) of the worker while
   it runs the chain through the per-allocation hook; a summary of the leaf frames.

    python bench/gil_profile.py [--threads 4] [--out DIR]
"""

from __future__ import annotations

import argparse
import collections
import os
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))


def _count_calls(fn, n: int) -> tuple[float, float]:
    """(Python calls, C calls) per call of ``fn``, counted with a profile hook."""
    counts = collections.Counter()

    def hook(frame, event, arg):
        counts[event] += 1

    fn()  # warm
    sys.setprofile(hook)
    try:
        for _ in range(n):
            fn()
    finally:
        sys.setprofile(None)
    return counts["call"] / n, counts["c_call"] / n


def calls_per_allocation(gpu: bool) -> None:
    from dask_rmm import mr
    from dask_rmm.stack.build import build_stack
    from dask_rmm.stack.options import RMMOptions

    base = "cuda" if gpu else "system"
    opts = RMMOptions(base_resource=base, pool_size=256 << 20)
    stack = build_stack(opts, 0, task_key=lambda: "task-1", owner_name=lambda k: "task")
    top = stack.top
    print(f"# stack: {stack.chain}")

    def pair():
        top.deallocate(top.allocate(4096), 4096)

    py, c = _count_calls(pair, 2000)
    print(f"stack allocate+deallocate: {py:.1f} Python calls, {c:.1f} C calls per pair")
    if not gpu:
        return
    import cupy

    from dask_rmm.allocators import cupy as hook

    previous = mr.set_current_device_resource(top)
    for label, cache in (("per-allocation hook", False), ("CuPy pool in front", True)):
        hook.set_cupy_allocator(cache=cache)

        def empty():
            a = cupy.empty(1024, dtype=cupy.uint8)
            del a

        py, c = _count_calls(empty, 2000)
        print(f"cupy.empty+del, {label}: {py:.1f} Python calls, {c:.1f} C calls per pair")
        hook.reset_cupy_allocator()
    mr.set_current_device_resource(previous)


def gil_proxy(threads_list=(1, 2, 4, 8), steps: int = 20_000, rounds: int = 3) -> None:
    """CPU proxy of a launch-bound worker: each step is a GIL-free C call of a few microseconds
    (a kernel launch's stand-in: hashing 8 KiB) after an allocate+free through the worker's
    stack, or with none. Wall time per step over all threads: with the GIL, Python per
    allocation stops overlapping once threads outnumber what the GIL lets run."""
    import hashlib
    import threading

    from dask_rmm.stack.build import build_stack
    from dask_rmm.stack.options import RMMOptions

    stack = build_stack(
        RMMOptions(base_resource="system", pool_size=64 << 20),
        0,
        task_key=lambda: "t-1",
        owner_name=lambda k: "t",
    )
    top = stack.top
    data = bytes(8192)
    sha = hashlib.sha256

    def work(n, allocate):
        if allocate:
            for _ in range(n):
                p = top.allocate(4096)
                sha(data).digest()
                top.deallocate(p, 4096)
        else:
            for _ in range(n):
                sha(data).digest()

    print(f"\n# GIL proxy on {os.cpu_count()} CPUs: ns per step (all threads' steps / wall)")
    print(f"{'threads':>7} {'no allocation':>14} {'stack pair':>11} {'added':>7}")
    for threads in threads_list:
        per = {}
        for allocate in (False, True):
            times = []
            for _ in range(rounds):
                ts = [
                    threading.Thread(target=work, args=(steps // threads, allocate))
                    for _ in range(threads)
                ]
                t0 = time.perf_counter_ns()
                for t in ts:
                    t.start()
                for t in ts:
                    t.join()
                times.append((time.perf_counter_ns() - t0) / steps)
            per[allocate] = statistics.median(times)
        print(f"{threads:>7} {per[False]:>14.0f} {per[True]:>11.0f} {per[True] - per[False]:>7.0f}")


def _chain(client, steps=20):
    from tiers import cupy_chain

    t0 = time.perf_counter()
    client.compute(cupy_chain(steps=steps)).result()
    return time.perf_counter() - t0


def _set_interval(seconds, dask_worker=None):
    sys.setswitchinterval(seconds)
    return sys.getswitchinterval()


def switch_intervals(threads: int, rounds: int) -> None:
    from dask_workload import one_worker_cluster
    from distributed import Client

    from dask_rmm import RMMPlugin

    configs = {
        "no plugin": None,
        "per-allocation (exact)": dict(exact_allocators=["cupy"]),
        "CuPy pool in front (default)": {},
    }
    clusters = {}
    try:
        for label, extra in configs.items():
            cluster = one_worker_cluster(threads)
            client = Client(cluster)
            if extra is not None:
                client.register_plugin(RMMPlugin(pool_size="2GiB", allocators=["cupy"], **extra))
            clusters[label] = (cluster, client)
            _chain(client)
        print(f"\n# switch interval, chain at {threads} threads, median of {rounds} (s)")
        print(f"{'configuration':<30} " + " ".join(f"{ms:>8} ms" for ms in (0.5, 5, 50)))
        table = {label: {} for label in clusters}
        for ms in (0.5, 5, 50):
            for _, client in clusters.values():
                client.run(_set_interval, ms / 1000)
            for _ in range(rounds):
                for label, (_, client) in clusters.items():
                    table[label].setdefault(ms, []).append(_chain(client))
        for label, per in table.items():
            print(
                f"{label:<30} " + " ".join(f"{statistics.median(t):>11.3f}" for t in per.values())
            )
        pyspy(clusters["per-allocation (exact)"][1], "exact")
        pyspy(clusters["CuPy pool in front (default)"][1], "cache")
    finally:
        for cluster, client in clusters.values():
            client.close()
            cluster.close()


def _summarize(path: Path, what: str) -> None:
    leaves = collections.Counter()
    ours = total = 0
    for line in path.read_text().splitlines():
        stack, _, n = line.rpartition(" ")
        try:
            k = int(n)
        except ValueError:
            continue
        total += k
        frames = stack.split(";")
        leaves[frames[-1][:110]] += k
        if "dask_rmm" in stack:
            ours += k
    print(f"\n# py-spy {what}: {total} samples, {ours / max(total, 1):.1%} with a dask_rmm frame")
    for leaf, k in leaves.most_common(18):
        print(f"{k / max(total, 1):6.1%}  {leaf}")


def pyspy(client, label: str, seconds: int = 5) -> None:
    exe = shutil.which("py-spy")
    if exe is None:
        print("py-spy not installed: no sampling profile", file=sys.stderr)
        return
    (pid,) = client.run(os.getpid).values()
    out = Path(os.environ.get("PYSPY_DIR", "/tmp"))
    for mode, flags in (("gil", ["--gil"]), ("idle", ["--idle"])):
        path = out / f"pyspy_{label}_{mode}.txt"
        cmd = [exe, "record", "--native", "-r", "250", "-d", str(int(seconds)), "-f", "raw"]
        proc = subprocess.Popen([*cmd, *flags, "-o", str(path), "-p", str(pid)])
        deadline = time.monotonic() + seconds + 1
        while time.monotonic() < deadline:
            _chain(client)
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()
        if path.exists():
            _summarize(path, f"{label} {mode}")
        else:
            print(f"py-spy {label} {mode}: no output (rc {proc.returncode})", file=sys.stderr)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--threads", type=int, default=4)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--cpu", action="store_true", help="part 1 only, on host memory")
    args = ap.parse_args()
    calls_per_allocation(gpu=not args.cpu)
    gil_proxy()
    if not args.cpu:
        switch_intervals(args.threads, args.rounds)
    return 0


if __name__ == "__main__":
    sys.exit(main())
