"""Memory admission on a Dask worker: :class:`AdmissionThreadPoolExecutor` is installed as the
worker's default executor in front of the real thread pool. distributed hands it each task as it
would the pool (the task is ``executing`` in the worker's state machine); the executor passes it
to the pool once the gate (:class:`~dask_rmm.pressure.admission.AdmissionGate`) says its
expected peak fits, and learns the task's peak when it finishes. A task that raised an
out-of-memory error of any library is run once more after room is made
(:func:`~dask_rmm.allocators.arbitration.make_room`). Teardown starts every waiting task and puts
the pool back. Not here: the policy (Dask-free) and the per-task accounting (the pressure
adaptor).

distributed details this relies on, each with a test that fails when it moves
(tests/worker/test_admission.py): ``Worker.execute`` runs a task through
``run_in_executor_with_context`` (with the task's key in ``thread_state``) only for an executor
whose type name contains "ThreadPoolExecutor"; it adds the key to ``Worker.active_keys`` and sets
``ts.start_time`` just before submitting, with no ``await`` in between (tasks whose
``run_spec.is_coro``, or with an ``executor`` annotation naming another executor, are not
submitted here); ``_run_task`` returns a dict whose ``"op"`` is ``"task-erred"`` with the
exception as ``"actual_exception"``.
"""

from __future__ import annotations

import logging
import threading
import traceback
from collections.abc import Callable, Hashable
from concurrent.futures import Executor, Future
from typing import TYPE_CHECKING, Any

from dask.utils import key_split

from dask_rmm.allocators.arbitration import is_out_of_memory, make_room, requested_bytes
from dask_rmm.allocators.torch import get_torch_cache
from dask_rmm.pressure.admission import AdmissionGate, AdmissionMetrics
from dask_rmm.worker.metrics import add_periodic, remove_periodic

if TYPE_CHECKING:
    from distributed import Worker

    from dask_rmm.pressure.worker import WorkerPressure

__all__ = [
    "ANNOTATION",
    "AdmissionThreadPoolExecutor",
    "admission_of",
    "install_admission",
    "remove_admission",
]

logger = logging.getLogger(__name__)

#: The task annotation giving a task's expected peak: ``dask.annotate(gpu_memory="2GiB")``.
ANNOTATION = "gpu_memory"
#: Key of the periodic look at the waiting tasks in ``worker.periodic_callbacks``, and seconds.
PUMP_KEY = "dask-rmm-admission"
PUMP_INTERVAL = 0.1


class AdmissionThreadPoolExecutor(Executor):
    """The worker's default executor under memory admission (see the module doc).

    Parameters
    ----------
    inner : Executor
        The worker's thread pool; tasks run there.
    worker : Worker
        Whose tasks (``active_keys``, ``state.tasks``) are submitted.
    gate : AdmissionGate
        Says when a task may start.
    pressure : WorkerPressure, optional
        Its devices are where room is made before a task that ran out of memory runs again.
    """

    def __init__(
        self,
        inner: Executor,
        worker: Worker,
        gate: AdmissionGate,
        pressure: WorkerPressure | None = None,
    ):
        self.inner = inner
        self.worker = worker
        self.gate = gate
        self.pressure = pressure
        # Keys claimed by a submission: key -> the task's start_time then (a task run again
        # on this worker has a new one).
        self._claims: dict[Hashable, Any] = {}
        self._bad_annotations: set[str] = set()
        self._lock = threading.Lock()

    # -- which task is submitted --------------------------------------------------------------

    def _claim_key(self) -> Hashable | None:
        """The key of the task being submitted now, or None (not a task's submission)."""
        worker = self.worker
        try:
            active = worker.active_keys
            tasks = worker.state.tasks
        except AttributeError:
            return None
        claims = self._claims
        for k in [k for k in claims if k not in active]:
            del claims[k]
        new = []
        for k in active:
            ts = tasks.get(k)
            if ts is None or not _in_default_executor(ts):
                continue  # a coroutine task, or one annotated with another executor
            start = getattr(ts, "start_time", None)
            if k not in claims or claims[k] != start:
                new.append((k, start))
        if len(new) != 1:
            return None
        key, start = new[0]
        claims[key] = start
        return key

    def _given_peak(self, key: Hashable) -> int | None:
        """The task's ``gpu_memory`` annotation in bytes, or None."""
        ts = self.worker.state.tasks.get(key)  # type: ignore[call-overload]
        annotations = getattr(ts, "annotations", None) or {}
        value = annotations.get(ANNOTATION)
        if value is None:
            return None
        from dask.utils import parse_bytes

        try:
            nbytes = parse_bytes(value) if isinstance(value, str) else int(value)
            if nbytes < 0:
                raise ValueError("negative")
            return nbytes
        except (TypeError, ValueError) as e:
            text = repr(value)
            if text not in self._bad_annotations:
                self._bad_annotations.add(text)
                logger.warning(
                    "dask-rmm: task annotation %s=%s is not a size (%s); its peak is learned",
                    ANNOTATION,
                    text,
                    e,
                )
            return None

    # -- the Executor interface ---------------------------------------------------------------

    def submit(self, fn: Callable, /, *args: Any, **kwargs: Any) -> Future:
        """A future of ``fn(*args, **kwargs)``: run in the pool once the gate admits the task
        being submitted (at once for a call that is not a task's)."""
        key = self._claim_key()
        if key is None:
            return self.inner.submit(fn, *args, **kwargs)
        prefix, given = key_split(key), self._given_peak(key)
        if self.gate.admit_now(key, prefix, given):  # no future of our own to make
            return self.inner.submit(self._run_admitted, key, fn, args, kwargs)
        outer: Future = Future()

        def start() -> None:
            try:
                self.inner.submit(self._run, key, outer, fn, args, kwargs)
            except BaseException as e:  # the pool is shut down: the task fails, not hangs
                self.gate.finished(key, learn=False)
                if outer.set_running_or_notify_cancel():
                    outer.set_exception(e)

        def withdrawn(f: Future) -> None:
            if f.cancelled():  # cancelled while waiting (the worker is closing)
                self.gate.withdraw(key)

        outer.add_done_callback(withdrawn)
        self.gate.request(key, prefix, given, start, outer)
        return outer

    def _run_admitted(self, key: Hashable, fn: Callable, args: tuple, kwargs: dict) -> Any:
        """In a thread of the pool, for a task admitted at once: :meth:`_run` without a future
        of our own (a task cancelled before it ran stays counted: only a closing worker
        cancels)."""
        try:
            return self._call(key, fn, args, kwargs)
        finally:
            self.gate.finished(key)

    def _call(self, key: Hashable, fn: Callable, args: tuple, kwargs: dict) -> Any:
        """Run the task, once more after an out-of-memory error."""
        result = fn(*args, **kwargs)
        error = _task_error(result)
        if error is not None and is_out_of_memory(error):
            need = self._room_needed(key, error)
            # The failed run's frames (kept by the traceback) hold its arrays: let them go.
            traceback.clear_frames(error.__traceback__)
            del error, result
            result = self._run_again(key, need, fn, args, kwargs)
        return result

    def _run(self, key: Hashable, outer: Future, fn: Callable, args: tuple, kwargs: dict) -> None:
        """In a thread of the pool: run the task (once more after an out-of-memory error)."""
        if not outer.set_running_or_notify_cancel():
            self.gate.finished(key, learn=False)
            return
        try:
            result = self._call(key, fn, args, kwargs)
        except BaseException as e:
            self.gate.finished(key)
            outer.set_exception(e)
            return
        self.gate.finished(key)
        outer.set_result(result)

    def _room_needed(self, key: Hashable, error: BaseException) -> int:
        """Bytes to make room for: what the error says was asked for, at least what the failed
        run held at its peak; for a library that says nothing, all that can be spilled."""
        account = self.gate.accounts.get(key)
        need = max(requested_bytes(error), account[1] if account else 0)
        pressure = self.pressure
        if not need and pressure is not None:
            need = sum(dp.admission_limit() for dp in pressure.devices.values())
        return need

    def _run_again(self, key: Hashable, need: int, fn: Callable, args: tuple, kwargs: dict) -> Any:
        """Make room on every device (caches give back, outputs spill, then the pool's fully free
        chunks go back to the device, for libraries that allocate beside the stack such as
        PyTorch's own allocator), run the task once more; its second result."""
        pressure = self.pressure
        devices = sorted(pressure.devices) if pressure is not None else [0]
        for device in devices:
            make_room(device, need, library="task")
            torch_cache = get_torch_cache()
            if torch_cache is not None and torch_cache.cap(device) is not None:
                # PyTorch's allocator shares the pool's maximum: trim the pool only as far as
                # the retry needs, and raise PyTorch's cap by what was given back.
                torch_cache.make_room(device, need)
            elif pressure is not None:
                pool = pressure.devices[device].pool
                if pool is not None:
                    pool.release()
                pressure.counters.add(device, "task_retries")
        result = fn(*args, **kwargs)
        if _task_error(result) is None and pressure is not None:
            for device in devices:
                pressure.counters.add(device, "task_retries_succeeded")
        return result

    def admission_metrics(self) -> AdmissionMetrics:
        """What the gate did (the heartbeat's admission fields)."""
        return self.gate.metrics()

    def shutdown(self, wait: bool = True, *, cancel_futures: bool = False) -> None:
        """The worker is closing: waiting tasks are dropped (their futures cancelled; the
        scheduler gives their keys to other workers), then the pool shuts down."""
        for outer in self.gate.drop_waiting():
            outer.cancel()
        self.inner.shutdown(wait=wait, cancel_futures=cancel_futures)

    def __repr__(self) -> str:
        return f"<AdmissionThreadPoolExecutor over {self.inner!r}>"


def _in_default_executor(ts: Any) -> bool:
    """Whether distributed submits task ``ts`` to the default executor."""
    if getattr(ts.run_spec, "is_coro", False):
        return False
    return (getattr(ts, "annotations", None) or {}).get("executor", "default") == "default"


def _task_error(result: Any) -> BaseException | None:
    """The exception of a task's failed result (distributed's ``_run_task`` result), or None."""
    if isinstance(result, dict) and result.get("op") == "task-erred":
        error = result.get("actual_exception")
        return error if isinstance(error, BaseException) else None
    return None


def install_admission(worker: Worker, pressure: WorkerPressure) -> AdmissionThreadPoolExecutor:
    """Put an :class:`AdmissionThreadPoolExecutor` in front of ``worker``'s default executor
    (one left by an earlier setup is taken off first); tasks are admitted under the sum of the
    devices' limits (``device_memory_limit``, else the capacity) beside the bytes in use."""
    remove_admission(worker)
    devices = list(pressure.devices.values())

    def limit() -> int:
        return sum(dp.admission_limit() for dp in devices)

    def held() -> int:
        return sum(dp.current_bytes() for dp in devices)

    def seceded(key: Hashable) -> bool:
        # A task that called secede() (to wait for other tasks, worker_client) must not hold
        # them back: it no longer counts as running.
        ts = worker.state.tasks.get(key)  # type: ignore[call-overload]
        return ts is not None and ts.state == "long-running"

    gate = AdmissionGate(limit, held, accounts=pressure.task_accounts, ignore=seceded)
    executor = AdmissionThreadPoolExecutor(worker.executors["default"], worker, gate, pressure)
    worker.executors["default"] = executor
    # Memory freed without a task finishing (outputs released or spilled), a task seceding:
    # waiting tasks are looked at again every so often, not only when a task finishes.
    add_periodic(worker, PUMP_KEY, gate.pump, PUMP_INTERVAL)
    return executor


def admission_of(worker: Worker) -> AdmissionThreadPoolExecutor | None:
    """The admission executor installed on ``worker``, or None."""
    executor = getattr(worker, "executors", {}).get("default")
    return executor if isinstance(executor, AdmissionThreadPoolExecutor) else None


def remove_admission(worker: Worker) -> None:
    """Take the admission executor off ``worker`` (if it has one): waiting tasks start now (a
    worker that is closing drops them instead), the pool is the default executor again."""
    executor = worker.executors.get("default")
    if not isinstance(executor, AdmissionThreadPoolExecutor):
        return
    worker.executors["default"] = executor.inner
    remove_periodic(worker, PUMP_KEY)
    if worker.status.name in ("closing", "closed", "failed"):
        for outer in executor.gate.drop_waiting():
            outer.cancel()
    else:
        executor.gate.close()
