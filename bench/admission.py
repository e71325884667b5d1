"""Memory admission and arbitration across libraries: three demonstrations, interleaved rounds,
medians, one table.

(a) Tasks that each hold ~30 % of the worker's limit while they run (plus a small output):
    8 threads without admission (failed tasks and bytes spilled are counted), 8 threads with
    ``memory_admission=True``, and fixed 1, 2, 3 and 4 threads without it (the best of those is
    the reference: admission should be within 10 % of it).
(b) A mixed worker: CuPy outputs held, and CuPy's cache holding free blocks, while a PyTorch task
    (PyTorch's own caching allocator, beside the stack) needs more than the device has free:
    dask-cuda's setup (when importable), dask-rmm without arbitration (``spill_on_oom``) and with
    it (``memory_admission``: the task runs once more after the caches gave back, the outputs
    spilled and the pool returned its free chunks).
(c) The cost on a workload that fits: the CuPy chain of bench/dask_workload.py at 4 and 8
    threads, with and without admission (target: at most 2 %).

Every configuration is one LocalCluster with one worker process, all alive at once; each round
runs every configuration once (the order reversed every other round). ``--host-memory`` runs
the same on host memory (``base_resource="system"``, NumPy and DeviceBuffers, a PyTorch stand-in
that allocates beside the stack), so it runs on a CPU host; its figures say nothing of a GPU.

    python bench/admission.py [--rounds 3] [--parts abc] [--json out.json]
    python bench/admission.py --host-memory [--rounds 3]
    python bench/admission.py --executor-cost
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.dask_workload import one_worker_cluster  # noqa: E402

MiB = 1 << 20
GiB = 1 << 30


@dataclass
class Setup:
    """The sizes of one run (GPU or host)."""

    host: bool
    limit: int  # (a) the worker's pool maximum
    task_fraction: float = 0.3  # (a) what each task holds while it runs
    output_fraction: float = 0.02  # (a) what each task leaves behind
    tasks: int = 24  # (a)
    work: int = 20  # (a) passes over the task's memory
    chain_n: int = 16000  # (c)
    chain_chunk: int = 500  # (c)
    mixed_budget: int = 24 * GiB  # (b) device memory outside the ballast


def gpu_setup() -> Setup:
    return Setup(host=False, limit=16 * GiB, tasks=16)


def host_setup() -> Setup:
    return Setup(
        host=True,
        limit=64 * MiB,
        tasks=12,
        work=4,
        chain_n=2000,
        chain_chunk=250,
        mixed_budget=64 * MiB,
    )


# -- the task bodies (run on the workers) ---------------------------------------------------------


def heavy_task(i: int, nbytes: int, out_bytes: int, work: int, host: bool) -> Any:
    """Hold ``nbytes`` while working on them; leave ``out_bytes`` behind."""
    if host:
        from dask_rmm import DeviceBuffer

        buf = DeviceBuffer(size=nbytes)  # held in the worker's stack while the task runs
        import numpy as np

        view = np.frombuffer(buf.copy_to_host(), dtype=np.uint8)
        for _ in range(work):
            view[:: 1 << 12].sum()  # the task's work while it holds the buffer
        del buf
        return DeviceBuffer(size=out_bytes)
    import cupy

    x = cupy.ones(nbytes // 8, dtype="float64")
    for _ in range(work):
        x *= 1.0001
    out = x[: out_bytes // 8].copy()
    del x
    return out


def output_size(x: Any) -> int:
    return int(getattr(x, "nbytes", None) or getattr(x, "size", 0))


def persisted_output(i: int, nbytes: int, host: bool) -> Any:
    if host:
        from dask_rmm import DeviceBuffer

        return DeviceBuffer(size=nbytes)
    import cupy

    out = cupy.full(nbytes // 8, float(i))
    # Temporaries that leave free blocks in CuPy's cache.
    tmp = cupy.ones(nbytes // 16)
    del tmp
    return out


class OutOfMemoryError(RuntimeError):
    """The host stand-in's error, named as PyTorch's is."""


def torch_task(nbytes: int, host: bool, budget_end: int) -> int:
    """A PyTorch task needing ``nbytes`` from its own allocator beside the stack. On host
    memory, a stand-in: it fails when the pool's bytes plus its own would pass ``budget_end``
    (as a native allocator fails when the device is full), else allocates from the stack."""
    if host:
        from dask_rmm import DeviceBuffer
        from dask_rmm.mr.registry import get_per_device_resource

        top = get_per_device_resource(0)
        pool = top.handler.pool
        used = pool.pool_size() if pool is not None else top.handler.statistics.current_bytes
        if used + nbytes > budget_end:
            raise OutOfMemoryError(f"out of memory: tried to allocate {nbytes} bytes")
        return DeviceBuffer(size=nbytes).size
    import torch

    t = torch.ones(nbytes // 4, dtype=torch.float32, device="cuda")
    value = int(t.sum().item())
    del t
    torch.cuda.empty_cache()
    return value


def ballast(budget: int) -> int:
    """Take all but ``budget`` bytes of the device outside everything (GPU only): the device
    then has ``budget`` for the mixed worker, so that the demonstration needs little memory."""
    from dask_rmm import _cuda

    free, _total = _cuda.mem_get_info()
    take = max(free - budget, 0)
    global _BALLAST
    _BALLAST = _cuda.malloc(take) if take else 0
    return take


_BALLAST = 0


def chain(n: int, chunk: int, host: bool):
    import dask.array as da

    if host:
        x = da.random.RandomState(42).random_sample((n, n), chunks=(chunk, chunk))
    else:
        import cupy

        rs = da.random.RandomState(42, RandomState=cupy.random.RandomState)
        x = rs.random_sample((n, n), chunks=(chunk, chunk))
    return ((x + x.T) * 2 - x.mean(axis=0)).sum()


# -- configurations ------------------------------------------------------------------------------


@dataclass
class Config:
    part: str
    label: str
    threads: int
    plugin: dict | None  # RMMPlugin options; None: dask-cuda's setup
    times: list[float] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    failures: list[int] = field(default_factory=list)
    cluster: Any = None
    client: Any = None


def _rmm_options(s: Setup, **extra: Any) -> dict:
    base = dict(pool_size=s.limit // 4, maximum_pool_size=s.limit)
    if s.host:
        base["base_resource"] = "system"
    else:
        # Exact per-allocation accounting: the task's peak is what it allocates, not only what
        # CuPy's cache draws anew (a block reused from the cache is not seen by the stack).
        base.update(allocators=["cupy"], exact_allocators=["cupy"])
    base.update(extra)
    return base


def configurations(s: Setup, parts: str) -> list[Config]:
    configs = []
    if "a" in parts:
        spill = dict(spill_on_oom=True, device_memory_limit=s.limit)
        configs.append(Config("a", "8 threads", 8, _rmm_options(s, **spill)))
        configs.append(
            Config("a", "8 threads + admission", 8, _rmm_options(s, **spill, memory_admission=True))
        )
        for t in (1, 2, 3, 4):
            configs.append(Config("a", f"{t} threads", t, _rmm_options(s, **spill)))
    if "b" in parts:
        mixed = dict(
            pool_size=min(s.mixed_budget // 8, GiB), maximum_pool_size=s.mixed_budget * 3 // 4
        )
        if s.host:
            mixed["base_resource"] = "system"
        else:
            mixed["allocators"] = ["cupy"]
            if _dask_cuda_available():
                configs.append(Config("b", "dask-cuda", 2, None))
        configs.append(Config("b", "dask-rmm, arbitration off", 2, dict(mixed, spill_on_oom=True)))
        configs.append(
            Config(
                "b",
                "dask-rmm, arbitration on",
                2,
                dict(mixed, spill_on_oom=True, memory_admission=True),
            )
        )
    if "c" in parts:
        # Four clusters alive at once: a pool that grows from 4 GiB (on host memory, 256 MiB).
        chain_options: dict[str, Any] = dict(pool_size=4 * GiB if not s.host else s.limit * 4)
        if s.host:
            chain_options["base_resource"] = "system"
        else:
            chain_options["allocators"] = ["cupy"]
        for t in (4, 8):
            configs.append(Config("c", f"chain {t} threads", t, dict(chain_options)))
            configs.append(
                Config(
                    "c",
                    f"chain {t} threads + admission",
                    t,
                    dict(chain_options, memory_admission=True),
                )
            )
    return configs


def _dask_cuda_available() -> bool:
    try:
        import dask_cuda  # noqa: F401
    except ImportError as e:
        print(f"dask-cuda not importable, its row skipped: {e}", file=sys.stderr)
        return False
    return True


def start(config: Config, s: Setup) -> None:
    from distributed import Client

    if config.plugin is None:  # dask-cuda: its own RMM pool and device_memory_limit spilling
        from dask_cuda import LocalCUDACluster

        budget = s.mixed_budget
        config.cluster = LocalCUDACluster(
            n_workers=1,
            threads_per_worker=config.threads,
            rmm_pool_size=min(budget // 8, GiB),
            rmm_maximum_pool_size=budget * 3 // 4,
            device_memory_limit=budget // 2,
            dashboard_address=":0",
        )
        config.client = Client(config.cluster)
        config.client.run(ballast, budget)
        return
    from dask_rmm import RMMPlugin

    config.cluster = one_worker_cluster(config.threads)
    config.client = Client(config.cluster)
    if config.part == "b" and not s.host:
        config.client.run(ballast, s.mixed_budget)
    config.client.register_plugin(RMMPlugin(**config.plugin))


def stop(config: Config) -> None:
    for thing in (config.client, config.cluster):
        try:
            if thing is not None:
                thing.close()
        except Exception as e:  # a broken cluster must not stop the table
            print(f"{config.label}: closing failed: {e!r}", file=sys.stderr)


def _worker_figures(client) -> dict:
    def figures(dask_worker):
        metric = dask_worker.metrics.get("dask-rmm")
        if metric is None:
            return {}
        return metric(dask_worker)["devices"].get("0", {})

    return next(iter(client.run(figures).values()), {})


# -- one round of each part ------------------------------------------------------------------------


def round_a(config: Config, s: Setup) -> None:
    from distributed import wait

    c = config.client
    nbytes, out = int(s.limit * s.task_fraction), int(s.limit * s.output_fraction)
    before = _worker_figures(c)
    t0 = time.perf_counter()
    futures = c.map(
        heavy_task,
        range(s.tasks),
        [nbytes] * s.tasks,
        [out] * s.tasks,
        [s.work] * s.tasks,
        [s.host] * s.tasks,
        pure=False,
        key=[f"heavy-{time.time_ns()}-{i}" for i in range(s.tasks)],
    )
    wait(futures)
    sizes = c.gather(c.map(output_size, futures, pure=False), errors="skip")
    config.times.append(time.perf_counter() - t0)
    failed = sum(f.status == "error" for f in futures)
    config.failures.append(failed)
    after = _worker_figures(c)
    spilled = after.get("total_spilled_bytes", 0) - before.get("total_spilled_bytes", 0)
    config.notes.append(
        f"{failed} failed, {len(sizes)} done, spilled {spilled / MiB:.0f} MiB, "
        f"held back {after.get('admission_total_held', 0) - before.get('admission_total_held', 0)}"
    )
    del futures


def round_b(config: Config, s: Setup) -> None:
    from distributed import wait

    c = config.client
    budget = s.mixed_budget
    n_out, out_bytes = 8, budget // 16  # outputs: half the budget
    outputs = c.map(
        persisted_output, range(n_out), [out_bytes] * n_out, [s.host] * n_out, pure=False
    )
    wait(outputs)
    t0 = time.perf_counter()
    job = c.submit(torch_task, budget // 2, s.host, budget, pure=False)
    wait(job)
    config.times.append(time.perf_counter() - t0)
    ok = job.status == "finished"
    config.failures.append(0 if ok else 1)
    figures = _worker_figures(c)
    why = ""
    if not ok:
        why = f": {type(job.exception()).__name__}"
    config.notes.append(
        f"{'completed' if ok else 'failed'}{why}; task retries {figures.get('task_retries', 0)}, "
        f"spilled {figures.get('total_spilled_bytes', 0) / MiB:.0f} MiB"
    )
    c.cancel(outputs)
    del outputs, job


def round_c(config: Config, s: Setup) -> None:
    t0 = time.perf_counter()
    config.client.compute(chain(s.chain_n, s.chain_chunk, s.host)).result()
    config.times.append(time.perf_counter() - t0)
    config.failures.append(0)
    config.notes.append("")


ROUNDS = {"a": round_a, "b": round_b, "c": round_c}


def run(s: Setup, parts: str, rounds: int) -> list[Config]:
    """Each part in turn. Within (a) and (c) the configurations are alive together and their
    rounds interleaved; (b) takes the device's memory down to its budget with a ballast, so its
    configurations run one after another."""
    configs = configurations(s, parts)
    for part in "abc":
        group = [c for c in configs if c.part == part]
        if part == "b":
            for config in group:
                _rounds([config], s, rounds)
        elif group:
            _rounds(group, s, rounds)
    return configs


def _rounds(group: list[Config], s: Setup, rounds: int) -> None:
    live = []
    try:
        for config in group:
            try:
                start(config, s)
                live.append(config)
            except Exception as e:
                config.notes.append(f"setup failed: {e!r}")
                print(f"{config.label}: setup failed: {e!r}", file=sys.stderr)
        for config in live:  # warm-up (admission learns its peaks here)
            ROUNDS[config.part](config, s)
            config.times.clear()
            config.failures.clear()
            config.notes.clear()
        for r in range(rounds):
            order = live if r % 2 == 0 else list(reversed(live))
            for config in order:
                ROUNDS[config.part](config, s)
                print(f"round {r}: {config.label}: {config.times[-1]:.2f} s", file=sys.stderr)
    finally:
        for config in live:
            stop(config)


def table(configs: list[Config], s: Setup, rounds: int) -> str:
    kind = "host memory (CPU; says nothing of a GPU)" if s.host else "GPU"
    lines = [f"bench/admission.py on {kind}: median of {rounds} interleaved rounds after a warm-up"]
    titles = {
        "a": f"(a) {s.tasks} tasks each holding {s.task_fraction:.0%} of {s.limit / MiB:.0f} MiB",
        "b": "(b) mixed worker: outputs held, a PyTorch task needing more than is free",
        "c": "(c) cost where everything fits: the chain",
    }
    for part in "abc":
        rows = [c for c in configs if c.part == part]
        if not rows:
            continue
        lines += ["", titles[part], f"{'configuration':<30} {'median s':>9} {'vs ref':>7}  notes"]
        ref = None
        if part == "a":
            fixed = [c for c in rows if c.threads <= 4 and c.times and not any(c.failures)]
            if fixed:
                ref = min(statistics.median(c.times) for c in fixed)
        for c in rows:
            if not c.times:
                lines.append(f"{c.label:<30} {'-':>9} {'':>7}  {'; '.join(c.notes)}")
                continue
            med = statistics.median(c.times)
            if part == "c":
                plain = next((x for x in rows if x.label == c.label.replace(" + admission", "")), c)
                ref = statistics.median(plain.times) if plain.times else None
            vs = f"{med / ref:.3f}" if ref else ""
            lines.append(f"{c.label:<30} {med:>9.3f} {vs:>7}  {c.notes[-1]}")
    return "\n".join(lines)


def executor_cost(n: int = 10000, threads: int = 4) -> tuple[float, float]:
    """Median microseconds per task (6 interleaved rounds) of submitting ``n`` empty tasks to a
    thread pool directly and through the admission executor (tasks admitted at once; a stand-in for the worker's task
    table): the executor's own cost, without Dask."""
    import types
    from concurrent.futures import ThreadPoolExecutor

    from dask_rmm.pressure.admission import AdmissionGate
    from dask_rmm.worker.admission import AdmissionThreadPoolExecutor

    class Task:
        def __init__(self) -> None:
            self.start_time = time.time()
            self.annotations: dict = {}
            self.run_spec = types.SimpleNamespace(is_coro=False)
            self.state = "executing"

    def empty() -> dict:
        return {"op": "task-finished"}

    worker = types.SimpleNamespace(active_keys=set(), state=types.SimpleNamespace(tasks={}))
    out: list[list[float]] = [[], []]
    with ThreadPoolExecutor(threads) as pool:
        gate = AdmissionGate(lambda: 1 << 40, lambda: 0)
        gate.peaks.observe("x", 0)
        executor = AdmissionThreadPoolExecutor(pool, worker, gate)
        for r in range(7):  # interleaved; the first round of each is a warm-up
            for j, submit in enumerate((pool.submit, executor.submit)):
                worker.active_keys.clear()
                worker.state.tasks.clear()
                t0 = time.perf_counter()
                futures = []
                for i in range(n):
                    key = f"x-{r}-{i}"
                    worker.state.tasks[key] = Task()
                    if len(worker.active_keys) >= threads:  # as Worker.execute discards them
                        worker.active_keys.pop()
                    worker.active_keys.add(key)
                    futures.append(submit(empty))
                for f in futures:
                    f.result()
                if r:
                    out[j].append((time.perf_counter() - t0) / n * 1e6)
    return statistics.median(out[0]), statistics.median(out[1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--host-memory", action="store_true", help="host memory, no GPU")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--parts", default="abc", help="which demonstrations: a, b, c")
    parser.add_argument("--json", type=Path, default=None)
    parser.add_argument(
        "--executor-cost", action="store_true", help="only the executor's cost per task"
    )
    args = parser.parse_args()
    if args.executor_cost:
        plain, gated = executor_cost()
        print(f"per task: pool {plain:.1f} us, admission executor {gated:.1f} us")
        return
    s = host_setup() if args.host_memory else gpu_setup()
    configs = run(s, args.parts, args.rounds)
    print(table(configs, s, args.rounds))
    if args.json is not None:
        rows = [
            {
                "part": c.part,
                "config": c.label,
                "threads": c.threads,
                "options": c.plugin,
                "times_s": c.times,
                "failures": c.failures,
                "notes": c.notes,
            }
            for c in configs
        ]
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(
            json.dumps(
                {
                    "benchmark": "admission",
                    "host_memory": s.host,
                    "rounds": args.rounds,
                    "python": platform.python_version(),
                    "host": platform.node(),
                    "rows": rows,
                },
                indent=2,
            )
        )


if __name__ == "__main__":
    main()
