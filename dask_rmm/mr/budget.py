"""One maximum for a pool and the library caches that take device memory beside it (design:
docs/internals.md, One budget). Not here: the PyTorch sharer (:mod:`dask_rmm.allocators.torch`)."""

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
