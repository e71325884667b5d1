"""Arbitration across libraries (docs/memory-pressure.md): :func:`make_room`, the one order in
which room is made on a device after an allocation failed in any library drawing from its
stack, recorded as :class:`RoomMade`; :func:`is_device_out_of_memory` and :func:`runs_again`,
which tell such errors apart (no library imported). Not here: the caches (:mod:`.caches`),
spilling (:mod:`dask_rmm.pressure`), retrying a task (the worker side).
"""

from __future__ import annotations

import functools
import re
import threading
import time
from collections import deque
from dataclasses import asdict, dataclass, field
from typing import Any

from dask_rmm.allocators import caches

__all__ = [
    "RoomMade",
    "is_device_out_of_memory",
    "make_room",
    "recent_rooms",
    "requested_bytes",
    "runs_again",
]

#: Records kept per process (the newest).
MAX_RECORDS = 64

_lock = threading.Lock()
_records: deque[RoomMade] = deque(maxlen=MAX_RECORDS)


@dataclass(frozen=True)
class RoomMade:
    """What was freed on ``device`` after ``library`` failed to allocate ``requested`` bytes."""

    device: int
    requested: int
    #: The library whose allocation failed ("cupy", "rmm", "torch", "task", ...).
    library: str
    #: Bytes each library's cache gave back (libraries that gave nothing left out).
    released: dict[str, int] = field(default_factory=dict)
    #: Bytes of task outputs moved to host memory.
    spilled: int = 0
    time: float = 0.0

    @property
    def freed(self) -> int:
        """All bytes made free: given back by caches, plus spilled."""
        return sum(self.released.values()) + self.spilled

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def make_room(device: int, nbytes: int, *, library: str, spill: bool = True) -> RoomMade:
    """Make room for ``nbytes`` on ``device`` after ``library`` failed to allocate them: the
    caches give their free blocks back, then (when ``spill`` and the worker spills on
    out-of-memory) task outputs adding up to ``nbytes`` are spilled; the caller retries. Never
    raises; returns (and keeps, :func:`recent_rooms`) the record of what was freed.

    Examples
    --------
    What PyTorch's or CuPy's out-of-memory handler on a worker calls before retrying::

        room = make_room(device, nbytes, library="torch")
        if room.freed:
            retry()
    """
    released = caches.release_cached_by_library(device)
    spilled = 0
    if spill:
        # Then libraries that spill their own objects (cuDF's spillable buffers), then outputs.
        by_libraries = caches.spill_libraries(nbytes)
        released.update(by_libraries)
        handler = caches.oom_handler(device)
        need = int(nbytes) - sum(by_libraries.values())
        if handler is not None and need > 0:
            spilled = caches.bytes_or_zero(handler, need, failed=f"spilling for {library}")
        if spilled:
            # Spilled arrays of a library free into that library's cache: give those back too.
            for name, n in caches.release_cached_by_library(device).items():
                released[name] = released.get(name, 0) + n
    for cache in caches.library_caches():
        # A library beside the stack (PyTorch's cap): the pool's free chunks make its room.
        give = getattr(cache, "make_room", None) if cache.name == library else None
        if give is not None:
            n = caches.bytes_or_zero(
                functools.partial(give, device), int(nbytes), failed=f"making room for {library}"
            )
            if n:
                released["pool"] = released.get("pool", 0) + n
    record = RoomMade(device, int(nbytes), str(library), released, spilled, time.time())
    with _lock:
        _records.append(record)
    return record


def recent_rooms() -> list[RoomMade]:
    """The last records :func:`make_room` made in this process, oldest first."""
    with _lock:
        return list(_records)


_TRIED = re.compile(r"[Tt]ried to allocate ([0-9.]+\s*(?:[KMGTP]i?B|B)?)")


def requested_bytes(error: BaseException) -> int:
    """The bytes an out-of-memory error says were asked for: its ``requested`` field
    (dask-rmm's), else "Tried to allocate 2.00 GiB" in its message (PyTorch's); 0 if unknown."""
    requested = getattr(error, "requested", None)
    if isinstance(requested, int) and requested > 0:
        return requested
    from dask.utils import parse_bytes

    match = _TRIED.search(str(error))
    try:
        return parse_bytes(match.group(1)) if match else 0
    except ValueError:  # "1.2.3 GiB"
        return 0


#: CUDA's "out of memory" error code (``cudaErrorMemoryAllocation`` and
#: ``CUDA_ERROR_OUT_OF_MEMORY`` are both 2), carried by Numba's ``CudaAPIError.code``.
_CUDA_OUT_OF_MEMORY = 2
#: PyTorch's ``RuntimeError`` when a CUDA library (allocating outside every allocator) could not:
#: "CUDA error: CUBLAS_STATUS_ALLOC_FAILED when calling `cublasCreate(handle)`".
_LIBRARY_ALLOC_FAILED = re.compile(r"\bCU(?:BLAS|SOLVER|SPARSE|DNN|FFT)_(?:STATUS_)?ALLOC_FAILED\b")
#: Libraries drawing device memory from a worker's budget, by top-level module.
_DEVICE_LIBRARIES = ("dask_rmm", "rmm", "cupy", "cupy_backends", "torch", "numba", "cudf")


def is_device_out_of_memory(error: BaseException) -> bool:
    """Whether ``error`` is a *device* allocation failure of a library drawing from the
    worker's budget: a type named ``OutOfMemoryError`` of dask-rmm, RMM, CuPy, PyTorch or cuDF,
    Numba's ``CudaAPIError`` with CUDA's out-of-memory code, or the ``MemoryError`` compiled
    RMM raises for ``rmm::out_of_memory`` (its message names it), or PyTorch's ``RuntimeError``
    when cuBLAS, cuSOLVER, cuSPARSE, cuDNN or cuFFT could not allocate (their ``ALLOC_FAILED``
    status in its message). A host ``MemoryError`` (NumPy's "Unable to allocate") is the task's
    own error. Told by type name, module, error code and status: no library is imported."""
    if isinstance(error, RuntimeError) and _LIBRARY_ALLOC_FAILED.search(str(error)):
        return type(error).__module__.partition(".")[0] in ("builtins", *_DEVICE_LIBRARIES)
    for t in type(error).__mro__:
        library = t.__module__.partition(".")[0]
        if library not in _DEVICE_LIBRARIES:
            continue
        if t.__name__ == "OutOfMemoryError":
            return True
        if t.__name__ == "CudaAPIError":
            return getattr(error, "code", None) == _CUDA_OUT_OF_MEMORY
    return type(error) is MemoryError and "out_of_memory" in str(error)


def runs_again(error: BaseException) -> bool:
    """Whether the task that raised ``error`` is worth running again after room is made: a
    device out-of-memory error of PyTorch's own caching allocator, the one library whose
    allocation dask-rmm cannot retry in place. Every allocation through dask-rmm's stack
    (``DeviceBuffer``, CuPy, Numba, compiled RMM, PyTorch through ``rmm_torch_allocator``) has
    already made room and retried where it failed, so its error is final. Also PyTorch's error
    for a CUDA library that could not allocate (cuBLAS's handle lacked the caches' free blocks)."""
    return is_device_out_of_memory(error) and (
        type(error).__module__.partition(".")[0] == "torch" or type(error) is RuntimeError
    )


def _reset_for_tests() -> None:
    with _lock:
        _records.clear()
