"""Decides which base resources this host can make, and resets global state after each test.

"system" always; "cuda", "managed", "async" (and "pinned" for host-side tests) when a CUDA
device is present. Suballocator, adaptor and Dask tests parametrize over ``base_resource``.
"""

from __future__ import annotations

import contextlib
import time

import pytest

# dask_rmm.config registers the dask-rmm.* defaults before any test module imports
# distributed.utils_test, whose clean-up restores the config it saw at import.
import dask_rmm.config  # noqa: F401
from dask_rmm import _cuda

HAS_GPU = _cuda.is_available()

#: Base resources usable as a suballocator's upstream on this host.
BASE_RESOURCES = ["system"] + (["cuda", "managed", "async"] if HAS_GPU else [])


def make_base_resource(name: str):
    """A fresh base resource by short name ("system", "cuda", "managed", "async", "pinned"),
    made as reinitialize(base_resource=name) makes it."""
    from dask_rmm.stack.build import make_base_resource as make

    if name not in ("system", "cuda", "managed", "async", "pinned"):
        raise ValueError(name)
    return make(name, 0)


#: The resources the cupy and numba allocator GPU tests run over (``make_gpu_resource`` names).
GPU_RESOURCES = ["cuda", "pool", "statistics(pool)", "statistics(cuda)", "async", "managed"]


def make_gpu_resource(kind: str):
    """A fresh device resource by one of the ``GPU_RESOURCES`` names; pools start at 64 MiB."""
    from dask_rmm import mr

    if kind == "cuda":
        return mr.CudaMemoryResource()
    if kind == "pool":
        return mr.PoolMemoryResource(mr.CudaMemoryResource(), initial_pool_size=1 << 26)
    if kind == "statistics(pool)":
        return mr.StatisticsResourceAdaptor(
            mr.PoolMemoryResource(mr.CudaMemoryResource(), initial_pool_size=1 << 26)
        )
    if kind == "statistics(cuda)":
        return mr.StatisticsResourceAdaptor(mr.CudaMemoryResource())
    if kind == "async":
        return mr.CudaAsyncMemoryResource()
    if kind == "managed":
        return mr.ManagedMemoryResource()
    raise ValueError(kind)


def make_test_streams(n: int, resource=None) -> list:
    """``n`` distinct streams for a test that passes non-default streams to ``resource``.

    Real ``Stream()`` objects (each owns and destroys its handle: keep them referenced for as
    long as anything may use them) when CUDA is available and ``resource``, if given, is not
    host memory; otherwise made-up handles ``0x1000, 0x2000, ...`` that no CUDA call may see.

    Leave ``resource`` out whenever a suballocator (pool, arena, fixed size, binning) sees the
    streams: they record events on / synchronize streams whenever CUDA is available, even over
    host memory. Pass it only where the stream reaches nothing but ``resource`` itself (a base
    resource, or adaptors over one that never touch the stream).
    """
    from dask_rmm.stream import Stream

    host = resource is not None and getattr(resource, "is_host_memory", False)
    if HAS_GPU and not host:
        # Real streams live for the whole session: a stream destroyed while some resource of an
        # earlier test (or hypothesis example) still orders on it would be a dangling handle.
        while len(_SESSION_STREAMS) < n:
            _SESSION_STREAMS.append(Stream())
        return _SESSION_STREAMS[:n]
    return [Stream._from_handle(0x1000 * (i + 1)) for i in range(n)]


_SESSION_STREAMS: list = []


def wait_until(predicate, timeout: float = 20.0, what: str = "condition", interval: float = 0.05):
    """``predicate()``'s first truthy value, asked every ``interval`` seconds; AssertionError
    naming ``what`` once ``timeout`` seconds have passed without one."""
    deadline = time.monotonic() + timeout
    while True:
        value = predicate()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout}s waiting for {what}")
        time.sleep(interval)


@contextlib.contextmanager
def log_records(logger_name: str):
    """Yields the list of records logged on ``logger_name`` while the block runs (also where
    that logger does not propagate to the root, so pytest's ``caplog`` would not see them)."""
    import logging

    records: list[logging.LogRecord] = []
    handler = logging.Handler()
    handler.emit = records.append  # type: ignore[method-assign]
    log = logging.getLogger(logger_name)
    log.addHandler(handler)
    try:
        yield records
    finally:
        log.removeHandler(handler)


@contextlib.contextmanager
def local_process_cluster(n_workers: int = 2, threads_per_worker: int = 1):
    """A LocalCluster of worker processes (two single-threaded ones by default; scheduler
    dashboard on a free port, none on the workers) and a Client of it; yields
    ``(cluster, client)``."""
    from distributed import Client, LocalCluster

    cluster = LocalCluster(
        n_workers=n_workers,
        threads_per_worker=threads_per_worker,
        processes=True,
        dashboard_address=":0",
        worker_dashboard_address=None,
    )
    try:
        with Client(cluster) as client:
            yield cluster, client
    finally:
        close_patiently(cluster)


def close_patiently(cluster, exit_within: float = 60.0, close_within: float = 90.0) -> None:
    """``cluster.close()``, tolerating what a loaded host does to it, not what a hang does.

    distributed's nanny gives its worker process 5 s to exit; on a host whose cores are all
    busy that can pass, and the close then raises ``TimeoutError`` half done, the scheduler
    still running in this process (and, with it, its dask-rmm Prometheus collector, which then
    shows its series to every later test). Then the scheduler is closed here, and each worker
    process must be gone within ``exit_within`` seconds: one that never exits still fails.
    """
    import psutil

    pids = [p for p in (getattr(w, "pid", None) for w in cluster.workers.values()) if p]
    try:
        cluster.close(timeout=close_within)  # bounded: a close stuck behind a restart goes on below
        return
    except TimeoutError:
        pass
    for nanny in list(cluster.workers.values()):  # those not closed yet, given time now
        with contextlib.suppress(Exception):
            cluster.sync(nanny.close, timeout=exit_within)
    scheduler = getattr(cluster, "scheduler", None)
    if scheduler is not None:
        cluster.sync(scheduler.close)
    deadline = time.monotonic() + exit_within
    alive = pids
    while alive and time.monotonic() < deadline:
        time.sleep(0.2)
        alive = [p for p in alive if _process_running(psutil, p)]
    assert not alive, f"worker processes {alive} still running {exit_within:.0f} s after close"


def _process_running(psutil, pid: int) -> bool:
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def hold(nbytes):
    """A task that allocates through the worker's resource and keeps it (a DeviceBuffer result)."""
    from dask_rmm import DeviceBuffer

    return DeviceBuffer(size=nbytes)


def pytest_collection_modifyitems(config, items):
    if HAS_GPU:
        return
    skip = pytest.mark.skip(
        reason="needs a CUDA device; this host has none (cuda-python reports no usable GPU)"
    )
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(params=BASE_RESOURCES)
def base_resource_name(request):
    return request.param


@pytest.fixture
def base_resource(base_resource_name):
    return make_base_resource(base_resource_name)


@pytest.fixture
def make_streams():
    """``make_test_streams`` as a fixture: every stream it hands out stays referenced until
    the test's teardown, so a real stream is not destroyed while the test still runs."""
    made = []

    def make(n: int, resource=None) -> list:
        streams = make_test_streams(n, resource)
        made.extend(streams)
        return streams

    yield make
    made.clear()


@pytest.fixture(autouse=True)
def _reset_global_state():
    """Every test starts and ends with the default per-device resources."""
    yield
    try:
        from dask_rmm.mr import registry
    except ImportError:
        return
    reset = getattr(registry, "_reset_for_tests", None)
    if reset is not None:
        reset()
    from dask_rmm.allocators import arbitration, caches

    caches._reset_for_tests()
    arbitration._reset_for_tests()
