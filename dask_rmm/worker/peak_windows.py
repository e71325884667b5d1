"""Task-group peaks over a block of work (a performance report's): open a peak window on each
active stack's attribution adaptor, later close it and read each task group's peak."""

from __future__ import annotations

import weakref
from typing import Any

from dask_rmm.worker.stacks import worker_stack

__all__ = ["close_peak_windows", "open_peak_windows"]

# worker -> window id -> [(attribution adaptor, device, token)]
_open: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def open_peak_windows(dask_worker: Any, window: str) -> int:
    """On a worker (``client.run``): open the window ``window`` on every active stack that
    attributes memory to task groups; the number of devices it covers."""
    entries = []
    for stack in worker_stack(dask_worker).active:
        if (attribution := stack.attribution) is not None:
            entries.append((weakref.ref(attribution), stack.device, attribution.open_window()))
    _open.setdefault(dask_worker, {})[window] = entries
    return len(entries)


def close_peak_windows(dask_worker: Any, window: str) -> dict[str, dict[str, int] | None]:
    """On a worker (``client.run``): close ``window``; ``{device: {task group: peak bytes}}``,
    None for a device whose stack was replaced during the window."""
    active = [s.attribution for s in worker_stack(dask_worker).active]
    out: dict[str, dict[str, int] | None] = {}
    for ref, device, token in _open.get(dask_worker, {}).pop(window, []):
        attribution = ref()
        try:
            peaks = attribution.close_window(token) if attribution is not None else None
        except KeyError:
            peaks = None
        still = attribution is not None and any(a is attribution for a in active)
        out[str(device)] = peaks if still else None
    return out
