"""Helpers of the memory-pressure tests: a small pool stack with the pressure adaptor on top,
and DeviceBuffers (or CuPy arrays on a GPU) carrying a byte pattern that can be checked."""

from __future__ import annotations

import numpy as np

MiB = 1 << 20


def pressure_stack(
    pool_bytes: int = 4 * MiB,
    *,
    base: str = "system",
    limit: int | None = None,
    spill_on_oom: bool = True,
    pause_fraction: float | None = None,
    task_key=None,
    maximum: int | None = None,
):
    """``(WorkerPressure, top)``: a fixed-size pool (initial = maximum = ``pool_bytes``, or up
    to ``maximum``) under a
    StatisticsResourceAdaptor and an AttributionResourceAdaptor, wrapped for pressure, and made
    device 0's resource."""
    from dask_rmm import mr
    from dask_rmm.mr.attribution_adaptor import AttributionResourceAdaptor
    from dask_rmm.pressure.worker import WorkerPressure
    from dask_rmm.stack.build import DeviceStack
    from tests.conftest import make_base_resource

    pool = mr.PoolMemoryResource(
        make_base_resource(base),
        initial_pool_size=pool_bytes,
        maximum_pool_size=pool_bytes if maximum is None else maximum,
    )
    stats = mr.StatisticsResourceAdaptor(pool)
    owner = task_key or (lambda: None)
    attrib = AttributionResourceAdaptor(stats, owner, owner_name=lambda k: str(k).split("-")[0])
    wp = WorkerPressure(spill_on_oom=spill_on_oom, pause_fraction=pause_fraction, task_key=task_key)
    stack = DeviceStack(0, attrib, statistics=stats, attribution=attrib, pool=pool)
    top = wp.wrap(stack, capacity=pool_bytes if maximum is None else maximum, limit=limit)
    mr.set_per_device_resource(0, top)
    return wp, top


def patterned_buffer(nbytes: int, value: int, mr=None):
    """A DeviceBuffer of ``nbytes`` filled with a pattern derived from ``value``."""
    from dask_rmm import DeviceBuffer

    buf = DeviceBuffer(size=nbytes, mr=mr)
    buf.copy_from_host(pattern(nbytes, value))
    return buf


_OFFSETS = 4093  # values below this give distinct patterns
_noise: list[np.ndarray] = [np.empty(0, np.uint8)]


def pattern(nbytes: int, value: int) -> np.ndarray:
    """``nbytes`` pseudo-random bytes, a different sequence for each ``value`` (a slice of one
    cached random array, so that making and checking patterns stays cheap)."""
    if len(_noise[0]) < nbytes + _OFFSETS:
        _noise[0] = np.random.default_rng(0).integers(0, 256, nbytes + _OFFSETS, dtype=np.uint8)
    offset = value % _OFFSETS
    return _noise[0][offset : offset + nbytes].copy()


def check_buffer(buf, value: int) -> None:
    got = buf.copy_to_host()
    expected = pattern(buf.size, value)
    if not np.array_equal(got, expected):
        bad = int(np.flatnonzero(got != expected)[0])
        raise AssertionError(f"buffer {value}: byte {bad} is {got[bad]}, expected {expected[bad]}")


# -- tasks of the cluster tests (run on workers) ----------------------------------------------


def make_output(nbytes: int, value: int):
    """A task output: a patterned DeviceBuffer from the worker's resource."""
    return patterned_buffer(nbytes, value)


def output_checksum(buf, value: int) -> int:
    """Checks the pattern (raises on a corrupted byte) and returns the byte sum."""
    check_buffer(buf, value)
    return int(buf.copy_to_host().astype("int64").sum())


def expected_checksum(nbytes: int, value: int) -> int:
    return int(pattern(nbytes, value).astype("int64").sum())


def allocate_once(nbytes: int) -> int:
    """A task that needs one block of ``nbytes`` for a moment."""
    from dask_rmm import DeviceBuffer

    return DeviceBuffer(size=nbytes).size


def fragment_then_allocate(block: int, n: int, request: int) -> int:
    """A task that fills the pool with ``n`` blocks, frees every other one, then asks for
    ``request`` bytes (more than one hole, less than all of them)."""
    from dask_rmm import DeviceBuffer

    blocks = [DeviceBuffer(size=block) for _ in range(n)]
    del blocks[::2]
    return DeviceBuffer(size=request).size


def worker_pressure_state(dask_worker) -> dict:
    """What the worker's pressure layer reports: metrics per device and OOM events (dicts)."""
    plugin = dask_worker.plugins.get("dask-rmm")
    wp = getattr(plugin, "worker_pressure", None)
    if wp is None:
        return {"installed": False, "data": type(dask_worker.data).__name__}
    return {
        "installed": True,
        "data": type(dask_worker.data).__name__,
        "metrics": {m.device: m.to_dict() for m in wp.metrics()},
        "oom_events": [e.to_dict() for e in wp.oom_events()],
    }


def capture_oom_layout(dask_worker) -> bool:
    """Have the worker's device-0 pressure layer, at each OOM that reaches a caller, keep a
    picture of what held the pool then (:func:`oom_layouts` reads them): every live block of
    the pool with the stored values inside it and whether something else references them."""
    import sys

    plugin = dask_worker.plugins.get("dask-rmm")
    wp = getattr(plugin, "worker_pressure", None)
    if wp is None or 0 not in wp.devices:
        return False
    dp = wp.devices[0]
    store = dp.store
    pictures: list = []
    dask_worker._oom_layouts = pictures
    previous = dp.on_oom

    def on_oom(event):
        try:
            chunks, free, live = dp.pool.memory_layout() if dp.pool is not None else ([], [], [])
            with store._lock:
                stored = [
                    (str(k), e.nbytes, e.ptrs, sys.getrefcount(store._device[k]))
                    for k, e in store._lru.items()
                    if e.nbytes and k in store._device
                ]
            referrers = {}
            for k, _n, _ptrs, r in stored:
                if r > 2 and len(referrers) < 6:
                    referrers[k] = _describe_referrers(store, k)
            blocks = []
            for p, s in live:
                inside = [
                    (k, n, r) for k, n, ptrs, r in stored if any(p <= q < p + s for q in ptrs)
                ]
                blocks.append((p, s, inside))
            cupy_pool = None
            try:
                import cupy

                pool = cupy.get_default_memory_pool()
                cupy_pool = (pool.used_bytes(), pool.total_bytes(), pool.n_free_blocks())
            except Exception:
                pass
            pictures.append(
                {
                    "requested": event.requested,
                    "task": event.task_key,
                    "spilled_trying": event.spilled_trying,
                    "released": event.released_by_library,
                    "free": free,
                    "referrers": referrers,
                    "chunks": chunks,
                    "live": blocks,
                    "cupy_pool": cupy_pool,
                    "by_prefix": event.live_bytes_by_prefix,
                    "recent": event.recent_events[-24:],
                    "threads": sorted(t.name for t in __import__("threading").enumerate()),
                }
            )
        except Exception as e:  # a diagnosis must not change the OOM
            pictures.append({"error": repr(e)})
        if previous is not None:
            previous(event)

    dp.on_oom = on_oom
    return True


def _describe_referrers(store, key) -> list[str]:
    """What, besides the store's dict, references the stored value of ``key``: each referrer's
    type, and for a frame its function and line, for a dict or list what holds it."""
    import gc

    value = store._device.get(key)
    if value is None:
        return []
    out = []
    for r in gc.get_referrers(value):
        if r is store._device:
            continue
        if hasattr(r, "f_code"):
            out.append(f"frame {r.f_code.co_name} {r.f_code.co_filename}:{r.f_lineno}")
        elif isinstance(r, (dict, list, tuple)):
            holders = [
                type(h).__name__
                + (f" {h.f_code.co_name}:{h.f_lineno}" if hasattr(h, "f_code") else "")
                for h in gc.get_referrers(r)[:4]
            ]
            out.append(f"{type(r).__name__} len {len(r)} held by {holders}")
        else:
            out.append(type(r).__name__)
    return out


def oom_layouts(dask_worker) -> list:
    return getattr(dask_worker, "_oom_layouts", [])
