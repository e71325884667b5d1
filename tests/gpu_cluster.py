"""Helpers of the multi-GPU and dask-cuda tests: a cluster of one worker process per GPU, and
functions that run on the workers (CuPy allocations, heartbeats, dask-rmm's log lines, memory
held outside any resource). Imported by name on the workers, so kept free of pytest fixtures."""

from __future__ import annotations

import contextlib
import logging
import os

#: dask-rmm log lines seen on this process since :func:`capture_dask_rmm_logs`.
_captured: list[str] = []
#: Device memory this process holds outside any resource (see :func:`occupy`).
_occupied: list[int] = []


def visible_gpus(n: int) -> list[str]:
    """The first ``n`` entries for ``CUDA_VISIBLE_DEVICES`` as this process sees its devices
    (its own ``CUDA_VISIBLE_DEVICES`` if set, else ``0..n-1``), like dask-cuda assigns them."""
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    ids = [v.strip() for v in visible.split(",") if v.strip()] if visible else []
    return (ids or [str(i) for i in range(n)])[:n]


@contextlib.contextmanager
def one_worker_per_gpu(n: int = 2):
    """A cluster of ``n`` single-threaded worker processes (Nannies), worker ``i`` seeing only
    GPU ``i`` through its own ``CUDA_VISIBLE_DEVICES``; yields ``(cluster, client, addresses)``
    with ``addresses[i]`` the worker on GPU ``i``."""
    from distributed import Client, Nanny, Scheduler, SpecCluster

    gpus = visible_gpus(n)
    workers = {
        f"gpu{i}": {
            "cls": Nanny,
            "options": {
                "nthreads": 1,
                "env": {"CUDA_VISIBLE_DEVICES": gpu},
            },
        }
        for i, gpu in enumerate(gpus)
    }
    scheduler = {"cls": Scheduler, "options": {"dashboard_address": ":0"}}
    with (
        SpecCluster(workers=workers, scheduler=scheduler) as cluster,
        Client(cluster) as client,
    ):
        client.wait_for_workers(n)
        by_name = {ws["name"]: a for a, ws in client.scheduler_info()["workers"].items()}
        yield cluster, client, [by_name[f"gpu{i}"] for i in range(n)]


def cupy_ones(nbytes: int, device: int | None = None):
    """A task: a CuPy array of ``nbytes`` bytes on ``device`` (default: the current one)."""
    import cupy

    with cupy.cuda.Device(device):  # Device(None) is the current device
        return cupy.ones(nbytes, dtype=cupy.uint8)


async def beat(dask_worker=None) -> None:
    """``client.run(beat)``: returns once the scheduler has this worker's heartbeat (and the
    timeline plugin has read it, since reports poll first)."""
    await dask_worker.heartbeat()


def worker_setup(dask_worker=None) -> dict:
    """What dask-rmm installed on this worker: registration token, and per device id (a str)
    its pool size and resource chain."""
    from dask_rmm.worker.stacks import worker_stack

    ws = worker_stack(dask_worker)
    return {
        "token": ws.token,
        "pool_size": {str(s.device): s.pool_size for s in ws.active},
        "chain": {str(s.device): s.chain for s in ws.active},
    }


def capture_dask_rmm_logs() -> None:
    """Keep this process's ``dask_rmm`` log lines (INFO and up) for :func:`dask_rmm_logs`."""

    class _Keep(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            _captured.append(record.getMessage())

    for name in ("dask_rmm", "distributed.worker.dask_rmm"):
        log = logging.getLogger(name)
        log.setLevel(logging.INFO)
        log.addHandler(_Keep(logging.INFO))


def dask_rmm_logs() -> list[str]:
    return list(_captured)


def cupy_allocator_name() -> str:
    """``module.name`` of the allocator CuPy uses in this process."""
    import cupy

    from dask_rmm.allocators.cupy import get_cupy_cache

    fn = cupy.cuda.get_allocator()
    cache = get_cupy_cache()
    if cache is not None and fn == cache.pool.malloc:
        return "dask_rmm.allocators.cupy.CupyPoolCache"  # CuPy's own pool over dask-rmm
    return f"{getattr(fn, '__module__', '')}.{getattr(fn, '__qualname__', '')}"


def device_total_memory() -> int:
    from dask_rmm import _cuda

    return _cuda.device_total_memory(_cuda.get_device())


def occupy(nbytes: int) -> None:
    """Hold ``nbytes`` of the current device with a bare cudaMalloc (no resource sees it)."""
    from dask_rmm import _cuda

    _occupied.append(_cuda.malloc(nbytes))


def release_occupied() -> None:
    from dask_rmm import _cuda

    while _occupied:
        _cuda.free(_occupied.pop())


def collect_garbage() -> None:
    import gc

    gc.collect()


def device_used_bytes() -> int:
    """Bytes in use on the current device (cudaMemGetInfo), by anyone."""
    from dask_rmm import _cuda

    free, total = _cuda.mem_get_info()
    return total - free


def compiled_rmm_state() -> dict:
    """What compiled RMM (``import rmm``, as dask-cuda sets it up) has on this worker: CuPy's
    allocator, RMM's current device resource (type and ``id``) and its pool's size."""
    import rmm

    top = mr = rmm.mr.get_current_device_resource()
    pool_size = None
    while mr is not None:
        if hasattr(mr, "pool_size"):
            pool_size = int(mr.pool_size())
            break
        mr = mr.get_upstream() if hasattr(mr, "get_upstream") else None
    return {
        "allocator": cupy_allocator_name(),
        "resource": type(top).__name__,
        "resource_id": id(top),
        "pool_size": pool_size,
    }


def gpu_name() -> str:
    """The current device's name as CuPy reads it (not through dask-rmm)."""
    import cupy

    name = cupy.cuda.runtime.getDeviceProperties(cupy.cuda.Device().id)["name"]
    return name.decode() if isinstance(name, bytes) else str(name)


def gpu_uuid() -> str:
    """The current device's UUID as dask-rmm reads it (``GPU-...``)."""
    from dask_rmm import _cuda

    return _cuda.device_identity(_cuda.get_device())[1]


def compiled_rmm_resource() -> str:
    """The type of compiled RMM's current device resource here, or ``"no rmm"``."""
    try:
        import rmm
    except ImportError:
        return "no rmm"
    return type(rmm.mr.get_current_device_resource()).__name__
