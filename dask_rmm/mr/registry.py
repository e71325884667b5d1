"""Which memory resource each CUDA device allocates from: RMM's per-device resource registry, keyed
by device id; a device with nothing set gets a ``CudaMemoryResource`` made on first use."""

from __future__ import annotations

import functools
import threading

from dask_rmm import _cuda
from dask_rmm.mr.base import DeviceMemoryResource, upstreams
from dask_rmm.mr.cuda import CudaMemoryResource

__all__ = [
    "available_device_memory",
    "get_current_device_resource",
    "get_per_device_resource",
    "is_initialized",
    "reset_current_device_resource",
    "reset_per_device_resource",
    "set_current_device_resource",
    "set_per_device_resource",
]

_lock = threading.Lock()
_resources: dict[int, DeviceMemoryResource] = {}
#: ``lookup_per_device_resource(device) -> resource or None`` (None: nothing set yet), the
#: registry read in one C call, for hooks that look the resource up on every allocation.
lookup_per_device_resource = _resources.get
_single_device: bool | None = None


def _current_device() -> int:
    global _single_device
    if _single_device is None:
        _single_device = _cuda.get_device_count() <= 1
    return 0 if _single_device else _cuda.get_device()


_check_device = functools.partial(_cuda.check_device, host_memory=True)


def _make_default(device: int) -> DeviceMemoryResource:
    _cuda.require_cuda(f"the default memory resource of device {device} (a CudaMemoryResource)")
    with _cuda.on_device(device):
        return CudaMemoryResource()


def get_per_device_resource(device: int) -> DeviceMemoryResource:
    """The resource ``device`` allocates from, making the default CudaMemoryResource if unset
    (CUDAUnavailableError without a usable GPU: pick host memory explicitly with
    ``set_per_device_resource(0, SystemMemoryResource())``)."""
    mr = _resources.get(device)
    if mr is not None:
        return mr
    device = _check_device(device)
    with _lock:
        mr = _resources.get(device)
        if mr is None:
            mr = _resources[device] = _make_default(device)
    return mr


def get_current_device_resource() -> DeviceMemoryResource:
    """The resource of the calling thread's current device (device 0 without a GPU).

    Examples
    --------
    >>> from dask_rmm.mr import SystemMemoryResource, set_current_device_resource
    >>> previous = set_current_device_resource(SystemMemoryResource())
    >>> type(get_current_device_resource()).__name__
    'SystemMemoryResource'
    >>> _ = set_current_device_resource(previous)
    """
    if _single_device:  # the hot path (DeviceBuffer's default): no further call
        mr = _resources.get(0)
        if mr is not None:
            return mr
    return get_per_device_resource(_current_device())


def set_per_device_resource(
    device: int, mr: DeviceMemoryResource | None
) -> DeviceMemoryResource | None:
    """Make ``device`` allocate from ``mr`` and return the previous resource (``None`` when
    nothing was set or made yet); ``None`` resets the device to its lazily made default, so
    ``set_per_device_resource(d, previous)`` restores the earlier state."""
    device = _check_device(device)
    if mr is not None and not isinstance(mr, DeviceMemoryResource):
        raise TypeError(f"mr must be a DeviceMemoryResource or None, got {type(mr).__name__}")
    with _lock:
        previous = _resources.pop(device, None)
        if mr is not None:
            _resources[device] = mr
    return previous


def set_current_device_resource(mr: DeviceMemoryResource | None) -> DeviceMemoryResource | None:
    """:func:`set_per_device_resource` for the calling thread's current device."""
    return set_per_device_resource(_current_device(), mr)


def reset_per_device_resource(device: int) -> None:
    """Forget what was set for ``device``; its next use makes the default CudaMemoryResource."""
    set_per_device_resource(device, None)


def reset_current_device_resource() -> None:
    """:func:`reset_per_device_resource` for the current device."""
    reset_per_device_resource(_current_device())


def is_initialized() -> bool:
    """True when the current device has a resource (set explicitly, or its default made)."""
    return _current_device() in _resources


def registered_devices() -> list[int]:
    """The device ids that have a resource now (set explicitly, or their default made)."""
    with _lock:
        return sorted(_resources)


def available_device_memory() -> tuple[int, int]:
    """``(free, total)`` bytes of the current device, from ``cudaMemGetInfo``
    (CUDAUnavailableError on a host without a GPU)."""
    _cuda.require_cuda("available_device_memory()")
    return _cuda.mem_get_info()


def _flush_logs() -> None:
    """Flush every registered resource's logging adaptor, anywhere in its stack (RMM's
    ``_flush_logs``)."""
    with _lock:
        resources = list(_resources.values())
    for mr in (mr for top in resources for mr in upstreams(top)):
        if callable(flush := getattr(mr, "flush", None)):
            flush()


def _reset_for_tests() -> None:
    """Drop every registered resource (the test suite's autouse fixture)."""
    global _single_device
    with _lock:
        _resources.clear()
    _single_device = None
