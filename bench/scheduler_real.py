"""dask-rmm's scheduler side at scale on a real ``distributed.Scheduler``: simulated workers added
through the scheduler's real ``add_worker`` handler, heartbeats (as distributed's comm delivers
them: through msgpack, sequences as tuples) through its real ``heartbeat_worker`` handler at the
rate distributed spaces them for that many workers, the plugin's own 0.1 s poller running,
timelines of ``--length`` points filled before timing.

Reported per size (workers x devices), the worst over every repetition (never the best):

- the event loop's worst block (a 1 ms tick probe) while heartbeats arrive, and while each of
  /dask-rmm, /dask-rmm/report.json, /metrics (Prometheus) and ``dask rmm report`` is served to
  another process;
- dask-rmm's CPU per heartbeat (everything the plugin does on the loop: reads, checks, timelines,
  cluster total; ``time.thread_time`` of the loop's thread) and the poller's share of the loop;
- what the plugin keeps per device (timeline points, cluster-total samples waiting) and the
  process's resident memory per device.

    python bench/scheduler_real.py [--sizes 2000x8,10000x1] [--length 3600] [--seconds 20]
        [--repeat 3] [--no-routes] [--hostile 100000]

``--hostile N``: worker 0 sends N entries in each list and map of its first device (libraries,
expected peaks, task groups, a map no reader knows), every heartbeat.

Numbers vary with the machine and its load (tests never assert on time).
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import os
import platform
import sys
import time
from pathlib import Path

import msgpack
import numpy as np

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from bench.scheduler_overhead import (  # noqa: E402
    _FETCH,
    SAMPLE_INTERVAL,
    device_fields,
    git_commit,
    print_sizes,
)
from dask_rmm.scheduler.resolution import SAMPLE_DTYPE  # noqa: E402
from dask_rmm.wire import METRICS_KEY, PLUGIN_NAME, ROW_FIELDS, heartbeat  # noqa: E402


class IdleComm:
    """The comm ``add_worker`` keeps for a worker's stream: never a message, writes dropped.
    Its read ends (as a closed comm's) only on :meth:`end`, which the bench calls once the
    scheduler has closed: ending the reads of a running scheduler would remove the workers one
    at a time, and distributed tells each remaining worker of each removal (n**2 / 2 messages,
    50 M at 10,000 workers, more than this host's memory)."""

    name = "bench"
    peer_address = local_address = "tcp://127.0.0.1:0"

    def __init__(self) -> None:
        self._ended = asyncio.Event()
        self._closed = False

    async def read(self, deserializers=None):
        from distributed.comm.core import CommClosedError

        del deserializers
        await self._ended.wait()
        raise CommClosedError("the bench ended")

    def end(self) -> None:
        self._ended.set()

    async def write(self, msg, serializers=None, on_error=None) -> int:
        del serializers, on_error  # distributed passes them by name; nothing is written
        return 0

    def closed(self) -> bool:
        return self._closed

    def abort(self) -> None:
        self._closed = True

    async def close(self) -> None:
        self._closed = True


class TickProbe:
    """The event loop's worst lateness coming back to a 1 ms sleep, since the last reset."""

    def __init__(self) -> None:
        self.worst = 0.0
        self.blocks: list[float] = []  # every lateness, for percentiles
        self.task = asyncio.get_running_loop().create_task(self._run())

    async def _run(self) -> None:
        while True:
            start = time.perf_counter()
            await asyncio.sleep(0.001)
            late = time.perf_counter() - start - 0.001
            self.worst = max(self.worst, late)
            self.blocks.append(late)


class Cluster:
    """``workers`` x ``devices`` simulated dask-rmm workers on scheduler ``s``."""

    def __init__(self, s, workers: int, devices: int, base_metrics: dict) -> None:
        from distributed.scheduler import heartbeat_interval

        self.s = s
        self.addresses = [f"tcp://10.{i // 250}.{i % 250}.1:40000" for i in range(workers)]
        self.devices = [str(d) for d in range(devices)]
        self.fields = {d: device_fields(int(d)) for d in self.devices}
        self.base = base_metrics
        self.interval = heartbeat_interval(workers)
        self.per_beat = max(1, round(self.interval / SAMPLE_INTERVAL))
        rng = np.random.default_rng(0)
        self.template = np.empty(self.per_beat, SAMPLE_DTYPE)
        self.template["c"] = rng.integers(1 << 29, 1 << 31, self.per_beat)
        self.template["m"] = self.template["c"] + rng.integers(0, 1 << 28, self.per_beat)
        self.previous: dict[int, bytes] = {}
        self.sent = 0
        self.comms: list[IdleComm] = []
        self.handlers: list[asyncio.Task] = []  # asyncio keeps only weak references
        self.hostile = 0

    async def add_all(self) -> None:
        from distributed.versions import get_versions

        versions = get_versions()
        handler = self.s.handlers["register-worker"]
        for i, address in enumerate(self.addresses):
            self.comms.append(IdleComm())
            task = asyncio.get_running_loop().create_task(
                handler(
                    self.comms[-1], address=address, status="running", server_id=f"bench-{i}",
                    nthreads=1, name=f"w{i}", now=time.time(), resources={},
                    memory_limit=0, metrics=dict(self.base), services={},
                    local_directory="/tmp", versions=versions, nanny="", extra={},
                    stimulus_id=f"bench-add-{i}",
                )
            )  # fmt: skip
            self.handlers.append(task)
            if i % 100 == 99:
                await asyncio.sleep(0)
        while len(self.s.workers) < len(self.addresses):
            await asyncio.sleep(0.05)

    def samples(self, end: float, n: int) -> bytes:
        pts = np.resize(self.template, n)
        pts["t"] = end - SAMPLE_INTERVAL * np.arange(n - 1, -1, -1)
        return pts.tobytes()

    def beat(self, i: int, now: float, fill: int = 0) -> None:
        """Worker i's heartbeat through the scheduler's handler (with ``fill`` old samples)."""
        new = self.samples(now, self.per_beat) if not fill else self.samples(now - 1, fill)
        devices = {
            d: dict(self.fields[d], samples=self.previous.get(i, b"") + new) for d in self.devices
        }
        self.previous[i] = new if not fill else b""
        metrics = dict(self.base)
        # As distributed's comm delivers it (msgpack, sequences as tuples).
        metrics[METRICS_KEY] = msgpack.unpackb(
            msgpack.packb(heartbeat(f"w{i}", now, devices), use_bin_type=True), use_list=False
        )
        if i == 0 and self.hostile:  # made once, as msgpack delivers it: the bench's own
            metrics[METRICS_KEY] = {**metrics[METRICS_KEY], **self.hostile_columns()}
        self.s.handlers["heartbeat_worker"](address=self.addresses[i], metrics=metrics)
        self.sent += 1

    def hostile_fields(self) -> dict:
        """``hostile`` entries in each list and map of a device (libraries, expected peaks, task
        groups, a map no reader knows), made once."""
        if not hasattr(self, "_hostile"):
            n = self.hostile
            self._hostile = {
                "libraries": tuple((f"lib{k}", k, 0, 0) for k in range(n)),
                "admission_expected_peaks": tuple((f"p{k}", k, 1) for k in range(n)),
                "task_groups": tuple((f"g{k}", k, k) for k in range(n)),
                "future_map": {f"k{k}": k for k in range(n)},
            }
        return self._hostile

    def hostile_columns(self) -> dict:
        """The heartbeat columns of :meth:`hostile_fields` on device "0" (rows and ``other``),
        packed as a worker packs them, once."""
        if not hasattr(self, "_hostile_columns"):
            on = {d: self.hostile_fields() if d == "0" else {} for d in self.devices}
            packed = msgpack.packb(heartbeat("w0", 0.0, on), use_bin_type=True)
            columns = msgpack.unpackb(packed, use_list=False)
            self._hostile_columns = {k: columns[k] for k in (*ROW_FIELDS, "other") if k in columns}
        return self._hostile_columns

    async def drive(self, stop: asyncio.Event) -> None:
        """Heartbeats at distributed's rate (every worker once per interval), in 10 ms steps."""
        n = len(self.addresses)
        rate = n / self.interval
        due = 0.0
        i = 0
        while not stop.is_set():
            due += rate * 0.01
            now = time.time()
            while due >= 1:
                self.beat(i % n, now)
                i += 1
                due -= 1
            await asyncio.sleep(0.01)

    async def fill_history(self, plugin, length: float) -> None:
        """One heartbeat from every worker, then ``length`` seconds of samples in every
        timeline (what a scheduler holds after an hour), put in place directly: an hour of
        samples of every device summed at once would be no steady state."""
        now = time.time()
        for i in range(len(self.addresses)):
            self.beat(i, now - self.interval)
            if i % 200 == 199:
                await asyncio.sleep(0)
        plugin.poll()
        for rec in plugin._records.values():
            for dev, tl in rec.timelines.items():
                full = plugin._new_timeline()
                full.extend(self.samples(tl.points()["t"][0] - 1, length))
                full.extend(tl.points().tobytes())
                rec.timelines[dev] = full
        plugin._compact()
        gc.collect()


async def base_metrics() -> dict:
    """A real worker's heartbeat metrics (distributed's part), dask-rmm's added per beat."""
    from distributed import Scheduler, Worker

    async with Scheduler(host="127.0.0.1", dashboard_address=":0", port=0) as s:
        async with Worker(s.address, nthreads=1) as w:
            metrics = await w.get_metrics()
    metrics.pop(METRICS_KEY, None)
    return metrics


def rss() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


async def run_size(workers: int, devices: int, args) -> list[tuple[str, str]]:
    from distributed import Scheduler

    from dask_rmm.scheduler import SchedulerTimelinePlugin

    base = await base_metrics()
    rows: list[tuple[str, str]] = []
    gc.collect()
    start_rss = rss()
    async with Scheduler(host="127.0.0.1", dashboard_address=":0", port=0) as s:
        await s.register_scheduler_plugin(
            SchedulerTimelinePlugin(timeline_length=args.length), idempotent=True
        )
        plugin = s.plugins[PLUGIN_NAME]
        cluster = Cluster(s, workers, devices, base)
        cluster.hostile = args.hostile
        t0 = time.perf_counter()
        await cluster.add_all()
        added = time.perf_counter() - t0
        await cluster.fill_history(plugin, args.length)

        # dask-rmm's time on the loop: every call of the plugin's poll (the poller's reads,
        # checks, timelines and cluster total), on the loop's own thread.
        spent = {"tick": 0.0, "other": 0.0, "ticks": 0}
        poll = plugin.poll

        def timed_poll(every: bool = True) -> bool:
            start = time.thread_time()
            try:
                return poll(every)
            finally:
                spent["other" if every else "tick"] += time.thread_time() - start
                spent["ticks"] += not every

        plugin.poll = timed_poll
        young = [0]

        def count_young(phase: str, info: dict) -> None:
            young[0] += phase == "start" and info["generation"] == 0

        gc.callbacks.append(count_young)
        probe = TickProbe()
        stop = asyncio.Event()
        driver = asyncio.get_running_loop().create_task(cluster.drive(stop))
        await asyncio.sleep(2)  # the first round of heartbeats replaces the fill
        spent.update(tick=0.0, other=0.0, ticks=0)
        sent, wall = cluster.sent, time.perf_counter()
        probe.worst = 0.0
        young[0] = 0
        await asyncio.sleep(args.seconds)
        wall = time.perf_counter() - wall
        beats = cluster.sent - sent
        young_per_minute = young[0] / wall * 60
        rows.append(
            (
                "heartbeats only",
                f"worst loop block {probe.worst * 1e3:.1f} ms over {args.seconds:g} s "
                f"({beats} heartbeats, {devices} dev x {cluster.per_beat} new samples each, "
                f"every {cluster.interval:g} s a worker)",
            )
        )
        rows.append(
            (
                "dask-rmm CPU per heartbeat",
                f"{spent['tick'] / max(1, beats) * 1e6:.1f} us (the poller's; "
                f"{spent['ticks']} ticks)",
            )
        )
        rows.append(("poller share of the loop", f"{spent['tick'] / wall * 100:.2f} %"))
        rows.append(("young-generation collections", f"{young_per_minute:.0f} a minute"))

        if not args.no_routes:
            url = f"http://127.0.0.1:{s.http_server.port}/"
            env = dict(
                os.environ,
                PYTHONPATH=os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])),
            )

            async def fetch(path: str) -> tuple[int, float]:
                proc = await asyncio.create_subprocess_exec(
                    sys.executable, "-c", _FETCH, url + path, stdout=asyncio.subprocess.PIPE,
                    stderr=asyncio.subprocess.DEVNULL,
                )  # fmt: skip
                out, _ = await proc.communicate()
                if proc.returncode:  # a route this version has not
                    return 0, float("nan")
                size, seconds = out.split()
                return int(size), float(seconds)

            async def cli() -> tuple[int, float]:
                start = time.perf_counter()
                proc = await asyncio.create_subprocess_exec(
                    sys.executable, "-m", "dask_rmm.cli", "report", s.address, "--timeout", "300",
                    stdout=asyncio.subprocess.PIPE, env=env,
                )  # fmt: skip
                out, _ = await proc.communicate()
                assert proc.returncode == 0
                return len(out), time.perf_counter() - start

            for label, run in (
                ("/dask-rmm (default page)", lambda: fetch("dask-rmm")),
                ("/dask-rmm/report.json", lambda: fetch("dask-rmm/report.json")),
                ("/metrics (Prometheus)", lambda: fetch("metrics")),
                ("/dask-rmm/metrics (every device)", lambda: fetch("dask-rmm/metrics")),
                ("dask rmm report (CLI)", cli),
            ):
                worst = answer = 0.0
                size = 0
                blocks = []
                for _ in range(args.repeat):
                    await asyncio.sleep(0.2)
                    probe.worst, probe.blocks = 0.0, []
                    size, seconds = await run()
                    worst, answer = max(worst, probe.worst), max(answer, seconds)
                    blocks += probe.blocks
                p99 = float(np.percentile(blocks, 99)) if blocks else 0.0
                rows.append(
                    (
                        label,
                        f"worst loop block {worst * 1e3:.1f} ms, p99 {p99 * 1e3:.1f} ms (of "
                        f"{args.repeat}), slowest answer {answer:.2f} s, {size / 1e6:.2f} MB",
                    )
                )
            collector = plugin._collector
            if collector is not None:  # dask-rmm's part of /metrics, on the loop
                worst = 0.0
                for _ in range(args.repeat):
                    start = time.perf_counter()
                    list(collector.collect())
                    worst = max(worst, time.perf_counter() - start)
                rows.append(
                    ("dask-rmm's Prometheus collector alone", f"{worst * 1e3:.1f} ms worst")
                )
        stop.set()
        await driver
        probe.task.cancel()
        gc.callbacks.remove(count_young)
        points = sum(len(tl) for r in plugin._records.values() for tl in r.timelines.values())
        n = workers * devices
        rows.append(
            (
                "kept per device",
                f"{points / n:.0f} points ({points * 24 / n / 1024:.1f} KiB; bound "
                f"{args.length}); cluster total waiting {plugin._total.waiting:,} samples",
            )
        )
        rows.append(
            (
                "process memory per device",
                f"{(rss() - start_rss) / n / 1024:.1f} KiB resident (the scheduler's own "
                "worker state and last heartbeats included)",
            )
        )
        rows.append(("adding the workers", f"{added:.1f} s"))
    for comm in cluster.comms:  # the scheduler is closed: it removes no worker now
        comm.end()
    await asyncio.gather(*cluster.handlers)
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--sizes", default="2000x8,10000x1")
    ap.add_argument("--length", type=int, default=3600, help="timeline points per device")
    ap.add_argument("--seconds", type=float, default=20.0, help="seconds of heartbeats timed")
    ap.add_argument("--repeat", type=int, default=3, help="fetches of each route")
    ap.add_argument("--no-routes", action="store_true", help="heartbeats only: fetch no route")
    ap.add_argument(
        "--hostile", type=int, default=0, help="entries in each list of one worker's heartbeat"
    )
    args = ap.parse_args()
    import logging

    logging.getLogger("distributed").setLevel(logging.ERROR)  # a line per simulated worker
    commit = git_commit()
    import distributed

    print(
        f"dask-rmm scheduler, real Scheduler: host {platform.node()} ({os.cpu_count()} CPUs), "
        f"Python {platform.python_version()}, distributed {distributed.__version__}, "
        f"commit {commit}, {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}"
    )
    print_sizes(args, run_size)


if __name__ == "__main__":
    main()
