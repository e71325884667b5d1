"""Nanoseconds AttributionResourceAdaptor adds to one allocate+deallocate pair (budget: 300).

A tight allocate+free loop with and without the adaptor, using the getter the plugin installs
(distributed's running-task key) with a task key set in the thread-local, over a trivial
upstream (only the adaptor's own cost) and over PoolMemoryResource on host memory. The
statistics adaptor's cost on the same upstream is printed beside it as a yardstick for slow or
busy machines. Best of ``--repeat`` runs.

    python bench/attribution_overhead.py [--pairs 200000] [--repeat 7]
"""

from __future__ import annotations

import argparse
import gc
import platform
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from dask_rmm.mr.attribution_adaptor import AttributionResourceAdaptor  # noqa: E402
from dask_rmm.mr.base import DeviceMemoryResource  # noqa: E402
from dask_rmm.stream import DEFAULT_STREAM  # noqa: E402


class _BumpResource(DeviceMemoryResource):
    """Hands out increasing fake addresses: the cheapest possible upstream, so only the
    adaptor's own cost is measured."""

    def __init__(self):
        super().__init__(device_id=0)
        self._next = 256

    def allocate(self, nbytes, stream=DEFAULT_STREAM):
        self._next += 256
        return self._next

    def deallocate(self, ptr, nbytes, stream=DEFAULT_STREAM):
        pass


def _loop(mr, pairs: int) -> float:
    alloc, free = mr.allocate, mr.deallocate
    t0 = time.perf_counter()
    for _ in range(pairs):
        p = alloc(4096)
        free(p, 4096)
    return (time.perf_counter() - t0) / pairs * 1e9


def _best(mr, pairs: int, repeat: int) -> float:
    _loop(mr, min(pairs, 10_000))
    return min(_loop(mr, pairs) for _ in range(repeat))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--pairs", type=int, default=200_000)
    parser.add_argument("--repeat", type=int, default=7)
    args = parser.parse_args()

    from distributed.utils import set_thread_state

    from dask_rmm.plugin import current_task_key, task_prefix

    upstreams = {"trivial": _BumpResource}
    try:
        from dask_rmm.mr import PoolMemoryResource, SystemMemoryResource

        upstreams["pool(system)"] = lambda: PoolMemoryResource(
            SystemMemoryResource(), initial_pool_size=1 << 24
        )
    except (ImportError, AttributeError):
        pass
    try:
        from dask_rmm.mr import StatisticsResourceAdaptor
    except (ImportError, AttributeError):
        StatisticsResourceAdaptor = None

    rows = []
    gc.disable()
    try:
        with set_thread_state(key=("sum-chunk-0123456789abcdef", 3, 4)):
            for label, make in upstreams.items():
                plain = _best(make(), args.pairs, args.repeat)
                attributed = AttributionResourceAdaptor(make(), current_task_key, task_prefix)
                with_attr = _best(attributed, args.pairs, args.repeat)
                assert attributed.get_owner_memory("sum-chunk").peak_bytes == 4096
                with_stats = None
                if StatisticsResourceAdaptor is not None:
                    with_stats = _best(StatisticsResourceAdaptor(make()), args.pairs, args.repeat)
                rows.append((label, plain, with_attr, with_stats))
    finally:
        gc.enable()

    print(
        f"{'upstream':<14} {'plain':>8} {'attribution':>12} {'added':>8} {'statistics added':>17}"
    )
    for label, plain, with_attr, with_stats in rows:
        stats = "" if with_stats is None else f"{with_stats - plain:.0f}"
        print(f"{label:<14} {plain:>8.0f} {with_attr:>12.0f} {with_attr - plain:>8.0f} {stats:>17}")
    print(
        f"ns per allocate+deallocate pair; python {platform.python_version()}, "
        f"{args.pairs} pairs x {args.repeat} repeats, best run"
    )


if __name__ == "__main__":
    main()
