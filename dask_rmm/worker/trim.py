"""Giving the workers' pooled memory back: now from a client (:func:`release_unused`), or
automatically above ``release_threshold`` (:class:`PoolTrimmer`). Not here: trimming one pool
(:mod:`dask_rmm.mr.trim`).
"""

from __future__ import annotations

import dataclasses
import logging
from typing import TYPE_CHECKING, Any

from dask_rmm.allocators.caches import release_cached
from dask_rmm.mr.trim import TrimResult, trim_resource
from dask_rmm.sizes import parse_size
from dask_rmm.worker.stacks import worker_stack

if TYPE_CHECKING:
    from distributed import Client, Worker

    from dask_rmm.stack.build import DeviceStack

__all__ = ["TRIM_INTERVAL", "TRIMMER_KEY", "PoolTrimmer", "release_unused", "trim_worker"]

logger = logging.getLogger(__name__)

#: Seconds between two checks of the pools against ``release_threshold``.
TRIM_INTERVAL = 1.0
#: Key of the trimmer in ``worker.periodic_callbacks``.
TRIMMER_KEY = "dask-rmm-trim"


async def trim_worker(
    dask_worker: Worker, size: int | str | float | None = None, library_caches: bool = True
) -> list[dict[str, Any]]:
    """On a worker (``client.run``): the library caches give their free blocks back
    (``library_caches``), then the stacks' pools are trimmed; one ``TrimResult.to_dict()`` per
    pool. The metrics go to the scheduler at once, so that a report right after shows it."""
    out = []
    for stack in worker_stack(dask_worker).active:
        from_caches = release_cached(stack.device) if library_caches else 0
        results = trim_resource(stack.top, size, device=stack.device)
        if results:  # the caches gave their blocks to the stack's outermost pool
            results[0] = dataclasses.replace(results[0], library_cache_bytes=from_caches)
        out += [r.to_dict() for r in results]
    if out:
        from dask_rmm.worker.metrics import send_metrics

        await send_metrics(dask_worker)
    return out


def release_unused(
    client: Client | None = None,
    size: int | str | float | None = None,
    *,
    workers: list[str] | None = None,
    library_caches: bool = True,
) -> Any:
    """Give the free memory of every worker's pools back to the device, now: the library caches
    give their free blocks back, then each pool releases its fully free chunks down to ``size``
    (default: its ``pool_size``; a cudaMallocAsync pool's: its release threshold).

    Parameters
    ----------
    client : distributed.Client, optional
        Default: the current client.
    size : int, str or float, optional
        Bytes each pool keeps at least (``"2GiB"``, a fraction of the device, ``0``: as little
        as possible).
    workers : str or list of str, optional
        Only these workers (an address, or a list of them; default: all).
    library_caches : bool
        Have the library caches give their free blocks back first.

    Returns ``{worker address: [TrimResult per pool]}``, with ``released_bytes`` and the pool's
    reserved bytes before and after (an awaitable of it with an asynchronous client). Workers
    without dask-rmm map to ``[]``. Examples: docs/gpu-memory-tools.md.
    """
    size, workers = _check_release_arguments(size, workers, library_caches)
    if client is None:
        from distributed import default_client

        client = default_client()

    async def run() -> dict[str, list[TrimResult]]:
        if workers is not None:  # client.run waits 30 s for a non-worker, or raises TypeError
            scheduler: Any = client.scheduler
            info = (await scheduler.identity())["workers"]
            known = {*info, *(str(w.get("name")) for w in info.values())}
            if unknown := [w for w in workers if w not in known and f"tcp://{w}" not in known]:
                raise ValueError(
                    f"release_unused: {', '.join(unknown)} is not a worker of the scheduler at "
                    f"{scheduler.address} (workers: {', '.join(sorted(info)) or 'none'})"
                )
        raw = await client.run(
            trim_worker, size=size, library_caches=library_caches, workers=workers
        )
        return {w: [TrimResult(**r) for r in rs] for w, rs in raw.items()}

    return client.sync(run)


def _check_release_arguments(
    size: Any, workers: Any, library_caches: Any
) -> tuple[Any, list[str] | None]:
    """``release_unused``'s arguments checked on the client; one address becomes a list."""
    parse_size(size, "size")
    if isinstance(workers, str):
        workers = [workers]
    elif workers is not None:
        try:
            workers = list(workers)
        except TypeError:
            raise TypeError(
                f"`workers` must be a worker address or a list of them, got {workers!r}"
            ) from None
        if bad := [w for w in workers if not isinstance(w, str)]:
            raise TypeError(f"`workers` must be worker addresses (strings), got {bad[0]!r}")
    if not isinstance(library_caches, bool):
        raise TypeError(f"`library_caches` must be True or False, got {library_caches!r}")
    return size, workers


class PoolTrimmer:
    """A worker's automatic trimming: every :data:`TRIM_INTERVAL` seconds, each pool holding
    more than its stack's ``release_threshold`` gives fully free chunks back down to it (as
    cudaMallocAsync's release threshold does at synchronizations); live blocks are untouched.
    """

    def __init__(self, stacks: list[DeviceStack]):
        self.stacks = [s for s in stacks if s.release_threshold is not None]
        #: Bytes released so far, per device.
        self.released: dict[int, int] = {}
        self._failed: set[int] = set()

    def __bool__(self) -> bool:
        return bool(self.stacks)

    def __call__(self) -> None:
        for stack in self.stacks:
            pool, threshold = stack.pool, stack.release_threshold or 0
            try:
                n = pool.trim(threshold) if pool is not None and pool.pool_size() > threshold else 0
                if n:
                    self.released[stack.device] = self.released.get(stack.device, 0) + n
            except Exception:  # a periodic callback must go on; say why once per device
                if stack.device not in self._failed:
                    self._failed.add(stack.device)
                    logger.exception("dask-rmm: trimming device %d's pool failed", stack.device)
