"""RMMPlugin: options -> one stack builder -> install, on every worker, all or nothing (each
worker builds while its old stacks stay installed, then the workers vote through
:mod:`dask_rmm.scheduler.setup_vote`; docs/internals.md draws the walk)."""

from __future__ import annotations

import asyncio
import functools
import logging
import os
import pickle
import uuid
from collections.abc import Iterable
from typing import TYPE_CHECKING, Any

from dask.typing import no_default
from dask.utils import key_split, parse_timedelta
from distributed.comm.addressing import get_address_host
from distributed.diagnostics.plugin import SchedulerPlugin, WorkerPlugin
from distributed.utils import thread_state

from dask_rmm import _cuda, allocators
from dask_rmm.config import config_value
from dask_rmm.logger import OneLineFor
from dask_rmm.pressure.worker import wrap_stacks
from dask_rmm.scheduler import install_scheduler_plugin
from dask_rmm.scheduler.setup_vote import SetupCoordinator, register_on_every_worker
from dask_rmm.sizes import format_bytes, host_total_memory
from dask_rmm.stack.build import build_stack
from dask_rmm.stack.options import RMMOptions
from dask_rmm.worker.admission import admission_of, install_admission, remove_admission
from dask_rmm.worker.fatal import WORKER_LOGGER, stop_worker
from dask_rmm.worker.metrics import WorkerMetrics, add_periodic, remove_periodic, send_metrics
from dask_rmm.worker.stacks import cupy_allocator_note, worker_stack
from dask_rmm.worker.trim import TRIM_INTERVAL, TRIMMER_KEY, PoolTrimmer

if TYPE_CHECKING:
    from distributed import Scheduler, Worker

    from dask_rmm.mr.base import DeviceMemoryResource

__all__ = ["RMMPlugin", "RMMSetupError", "current_task_key", "task_prefix"]

logger = logging.getLogger(__name__)

#: How often a worker writes its allocation logs' buffered rows to disk (seconds): at most
#: distributed's shortest heartbeat interval, so a killed worker loses at most that much.
LOG_FLUSH_INTERVAL = 0.5
_FLUSHER_KEY = "dask-rmm-log-flush"


class RMMSetupError(RuntimeError):
    """RMMPlugin could not set the cluster up; the message names each failed worker and why.

    ``failures`` maps each failed worker's address to its reason.
    """

    def __init__(self, message: str, failures: dict[str, str] | None = None) -> None:
        super().__init__(message)
        self.failures = dict(failures or {})

    @classmethod
    def from_failures(cls, failures: dict[str, str], kept_previous: bool) -> RMMSetupError:
        kept = "every worker keeps its previous setup" if kept_previous else "no worker changed"
        n, s = len(failures), "s" if len(failures) != 1 else ""
        reasons = "; ".join(f"worker {w}: {r}" for w, r in sorted(failures.items()))
        return cls(f"dask-rmm setup failed on {n} worker{s}, so {kept}: {reasons}", failures)


#: distributed logs a failed setup (worker) or registration (scheduler) with its traceback; an
#: RMMSetupError already names each worker and why.
_ONE_LINE = OneLineFor(RMMSetupError)
_UNSET: Any = no_default  # an option not given: the config's


#: The key of the Dask task running on the calling thread, or None: a partial of the builtin
#: getattr, so no Python frame on the allocation path.
current_task_key = functools.partial(getattr, thread_state, "key", None)
#: The task prefix a key is charged to (``"sum-chunk"`` for ``("sum-chunk-abc", 1, 2)``).
task_prefix = key_split


class RMMPlugin(SchedulerPlugin, WorkerPlugin):
    """Give every worker an RMM memory-resource stack, per-task-group statistics and metrics.

    Options are documented once, on :class:`~dask_rmm.stack.RMMOptions` (and in
    docs/workers.md); those not given come from the ``dask-rmm.*`` config. Registering again
    replaces the setup on every worker, all or nothing: if any worker fails, every worker keeps
    its previous stacks and ``register_plugin`` raises :class:`RMMSetupError`.

    >>> from dask_rmm import RMMPlugin
    >>> plugin = RMMPlugin(pool_size="4GiB", allocators=["cupy"])
    >>> plugin.options.pool_size
    4294967296

    >>> client.register_plugin(plugin)  # doctest: +SKIP
    """

    name = "dask-rmm"
    idempotent = False
    #: How a user who made this plugin asks for host memory (named when a worker has no GPU);
    #: the preload names its flag instead.
    host_memory_form = 'RMMPlugin(base_resource="system")'

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
        exact_allocators: Iterable[str] | str | bool | None = _UNSET,
        statistics: bool = _UNSET,
        base_resource: str = _UNSET,
        devices: Iterable[int] | int | str | None = _UNSET,
        device_memory_limit: int | str | float | None = _UNSET,
        spill_on_oom: bool = _UNSET,
        device_pause_fraction: float | None = _UNSET,
        memory_admission: bool = _UNSET,
        oom_retry: bool = _UNSET,
    ):
        given = {k: v for k, v in locals().items() if k != "self" and v is not _UNSET}
        #: The checked options (:class:`~dask_rmm.stack.RMMOptions`); the rest from the config.
        self.options = RMMOptions.from_config(**given)
        #: Identifies this registration in the setup vote.
        self.token = uuid.uuid4().hex
        #: False for a plugin one worker sets up alone (the preload): no vote.
        self.coordinated = True
        #: The heartbeat metrics of this worker's stacks.
        self.worker_metrics = WorkerMetrics()
        self._worker: Any = None

    def __repr__(self) -> str:
        default = RMMOptions().to_dict()
        shown = ", ".join(
            f"{k}={v!r}" for k, v in self.options.to_dict().items() if v != default[k]
        )
        return f"RMMPlugin({shown})"

    def __getstate__(self) -> dict:
        return {**self.__dict__, "worker_metrics": WorkerMetrics(), "_worker": None}

    async def start(self, scheduler: Scheduler) -> None:
        """On the scheduler (``register_plugin`` sends a SchedulerPlugin there first): register
        on every worker from there, so a worker dying meanwhile is named in the scheduler's log
        instead of failing ``register_plugin`` with a comm error."""
        logging.getLogger("distributed.core").addFilter(_ONE_LINE)  # its handler logs errors
        await register_on_every_worker(scheduler, self)
        # The scheduler adds this object to its plugins right after this returns: drop it on
        # the next iteration, and now one an earlier registration left (adding over it warns).
        _forget_scheduler_plugins(scheduler)
        asyncio.get_running_loop().call_soon(_forget_scheduler_plugins, scheduler)

    def transition(self, key: Any, start: str, finish: str, *args: Any, **kwargs: Any) -> None:
        """On a worker with memory admission, admission follows the task
        (:meth:`dask_rmm.worker.admission.WorkerAdmission.transition`); nothing otherwise."""
        if self._worker is not None:
            admission = admission_of(self._worker)
            if admission is not None:
                admission.transition(key, start, finish)

    async def setup(self, worker: Worker) -> None:
        """Build this worker's stacks, vote, then roll back (keep the previous ones) or commit."""
        logging.getLogger("distributed.worker").addFilter(_ONE_LINE)  # plugin_add logs errors
        ws = worker_stack(worker)
        # First, before any await: keep the stacks a teardown of the plugin we replace handed back
        # installed until ours are ready (or for good if we fail).
        kept = ws.take_released()
        self._worker = worker
        stacks, pressure, error = self._build(worker)
        failures, current, joining = await self._vote(worker, error, ws.token if kept else None)
        if failures or not current:
            pressure = None
            await self._roll_back(worker, ws, stacks, failures, joining)
            return
        await self._commit(worker, ws, stacks, pressure)

    def _build(self, worker: Worker) -> tuple[list, Any, str | None]:
        """This worker's new stacks and their memory-pressure layer, installed nowhere yet; or
        the ones built before an error, and the error as one line (``"Type: message"``)."""
        stacks: list = []
        try:
            for device in self.options.devices or [_cuda.current_device()]:
                stacks.append(
                    build_stack(
                        self.options,
                        device,
                        worker_name=worker.name,
                        task_key=current_task_key,
                        owner_name=task_prefix,
                    )
                )
            # a library the worker lacks fails here, before any stack is installed (after a
            # missing GPU: installing torch would not help there)
            allocators.check_allocators(self.options.allocators)
            pressure = wrap_stacks(self.options, stacks, task_key=current_task_key)
        except Exception as e:
            return stacks, None, f"{type(e).__name__}: {self._hint(e)}"
        return stacks, pressure, None

    async def _roll_back(
        self, worker: Worker, ws: Any, stacks: list, failures: dict, joining: bool
    ) -> None:
        """Discard the new stacks and keep the previous setup; raise :class:`RMMSetupError`
        when any worker failed (a worker that joined a set-up cluster and failed also stops)."""
        # The error's traceback keeps our frames: no discarded stack may stay in them.
        while stacks:
            stacks.pop().close_log()
        owner = ws.plugin
        if (
            not failures
            and owner is not None
            and owner is not self
            and owner.token == ws.token
            and worker.plugins.get(self.name) is self
        ):
            # Superseded by a registration that reached this worker first and that this one
            # tore down in worker.plugins; its stacks stay installed, so put it back.
            worker.plugins[self.name] = owner
            owner._worker = worker
            owner._publish(worker, ws)
        elif failures or worker.plugins.get(self.name) is self:
            self._publish(worker, ws)
        if failures:
            setup_error = RMMSetupError.from_failures(failures, kept_previous=bool(ws.active))
            if joining and worker.address in failures:
                # joined a cluster set up this way: it must not run on without the setup
                reason = f"dask-rmm setup failed: {failures[worker.address]}"
                await stop_worker(worker, reason, close_later=True)
            raise setup_error
        # a later registration (two clients at once) is the one every worker installs
        WORKER_LOGGER.info(
            "dask-rmm: worker %s: a later registration replaced this one", worker.name
        )

    async def _commit(self, worker: Worker, ws: Any, stacks: list, pressure: Any) -> None:
        """Install the new stacks (the previous ones retire), publish their metrics and make
        sure the scheduler has the cluster report's plugin."""
        if worker.plugins.get(self.name) is not self:
            # a later registration that reached us first tore this one down; the scheduler keeps it
            worker.plugins[self.name] = self
            self._worker = worker
        ws.install(stacks, self.options, self.token)
        ws.plugin = self
        ws.set_pressure(worker, pressure)
        for stack in stacks:
            WORKER_LOGGER.info("dask-rmm: worker %s installed %s", worker.name, stack.describe())
        if (note := cupy_allocator_note()) is not None:
            WORKER_LOGGER.info("dask-rmm: worker %s: %s", worker.name, note)
        self._publish(worker, ws)
        if self.options.memory_admission and pressure is not None:
            await install_admission(worker, pressure, self.options.oom_retry)
        else:
            remove_admission(worker)
        await self._warn_if_host_overcommitted(worker, stacks)
        try:  # the cluster report's scheduler plugin, once (idempotent)
            await install_scheduler_plugin(worker)
        except Exception:
            logger.warning(
                "dask-rmm: could not install the scheduler plugin from worker %s",
                worker.address,
                exc_info=True,
            )
        if self.coordinated:  # a report right after register_plugin shows this setup
            await send_metrics(worker)

    def _hint(self, e: Exception) -> str:
        """``e``'s message; a missing GPU names the form the user typed to use host memory."""
        message = str(e)
        if isinstance(e, _cuda.CUDAUnavailableError) and "Use host memory explicitly" in message:
            message = message.split("Use host memory explicitly")[0].rstrip()
            message += (
                f" For host memory instead give {self.host_memory_form} "
                "(or config dask-rmm.base-resource: system)."
            )
        return message

    async def _warn_if_host_overcommitted(self, worker: Worker, stacks: list) -> None:
        """Warn when a pool that is a fraction of host memory, times the workers on this host,
        is more than the host has (every worker takes its fraction of the whole host)."""
        if not stacks or not stacks[0].host_memory or not isinstance(self.options.pool_size, float):
            return
        try:
            host = get_address_host(worker.address)
            info = await worker.scheduler.identity()
            workers = info.get("workers", {}).items()
            n = len({a for a, w in workers if w.get("host") == host} | {worker.address})
        except Exception:  # only a warning: never fail the setup for it
            return
        total = host_total_memory()
        pools = sum(s.pool_size or 0 for s in stacks) * n
        if n > 1 and pools > total:
            WORKER_LOGGER.warning(
                "dask-rmm: worker %s: pool_size %s is a fraction of host memory, and the %d "
                "workers on host %s each take it: %s in all, more than the host's %s; give a "
                "smaller fraction (%.2f or less) or a size in bytes",
                worker.name,
                self.options.pool_size,
                n,
                host,
                format_bytes(pools),
                format_bytes(total),
                int(100 / n) / 100,
            )

    async def _vote(
        self, worker: Worker, error: str | None, previous: str | None
    ) -> tuple[dict, bool, bool]:
        """The failures of this registration on every worker (``{}``: all succeeded), whether
        it is still the scheduler's registration of the plugin, and whether this worker joined
        after the registration succeeded on the others. An uncoordinated plugin (the preload)
        decides alone."""
        try:
            if self.coordinated:
                await worker.scheduler.register_scheduler_plugin(
                    plugin=pickle.dumps(SetupCoordinator()),
                    name=SetupCoordinator.name,
                    idempotent=True,
                )
                answer = await worker.scheduler.dask_rmm_setup_vote(
                    token=self.token, name=self.name, worker=worker.address, error=error,
                    previous=previous,
                )  # fmt: skip
                return answer["failures"], answer["current"], bool(answer.get("joined"))
        except Exception as e:
            logger.warning(
                "dask-rmm: cannot agree the setup with the other workers (%s: %s); worker %s "
                "decides alone", type(e).__name__, e, worker.address,
            )  # fmt: skip
        return ({worker.address: error} if error else {}), True, False

    def _publish(self, worker: Worker, ws: Any) -> None:
        """Heartbeat metrics, the log flusher and the pool trimmer for the worker's active stacks."""
        if not ws.active:
            return
        try:  # checked where the plugin was made; a worker's own bad config: the defaults
            top_n = int(config_value("metrics.top-task-groups"))
            interval = parse_timedelta(config_value("metrics.sample-interval"), default="ms")
        except (TypeError, ValueError, KeyError):
            top_n, interval = 10, 0.1
        self.worker_metrics.install(
            worker, ws.active, top_n=top_n, sample_interval=interval, sampling=ws.options.statistics
        )
        if any(s.logging is not None for s in [*ws.active, *ws.retired]):
            add_periodic(worker, _FLUSHER_KEY, ws.flush_logs, LOG_FLUSH_INTERVAL)
        if trimmer := PoolTrimmer(ws.active):  # release_threshold with a PoolMemoryResource
            add_periodic(worker, TRIMMER_KEY, trimmer, TRIM_INTERVAL)
        else:
            remove_periodic(worker, TRIMMER_KEY)

    def teardown(self, worker: Worker) -> None:
        """Take the metrics back and hand the stacks back: a plugin replacing this one keeps
        them until its own are ready; otherwise they are removed on the next loop iteration
        (at once when the worker closes), restoring the previous resources and allocators."""
        self.worker_metrics.remove(worker)
        remove_admission(worker)  # waiting tasks start now
        remove_periodic(worker, _FLUSHER_KEY)
        remove_periodic(worker, TRIMMER_KEY)
        ws = worker_stack(worker)
        if ws.release():
            if worker.status.name in ("closing", "closed", "failed", "init"):
                ws.remove_released()
            elif ws.command_line is not None and ws.command_line is not self:
                # Unregistered on a worker set up by its command line: that setup comes back.
                worker.loop.add_callback(ws.restore_command_line, worker)
            else:
                worker.loop.add_callback(ws.remove_released)
        if worker.status.name == "running":  # a report right after no longer shows this setup
            worker.loop.add_callback(send_metrics, worker)
        self._worker = None

    @property
    def worker_pressure(self) -> Any:
        """The memory-pressure layer on this plugin's worker (``WorkerPressure``), or None."""
        return worker_stack(self._worker).pressure if self._worker is not None else None

    def resources(self) -> dict[int, DeviceMemoryResource]:
        """The top of each device's installed stack on this plugin's worker (empty before setup)."""
        if self._worker is None:
            return {}
        return {s.device: s.top for s in worker_stack(self._worker).active}


def _forget_scheduler_plugins(scheduler: Scheduler) -> None:
    """Remove every RMMPlugin from the scheduler's plugins (see :meth:`RMMPlugin.start`)."""
    for name, plugin in list(scheduler.plugins.items()):
        if isinstance(plugin, RMMPlugin):
            scheduler.remove_plugin(name)
