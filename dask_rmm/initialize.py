"""``reinitialize`` and its companions, as RMM's top-level functions: build each device's
resource stack (:func:`dask_rmm.stack.build_stack`) and install it in :mod:`dask_rmm.mr.registry`."""

from __future__ import annotations

import os
from collections.abc import Callable, Sequence
from typing import Any

from dask_rmm import _cuda
from dask_rmm.mr import registry
from dask_rmm.mr.logging_adaptor import (
    _log_file_name,
    _registered_devices,
    disable_logging,
    enable_logging,
    get_log_filenames,
)
from dask_rmm.mr.registry import is_initialized
from dask_rmm.sizes import parse_size
from dask_rmm.stack.build import build_stack
from dask_rmm.stack.options import RMMOptions, base_resource_of

__all__ = [
    "RMMError",
    "disable_logging",
    "enable_logging",
    "get_log_filenames",
    "is_initialized",
    "register_reinitialize_hook",
    "reinitialize",
    "unregister_reinitialize_hook",
]


class RMMError(Exception):
    """RMM's error type for initialization failures; ``errcode`` is kept as RMM has it."""

    def __init__(self, errcode: int, msg: str):
        self.errcode = errcode
        super().__init__(msg)

    def __reduce__(self):
        return (type(self), (self.errcode, self.args[0]))


_reinitialize_hooks: list[tuple[Callable, tuple, dict]] = []


def _check_devices(devices: Any) -> list[int]:
    if devices is None:
        return [0]
    if isinstance(devices, (bool, str)) or not isinstance(devices, (int, Sequence)):
        raise TypeError(f"devices must be an int or a list of ints, got {devices!r}")
    devices = [devices] if isinstance(devices, int) else list(devices)
    if not devices:
        raise ValueError("devices must name at least one device")
    for d in devices:
        try:
            _cuda.check_device(d, host_memory=True)
        except (TypeError, ValueError) as e:
            raise type(e)(f"devices: {e}") from None
    return list(dict.fromkeys(devices))


def reinitialize(
    pool_allocator: bool = False,
    managed_memory: bool = False,
    initial_pool_size: int | str | float | None = None,
    maximum_pool_size: int | str | float | None = None,
    devices: int | Sequence[int] | None = 0,
    logging: bool = False,
    log_file_name: str | os.PathLike | None = None,
    base_resource: str | None = None,
) -> None:
    """Replace every device's resource with a new stack built from these options.

    The registered hooks run first (last registered first). Then, for each of ``devices``, a
    stack is built by :func:`dask_rmm.stack.build_stack` (the one the Dask worker plugin
    uses): a base resource on that device, a :class:`~dask_rmm.mr.PoolMemoryResource` if
    ``pool_allocator``, a :class:`~dask_rmm.mr.LoggingResourceAdaptor` if ``logging``. All
    stacks are built before any is installed, so a failure changes nothing. Devices not listed
    go back to their lazily made default. Buffers allocated before keep their old resource
    alive and free through it, so they stay valid.

    Parameters
    ----------
    pool_allocator : bool, default False
        Suballocate from a pool.
    managed_memory : bool, default False
        Use CUDA managed memory (the same as ``base_resource="managed"``).
    initial_pool_size, maximum_pool_size : int, str or float, optional
        Pool sizes (``4 << 30``, ``"4GiB"`` or a fraction of total memory, see
        :func:`dask_rmm.parse_device_bytes`); ignored without ``pool_allocator``. With
        ``base_resource="async"`` they size cudaMallocAsync's own pool (the maximum through a
        ``LimitingResourceAdaptor``), as dask-cuda does.
    devices : int or list of int, default 0
        Devices to set up.
    logging : bool, default False
        Log every allocation event to a CSV file per device.
    log_file_name : str, optional
        The event log's name; ``.dev{id}`` is added before the extension for each device.
        Default: the ``RMM_LOG_FILE`` environment variable; ``ValueError`` if neither is set.
    base_resource : {"cuda", "managed", "async", "system", "pinned"}, optional
        Where memory comes from (default ``"cuda"``, or ``"managed"`` with
        ``managed_memory=True``). ``"system"`` is host memory and works without a GPU; the
        others need one and raise ``CUDAUnavailableError`` otherwise.

    Options that do not go together (``initial_pool_size > maximum_pool_size``...) raise
    :class:`dask_rmm.stack.OptionError`, a ValueError and a RuntimeError (as RMM raises).

    Examples
    --------
    >>> import dask_rmm
    >>> dask_rmm.reinitialize(pool_allocator=True, initial_pool_size="64MiB",
    ...                       base_resource="system")
    >>> type(dask_rmm.mr.get_current_device_resource()).__name__
    'PoolMemoryResource'
    """
    base_resource = base_resource_of(base_resource, managed_memory) or "cuda"
    pool = bool(pool_allocator)
    pool_size = maximum = None
    if pool:
        # Parsed under the names the caller used (the options call them pool_size, ...).
        pool_size = parse_size(initial_pool_size, "initial_pool_size")
        maximum = parse_size(maximum_pool_size, "maximum_pool_size")
    options = RMMOptions(
        base_resource=base_resource,
        pool_allocator=pool,
        pool_size=pool_size,
        maximum_pool_size=maximum,
        log_file_name=_log_file_name(log_file_name) if logging else None,
        statistics=False,
    )
    device_list = _check_devices(devices)
    for func, args, kwargs in reversed(list(_reinitialize_hooks)):
        func(*args, **kwargs)
    stacks = {device: build_stack(options, device).top for device in device_list}
    for device in _registered_devices():
        if device not in stacks:
            registry.reset_per_device_resource(device)
    for device, mr in stacks.items():
        registry.set_per_device_resource(device, mr)


def register_reinitialize_hook(func: Callable, *args: Any, **kwargs: Any) -> Callable:
    """Call ``func(*args, **kwargs)`` at the start of every :func:`reinitialize`; returns
    ``func``, so this can be used as a decorator.

    Hooks run in the reverse order of registration, so a library can release what it caches
    (device memory from the old resource) before the stack is replaced.
    """
    if not callable(func):
        raise TypeError(f"func must be callable, got {func!r}")
    _reinitialize_hooks.append((func, args, kwargs))
    return func


def unregister_reinitialize_hook(func: Callable) -> None:
    """Remove every registration of ``func`` (no error if there is none)."""
    _reinitialize_hooks[:] = [h for h in _reinitialize_hooks if h[0] != func]
