"""Time reading, summarizing and replaying a large RMM allocation log.

Writes a synthetic log of ``--rows`` rows (default 1 million; about 1000 live blocks, sizes
log-uniform in [256 B, 4 MiB], 4 threads, 3 streams, frees on other threads) and times
``summarize`` and ``replay`` on each resource asked for. Prints a table; ``--results DIR``
also writes it as a dated markdown file. Target: a 1-million-row replay within a minute on
CI-class hardware.

    python bench/log_replay.py --resources pool,cuda --results bench/out
"""

from __future__ import annotations

import argparse
import datetime
import os
import platform
import random
import sys
import tempfile
import time

from dask_rmm import logs
from dask_rmm.logs import Action, LogEvent, format_event, replay, summary
from dask_rmm.sizes import format_bytes


def write_log(path: str, rows: int, seed: int = 0) -> None:
    rng = random.Random(seed)
    threads = (140001, 140002, 140003, 140004)
    streams = (0, 0x2, 0x7F3A40001230)
    live: list[tuple[int, int]] = []
    free_ptrs: list[int] = []
    bump = 0x7F0000000000
    t = 10 * 3600.0
    with open(path, "w") as f:
        f.write(",".join(logs.HEADER) + "\n")
        buf = []
        for _ in range(rows):
            t += 2e-6
            thread = threads[rng.randrange(4)]
            stream = streams[rng.randrange(3)]
            if live and (len(live) >= 1000 or rng.random() < 0.5):
                j = rng.randrange(len(live))
                live[j], live[-1] = live[-1], live[j]
                ptr, size = live.pop()
                free_ptrs.append(ptr)
                e = LogEvent(thread, t, Action.FREE, ptr, size, stream, 0, "", "")
            else:
                size = int(2 ** rng.uniform(8, 22))
                if free_ptrs:
                    ptr = free_ptrs.pop()
                else:
                    ptr = bump
                    bump += 1 << 22
                live.append((ptr, size))
                e = LogEvent(thread, t, Action.ALLOCATE, ptr, size, stream, 0, "", "")
            buf.append(format_event(e))
            if len(buf) >= 65536:
                f.write("\n".join(buf) + "\n")
                buf.clear()
        if buf:
            f.write("\n".join(buf) + "\n")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rows", type=int, default=1_000_000)
    ap.add_argument("--resources", default="pool,cuda", help="comma-separated replay resources")
    ap.add_argument("--log", help="replay this log instead of a synthetic one")
    ap.add_argument(
        "--initial-pool-size",
        type=int,
        default=512 << 20,
        help="pool and arena size in bytes (default 512 MiB: the synthetic peak is ~200 MiB)",
    )
    ap.add_argument("--results", help="folder to write a dated markdown table to")
    args = ap.parse_args(argv)

    gpu = replay._has_gpu()
    with tempfile.TemporaryDirectory() as tmp:
        path = args.log
        gen_s = 0.0
        if path is None:
            path = os.path.join(tmp, "bench.csv")
            t0 = time.perf_counter()
            write_log(path, args.rows)
            gen_s = time.perf_counter() - t0
        size_mb = os.path.getsize(path) / 1e6

        t0 = time.perf_counter()
        n = sum(1 for _ in logs.read_log(path))
        read_s = time.perf_counter() - t0
        t0 = time.perf_counter()
        s = summary.summarize(path).files[0]
        summary_s = time.perf_counter() - t0

        rows = [("read", read_s, "", "", ""), ("summarize", summary_s, "", "", "")]
        for name in args.resources.split(","):
            name = name.strip()
            sized = (
                {"initial_pool_size": args.initial_pool_size} if name in ("pool", "arena") else {}
            )
            r = replay.replay(path, name, gpu=gpu, **sized)
            assert r.failed or r.peak_bytes == s.peak_bytes
            rows.append(
                (
                    f"replay {name}",
                    r.seconds,
                    f"{r.call_seconds:.2f}",
                    format_bytes(r.peak_upstream_bytes),
                    f"{r.new_failures:,}",
                )
            )

    memory = "device memory" if gpu else "host memory (SystemMemoryResource), no GPU"
    lines = [
        f"# Log replay benchmark, {datetime.date.today().isoformat()}",
        "",
        f"- host: {platform.node()}, {platform.processor() or platform.machine()}, "
        f"{os.cpu_count()} CPUs, Python {platform.python_version()}",
        f"- log: {n:,} rows, {size_mb:.1f} MB (synthetic: ~1000 live blocks, 256 B..4 MiB, "
        f"4 threads, 3 streams){'' if args.log is None else ' from ' + args.log}",
        f"- generating it took {gen_s:.1f} s; replay on {memory}",
        f"- peak in use {summary.format_size(s.peak_bytes)}; pool and arena sized "
        f"{args.initial_pool_size >> 20} MiB, binning with RMM's 256 KiB..4 MiB bins",
        "",
        "| step | seconds | us/row | in allocate/deallocate (s) | peak upstream | new failures |",
        "|---|---:|---:|---:|---:|---:|",
    ]
    for label, secs, call_s, up, fails in rows:
        lines.append(f"| {label} | {secs:.2f} | {1e6 * secs / n:.2f} | {call_s} | {up} | {fails} |")
    text = "\n".join(lines) + "\n"
    print(text)
    if args.results:
        os.makedirs(args.results, exist_ok=True)
        name = f"log_replay-{'gpu' if gpu else 'cpu'}-{datetime.date.today().isoformat()}.md"
        with open(os.path.join(args.results, name), "w") as f:
            f.write(text)
        print(f"wrote {os.path.join(args.results, name)}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
