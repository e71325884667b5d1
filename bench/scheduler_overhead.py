"""What SchedulerTimelinePlugin costs the scheduler, with 64 simulated workers.

The plugin reads ``WorkerState.metrics["dask-rmm"]`` in ``poll()``, every 0.1 s. Measured:
``poll()`` per new worker heartbeat once every ring buffer is full (each heartbeat carries the
previous heartbeat's samples and ``--samples`` new ones, as ``WorkerMetrics`` sends them: 20 is
a 2 s heartbeat, what distributed uses for 50-199 workers, at the 100 ms sample interval);
``poll()`` when no heartbeat arrived since the last one; ``report_data`` with and without
timelines; a Prometheus collect; the timelines' memory when full; and the real in-process
``Scheduler.heartbeat_worker`` (and a worker's whole heartbeat round trip) with and without the
plugin registered.

    python bench/scheduler_overhead.py [--workers 64] [--samples 20] [--rounds 400]

Prints a table; numbers vary with the machine (tests never assert on time).
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import os
import platform
import subprocess
import sys
import time
import tracemalloc
from pathlib import Path
from types import SimpleNamespace

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from dask_rmm.scheduler import SchedulerTimelinePlugin  # noqa: E402
from dask_rmm.wire import METRICS_KEY, PLUGIN_NAME, DeviceSample, TaskGroup, heartbeat  # noqa: E402


def device_dict(samples: list[list]) -> dict:
    """One device's heartbeat entry, as ``WorkerMetrics`` builds it (a pool with 10 task groups)."""
    d = DeviceSample(
        resource="StatisticsResourceAdaptor>AttributionAdaptor>PoolMemoryResource>CudaMemoryResource",
        current_bytes=1 << 30,
        current_count=1000,
        peak_bytes=3 << 30,
        peak_count=4000,
        total_bytes=1 << 40,
        total_count=10**6,
        reserved_bytes=4 << 30,
        pool_free_bytes=3 << 30,
        largest_free_block=1 << 30,
        device_used_bytes=5 << 30,
        device_total_bytes=140 << 30,
        gpu_name="NVIDIA H200",
        gpu_uuid="GPU-00000000-0000-0000-0000-000000000000",
        pci_bus_id="0000:01:00.0",
        task_groups=tuple(TaskGroup(f"group-{i}", i << 20, i << 21) for i in range(10)),
    ).to_dict()
    d["samples"] = samples
    return d


def heartbeats(worker: int, beats: int, samples: int, devices: int) -> list[dict]:
    """``beats`` consecutive heartbeat dicts of one worker (fresh dicts, as each heartbeat is)."""
    out = []
    previous: list[list] = []
    t = 1e9
    for _ in range(beats):
        batch = [[t + 0.1 * i, (1 << 30) + i, (1 << 30) + 2 * i] for i in range(samples)]
        t += 0.1 * samples
        devs = {str(dev): device_dict(previous + batch) for dev in range(devices)}
        out.append({METRICS_KEY: heartbeat(f"w{worker}", t, devs)})
        previous = batch
    return out


def fake_scheduler(n: int) -> SimpleNamespace:
    """What ``poll`` and ``report_data`` read of a Scheduler: workers, plugins, address."""
    workers = {
        f"tcp://10.0.0.{i}:40000": SimpleNamespace(
            address=f"tcp://10.0.0.{i}:40000", name=f"w{i}", metrics={}
        )
        for i in range(n)
    }
    return SimpleNamespace(workers=workers, plugins={}, address="tcp://10.0.0.250:8786")


def attach(s: SimpleNamespace, timeline_length: int) -> SchedulerTimelinePlugin:
    """Register a plugin on the fake scheduler without ``start`` (no poller, HTTP or Prometheus)."""
    plugin = SchedulerTimelinePlugin(timeline_length=timeline_length)
    plugin.scheduler = s
    s.plugins[PLUGIN_NAME] = plugin
    return plugin


def deliver(s: SimpleNamespace, beats: list[list[dict]], k: int) -> None:
    """Every worker's heartbeat number ``k`` arrives (the scheduler replaces ``ws.metrics``)."""
    for i, ws in enumerate(s.workers.values()):
        ws.metrics = beats[i][k % len(beats[i])]


def simulated(args) -> list[tuple[str, str]]:
    rows = []
    n = args.workers
    s = fake_scheduler(n)
    # The ring buffers fill after fill_beats heartbeats; a cycle of distinct heartbeats with
    # increasing times is built up front so that only the plugin is timed.
    fill_beats = args.timeline_length // args.samples + 1
    cycle = fill_beats + args.rounds
    beats = [heartbeats(i, cycle, args.samples, args.devices) for i in range(n)]

    plugin = attach(s, args.timeline_length)
    for k in range(fill_beats):
        deliver(s, beats, k)
        plugin.poll()
    full = sum(len(tl) for w in plugin._records.values() for tl in w.timelines.values())
    assert full == n * args.devices * args.timeline_length, full

    elapsed = 0.0
    for k in range(fill_beats, cycle):
        deliver(s, beats, k)
        start = time.perf_counter()
        plugin.poll()
        elapsed += time.perf_counter() - start
    per_beat = elapsed / (args.rounds * n) * 1e6
    rows.append(
        (
            f"poll() per new heartbeat, full buffers ({args.samples} new samples x "
            f"{args.devices} device(s))",
            f"{per_beat:.2f} us",
        )
    )

    reps = args.rounds * 10
    start = time.perf_counter()
    for _ in range(reps):
        plugin.poll()
    idle = (time.perf_counter() - start) / reps * 1e6
    rows.append((f"poll(), no new heartbeat ({n} workers)", f"{idle:.2f} us"))

    interval = 2.0 if n >= 50 else 1.0 if n > 10 else 0.5
    cpu = per_beat * n / interval + idle * 10  # heartbeats + 10 polls a second
    rows.append(
        (
            f"scheduler CPU, {n} workers (heartbeat every {interval:g} s, poll every 0.1 s)",
            f"{cpu / 1e4:.4f} %",
        )
    )

    # Memory: a second plugin fed the same heartbeats until full, counted by tracemalloc.
    # The heartbeat dicts already exist; what grows is the plugin's records and timelines.
    s2 = fake_scheduler(n)
    tracemalloc.start()
    snap0 = tracemalloc.take_snapshot()
    p2 = attach(s2, args.timeline_length)
    for k in range(fill_beats + 1):
        deliver(s2, beats, k)
        p2.poll()
    for ws in s2.workers.values():  # drop the scheduler's references, keep the plugin's
        ws.metrics = {}
    snap1 = tracemalloc.take_snapshot()
    tracemalloc.stop()
    timeline_bytes = sum(24 * len(tl) for w in p2._records.values() for tl in w.timelines.values())
    grown = sum(st.size_diff for st in snap1.compare_to(snap0, "filename"))
    memory_row = (
        f"timeline memory, full ({args.timeline_length} samples/device, {n * args.devices} "
        "devices)",
        f"{timeline_bytes / 2**20:.1f} MiB in arrays; "
        f"{grown / 2**20:.1f} MiB allocated by the plugin (tracemalloc)",
    )
    del p2, s2

    # The prebuilt heartbeats are millions of objects that would make the garbage collector's
    # passes, not the plugin, dominate the reports below: keep only what a scheduler holds
    # (each worker's last heartbeat).
    del beats
    gc.collect()

    start = time.perf_counter()
    for _ in range(3):
        data = plugin.report_data(timeline=True)
    rows.append(
        ("report_data, full timelines", f"{(time.perf_counter() - start) / 3 * 1e3:.1f} ms")
    )
    nsamples = sum(len(d["timeline"]) for w in data["workers"] for d in w["devices"].values())
    rows.append(("  samples in that report", f"{nsamples:,}"))
    reps = 20
    start = time.perf_counter()
    for _ in range(reps):
        plugin.report_data(timeline=False)
    rows.append(
        ("report_data, no timelines", f"{(time.perf_counter() - start) / reps * 1e3:.2f} ms")
    )

    try:
        from dask_rmm.scheduler.prometheus import DaskRMMCollector
    except ImportError:
        rows.append(("Prometheus collect", "prometheus_client not installed"))
    else:
        collector = DaskRMMCollector(plugin)
        list(collector.collect())  # the first call pays for prometheus_client's lazy setup
        start = time.perf_counter()
        for _ in range(reps):
            fams = list(collector.collect())
        rows.append(
            (
                "Prometheus collect",
                f"{(time.perf_counter() - start) / reps * 1e3:.2f} ms ({len(fams)} families)",
            )
        )

    rows.append(memory_row)
    return rows


async def real_heartbeat(args) -> list[tuple[str, str]]:
    """The real Scheduler.heartbeat_worker and a worker's heartbeat round trip, in-process,
    with and without the plugin registered (the plugin wraps nothing: its cost is the poll)."""
    from distributed import Scheduler, Worker

    rows = []
    async with Scheduler(dashboard_address=":0", port=0) as s:
        async with Worker(s.address, nthreads=1) as w:
            w.periodic_callbacks["heartbeat"].stop()
            # Consecutive slices of one worker's heartbeats, so each run brings new samples.
            beats = heartbeats(0, args.rounds * 5, args.samples, args.devices)
            base = await w.get_metrics()
            metrics = [dict(base, **b) for b in beats]

            def timed_handler(offset: int, plugin: SchedulerTimelinePlugin | None) -> float:
                start = time.perf_counter()
                for r in range(args.rounds):
                    s.heartbeat_worker(
                        address=w.address,
                        metrics=metrics[offset + r],
                        executing={},
                        now=time.time(),
                    )
                    if plugin is not None:
                        plugin.poll()
                return (time.perf_counter() - start) / args.rounds * 1e6

            async def timed_roundtrip(offset: int) -> float:
                nxt = iter(beats[offset:])
                w.metrics[METRICS_KEY] = lambda worker: next(nxt)[METRICS_KEY]
                start = time.perf_counter()
                for _ in range(args.rounds):
                    await w.heartbeat()
                return (time.perf_counter() - start) / args.rounds * 1e6

            timed_handler(0, None)  # warm up
            no_plugin = timed_handler(0, None)
            rt_no_plugin = await timed_roundtrip(args.rounds)
            await s.register_scheduler_plugin(
                SchedulerTimelinePlugin(timeline_length=args.timeline_length), idempotent=True
            )
            plugin = s.plugins[PLUGIN_NAME]
            with_plugin_handler = timed_handler(args.rounds * 2, None)
            with_plugin = timed_handler(args.rounds * 3, plugin)
            rt_plugin = await timed_roundtrip(args.rounds * 4)
            rows += [
                ("real Scheduler.heartbeat_worker, no plugin", f"{no_plugin:.2f} us"),
                (
                    "real Scheduler.heartbeat_worker, plugin registered",
                    f"{with_plugin_handler:.2f} us",
                ),
                ("  + plugin.poll() reading that heartbeat", f"{with_plugin:.2f} us"),
                ("worker heartbeat round trip (in-process), no plugin", f"{rt_no_plugin:.1f} us"),
                (
                    "worker heartbeat round trip (in-process), plugin polling",
                    f"{rt_plugin:.1f} us",
                ),
            ]
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--workers", type=int, default=64)
    ap.add_argument("--samples", type=int, default=20, help="new samples per heartbeat and device")
    ap.add_argument("--devices", type=int, default=1)
    ap.add_argument("--rounds", type=int, default=400)
    ap.add_argument("--timeline-length", type=int, default=3600)
    args = ap.parse_args()

    rows = simulated(args)
    rows += asyncio.run(real_heartbeat(args))
    width = max(len(k) for k, _ in rows)
    try:
        commit = subprocess.run(
            ["git", "-C", str(Path(__file__).parent), "rev-parse", "--short", "HEAD"],
            capture_output=True,
            text=True,
            check=True,
        ).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        commit = "unknown"
    import distributed

    print(f"dask-rmm scheduler overhead: {args.workers} simulated workers")
    print(
        f"host {platform.node()} ({platform.machine()}, {os.cpu_count()} CPUs), "
        f"Python {platform.python_version()}, distributed {distributed.__version__}, "
        f"commit {commit}, load average {os.getloadavg()[0]:.1f} at the end"
    )
    print(f"{'measure':<{width}}  value")
    print(f"{'-' * width}  {'-' * 20}")
    for k, v in rows:
        print(f"{k:<{width}}  {v}")


if __name__ == "__main__":
    main()
