"""What one heartbeat costs the scheduler, with and without dask-rmm: distributed's real
``heartbeat_worker`` handler of a real in-process ``Scheduler`` (workers added through its
``register-worker`` handler), fed a real dask-rmm metrics payload (``DeviceSample.to_dict()``
fields, 10 task groups, packed samples: the previous heartbeat's and this one's, 100 ms apart, as
msgpack delivers it) from N workers x D devices at distributed's rate for N workers, with the
plugin's own poller running (timelines full before timing).

Two schedulers in one process, one with dask-rmm's plugin and one without (the same heartbeats
less the ``dask-rmm`` entry), timed in interleaved rounds of one heartbeat interval each.
Scheduler CPU per heartbeat (``time.thread_time`` of the loop's thread): the handler, plus, with
dask-rmm, every poll of the plugin in that round (reads, bounds, timelines, cluster total);
also msgpack's decode of the heartbeat message, which distributed's comm does on the loop, and
young-generation collections. Medians over the rounds, [min-max] beside them.

    python bench/scheduler_heartbeat.py [--sizes 300x8,300x1] [--rounds 5] [--profile]

Numbers vary with the machine and its load (tests never assert on time).
"""

from __future__ import annotations

import argparse
import asyncio
import cProfile
import gc
import os
import platform
import pstats
import statistics
import sys
import time
from pathlib import Path

import msgpack

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from bench.scheduler_overhead import SAMPLE_INTERVAL, git_commit  # noqa: E402
from bench.scheduler_real import Cluster, base_metrics  # noqa: E402
from dask_rmm.wire import METRICS_KEY, PLUGIN_NAME, heartbeat  # noqa: E402


class Timed:
    """One scheduler's heartbeats, timed: its handler, its plugin's polls (if any)."""

    def __init__(self, s, cluster: Cluster, with_rmm: bool) -> None:
        self.s, self.cluster, self.with_rmm = s, cluster, with_rmm
        self.plugin = s.plugins.get(PLUGIN_NAME)
        self.handler = s.handlers["heartbeat_worker"]
        self.cpu = {"handler": 0.0, "poll": 0.0, "decode": 0.0}
        self.timing = False
        self.profile: cProfile.Profile | None = None
        if self.plugin is not None:
            poll = self.plugin.poll

            def timed_poll(every: bool = True) -> bool:
                if not self.timing:
                    return poll(every)
                start = time.thread_time()
                if self.profile is not None:
                    self.profile.enable()
                try:
                    return poll(every)
                finally:
                    if self.profile is not None:
                        self.profile.disable()
                    self.cpu["poll"] += time.thread_time() - start

            self.plugin.poll = timed_poll

    def message(self, i: int, now: float) -> bytes:
        """Worker i's heartbeat message as the comm receives it (msgpack bytes)."""
        c = self.cluster
        metrics = dict(c.base)
        if self.with_rmm:
            new = c.samples(now, c.per_beat)
            devices = {
                d: dict(c.fields[d], samples=c.previous.get(i, b"") + new) for d in c.devices
            }
            c.previous[i] = new
            metrics[METRICS_KEY] = heartbeat(f"w{i}", now, devices)
        return msgpack.packb({"address": c.addresses[i], "metrics": metrics}, use_bin_type=True)

    def beat(self, i: int, now: float) -> None:
        raw = self.message(i, now)
        start = time.thread_time()
        msg = msgpack.unpackb(raw, use_list=False)
        decoded = time.thread_time()
        self.handler(**msg)
        if self.timing:
            self.cpu["decode"] += decoded - start
            self.cpu["handler"] += time.thread_time() - decoded

    async def round(self, profile: cProfile.Profile | None) -> dict[str, float]:
        """Every worker's heartbeat once, spread over one heartbeat interval (10 ms steps)."""
        c = self.cluster
        n = len(c.addresses)
        self.cpu = dict.fromkeys(self.cpu, 0.0)
        self.timing, self.profile = True, profile
        young = [0]
        collecting = [0.0, 0.0]  # when the collection in progress started, collections' time

        def count(phase: str, info: dict) -> None:
            young[0] += phase == "start" and info["generation"] == 0
            if phase == "start":
                collecting[0] = time.thread_time()
            else:
                collecting[1] += time.thread_time() - collecting[0]

        gc.callbacks.append(count)
        steps = max(1, round(c.interval / 0.01))
        i = 0
        for step in range(steps):
            now = time.time()
            while i < n * (step + 1) // steps:
                self.beat(i, now)
                i += 1
            await asyncio.sleep(0.01)
        if self.plugin is not None:
            self.plugin.poll()  # what the poller had not read yet: this round's work
        gc.callbacks.remove(count)
        self.timing, self.profile = False, None
        out = {k: v / n * 1e6 for k, v in self.cpu.items()}
        out["young"] = young[0]
        out["gc"] = collecting[1] / n * 1e6
        return out


async def run_size(workers: int, devices: int, args) -> None:
    from distributed import Scheduler

    from dask_rmm.scheduler import SchedulerTimelinePlugin

    base = await base_metrics()
    async with (
        Scheduler(host="127.0.0.1", dashboard_address=":0", port=0) as with_s,
        Scheduler(host="127.0.0.1", dashboard_address=":0", port=0) as without_s,
    ):
        await with_s.register_scheduler_plugin(SchedulerTimelinePlugin(), idempotent=True)
        sides = []
        for s, with_rmm in ((with_s, True), (without_s, False)):
            cluster = Cluster(s, workers, devices, base)
            await cluster.add_all()
            sides.append(Timed(s, cluster, with_rmm))
        # Fill the timelines: enough heartbeats, as fast as the clock allows, that every
        # device's timeline is full (compacting, as in a steady state) before timing.
        with_side = sides[0]
        c = with_side.cluster
        fill = max(2, with_side.plugin.timeline_length // c.per_beat + 2)
        start = time.time() - fill * c.interval
        for k in range(fill):
            for i in range(workers):
                with_side.beat(i, start + k * c.interval)
            with_side.plugin.poll()
        gc.collect()
        profile = cProfile.Profile() if args.profile else None
        results: dict[bool, list[dict]] = {True: [], False: []}
        for r in range(args.rounds):
            for side in sides if r % 2 == 0 else sides[::-1]:
                got = await side.round(profile if side.with_rmm else None)
                results[side.with_rmm].append(got)
    for side in sides:  # the schedulers are closed: they remove no worker now
        for comm in side.cluster.comms:
            comm.end()
        await asyncio.gather(*side.cluster.handlers)
    print(
        f"\n{workers} workers x {devices} devices: {args.rounds} rounds, heartbeat every "
        f"{c.interval:g} s, {c.per_beat} new samples a device (load average "
        f"{os.getloadavg()[0]:.1f} at the end)"
    )
    rows = [
        ("handler (heartbeat_worker)", "handler"),
        ("dask-rmm's polls", "poll"),
        ("msgpack decode of the message", "decode"),
        ("young collections per round", "young"),
        ("garbage collection (in the above)", "gc"),
    ]
    print(f"  {'us per heartbeat':<32}{'with dask-rmm':>24}{'without':>24}")
    for label, key in rows:
        cells = [_cell([x[key] for x in results[w]]) for w in (True, False)]
        print(f"  {label:<32}{cells[0]:>24}{cells[1]:>24}")
    totals = {w: [x["handler"] + x["poll"] for x in results[w]] for w in (True, False)}
    extra = [a - b for a, b in zip(totals[True], totals[False], strict=True)]
    print(f"  {'handler + polls':<32}{_cell(totals[True]):>24}{_cell(totals[False]):>24}")
    target = 20 + 10 * (devices - 1)
    print(f"  dask-rmm's cost (with - without, per round): {_cell(extra)} us; target {target} us")
    every = {w: [x["handler"] + x["poll"] + x["decode"] for x in results[w]] for w in (True, False)}
    extra = [a - b for a, b in zip(every[True], every[False], strict=True)]
    print(f"  the same with the decode: {_cell(extra)} us")
    if profile is not None:
        pstats.Stats(profile).sort_stats("tottime").print_stats(25)


def _cell(values: list[float]) -> str:
    return f"{statistics.median(values):.1f} [{min(values):.1f}-{max(values):.1f}]"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--sizes", default="300x8,300x1")
    ap.add_argument("--rounds", type=int, default=5, help="rounds of each side, interleaved")
    ap.add_argument("--profile", action="store_true", help="cProfile dask-rmm's polls")
    ap.add_argument(
        "--without-checks",
        action="store_true",
        help="UNSAFE, to measure: heartbeats taken without validate.check_metrics (what the "
        "rest of the poll costs)",
    )
    args = ap.parse_args()
    if args.without_checks:
        from dask_rmm.scheduler import timeline, validate

        def unchecked(m, now, arrived=None):
            blobs = zip(m["devices"], m["samples"], strict=True)
            samples = {d: blob for d, blob in blobs if blob}
            return validate.Checked({**m, "time": m.get("time") or now}, samples, [])

        timeline.check_metrics = unchecked
    import logging

    import distributed

    logging.getLogger("distributed").setLevel(logging.ERROR)  # a line per simulated worker
    print(
        f"dask-rmm heartbeat cost: host {platform.node()} ({os.cpu_count()} CPUs), Python "
        f"{platform.python_version()}, distributed {distributed.__version__}, commit "
        f"{git_commit()}, {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}; samples every "
        f"{SAMPLE_INTERVAL} s"
    )
    for size in args.sizes.split(","):
        workers, devices = map(int, size.split("x"))
        asyncio.run(run_size(workers, devices, args))


if __name__ == "__main__":
    main()
