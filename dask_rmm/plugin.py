"""RMMPlugin: checks its options on the client, builds each worker's memory-resource stacks from
them and points CuPy/Numba at them. Not here: installing stacks and their log files
(``worker_stack.py``), heartbeat metrics (``worker_metrics.py``), CLI flags (``preload.py``).
"""

from __future__ import annotations

import functools
import logging
import os
from collections.abc import Iterable
from typing import TYPE_CHECKING, Any

import dask.config
from dask.utils import key_split
from distributed.diagnostics.plugin import WorkerPlugin
from distributed.utils import thread_state

from dask_rmm.worker_metrics import WorkerMetrics
from dask_rmm.worker_stack import (
    DeviceStack,
    claim_log_file,
    install_stack,
    log_file_path,
    resource_chain,
    uninstall_stack,
)

if TYPE_CHECKING:
    from distributed import Worker

    from dask_rmm.mr.base import DeviceMemoryResource

__all__ = [
    "SUPPORTED_ALLOCATORS",
    "RMMPlugin",
    "RMMSetupError",
    "current_task_key",
]

logger = logging.getLogger(__name__)

#: Libraries ``allocators=[...]`` can point at the worker's resource.
SUPPORTED_ALLOCATORS = ("cupy", "numba")
#: Values of ``base_resource``.
BASE_RESOURCES = ("cuda", "system")


def _config(key: str) -> Any:
    """``dask.config.get("dask-rmm.<key>")``, falling back to dask-rmm.yaml's default (the
    defaults survive code that resets Dask's config, such as distributed's test fixtures)."""
    from dask_rmm.config import defaults

    default = defaults["dask-rmm"]
    for part in key.split("."):
        default = default[part]
    return dask.config.get(f"dask-rmm.{key}", default)


class _Unset:
    def __repr__(self) -> str:
        return "<from config>"


_UNSET: Any = _Unset()


class RMMSetupError(RuntimeError):
    """RMMPlugin could not set up a worker; the message names the worker and the reason."""


# -- the running task ------------------------------------------------------------------------------

#: The key of the Dask task running on the calling thread, or None. distributed sets
#: ``thread_state.key`` (``dask.context.thread_state``, a thread-local) while a task executes on
#: a worker thread. A partial of the builtin getattr: no Python frame on the allocation path.
current_task_key = functools.partial(getattr, thread_state, "key", None)


def task_prefix(key: Any) -> str:
    """The task prefix a key is charged to: ``key_split(("sum-chunk-abc", 1, 2)) == "sum-chunk"``."""
    return key_split(key)


# -- option checking (client side) --------------------------------------------------------------


def _check_size(option: str, value: Any) -> int | float | None:
    """Check a size option on the client: bytes (an int) or a fraction of device memory (a float
    in (0, 1]); turned into bytes on the worker, where the device is known."""
    if value is None:
        return None
    from dask_rmm.config import parse_device_bytes

    if isinstance(value, str):
        text = value.strip()
        try:
            number = float(text)
        except ValueError:
            number = None
        if number is not None and 0 < number <= 1 and not text.lstrip("+").isdigit():
            value = number
    try:
        # Parsing against a made-up total checks the form; the worker parses again for real.
        parse_device_bytes(value, total_memory=1 << 40, alignment=1)
    except (TypeError, ValueError) as e:
        raise type(e)(f"`{option}`: {e}") from None
    if isinstance(value, float):
        return value
    return parse_device_bytes(value, alignment=1)


def _check_bool(option: str, value: Any) -> bool:
    if isinstance(value, str):
        lowered = value.strip().lower()
        if lowered in ("true", "1", "yes", "on"):
            return True
        if lowered in ("false", "0", "no", "off", ""):
            return False
    if isinstance(value, bool):
        return value
    if isinstance(value, int) and value in (0, 1):
        return bool(value)
    raise TypeError(f"`{option}` must be True or False, got {value!r}")


def _check_allocators(value: Any) -> tuple[str, ...]:
    if value is None:
        return ()
    names = value.split(",") if isinstance(value, str) else list(value)
    out = []
    for name in names:
        name = str(name).strip().lower()
        if not name:
            continue
        if name not in SUPPORTED_ALLOCATORS:
            raise ValueError(
                f"unknown library {name!r} in `allocators`; supported: "
                f"{', '.join(SUPPORTED_ALLOCATORS)}"
            )
        if name not in out:
            out.append(name)
    return tuple(out)


def _check_devices(value: Any) -> tuple[int, ...] | None:
    if value is None:
        return None
    if isinstance(value, str):
        value = [v for v in value.replace(" ", "").split(",") if v]
    elif isinstance(value, int) and not isinstance(value, bool):
        value = [value]
    try:
        devices = tuple(int(d) for d in value)
    except (TypeError, ValueError) as e:
        raise TypeError(
            f"`devices` must be device ids such as [0, 1] or '0,1', got {value!r}"
        ) from e
    if not devices:
        return None
    if any(d < 0 for d in devices) or len(set(devices)) != len(devices):
        raise ValueError(f"`devices` must be distinct non-negative device ids, got {list(devices)}")
    return devices


def _describe(value: int | float) -> str:
    from dask_rmm.mr.base import format_bytes

    return f"{value:.0%} of device memory" if isinstance(value, float) else format_bytes(value)


# -- the plugin -----------------------------------------------------------------------------------


class RMMPlugin(WorkerPlugin):
    """Give every worker an RMM memory-resource stack, per-task-group statistics and metrics.

    Options mean what they mean in dask-cuda (``LocalCUDACluster(rmm_pool_size=...)``). Options
    not given are read from Dask's config (``dask-rmm.*``, e.g. ``DASK_DASK_RMM__POOL_SIZE=4GiB``)
    where the plugin is made; explicit arguments win. Sizes are bytes, strings such as ``"4GiB"``,
    or fractions of the device's memory (``0.8``), resolved on each worker.

    Each worker's stack, outermost first (layers that are off are left out)::

        AttributionResourceAdaptor -> StatisticsResourceAdaptor -> LoggingResourceAdaptor
          -> TrackingResourceAdaptor -> PoolMemoryResource | CudaAsyncMemoryResource
          -> CudaMemoryResource | ManagedMemoryResource | SystemMemoryResource

    Parameters
    ----------
    pool_size : int, str or float, optional
        Initial size of a ``PoolMemoryResource`` (or of the async pool with ``async_alloc``).
        None: no pool.
    maximum_pool_size : int, str or float, optional
        The pool never grows beyond this (with ``async_alloc``: a ``LimitingResourceAdaptor``).
    managed_memory : bool
        Allocate CUDA managed (unified) memory.
    async_alloc : bool
        Use ``CudaAsyncMemoryResource`` (cudaMallocAsync) instead of a pool.
    release_threshold : int, str or float, optional
        Bytes the async pool keeps when idle; needs ``async_alloc``.
    log_directory : str, optional
        Write one CSV allocation log per worker and device into this directory:
        ``rmm_log_<worker name>.dev<device>.csv``.
    track_allocations : bool
        Add a ``TrackingResourceAdaptor`` (outstanding allocations, optionally with stacks).
    allocators : list of str
        Libraries to point at the worker's resource: ``"cupy"``, ``"numba"``.
    statistics : bool
        Count allocations (``StatisticsResourceAdaptor``) and charge them to task prefixes;
        needed for the heartbeat metrics' counters and the cluster report. Default True.
    base_resource : {"cuda", "system"}
        ``"cuda"`` (device memory, the default) or ``"system"`` (host memory, for hosts without
        a GPU). Never chosen silently: ``"cuda"`` on a host without a GPU fails setup.
    devices : list of int, optional
        Device ids to set up; default the worker's current device.

    Notes
    -----
    ``idempotent`` is False: registering the plugin again (say with a bigger pool) tears the old
    setup down on every worker and builds the new one. Setup builds a fresh stack over a fresh
    base resource, so re-registration never stacks adaptors. A worker whose setup fails raises
    :class:`RMMSetupError` naming its address, which ``client.register_plugin`` re-raises.

    Examples
    --------
    >>> from dask_rmm import RMMPlugin
    >>> client.register_plugin(RMMPlugin(pool_size="4GiB", allocators=["cupy"]))  # doctest: +SKIP
    """

    name = "dask-rmm"
    idempotent = False

    def __init__(
        self,
        pool_size: int | str | float | None = _UNSET,
        maximum_pool_size: int | str | float | None = _UNSET,
        managed_memory: bool = _UNSET,
        async_alloc: bool = _UNSET,
        release_threshold: int | str | float | None = _UNSET,
        log_directory: str | os.PathLike | None = _UNSET,
        track_allocations: bool = _UNSET,
        allocators: Iterable[str] | str | None = _UNSET,
        statistics: bool = _UNSET,
        base_resource: str = _UNSET,
        devices: Iterable[int] | int | str | None = _UNSET,
    ):
        def pick(value: Any, key: str) -> Any:
            return _config(key) if value is _UNSET else value

        self.pool_size = _check_size("pool_size", pick(pool_size, "pool-size"))
        self.maximum_pool_size = _check_size(
            "maximum_pool_size", pick(maximum_pool_size, "maximum-pool-size")
        )
        self.managed_memory = _check_bool("managed_memory", pick(managed_memory, "managed-memory"))
        self.async_alloc = _check_bool("async_alloc", pick(async_alloc, "async"))
        self.release_threshold = _check_size(
            "release_threshold", pick(release_threshold, "release-threshold")
        )
        log_directory = pick(log_directory, "log-directory")
        if log_directory is not None:
            log_directory = os.fspath(log_directory)
            if not log_directory:
                raise ValueError("`log_directory` must be a directory path, got ''")
        self.log_directory = log_directory
        self.track_allocations = _check_bool(
            "track_allocations", pick(track_allocations, "track-allocations")
        )
        self.allocators = _check_allocators(pick(allocators, "allocators"))
        self.statistics = _check_bool("statistics", pick(statistics, "statistics"))
        base = pick(base_resource, "base-resource")
        base = str(base).strip().lower() if base is not None else "cuda"
        if base not in BASE_RESOURCES:
            raise ValueError(
                f"`base_resource` must be one of {', '.join(map(repr, BASE_RESOURCES))}, got {base!r}"
            )
        self.base_resource = base
        self.devices = _check_devices(pick(devices, "devices"))
        self._validate()
        self._stacks: list[DeviceStack] = []
        #: The heartbeat metrics of this plugin's stacks on the worker (no devices before setup).
        self.worker_metrics = WorkerMetrics()

    def _validate(self) -> None:
        if self.async_alloc and self.managed_memory:
            raise ValueError("`managed_memory` is incompatible with `async_alloc`: pick one")
        if self.release_threshold is not None and not self.async_alloc:
            raise ValueError("`release_threshold` requires `async_alloc=True`")
        if self.maximum_pool_size is not None and self.pool_size is None and not self.async_alloc:
            raise ValueError(
                "`maximum_pool_size` was given without `pool_size`; set `pool_size` to use a pool"
            )
        if (
            isinstance(self.pool_size, int)
            and isinstance(self.maximum_pool_size, int)
            and self.maximum_pool_size < self.pool_size
        ):
            raise ValueError(
                f"`maximum_pool_size` ({_describe(self.maximum_pool_size)}) is smaller than "
                f"`pool_size` ({_describe(self.pool_size)})"
            )
        if self.base_resource == "system":
            for option in ("managed_memory", "async_alloc"):
                if getattr(self, option):
                    raise ValueError(
                        f"`{option}` needs base_resource='cuda'; base_resource='system' is host memory"
                    )
            if self.allocators:
                raise ValueError(
                    f"`allocators` {list(self.allocators)} need base_resource='cuda': CuPy and "
                    "Numba cannot use host memory from base_resource='system'"
                )

    @property
    def options(self) -> dict[str, Any]:
        """The resolved options, as keyword arguments to ``RMMPlugin``."""
        return {
            "pool_size": self.pool_size,
            "maximum_pool_size": self.maximum_pool_size,
            "managed_memory": self.managed_memory,
            "async_alloc": self.async_alloc,
            "release_threshold": self.release_threshold,
            "log_directory": self.log_directory,
            "track_allocations": self.track_allocations,
            "allocators": list(self.allocators),
            "statistics": self.statistics,
            "base_resource": self.base_resource,
            "devices": None if self.devices is None else list(self.devices),
        }

    def __repr__(self) -> str:
        shown = ", ".join(
            f"{k}={v!r}"
            for k, v in self.options.items()
            if v is not None and v is not False and v != []
        )
        return f"RMMPlugin({shown})"

    def __getstate__(self) -> dict:
        state = self.__dict__.copy()
        state["_stacks"] = []
        state["worker_metrics"] = WorkerMetrics()
        return state

    # -- setup -----------------------------------------------------------------------------

    async def setup(self, worker: Worker) -> None:
        """Build the stacks on this worker, install them, point allocators, start metrics."""
        self._teardown_local(worker)
        try:
            self._setup_memory(worker)
        except Exception as e:
            raise RMMSetupError(
                f"dask-rmm setup failed on worker {worker.address} (name {worker.name!r}): "
                f"{type(e).__name__}: {e}"
            ) from e
        self._install_metrics(worker)
        await self._install_scheduler_plugin(worker)

    def _setup_memory(self, worker: Worker) -> None:
        from dask_rmm import _cuda

        if self.base_resource == "cuda":
            _cuda.require_cuda(
                "RMMPlugin(base_resource='cuda') (use base_resource='system' "
                "for host memory on a host without a GPU)"
            )
        if self.devices is not None:
            devices = list(self.devices)
        else:
            devices = [_cuda.get_device() if _cuda.is_available() else 0]
        stacks: list[DeviceStack] = []
        try:
            if self.log_directory is not None:
                os.makedirs(self.log_directory, exist_ok=True)
                if not os.access(self.log_directory, os.W_OK | os.X_OK):
                    raise PermissionError(f"log directory {self.log_directory!r} is not writable")
            for device in devices:
                stacks.append(self._build_stack(worker, device))
            for stack in stacks:
                install_stack(stack)
            self._stacks = stacks
            self._set_allocators()
        except BaseException:
            for stack in reversed(stacks):
                uninstall_stack(stack)
                stack.close_log()
            self._stacks = []
            raise

    def _resolve(
        self, option: str, value: int | float | None, total: int, device: int
    ) -> int | None:
        if value is None:
            return None
        from dask_rmm.config import parse_device_bytes
        from dask_rmm.mr.base import format_bytes

        nbytes = parse_device_bytes(value, device, total_memory=total)
        if nbytes > total:
            where = "host memory" if self.base_resource == "system" else f"device {device}'s memory"
            raise ValueError(
                f"`{option}` ({format_bytes(nbytes)}) is larger than {where} ({format_bytes(total)})"
            )
        return nbytes

    def _build_stack(self, worker: Worker, device: int) -> DeviceStack:
        from dask_rmm import _cuda

        current = _cuda.get_device() if _cuda.is_available() else device
        if current != device:
            _cuda.set_device(device)
        try:
            return self._build_stack_on_device(worker, device)
        finally:
            if current != device:
                _cuda.set_device(current)

    def _build_stack_on_device(self, worker: Worker, device: int) -> DeviceStack:
        from dask_rmm import mr

        if self.base_resource == "system":
            total = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
        else:
            from dask_rmm import _cuda

            total = _cuda.device_total_memory(device)
        pool_size = self._resolve("pool_size", self.pool_size, total, device)
        maximum = self._resolve("maximum_pool_size", self.maximum_pool_size, total, device)
        if pool_size is not None and maximum is not None and maximum < pool_size:
            raise ValueError(
                f"`maximum_pool_size` ({_describe(maximum)}) is smaller than `pool_size` "
                f"({_describe(pool_size)}) on device {device}"
            )

        # Layers from the bottom up. The order, outermost first, is attribution -> statistics ->
        # logging -> tracking -> pool/async -> base: attribution reads the allocating thread's
        # task and charges only what succeeded through every layer below; statistics sits right
        # under it so per-task bytes add up to its counters; logging and tracking record the
        # calls as the application made them; every adaptor sits above the pool so it sees
        # what was asked for, not the pool's growth from upstream.
        top: DeviceMemoryResource
        if self.async_alloc:
            top = mr.CudaAsyncMemoryResource(
                initial_pool_size=pool_size,
                release_threshold=self._resolve(
                    "release_threshold", self.release_threshold, total, device
                ),
            )
            if maximum is not None:
                top = mr.LimitingResourceAdaptor(top, allocation_limit=maximum)
        else:
            if self.base_resource == "system":
                base = mr.SystemMemoryResource(device_id=device)
            elif self.managed_memory:
                base = mr.ManagedMemoryResource()
            else:
                base = mr.CudaMemoryResource()
            top = base
            if pool_size is not None:
                top = mr.PoolMemoryResource(
                    base, initial_pool_size=pool_size, maximum_pool_size=maximum
                )
        stack = DeviceStack(device=device, top=top, host_memory=top.is_host_memory)
        try:
            if self.track_allocations:
                top = mr.TrackingResourceAdaptor(top)
            if self.log_directory is not None:
                path, fd = claim_log_file(log_file_path(self.log_directory, worker.name, device))
                stack.log_path, stack.log_fd = path, fd
                # The adaptor adds RMM's ".dev<id>" to the name it is given.
                suffix = f".dev{device}.csv"
                top = stack.logging = mr.LoggingResourceAdaptor(
                    top, log_file_name=path[: -len(suffix)] + ".csv"
                )
            if self.statistics:
                from dask_rmm.mr.attribution_adaptor import AttributionResourceAdaptor

                top = stack.statistics = mr.StatisticsResourceAdaptor(top)
                top = stack.attribution = AttributionResourceAdaptor(
                    top, current_task_key, owner_name=task_prefix
                )
        except BaseException:
            stack.close_log()
            raise
        stack.top = top
        stack.chain = resource_chain(top)
        return stack

    def _set_allocators(self) -> None:
        if "cupy" in self.allocators:
            from dask_rmm.allocators.cupy import set_cupy_allocator

            set_cupy_allocator()
        if "numba" in self.allocators:
            from dask_rmm.allocators.numba import set_numba_allocator

            set_numba_allocator()

    def _reset_allocators(self) -> None:
        if "cupy" in self.allocators:
            from dask_rmm.allocators.cupy import reset_cupy_allocator

            reset_cupy_allocator()
        if "numba" in self.allocators:
            from dask_rmm.allocators.numba import reset_numba_allocator

            reset_numba_allocator()

    def _install_metrics(self, worker: Worker) -> None:
        self.worker_metrics.install(
            worker,
            self._stacks,
            top_n=int(_config("metrics.top-task-groups")),
            sample_interval=_config("metrics.sample-interval"),
            sampling=self.statistics,
        )

    async def _install_scheduler_plugin(self, worker: Worker) -> None:
        """Hook: install the cluster report's scheduler plugin (``dask_rmm.cluster``) once.

        Called by every worker's setup, so the single ``client.register_plugin(RMMPlugin(...))``
        (or a ``--preload dask_rmm.preload`` worker) also sets the scheduler up; the scheduler
        keeps the first one (idempotent). A failure here is logged, never fatal: the workers'
        memory setup does not depend on it.
        """
        try:
            from dask_rmm.cluster import install_scheduler_plugin
        except ImportError:
            return
        try:
            result = install_scheduler_plugin(worker)
            if result is not None and hasattr(result, "__await__"):
                await result
        except Exception:
            logger.warning(
                "dask-rmm: could not install the scheduler plugin from worker %s",
                worker.address,
                exc_info=True,
            )

    # -- teardown --------------------------------------------------------------------------

    def teardown(self, worker: Worker) -> None:
        """Restore the previous resources and allocators and remove the metrics."""
        self._teardown_local(worker)

    def _teardown_local(self, worker: Worker) -> None:
        self.worker_metrics.remove(worker)
        if self._stacks:
            self._reset_allocators()
        for stack in reversed(self._stacks):
            uninstall_stack(stack)
            stack.close_log()
        self._stacks = []

    # -- introspection ---------------------------------------------------------------------

    def resources(self) -> dict[int, DeviceMemoryResource]:
        """The top of the stack this plugin installed, per device (empty before setup)."""
        return {s.device: s.top for s in self._stacks}
