"""What dask-rmm's scheduler side costs at scale: simulated workers and devices fed through the
real SchedulerTimelinePlugin of a real in-process Scheduler, served by its real HTTP handlers.

Per size (workers x devices): the event loop's longest block (a 1 ms tick probe) and its own
time while serving the default /dask-rmm page, report.json (default, and with every timeline),
``dask rmm report`` one-shot and ``--watch`` (the CLI run as a process), a Prometheus scrape;
the plugin's time per worker heartbeat (heartbeats as distributed spaces them for that many
workers, 100 ms samples), the cluster-total upkeep, the memory the plugin keeps per device, and
the heartbeat payload per device.

    python bench/scheduler_overhead.py [--sizes 64x1,64x8,512x1,512x8,2000x1,2000x8]

Prints a table; numbers vary with the machine and its load (tests never assert on time).
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import os
import platform
import signal
import subprocess
import sys
import time
import tracemalloc
from pathlib import Path

import msgpack
import numpy as np

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from dask_rmm.scheduler.resolution import SAMPLE_DTYPE  # noqa: E402
from dask_rmm.wire import METRICS_KEY, PLUGIN_NAME, DeviceSample, TaskGroup, heartbeat  # noqa: E402

SAMPLE_INTERVAL = 0.1
_FETCH = (
    "import sys, time, urllib.request as u; t = time.perf_counter(); "
    "n = len(u.urlopen(sys.argv[1], timeout=600).read()); print(n, time.perf_counter() - t)"
)


def device_fields(device: int) -> dict:
    """One device's heartbeat fields as WorkerMetrics sends them (a pool, 10 task groups)."""
    return DeviceSample(
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
        gpu_uuid=f"GPU-{device:08d}-0000-0000-0000-000000000000",
        pci_bus_id="0000:01:00.0",
        task_groups=tuple(TaskGroup(f"group-{i}", i << 20, i << 21) for i in range(10)),
    ).to_dict()  # as the worker sends it: fields at their default left out


class Simulated:
    """``workers`` x ``devices`` simulated devices; each heartbeat carries the previous one's
    samples and ``per_beat`` new ones (100 ms apart), packed as WorkerMetrics packs them."""

    def __init__(self, workers: int, devices: int, per_beat: int, seed: int = 0):
        self.rng = np.random.default_rng(seed)
        self.per_beat = per_beat
        self.ws = []
        for i in range(workers):
            ws = type("SimulatedWorkerState", (), {})()
            ws.address, ws.name, ws.metrics = f"tcp://10.{i // 250}.{i % 250}.1:40000", f"w{i}", {}
            self.ws.append(ws)
        self.devices = [str(d) for d in range(devices)]
        self.fields = {d: device_fields(int(d)) for d in self.devices}
        # Heartbeats are spread over the interval: worker i is `phase` seconds behind.
        self.phase = self.rng.uniform(0, per_beat * SAMPLE_INTERVAL, workers)
        self.previous: dict = {}

    def blob(self, end: float, n: int) -> bytes:
        pts = np.empty(n, SAMPLE_DTYPE)
        pts["t"] = end - SAMPLE_INTERVAL * np.arange(n - 1, -1, -1)
        pts["c"] = self.rng.integers(1 << 29, 1 << 31, n)
        pts["m"] = pts["c"] + self.rng.integers(0, 1 << 28, n)
        return pts.tobytes()

    def heartbeat(self, i: int, now: float) -> dict:
        ws = self.ws[i]
        end = now - self.phase[i]
        devices = {}
        for d in self.devices:
            new = self.blob(end, self.per_beat)
            devices[d] = dict(self.fields[d], samples=self.previous.get((i, d), b"") + new)
            self.previous[i, d] = new
        return {METRICS_KEY: heartbeat(ws.name, end, devices)}


def prefill(plugin, sim: Simulated, points: int) -> None:
    """Full timelines (``points`` samples each, oldest hours ago) without the cluster total's
    history: what a scheduler holds after running a while."""
    now = time.time()
    for i, ws in enumerate(sim.ws):
        ws.metrics = sim.heartbeat(i, now - 1.0)
        plugin._ingest(ws)
        rec = plugin._records[ws.address]
        for d in sim.devices:
            old = sim.blob(now - 2.0 - sim.phase[i], points)
            tl = plugin._new_timeline()
            tl.extend(old)
            tl.extend(rec.timelines[d].points().tobytes())
            rec.timelines[d] = tl
    plugin._total.advance(time.time())


def steady(plugin, sim: Simulated, rounds: int) -> tuple[float, float, int]:
    """Rounds of one heartbeat per worker (a heartbeat interval), the poller's upkeep as often
    as it runs in that time (every TOTAL_INTERVAL): seconds in ``_ingest``, seconds in the
    cluster total's upkeep, heartbeats."""
    from dask_rmm.scheduler.timeline import TOTAL_INTERVAL

    ingest = upkeep = 0.0
    beats = 0
    n = len(sim.ws)
    every = max(1, int(n / max(1.0, sim.per_beat * SAMPLE_INTERVAL / TOTAL_INTERVAL)))
    for _ in range(rounds):
        now = time.time()
        heartbeats = [sim.heartbeat(i, now) for i in range(n)]
        # Made here all at once (a scheduler unpacks them one at a time as they arrive): kept
        # out of the collector's young generations, whose passes would count as the plugin's.
        gc.collect()
        gc.freeze()
        for i, ws in enumerate(sim.ws):
            ws.metrics = heartbeats[i]
            start = time.process_time()  # CPU time: less noisy than wall time on a shared host
            plugin._ingest(ws)
            ingest += time.process_time() - start
            beats += 1
            if i % every == 0:
                start = time.process_time()
                plugin._compact()
                plugin._total.advance(time.time())
                upkeep += time.process_time() - start
        gc.unfreeze()
    return ingest, upkeep, beats


def memory(workers: int, devices: int, per_beat: int, fill: int) -> tuple[int, int, int]:
    """Bytes a plugin (not attached to a scheduler) keeps for full timelines and two rounds of
    heartbeats, the heartbeat dicts themselves excluded; its points; and the devices measured
    (at most 256 workers': what is kept per device does not depend on how many there are, and
    tracemalloc is slow)."""
    workers = min(workers, 256)
    from types import SimpleNamespace

    from dask_rmm.scheduler import SchedulerTimelinePlugin

    plugin = SchedulerTimelinePlugin()
    plugin.scheduler = SimpleNamespace(workers={}, plugins={PLUGIN_NAME: plugin}, address="")
    plugin._configure()
    sim = Simulated(workers, devices, per_beat, seed=1)
    gc.collect()
    tracemalloc.start()
    before = tracemalloc.take_snapshot()
    prefill(plugin, sim, fill)
    steady(plugin, sim, 2)
    for ws in sim.ws:  # what the scheduler holds anyway, not the plugin
        ws.metrics = {}
    sim.previous.clear()
    gc.collect()
    after = tracemalloc.take_snapshot()
    tracemalloc.stop()
    # The heartbeat dicts (made here) are the scheduler's WorkerState.metrics, which the
    # plugin only refers to.
    here = [tracemalloc.Filter(False, __file__)]
    after, before = after.filter_traces(here), before.filter_traces(here)
    kept = sum(st.size_diff for st in after.compare_to(before, "filename"))
    points = sum(len(tl) for rec in plugin._records.values() for tl in rec.timelines.values())
    return kept, points, workers * devices


class TickProbe:
    """The event loop's longest time to come back to a 1 ms sleep."""

    def __init__(self) -> None:
        self.longest = 0.0

    async def run(self) -> None:
        while True:
            start = time.perf_counter()
            await asyncio.sleep(0.001)
            self.longest = max(self.longest, time.perf_counter() - start - 0.001)


async def probed(coro_fn, repeat: int = 3) -> tuple[float, float, object]:
    """(longest event-loop block, wall seconds, result) of the worst of ``repeat`` runs (what a
    user of the scheduler meets, not the best case)."""
    worst = None
    for _ in range(repeat):
        probe = TickProbe()
        task = asyncio.get_running_loop().create_task(probe.run())
        await asyncio.sleep(0.01)
        probe.longest = 0.0
        start = time.perf_counter()
        result = await coro_fn()
        wall = time.perf_counter() - start
        task.cancel()
        if worst is None or probe.longest > worst[0]:
            worst = (probe.longest, wall, result)
    return worst


def fmt_ms(seconds: float) -> str:
    return f"{seconds * 1e3:.1f} ms"


async def run_size(workers: int, devices: int, args) -> list[tuple[str, str]]:
    from distributed import Scheduler
    from distributed.scheduler import heartbeat_interval

    from dask_rmm.scheduler import SchedulerTimelinePlugin
    from dask_rmm.scheduler.report_build import ReportRequest

    interval = heartbeat_interval(workers)
    per_beat = max(1, round(interval / SAMPLE_INTERVAL))
    rows: list[tuple[str, str]] = []
    async with Scheduler(host="127.0.0.1", dashboard_address=":0", port=0) as s:
        await s.register_scheduler_plugin(SchedulerTimelinePlugin(), idempotent=True)
        plugin = s.plugins[PLUGIN_NAME]
        plugin._poller.stop()  # polled below, as the 0.1 s poller would
        sim = Simulated(workers, devices, per_beat)

        prefill(plugin, sim, args.fill)
        ingest, upkeep, beats = steady(plugin, sim, args.rounds)
        kept, points, measured = memory(workers, devices, per_beat, args.fill)
        rows += [
            (
                "heartbeat handling per worker heartbeat (CPU)",
                f"{ingest / beats * 1e6:.1f} us ({devices} dev x {per_beat} new samples, "
                f"heartbeat every {interval:g} s)",
            ),
            (
                "  + merging and cluster-total upkeep per heartbeat (CPU)",
                f"{upkeep / beats * 1e6:.1f} us (waiting samples now {plugin._total.waiting:,})",
            ),
            (
                "timeline memory per device",
                f"{kept / measured / 1024:.1f} KiB kept by the plugin (tracemalloc over "
                f"{measured} devices; the heartbeat dicts excluded); {points / measured:.0f} "
                f"points = {points * 24 / measured / 1024:.1f} KiB of samples",
            ),
        ]
        m0 = sim.ws[0].metrics[METRICS_KEY]
        rows.append(
            (
                "heartbeat payload per device",
                f"{len(msgpack.packb(m0, use_bin_type=True)) // len(m0['devices']):,} B (msgpack, "
                f"the whole heartbeat over its devices; samples {len(m0['samples'][0]):,} B)",
            )
        )
        gc.collect()

        base = f"http://127.0.0.1:{s.http_server.port}/"

        def fetch(path: str):
            # From another process: the client's own work must not count as the scheduler's.
            async def go():
                proc = await asyncio.create_subprocess_exec(
                    sys.executable, "-c", _FETCH, base + path, stdout=asyncio.subprocess.PIPE
                )
                out, _ = await proc.communicate()
                size, seconds = out.split()
                return int(size), float(seconds)

            return go

        def loop_time(request: ReportRequest) -> float:
            start = time.perf_counter()
            plugin.snapshot(request)
            return time.perf_counter() - start

        for label, path, request in (
            ("default /dask-rmm page", "dask-rmm", ReportRequest(top=50, width=640)),
            ("report.json (default)", "dask-rmm/report.json", ReportRequest(timeline=False)),
            (
                "report.json?timeline=1 (every point)",
                "dask-rmm/report.json?timeline=1",
                ReportRequest(timeline=True),
            ),
        ):
            if "timeline=1" in path and workers * devices > args.full_limit:
                rows.append((label, f"not run (> {args.full_limit} devices)"))
                continue
            block, _, (size, answer) = await probed(fetch(path), 1 if "timeline=1" in path else 3)
            rows.append(
                (
                    label,
                    f"longest loop block {fmt_ms(block)}, snapshot on the loop "
                    f"{fmt_ms(loop_time(request))}, answer {fmt_ms(answer)} ({size / 1e6:.1f} MB)",
                )
            )

        try:
            import prometheus_client  # noqa: F401
        except ImportError:
            rows.append(("Prometheus scrape", "prometheus_client not installed"))
        else:
            block, _, (size, answer) = await probed(fetch("metrics"))
            rows.append(
                (
                    "Prometheus scrape (/metrics)",
                    f"{fmt_ms(answer)}, longest loop block {fmt_ms(block)} ({size / 1e6:.2f} MB)",
                )
            )

        cli = [sys.executable, "-m", "dask_rmm.cli", "report", s.address, "--timeout", "300"]
        path = os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))
        env = dict(os.environ, PYTHONPATH=path)  # the GPU host's packages are on PYTHONPATH

        async def one_shot():
            proc = await asyncio.create_subprocess_exec(
                *cli, stdout=asyncio.subprocess.DEVNULL, env=env
            )
            assert await proc.wait() == 0

        block, wall, _ = await probed(one_shot, 2)
        rows.append(
            ("dask rmm report (one-shot)", f"{wall:.2f} s, longest loop block {fmt_ms(block)}")
        )

        async def watch():
            proc = await asyncio.create_subprocess_exec(
                *cli, "--watch", "1", stdout=asyncio.subprocess.PIPE, env=env
            )
            seen = 0
            while seen < 3:
                line = await proc.stdout.readline()
                assert line, "dask rmm report --watch ended"
                seen += line.startswith(b"total (")
            proc.send_signal(signal.SIGINT)
            await proc.wait()

        block, wall, _ = await probed(watch, 1)
        rows.append(
            (
                "dask rmm report --watch 1 (3 refreshes)",
                f"{wall:.2f} s, longest loop block {fmt_ms(block)}",
            )
        )
    return rows


def git_commit() -> str:
    """The checkout's short commit, or "unknown" (a copy without git, as on the GPU host)."""
    try:
        return subprocess.run(
            ["git", "-C", str(ROOT), "rev-parse", "--short", "HEAD"],
            capture_output=True, text=True, check=True,
        ).stdout.strip()  # fmt: skip
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


def print_sizes(args: argparse.Namespace, run_size) -> None:
    """Run ``run_size(workers, devices, args)`` for each ``WxD`` of ``args.sizes`` and print
    its rows as a table, with the load average at its start."""
    for size in args.sizes.split(","):
        workers, devices = map(int, size.split("x"))
        load = os.getloadavg()[0]
        rows = asyncio.run(run_size(workers, devices, args))
        print(f"\n{workers} workers x {devices} devices (load average {load:.1f} at the start)")
        width = max(len(k) for k, _ in rows)
        for k, v in rows:
            print(f"  {k:<{width}}  {v}")
        sys.stdout.flush()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--sizes", default="64x1,64x8,512x1,512x8,2000x1,2000x8")
    ap.add_argument("--rounds", type=int, default=3, help="heartbeats per worker timed")
    ap.add_argument("--fill", type=int, default=4096, help="samples per device before timing")
    ap.add_argument(
        "--full-limit", type=int, default=4096, help="most devices for the every-point JSON"
    )
    args = ap.parse_args()
    commit = git_commit()
    import distributed

    print(
        f"dask-rmm scheduler at scale: host {platform.node()} ({platform.machine()}, "
        f"{os.cpu_count()} CPUs), Python {platform.python_version()}, distributed "
        f"{distributed.__version__}, commit {commit}"
    )
    print_sizes(args, run_size)


if __name__ == "__main__":
    main()
