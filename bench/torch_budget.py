"""PyTorch under one worker budget: speed, a threaded stress and a fill past the limit, on a GPU.

Modes (each configuration in its own process: PyTorch takes one allocator per process):

- ``--mlp`` (default): an MLP training step (1024-4096-1024, batch 256, AdamW), one model per
  thread, each thread on its own stream, at ``--threads`` (1,4,8), with PyTorch's caching
  allocator alone, with ``allocators=["torch"]`` (PyTorch's cache beside a worker-like stack
  whose pool shares its maximum) and with the exact path (``exact_allocators=["torch"]``, every
  tensor through the stack); configurations interleaved, ``--rounds`` rounds, medians.
- ``--stress SECONDS``: ``--threads`` threads mixing tensor allocation and free, backward
  (autograd's device thread), a second stream, ``torch.cuda.empty_cache()``, filling PyTorch
  to its limit (out of memory), and DeviceBuffers growing and trimming the pool beside it, while
  a monitor reads the device's used memory; no deadlock (a watchdog), no crash, never past the
  maximum by more than ``--slack`` (CUDA context growth, cuBLAS handles).
- ``--fill``: for each library (torch, cupy, numba, DeviceBuffer, and compiled RMM where it is
  installed), fill it past the maximum
  while the others hold memory; the error each raises and the device's used memory.
- ``--dask``: a Dask workload (tasks training the MLP on a one-worker LocalCluster of 4 threads)
  with and without ``RMMPlugin(allocators=["torch"])``.

Usage::

    python bench/torch_budget.py [--mlp] [--stress 60] [--fill] [--dask] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import os
import random
import re
import statistics
import subprocess
import sys
import threading
import time

MiB = 1 << 20
CONFIGS = ("torch caching allocator", "dask-rmm allocators=[torch]", "dask-rmm exact")
HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)


class BudgetWatch:
    """The pool's upstream, counting the pool's device bytes; at each growth (under its lock,
    which a trim's give-back waits for) it checks the pool's bytes plus PyTorch's reserved
    bytes, and plus the room PyTorch was given, against the maximum. In-process: unlike the
    device's used memory it holds with other processes on the GPU."""

    def __init__(self, maximum: int):
        self.maximum = maximum
        self.lock = threading.Lock()
        self.pool_bytes = 0
        self.peak_with_torch = 0
        self.peak_with_room = 0
        self.checks = 0
        self.cache = None  # PyTorch's cache, once set

    def upstream(self):
        from dask_rmm import mr

        base = mr.CudaMemoryResource()

        def allocate(nbytes, stream):
            ptr = base.allocate(nbytes, stream)
            with self.lock:
                self.pool_bytes += nbytes
                if self.cache is not None:
                    reserved = self.cache.reserved_bytes(0)
                    room = self.cache.cap(0)
                    self.peak_with_torch = max(self.peak_with_torch, self.pool_bytes + reserved)
                    if room is not None:
                        self.peak_with_room = max(self.peak_with_room, self.pool_bytes + room)
                    self.checks += 1
            return ptr

        def deallocate(ptr, nbytes, stream):
            base.deallocate(ptr, nbytes, stream)
            with self.lock:
                self.pool_bytes -= nbytes

        return mr.CallbackMemoryResource(allocate, deallocate)


def _stack(maximum: int, initial: int = 256 * MiB, allocators=("torch",), exact=(), watch=None):
    """A worker-like stack (statistics over a pool with a maximum) as device 0's resource, and
    the allocators set over it as a worker does."""
    from dask_rmm import mr
    from dask_rmm.allocators import set_allocators

    upstream = watch.upstream() if watch is not None else mr.CudaMemoryResource()
    pool = mr.PoolMemoryResource(upstream, initial_pool_size=initial, maximum_pool_size=maximum)
    stats = mr.StatisticsResourceAdaptor(pool)
    mr.set_current_device_resource(stats)
    set_allocators(list(allocators), exact=list(exact))
    return pool, stats


def _mlp(torch, seed: int):
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

    return step


def mlp_child(kind: str, steps: int, threads_list: list[int]) -> dict:
    import torch

    from dask_rmm import _cuda

    stats = None
    half = _cuda.device_total_memory(0) // 2  # read without initializing PyTorch's CUDA
    if kind == "dask-rmm allocators=[torch]":
        _, stats = _stack(maximum=half)
    elif kind == "dask-rmm exact":
        _, stats = _stack(maximum=half, exact=["torch"])
    out = {"torch": torch.__version__}
    for threads in threads_list:
        barrier = threading.Barrier(threads + 1)

        def train(seed: int, barrier: threading.Barrier = barrier) -> None:
            stream = torch.cuda.Stream()
            with torch.cuda.stream(stream):
                step = _mlp(torch, seed)
                for _ in range(10):
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
        counted = stats.allocation_counts.total_count - before if stats is not None else -1
        out[f"{threads}t"] = {"us_per_step": elapsed / steps * 1e6, "stack_allocations": counted}
        torch.cuda.empty_cache()
    return out


def run_mlp(rounds: int, steps: int, threads_list: list[int], results: dict) -> None:
    per: dict[str, dict[str, list[float]]] = {}
    for r in range(rounds):
        order = CONFIGS[r % 3 :] + CONFIGS[: r % 3]
        for kind in order:
            cmd = [sys.executable, __file__, "--child", "mlp", "--kind", kind]
            cmd += ["--steps", str(steps), "--threads", ",".join(map(str, threads_list))]
            proc = subprocess.run(cmd, capture_output=True, text=True, timeout=240)
            lines = [s for s in proc.stdout.splitlines() if s.startswith("RESULT")]
            if not lines:
                print(f"mlp {kind}: failed: {proc.stderr[-2000:]}", file=sys.stderr)
                continue
            out = json.loads(lines[-1][6:])
            print(f"round {r} {kind:<28} {out}", file=sys.stderr)
            for threads in threads_list:
                per.setdefault(f"{threads}t", {}).setdefault(kind, []).append(
                    out[f"{threads}t"]["us_per_step"]
                )
    table = {}
    for key, by_kind in per.items():
        med = {k: statistics.median(v) for k, v in by_kind.items()}
        base = med.get(CONFIGS[0])
        table[key] = {
            k: {
                "median_us": round(m, 1),
                "ratio": round(m / base, 3) if base else None,
                "rounds_us": [round(x, 1) for x in by_kind[k]],
            }
            for k, m in med.items()
        }
        print(
            f"MLP step {key}: "
            + "; ".join(f"{k} {v['median_us']} us ({v['ratio']}x)" for k, v in table[key].items())
        )
    results["mlp"] = table


# -- stress ---------------------------------------------------------------------------------------


def stress_child(seconds: float, threads: int, maximum: int, slack: int) -> dict:
    import torch

    from dask_rmm import DeviceBuffer
    from dask_rmm.allocators.torch import get_torch_cache

    def warm(i: int) -> None:
        # What the stress's threads load once (kernels, cuBLAS handles, streams): device memory
        # outside both budgets, measured into the baseline.
        stream = torch.cuda.Stream() if i % 2 else torch.cuda.current_stream()
        with torch.cuda.stream(stream):
            model = torch.nn.Sequential(
                torch.nn.Linear(256, 1024), torch.nn.ReLU(), torch.nn.Linear(1024, 256)
            ).cuda()
            x = torch.randn(512, 256, device="cuda", requires_grad=True)
            model(x).square().mean().backward()
        stream.synchronize()

    warmers = [threading.Thread(target=warm, args=(i,)) for i in range(threads)]
    for w in warmers:
        w.start()
    for w in warmers:
        w.join()
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    free, total = torch.cuda.mem_get_info(0)
    baseline = total - free
    watch = BudgetWatch(maximum)
    pool, stats = _stack(maximum=maximum, initial=64 * MiB, watch=watch)
    cache = watch.cache = get_torch_cache()
    deadline = time.monotonic() + seconds
    counts = {"ops": 0, "torch_oom": 0, "pool_oom": 0, "fills": 0, "backward": 0, "empty": 0}
    errors: list[str] = []
    peak = [0]
    both = [0]
    lock = threading.Lock()
    done = threading.Event()

    def monitor():
        while not done.is_set():
            f, t = torch.cuda.mem_get_info(0)
            peak[0] = max(peak[0], t - f - baseline)
            # read one after the other, so only roughly together
            both[0] = max(both[0], pool.pool_size() + cache.reserved_bytes(0))
            time.sleep(0.005)

    def count(key):
        with lock:
            counts[key] += 1

    def work(i: int):
        rng = random.Random(i)
        stream = torch.cuda.Stream() if i % 2 else torch.cuda.current_stream()
        model = torch.nn.Sequential(
            torch.nn.Linear(256, 1024), torch.nn.ReLU(), torch.nn.Linear(1024, 256)
        ).cuda()
        held: list = []
        buffers: list = []
        try:
            with torch.cuda.stream(stream):
                while time.monotonic() < deadline:
                    r = rng.random()
                    try:
                        if r < 0.30:
                            held.append(
                                torch.empty(
                                    rng.randint(1, 64) * MiB, dtype=torch.uint8, device="cuda"
                                )
                            )
                            if len(held) > 8:
                                held.pop(0)
                        elif r < 0.45 and held:
                            held.pop(rng.randrange(len(held)))
                        elif r < 0.65:
                            x = torch.randn(512, 256, device="cuda", requires_grad=True)
                            model(x).square().mean().backward()  # autograd's device thread
                            count("backward")
                        elif r < 0.70:
                            torch.cuda.empty_cache()
                            count("empty")
                        elif r < 0.72:
                            fill = []
                            count("fills")
                            try:
                                while True:
                                    fill.append(
                                        torch.empty(64 * MiB, dtype=torch.uint8, device="cuda")
                                    )
                            except torch.OutOfMemoryError:
                                count("torch_oom")
                            del fill
                        elif r < 0.90:
                            buffers.append(DeviceBuffer(size=rng.randint(1, 96) * MiB))
                            if len(buffers) > 4:
                                buffers.pop(0)
                        elif r < 0.95 and buffers:
                            buffers.pop(rng.randrange(len(buffers)))
                        else:
                            pool.trim()
                    except torch.OutOfMemoryError:
                        count("torch_oom")
                    except MemoryError:
                        count("pool_oom")
                    count("ops")
            stream.synchronize()
        except BaseException as e:  # anything else is a failure
            errors.append(f"thread {i}: {type(e).__name__}: {e}")

    mon = threading.Thread(target=monitor, daemon=True)
    mon.start()
    workers = [threading.Thread(target=work, args=(i,), daemon=True) for i in range(threads)]
    for w in workers:
        w.start()
    for w in workers:
        w.join(max(0.0, deadline - time.monotonic()) + 120)
    alive = sum(w.is_alive() for w in workers)
    done.set()
    torch.cuda.synchronize()
    out = dict(
        counts,
        errors=errors[:10],
        deadlocked_threads=alive,
        seconds=seconds,
        threads=threads,
        maximum=maximum,
        slack=slack,
        peak_over_baseline=peak[0],
        peak_pool_plus_torch_sampled=both[0],
        torch=torch.__version__,
        cap_now=cache.cap(0),
        pool_size_now=pool.pool_size(),
        torch_reserved_now=cache.reserved_bytes(0),
    )
    out["pool_growth_checks"] = watch.checks
    out["peak_pool_plus_torch_at_growth"] = watch.peak_with_torch
    out["peak_pool_plus_torch_room_at_growth"] = watch.peak_with_room
    # In-process: the pool's bytes plus PyTorch's (and plus PyTorch's room) at every growth.
    out["within_maximum"] = watch.peak_with_torch <= maximum and watch.peak_with_room <= maximum
    # The device's used memory, which other processes on the GPU would move too.
    out["device_within_maximum"] = peak[0] <= maximum + slack
    out["ok"] = not errors and not alive and out["within_maximum"]
    if alive:  # a deadlock: report and leave without waiting for the stuck threads
        print("RESULT" + json.dumps(out), flush=True)
        os._exit(3)
    return out


# -- fill past the limit --------------------------------------------------------------------------


_OTHER_PROCESSES = re.compile(r"(?:Process \d+ has [\d.]+ [KMGTP]?i?B memory in use\. ?)+")


def _short_error(message: str, limit: int = 600) -> str:
    """An out-of-memory message, short enough to print, with what it says about the limit kept:
    PyTorch lists every process on the GPU before the part that names its cap ("... allowed"),
    so on a shared GPU a plain cut loses exactly that part. The list is replaced by its count."""
    listed = len(re.findall(r"Process \d+ has", message))
    if listed:
        message = _OTHER_PROCESSES.sub(f"({listed} processes' use on the GPU left out) ", message)
    return message if len(message) <= limit else message[: limit - 3] + "..."


def fill_child(maximum: int) -> dict:
    import cupy
    import torch

    from dask_rmm import DeviceBuffer

    torch.zeros(1, device="cuda")
    cupy.zeros(1)
    torch.cuda.synchronize()
    free, total = torch.cuda.mem_get_info(0)
    baseline = total - free
    try:  # compiled RMM (what cuDF allocates through), where installed
        import rmm as compiled_rmm
    except ImportError:
        compiled_rmm = None
    libraries = ("torch", "cupy", "numba") + (("rmm",) if compiled_rmm is not None else ())
    pool, _ = _stack(maximum=maximum, initial=64 * MiB, allocators=libraries)
    from dask_rmm.allocators.torch import get_torch_cache

    cache = get_torch_cache()
    from numba import cuda as ncuda

    def used():
        f, t = torch.cuda.mem_get_info(0)
        return t - f - baseline

    fillers = {
        "torch": lambda: torch.empty(32 * MiB, dtype=torch.uint8, device="cuda"),
        "cupy": lambda: cupy.empty(32 * MiB, dtype=cupy.uint8),
        "numba": lambda: ncuda.device_array(32 * MiB, dtype="uint8"),
        "DeviceBuffer": lambda: DeviceBuffer(size=32 * MiB),
    }
    if compiled_rmm is not None:
        fillers["rmm"] = lambda: compiled_rmm.DeviceBuffer(size=32 * MiB)
    out = {}
    for name, make in fillers.items():
        others = [f() for n, f in fillers.items() if n != name for _ in range(3)]  # others hold
        held, error = [], None
        try:
            for _ in range(10_000):
                held.append(make())
        except BaseException as e:
            error = f"{type(e).__module__}.{type(e).__name__}: {_short_error(str(e))}"
        peak = used()
        both = pool.pool_size() + cache.reserved_bytes(0)  # one thread: read exactly
        out[name] = {
            "filled_bytes": len(held) * 32 * MiB,
            "error": error,
            "pool_plus_torch": both,
            "over_maximum": both > maximum,
            "device_used_over_baseline": peak,  # other processes on the GPU count here too
        }
        del held, others
        cupy.get_default_memory_pool().free_all_blocks()
        from dask_rmm.allocators import caches

        caches.release_cached(0)
        pool.trim(64 * MiB)
    return out


# -- Dask -----------------------------------------------------------------------------------------


def _train_task(seed: int, steps: int) -> float:
    import torch

    step = _mlp(torch, seed)
    t0 = time.perf_counter()
    for _ in range(steps):
        step()
    torch.cuda.synchronize()
    return time.perf_counter() - t0


def dask_child(kind: str, tasks: int, steps: int) -> dict:
    sys.path.insert(0, HERE)
    from dask_workload import one_worker_cluster
    from distributed import Client

    with one_worker_cluster(4) as cluster, Client(cluster) as client:
        if kind != "no plugin":
            from dask_rmm import RMMPlugin

            client.register_plugin(
                RMMPlugin(pool_size="256MiB", maximum_pool_size=0.5, allocators=["torch"])
            )
        client.gather(client.map(_train_task, range(4), steps=5, pure=False))  # warm up
        t0 = time.perf_counter()
        client.gather(client.map(_train_task, range(100, 100 + tasks), steps=steps, pure=False))
        elapsed = time.perf_counter() - t0
    return {"s": elapsed}


def run_dask(rounds: int, results: dict) -> None:
    per: dict[str, list[float]] = {}
    kinds = ("no plugin", "RMMPlugin(allocators=[torch])")
    for r in range(rounds):
        for kind in kinds[r % 2 :] + kinds[: r % 2]:
            cmd = [sys.executable, __file__, "--child", "dask", "--kind", kind]
            proc = subprocess.run(cmd, capture_output=True, text=True, timeout=240)
            lines = [s for s in proc.stdout.splitlines() if s.startswith("RESULT")]
            if not lines:
                print(f"dask {kind}: failed: {proc.stderr[-2000:]}", file=sys.stderr)
                continue
            per.setdefault(kind, []).append(json.loads(lines[-1][6:])["s"])
            print(f"round {r} dask {kind}: {per[kind][-1]:.3f} s", file=sys.stderr)
    med = {k: statistics.median(v) for k, v in per.items()}
    base = med.get(kinds[0])
    results["dask"] = {
        k: {
            "median_s": round(m, 3),
            "ratio": round(m / base, 3) if base else None,
            "rounds_s": [round(x, 3) for x in per[k]],
        }
        for k, m in med.items()
    }
    print("dask: " + json.dumps(results["dask"]))


def _child(args) -> None:
    sys.path.insert(0, ROOT)
    if args.child == "mlp":
        out = mlp_child(args.kind, args.steps, [int(t) for t in args.threads.split(",")])
    elif args.child == "stress":
        out = stress_child(args.stress, int(args.threads.split(",")[-1]), args.maximum, args.slack)
    elif args.child == "fill":
        out = fill_child(args.maximum)
    else:
        out = dask_child(args.kind, args.tasks, args.steps)
    print("RESULT" + json.dumps(out), flush=True)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--mlp", action="store_true")
    ap.add_argument("--stress", type=float, default=0.0, help="seconds of stress (0: none)")
    ap.add_argument("--fill", action="store_true")
    ap.add_argument("--dask", action="store_true")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--steps", type=int, default=100)
    ap.add_argument("--tasks", type=int, default=16)
    ap.add_argument("--threads", default="1,4,8")
    ap.add_argument("--maximum", type=int, default=4 << 30)
    ap.add_argument("--slack", type=int, default=128 * MiB)
    ap.add_argument("--json", default=None)
    ap.add_argument("--child", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--kind", default="", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        _child(args)
        return 0
    if not (args.mlp or args.stress or args.fill or args.dask):
        args.mlp = True
    results: dict = {}
    ok = True

    def sub(mode: str, extra: list[str], timeout: float) -> dict:
        cmd = [sys.executable, __file__, "--child", mode, *extra]
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)
        lines = [s for s in proc.stdout.splitlines() if s.startswith("RESULT")]
        if not lines:
            return {"ok": False, "rc": proc.returncode, "stderr": proc.stderr[-3000:]}
        return dict(json.loads(lines[-1][6:]), rc=proc.returncode)

    if args.mlp:
        run_mlp(args.rounds, args.steps, [int(t) for t in args.threads.split(",")], results)
    if args.stress:
        threads = args.threads.split(",")[-1]
        out = sub(
            "stress",
            [
                "--stress",
                str(args.stress),
                "--threads",
                threads,
                "--maximum",
                str(args.maximum),
                "--slack",
                str(args.slack),
            ],
            args.stress + 200,
        )
        results["stress"] = out
        ok &= bool(out.get("ok"))
        print("stress: " + json.dumps(out))
    if args.fill:
        out = sub("fill", ["--maximum", str(args.maximum)], 200)
        results["fill"] = out
        print("fill: " + json.dumps(out))
    if args.dask:
        run_dask(args.rounds, results)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=1)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
