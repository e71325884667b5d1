"""What SchedulerTimelinePlugin costs the scheduler, with 64 simulated workers.

Per heartbeat: the ``heartbeat_worker`` wrapper plus taking one device's samples into the ring
buffer (20 samples: a 2 s heartbeat, which distributed uses for 50-199 workers, at the default
100 ms sample interval). Also the cost of the real ``Scheduler.heartbeat_worker`` call with and
without the hook, a full report, a Prometheus scrape, and the timelines' memory when full.

    python bench/scheduler_overhead.py [--workers 64] [--samples 20] [--rounds 400]

Prints a table; numbers vary with the machine (tests never assert on time).
"""

from __future__ import annotations

import argparse
import asyncio
import sys
import time
import tracemalloc
from pathlib import Path
from types import SimpleNamespace

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from dask_rmm.cluster import (  # noqa: E402
    METRICS_KEY,
    PLUGIN_NAME,
    SchedulerTimelinePlugin,
    _install_heartbeat_hook,
)


def metrics_dict(worker: int, t0: float, samples: int, devices: int = 1) -> dict:
    """One heartbeat's ``dask-rmm`` entry in the docs/internals.md format."""
    dev = {
        "current_bytes": 1 << 30,
        "current_count": 1000,
        "peak_bytes": 3 << 30,
        "peak_count": 4000,
        "total_bytes": 1 << 40,
        "total_count": 10**6,
        "reserved_bytes": 4 << 30,
        "pool_free_bytes": 3 << 30,
        "largest_free_block": 1 << 30,
        "failed_allocations": 0,
        "device_used_bytes": 5 << 30,
        "device_total_bytes": 80 << 30,
        "resource": "StatisticsResourceAdaptor>PoolMemoryResource>CudaMemoryResource",
        "task_groups": [[f"group-{i}", i << 20, i << 21] for i in range(10)],
        "samples": [[t0 + 0.1 * i, (1 << 30) + i, (1 << 30) + 2 * i] for i in range(samples)],
    }
    return {
        "version": 1,
        "time": t0,
        "worker": f"w{worker}",
        "devices": {str(d): dict(dev) for d in range(devices)},
    }


def fake_scheduler(n: int):
    workers = {
        f"tcp://10.0.0.{i}:40000": SimpleNamespace(
            address=f"tcp://10.0.0.{i}:40000", name=f"w{i}", metrics={}
        )
        for i in range(n)
    }
    s = SimpleNamespace(
        workers=workers,
        plugins={},
        address="tcp://10.0.0.250:8786",
        coerce_address=lambda a, resolve=True: a,
    )
    s.handlers = {"heartbeat_worker": lambda **kw: {"status": "OK"}}
    return s


def per_heartbeat(s, handler, batches, rounds: int) -> float:
    """Microseconds per heartbeat: set ws.metrics (as the scheduler does), call the handler."""
    addrs = list(s.workers)
    n = 0
    elapsed = 0.0
    for r in range(rounds):
        batch = batches[r % len(batches)]
        start = time.perf_counter()
        for i, a in enumerate(addrs):
            s.workers[a].metrics = batch[i]
            handler(address=a)
        elapsed += time.perf_counter() - start
        n += len(addrs)
    return elapsed / n * 1e6


def simulated(args) -> list[tuple[str, str]]:
    rows = []
    s = fake_scheduler(args.workers)
    base = s.handlers["heartbeat_worker"]
    # Fresh dicts per round (the scheduler gets a new one every heartbeat); built up front.
    batches = [
        [
            {METRICS_KEY: metrics_dict(i, 1e9 + r, args.samples, args.devices)}
            for i in range(args.workers)
        ]
        for r in range(8)
    ]
    empty = [[{} for _ in range(args.workers)]]

    rows.append(
        ("stub heartbeat_worker, no hook", f"{per_heartbeat(s, base, batches, args.rounds):.2f} us")
    )
    _install_heartbeat_hook(s)
    hooked = s.handlers["heartbeat_worker"]
    rows.append(
        ("hook, plugin not registered", f"{per_heartbeat(s, hooked, batches, args.rounds):.2f} us")
    )

    plugin = SchedulerTimelinePlugin(timeline_length=args.timeline_length)
    plugin.scheduler = s
    plugin.timeline_length = args.timeline_length
    s.plugins[PLUGIN_NAME] = plugin
    rows.append(
        (
            "hook + plugin, worker without dask-rmm",
            f"{per_heartbeat(s, hooked, empty, args.rounds):.2f} us",
        )
    )
    # Fill every ring buffer first, so the steady state (overwriting) is what gets timed.
    fill = args.timeline_length // args.samples + 1
    per_heartbeat(s, hooked, batches, fill)
    cost = per_heartbeat(s, hooked, batches, args.rounds)
    rows.append(
        (
            f"hook + plugin, {args.samples} samples x {args.devices} device(s)",
            f"{cost:.2f} us",
        )
    )
    interval = 2.0 if args.workers >= 50 else 1.0 if args.workers > 10 else 0.5
    rows.append(
        (
            f"scheduler CPU for {args.workers} workers (heartbeat every {interval:g} s)",
            f"{cost * args.workers / interval / 1e4:.4f} %",
        )
    )

    start = time.perf_counter()
    data = plugin.report_data(timeline=True)
    rows.append(("report_data, full timelines", f"{(time.perf_counter() - start) * 1e3:.1f} ms"))
    nsamples = sum(len(d["timeline"]) for w in data["workers"] for d in w["devices"].values())
    rows.append(("  samples in that report", f"{nsamples:,}"))
    start = time.perf_counter()
    plugin.report_data(timeline=False)
    rows.append(("report_data, no timelines", f"{(time.perf_counter() - start) * 1e3:.2f} ms"))

    try:
        from dask_rmm.prometheus import DaskRMMCollector

        collector = DaskRMMCollector()
        collector.plugins.add(plugin)
        list(collector.collect())  # the first call pays for prometheus_client's lazy setup
        start = time.perf_counter()
        fams = list(collector.collect())
        rows.append(
            (
                "Prometheus collect",
                f"{(time.perf_counter() - start) * 1e3:.2f} ms ({len(fams)} families)",
            )
        )
    except ImportError:
        rows.append(("Prometheus collect", "prometheus_client not installed"))

    tracemalloc.start()
    p2 = SchedulerTimelinePlugin(timeline_length=args.timeline_length)
    p2.scheduler = s
    s.plugins[PLUGIN_NAME] = p2
    snap0 = tracemalloc.take_snapshot()
    for k in range(args.timeline_length // args.samples + 1):
        for i, a in enumerate(s.workers):
            s.workers[a].metrics = batches[k % len(batches)][i]
            p2.on_heartbeat(a)
    snap1 = tracemalloc.take_snapshot()
    tracemalloc.stop()
    grown = sum(st.size_diff for st in snap1.compare_to(snap0, "filename"))
    rows.append(
        (
            f"timeline memory, full ({args.timeline_length} samples/device)",
            f"{grown / 2**20:.1f} MiB",
        )
    )
    return rows


async def real_heartbeat(args) -> list[tuple[str, str]]:
    """The real Scheduler.heartbeat_worker, with and without the hook (one worker, in-process)."""
    from distributed import Scheduler, Worker

    rows = []
    async with Scheduler(dashboard_address=":0", port=0) as s:
        async with Worker(s.address, nthreads=1) as w:
            base_metrics = await w.get_metrics()
            batches = [
                dict(
                    base_metrics,
                    **{METRICS_KEY: metrics_dict(0, 1e9 + r, args.samples, args.devices)},
                )
                for r in range(8)
            ]
            w.periodic_callbacks["heartbeat"].stop()

            def timed(handler) -> float:
                start = time.perf_counter()
                for r in range(args.rounds):
                    handler(
                        address=w.address, metrics=batches[r % 8], executing={}, now=time.time()
                    )
                return (time.perf_counter() - start) / args.rounds * 1e6

            original = s.handlers["heartbeat_worker"]
            timed(original)
            rows.append(("real Scheduler.heartbeat_worker, no hook", f"{timed(original):.2f} us"))
            await s.register_scheduler_plugin(
                SchedulerTimelinePlugin(timeline_length=args.timeline_length), idempotent=True
            )
            hooked = s.handlers["heartbeat_worker"]
            timed(hooked)
            rows.append(
                ("real Scheduler.heartbeat_worker + dask-rmm hook", f"{timed(hooked):.2f} us")
            )
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--workers", type=int, default=64)
    ap.add_argument("--samples", type=int, default=20, help="samples per heartbeat and device")
    ap.add_argument("--devices", type=int, default=1)
    ap.add_argument("--rounds", type=int, default=400)
    ap.add_argument("--timeline-length", type=int, default=3600)
    args = ap.parse_args()

    rows = simulated(args)
    rows += asyncio.run(real_heartbeat(args))
    width = max(len(k) for k, _ in rows)
    print(
        f"dask-rmm scheduler overhead: {args.workers} simulated workers, Python {sys.version.split()[0]}"
    )
    print(f"{'measure':<{width}}  value")
    print(f"{'-' * width}  {'-' * 20}")
    for k, v in rows:
        print(f"{k:<{width}}  {v}")


if __name__ == "__main__":
    main()
