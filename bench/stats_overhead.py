"""Nanoseconds the bookkeeping adaptors add to one allocate+deallocate pair.

Prints a table: adaptor over a trivial upstream (a resource that hands back one pointer and
does nothing), over SystemMemoryResource, and over PoolMemoryResource when it exists. The
figure that matters is the statistics adaptor's (budget: 150 ns per pair); tracking and
logging are shown for information. Run: ``python bench/stats_overhead.py [pairs]``.
"""

from __future__ import annotations

import gc
import os
import sys
import tempfile
import time

from dask_rmm.mr.base import DeviceMemoryResource
from dask_rmm.stream import DEFAULT_STREAM


class TrivialResource(DeviceMemoryResource):
    """Hands out one fixed pointer and takes it back without any bookkeeping."""

    def allocate(self, nbytes, stream=DEFAULT_STREAM):
        return 1 << 20

    def deallocate(self, ptr, nbytes, stream=DEFAULT_STREAM):
        return None


def _time_pairs(mr, pairs: int, nbytes: int = 1000) -> float:
    alloc, dealloc = mr.allocate, mr.deallocate
    t0 = time.perf_counter()
    for _ in range(pairs):
        dealloc(alloc(nbytes), nbytes)
    return time.perf_counter() - t0


def _best_ns(mr, pairs: int, repeats: int) -> float:
    return min(_time_pairs(mr, pairs) for _ in range(repeats)) / pairs * 1e9


def _upstreams():
    from dask_rmm import mr

    yield "trivial", TrivialResource
    yield "system", mr.SystemMemoryResource
    try:
        pool_cls = mr.PoolMemoryResource
    except (ImportError, AttributeError):
        return
    yield "pool(system)", lambda: pool_cls(mr.SystemMemoryResource(), initial_pool_size=1 << 24)


def _adaptors(tmpdir):
    from dask_rmm import mr

    yield "statistics", mr.StatisticsResourceAdaptor
    yield "tracking", mr.TrackingResourceAdaptor
    log_path = os.path.join(tmpdir, "bench.csv")
    yield "logging", lambda up: mr.LoggingResourceAdaptor(up, log_file_name=log_path)


def main(pairs: int = 200_000, repeats: int = 7) -> None:
    gc.disable()
    print(f"{'upstream':<14} {'adaptor':<12} {'ns/pair':>9} {'added ns/pair':>14}")
    with tempfile.TemporaryDirectory() as tmpdir:
        for up_name, make_up in _upstreams():
            upstream = make_up()
            base = _best_ns(upstream, pairs, repeats)
            print(f"{up_name:<14} {'(none)':<12} {base:9.0f} {'':>14}")
            for ad_name, make_ad in _adaptors(tmpdir):
                # A fresh upstream under the adaptor: a statistics adaptor fuses with a pool and
                # would then count the bare pool's calls too.
                adaptor = make_ad(make_up())
                # Interleave with the bare upstream so that machine noise hits both alike.
                samples, bases = [], []
                for _ in range(repeats):
                    bases.append(_time_pairs(upstream, pairs) / pairs * 1e9)
                    samples.append(_time_pairs(adaptor, pairs) / pairs * 1e9)
                added = min(samples) - min(bases)
                print(f"{up_name:<14} {ad_name:<12} {min(samples):9.0f} {added:14.0f}")
    print(f"python {sys.version.split()[0]}, {pairs} pairs x {repeats} repeats, best run")
    gc.enable()
    alloc_workload_rows()


def alloc_workload_rows(steps: int = 50_000, repeats: int = 7) -> None:
    """The same question on bench/alloc.py's workload (1000 live blocks, 256 B..4 MiB), over a
    pool on the host's base resource: the statistics and attribution layers the worker plugin
    stacks, measured interleaved with the bare pool, median of ``repeats``."""
    import functools
    import statistics as st
    import threading

    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    import alloc as A

    from dask_rmm import mr
    from dask_rmm.mr.attribution_adaptor import AttributionResourceAdaptor

    local = threading.local()
    local.key = "task-1"
    owner = functools.partial(getattr, local, "key", None)

    def stack(layers):
        def make():
            r = mr.PoolMemoryResource(A.base(), initial_pool_size=A.POOL_SIZE)
            if "statistics" in layers:
                r = mr.StatisticsResourceAdaptor(r)
            if "attribution" in layers:
                r = AttributionResourceAdaptor(r, owner)
            return r.allocate, r.deallocate, r

        return make

    rows = [
        ("pool", ()),
        ("pool+statistics", ("statistics",)),
        ("pool+statistics+attribution", ("statistics", "attribution")),
    ]
    times = {name: [] for name, _ in rows}
    for _ in range(repeats):
        for name, layers in rows:
            times[name].append(A.measure(stack(layers), steps, 1, 1))
    base = st.median(times["pool"])
    print(f"\nalloc workload (bench/alloc.py), median of {repeats} interleaved runs")
    print(f"{'stack':<30} {'ns/pair':>9} {'added ns/pair':>14}")
    for name, _ in rows:
        med = st.median(times[name])
        print(f"{name:<30} {med:9.0f} {med - base:14.0f}")


if __name__ == "__main__":
    main(int(sys.argv[1]) if len(sys.argv) > 1 else 200_000)
