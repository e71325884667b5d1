"""What dask-rmm installed: one device's stack (:class:`DeviceStack`), one worker's stacks with
the retired ones still holding memory (:class:`WorkerStack`), the per-process registry that
installs them and restores what was there, and their log files. Not here: building a stack
(``options.py``), distributed (``plugin.py``).
"""

from __future__ import annotations

import contextlib
import logging
import os
import re
import sys
import weakref
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from dask_rmm.mr.base import DeviceMemoryResource
    from dask_rmm.options import RMMOptions

__all__ = [
    "DeviceStack",
    "WorkerStack",
    "claim_log_file",
    "cupy_allocator_note",
    "install_stack",
    "log_file_path",
    "on_device",
    "replaced_resource_note",
    "resource_chain",
    "uninstall_stack",
    "worker_stack",
]

logger = logging.getLogger(__name__)


# -- log files ------------------------------------------------------------------------------------


def _sanitise(name: Any) -> str:
    text = re.sub(r"[^A-Za-z0-9_.-]+", "_", str(name)).strip("._")
    return text or "worker"


def log_file_path(log_directory: str | os.PathLike, worker_name: Any, device: int) -> str:
    """``<log_directory>/rmm_log_<worker name>.dev<device>.csv``, the name made filename-safe.

    Examples
    --------
    >>> log_file_path("/logs", "tcp://10.0.0.1:4242", 0)
    '/logs/rmm_log_tcp_10.0.0.1_4242.dev0.csv'
    """
    return os.path.join(
        os.fspath(log_directory), f"rmm_log_{_sanitise(worker_name)}.dev{device}.csv"
    )


def claim_log_file(path: str) -> tuple[str, int | None]:
    """Reserve ``path`` for this worker with an exclusive ``flock`` held until teardown.

    A file another live worker holds (two clusters sharing a directory, or two names that
    sanitise alike) gets this process's id, then a counter, added to its name instead.
    """
    try:
        import fcntl
    except ImportError:  # pragma: no cover - not POSIX: no reservation, the name is used as is
        return path, None
    stem, _, ext = path.rpartition(".dev")
    candidates = [path, f"{stem}-{os.getpid()}.dev{ext}"]
    candidates += [f"{stem}-{os.getpid()}-{i}.dev{ext}" for i in range(1, 64)]
    for candidate in candidates:
        fd = os.open(candidate, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            os.close(fd)
            continue
        return candidate, fd
    raise RuntimeError(f"no free log file name next to {path}: all candidates are in use")


# -- per-device state on one worker --------------------------------------------------------------


@dataclass
class DeviceStack:
    """What setup built for one device, and what teardown needs to undo it."""

    device: int
    top: DeviceMemoryResource
    statistics: Any = None  # StatisticsResourceAdaptor or None
    attribution: Any = None  # AttributionResourceAdaptor or None
    logging: Any = None  # LoggingResourceAdaptor or None
    log_path: str | None = None
    log_fd: int | None = None
    chain: str = ""
    host_memory: bool = False
    options: RMMOptions | None = None
    pool_size: int | None = None  # bytes, as resolved on this device
    maximum_pool_size: int | None = None
    pressure: Any = None  # dask_rmm.pressure.DevicePressure when the options ask for it

    @property
    def live_bytes(self) -> int:
        """Bytes allocated through this stack and not yet freed (0 without statistics)."""
        try:
            return int(self.statistics.current_bytes) if self.statistics is not None else 0
        except Exception:  # a broken counter must not break a teardown
            return 0

    def describe(self) -> str:
        """One line: resources, pool size and maximum, base resource, log file."""
        from dask_rmm.mr.base import format_bytes

        pool, maximum = (
            "none" if n is None else format_bytes(n) for n in (self.pool_size, self.maximum_pool_size)
        )
        base = self.options.base_resource if self.options is not None else "?"
        return (
            f"device {self.device}: {self.chain}; pool {pool}, maximum {maximum}, "
            f"base resource {base}, log {self.log_path or 'none'}"
        )

    def flush_log(self, close: bool = False) -> None:
        """Write the log's buffered rows to its file (and close it, releasing its name);
        nothing without a log, or once the adaptor of a retired stack was collected (it flushed
        and closed its file then)."""
        if self.logging is not None:
            for method in ("flush", "close") if close else ("flush",):
                try:
                    getattr(self.logging, method)()
                except ReferenceError:  # a retired stack's adaptor, collected: closed already
                    break
                except Exception:  # pragma: no cover - a timer or a teardown must go on
                    logger.exception("dask-rmm: %s of %s failed", method, self.log_path)
        if close and self.log_fd is not None:
            fd, self.log_fd = self.log_fd, None
            os.close(fd)

    def close_log(self) -> None:
        self.flush_log(close=True)


@contextlib.contextmanager
def on_device(device: int) -> Iterator[None]:
    """Make ``device`` the current CUDA device for the block (no-op without CUDA)."""
    from dask_rmm import _cuda

    current = _cuda.get_device() if _cuda.is_available() else device
    if current != device:
        _cuda.set_device(device)
    try:
        yield
    finally:
        if current != device:
            _cuda.set_device(current)


def _upstreams(mr: Any) -> Iterator[Any]:
    """``mr`` and its upstreams, outermost first."""
    while mr is not None:
        yield mr
        mr = getattr(mr, "upstream_mr", None)


def resource_chain(mr: Any) -> str:
    """The class names of a resource and its upstreams, outermost first, joined by ``>``."""
    return ">".join(type(m).__name__ for m in _upstreams(mr))


# Worker objects of one process share the per-device registry (gen_cluster, LocalCluster with
# processes=False): the stacks installed per device, newest last, and what was there before the
# first, so that tearing down in any order restores the right resource.
_installed: dict[int, list[DeviceStack]] = {}
_original: dict[int, Any] = {}


def install_stack(stack: DeviceStack) -> None:
    """Make ``stack`` its device's resource, remembering what it replaced."""
    from dask_rmm.mr.registry import set_per_device_resource

    active = _installed.setdefault(stack.device, [])
    previous = set_per_device_resource(stack.device, stack.top)
    if not active:
        _original[stack.device] = previous
    active.append(stack)


def uninstall_stack(stack: DeviceStack) -> None:
    """Undo :func:`install_stack`: the newest stack still installed, or else the original, is
    the device's resource again (unless someone else replaced ours). Unknown stacks: no-op."""
    from dask_rmm.mr.registry import get_per_device_resource, set_per_device_resource

    active = _installed.get(stack.device, [])
    if stack not in active:
        return
    was_newest = active[-1] is stack
    active.remove(stack)
    if not active:
        del _installed[stack.device]
        previous = _original.pop(stack.device, None)
        try:
            current = get_per_device_resource(stack.device)
        except Exception:
            current = None
        # Someone replaced our resource after us (set_current_device_resource, reinitialize):
        # theirs stays.
        if current is stack.top:
            set_per_device_resource(stack.device, previous)
    elif was_newest:
        set_per_device_resource(stack.device, active[-1].top)


def replaced_resource_note(device: int) -> str | None:
    """Why allocations on ``device`` may go uncounted, or None: its current resource neither is
    nor wraps a stack dask-rmm installed there (code on the worker called ``reinitialize`` or
    ``set_current_device_resource``), so what is allocated through it is not counted."""
    from dask_rmm.mr.registry import get_per_device_resource, registered_devices

    current = get_per_device_resource(device) if device in registered_devices() else None
    tops = [s.top for s in _installed.get(device, ())]
    # an adaptor over our stack (enable_statistics()) still reaches it
    if any(mr is top for mr in _upstreams(current) for top in tops):
        return None
    what = "the default resource" if current is None else type(current).__name__
    return (
        f"device {device}'s current resource was replaced outside dask-rmm (by {what}, e.g. "
        "reinitialize or set_current_device_resource in a task): allocations through it are "
        "not counted here; register the plugin again to install dask-rmm's stack"
    )


def cupy_allocator_note() -> str | None:
    """Which allocator CuPy uses now, in words (dask-rmm's, compiled RMM's as dask-cuda's
    ``rmm_allocator_external_lib_list=["cupy"]`` sets, which dask-rmm neither sees nor counts,
    or CuPy's own); None when CuPy is not imported."""
    try:
        allocator = sys.modules["cupy"].cuda.get_allocator()
    except (KeyError, AttributeError):  # CuPy not imported, or too old to tell
        return None
    owner_object = getattr(allocator, "__self__", None)  # a bound method: MemoryPool.malloc
    module = getattr(allocator, "__module__", None) or type(owner_object or allocator).__module__
    name = getattr(allocator, "__qualname__", None) or type(allocator).__qualname__
    owner = "CuPy's own allocator; dask-rmm does not see or count it"
    if module.startswith("dask_rmm."):
        owner = "dask-rmm's resources, counted in its metrics"
    elif module.startswith("rmm."):
        owner = "compiled RMM's current device resource; dask-rmm does not see or count it"
    return f"CuPy allocates through {module}.{name} ({owner})"


# -- one worker's stacks -----------------------------------------------------------------------


@dataclass(eq=False)
class WorkerStack:
    """The stacks dask-rmm installed on one worker, across plugin registrations.

    ``active``: the installed stacks (one per device), made from ``options`` by the
    registration ``token``. ``retired``: stacks replaced or removed while buffers allocated
    through them were still alive; they are listed, with :attr:`DeviceStack.live_bytes`, until
    those buffers are freed, so that re-registering never hides memory in use (the heartbeat
    metrics read them). Teardown hands the active stacks back with :meth:`release` instead of
    removing them at once, so that a registration replacing them can :meth:`take_released` and
    keep them installed until its own stacks are ready (or keep them if it fails).
    """

    active: list[DeviceStack] = field(default_factory=list)
    options: RMMOptions | None = None
    token: str | None = None
    #: The memory-pressure layer over ``active`` (``dask_rmm.pressure.WorkerPressure``) or None.
    pressure: Any = None
    _retired: list[tuple[weakref.ref, DeviceStack]] = field(default_factory=list)
    _released: bool = False

    @property
    def retired(self) -> list[DeviceStack]:
        """Retired stacks with live bytes, oldest first. They hold their resources weakly (the
        live buffers keep them alive), so a retired pool goes once its last buffer is freed."""
        kept = []
        for alive, stack in self._retired:
            if alive() is not None and stack.live_bytes > 0:
                kept.append((alive, stack))
            else:  # its last buffer was freed: its log is complete
                stack.close_log()
        self._retired = kept
        return [s for _, s in kept]

    def install(self, stacks: list[DeviceStack], options: RMMOptions, token: str | None) -> None:
        """Install ``stacks`` and retire the active ones (call after every stack is built)."""
        from dask_rmm import allocators

        previous, previous_options = self.active, self.options
        for stack in stacks:
            install_stack(stack)
        if previous_options is not None:
            dropped = [a for a in previous_options.allocators if a not in options.allocators]
            allocators.reset_allocators(dropped)
        self.active, self.options, self.token, self._released = stacks, options, token, False
        self.retire(previous)
        allocators.set_allocators(list(options.allocators))

    def set_pressure(self, worker: Any, pressure: Any) -> None:
        """Detach the memory-pressure layer in place (its spilled outputs come back to the
        device) and attach ``pressure`` (or none) to ``worker``'s data."""
        previous, self.pressure = self.pressure, None
        if previous is not None:
            previous.detach(worker)
        if pressure is not None:
            pressure.attach(worker)
            self.pressure = pressure

    def retire(self, stacks: list[DeviceStack]) -> None:
        """Uninstall ``stacks`` and keep the ones still holding memory; close the others' logs.

        A retired stack keeps its log file (and its claim on the name) until its last buffer is
        freed, so that those frees are logged: closing it at once made every buffer held across
        a re-registration look leaked to ``dask rmm log summary``.
        """
        for stack in reversed(stacks):
            uninstall_stack(stack)
            if stack.live_bytes <= 0:
                stack.close_log()
            else:
                stack.flush_log()
                alive = weakref.ref(stack.top)
                for name in ("top", "statistics", "attribution", "logging"):
                    if getattr(stack, name) is not None:
                        setattr(stack, name, weakref.proxy(getattr(stack, name)))
                self._retired.append((alive, stack))

    def release(self) -> bool:
        """Mark the active stacks as handed back (see the class doc); False if there are none."""
        self._released = bool(self.active)
        return self._released

    def take_released(self) -> bool:
        """Claim stacks handed back by :meth:`release` and not yet removed (they stay installed)."""
        taken, self._released = self._released, False
        return taken

    def remove_released(self) -> None:
        """Remove the active stacks if they were released and nobody took them."""
        if not self._released:
            return
        from dask_rmm import allocators

        stacks, options = self.active, self.options
        self.active, self.options, self.token, self._released = [], None, None, False
        self.set_pressure(None, None)  # while its stacks are installed: outputs come back there
        if options is not None:
            allocators.reset_allocators(list(options.allocators))
        self.retire(stacks)

    def flush_logs(self) -> None:
        """Write the buffered log rows of every active stack, and of every retired stack
        still holding memory, to their files."""
        for stack in [*self.active, *self.retired]:
            stack.flush_log()


_worker_stacks: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def worker_stack(worker: Any) -> WorkerStack:
    """The :class:`WorkerStack` of ``worker`` (a distributed Worker), made on first use."""
    return _worker_stacks.get(worker) or _worker_stacks.setdefault(worker, WorkerStack())
