"""``reinitialize`` and its companions, as RMM's top-level functions: build each device's
resource stack (base resource, optional pool, optional event log; built by
:func:`dask_rmm.stack.build_stack`) and install it in the per-device registry; hooks that run
before; per-device event logging.

The registry itself (get/set the current resource) is :mod:`dask_rmm.mr.registry`'s.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Sequence
from typing import Any

from dask_rmm import _cuda
from dask_rmm.mr import registry
from dask_rmm.mr.logging_adaptor import LoggingResourceAdaptor
from dask_rmm.stack.build import build_stack
from dask_rmm.stack.options import BASE_RESOURCES, OptionError, RMMOptions, _size

__all__ = [
    "BASE_RESOURCES",
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
    if (
        isinstance(devices, bool)
        or not isinstance(devices, (int, Sequence))
        or isinstance(devices, str)
    ):
        raise TypeError(f"devices must be an int or a list of ints, got {devices!r}")
    devices = [devices] if isinstance(devices, int) else list(devices)
    if not devices:
        raise ValueError("devices must name at least one device")
    count = _cuda.get_device_count()
    for d in devices:
        if isinstance(d, bool) or not isinstance(d, int):
            raise TypeError(f"devices must hold int device ids, got {d!r}")
        if d < 0 or d >= max(count, 1):
            where = f"{count} CUDA device(s)" if count else "no CUDA device (only device 0)"
            raise ValueError(f"devices: device {d} does not exist, this host has {where}")
    return list(dict.fromkeys(devices))


def _log_file_name(log_file_name: Any) -> str:
    if log_file_name is None:
        log_file_name = os.environ.get("RMM_LOG_FILE") or None
    if log_file_name is None:
        raise ValueError(
            "logging=True needs a log file: pass log_file_name=... or set the RMM_LOG_FILE "
            "environment variable"
        )
    if not isinstance(log_file_name, (str, os.PathLike)) or not os.fspath(log_file_name):
        raise TypeError(f"log_file_name must be a non-empty path, got {log_file_name!r}")
    return os.fspath(log_file_name)


def _registered_devices() -> list[int]:
    # The device ids that have a resource are what RMM's logging functions walk over.
    return registry.registered_devices() or [0]


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

    Raises
    ------
    dask_rmm.stack.OptionError
        A ValueError and a RuntimeError (as RMM raises), for options that do not go together,
        such as ``initial_pool_size > maximum_pool_size``.

    Examples
    --------
    >>> import dask_rmm
    >>> dask_rmm.reinitialize(pool_allocator=True, initial_pool_size="64MiB",
    ...                       base_resource="system")
    >>> type(dask_rmm.mr.get_current_device_resource()).__name__
    'PoolMemoryResource'
    """
    if base_resource is None:
        base_resource = "managed" if managed_memory else "cuda"
    elif managed_memory and base_resource != "managed":
        raise OptionError(
            f"managed_memory=True conflicts with base_resource={base_resource!r}; "
            "pass one of them (managed_memory=True is base_resource='managed')"
        )
    pool = bool(pool_allocator)
    pool_size = maximum = None
    if pool:
        # Parsed under the names the caller used (the options call them pool_size, ...).
        pool_size = _size("initial_pool_size", initial_pool_size)
        maximum = _size("maximum_pool_size", maximum_pool_size)
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


def is_initialized() -> bool:
    """True when the current device has a resource (see :func:`dask_rmm.mr.is_initialized`)."""
    return registry.is_initialized()


def register_reinitialize_hook(func: Callable, *args: Any, **kwargs: Any) -> Callable:
    """Call ``func(*args, **kwargs)`` at the start of every :func:`reinitialize`.

    Hooks run in the reverse order of registration, so a library can release what it caches
    (device memory from the old resource) before the stack is replaced.

    Returns
    -------
    callable
        ``func``, so this can be used as a decorator.
    """
    if not callable(func):
        raise TypeError(f"func must be callable, got {func!r}")
    _reinitialize_hooks.append((func, args, kwargs))
    return func


def unregister_reinitialize_hook(func: Callable) -> None:
    """Remove every registration of ``func`` (no error if there is none)."""
    _reinitialize_hooks[:] = [h for h in _reinitialize_hooks if h[0] != func]


def enable_logging(log_file_name: str | os.PathLike | None = None) -> None:
    """Log allocation events on every device that has a resource (device 0 if none has).

    Each device's resource is wrapped in a :class:`~dask_rmm.mr.LoggingResourceAdaptor`
    writing to ``log_file_name`` with ``.dev{id}`` added; resources that already log are left
    alone. ``log_file_name`` defaults to ``RMM_LOG_FILE``; ``ValueError`` if neither is set.
    """
    log_file_name = _log_file_name(log_file_name)
    for device in _registered_devices():
        mr = registry.get_per_device_resource(device)
        if not isinstance(mr, LoggingResourceAdaptor):
            registry.set_per_device_resource(
                device, LoggingResourceAdaptor(mr, log_file_name=log_file_name)
            )


def disable_logging() -> None:
    """Unwrap every device's :class:`~dask_rmm.mr.LoggingResourceAdaptor` (flushing its file).

    Buffers allocated while logging still free through the adaptor, and those frees are logged.
    """
    for device in _registered_devices():
        mr = registry.get_per_device_resource(device)
        if isinstance(mr, LoggingResourceAdaptor):
            mr.flush()
            registry.set_per_device_resource(device, mr.get_upstream())


def get_log_filenames() -> dict[int, str | None]:
    """``{device: absolute log file name}`` for each device with a resource; ``None`` for a
    device whose resource does not log.

    Examples
    --------
    >>> import dask_rmm, tempfile, os
    >>> path = os.path.join(tempfile.mkdtemp(), "rmm.log")
    >>> dask_rmm.reinitialize(base_resource="system", logging=True, log_file_name=path)
    >>> dask_rmm.get_log_filenames()[0].endswith("rmm.dev0.log")
    True
    """
    out: dict[int, str | None] = {}
    for device in registry.registered_devices():
        mr = registry.get_per_device_resource(device)
        out[device] = mr.get_file_name() if isinstance(mr, LoggingResourceAdaptor) else None
    return out


def _reset_for_tests() -> None:
    """Forget every hook."""
    _reinitialize_hooks.clear()
