"""What each of the pool's speed mechanisms is worth: every mechanism turned off in turn, the
allocation pairs of bench/alloc.py timed with and without it, all interleaved.

Mechanisms (each switched off here only, by the bench, never by a flag of the pool):

- ``lock``: the list-based lock (mr/locks.py ``ListLock``, taken with ``unlocked.pop()`` and
  given back with ``unlocked.append(True)``) replaced by a ``threading.Lock`` whose blocking
  ``acquire``/``__exit__`` stand in for ``pop``/``append`` (so, with threads, also without the
  ``sleep(0)`` retry that avoids a lock convoy). Taken on the pairs only while owners are
  charged (the worker stack) and when a stream's cache misses.
- ``gc-pause``: no garbage-collector pause while the pool's lock is held (``gc_paused_lock`` a
  plain lock, the in-place pauses skipped).
- ``numpy-fold``: the counters' journal folded by the Python loop at every length (not NumPy
  from 160 entries).
- ``fused``: statistics and attribution count in their own layers (the pool declines
  ``count_allocations``/``charge_owners``), so no journal either.
- ``inlined``: the fast paths' inlined ``SEARCH_CLASS[(n + 255) >> 8]`` (pinned by
  tests/mr/test_inlined_formulas.py) made a function call, as it would be without inlining.
- ``charged``: the fast paths serving a cached block under the lock while owners are charged
  (the worker stack), turned off: those pairs go to the locked path
  (``_allocate_locked``/``_deallocate_locked``).

Rows: the pool alone, statistics over the pool, the worker stack (attribution over statistics
over the pool, owners charged), each at 1 and ``--threads`` threads, and ``DeviceBuffer(size=n)``
over the worker stack. Workload and timing are bench/alloc.py's (W=1000 live blocks, log-uniform
sizes in [256 B, 4 MiB], served from the pool's per-stream caches after warm-up: the base
resource is only called at construction, so host memory stands in for a GPU's). Every round
measures every (row, variant) once, the variants in a rotated order; the table gives, per row,
the median ns per pair with everything on, and per mechanism the median over rounds of
(ns with it off / ns with it on - 1) with the smallest and largest round: the mechanism's share.
The keep threshold of issue 32 is a share of 10 % on the pairs.

Usage: python bench/pool_mechanisms.py [--steps N] [--rounds R] [--threads T] [--clock wall|thread]
[--json PATH]
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import gc
import inspect
import json
import platform
import statistics
import subprocess
import sys
import textwrap
import threading
import time
import types
from collections.abc import Callable, Iterator
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from alloc import POOL_SIZE, W, base, draw, measure_once, run_loop  # noqa: E402

from dask_rmm import mr  # noqa: E402
from dask_rmm.mr import instrumentation  # noqa: E402
from dask_rmm.mr import pool as pool_module  # noqa: E402
from dask_rmm.mr.attribution_adaptor import AttributionResourceAdaptor  # noqa: E402

MECHANISMS = ("lock", "gc-pause", "numpy-fold", "fused", "inlined", "charged")
VARIANTS = ("all on", *MECHANISMS)

# -- the switches -------------------------------------------------------------------------------


def _threading_lock(pool: mr.PoolMemoryResource) -> None:
    lock = threading.Lock()
    pool._lock = lock  # type: ignore[assignment]
    # The hot paths call unlocked.pop() to take the lock and unlocked.append(True) to give it
    # back; Lock.__exit__ takes any arguments and releases.
    pool._unlocked = types.SimpleNamespace(pop=lock.acquire, append=lock.__exit__)  # type: ignore[assignment]


class _PlainLock:
    """``gc_paused_lock`` without the pause."""

    __slots__ = ("lock",)

    def __init__(self, lock):
        self.lock = lock

    def __enter__(self):
        self.lock.acquire()
        return self

    def __exit__(self, *exc):
        self.lock.release()


@contextlib.contextmanager
def _no_gc_pause() -> Iterator[None]:
    # gc.isenabled() answers False (bool() is a C call, as gc.isenabled is): no in-place pause.
    fake_gc = types.SimpleNamespace(isenabled=bool, disable=gc.disable, enable=gc.enable)
    saved = pool_module.gc, instrumentation.gc, pool_module.gc_paused_lock
    pool_module.gc = instrumentation.gc = fake_gc  # type: ignore[assignment]
    pool_module.gc_paused_lock = _PlainLock  # type: ignore[assignment,misc]
    try:
        yield
    finally:
        pool_module.gc, instrumentation.gc, pool_module.gc_paused_lock = saved


@contextlib.contextmanager
def _python_fold() -> Iterator[None]:
    saved = instrumentation._SETTLE_IN_NUMPY
    instrumentation._SETTLE_IN_NUMPY = 1 << 62
    try:
        yield
    finally:
        instrumentation._SETTLE_IN_NUMPY = saved


@contextlib.contextmanager
def _patched(obj, **attrs) -> Iterator[None]:
    """Class or module attributes replaced while the block runs (never an instance's: a new
    instance attribute would slow every attribute read of the pool's hot path)."""
    saved = {name: getattr(obj, name) for name in attrs}
    for name, value in attrs.items():
        setattr(obj, name, value)
    try:
        yield
    finally:
        for name, value in saved.items():
            setattr(obj, name, value)


def _unfused() -> contextlib.AbstractContextManager:
    # The adaptors find a pool that declines to count and to charge for them.
    return _patched(
        mr.PoolMemoryResource,
        count_allocations=lambda self, counters: False,
        charge_owners=lambda self, owners: False,
    )


def _search_class_of(n: int) -> int:
    return pool_module.SEARCH_CLASS[(n + 255) >> 8]


INLINED = "SEARCH_CLASS[(n + 255) >> 8]"
#: method -> (text, replacement) for each variant made from the pool's own source
REWRITES = {
    "inlined": {
        name: [
            (INLINED, "_search_class_of(n)"),
            (INLINED.replace("(n ", "(nbytes "), "_search_class_of(nbytes)"),
        ]
        for name in ("allocate", "deallocate")
    },
    "charged": {
        name: [
            (
                "    owners = self._owners\n    if owners is not None:\n",
                "    owners = self._owners\n    if owners is not None:\n"
                f"        return self._{name}_locked({args}, stream, key)\n",
            )
        ]
        for name, args in (("allocate", "nbytes"), ("deallocate", "ptr, nbytes"))
    },
}


@functools.cache
def _rewritten_methods(variant: str) -> dict[str, Callable]:
    """PoolMemoryResource's ``allocate``/``deallocate`` with :data:`REWRITES`' changes (made
    from the pool's own source, so nothing else differs)."""
    namespace = {**vars(pool_module), "_search_class_of": _search_class_of}
    methods = {}
    for name, changes in REWRITES[variant].items():
        source = textwrap.dedent(inspect.getsource(getattr(mr.PoolMemoryResource, name)))
        replaced = source
        for old, new in changes:
            replaced = replaced.replace(old, new)
        if replaced == source:
            raise RuntimeError(f"PoolMemoryResource.{name} no longer has {changes[0][0]!r}")
        exec(compile(replaced, pool_module.__file__, "exec"), namespace)
        methods[name] = namespace[name]
    return methods


def _uninlined() -> contextlib.AbstractContextManager:
    return _patched(mr.PoolMemoryResource, **_rewritten_methods("inlined"))


def _uncharged() -> contextlib.AbstractContextManager:
    return _patched(mr.PoolMemoryResource, **_rewritten_methods("charged"))


#: variant -> (change made to each new pool, module-level swap held while the row runs)
SWITCHES: dict[str, tuple[Callable | None, Callable[[], contextlib.AbstractContextManager]]] = {
    "all on": (None, contextlib.nullcontext),
    "lock": (_threading_lock, contextlib.nullcontext),
    "gc-pause": (None, _no_gc_pause),
    "numpy-fold": (None, _python_fold),
    "fused": (None, _unfused),
    "inlined": (None, _uninlined),
    "charged": (None, _uncharged),
}

# -- the rows -----------------------------------------------------------------------------------

_task = threading.local()
#: The owner of an allocation: the thread's "task" (as current_task_key reads distributed's).
get_owner = functools.partial(getattr, _task, "key", "task-0")


def _stack(row: str, pool_hook: Callable | None):
    pool = mr.PoolMemoryResource(base(), initial_pool_size=POOL_SIZE)
    if pool_hook is not None:
        pool_hook(pool)
    if row == "pool":
        return pool
    stats = mr.StatisticsResourceAdaptor(pool)
    if row == "statistics(pool)":
        return stats
    return AttributionResourceAdaptor(stats, get_owner, owner_name=str)


class _Restore:
    def __init__(self, undo, *keep):
        self.undo, self.keep = undo, keep

    def __del__(self):
        self.undo()


def maker(row: str, pool_hook: Callable | None):
    def make():
        if row == "DeviceBuffer":
            from dask_rmm.device_buffer import DeviceBuffer

            top = _stack("worker stack", pool_hook)
            previous = mr.set_current_device_resource(top)

            def alloc(n):
                return DeviceBuffer(size=n)

            def free(p, n):
                pass  # the loop drops the buffer, which frees it

            return alloc, free, _Restore(lambda: mr.set_current_device_resource(previous), top)
        top = _stack(row, pool_hook)
        return top.allocate, top.deallocate, top

    return make


def rows(threads: int) -> list[tuple[str, int]]:
    out = []
    for row in ("pool", "statistics(pool)", "worker stack"):
        out += [(row, 1), (row, threads)]
    return [*out, ("DeviceBuffer", 1)]


# -- run ----------------------------------------------------------------------------------------


def _measure_thread_time(make, steps: int, r: int) -> float:
    """bench/alloc.py's one-thread measurement, timed by this thread's CPU time (other
    processes on a shared host then add little noise)."""
    alloc, free, keep = make()
    ns = run_loop(alloc, free, *draw(steps, W, seed=1000 * r), clock=time.thread_time_ns)
    del alloc, free, keep
    gc.collect()
    return ns / steps


def measure(row: str, threads: int, variant: str, steps: int, r: int, clock: str) -> float:
    hook, swap = SWITCHES[variant]
    with swap():
        if threads == 1 and clock == "thread":
            return _measure_thread_time(maker(row, hook), steps, r)
        return measure_once(maker(row, hook), steps, threads, r)


def _commit() -> str:
    try:
        out = subprocess.run(
            ["git", "log", "-1", "--format=%h"],
            capture_output=True,
            text=True,
            cwd=Path(__file__).resolve().parent,
            check=False,
        )
        return out.stdout.strip() or "?"
    except OSError:
        return "?"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=20_000, help="pairs per measurement")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--threads", type=int, default=8)
    ap.add_argument(
        "--clock",
        choices=("wall", "thread"),
        default="wall",
        help="one-thread rows timed by wall time (default) or by the thread's CPU time (for a "
        "shared host; rows with threads are always wall time)",
    )
    ap.add_argument("--json", default="", help="write every measurement to this path")
    args = ap.parse_args()
    for variant in REWRITES:  # fails at once if the pool's source no longer has what is rewritten
        _rewritten_methods(variant)
    cells = rows(args.threads)
    runs: dict[tuple[str, int, str], list[float]] = {}
    t_start = time.monotonic()
    for r in range(args.rounds):
        for i, (row, threads) in enumerate(cells):
            k = (r + i) % len(VARIANTS)
            measure(row, threads, "all on", args.steps // 4, r, args.clock)  # warm-up, not counted
            for variant in VARIANTS[k:] + VARIANTS[:k]:  # rotated: no variant always first
                ns = measure(row, threads, variant, args.steps, r, args.clock)
                runs.setdefault((row, threads, variant), []).append(ns)
    base_name = type(base()).__name__
    print(
        f"# bench/pool_mechanisms.py  commit {_commit()}  {time.strftime('%Y-%m-%d', time.gmtime())}"
        f"  base {base_name}  steps={args.steps}  rounds={args.rounds}  clock={args.clock}  python "
        f"{platform.python_version()}  {time.monotonic() - t_start:.0f} s"
    )
    print("# share = ns with the mechanism off / ns with all on - 1: median over rounds [min, max]")
    header = ["row", "threads", "all on (ns/pair)", *MECHANISMS]
    print("| " + " | ".join(header) + " |")
    print("| " + " | ".join("---" for _ in header) + " |")
    for row, threads in cells:
        on = runs[(row, threads, "all on")]
        cells_out = [row, str(threads), f"{statistics.median(on):.0f}"]
        for m in MECHANISMS:
            shares = [off / o - 1 for off, o in zip(runs[(row, threads, m)], on, strict=True)]
            cells_out.append(
                f"{100 * statistics.median(shares):+.1f} % [{100 * min(shares):+.1f}, "
                f"{100 * max(shares):+.1f}]"
            )
        print("| " + " | ".join(cells_out) + " |")
    if args.json:
        Path(args.json).write_text(
            json.dumps(
                {"base": base_name, "steps": args.steps, "runs": [
                    {"row": k[0], "threads": k[1], "variant": k[2], "ns": v}
                    for k, v in runs.items()
                ]},
                indent=1,
            )
        )  # fmt: skip


if __name__ == "__main__":
    main()
