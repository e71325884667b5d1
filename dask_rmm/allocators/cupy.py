"""CuPy allocators on the current device resource of the device CuPy is on, on CuPy's current
stream (pinned host memory is not covered): :class:`CupyPoolCache` (the default: CuPy's own
``MemoryPool`` drawing blocks from the resource), ``lean_cupy_allocator`` (every allocation
through the resource), RMM's ``rmm_cupy_allocator`` (the same, owned by a
:class:`~dask_rmm.DeviceBuffer`: one object and one call more, bench/cupy_churn.py), and
:func:`watch_cupy_allocations` (a watcher told each allocation's size, whatever the allocator).
"""

from __future__ import annotations

import gc
import logging
import sys
import threading
from collections.abc import Callable
from typing import Any

from dask_rmm.allocators import caches
from dask_rmm.device_buffer import DeviceBuffer, _free_failed
from dask_rmm.mr.registry import get_per_device_resource as _get_per_device_resource
from dask_rmm.mr.registry import lookup_per_device_resource as _lookup_resource
from dask_rmm.stream import PER_THREAD_HANDLE as _LAST_DEFAULT_HANDLE
from dask_rmm.stream import cached_stream as _stream_for
from dask_rmm.stream import handle_streams as _streams

__all__ = [
    "CupyPoolCache",
    "ResourceMemory",
    "get_cupy_cache",
    "lean_cupy_allocator",
    "reset_cupy_allocator",
    "rmm_cupy_allocator",
    "set_cupy_allocator",
    "unwatch_cupy_allocations",
    "watch_cupy_allocations",
]

logger = logging.getLogger(__name__)

try:
    import cupy as _cupy
except ImportError as _e:  # cupy is optional
    _cupy = None
    _library_import_error: ImportError | None = _e
else:
    _library_import_error = None


class _ReleasedOnThisThread(threading.local):
    counting: list[int] | None = None  # sizes given back while CupyPoolCache.release counts


_released = _ReleasedOnThisThread()


if _cupy is not None:
    _get_device_id = _cupy.cuda.device.get_device_id
    _get_current_stream = _cupy.cuda.get_current_stream
    _UnownedMemory = _cupy.cuda.memory.UnownedMemory
    _MemoryPointer = _cupy.cuda.memory.MemoryPointer
    _adopt = DeviceBuffer._adopt

    def rmm_cupy_allocator(nbytes: int) -> _cupy.cuda.MemoryPointer:
        """RMM's CuPy allocator: ``nbytes`` from the current device resource, owned by a
        :class:`~dask_rmm.DeviceBuffer` that frees it when CuPy drops the memory.

        >>> import cupy
        >>> from dask_rmm.allocators.cupy import rmm_cupy_allocator
        >>> cupy.cuda.set_allocator(rmm_cupy_allocator)
        """
        device_id = _get_device_id()
        cupy_stream = _get_current_stream(device_id)
        handle = cupy_stream.ptr
        stream = _streams.get(handle)
        if stream is None or (handle > _LAST_DEFAULT_HANDLE and stream._owner is not cupy_stream):
            stream = _stream_for(handle, cupy_stream)
        mr = _lookup_resource(device_id)
        if mr is None:
            mr = _get_per_device_resource(device_id)
        ptr = mr.allocate(nbytes, stream)
        return _MemoryPointer(
            _UnownedMemory(ptr, nbytes, _adopt(ptr, nbytes, stream, mr), device_id), 0
        )

    class ResourceMemory(_cupy.cuda.memory.UnownedMemory):
        """What :func:`lean_cupy_allocator` hands CuPy: an ``UnownedMemory`` holding the
        ``resource`` and :class:`~dask_rmm.stream.Stream` it came from, which it frees to when
        CuPy drops it (a failing free is logged, never raised)."""

        __slots__ = ("resource", "stream")

        # Bound as defaults: at interpreter shutdown module globals may already be None.
        def __del__(
            self, _free_failed=_free_failed, _finalizing=sys.is_finalizing, _released=_released
        ):
            ptr = self.ptr
            if ptr and not _finalizing():
                try:
                    self.resource.deallocate(ptr, self.size, self.stream)
                except Exception as e:
                    _free_failed(ptr, self.size, e, "CuPy memory")
                else:
                    counting = _released.counting
                    if counting is not None:
                        counting.append(self.size)

    def lean_cupy_allocator(nbytes: int) -> _cupy.cuda.MemoryPointer:
        """:func:`rmm_cupy_allocator` without a DeviceBuffer: the memory object is a
        :class:`ResourceMemory`.

        >>> import cupy
        >>> from dask_rmm.allocators.cupy import lean_cupy_allocator
        >>> cupy.cuda.set_allocator(lean_cupy_allocator)
        """
        device_id = _get_device_id()
        cupy_stream = _get_current_stream(device_id)
        handle = cupy_stream.ptr
        stream = _streams.get(handle)
        if stream is None or (handle > _LAST_DEFAULT_HANDLE and stream._owner is not cupy_stream):
            stream = _stream_for(handle, cupy_stream)
        mr = _lookup_resource(device_id)
        if mr is None:
            mr = _get_per_device_resource(device_id)
        ptr = mr.allocate(nbytes, stream)
        mem = _ResourceMemory(ptr, nbytes, None, device_id)
        mem.resource = mr
        mem.stream = stream
        return _MemoryPointer(mem, 0)

    _ResourceMemory = ResourceMemory

else:

    def rmm_cupy_allocator(nbytes: int):
        """A CuPy allocator that takes memory from the current device resource (needs CuPy)."""
        _require_cupy()

    lean_cupy_allocator = rmm_cupy_allocator
    # Needs CuPy; the name stays importable. mypy sees the class of the branch above.
    ResourceMemory = None  # type: ignore[assignment,misc]


class CupyPoolCache:
    """CuPy's own ``MemoryPool`` (``pool``) drawing its blocks from the current device resource
    (:func:`lean_cupy_allocator`). Out of memory, it gives its free blocks back and tries once
    more; then the stack's ``OutOfMemoryError`` reaches the caller.

    >>> import cupy
    >>> from dask_rmm.allocators.cupy import CupyPoolCache
    >>> cache = CupyPoolCache()
    >>> cupy.cuda.set_allocator(cache.pool.malloc)  # doctest: +SKIP
    """

    name = "cupy"

    def __init__(self) -> None:
        cupy = _require_cupy()
        self.pool = cupy.cuda.MemoryPool(allocator=self._draw)

    def _draw(self, nbytes: int) -> Any:
        try:
            return lean_cupy_allocator(nbytes)
        except MemoryError:  # not kept: its traceback would keep the caller's arrays alive
            # As CuPy's pool on cudaMalloc's out-of-memory: free blocks back (cycles collected if
            # need be), once more; the pressure layer's error, if any, passes on to the caller.
            device = _get_device_id()
            if not self.release(device):
                gc.collect()
                if not self.release(device):
                    raise
        return lean_cupy_allocator(nbytes)

    def cached_bytes(self, device: int) -> int:
        """Bytes CuPy's pool holds free on ``device`` (drawn from the stack, in no array)."""
        with _cupy.cuda.Device(device):
            return int(self.pool.free_bytes())

    def in_use_bytes(self, device: int) -> int:
        """Bytes of CuPy's pool on ``device`` that arrays hold."""
        with _cupy.cuda.Device(device):
            return int(self.pool.used_bytes())

    def release(self, device: int) -> int:
        """Give CuPy's free blocks on ``device`` back to the stack (blocks partly in use stay);
        the bytes given back."""
        # Counted as the blocks go back, on this thread: total_bytes() before and after also
        # moves with other threads' draws, so a release could read as 0 (it stays a floor).
        counting: list[int] = []
        _released.counting = counting
        try:
            with _cupy.cuda.Device(device):
                before = int(self.pool.total_bytes())
                self.pool.free_all_blocks()
                difference = before - int(self.pool.total_bytes())
        finally:
            _released.counting = None
        return max(sum(counting), difference, 0)

    def __repr__(self) -> str:
        return f"<CupyPoolCache {self.pool!r}>"


_previous_allocators: list[Any] = []
#: The process's CuPy cache, made by the first :func:`set_cupy_allocator` that asks for one.
_cache: CupyPoolCache | None = None


def _require_cupy():
    if _cupy is None:
        raise ImportError(
            "CuPy is not importable here "
            f"({_library_import_error}); install cupy-cuda13x (pip install 'dask-rmm[cupy]')"
        ) from _library_import_error
    return _cupy


def _ours(allocator: Any) -> bool:
    if allocator is lean_cupy_allocator or allocator is rmm_cupy_allocator:
        return True
    return _cache is not None and allocator == _cache.pool.malloc


def get_cupy_cache() -> CupyPoolCache | None:
    """The CuPy cache :func:`set_cupy_allocator` installed, or None."""
    return _cache


def set_cupy_allocator(cache: bool = True) -> None:
    """Point CuPy's allocations at the current device resource: through :class:`CupyPoolCache`
    (``cache=True``) or one by one through ``lean_cupy_allocator``. Remembers CuPy's previous
    allocator for :func:`reset_cupy_allocator`; again with the same choice: nothing; with the
    other: a switch. ImportError without CuPy.

    >>> from dask_rmm.allocators.cupy import reset_cupy_allocator, set_cupy_allocator
    >>> set_cupy_allocator()
    >>> reset_cupy_allocator()
    """
    global _cache
    _require_cupy()
    current = _current_allocator()
    if cache:
        if _cache is None:
            _cache = CupyPoolCache()
        wanted = _cache.pool.malloc
        if current == wanted:
            return
        _set_allocator(wanted)
        caches.register_cache(_cache)
    else:
        if current is lean_cupy_allocator or current is rmm_cupy_allocator:
            return
        _set_allocator(lean_cupy_allocator)
    if _ours(current) and _previous_allocators:  # switched between our two ways
        _drop_cache(keep_allocator=True)
        return
    _previous_allocators.append(current)


def _drop_cache(keep_allocator: bool = False) -> None:
    """Give the cache's free blocks back; unlist it once it holds none. Arrays still holding
    blocks give them back to the cache when CuPy frees them: until then it stays listed, so
    its free bytes are still reported and still given back under memory pressure."""
    if _cache is None or (keep_allocator and _current_allocator() == _cache.pool.malloc):
        return
    try:
        _cache.pool.free_all_blocks()
        holds = _cache.pool.total_bytes() > 0
    except Exception:  # no device (a pool that never allocated), or a teardown that must go on
        logger.debug("dask-rmm: freeing CuPy's cached blocks failed", exc_info=True)
        holds = False
    if not holds:
        caches.unregister_cache(_cache)


def reset_cupy_allocator() -> None:
    """Give CuPy back the allocator it had before :func:`set_cupy_allocator` (nothing if it
    was not called, or someone else changed CuPy's allocator since)."""
    if _cupy is None or not _previous_allocators:
        return
    if not _ours(_current_allocator()):
        _previous_allocators.clear()
        return
    _set_allocator(_previous_allocators.pop())
    _drop_cache()


# -- watching CuPy's allocations -----------------------------------------------------------------

#: Owner -> watcher: called with each allocation's size after CuPy's allocator returned.
_watchers: dict[Any, Callable[[int], object]] = {}
#: The wrapper installed as CuPy's allocator while some owner watches (its ``__wrapped__``: the
#: allocator it calls), else None.
_wrapper: Any = None


def _current_allocator() -> Any:
    """CuPy's allocator (on this thread: inside ``using_allocator``, that block's, and CuPy's
    ``set_allocator`` then refuses), seen through the watch."""
    allocator = _cupy.cuda.get_allocator()
    return allocator.__wrapped__ if allocator is _wrapper and _wrapper is not None else allocator


def _set_allocator(allocator: Any) -> None:
    """Make ``allocator`` CuPy's, wrapped for the watchers there are now."""
    global _wrapper
    wrapper = _watched(allocator) if _watchers else None
    _cupy.cuda.set_allocator(wrapper or allocator)  # raises inside using_allocator: unchanged
    _wrapper = wrapper


def _watched(allocate: Callable[[int], Any]) -> Callable[[int], Any]:
    # Runs on every CuPy allocation while watched (a MemoryPool's malloc too): ~0.2 us; made
    # again when the watchers change, so that one watcher is called directly.
    watchers = tuple(_watchers.values())
    if len(watchers) == 1:
        (watcher,) = watchers
    else:

        def watcher(nbytes: int) -> None:
            for each in watchers:
                try:
                    each(nbytes)
                except Exception:
                    _watch_failed(each)

    def _watched_malloc(nbytes: int) -> Any:
        memptr = allocate(nbytes)
        try:
            watcher(nbytes)
        except Exception:  # an allocation that succeeded never fails here
            _watch_failed(watcher)
        return memptr

    _watched_malloc.__wrapped__ = allocate  # type: ignore[attr-defined]
    return _watched_malloc


_failed_watchers: set[int] = set()  # ids of the watchers that raised (while watching)


def _watch_failed(watcher: Callable[[int], object]) -> None:
    if id(watcher) not in _failed_watchers:  # once per watcher: this is every allocation
        _failed_watchers.add(id(watcher))
        logger.warning("dask-rmm: watching a CuPy allocation failed (%r)", watcher, exc_info=True)


def watch_cupy_allocations(owner: Any, watcher: Callable[[int], object]) -> None:
    """Call ``watcher(nbytes)`` after each allocation through CuPy's allocator, whichever it is
    (a ``MemoryPool``'s cache hits included; not inside ``using_allocator`` blocks, nor frees),
    until :func:`unwatch_cupy_allocations` with the same ``owner`` (again: replaced). Kept across
    :func:`set_cupy_allocator`; a watcher that raises is logged once. ImportError without CuPy.

    >>> from dask_rmm.allocators.cupy import unwatch_cupy_allocations, watch_cupy_allocations
    >>> sizes = []
    >>> watch_cupy_allocations("me", sizes.append)
    >>> unwatch_cupy_allocations("me")
    """
    _require_cupy()
    current, before = _current_allocator(), _watchers.get(owner)
    _watchers[owner] = watcher
    try:
        _set_allocator(current)
    except BaseException:
        if before is None:
            del _watchers[owner]
        else:
            _watchers[owner] = before
        raise


def unwatch_cupy_allocations(owner: Any) -> None:
    """Stop ``owner``'s watch; the last one gives CuPy back the allocator the watch wrapped
    (one set since outside dask-rmm stays, unwatched). Nothing when ``owner`` does not watch."""
    global _wrapper
    watcher = _watchers.pop(owner, None)
    if watcher is None:
        return
    _failed_watchers.discard(id(watcher))
    if _wrapper is not None and _cupy.cuda.get_allocator() is _wrapper:
        _set_allocator(_wrapper.__wrapped__)
    elif not _watchers:
        _wrapper = None
