"""Stopping a worker whose dask-rmm setup failed: the reason on one line, exit status 1, no
restart by its nanny, and the ``dask worker`` command exiting 1 without tracebacks of its own
(failing the worker's start instead logs the exception about 150 lines' worth, three times).
"""

from __future__ import annotations

import asyncio
import atexit
import contextlib
import logging
import os
import sys
import tempfile
from typing import Any

__all__ = ["WORKER_LOGGER", "arm_worker_command", "stop_worker"]

#: What dask-rmm did on a worker: a child of ``distributed.worker``, so that distributed's
#: logging shows it at INFO and ``Client.get_worker_logs()`` returns it.
WORKER_LOGGER = logging.getLogger("distributed.worker.dask_rmm")

#: Set by ``dask worker`` for its worker processes: the file where one writes why it stopped.
FAILURE_FILE_ENV = "_DASK_RMM_FAILURE_FILE"

_armed: str | None = None  # the failure file, in the process that made it


def _reasons(path: str) -> list[str]:
    try:
        with open(path) as f:
            return [line.strip() for line in f if line.strip()]
    except OSError:
        return []


def arm_worker_command() -> None:
    """In a ``dask (cuda) worker`` process: exit with status 1 and no traceback once one of
    its workers stopped because its dask-rmm setup failed. Idempotent."""
    global _armed
    if _armed is not None:
        return
    fd, path = tempfile.mkstemp(prefix="dask-rmm-failures-", suffix=".txt")
    os.close(fd)
    os.environ[FAILURE_FILE_ENV] = path
    _armed = path
    previous_hook = sys.excepthook

    def excepthook(kind: type[BaseException], value: BaseException, tb: Any) -> None:
        # "Nanny failed to start" and its chain say nothing the worker's line did not
        if not _reasons(path):
            previous_hook(kind, value, tb)

    def exit_status() -> None:
        failed = _reasons(path)
        with contextlib.suppress(OSError):
            os.unlink(path)
        if failed:
            # the command would end with status 0: exit now, after the other exit handlers
            atexit.unregister(exit_status)
            atexit._run_exitfuncs()
            sys.stdout.flush()
            sys.stderr.flush()
            os._exit(1)

    class Quiet(logging.Filter):
        # the nanny's own shutdown after that adds tracebacks that say nothing more
        def filter(self, record: logging.LogRecord) -> bool:
            return not (record.exc_info and _reasons(path))

    for handler in logging.getLogger("distributed").handlers:
        handler.addFilter(Quiet())
    sys.excepthook = excepthook
    atexit.register(exit_status)


def _record(reason: str) -> None:
    path = os.environ.get(FAILURE_FILE_ENV)
    if path:
        with contextlib.suppress(OSError), open(path, "a") as f:  # else the exit status says it
            f.write(reason + "\n")


def one_line(text: str) -> str:
    """``text`` on one line (an exception's message may span several)."""
    return " ".join(text.split())


async def stop_worker(worker: Any, reason: str, *, close_later: bool = False) -> None:
    """Log ``reason`` on one line and stop ``worker``: a process of its own exits with status 1
    (its nanny told first not to restart it); otherwise the worker is closed (``close_later``:
    on the next loop iteration) and this returns."""
    reason = one_line(reason)
    WORKER_LOGGER.error("dask-rmm: stopping worker %s: %s", worker.name, reason)
    own_process = bool(getattr(worker, "nanny", None)) or _armed is not None
    if not own_process:
        closing = worker.close(reason=f"dask-rmm setup failed: {reason}", nanny=False)
        if close_later:
            asyncio.get_running_loop().create_task(closing)
        else:
            await closing
        return
    _record(f"{worker.name}: {reason}")
    if worker.nanny:
        # On failure the exit below still stops the worker; a restart fails the same way.
        with contextlib.suppress(Exception):
            async with worker.rpc(worker.nanny) as nanny:
                await asyncio.wait_for(
                    nanny.close_gracefully(reason="dask-rmm setup failed"), timeout=2
                )
    for handler in logging.getLogger().handlers + logging.getLogger("distributed").handlers:
        with contextlib.suppress(Exception):
            handler.flush()
    sys.stdout.flush()
    sys.stderr.flush()
    if _armed is not None:  # the command itself (--no-nanny): its exit handlers do not run
        with contextlib.suppress(OSError):
            os.unlink(_armed)
    os._exit(1)
