"""PyTorch allocators (docs/pytorch.md): its own caching allocator capped to the room the
worker's pool leaves (:class:`TorchCache`, the default), or ``rmm_torch_allocator``, ctypes
callbacks allocating every tensor from the current device resource (the exact path; None without
a CUDA-enabled torch, as RMM's; failures: docs/rmm-differences.md, PyTorch)."""

from __future__ import annotations

import contextlib
import ctypes
import functools
import gc
import inspect
import logging
import sys
import threading
import weakref
from types import FrameType
from typing import Any

from dask_rmm.allocators import caches
from dask_rmm.mr.base import upstreams
from dask_rmm.mr.pool import pool_behind
from dask_rmm.mr.registry import get_per_device_resource as _get_per_device_resource
from dask_rmm.mr.registry import lookup_per_device_resource, registered_devices
from dask_rmm.mr.trim import trim_resource
from dask_rmm.stream import Stream
from dask_rmm.stream import cached_stream as _stream_for
from dask_rmm.stream import handle_streams as _streams

__all__ = [
    "TorchCache",
    "get_torch_cache",
    "last_allocation_error",
    "reset_torch_allocator",
    "rmm_torch_allocator",
    "set_torch_allocator",
]

logger = logging.getLogger(__name__)

#: ``void* (size_t size, int device, cudaStream_t stream)``, PyTorch's allocation callback.
ALLOC_FN_TYPE = ctypes.CFUNCTYPE(ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_void_p)
#: ``void (void* ptr, size_t size, int device, cudaStream_t stream)``, its free callback.
FREE_FN_TYPE = ctypes.CFUNCTYPE(
    None, ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_void_p
)

# Pointer -> the resource it came from, also after the current one was replaced (atomic ops).
_live: dict[int, Any] = {}
_errors = threading.local()
# Idents of the threads with a failure pending (armed): what the callbacks' fast path reads.
_armed_threads: set[int] = set()


def allocate(size: int, device: int, stream: int | None) -> int | None:
    """The allocation callback (also callable from Python): a pointer, or None (NULL) on failure."""
    # Every tensor's path: no thread-local state unless some thread has a failure pending.
    if _armed_threads:
        _disarm()  # PyTorch asks again: a hook not fired yet is stale (must not fire below)
    s = None
    try:
        s = _streams.get(stream or 0) or _stream_for(stream or 0)
        mr = _get_per_device_resource(device)
        ptr = mr.allocate(size, s)
        if ptr:
            _live[ptr] = mr
        return ptr or None
    except BaseException as e:  # never into C: PyTorch sees NULL
        return _allocation_failed(e, size, device, stream, s)


def _allocation_failed(
    error: BaseException, size: int, device: int, stream: int | None, s: Stream | None
) -> int | None:
    """After a failed first attempt: collect garbage and retry once (tensors that are garbage
    but not yet collected may hold the memory asked for); on a second failure keep the error,
    log it, arm this thread to raise in the allocating Python call, and return None."""
    try:
        if isinstance(error, MemoryError) and s is not None:
            try:
                gc.collect()
                mr = _get_per_device_resource(device)
                ptr = mr.allocate(size, s)
                if ptr:
                    _live[ptr] = mr
                return ptr or None
            except BaseException as again:
                error = again
        _errors.last = error
        _errors.message = (
            f"rmm_torch_allocator: allocating {size} bytes on device {device}, stream "
            f"{stream or 0:#x} failed: {error}"
        )
        logger.warning("%s", _errors.message)
        _raise_when_back_in_python(_errors.message)
    except BaseException:
        pass
    return None


@functools.cache
def _allocation_error_type() -> type[BaseException]:
    """The exception raised in the allocating thread: a ``torch.OutOfMemoryError`` (what
    PyTorch code catches) that is also a ``MemoryError`` and carries dask-rmm's message."""
    try:
        from torch.cuda import OutOfMemoryError as torch_oom

        bases: tuple[type, ...] = (torch_oom, MemoryError)
    except ImportError:
        bases = (MemoryError,)

    # The bases are known only at run time (torch's class when torch is importable).
    class TorchAllocationError(*bases):  # type: ignore[misc]
        """PyTorch asked dask-rmm's resource for memory and did not get it; the message
        is the resource's (``last_allocation_error()`` is the original exception)."""

        def __init__(self, *args):
            if not args:
                args = (getattr(_errors, "message", "rmm_torch_allocator: out of memory"),)
            super().__init__(*args)

    return TorchAllocationError


def _raise_when_back_in_python(message: str) -> None:
    """Have the allocating Python call (e.g. ``torch.empty``) raise ``TorchAllocationError``:
    PyTorch does not check the pointer (NULL becomes a tensor that fails on the device) and an
    exception cannot cross its C frames, so the calling frame gets an opcode trace function
    that raises once the failing call returns (a profile hook as fallback); whichever fires
    first restores the previous tracer and profiler and raises once; events inside the
    callbacks are ignored; a later allocation on the thread disarms."""
    exc_type = _allocation_error_type()
    _disarm()
    _errors.pending = message

    def fire(frame, event, arg):  # also the caller frame's f_trace: every opcode, line, return
        if frame.f_code.co_filename == __file__ or _inside_callback(frame):
            return fire
        pending = getattr(_errors, "pending", None)
        _disarm()
        if pending is not None:
            raise exc_type(pending)
        return None

    def global_trace(frame, event, arg):  # new frames are not traced
        return None

    def hook(frame, event, arg):
        if event in ("c_return", "c_exception", "return"):
            fire(frame, event, arg)

    caller: FrameType | None = inspect.currentframe()
    while caller is not None and caller.f_code.co_filename == __file__:
        caller = caller.f_back
    _armed_threads.add(threading.get_ident())
    _errors.armed = (
        sys.gettrace(),
        sys.getprofile(),
        caller,
        getattr(caller, "f_trace", None),
        getattr(caller, "f_trace_opcodes", False),
        global_trace,
        hook,
    )
    if caller is not None:  # not a real frame (tests), or no tracing: only the profile hook
        with contextlib.suppress(AttributeError, TypeError, ValueError):
            caller.f_trace = fire
            caller.f_trace_opcodes = True
            sys.settrace(global_trace)
    sys.setprofile(hook)


def _disarm() -> None:
    """Undo this thread's arming (tracer, profiler, the caller frame's trace) and forget its
    pending error; what another tool set meanwhile is left alone."""
    _errors.pending = None
    armed = getattr(_errors, "armed", None)
    if armed is None:
        return
    _errors.armed = None
    _armed_threads.discard(threading.get_ident())
    trace, profile, caller, f_trace, f_trace_opcodes, global_trace, hook = armed
    if sys.getprofile() is hook:
        sys.setprofile(profile)
    with contextlib.suppress(AttributeError, TypeError, ValueError):
        if sys.gettrace() is global_trace:
            sys.settrace(trace)
        if caller is not None:
            caller.f_trace = f_trace
            caller.f_trace_opcodes = f_trace_opcodes


def deallocate(ptr: int | None, size: int, device: int, stream: int | None) -> None:
    """The free callback (also callable from Python); logs, never raises."""
    if not ptr:
        return
    try:
        s = _streams.get(stream or 0) or _stream_for(stream or 0)
        mr = _live.pop(ptr, None)
        if mr is None:
            mr = _get_per_device_resource(device)
        mr.deallocate(ptr, size, s)
    except BaseException as e:
        try:
            logger.warning(
                "rmm_torch_allocator: freeing %#x (%d bytes) on device %d failed: %r",
                ptr,
                size,
                device,
                e,
            )
        except BaseException:
            pass


#: An event with one of these frames below it happened inside a callback: no hook fires there.
_CALLBACK_CODES = frozenset({allocate.__code__, deallocate.__code__})


def _inside_callback(frame: FrameType | None) -> bool:
    while frame is not None:
        if frame.f_code in _CALLBACK_CODES:
            return True
        frame = frame.f_back
    return False


def last_allocation_error() -> BaseException | None:
    """The exception behind this thread's last failed PyTorch allocation (PyTorch only sees
    NULL), e.g. an :class:`~dask_rmm.mr.OutOfMemoryError` with the pool's numbers."""
    return getattr(_errors, "last", None)


# The C-callable entry points: never deleted, PyTorch keeps their addresses for good.
_alloc_callback = ALLOC_FN_TYPE(allocate)
_free_callback = FREE_FN_TYPE(deallocate)


def callback_addresses() -> tuple[int, int]:
    """``(alloc_fn, free_fn)`` addresses, as ``torch._C._cuda_customAllocator`` takes them."""
    alloc_fn = ctypes.cast(_alloc_callback, ctypes.c_void_p).value
    free_fn = ctypes.cast(_free_callback, ctypes.c_void_p).value
    assert alloc_fn and free_fn  # ctypes callbacks are live C functions: never NULL
    return alloc_fn, free_fn


def _torch_cuda():
    """The torch module, when it has CUDA; ImportError otherwise."""
    try:
        import torch
    except ImportError as e:
        raise ImportError(f"the 'torch' allocator needs torch with CUDA ({e})") from e
    if not torch.cuda.is_available():
        raise ImportError("the 'torch' allocator needs torch with CUDA; torch has no usable CUDA")
    return torch


def _make_allocator():
    """A ``CUDAPluggableAllocator`` over the callbacks, or None without a CUDA-enabled torch
    or its private ``torch._C._cuda_customAllocator`` (the public constructor takes only a .so
    file's path and symbol names; these callbacks live in no .so)."""
    global _library_import_error
    try:
        torch = _torch_cuda()
    except ImportError as e:
        _library_import_error = e
        return None
    from torch.cuda.memory import CUDAPluggableAllocator

    if not hasattr(torch._C, "_cuda_customAllocator"):
        return None

    class PythonCallbackAllocator(CUDAPluggableAllocator):
        """CUDAPluggableAllocator made from C-callable Python callbacks instead of a .so."""

        def __init__(self, alloc_fn: int, free_fn: int):
            self._allocator = torch._C._cuda_customAllocator(alloc_fn, free_fn)

    return PythonCallbackAllocator(*callback_addresses())


#: Why the "torch" allocators cannot be set here (None: they can). A torch without the private
#: ``torch._C._cuda_customAllocator`` still has the cache path (``rmm_torch_allocator`` is None).
_library_import_error: ImportError | None = None
#: Pass to ``torch.cuda.memory.change_current_allocator`` (once, before PyTorch's first CUDA
#: allocation), or use :func:`set_torch_allocator`. None without a CUDA-enabled torch.
rmm_torch_allocator = _make_allocator()
_warned_exact_fallback = False
_installed = False


#: PyTorch's cap is kept this far below the room (its fraction is a float times the device's
#: memory; PyTorch's smallest segment is 2 MiB).
ROOM_MARGIN = 2 << 20


class _TorchDeviceBudget:
    """PyTorch's cache on one device as a :class:`dask_rmm.mr.budget.BudgetSharer`."""

    name = "torch"

    def __init__(self, cache: TorchCache, device: int):
        self.cache = cache
        self.device = device
        #: The room the pool last gave (None: no limit), and the pool (weakly).
        self.room: int | None = None
        self.pool: Any = None

    def reserved_bytes(self) -> int:
        return self.cache.reserved_bytes(self.device)

    def set_room(self, nbytes: int | None) -> None:
        self.room = nbytes
        self.cache.set_cap(self.device, nbytes)

    def release(self) -> int:
        return self.cache.release(self.device)


class TorchCache:
    """PyTorch's own caching allocator, unchanged, as a library cache beside dask-rmm's stack
    (``outside_stack``): read (``memory_allocated``/``memory_reserved``), emptied
    (``empty_cache``) and capped (``set_per_process_memory_fraction``) to the room the worker's
    pool leaves (:meth:`budget`)."""

    name = "torch"
    outside_stack = True

    def __init__(self) -> None:
        self.torch = _torch_cuda()
        self._budgets: dict[int, _TorchDeviceBudget] = {}
        self._totals: dict[int, int] = {}

    def _initialized(self) -> bool:
        return bool(self.torch.cuda.is_initialized())

    def in_use_bytes(self, device: int) -> int:
        """Bytes in PyTorch's tensors on ``device`` (``torch.cuda.memory_allocated``)."""
        if not self._initialized():
            return 0
        return int(self.torch.cuda.memory_allocated(device))

    def reserved_bytes(self, device: int) -> int:
        """Bytes PyTorch's caching allocator holds on ``device`` (``memory_reserved``)."""
        if not self._initialized():
            return 0
        return int(self.torch.cuda.memory_reserved(device))

    def cached_bytes(self, device: int) -> int:
        """Bytes PyTorch holds free in its cache on ``device`` (reserved, in no tensor)."""
        return max(0, self.reserved_bytes(device) - self.in_use_bytes(device))

    def release(self, device: int) -> int:
        """``torch.cuda.empty_cache()`` on ``device``: PyTorch's free segments go back to the
        device; the bytes given back."""
        if not self._initialized():
            return 0
        before = self.reserved_bytes(device)
        with self.torch.cuda.device(device):
            self.torch.cuda.empty_cache()
        return max(0, before - self.reserved_bytes(device))

    def _total(self, device: int) -> int:
        total = self._totals.get(device)
        if total is None:  # what PyTorch's fraction is a fraction of (the device's memory)
            props = self.torch.cuda.get_device_properties(device)
            total = self._totals[device] = int(props.total_memory)
        return total

    def set_cap(self, device: int, nbytes: int | None) -> None:
        """Cap PyTorch's reserved bytes on ``device`` at ``nbytes`` (less
        :data:`ROOM_MARGIN`); None: no cap."""
        total = self._total(device)
        if nbytes is None:
            fraction = 1.0
        else:
            fraction = max(0, min(total, int(nbytes) - ROOM_MARGIN)) / total
        self.torch.cuda.set_per_process_memory_fraction(float(fraction), device)

    def cap(self, device: int) -> int | None:
        """The room last given to PyTorch on ``device`` (None: no cap)."""
        budget = self._budgets.get(device)
        return None if budget is None else budget.room

    def budget(self, device: int) -> _TorchDeviceBudget:
        """This cache on ``device`` as a pool's budget sharer (one object per device)."""
        budgets = self._budgets  # setdefault: one object per device, under the GIL
        return budgets.get(device) or budgets.setdefault(device, _TorchDeviceBudget(self, device))

    def make_room(self, device: int, nbytes: int) -> int:
        """After PyTorch ran out of memory on ``device``: the pool it shares a maximum with gives
        free chunks back until PyTorch's room grew by ``nbytes`` (without one, every pool of the
        device's resource gives its free memory back); the bytes given back."""
        budget = self._budgets.get(device)
        pool = budget.pool() if budget is not None and budget.pool is not None else None
        if pool is not None:
            return int(pool.give_room(nbytes))
        resource = lookup_per_device_resource(device)
        if resource is None:
            return 0
        return sum(r.released_bytes for r in trim_resource(resource, 0, device=device))

    def __repr__(self) -> str:
        return f"<TorchCache devices={sorted(self._budgets)}>"


#: The process's PyTorch cache, made by the first set_torch_allocator(cache=True).
_cache: TorchCache | None = None


def get_torch_cache() -> TorchCache | None:
    """The :class:`TorchCache` :func:`set_torch_allocator` registered, or None."""
    return _cache


def share_torch_budget(device: int, resource: Any) -> None:
    """Make PyTorch's cache on ``device`` share the maximum of the pool in ``resource``'s chain
    (and leave the pool it shared before); no cap without such a pool."""
    if _cache is not None:
        pools = (pool_behind(mr) for mr in upstreams(resource))
        _move_budget(_cache.budget(device), next((p for p in pools if p is not None), None))


def _move_budget(budget: _TorchDeviceBudget, pool: Any) -> None:
    """Make ``budget`` share ``pool``'s maximum, leaving the pool it shared before (None: no
    pool, no cap)."""
    previous = budget.pool() if budget.pool is not None else None
    if previous is not None and previous is not pool:
        previous.stop_sharing(budget)
    budget.pool = None if pool is None else weakref.ref(pool)
    if pool is not None:
        pool.share_budget(budget)
    elif budget.room is not None:
        budget.set_room(None)


def set_torch_allocator(cache: bool = True) -> None:
    """Make PyTorch's CUDA memory part of dask-rmm's budget.

    Parameters
    ----------
    cache : bool
        True (default): PyTorch's caching allocator is registered as a library cache
        (:class:`TorchCache`) sharing the maximum of each device's current pool; call again
        after replacing the resources. False: every tensor through ``rmm_torch_allocator``,
        possible once per process, before PyTorch's first CUDA allocation (then a no-op).

    ImportError without a CUDA-enabled torch; RuntimeError when the other path was set earlier
    in this process (PyTorch cannot switch back), or, for the exact path, when PyTorch already
    allocated CUDA memory with its own allocator.
    """
    global _installed, _cache, _warned_exact_fallback
    if cache:
        if _installed:
            raise RuntimeError(
                "cannot put PyTorch's caching allocator in front of dask-rmm: this process "
                "already routes every PyTorch tensor through rmm_torch_allocator (the exact "
                "path, exact_allocators=['torch']), which PyTorch cannot undo"
            )
        if _cache is None:
            _cache = TorchCache()
        caches.register_cache(_cache)
        for device in registered_devices():
            if (resource := lookup_per_device_resource(device)) is not None:
                share_torch_budget(device, resource)
        return
    if _installed:
        return
    if rmm_torch_allocator is None:
        if _library_import_error is not None:
            raise ImportError(
                "set_torch_allocator needs torch with CUDA; rmm_torch_allocator is None here"
            ) from _library_import_error
        # This PyTorch lacks the private hook of the exact path: its cache path instead, once
        # warned (allocations are then counted per library, not per tensor).
        if not _warned_exact_fallback:
            _warned_exact_fallback = True
            import torch

            logger.warning(
                "dask-rmm: PyTorch %s has no torch._C._cuda_customAllocator, which the exact "
                "path (exact_allocators=['torch']) needs; using PyTorch's own caching allocator "
                "under the worker's budget instead",
                torch.__version__,
            )
        set_torch_allocator(cache=True)
        return
    if _cache is not None and _cache.torch.cuda.is_initialized():
        raise RuntimeError(
            "cannot route PyTorch tensors through dask-rmm one by one (exact_allocators="
            "['torch']): PyTorch's caching allocator already serves this process"
        )
    from torch.cuda.memory import change_current_allocator

    try:
        change_current_allocator(rmm_torch_allocator)
    except RuntimeError as e:
        raise RuntimeError(
            "cannot make PyTorch allocate from dask-rmm: PyTorch already made CUDA allocations "
            "with its own allocator in this process; set the 'torch' allocator before the "
            f"first CUDA tensor (PyTorch said: {e})"
        ) from e
    _installed = True
    _drop_cache()


def _drop_cache() -> None:
    """Unregister the cache and lift PyTorch's caps (the pools stop counting it)."""
    if _cache is None:
        return
    caches.unregister_cache(_cache)
    for device, budget in list(_cache._budgets.items()):
        try:
            _move_budget(budget, None)
        except Exception:  # pragma: no cover - a reset must go on
            logger.warning("dask-rmm: lifting PyTorch's cap on device %d failed", device)


def reset_torch_allocator() -> None:
    """Take PyTorch's cache off dask-rmm's budget (its cap lifted, no longer reported). After
    the exact path, nothing: PyTorch cannot switch allocators back (tensors keep coming from
    dask-rmm's current device resource until the process ends)."""
    _drop_cache()
