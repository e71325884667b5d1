"""Giving pooled memory back to the upstream: each pool in a resource chain, and
:func:`trim_pools` over this process's device resources. Not here: the cluster-wide call and the
worker's automatic trimming (:mod:`dask_rmm.worker.trim`)."""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from dataclasses import asdict, dataclass
from typing import Any

from dask_rmm import _cuda
from dask_rmm.mr.base import upstreams
from dask_rmm.mr.cuda import CudaAsyncMemoryResource
from dask_rmm.mr.pool import PoolMemoryResource
from dask_rmm.mr.registry import get_per_device_resource, registered_devices
from dask_rmm.sizes import format_bytes, parse_device_bytes

__all__ = ["TrimResult", "pools_in", "trim_pools", "trim_resource"]


@dataclass(frozen=True)
class TrimResult:
    """What trimming one pool did: the pool (class name ``resource``) of ``device`` gave
    ``released_bytes`` back upstream, holding ``reserved_before`` then ``reserved_after`` bytes
    with ``in_use_bytes`` handed out (live blocks, never touched); ``library_cache_bytes``: what
    library caches in front of the stack gave back to it first (:func:`dask_rmm.release_unused`).
    """

    device: int
    resource: str
    released_bytes: int
    reserved_before: int
    reserved_after: int
    in_use_bytes: int
    library_cache_bytes: int = 0

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    def __str__(self) -> str:
        return (
            f"device {self.device} {self.resource}: released {format_bytes(self.released_bytes)}, "
            f"reserved {format_bytes(self.reserved_before)} -> {format_bytes(self.reserved_after)}"
            f" ({format_bytes(self.in_use_bytes)} in use)"
        )


def pools_in(resource: Any) -> Iterator[Any]:
    """Every :class:`PoolMemoryResource` and :class:`CudaAsyncMemoryResource` in ``resource``'s
    chain, outermost first."""
    for mr in upstreams(resource):
        if isinstance(mr, (PoolMemoryResource, CudaAsyncMemoryResource)):
            yield mr


def _reserved(pool: Any) -> tuple[int, int]:
    """``(bytes held from upstream, bytes handed out)`` of a pool."""
    if isinstance(pool, CudaAsyncMemoryResource):
        return pool.reserved_bytes(), pool.used_bytes()
    info = pool.reserved_memory_info()
    if info is None:
        return 0, 0
    return int(info.reserved_bytes), int(info.reserved_bytes - info.free_bytes)


def trim_resource(
    resource: Any, size: int | str | float | None = None, *, device: int = 0
) -> list[TrimResult]:
    """Trim every pool in ``resource``'s chain to ``size`` and say what each gave back (default:
    a :class:`PoolMemoryResource`'s initial size, a :class:`CudaAsyncMemoryResource`'s release
    threshold, with ``cudaMemPoolTrimTo``). Live blocks are never touched."""
    results = []
    for pool in pools_in(resource):
        before, _ = _reserved(pool)
        if isinstance(pool, CudaAsyncMemoryResource):
            keep = (
                pool.release_threshold
                if size is None
                else parse_device_bytes(size, pool, option="size") or 0
            )
            # Memory freed on a stream is still the pool's until the stream gets there.
            _cuda.device_synchronize()
            pool.trim_to(keep)
        else:
            pool.trim(size)
        after, in_use = _reserved(pool)
        results.append(
            TrimResult(device, type(pool).__name__, max(before - after, 0), before, after, in_use)
        )
    return results


def trim_pools(
    size: int | str | float | None = None, devices: Iterable[int] | None = None
) -> dict[int, list[TrimResult]]:
    """:func:`trim_resource` on the resource of each of ``devices`` (default: every device with
    a resource); returns ``{device: [TrimResult]}``.

    Examples
    --------
    >>> import dask_rmm
    >>> dask_rmm.reinitialize(pool_allocator=True, initial_pool_size="1MiB", base_resource="system")
    >>> buf = dask_rmm.DeviceBuffer(size=8 << 20)  # the pool grows
    >>> del buf
    >>> [r.released_bytes for r in dask_rmm.mr.trim_pools()[0]]
    [8388608]
    """
    wanted = registered_devices() if devices is None else list(devices)
    return {d: trim_resource(get_per_device_resource(d), size, device=d) for d in wanted}
