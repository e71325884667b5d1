"""Microseconds the worker spends on dask-rmm's heartbeat metrics and on one sampler tick.

Builds RMMPlugin's stack (pool + statistics + attribution) on a stand-in worker, charges 20
task prefixes, then times ``worker.metrics["dask-rmm"]`` (with the ~5 samples a 0.5 s heartbeat
at the 100 ms sample interval carries), ``worker.metrics["rmm"]`` and the sampler tick. Prints a
table; ``--base cuda`` on a GPU host (the default there) includes cudaMemGetInfo.

    python bench/plugin_metrics.py [--calls 20000] [--base system|cuda]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path
from types import SimpleNamespace

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from dask_rmm import _cuda  # noqa: E402
from dask_rmm.plugin import RMMPlugin  # noqa: E402


def _time(fn, calls: int, before=None) -> float:
    """Median of 5 runs, microseconds per call."""
    runs = []
    for _ in range(5):
        total = 0.0
        for _ in range(calls):
            if before is not None:
                before()
            t0 = time.perf_counter()
            fn()
            total += time.perf_counter() - t0
        runs.append(total / calls * 1e6)
    return statistics.median(runs)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--calls", type=int, default=20_000)
    parser.add_argument("--base", default="cuda" if _cuda.is_available() else "system")
    args = parser.parse_args()

    from distributed.utils import set_thread_state

    worker = SimpleNamespace(
        name="bench-0",
        address="inproc://bench",
        metrics={},
        periodic_callbacks={},
        status=SimpleNamespace(name="init"),
    )
    plugin = RMMPlugin(pool_size="64MiB", base_resource=args.base)
    plugin._setup_memory(worker)
    plugin._install_metrics(worker)
    metrics = plugin.worker_metrics
    mr = plugin.resources()[0]
    held = []
    for i in range(20):
        with set_thread_state(key=(f"prefix{i}-0123456789abcdef", 0)):
            held.append((mr.allocate(4096 * (i + 1)), 4096 * (i + 1)))

    def refill():
        for _ in range(5):
            metrics.sample()

    rows = [
        (
            'metrics["dask-rmm"] (5 samples)',
            _time(lambda: metrics.heartbeat_metrics(worker), args.calls, refill),
        ),
        ("  of which reserved_memory_info()", _time(mr.reserved_memory_info, args.calls)),
        (
            'metrics["rmm"] (after "dask-rmm")',
            _time(
                lambda: metrics.rmm_metrics(worker),
                args.calls,
                lambda: metrics.heartbeat_metrics(worker),
            ),
        ),
        ("sampler tick", _time(metrics.sample, args.calls)),
    ]
    print(f"{'callable':<34} {'us/call':>8}")
    for label, us in rows:
        print(f"{label:<34} {us:>8.1f}")
    print(
        f"base resource {args.base!r}, 1 device, 20 task prefixes, median of 5 x {args.calls} calls"
    )
    for ptr, size in held:
        mr.deallocate(ptr, size)
    plugin.teardown(worker)


if __name__ == "__main__":
    main()
