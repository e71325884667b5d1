"""What RMMPlugin installed on one worker device: the stack's record, the per-process registry that
installs it and restores the previous resource, its log file. Not here: building it (``plugin.py``).
"""

from __future__ import annotations

import logging
import os
import re
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from dask_rmm.mr.base import DeviceMemoryResource

__all__ = [
    "DeviceStack",
    "claim_log_file",
    "install_stack",
    "log_file_path",
    "resource_chain",
    "uninstall_stack",
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

    def close_log(self) -> None:
        if self.logging is not None:
            for method in ("flush", "close"):
                fn = getattr(self.logging, method, None)
                if fn is not None:
                    try:
                        fn()
                    except Exception:  # pragma: no cover - teardown must go on
                        logger.exception("dask-rmm: %s of %s failed", method, self.log_path)
        if self.log_fd is not None:
            os.close(self.log_fd)
            self.log_fd = None


def resource_chain(mr: Any) -> str:
    """The class names of a resource and its upstreams, outermost first, joined by ``>``."""
    names = []
    while mr is not None:
        names.append(type(mr).__name__)
        mr = getattr(mr, "upstream_mr", None)
    return ">".join(names)


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
