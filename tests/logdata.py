"""Allocation logs for the log tests: RMM-format rows from a seeded synthetic workload (with the
numbers the summary must find), and real traffic to record with LoggingResourceAdaptor.

Not a test module; imported by test_logs.py and test_cli_log.py.
"""

from __future__ import annotations

import random
import threading
from dataclasses import dataclass, field

from dask_rmm.logs import HEADER, Action, LogEvent, format_event


@dataclass
class Expected:
    """What a summary of the written log must say."""

    allocations: int = 0
    frees: int = 0
    failures: int = 0
    peak_bytes: int = 0
    peak_line: int = 0
    outstanding_bytes: int = 0
    outstanding_count: int = 0
    histogram: dict[int, int] = field(default_factory=dict)
    thread_allocated: dict[int, int] = field(default_factory=dict)
    stream_allocs: dict[int, int] = field(default_factory=dict)
    end_time: float = 0.0


def synthetic_events(
    n: int,
    seed: int = 0,
    *,
    start: float = 12 * 3600.0,
    step: float = 1e-4,
    threads: tuple[int, ...] = (140001, 140002, 140003),
    streams: tuple[int, ...] = (0, 0x2, 0x7F3A40001230),
    failure_rate: float = 0.01,
    base: int = 0x7F0000000000,
) -> tuple[list[LogEvent], Expected]:
    """``n`` rows of a random workload: about 1000 live blocks, sizes log-uniform in
    [1 B, 4 MiB], pointers reused after free, frees often on another thread and stream,
    a few failure rows; and the summary it must produce."""
    rng = random.Random(seed)
    exp = Expected()
    live: dict[int, int] = {}
    live_list: list[int] = []
    free_ptrs: list[int] = []
    bump = base
    cur = 0
    events = []
    t = start
    for i in range(n):
        line = i + 2
        t += step * rng.random()
        thread = rng.choice(threads)
        stream = rng.choice(streams)
        if live_list and (len(live_list) > 1000 or rng.random() < 0.45):
            j = rng.randrange(len(live_list))
            ptr = live_list[j]
            live_list[j] = live_list[-1]
            live_list.pop()
            size = live.pop(ptr)
            free_ptrs.append(ptr)
            cur -= size
            exp.frees += 1
            events.append(LogEvent(thread, t, Action.FREE, ptr, size, stream, line, "", ""))
            continue
        size = int(2 ** rng.uniform(0, 22))
        if rng.random() < failure_rate:
            exp.failures += 1
            events.append(
                LogEvent(thread, t, Action.ALLOCATE_FAILURE, 0, size, stream, line, "", "")
            )
            continue
        if free_ptrs and rng.random() < 0.5:
            ptr = free_ptrs.pop(rng.randrange(len(free_ptrs)))
        else:
            ptr = bump
            bump += 1 << 23
        # A reused address must not be live (it is not: only freed pointers are reused).
        live[ptr] = size
        live_list.append(ptr)
        cur += size
        exp.allocations += 1
        b = 1 << (size - 1).bit_length()
        exp.histogram[b] = exp.histogram.get(b, 0) + 1
        exp.thread_allocated[thread] = exp.thread_allocated.get(thread, 0) + size
        exp.stream_allocs[stream] = exp.stream_allocs.get(stream, 0) + 1
        if cur > exp.peak_bytes:
            exp.peak_bytes = cur
            exp.peak_line = line
        events.append(LogEvent(thread, t, Action.ALLOCATE, ptr, size, stream, line, "", ""))
    exp.outstanding_bytes = cur
    exp.outstanding_count = len(live)
    exp.end_time = t
    return events, exp


def write_log(path, events, *, final_newline: bool = True) -> None:
    """Write ``events`` as an RMM log (header first)."""
    with open(path, "w", newline="\n") as f:
        f.write(",".join(HEADER) + "\n")
        rows = [format_event(e) for e in events]
        f.write("\n".join(rows))
        if final_newline and rows:
            f.write("\n")


def write_synthetic(path, n: int, seed: int = 0, **kwargs) -> Expected:
    events, exp = synthetic_events(n, seed, **kwargs)
    write_log(path, events)
    return exp


def logging_adaptor(upstream, path):
    """dask_rmm's LoggingResourceAdaptor over ``upstream`` logging to (about) ``path``: the
    adaptor adds ``.dev{id}`` to the name, so read :meth:`get_file_name`."""
    from dask_rmm.mr import LoggingResourceAdaptor

    return LoggingResourceAdaptor(upstream, log_file_name=str(path))


def run_workload(resource, steps: int, seed: int = 0, threads: int = 1) -> list:
    """Random allocate/free traffic on ``resource`` from ``threads`` threads, with frees
    handed to other threads, ending with about a tenth of the blocks still live.

    Returns the blocks left live as ``(ptr, size, stream)``, for the caller to free (the
    Stream objects in them keep a real stream alive until then).

    The third stream is a real one on a GPU host: a suballocator in ``resource`` records events
    on / synchronizes the streams it sees whenever CUDA is available, even over host memory.
    """
    from conftest import make_test_streams

    from dask_rmm.stream import DEFAULT_STREAM, PER_THREAD_DEFAULT_STREAM

    streams = [DEFAULT_STREAM, PER_THREAD_DEFAULT_STREAM, *make_test_streams(1)]
    handoff: list[tuple[int, int, object]] = []
    lock = threading.Lock()
    kept: list[tuple[int, int, object]] = []

    def work(k: int) -> None:
        rng = random.Random(seed * 1000 + k)
        mine: list[tuple[int, int, object]] = []
        for _ in range(steps):
            if mine and (len(mine) > 200 or rng.random() < 0.45):
                blk = mine.pop(rng.randrange(len(mine)))
                if rng.random() < 0.3:
                    with lock:
                        handoff.append(blk)  # freed later by whichever thread takes it
                    continue
                resource.deallocate(blk[0], blk[1], rng.choice(streams))
                continue
            with lock:
                other = handoff.pop() if handoff and rng.random() < 0.5 else None
            if other is not None:
                resource.deallocate(other[0], other[1], rng.choice(streams))
            size = int(2 ** rng.uniform(0, 20))
            s = rng.choice(streams)
            mine.append((resource.allocate(size, s), size, s))
        for blk in mine[: len(mine) * 9 // 10]:
            resource.deallocate(*blk)
        with lock:
            kept.extend(mine[len(mine) * 9 // 10 :])

    ts = [threading.Thread(target=work, args=(k,)) for k in range(threads)]
    for t in ts:
        t.start()
    for t in ts:
        t.join()
    for blk in handoff:
        resource.deallocate(*blk)
    return kept
