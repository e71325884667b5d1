"""The registry of library caches in front of dask-rmm's stacks (CuPy's and compiled RMM's
pools) and beside them (``outside_stack``: PyTorch's, sharing the pool's maximum): what they
hold and how to make them give free blocks back; and the libraries that spill their own objects
(cuDF, :func:`spill_libraries`) after the caches gave back, before task outputs spill.
"""

from __future__ import annotations

import contextlib
import logging
import sys
import threading
from collections.abc import Callable, Iterator
from typing import Any, NamedTuple, Protocol

__all__ = [
    "LibraryBytes",
    "LibraryCache",
    "cached_bytes",
    "library_bytes",
    "outside_in_use_bytes",
    "drawing_for_cache",
    "library_caches",
    "register_cache",
    "release_cached",
    "release_cached_by_library",
    "set_oom_handler",
    "spill_libraries",
    "spilled_by_libraries",
    "unregister_cache",
]

logger = logging.getLogger(__name__)


class LibraryCache(Protocol):
    """A library's own allocator cache drawing its blocks from dask-rmm's stack."""

    #: The library: ``"cupy"`` or ``"rmm"``.
    name: str

    def cached_bytes(self, device: int) -> int:
        """Bytes the cache holds from ``device``'s stack without handing them to arrays."""
        ...

    def release(self, device: int) -> int:
        """Give the cache's free blocks on ``device`` back to the stack; the bytes given back."""
        ...

    # Optional: ``in_use_bytes(device)`` (bytes in the library's objects), and, for a cache
    # outside the stack, ``outside_stack = True``, ``reserved_bytes(device)`` and
    # ``budget(device)`` (a :class:`dask_rmm.mr.budget.BudgetSharer`).


class LibraryBytes(NamedTuple):
    """What one library holds on one device: bytes in its objects, bytes free in its cache,
    and whether those come from the stack (in its ``current_bytes``) or beside it."""

    in_use_bytes: int
    cached_bytes: int
    outside_stack: bool


_lock = threading.Lock()
_caches: list[LibraryCache] = []
_oom_handlers: dict[int, Callable[[int], int]] = {}
_drawing = threading.local()


def register_cache(cache: LibraryCache) -> None:
    """List ``cache`` (idempotent)."""
    with _lock:
        if not any(c is cache for c in _caches):
            _caches.append(cache)


def unregister_cache(cache: LibraryCache) -> None:
    """Take ``cache`` off the list (nothing if it is not listed)."""
    with _lock:
        _caches[:] = [c for c in _caches if c is not cache]


def library_caches() -> list[LibraryCache]:
    """The registered caches, oldest first."""
    with _lock:
        return list(_caches)


def cached_bytes(device: int) -> dict[str, int]:
    """Free bytes each library's cache inside the stack holds from ``device``'s stack, by
    library name."""
    out: dict[str, int] = {}
    for cache in library_caches():
        if not _is_outside(cache):
            n = bytes_or_zero(cache.cached_bytes, device, failed=f"reading {cache.name}'s cache")
            out[cache.name] = out.get(cache.name, 0) + n
    return out


def _is_outside(cache: Any) -> bool:
    return bool(getattr(cache, "outside_stack", False))


def library_bytes(device: int) -> dict[str, LibraryBytes]:
    """Per library name, what its cache holds on ``device`` (:class:`LibraryBytes`). A cache
    that cannot tell its bytes in use counts 0 there. Never raises (a failing cache is left
    out, logged at debug level)."""
    out: dict[str, LibraryBytes] = {}
    for cache in library_caches():
        try:
            cached = int(cache.cached_bytes(device))
            in_use_fn = getattr(cache, "in_use_bytes", None)
            in_use = int(in_use_fn(device)) if in_use_fn is not None else 0
        except Exception:
            logger.debug("dask-rmm: %s cache could not tell its bytes", cache.name, exc_info=True)
            continue
        if (prev := out.get(cache.name)) is not None:
            in_use, cached = in_use + prev.in_use_bytes, cached + prev.cached_bytes
        out[cache.name] = LibraryBytes(max(0, in_use), max(0, cached), _is_outside(cache))
    return out


def outside_in_use_bytes(device: int) -> int:
    """Bytes in the objects of caches outside the stack on ``device`` (PyTorch's tensors): what
    a device memory limit counts beside the stack's own."""
    outside: list[Any] = [c for c in library_caches() if _is_outside(c)]
    return sum(bytes_or_zero(c.in_use_bytes, device, failed=f"reading {c.name}") for c in outside)


def release_cached(device: int) -> int:
    """Make every library cache give its free blocks on ``device`` back to the stack; the bytes
    given back. What spill-on-OOM and the limit check do before spilling anything."""
    return sum(release_cached_by_library(device).values())


def bytes_or_zero(call: Callable[[int], Any], arg: int, *, failed: str) -> int:
    """``int(call(arg))``: bytes a cache holds or gave back, or a library spilled (None: 0); 0
    (logged with ``failed``; reading: at debug level) when it raises, so that reading the
    caches never raises and making room never fails on one library."""
    try:
        return int(call(arg) or 0)
    except Exception:
        level = logging.DEBUG if failed.startswith("reading") else logging.WARNING
        logger.log(level, "dask-rmm: %s failed", failed, exc_info=True)
        return 0


def release_cached_by_library(device: int, *, outside: bool = True) -> dict[str, int]:
    """:func:`release_cached` by library name (those that gave some back); ``outside=False``
    leaves the caches outside the stack (PyTorch's: ``empty_cache`` synchronizes the device, so
    not on the event loop) alone. Never raises: a cache that fails to release counts 0 (logged)."""
    released: dict[str, int] = {}
    for cache in library_caches():
        if not outside and _is_outside(cache):
            continue
        n = bytes_or_zero(cache.release, device, failed=f"releasing the {cache.name} cache")
        if n > 0:
            released[cache.name] = released.get(cache.name, 0) + n
    return released


@contextlib.contextmanager
def drawing_for_cache() -> Iterator[None]:
    """Mark this thread as drawing a block for a library cache: a failure then reaches the cache
    at once, without spilling (the cache may back off, or make room itself)."""
    depth = getattr(_drawing, "depth", 0)
    _drawing.depth = depth + 1
    try:
        yield
    finally:
        _drawing.depth = depth


def is_drawing_for_cache() -> bool:
    """Whether this thread is inside :func:`drawing_for_cache`."""
    return getattr(_drawing, "depth", 0) > 0


def set_oom_handler(device: int, handler: Callable[[int], int] | None) -> None:
    """``handler(nbytes) -> bytes freed`` (spilling) for caches of ``device`` that ran out of
    memory; None removes it. The memory-pressure layer sets it with ``spill_on_oom``."""
    with _lock:
        if handler is None:
            _oom_handlers.pop(device, None)
        else:
            _oom_handlers[device] = handler


def oom_handler(device: int) -> Callable[[int], int] | None:
    """The handler :func:`set_oom_handler` set for ``device``, or None."""
    return _oom_handlers.get(device)


class CudfSpilling:
    """cuDF's spill manager (``cudf.core.buffer.spill_manager.get_global_manager()``, set when
    cuDF's spilling is on), if cuDF was imported: nothing is imported here."""

    name = "cudf"

    def manager(self) -> Any:
        # Looked up, never imported: an import from here could meet another thread's import
        # lock on cuDF and raise _DeadlockError (bench/ooc_merge.py).
        module = sys.modules.get("cudf.core.buffer.spill_manager")
        get_global_manager = getattr(module, "get_global_manager", None)
        return None if get_global_manager is None else get_global_manager()

    def spill(self, nbytes: int) -> int:
        """Have cuDF spill its least recently used spillable buffers adding up to ``nbytes``;
        the bytes spilled."""
        manager = self.manager()
        return 0 if manager is None else int(manager.spill_device_memory(nbytes=int(nbytes)))

    def spilled_and_spillable(self) -> tuple[int, int]:
        """Bytes of cuDF's buffers on host now, and of those on the device it could spill."""
        manager = self.manager()
        if manager is None:
            return 0, 0
        spilled = spillable = 0
        for buf in manager.buffers():
            if buf.is_spilled:
                spilled += int(buf.size)
            elif buf.spillable:
                spillable += int(buf.size)
        return spilled, spillable


#: The libraries that spill their own objects (cuDF's); replaced by tests.
spilling_libraries: list[Any] = [CudfSpilling()]


def spill_libraries(nbytes: int) -> dict[str, int]:
    """Have the libraries that spill their own objects (cuDF, when its spilling is on) spill
    ``nbytes``, one after the other until that many are spilled; the bytes each spilled (those
    that spilled some). Never raises: a library that fails counts 0 (logged)."""
    spilled: dict[str, int] = {}
    for library in spilling_libraries:
        left = int(nbytes) - sum(spilled.values())
        if left <= 0:
            break
        n = bytes_or_zero(library.spill, left, failed=f"{library.name}'s spilling")
        if n > 0:
            spilled[library.name] = n
    return spilled


def spilled_by_libraries() -> dict[str, tuple[int, int]]:
    """Per library that spills its own objects and has any: ``(bytes spilled, bytes it could
    spill)``. Never raises (a library that cannot tell is left out, logged at debug level)."""
    out: dict[str, tuple[int, int]] = {}
    for library in spilling_libraries:
        try:
            figures = library.spilled_and_spillable()
        except Exception:
            logger.debug("dask-rmm: %s could not tell its bytes", library.name, exc_info=True)
            continue
        if any(figures):
            out[library.name] = (int(figures[0]), int(figures[1]))
    return out


def _reset_for_tests() -> None:
    """Forget every cache and handler (the test suite's fixture calls it after each test)."""
    with _lock:
        _caches.clear()
        _oom_handlers.clear()
