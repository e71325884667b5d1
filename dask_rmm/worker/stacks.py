"""What dask-rmm installed on a worker (:class:`WorkerStack`, with retired stacks still holding
memory) and the per-process registry that installs stacks and restores what was there."""

from __future__ import annotations

import logging
import sys
import weakref
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from dask_rmm import allocators
from dask_rmm.allocators import caches
from dask_rmm.mr.base import upstreams
from dask_rmm.mr.registry import (
    get_per_device_resource,
    registered_devices,
    set_per_device_resource,
)
from dask_rmm.stack.build import DeviceStack

if TYPE_CHECKING:
    from dask_rmm.stack.options import RMMOptions

__all__ = [
    "WorkerStack",
    "cupy_allocator_note",
    "install_stack",
    "replaced_resource_note",
    "uninstall_stack",
    "worker_stack",
]

logger = logging.getLogger(__name__)


# The workers of one process share it: stacks per device, newest last, and what was there
# before the first, so that tearing down in any order restores the right resource.
_installed: dict[int, list[DeviceStack]] = {}
_original: dict[int, Any] = {}


def install_stack(stack: DeviceStack) -> None:
    """Make ``stack`` its device's resource, remembering what it replaced."""
    active = _installed.setdefault(stack.device, [])
    previous = set_per_device_resource(stack.device, stack.top)
    if not active:
        _original[stack.device] = previous
    active.append(stack)


def uninstall_stack(stack: DeviceStack) -> None:
    """Undo :func:`install_stack`: the newest stack still installed, or else the original, is
    the device's resource again (unless someone else replaced ours). Unknown stacks: no-op."""
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
        if current is stack.top:  # else someone replaced ours after us: theirs stays
            set_per_device_resource(stack.device, previous)
    elif was_newest:
        set_per_device_resource(stack.device, active[-1].top)


def replaced_resource_note(device: int) -> str | None:
    """Why allocations on ``device`` go uncounted (its current resource neither is nor wraps a
    stack dask-rmm installed there), or None."""
    current = get_per_device_resource(device) if device in registered_devices() else None
    tops = [s.top for s in _installed.get(device, ())]
    # an adaptor over our stack (enable_statistics()) still reaches it
    if any(mr is top for mr in upstreams(current) for top in tops):
        return None
    what = "the default resource" if current is None else type(current).__name__
    return (
        f"device {device}'s current resource was replaced outside dask-rmm (by {what}, e.g. "
        "reinitialize or set_current_device_resource in a task): allocations through it are "
        "not counted here; register the plugin again to install dask-rmm's stack"
    )


def cupy_allocator_note() -> str | None:
    """Which allocator CuPy uses now, in words; None when CuPy is not imported."""
    try:
        allocator = sys.modules["cupy"].cuda.get_allocator()
    except (KeyError, AttributeError):  # CuPy not imported, or too old to tell
        return None
    allocator = getattr(allocator, "__wrapped__", allocator)  # memory admission's watch
    ours = sys.modules.get("dask_rmm.allocators.cupy")
    cache = ours.get_cupy_cache() if ours is not None else None
    if cache is not None and allocator == cache.pool.malloc:
        return (
            "CuPy allocates through its own MemoryPool over dask-rmm's resources "
            "(dask_rmm.allocators.cupy.CupyPoolCache; the pool's blocks are counted in "
            "dask-rmm's metrics, its free bytes reported as library_cached_bytes)"
        )
    owner_object = getattr(allocator, "__self__", None)  # a bound method: MemoryPool.malloc
    module = getattr(allocator, "__module__", None) or type(owner_object or allocator).__module__
    name = getattr(allocator, "__qualname__", None) or type(allocator).__qualname__
    owner = "CuPy's own allocator; dask-rmm does not see or count it"
    if module.startswith("dask_rmm."):
        owner = "dask-rmm's resources, counted in its metrics"
    elif module.startswith("rmm."):
        owner = "compiled RMM's current device resource; dask-rmm does not see or count it"
    return f"CuPy allocates through {module}.{name} ({owner})"


@dataclass(eq=False)
class WorkerStack:
    """One worker's stacks: ``active`` (one per device, from ``options`` of registration
    ``token``) and ``retired`` (replaced while their buffers were alive, listed until freed).
    Teardown hands the active ones back (:meth:`release`); a registration replacing them may
    :meth:`take_released` them and keep them installed until its own are ready."""

    active: list[DeviceStack] = field(default_factory=list)
    options: RMMOptions | None = None
    token: str | None = None
    #: The RMMPlugin that installed ``active`` (what ``worker.plugins`` must hold).
    plugin: Any = None
    #: The memory-pressure layer over ``active`` (``WorkerPressure``) or None.
    pressure: Any = None
    #: The plugin ``--preload dask_rmm.preload`` set up, or None: restored when a plugin that
    #: replaced it is unregistered (:meth:`restore_command_line`).
    command_line: Any = None
    _retired: list[tuple[weakref.ref, DeviceStack]] = field(default_factory=list)
    _released: bool = False

    @property
    def retired(self) -> list[DeviceStack]:
        """Retired stacks with live bytes, oldest first (held weakly: a retired pool goes once
        its last buffer is freed)."""
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
        previous, previous_options = self.active, self.options
        for stack in stacks:
            install_stack(stack)
        if previous_options is not None:
            dropped = [a for a in previous_options.allocators if a not in options.allocators]
            allocators.reset_allocators(dropped)
        self.active, self.options, self.token, self._released = stacks, options, token, False
        self.retire(previous)
        for stack in stacks:  # a retired stack may have let its log file name go
            stack.plan_log_path()
        allocators.set_allocators(list(options.allocators), exact=options.exact_allocators)
        for stack in stacks:
            # a library cache's free blocks from the replaced stacks go back to them
            caches.release_cached(stack.device)

    def set_pressure(self, worker: Any, pressure: Any) -> None:
        """Detach the memory-pressure layer (its spilled outputs come back) and attach
        ``pressure`` (or none) to ``worker``'s data."""
        previous, self.pressure = self.pressure, None
        if previous is not None:
            previous.detach(worker)
        if pressure is not None:
            if previous is not None:  # OOM events and totals stay, as the peaks do
                pressure.carry_history(previous)
            pressure.attach(worker)
            self.pressure = pressure

    def retire(self, stacks: list[DeviceStack]) -> None:
        """Uninstall ``stacks``; keep those still holding memory (log open until their last
        buffer is freed), close the others' logs."""
        for stack in reversed(stacks):
            uninstall_stack(stack)
            if stack.live_bytes <= 0:
                stack.close_log()
            else:
                stack.flush_log()
                alive = weakref.ref(stack.top)
                for name in ("top", "statistics", "attribution", "logging", "pool"):
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
        stacks, options = self.active, self.options
        self.active, self.options, self.token, self._released = [], None, None, False
        self.plugin = None
        self.set_pressure(None, None)  # while its stacks are installed: outputs come back there
        if options is not None:
            allocators.reset_allocators(list(options.allocators))
        self.retire(stacks)

    async def restore_command_line(self, worker: Any) -> None:
        """Set the command line's plugin up again after a plugin that replaced it was torn down
        (unless another registration took the stacks); remove the stacks if that fails."""
        plugin = self.command_line
        if plugin is None or not self._released or worker.plugins.get(plugin.name) is not None:
            self.remove_released()
            return
        worker.plugins[plugin.name] = plugin
        try:
            await plugin.setup(worker)
        except Exception:
            if worker.plugins.get(plugin.name) is plugin:
                del worker.plugins[plugin.name]
            logger.exception("dask-rmm: restoring the command line's setup failed")
            self.remove_released()

    def flush_logs(self) -> None:
        """Write the buffered log rows of the active and retired stacks."""
        for stack in [*self.active, *self.retired]:
            stack.flush_log()


_worker_stacks: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def worker_stack(worker: Any) -> WorkerStack:
    """The :class:`WorkerStack` of ``worker`` (a distributed Worker), made on first use."""
    return _worker_stacks.get(worker) or _worker_stacks.setdefault(worker, WorkerStack())
