"""Memory admission and arbitration across libraries: three demonstrations, interleaved rounds,
medians, one table with each part's target and whether it is met.

(a) Tasks that each hold ~30 % of the worker's limit while they run (plus a small output):
    8 threads without admission, 8 threads with ``memory_admission=True``, and fixed 1, 2, 3
    and 4 threads without it (the best of those is the reference). Target: admission completes
    every task, within 10 % of the best fixed setting.
(b) A mixed worker: CuPy outputs held, and CuPy's cache holding free blocks, while a PyTorch task
    (PyTorch's own caching allocator, beside the stack) needs more than the device has free:
    dask-cuda's setup (when importable), dask-rmm without arbitration (``spill_on_oom``) and with
    it (``memory_admission``: the task runs once more after the caches gave back, the outputs
    spilled and the pool returned its free chunks). Target: only arbitration completes.
(c) The cost on a workload that fits: the CuPy chain of bench/dask_workload.py at 4 and 8
    threads, with and without admission (12000^2 rather than its 16000^2, in the same 500^2
    chunks: the same work per task, ~5 s a run on an H200 instead of ~9). Target: at most 2 %.

Every round recomputes from scratch (fresh keys: new task keys in (a) and (b), a new random
seed, so a new graph, in (c)) and checks its result against the expected value: a task that
failed, a wrong value or a missing one makes the round failed (counted and printed, its time
kept out of the medians). Tasks synchronize the device before they return, so a round's time
is the work's, not the kernel launches'. Per configuration the table gives the median and the
range of the times, the failed rounds and tasks, the bytes spilled, the OOMs avoided and those
that reached the task, the task retries and the tasks admission held back.

Every configuration of (a) and of (c) is one LocalCluster with one worker process, alive
together, and each round runs every configuration once (the order reversed every other round);
(b) takes the device down to its budget with a ballast, so its configurations run one after
another. A short warm-up before the rounds (admission learns its peaks there; kernels compile)
is not timed. ``--budget`` (seconds, default 250) shares the time among the parts: a part stops
starting rounds that would pass its share (the first round always runs) and says so. Progress
goes to stderr as it happens, and ``--json`` is rewritten after every round, so a timeout still
leaves the rounds done. ``--host-memory`` runs the same on host memory
(``base_resource="system"``, NumPy and DeviceBuffers, a PyTorch stand-in that allocates beside
the stack), so it runs on a CPU host; its figures say nothing of a GPU.

    python bench/admission.py [--rounds 3] [--parts abc] [--budget 250] [--json out.json]
    python bench/admission.py --parts a          # or b, c, "ab", ...: only those parts
    python bench/admission.py --host-memory [--rounds 2]
    python bench/admission.py --executor-cost
"""

from __future__ import annotations

import argparse
import json
import logging
import platform
import statistics
import sys
import time
from dataclasses import dataclass, field, replace
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
    warmup_tasks: int = 2  # (a) the warm-up's tasks (together they fit at any thread count)
    work: int = 20  # (a) passes over the task's memory
    chain_n: int = 12000  # (c); the warm-up runs a quarter of it with the same chunks
    chain_chunk: int = 500  # (c)
    mixed_budget: int = 24 * GiB  # (b) device memory outside the ballast
    round_timeout: float = 60.0  # seconds one wait of a round may take before it fails


def gpu_setup() -> Setup:
    # (c): 12000^2 float64 in 500^2 chunks, ~5 s a run on the H200 (the 16000^2 of
    # bench/dask_workload.py takes ~9 s and would not fit the budget); the same chunks, so the
    # same work per task and the same per-task cost ratio.
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


def expected_value(i: int, work: int) -> float:
    """What every element of task ``i``'s output of (a) holds."""
    v = float(i + 1)
    for _ in range(work):
        v *= 1.0001
    return v


def heavy_task(i: int, nbytes: int, out_bytes: int, work: int, host: bool) -> Any:
    """Hold ``nbytes`` while working on them; leave ``out_bytes`` behind, each float64 of them
    :func:`expected_value` ``(i, work)``. Returns when the device has done the work."""
    if host:
        import numpy as np

        from dask_rmm import DeviceBuffer

        buf = DeviceBuffer(size=nbytes)  # held in the worker's stack while the task runs
        view = np.frombuffer(buf.copy_to_host(), dtype=np.uint8)
        v = float(i + 1)
        for _ in range(work):
            view[:: 1 << 12].sum()  # the task's work while it holds the buffer
            v *= 1.0001
        del buf, view
        return DeviceBuffer.to_device(np.full(out_bytes // 8, v))
    import cupy

    x = cupy.full(nbytes // 8, float(i + 1), dtype="float64")
    for _ in range(work):
        x *= 1.0001
    out = x[: out_bytes // 8].copy()
    del x
    # CuPy only queues the kernels: without this the task "finishes" before its work is done,
    # and the work lands on whatever runs on the device next (another configuration's round).
    cupy.cuda.get_current_stream().synchronize()
    return out


def summary(x: Any) -> tuple[int, float, float]:
    """``(bytes, first element, last element)`` of an output (float64)."""
    if hasattr(x, "copy_to_host") and not hasattr(x, "get"):  # a DeviceBuffer
        import numpy as np

        a = np.frombuffer(x.copy_to_host(), dtype=np.float64)
        return int(x.size), float(a[0]), float(a[-1])
    return int(x.nbytes), float(x[0]), float(x[-1])


def persisted_output(i: int, nbytes: int, host: bool) -> Any:
    """An output of ``nbytes`` whose float64 elements are all ``i``."""
    if host:
        import numpy as np

        from dask_rmm import DeviceBuffer

        return DeviceBuffer.to_device(np.full(nbytes // 8, float(i)))
    import cupy

    out = cupy.full(nbytes // 8, float(i))
    # Temporaries that leave free blocks in CuPy's cache.
    tmp = cupy.ones(nbytes // 16)
    del tmp
    cupy.cuda.get_current_stream().synchronize()
    return out


class OutOfMemoryError(RuntimeError):
    """The host stand-in's error, named as PyTorch's is."""


def torch_task(nbytes: int, host: bool, budget_end: int) -> int:
    """A PyTorch task needing ``nbytes`` from its own allocator beside the stack; returns the
    number of float32 ones it summed (``nbytes // 4``). On host memory, a stand-in: it fails
    when the pool's bytes plus its own would pass ``budget_end`` (as a native allocator fails
    when the device is full), else allocates from the stack."""
    if host:
        from dask_rmm import DeviceBuffer
        from dask_rmm.mr.registry import get_per_device_resource

        top = get_per_device_resource(0)
        pool = top.handler.pool
        used = pool.pool_size() if pool is not None else top.handler.statistics.current_bytes
        if used + nbytes > budget_end:
            raise OutOfMemoryError(f"out of memory: tried to allocate {nbytes} bytes")
        return DeviceBuffer(size=nbytes).size // 4
    import torch

    t = torch.ones(nbytes // 4, dtype=torch.float32, device="cuda")
    # The last element, read back, says the fill ran (.item() waits for the device). A sum
    # would need a float64 copy as large again as the tensor (24 GiB for 12).
    value = t.numel() if t[-1].item() == 1.0 else -1
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


def chain(n: int, chunk: int, host: bool, seed: int):
    """The chain; ``seed`` makes a new graph (new keys) with its own value."""
    import dask.array as da

    if host:
        x = da.random.RandomState(seed).random_sample((n, n), chunks=(chunk, chunk))
    else:
        import cupy

        rs = da.random.RandomState(seed, RandomState=cupy.random.RandomState)
        x = rs.random_sample((n, n), chunks=(chunk, chunk))
    return ((x + x.T) * 2 - x.mean(axis=0)).sum()


def chain_check(value: float, n: int) -> str:
    """Why ``value`` cannot be the chain's sum (empty: it can). The sum is ``3 * S`` with ``S``
    the sum of ``n^2`` uniform numbers: ``1.5 n^2`` give or take ``0.87 n`` (one standard
    deviation). Ten of those let no right value fail, and a chunk missing or counted twice
    moves the sum by ``1.5 chunk^2``: 36 deviations at 12000^2 in 500^2 chunks, 54 at 2000^2 in
    250^2 (host memory)."""
    expected, allowed = 1.5 * n * n, 10 * 0.87 * n
    if abs(value - expected) > allowed:
        return f"sum {value:.6g}, expected {expected:.6g} +- {allowed:.3g}"
    return ""


# -- configurations ------------------------------------------------------------------------------

#: The worker's pressure and admission counters a round reports as differences.
COUNTERS = (
    "total_spilled_bytes",
    "ooms_avoided",
    "oom_count",
    "task_retries",
    "admission_total_held",
)


@dataclass
class Round:
    """One round of one configuration."""

    seconds: float
    ok: bool  # every result present and right: only then is ``seconds`` a figure
    tasks: int
    failed: int  # tasks that raised, returned a wrong value or none (timed out)
    counters: dict[str, int]  # COUNTERS' changes during the round (empty: not available)
    note: str = ""


@dataclass
class Config:
    part: str
    label: str
    threads: int
    plugin: dict | None  # RMMPlugin options; None: dask-cuda's setup
    rounds: list[Round] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)  # set-up failures, rounds skipped
    cluster: Any = None
    client: Any = None

    @property
    def admission(self) -> bool:
        return bool(self.plugin and self.plugin.get("memory_admission"))

    @property
    def times(self) -> list[float]:
        return [r.seconds for r in self.rounds if r.ok]

    @property
    def failed_rounds(self) -> int:
        return sum(not r.ok for r in self.rounds)

    @property
    def median(self) -> float | None:
        return statistics.median(self.times) if self.times else None

    def total(self, counter: str) -> int | None:
        values = [r.counters[counter] for r in self.rounds if counter in r.counters]
        return sum(values) if values else None

    def row(self) -> dict:
        return {
            "part": self.part,
            "config": self.label,
            "threads": self.threads,
            "options": self.plugin,
            "times_s": self.times,
            "median_s": self.median,
            "min_s": min(self.times) if self.times else None,
            "max_s": max(self.times) if self.times else None,
            "rounds_run": len(self.rounds),
            "rounds_failed": self.failed_rounds,
            "tasks_failed": sum(r.failed for r in self.rounds),
            **{c: self.total(c) for c in COUNTERS},
            "rounds": [r.__dict__ for r in self.rounds],
            "notes": self.notes,
        }


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
        print(f"dask-cuda not importable, its row skipped: {e}", file=sys.stderr, flush=True)
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
            print(f"{config.label}: closing failed: {e!r}", file=sys.stderr, flush=True)


def _counters(client) -> dict[str, int]:
    """The worker's COUNTERS now (empty without dask-rmm's metrics: dask-cuda's setup)."""

    def figures(dask_worker):
        metric = dask_worker.metrics.get("dask-rmm")
        if metric is None:
            return {}
        return metric(dask_worker)["devices"].get("0", {})

    try:
        got = next(iter(client.run(figures).values()), {})
    except Exception:  # a worker gone: no figures, the round says so by its failures
        return {}
    return {c: int(got[c]) for c in COUNTERS if c in got}


def _difference(before: dict[str, int], after: dict[str, int]) -> dict[str, int]:
    return {c: after[c] - before[c] for c in COUNTERS if c in before and c in after}


def _error(future) -> str:
    try:
        return f"{type(future.exception(timeout=5)).__name__}"
    except Exception as e:
        return f"{type(e).__name__}"


def _wait(futures: list, timeout: float) -> list:
    """Wait for ``futures`` at most ``timeout`` seconds; those not done by then."""
    from distributed import wait

    try:
        wait(futures, timeout=timeout)
    except TimeoutError:
        pass
    return [f for f in futures if f.status not in ("finished", "error", "cancelled")]


def _summaries(c, futures: list, timeout: float) -> dict[int, tuple[int, float, float]]:
    """:func:`summary` of each finished future, by position (absent: failed or not done)."""
    finished = [(i, f) for i, f in enumerate(futures) if f.status == "finished"]
    checks = c.map(summary, [f for _, f in finished], pure=False)
    _wait(checks, timeout)
    return {
        i: check.result()
        for (i, _), check in zip(finished, checks, strict=True)
        if check.status == "finished"
    }


# -- one round of each part ------------------------------------------------------------------------


def round_a(config: Config, s: Setup, r: int, warmup: bool = False) -> Round:
    """``s.tasks`` heavy tasks under fresh keys; each output checked for its own value."""
    c = config.client
    tasks = s.warmup_tasks if warmup else s.tasks
    nbytes, out = int(s.limit * s.task_fraction), int(s.limit * s.output_fraction)
    before = _counters(c)
    stamp = time.time_ns()
    t0 = time.perf_counter()
    futures = c.map(
        heavy_task,
        range(tasks),
        [nbytes] * tasks,
        [out] * tasks,
        [s.work] * tasks,
        [s.host] * tasks,
        pure=False,
        key=[f"heavy-{r}-{stamp}-{i}" for i in range(tasks)],
    )
    not_done = _wait(futures, s.round_timeout)
    seconds = time.perf_counter() - t0
    errors = [f for f in futures if f.status == "error"]
    checked = _summaries(c, futures, s.round_timeout)
    wrong = []
    for i, f in enumerate(futures):
        if f.status != "finished":
            continue
        want, got = expected_value(i, s.work), checked.get(i)
        if (
            got is None
            or got[0] != (out // 8) * 8
            or not all(abs(v - want) <= 1e-9 * want for v in got[1:])
        ):
            wrong.append(i)
    failed = len(errors) + len(not_done) + len(wrong)
    counters = _difference(before, _counters(c))
    parts = []
    if errors:
        kinds = sorted({_error(f) for f in errors})
        parts.append(f"{len(errors)} raised ({', '.join(kinds)})")
    if not_done:
        parts.append(f"{len(not_done)} not done after {s.round_timeout:.0f} s")
        c.cancel(list(not_done))
    if wrong:
        parts.append(f"{len(wrong)} wrong or missing values")
    del futures, not_done, errors
    return Round(seconds, failed == 0, tasks, failed, counters, "; ".join(parts))


def round_b(config: Config, s: Setup, r: int, warmup: bool = False) -> Round:
    """Outputs held, then a PyTorch task needing more than is free (the warm-up: a small one,
    so that PyTorch starts); its value and the outputs' values checked afterwards."""
    c = config.client
    budget = s.mixed_budget
    n_out, out_bytes = 8, budget // 16  # outputs: half the budget
    need = budget // 2 if not warmup else 8 * MiB
    if warmup:
        n_out = 1
    before = _counters(c)
    stamp = time.time_ns()
    outputs = c.map(
        persisted_output,
        range(n_out),
        [out_bytes] * n_out,
        [s.host] * n_out,
        pure=False,
        key=[f"output-{r}-{stamp}-{i}" for i in range(n_out)],
    )
    _wait(outputs, s.round_timeout)
    t0 = time.perf_counter()
    job = c.submit(torch_task, need, s.host, budget, pure=False, key=f"torch-{r}-{stamp}")
    not_done = _wait([job], s.round_timeout)
    seconds = time.perf_counter() - t0
    parts = []
    failed = 0
    if not_done:
        failed += 1
        parts.append(f"the PyTorch task not done after {s.round_timeout:.0f} s")
        c.cancel([job])
    elif job.status != "finished":
        failed += 1
        parts.append(f"the PyTorch task failed: {_error(job)}")
    elif job.result() != need // 4:
        failed += 1
        parts.append(f"the PyTorch task returned {job.result()}, expected {need // 4}")
    # The outputs, spilled or not, still hold their values.
    checked = _summaries(c, outputs, s.round_timeout)
    bad = sum(checked.get(i) != (out_bytes // 8 * 8, float(i), float(i)) for i in range(n_out))
    if bad:
        failed += bad
        parts.append(f"{bad} of the {n_out} held outputs wrong or lost")
    counters = _difference(before, _counters(c))
    c.cancel(outputs)
    del outputs, job
    return Round(seconds, failed == 0, 1 + n_out, failed, counters, "; ".join(parts))


def round_c(config: Config, s: Setup, r: int, warmup: bool = False) -> Round:
    """The chain under a new seed (new keys); its sum checked. The warm-up: a quarter of it
    in the same chunks (the same task prefixes and peaks, kernels compiled)."""
    c = config.client
    n = s.chain_n // 4 if warmup else s.chain_n
    seed = 1000 + r if not warmup else 7
    before = _counters(c)
    t0 = time.perf_counter()
    future = c.compute(chain(n, s.chain_chunk, s.host, seed))
    not_done = _wait([future], s.round_timeout)
    seconds = time.perf_counter() - t0
    if not_done:
        c.cancel([future])
        note = f"not done after {s.round_timeout:.0f} s"
    elif future.status != "finished":
        note = f"failed: {_error(future)}"
    else:
        note = chain_check(float(future.result()), n)
    counters = _difference(before, _counters(c))
    del future
    return Round(seconds, not note, 1, int(bool(note)), counters, note)


ROUNDS = {"a": round_a, "b": round_b, "c": round_c}
#: The parts' shares of the budget.
SHARES = {"a": 0.3, "b": 0.25, "c": 0.45}
#: Seconds of (b)'s share kept for each configuration still to run (the failing ones are quick).
B_RESERVE = 15.0
#: The shortest a round's timeout gets when its part's time is nearly spent.
MIN_ROUND_TIMEOUT = 20.0


def run(s: Setup, parts: str, rounds: int, budget: float, save) -> list[Config]:
    """Each part in turn, in its share of the ``budget`` seconds (0: no budget). Within (a)
    and (c) the configurations are alive together and their rounds interleaved; (b) takes the
    device's memory down to its budget with a ballast, so its configurations run one after
    another. ``save(configs)`` is called after every round."""
    configs = configurations(s, parts)
    t_start = time.perf_counter()
    todo = [p for p in "abc" if any(c.part == p for c in configs)]
    for k, part in enumerate(todo):
        group = [c for c in configs if c.part == part]
        deadline = None
        if budget:
            left = budget - (time.perf_counter() - t_start)
            deadline = time.perf_counter() + left * SHARES[part] / sum(SHARES[p] for p in todo[k:])
        if part == "b":
            for i, config in enumerate(group):  # each its equal part of (b)'s time
                d = None
                if deadline is not None:  # what is left, less a reserve for the others
                    d = deadline - B_RESERVE * (len(group) - i - 1)
                _rounds([config], s, rounds, d, lambda: save(configs))
        else:
            _rounds(group, s, rounds, deadline, lambda: save(configs))
    return configs


def _say(text: str) -> None:
    print(text, file=sys.stderr, flush=True)


def _one(config: Config, s: Setup, r: int, warmup: bool = False) -> Round:
    """Round ``r`` of ``config``; one that raises (a worker lost, the client closed) is a
    failed round, and the others go on."""
    t0 = time.perf_counter()
    try:
        return ROUNDS[config.part](config, s, r, warmup=warmup)
    except Exception as e:
        return Round(time.perf_counter() - t0, False, 0, 0, {}, f"the round raised {e!r}")


def _rounds(group: list[Config], s: Setup, rounds: int, deadline: float | None, save) -> None:
    live = []
    try:
        for config in group:
            t0 = time.perf_counter()
            try:
                start(config, s)
                live.append(config)
                _say(f"{config.label}: started in {time.perf_counter() - t0:.1f} s")
            except Exception as e:
                config.notes.append(f"setup failed: {e!r}")
                _say(f"{config.label}: setup failed: {e!r}")
        for config in live:  # warm-up (admission learns its peaks here), not kept
            w = _one(config, s, -1, warmup=True)
            _say(f"warm-up: {config.label}: {w.seconds:.2f} s {'ok' if w.ok else w.note}")
        last = 0.0
        for r in range(rounds):
            if r and deadline is not None and time.perf_counter() + last > deadline:
                for config in live:
                    config.notes.append(f"rounds {r}-{rounds - 1} not run: budget")
                _say(f"{', '.join(c.label for c in live)}: rounds {r}+ not run (budget)")
                break
            t_round = time.perf_counter()
            order = live if r % 2 == 0 else list(reversed(live))
            for config in order:
                limit = s.round_timeout
                if deadline is not None:  # a round that hangs must not take the other parts'
                    limit = min(limit, max(deadline - time.perf_counter(), MIN_ROUND_TIMEOUT))
                one = _one(config, replace(s, round_timeout=limit), r)
                config.rounds.append(one)
                figures = ", ".join(
                    f"{k} {_fmt_bytes(v) if k.endswith('bytes') else v}"
                    for k, v in one.counters.items()
                    if v
                )
                status = "ok" if one.ok else f"FAILED ({one.failed} of {one.tasks}: {one.note})"
                _say(
                    f"round {r}: {config.label}: {one.seconds:.2f} s {status}"
                    + (f"; {figures}" if figures else "")
                )
                save()
            last = time.perf_counter() - t_round
    finally:
        for config in live:
            stop(config)


# -- the table ------------------------------------------------------------------------------------


def _fmt_bytes(n: int | None) -> str:
    if n is None:
        return "-"
    return f"{n / MiB:.0f} MiB" if n >= MiB or n == 0 else f"{n} B"


def verdicts(configs: list[Config]) -> dict[str, dict]:
    """Per part: the target, the figure and whether it is met (None: not measured)."""
    out: dict[str, dict] = {}
    a = [c for c in configs if c.part == "a"]
    if a:
        gated = next(c for c in a if "admission" in c.label)
        fixed = [c for c in a if c.threads <= 4 and c.times and not c.failed_rounds]
        best = min(fixed, key=lambda c: c.median or 0.0) if fixed else None
        ratio = None
        if best is not None and gated.median is not None:
            ratio = gated.median / (best.median or 1.0)
        met = None
        if ratio is not None:
            met = ratio <= 1.10 and not gated.failed_rounds
        elif gated.rounds:
            met = False  # admission failed every round
        out["a"] = {
            "target": "8 threads + admission completes every round, within 10 % of the best "
            "fixed 1/2/3/4 threads",
            "best_fixed": best.label if best else None,
            "ratio": ratio,
            "met": met,
        }
    b = [c for c in configs if c.part == "b"]
    if b:
        completed = {c.label: bool(c.rounds) and not c.failed_rounds for c in b}
        on = [c for c in b if "arbitration on" in c.label]
        others = [c for c in b if c not in on]
        met = None
        if all(c.rounds for c in b):
            met = all(completed[c.label] for c in on) and not any(
                any(r.ok for r in c.rounds) for c in others
            )
        out["b"] = {
            "target": "only arbitration on completes (the others fail the PyTorch task)",
            "completed": completed,
            "met": met,
        }
    c_rows = [c for c in configs if c.part == "c"]
    if c_rows:
        costs: dict[str, float | None] = {}
        paired: dict[str, float | None] = {}
        for c in c_rows:
            if "admission" not in c.label:
                continue
            plain = next(x for x in c_rows if x.label == c.label.replace(" + admission", ""))
            costs[plain.label] = (
                (c.median / plain.median - 1) * 100 if c.median and plain.median else None
            )
            # The same round of both (neighbours in time): less drift than the medians'.
            ratios = [
                x.seconds / y.seconds
                for x, y in zip(c.rounds, plain.rounds, strict=False)
                if x.ok and y.ok
            ]
            paired[plain.label] = (statistics.median(ratios) - 1) * 100 if ratios else None
        measured = [v for v in costs.values() if v is not None]
        out["c"] = {
            "target": "admission costs at most 2 %",
            "cost_percent": costs,
            "paired_cost_percent": paired,
            "met": (all(v <= 2.0 for v in measured) if len(measured) == len(costs) else None),
        }
    return out


def table(configs: list[Config], s: Setup, rounds: int) -> str:
    kind = "host memory (CPU; says nothing of a GPU)" if s.host else "GPU"
    lines = [
        f"bench/admission.py on {kind}: median of up to {rounds} interleaved rounds after a "
        "warm-up; a round with a failed, wrong or missing result is failed and has no time"
    ]
    titles = {
        "a": f"(a) {s.tasks} tasks each holding {s.task_fraction:.0%} of {s.limit / MiB:.0f} MiB"
        f" while {s.work} passes run",
        "b": f"(b) mixed worker: outputs of {s.mixed_budget // 2 / MiB:.0f} MiB held, a PyTorch "
        f"task needing {s.mixed_budget // 2 / MiB:.0f} MiB of {s.mixed_budget / MiB:.0f}",
        "c": f"(c) cost where everything fits: the chain, {s.chain_n}^2 in {s.chain_chunk}^2",
    }
    verdict = verdicts(configs)
    head = (
        f"{'configuration':<30} {'median s':>8} {'min-max s':>13} {'failed':>9} "
        f"{'spilled':>9} {'OOM avoided/hit':>15} {'retried':>7} {'held':>5}"
    )
    for part in "abc":
        rows = [c for c in configs if c.part == part]
        if not rows:
            continue
        lines += ["", titles[part], head]
        for c in rows:
            med = f"{c.median:.3f}" if c.median is not None else "-"
            spread = f"{min(c.times):.2f}-{max(c.times):.2f}" if c.times else "-"
            failed = f"{c.failed_rounds}/{len(c.rounds)} r"
            avoided, hit = c.total("ooms_avoided"), c.total("oom_count")
            ooms = "-" if avoided is None else f"{avoided}/{hit}"
            retried = c.total("task_retries")
            held = c.total("admission_total_held") if c.admission else None
            lines.append(
                f"{c.label:<30} {med:>8} {spread:>13} {failed:>9} "
                f"{_fmt_bytes(c.total('total_spilled_bytes')):>9} {ooms:>15} "
                f"{'-' if retried is None else retried:>7} "
                f"{'-' if held is None else held:>5}"
            )
            tasks_failed = sum(r.failed for r in c.rounds)
            notes = sorted({r.note for r in c.rounds if r.note}) + c.notes
            if tasks_failed:
                notes.insert(0, f"{tasks_failed} tasks failed over the rounds")
            if notes:
                lines.append("    " + "; ".join(notes))
        v = verdict[part]
        met = {True: "MET", False: "NOT MET", None: "not measured"}[v["met"]]
        if part == "a":
            figure = (
                f"admission / {v['best_fixed']} = {v['ratio']:.3f}"
                if v["ratio"] is not None
                else "no ratio (admission or every fixed setting failed)"
            )
        elif part == "b":
            figure = "completed: " + ", ".join(
                f"{k} {'yes' if ok else 'no'}" for k, ok in v["completed"].items()
            )
        else:
            figure = ", ".join(
                f"{k}: {'-' if p is None else f'{p:+.1f} %'}"
                + ("" if q is None else f" (per-round median {q:+.1f} %)")
                for (k, p), q in zip(
                    v["cost_percent"].items(), v["paired_cost_percent"].values(), strict=True
                )
            )
        counted = sorted({len(c.rounds) for c in rows})
        lines.append(
            f"target: {v['target']}: {figure}: {met} ({'/'.join(map(str, counted))} rounds run)"
        )
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
    parser.add_argument("--parts", default="abc", help="which demonstrations: a, b, c (e.g. ab)")
    parser.add_argument(
        "--budget",
        type=float,
        default=250.0,
        help="seconds for the whole run, shared among the parts (0: no limit)",
    )
    parser.add_argument("--json", type=Path, default=None)
    parser.add_argument(
        "--executor-cost", action="store_true", help="only the executor's cost per task"
    )
    args = parser.parse_args()
    if args.executor_cost:
        plain, gated = executor_cost()
        print(f"per task: pool {plain:.1f} us, admission executor {gated:.1f} us")
        return
    # The in-process schedulers' INFO lines (clients and workers coming and going) drown the
    # progress lines.
    import distributed  # noqa: F401  (its logging set up first, then quietened)

    for name in ["distributed", *logging.root.manager.loggerDict]:
        if name.startswith("distributed"):
            logging.getLogger(name).setLevel(logging.WARNING)
    s = host_setup() if args.host_memory else gpu_setup()

    def save(configs: list[Config]) -> None:
        if args.json is None:
            return
        args.json.parent.mkdir(parents=True, exist_ok=True)
        document = {
            "benchmark": "admission",
            "host_memory": s.host,
            "rounds": args.rounds,
            "parts": args.parts,
            "budget_s": args.budget,
            "python": platform.python_version(),
            "host": platform.node(),
            "setup": s.__dict__,
            "verdicts": verdicts(configs),
            "rows": [c.row() for c in configs],
        }
        args.json.write_text(json.dumps(document, indent=2))

    t0 = time.perf_counter()
    configs = run(s, args.parts, args.rounds, args.budget, save)
    save(configs)
    print(table(configs, s, args.rounds))
    print(f"\n{time.perf_counter() - t0:.0f} s in all")


if __name__ == "__main__":
    main()
