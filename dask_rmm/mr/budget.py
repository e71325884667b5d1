"""One maximum for a pool and the library caches that take device memory beside it.

A library whose own caching allocator gets its memory straight from the device (PyTorch's)
cannot draw its blocks from a pool without Python under that library's lock. It shares the
pool's maximum instead: a :class:`BudgetSharer` is told the room the pool leaves it (the maximum
less what the pool holds) and keeps its reserved bytes within it; the pool, before it grows,
lowers that room first and then counts the sharer's reserved bytes, so that neither side can go
past the maximum. Both reads and the room change happen on the pool's slow path only (growth,
trim), never per allocation. Not here: the PyTorch sharer (:mod:`dask_rmm.allocators.torch`).
"""

from __future__ import annotations

from typing import Protocol

__all__ = ["BudgetSharer"]


class BudgetSharer(Protocol):
    """A library cache taking device memory beside a pool, within the room the pool leaves."""

    #: The library, named in the pool's out-of-memory error (``"torch"``).
    name: str

    def reserved_bytes(self) -> int:
        """Device bytes the library holds now (in its objects and free in its cache)."""
        ...

    def set_room(self, nbytes: int | None) -> None:
        """Keep the library's reserved bytes at most ``nbytes`` from now on (None: no limit)."""
        ...

    def release(self) -> int:
        """Give the library's free cached bytes back to the device; the bytes given back."""
        ...
