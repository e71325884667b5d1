"""Added cost of AttributionResourceAdaptor per allocate/deallocate pair, on host memory.

Runs a tight allocate+free loop on a PoolMemoryResource (or a trivial counting resource when the
pool is not available) with and without the adaptor, with the real task-prefix getter that the
plugin installs and a distributed task key set in the thread-local, and prints a table.

    python bench/attribution_overhead.py [--pairs 200000] [--repeat 7]
"""

from __future__ import annotations

import argparse
import statistics
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


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--pairs", type=int, default=200_000)
    parser.add_argument("--repeat", type=int, default=7)
    args = parser.parse_args()

    from distributed.utils import set_thread_state

    from dask_rmm.plugin import current_task_key, task_prefix

    upstreams = {"bump": _BumpResource}
    try:
        from dask_rmm.mr import PoolMemoryResource, SystemMemoryResource

        upstreams["pool(system)"] = lambda: PoolMemoryResource(
            SystemMemoryResource(), initial_pool_size=1 << 24
        )
    except (ImportError, AttributeError):
        pass

    rows = []
    for label, make in upstreams.items():
        base = make()
        wrapped = AttributionResourceAdaptor(make(), current_task_key, owner_name=task_prefix)
        with set_thread_state(key=("sum-chunk-0123456789abcdef", 3, 4)):
            _loop(base, 10_000)
            _loop(wrapped, 10_000)
            plain, attributed = [], []
            for _ in range(args.repeat):
                plain.append(_loop(base, args.pairs))
                attributed.append(_loop(wrapped, args.pairs))
        assert wrapped.get_owner_memory("sum-chunk").peak_bytes == 4096
        p, a = statistics.median(plain), statistics.median(attributed)
        rows.append((label, p, a, a - p))

    print(f"{'upstream':<14} {'plain ns/pair':>14} {'attributed ns/pair':>19} {'added ns/pair':>14}")
    for label, p, a, d in rows:
        print(f"{label:<14} {p:>14.0f} {a:>19.0f} {d:>14.0f}")


if __name__ == "__main__":
    main()
