"""What each route costs the scheduler's event loop at scale: a real ``distributed.Scheduler``
with simulated workers heartbeating through its real handler (``bench/scheduler_real.py``'s
cluster) and timelines of ``--length`` points, then ``--rounds`` rounds, each fetching every
route once from another process (``/metrics``, ``/dask-rmm``, ``report.json``,
``/dask-rmm/metrics``, ``dask rmm report``) and then ``--burst`` fetches of every route at once.

Per route: the event loop's worst block (a 1 ms tick probe) of each round, printed as the median
and range over the rounds, and the loop callbacks that took longer than 20 ms (``--why``: asyncio
debug mode names each; a long block with no long callback is another thread holding the GIL).

    python bench/scrape_cost.py [--sizes 2000x8,10000x1] [--length 3600] [--rounds 5]
        [--burst 4] [--why] [--json FILE]

Run it once per tree and alternate the trees for before/after (``bench/README.md``). Numbers
vary with the machine and its load (tests never assert on time).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import os
import platform
import statistics
import sys
import threading
import time
from collections import Counter
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from bench.scheduler_overhead import _FETCH, git_commit  # noqa: E402
from bench.scheduler_real import Cluster, TickProbe, base_metrics  # noqa: E402
from dask_rmm.wire import PLUGIN_NAME  # noqa: E402

ROUTES = ("metrics", "dask-rmm", "dask-rmm/report.json", "dask-rmm/metrics", "cli")


class SlowCallbacks(logging.Handler):
    """asyncio's debug-mode lines "Executing <callback> took N seconds", kept."""

    def __init__(self) -> None:
        super().__init__()
        self.lines: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        text = record.getMessage()
        if text.startswith("Executing"):
            self.lines.append(text[:200])


#: Innermost functions of a thread that waits (holds no GIL).
IDLE = {"_worker", "_do_waitpid", "wait", "select", "_run", "sleep"}


class BlockSampler:
    """Every 2 ms, while the event loop has not come back to the tick probe for 15 ms, the
    innermost frames of every thread, counted (where a block's time goes)."""

    def __init__(self, probe: TickProbe) -> None:
        self.probe = probe
        self.counts: Counter = Counter()
        self.loop_thread = threading.get_ident()
        self.last = time.perf_counter()
        self.stopped = False
        threading.Thread(target=self._run, daemon=True).start()

    def _run(self) -> None:
        while not self.stopped:
            time.sleep(0.002)
            if time.perf_counter() - self.last < 0.015:
                continue
            for ident, frame in sys._current_frames().items():
                if ident == threading.get_ident():
                    continue
                stack = []
                while frame is not None and len(stack) < 4:
                    code = frame.f_code
                    stack.append(f"{Path(code.co_filename).name}:{frame.f_lineno}:{code.co_name}")
                    frame = frame.f_back
                who = "loop" if ident == self.loop_thread else "other"
                if who == "other" and stack and stack[0].split(":")[2] in IDLE:
                    continue
                self.counts[who + " " + " < ".join(stack)] += 1


async def run_size(workers: int, devices: int, args) -> dict:
    from distributed import Scheduler

    from dask_rmm.scheduler import SchedulerTimelinePlugin

    base = await base_metrics()
    out: dict = {"size": f"{workers}x{devices}", "routes": {r: [] for r in ROUTES}}
    async with Scheduler(host="127.0.0.1", dashboard_address=":0", port=0) as s:
        await s.register_scheduler_plugin(
            SchedulerTimelinePlugin(timeline_length=args.length), idempotent=True
        )
        plugin = s.plugins[PLUGIN_NAME]
        cluster = Cluster(s, workers, devices, base)
        await cluster.add_all()
        await cluster.fill_history(plugin, args.length)
        probe = TickProbe()
        sampler = BlockSampler(probe) if args.profile else None

        async def beat() -> None:
            while sampler is not None:
                sampler.last = time.perf_counter()
                await asyncio.sleep(0.001)

        asyncio.get_running_loop().create_task(beat())
        stop = asyncio.Event()
        driver = asyncio.get_running_loop().create_task(cluster.drive(stop))
        await asyncio.sleep(2)
        slow = SlowCallbacks()
        if args.why:
            loop = asyncio.get_running_loop()
            loop.set_debug(True)
            loop.slow_callback_duration = 0.02
            logging.getLogger("asyncio").addHandler(slow)
        url = f"http://127.0.0.1:{s.http_server.port}/"
        env = dict(
            os.environ,
            PYTHONPATH=os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])),
        )

        async def fetch(route: str) -> int:
            if route == "cli":
                cmd = ["-m", "dask_rmm.cli", "report", s.address, "--timeout", "300"]
            else:
                cmd = ["-c", _FETCH, url + route]
            proc = await asyncio.create_subprocess_exec(
                sys.executable, *cmd, stdout=asyncio.subprocess.PIPE, env=env,
                stderr=asyncio.subprocess.DEVNULL,
            )  # fmt: skip
            body, _ = await proc.communicate()
            if proc.returncode:
                return -1
            return len(body) if route == "cli" else int(body.split()[0])

        async def timed(routes: list[str]) -> tuple[float, list[str], list[int]]:
            await asyncio.sleep(0.3)
            probe.worst, probe.blocks = 0.0, []
            slow.lines.clear()
            if sampler is not None:
                sampler.counts.clear()
            sizes = await asyncio.gather(*(fetch(r) for r in routes))
            why = list(slow.lines)
            if sampler is not None:
                why += [f"{n} x {stack}" for stack, n in sampler.counts.most_common(6)]
            return probe.worst, why, list(sizes)

        burst = out["burst"] = []
        for _ in range(args.rounds):
            for route in ROUTES:
                worst, why, (size,) = await timed([route])
                out["routes"][route].append({"ms": worst * 1e3, "why": why, "bytes": size})
            if args.burst:
                worst, why, sizes = await timed([r for r in ROUTES for _ in range(args.burst)])
                burst.append({"ms": worst * 1e3, "why": why, "bytes": sizes})
        probe.worst, probe.blocks = 0.0, []
        await asyncio.sleep(3)
        out["heartbeats only"] = [{"ms": probe.worst * 1e3, "why": list(slow.lines)}]
        stop.set()
        if sampler is not None:
            sampler.stopped = True
        await driver
        probe.task.cancel()
    for comm in cluster.comms:
        comm.end()
    await asyncio.gather(*cluster.handlers)
    return out


def summary(runs: list[dict]) -> str:
    ms = [r["ms"] for r in runs]
    if not ms:
        return "-"
    return f"{statistics.median(ms):.0f} ms ({min(ms):.0f}-{max(ms):.0f})"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--sizes", default="2000x8,10000x1")
    ap.add_argument("--length", type=int, default=3600, help="timeline points per device")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--burst", type=int, default=4, help="fetches of each route at once")
    ap.add_argument("--why", action="store_true", help="name loop callbacks over 20 ms")
    ap.add_argument("--profile", action="store_true", help="sample the stacks during blocks")
    ap.add_argument("--json", help="write every figure here")
    ap.add_argument("--switch", type=float, help="sys.setswitchinterval for the whole run")
    args = ap.parse_args()
    if args.switch:
        sys.setswitchinterval(args.switch)
    logging.getLogger("distributed").setLevel(logging.ERROR)
    import distributed

    print(
        f"scrape cost: host {platform.node()} ({os.cpu_count()} CPUs), Python "
        f"{platform.python_version()}, distributed {distributed.__version__}, commit "
        f"{git_commit()}, {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}, load "
        f"{os.getloadavg()[0]:.1f}"
    )
    results = []
    for size in args.sizes.split(","):
        workers, devices = map(int, size.split("x"))
        res = asyncio.run(run_size(workers, devices, args))
        results.append(res)
        print(f"{size}: worst loop block per round, median (range) of {args.rounds}")
        for route, runs in [*res["routes"].items(), ("burst", res["burst"])]:
            mb = max([r["bytes"] if isinstance(r["bytes"], int) else 0 for r in runs] or [0])
            print(f"  {route:<22} {summary(runs):<22} {mb / 1e6:.1f} MB")
            for r in runs:
                for line in r["why"]:
                    print(f"      {line}")
        print(f"  {'heartbeats only':<22} {summary(res['heartbeats only'])}")
        sys.stdout.flush()
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
