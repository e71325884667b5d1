"""Replaying an RMM allocation log, in one thread and in file order, against a freshly built
memory resource: the upstream footprint, failed rows and time. No plotting or summaries."""

from __future__ import annotations

import os
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from typing import Any

from dask_rmm import _cuda
from dask_rmm.logs.reader import Action, LiveAllocations, LogReader, format_time, read_logs
from dask_rmm.logs.summary import format_size
from dask_rmm.mr.base import DeviceMemoryResource
from dask_rmm.sizes import format_bytes
from dask_rmm.stream import DEFAULT_STREAM, LEGACY_DEFAULT_STREAM, PER_THREAD_HANDLE, Stream

__all__ = [
    "RESOURCES",
    "ReplayFailure",
    "ReplayResult",
    "build_resource",
    "format_comparison",
    "format_result",
    "replay",
]

#: Resource names ``replay`` can build.
RESOURCES = ("pool", "arena", "binning", "fixed_size", "async", "cuda")

# Binning's default bins, as RMM's own examples use them: 256 KiB .. 4 MiB fixed-size bins.
_BINNING_EXPONENTS = (18, 22)
_MAX_LISTED_FAILURES = 50
#: The resources that are a base resource alone, no suballocator in front.
_BASE_ALONE = ("cuda", "async")


def _has_gpu() -> bool:
    return _cuda.is_available()


def build_resource(
    name: str,
    *,
    gpu: bool | None = None,
    initial_pool_size: int | None = None,
    maximum_pool_size: int | None = None,
    block_size: int | None = None,
) -> tuple[Any, Any, str]:
    """A fresh resource of kind ``name`` (one of :data:`RESOURCES`) over a counting upstream:
    ``(resource, the StatisticsResourceAdaptor over its upstream, a one-line description)``.

    The base is CudaMemoryResource on a GPU (``gpu``, default when there is one), else
    SystemMemoryResource (``async`` needs a GPU: RuntimeError); ``initial_pool_size`` is also the
    arena's size and the async pool's; ``block_size`` is ``fixed_size``'s. ValueError for an
    unknown name or a block size <= 0.
    """
    from dask_rmm import mr

    if block_size is not None and block_size <= 0:
        raise ValueError(f"block_size must be a positive number of bytes, got {block_size}")
    if name not in RESOURCES:
        raise ValueError(f"unknown resource {name!r}; choose one of {', '.join(RESOURCES)}")
    if gpu is None:
        gpu = _has_gpu()
    if name == "async":
        if not gpu:
            raise RuntimeError(
                "resource 'async' (cudaMallocAsync) needs a CUDA device and this host has none; "
                "replay with pool, arena, binning, fixed_size or cuda on host memory instead"
            )
        base: DeviceMemoryResource = mr.CudaAsyncMemoryResource(initial_pool_size=initial_pool_size)
    else:
        base = mr.CudaMemoryResource() if gpu else mr.SystemMemoryResource()
    base_name = type(base).__name__
    counter = mr.StatisticsResourceAdaptor(base)
    if name in _BASE_ALONE:
        return counter, counter, base_name
    resource: DeviceMemoryResource
    if name == "pool":
        resource = mr.PoolMemoryResource(
            counter, initial_pool_size=initial_pool_size, maximum_pool_size=maximum_pool_size
        )
    elif name == "arena":
        resource = mr.ArenaMemoryResource(counter, arena_size=initial_pool_size)
    elif name == "binning":
        resource = mr.BinningMemoryResource(counter, *_BINNING_EXPONENTS)
    else:
        kwargs = {} if block_size is None else {"block_size": block_size}
        resource = mr.FixedSizeMemoryResource(counter, **kwargs)
    return resource, counter, f"{type(resource).__name__} over {base_name}"


class _StreamMap:
    """Log stream handles to :class:`Stream` objects for the replay (on the host, a thread's
    per-thread stream gets a handle beyond any real one)."""

    def __init__(self, gpu: bool):
        self.gpu = gpu
        self.streams: dict[Any, Any] = {0: DEFAULT_STREAM, 1: LEGACY_DEFAULT_STREAM}

    def get(self, handle: int, thread: int):
        key = ("ptds", thread) if handle == PER_THREAD_HANDLE else handle
        s = self.streams.get(key)
        if s is None:
            fake = handle if key == handle else (1 << 64) + len(self.streams)
            s = self.streams[key] = Stream() if self.gpu else Stream._from_handle(fake)
        return s

    def synchronize(self) -> None:
        if self.gpu:
            for s in self.streams.values():
                s.synchronize()

    def __len__(self) -> int:
        return len(self.streams) - 2


@dataclass(frozen=True)
class ReplayFailure:
    """A row whose allocation failed in the replay."""

    line: int
    source: str
    size: int
    stream: int
    thread: int
    time: float
    original_failed: bool
    error: str


@dataclass(frozen=True)
class ReplayResult:
    """What replaying one log on one resource showed."""

    resource: str  #: the ``--resource`` name; ``description`` says what was built
    description: str
    path: str
    host_memory: bool  #: replayed on host memory (no GPU)
    rows: int  #: rows read
    allocations: int  #: allocations re-issued
    frees: int
    original_failures: int  #: ``allocate failure`` rows in the log
    retried_failures: bool  #: whether those were re-issued (``retry_failures=True``) ...
    original_failures_succeeded: int  #: ... and how many of them succeeded here
    new_failures: int  #: allocations that succeeded originally and failed here
    failures: tuple[ReplayFailure, ...]  #: the failed rows (the first 50)
    skipped_frees: int  #: frees of blocks the replay does not hold (failed here, or not logged)
    peak_bytes: int  #: the largest sum of live requested bytes (the log's peak if none failed)
    peak_upstream_bytes: int  #: the most the resource held from its base: its real footprint
    final_upstream_bytes: int  #: held from the base at the end of the log
    upstream_allocations: int  #: calls the resource made to its base
    streams: int  #: distinct non-default streams used
    seconds: float  #: wall time, log reading included
    call_seconds: float  #: time spent inside allocate and deallocate
    truncated: str | None = None
    failed_rows: int = 0  #: rows that failed here (``failures`` holds the first 50)
    unservable: int = 0  #: new failures this resource rejects whatever its memory (too large)

    @property
    def failed(self) -> bool:
        """True when the replay hit a failure the original run did not."""
        return self.new_failures > 0

    @property
    def can_serve(self) -> bool:
        """False when the log asks for a size this kind of resource never serves."""
        return self.unservable == 0

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d["failures"] = [{**asdict(f), "stream": hex(f.stream)} for f in self.failures]
        return d


def replay(
    path: str | os.PathLike,
    resource: str = "pool",
    *,
    gpu: bool | None = None,
    initial_pool_size: int | None = None,
    maximum_pool_size: int | None = None,
    block_size: int | None = None,
    retry_failures: bool = False,
    progress: bool = False,
) -> ReplayResult:
    """Replay the log at ``path`` against a freshly built ``resource``.

    ``path`` is an RMM allocation log (a merged one keeps each worker's pointers apart);
    ``resource``, ``gpu`` and the sizes are :func:`build_resource`'s. ``retry_failures``
    re-issues the log's ``allocate failure`` rows too, to see whether this resource would have
    satisfied them (a success is freed at once: the program never got the block; off by default
    because such a block raises the footprint beyond what the workload held). ``progress`` draws
    click's progress bar on stderr. RuntimeError when the resource cannot be built (an initial
    pool larger than the memory there is, ``async`` without a GPU)."""
    if gpu is None:
        gpu = _has_gpu()
    try:
        mr, counter, description = build_resource(
            resource,
            gpu=gpu,
            initial_pool_size=initial_pool_size,
            maximum_pool_size=maximum_pool_size,
            block_size=block_size,
        )
    except MemoryError as oom:  # an initial pool or arena larger than the memory there is
        reason = str(oom).splitlines()[0] if str(oom) else type(oom).__name__
        raise RuntimeError(
            f"cannot build the {resource!r} resource to replay on: {reason}"
        ) from oom
    readers: list[LogReader] = []
    events = read_logs([path], readers, progress=f"replay {resource}" if progress else None)
    reader = readers[0]
    streams = _StreamMap(gpu)
    get_stream = streams.get
    table = LiveAllocations()
    late_free = LiveAllocations.LATE_FREE
    failures: list[ReplayFailure] = []
    allocate, deallocate = mr.allocate, mr.deallocate
    allocations = frees = original_failures = recovered = new_failures = skipped = 0
    unservable = current = peak = n_failed = 0
    call_seconds = 0.0
    clock = time.perf_counter
    ALLOCATE, FREE, RESTART = Action.ALLOCATE, Action.FREE, Action.RESTART
    start = clock()
    for e in events:
        action = e.action
        if action is FREE:
            entry = table.free((e.source, e.pointer))
            if entry is None or entry is late_free:
                skipped += entry is None
                continue
            ptr, size, _ = entry
            t0 = clock()
            deallocate(ptr, size, get_stream(e.stream, e.thread))
            call_seconds += clock() - t0
            frees += 1
            current -= size
            continue
        if action is RESTART:  # the writer's process ended: so did its allocations
            for ptr, size, stream in table.end_source(e.source):
                deallocate(ptr, size, stream)
                current -= size
            continue
        original_ok = action is ALLOCATE
        original_failures += not original_ok
        if not original_ok and not retry_failures:
            continue
        size = e.size
        stream = get_stream(e.stream, e.thread)
        t0 = clock()
        try:
            ptr = allocate(size, stream)
        except (MemoryError, ValueError) as err:  # ValueError: fixed_size, too large
            call_seconds += clock() - t0
            new_failures += original_ok
            unservable += original_ok and not isinstance(err, MemoryError)
            n_failed += 1
            if len(failures) < _MAX_LISTED_FAILURES:
                reason = str(err).splitlines()[0] if str(err) else type(err).__name__
                row = (e.line, e.source, size, e.stream, e.thread, e.time, not original_ok)
                failures.append(ReplayFailure(*row, reason))
            continue
        call_seconds += clock() - t0
        if not original_ok:  # the original program never got this block: give it back at once
            recovered += 1
            deallocate(ptr, size, stream)
            continue
        allocations += 1
        old = table.allocate((e.source, e.pointer), (ptr, size, stream))
        if old is not None:  # its free row comes later (threads' rows out of order)
            deallocate(old[0], old[1], old[2])
            current -= old[1]
        current += size
        if current > peak:
            peak = current
    final_upstream = counter.current_bytes
    for ptr, size, stream in table.live.values():
        deallocate(ptr, size, stream)
    streams.synchronize()
    seconds = clock() - start
    return ReplayResult(
        resource=resource,
        description=description,
        path=os.fspath(path),
        host_memory=not gpu,
        rows=reader.rows,
        allocations=allocations,
        frees=frees,
        original_failures=original_failures,
        retried_failures=retry_failures,
        original_failures_succeeded=recovered,
        new_failures=new_failures,
        failures=tuple(failures),
        skipped_frees=skipped,
        peak_bytes=peak,
        peak_upstream_bytes=counter.allocation_counts.peak_bytes,
        final_upstream_bytes=final_upstream,
        upstream_allocations=counter.allocation_counts.total_count,
        streams=len(streams),
        seconds=seconds,
        call_seconds=call_seconds,
        truncated=f"{reader.path}:{reader.truncated[0]}" if reader.truncated else None,
        failed_rows=n_failed,
        unservable=unservable,
    )


def format_result(r: ReplayResult, max_failures: int = 10) -> str:
    """Text report of one replay."""
    lines = [
        f"replay of {r.path} on {r.description}",
        f"  rows             {r.rows:,} ({r.allocations:,} allocations, {r.frees:,} frees, "
        f"{r.streams} non-default streams)",
        f"  peak in use      {format_size(r.peak_bytes)}",
        f"  peak upstream    {format_size(r.peak_upstream_bytes)} in "
        f"{r.upstream_allocations:,} upstream allocations",
        f"  upstream at end  {format_bytes(r.final_upstream_bytes)}",
        f"  time             {r.seconds:.3f} s ({r.call_seconds:.3f} s in allocate/deallocate, "
        f"{1e6 * r.seconds / max(r.rows, 1):.2f} us per row)",
    ]
    if r.original_failures:
        outcome = (
            f"{r.original_failures_succeeded:,} succeed here"
            if r.retried_failures
            else "not re-issued (--retry-failures re-issues them)"
        )
        lines.append(
            f"  original fails   {r.original_failures:,} rows failed in the original run; {outcome}"
        )
    if r.skipped_frees:
        lines.append(f"  skipped frees    {r.skipped_frees:,} (no block held for them)")
    if not r.can_serve:
        lines.append(f"  CANNOT SERVE     {_cannot_serve(r)}")
    if r.new_failures:
        lines.append(
            f"  NEW FAILURES     {r.new_failures:,} allocations that succeeded originally failed"
        )
    listed = [f for f in r.failures if not f.original_failed][:max_failures]
    lines += [
        f"    line {f.line}: {format_size(f.size)} at {format_time(f.time)} thread "
        f"{f.thread} stream {f.stream:#x}: {f.error}"
        for f in listed
    ]
    if r.new_failures > len(listed):
        # Counted against what this text lists, not the 50 rows the result keeps.
        lines.append(f"    ... {r.new_failures - len(listed):,} more new failures not listed")
    if r.truncated:
        lines.append(f"  note             cut-off last line skipped: {r.truncated}")
    return "\n".join(lines)


def _cannot_serve(r: ReplayResult) -> str:
    """Why ``r``'s resource cannot serve the log, in words (its first rejected request)."""
    why = next((f.error for f in r.failures if not f.original_failed), "")
    return (
        f"{r.resource} cannot serve this log: {r.unservable:,} allocations it rejects whatever "
        f"its size ({why})"
    )


def format_comparison(results: Sequence[ReplayResult]) -> str:
    """One table comparing replays of the same log on several resources, then the smallest
    footprint without new failures (and the smallest pooled one when that is a base resource
    alone); a resource that cannot serve the log's sizes is named as such below the table."""
    head = (
        f"{'resource':<12} {'peak upstream':>14} {'vs in-use':>9} {'upstream allocs':>15} "
        f"{'new failures':>12} {'time (s)':>9} {'us/row':>7}"
    )
    lines = [head, "-" * len(head)]
    for r in results:
        # nothing was in use (every allocation failed): no ratio to give
        ratio = f"{r.peak_upstream_bytes / r.peak_bytes:.2f}x" if r.peak_bytes else "-"
        lines.append(
            f"{r.resource:<12} {format_bytes(r.peak_upstream_bytes):>14} {ratio:>9} "
            f"{r.upstream_allocations:>15,} "
            f"{r.new_failures if r.can_serve else 'cannot serve':>12} {r.seconds:>9.3f} "
            f"{1e6 * r.seconds / max(r.rows, 1):>7.2f}"
        )
    lines.extend(_cannot_serve(r) for r in results if not r.can_serve)
    ok = [r for r in results if not r.failed]
    if not ok:
        lines.append("every resource failed allocations the original run did not")
        return "\n".join(lines)
    best = min(ok, key=lambda r: r.peak_upstream_bytes)
    line = (
        f"smallest footprint without new failures: {best.resource} "
        f"({format_bytes(best.peak_upstream_bytes)})"
    )
    if best.resource in _BASE_ALONE:
        line += " (the base resource alone: one upstream call per allocation)"
        if pooled := [r for r in ok if r.resource not in _BASE_ALONE]:
            best_pool = min(pooled, key=lambda r: r.peak_upstream_bytes)
            line += (
                f"; of the pooled resources: {best_pool.resource} "
                f"({format_bytes(best_pool.peak_upstream_bytes)})"
            )
    lines.append(line)
    return "\n".join(lines)
