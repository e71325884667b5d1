"""RAPIDS interop: serve the compiled RMM library's allocations (cuDF, cuML, ...) from dask-rmm,
the ``"rmm"`` entry of :func:`dask_rmm.allocators.set_allocators`: RMM's compiled pool drawing
blocks through :class:`RMMForwarder`'s callbacks (:class:`RMMPoolCache`), or the callbacks
alone (``cache=False``). Streams, out-of-memory errors, frees that never raise and frees during
a garbage collection: docs/rapids.md, "How it behaves".
"""

from __future__ import annotations

import gc
import logging
import os
import queue
import sys
import threading
import weakref
from collections.abc import Iterable
from typing import Any, NamedTuple

from dask_rmm.allocators import arbitration, caches
from dask_rmm.mr import registry
from dask_rmm.mr.statistics_adaptor import Statistics
from dask_rmm.sizes import ALIGNMENT
from dask_rmm.stream import Stream, as_stream, cached_stream, handle_streams

__all__ = [
    "RMMForwarder",
    "RMMPoolCache",
    "get_rmm_cache",
    "get_rmm_forwarder",
    "reset_rmm_callback_resource",
    "set_rmm_callback_resource",
]

logger = logging.getLogger(__name__)

#: What to install when ``rmm`` is missing (the CUDA 13 wheel of the compiled package).
RMM_REQUIREMENT = "rmm-cu13"

try:
    import rmm as _rmm
    import rmm.mr  # noqa: F401  (the per-device resource functions and CallbackMemoryResource)
except Exception as _e:  # rmm is optional; a broken install (missing librmm) is as good as none
    _rmm = None
    _library_import_error: ImportError | None = (
        _e if isinstance(_e, ImportError) else ImportError(f"{type(_e).__name__}: {_e}")
    )
else:
    _library_import_error = None


def _our_stream(stream: Any) -> Stream:
    """RMM's stream (anything with ``__cuda_stream__``, or an int) as a dask-rmm Stream."""
    try:
        handle = stream.__cuda_stream__()[1]
    except AttributeError:
        return as_stream(stream)
    return handle_streams.get(handle) or cached_stream(handle)


class RMMForwarder:
    """The two callbacks of ``device``'s ``CallbackMemoryResource``. ``live``: pointer -> the
    dask-rmm resource that allocated it; ``failed_deallocations``: frees that failed (logged)."""

    def __init__(self, device: int):
        self.device = device
        self.live: dict[int, Any] = {}
        self.failed_deallocations = 0
        self._resource_of = registry.get_per_device_resource
        # The last resource found to be device memory, weakly: a forwarder outlives its stacks.
        self._checked: Any = lambda: None

    def allocate(self, nbytes: Any, stream: Any, alignment: int | None = None) -> int:
        """RMM's allocate callback: ``nbytes`` from the device's dask-rmm resource on ``stream``;
        ``(nbytes, stream)`` as RMM up to 26.10 calls it, or ``(stream, nbytes, alignment)``."""
        if alignment is not None:
            stream, nbytes = nbytes, stream
            if alignment > ALIGNMENT or ALIGNMENT % alignment:
                raise ValueError(
                    f"RMM asked for {nbytes} bytes aligned to {alignment}: dask-rmm's "
                    f"allocations are aligned to {ALIGNMENT} bytes"
                )
        if nbytes == 0:
            return 0
        mr = self._resource_of(self.device)
        if self._checked() is not mr:
            _require_device_memory(mr, self.device)
            try:
                self._checked = weakref.ref(mr)
            except TypeError:  # not weakly referenceable: checked at every allocation
                pass
        try:
            ptr = mr.allocate(nbytes, _our_stream(stream))
        except MemoryError:
            raise  # rmm::out_of_memory in C++: its message already names the numbers
        except Exception as e:  # std::runtime_error in C++, which keeps only the message
            raise RuntimeError(
                f"dask-rmm's {type(mr).__name__} on device {self.device} could not allocate "
                f"{nbytes} bytes for RMM: {type(e).__name__}: {e}"
            ) from e
        self.live[ptr] = mr
        return ptr

    def deallocate(
        self,
        ptr: Any,
        nbytes: Any,
        stream: Any,
        alignment: int | None = None,
        *,
        _finalizing=sys.is_finalizing,
    ) -> None:
        """RMM's deallocate callback, ``(ptr, nbytes, stream)`` or ``(stream, ptr, nbytes,
        alignment)``: ``ptr`` back to the resource that allocated it. Never raises (``noexcept``)."""
        try:
            if _finalizing():
                return
            if alignment is not None:
                stream, ptr, nbytes = ptr, nbytes, stream
            mr = self.live.pop(ptr, None)
            if mr is None:
                if ptr:
                    self._failed(ptr, nbytes, "RMM freed a pointer this forwarder never handed out")
                return
            if getattr(_gc_state, "collecting", False):
                _deferred_frees.put((self, mr, ptr, nbytes, stream))
                return
            mr.deallocate(ptr, nbytes, _our_stream(stream))
        except BaseException as e:  # nothing may propagate into C++
            self._failed(ptr, nbytes, f"{type(e).__name__}: {e}")

    def _free_deferred(self, mr: Any, ptr: int, nbytes: int, stream: Any) -> None:
        try:
            mr.deallocate(ptr, nbytes, _our_stream(stream))
        except BaseException as e:  # the free-thread must go on
            self._failed(ptr, nbytes, f"{type(e).__name__}: {e}")

    def _failed(self, ptr: Any, nbytes: Any, why: str) -> None:
        try:
            self.failed_deallocations += 1
            logger.error(
                "dask-rmm could not free RMM's allocation %#x (%s bytes) on device %s: %s",
                ptr,
                nbytes,
                self.device,
                why,
            )
        except BaseException:  # logging itself may be gone at shutdown
            pass

    def __repr__(self) -> str:
        return f"<RMMForwarder device={self.device} live={len(self.live)}>"


# -- frees during a garbage collection (docs/rapids.md, "Locks"): queued (SimpleQueue.put is
# safe there) and done by one daemon thread, which waits for the resource's lock like any other.

_gc_state = threading.local()
_deferred_frees: queue.SimpleQueue = queue.SimpleQueue()
_free_thread: threading.Thread | None = None


def _note_collection(phase: str, info: dict) -> None:
    _gc_state.collecting = phase == "start"


def _free_deferred_forever() -> None:
    while True:
        forwarder, mr, ptr, nbytes, stream = _deferred_frees.get()
        forwarder._free_deferred(mr, ptr, nbytes, stream)
        del forwarder, mr, stream


def _start_free_thread() -> None:
    """Start the thread for deferred frees and watch collections (once; not during one)."""
    global _free_thread
    if _free_thread is not None and _free_thread.is_alive():
        return
    if _note_collection not in gc.callbacks:
        gc.callbacks.append(_note_collection)
    _free_thread = threading.Thread(
        target=_free_deferred_forever, name="dask-rmm deferred RMM frees", daemon=True
    )
    _free_thread.start()


def _require_device_memory(mr: Any, device: int) -> None:
    if getattr(mr, "is_host_memory", False):
        raise ValueError(
            f"RMM's allocations on device {device} cannot be served by {mr!r}: it hands out host "
            "memory (base_resource='system'); RMM's callers need device memory"
        )


class _Installation(NamedTuple):
    """What :func:`set_rmm_callback_resource` changed on one device."""

    forwarder: RMMForwarder
    #: What RMM's per-device resource is set to (the cache's top, or the callback resource).
    callback_resource: Any
    rmm_previous: Any
    cache: RMMPoolCache | None = None


_lock = threading.Lock()
#: device -> the installation RMM's per-device resource is (or was last) set to.
_installed: dict[int, _Installation] = {}
#: Uninstalled or replaced installations, kept for the life of the process (a few hundred bytes
#: each): RMM's buffers (cuDF columns) keep raw pointers to their callbacks, not references.
_retired: list[_Installation] = []


#: The compiled pool's first block, when the stack has room for it (else the pool starts
#: empty); it doubles from there as the library needs more.
RMM_CACHE_INITIAL_SIZE = 64 << 20


class RMMPoolCache:
    """Compiled RMM's pool in front of dask-rmm's stack on ``device``: ``top`` (RMM's per-device
    resource) is RMM's statistics adaptor over a failure-callback adaptor (out of memory:
    :func:`~dask_rmm.allocators.arbitration.make_room`, then RMM retries) over a
    ``PoolMemoryResource`` drawing blocks through ``forwarder`` (``initial_pool_size`` first, if
    the stack can give it), marked :func:`~dask_rmm.allocators.caches.drawing_for_cache`."""

    name = "rmm"

    def __init__(self, device: int, forwarder: RMMForwarder, initial_pool_size: int | None = None):
        rmm = _require_rmm("RMMPoolCache")
        if initial_pool_size is None:
            initial_pool_size = RMM_CACHE_INITIAL_SIZE
        self.device = device
        self.forwarder = forwarder
        self.upstream = rmm.mr.CallbackMemoryResource(self._draw, forwarder.deallocate)
        try:
            self.pool = rmm.mr.PoolMemoryResource(
                self.upstream, initial_pool_size=initial_pool_size
            )
        except MemoryError:  # a small stack: start empty
            self.pool = rmm.mr.PoolMemoryResource(self.upstream, initial_pool_size=0)
        self.failure = rmm.mr.FailureCallbackResourceAdaptor(self.pool, self._out_of_memory)
        _leave_cudf_spilling_to_the_pool()
        self.top = rmm.mr.StatisticsResourceAdaptor(self.failure)
        #: Failed allocations that the callback freed memory for (then retried).
        self.retries = 0

    def _draw(self, *args: Any) -> int:
        with caches.drawing_for_cache():
            return self.forwarder.allocate(*args)

    def _out_of_memory(self, nbytes: int) -> bool:
        """RMM's failure callback: free what can be freed; True to retry. Never raises."""
        try:
            freed = arbitration.make_room(self.device, nbytes, library=self.name).freed
        except BaseException:  # nothing may propagate into C++
            logger.warning("dask-rmm: freeing memory for RMM's pool failed", exc_info=True)
            return False
        if freed > 0:
            self.retries += 1
        return freed > 0

    def statistics(self) -> dict[str, int]:
        """RMM's exact counts of the allocations the pool served: current, peak and total
        bytes and counts."""
        counts: Any = self.top.allocation_counts  # rmm.statistics.Statistics: our field names
        return {k: int(getattr(counts, k)) for k in Statistics.__dataclass_fields__}

    def pool_size(self) -> int:
        """Bytes the pool drew from the stack."""
        return int(self.pool.pool_size())

    def cached_bytes(self, device: int) -> int:
        """Bytes the pool holds from ``device``'s stack without an allocation in them."""
        if device != self.device:
            return 0
        return max(0, self.pool_size() - self.statistics()["current_bytes"])

    def in_use_bytes(self, device: int) -> int:
        """Bytes the pool has handed out on ``device`` (RMM's statistics)."""
        return self.statistics()["current_bytes"] if device == self.device else 0

    def release(self, device: int) -> int:
        """RMM's compiled pool cannot shrink: nothing is given back (0)."""
        return 0

    def __repr__(self) -> str:
        return f"<RMMPoolCache device={self.device} pool_size={self.pool_size()}>"


def _require_rmm(what: str):
    if _rmm is None:
        raise ImportError(
            f"{what} needs the compiled RMM package ('rmm'), which is not importable here "
            f"({_library_import_error}); install {RMM_REQUIREMENT} "
            "(pip install 'dask-rmm[rmm]') or drop 'rmm' from the allocators"
        ) from _library_import_error
    return _rmm


def _target_devices(devices: Iterable[int] | None) -> list[int]:
    """The devices to install on; their dask-rmm resources exist afterwards (a device that does
    not exist raises ValueError here, before anything changes)."""
    if devices is None:
        if found := registry.registered_devices():
            return found
        registry.get_current_device_resource()  # makes the current device's default resource
        return registry.registered_devices()
    targets = sorted(set(devices))
    for device in targets:
        registry.get_per_device_resource(device)
    return targets


def set_rmm_callback_resource(
    devices: Iterable[int] | None = None, cache: bool = True
) -> list[int]:
    """Serve the compiled RMM's allocations on ``devices`` (default: every device with a
    dask-rmm resource, else the current one) from dask-rmm's resources, through
    :class:`RMMPoolCache` (``cache=True``) or the callbacks alone; the devices set. RMM's
    previous resources are kept for :func:`reset_rmm_callback_resource` (a device forwarding
    already is left as is, one whose resource was replaced since gets a new one). ImportError
    without ``rmm``; ValueError, changing nothing, for a device that does not exist or whose
    dask-rmm resource is host memory. Needs a CUDA device:

    >>> from dask_rmm.allocators.rmm_interop import (
    ...     reset_rmm_callback_resource, set_rmm_callback_resource)
    >>> set_rmm_callback_resource()  # doctest: +SKIP
    [0]
    >>> reset_rmm_callback_resource()  # doctest: +SKIP
    """
    rmm = _require_rmm("set_rmm_callback_resource()")

    with _lock:
        targets = _target_devices(devices)
        for device in targets:  # check every device before changing any
            _require_device_memory(registry.get_per_device_resource(device), device)
        _start_free_thread()
        changed: list[tuple[int, _Installation | None]] = []
        try:
            for device in targets:
                current = rmm.mr.get_per_device_resource(device)
                old = _installed.get(device)
                previous = current
                if old is not None and current is old.callback_resource:
                    if (old.cache is not None) == bool(cache):
                        continue
                    previous = old.rmm_previous
                forwarder = RMMForwarder(device)
                tier = RMMPoolCache(device, forwarder) if cache else None
                callback = (
                    tier.top
                    if tier is not None
                    else rmm.mr.CallbackMemoryResource(forwarder.allocate, forwarder.deallocate)
                )
                rmm.mr.set_per_device_resource(device, callback)
                changed.append((device, old))
                _installed[device] = _Installation(forwarder, callback, previous, tier)
                if tier is not None:
                    caches.register_cache(tier)
        except BaseException:
            for device, old in reversed(changed):
                new = _installed.pop(device)
                rmm.mr.set_per_device_resource(
                    device, old.callback_resource if old is not None else new.rmm_previous
                )
                _retire(new)
                if old is not None:
                    _installed[device] = old
            raise
        for _device, old in changed:
            if old is not None:
                _retire(old)
    return targets


def _leave_cudf_spilling_to_the_pool() -> None:
    """Turn cuDF's spill on demand off (its option; its environment variable before cuDF is
    imported): cuDF refuses a second failure-callback adaptor on RMM's resource (ValueError at
    its first buffer), and :class:`RMMPoolCache`'s spills cuDF's buffers first (``make_room``)."""
    if (set_option := getattr(sys.modules.get("cudf"), "set_option", None)) is not None:
        set_option("spill_on_demand", False)
    else:
        os.environ["CUDF_SPILL_ON_DEMAND"] = "off"


def _retire(installation: _Installation) -> None:
    if installation.cache is not None:
        caches.unregister_cache(installation.cache)
    _retired.append(installation)


def get_rmm_cache(device: int) -> RMMPoolCache | None:
    """The compiled RMM cache serving ``device``'s RMM allocations, or None."""
    installation = _installed.get(device)
    return None if installation is None else installation.cache


def reset_rmm_callback_resource(devices: Iterable[int] | None = None) -> None:
    """Give RMM back, on ``devices`` (default: all set), the resources it had before
    :func:`set_rmm_callback_resource`, unless someone else replaced them since. Live buffers
    stay valid and are freed to the dask-rmm resource that allocated them."""
    if _rmm is None:
        return
    with _lock:
        for device in sorted(_installed) if devices is None else list(devices):
            installation = _installed.pop(device, None)
            if installation is None:
                continue
            if _rmm.mr.get_per_device_resource(device) is installation.callback_resource:
                _rmm.mr.set_per_device_resource(device, installation.rmm_previous)
            _retire(installation)


def get_rmm_forwarder(device: int) -> RMMForwarder | None:
    """The forwarder RMM's resource of ``device`` calls, or None when it does not forward."""
    installation = _installed.get(device)
    if installation is None or _rmm is None:
        return None
    if _rmm.mr.get_per_device_resource(device) is not installation.callback_resource:
        return None
    return installation.forwarder
