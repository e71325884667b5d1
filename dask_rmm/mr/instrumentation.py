"""The pool's instrumentation interface: :class:`AllocationCounters` (what a statistics adaptor
reads) and :class:`OwnerAccounts` (how an attribution adaptor charges owners). Not here: the pool
that updates them (pool.py), the adaptors that read them."""

from __future__ import annotations

import gc
import struct
from collections.abc import Callable, Hashable
from typing import Any

__all__ = ["JOURNAL_LIMIT", "AllocationCounters", "OwnerAccounts"]


class AllocationCounters:
    """Allocation counters a pool (or a statistics adaptor on its own) keeps for an observer,
    journaled (docs/internals.md, Statistics): readers hold the instrumentation lock and call
    :meth:`settle` first. Sizes are as asked: ``total_*`` and ``freed_*`` count allocations and
    their frees in bytes and number (current = total - freed), ``peak_*`` the largest current
    values (an observer may lower them), ``interval_peak`` too (reset by an observer to sample
    spikes), ``failed`` the allocations that raised ``MemoryError``; ``journal``: ``+nbytes``
    per allocation, ``-nbytes`` per free, not yet folded in (never 0).
    """

    __slots__ = (
        "total_bytes", "total_count", "freed_bytes", "freed_count", "peak_bytes", "peak_count",
        "interval_peak", "failed", "journal",
    )  # fmt: skip

    def __init__(self) -> None:
        self.total_bytes = self.total_count = self.freed_bytes = self.freed_count = 0
        self.peak_bytes = self.peak_count = self.interval_peak = self.failed = 0
        self.journal: list[int] = []

    def settle(self) -> None:
        """Fold :attr:`journal` into the numbers (hold the instrumentation lock); entries
        appended meanwhile stay for the next call. Peaks follow the journal's order."""
        journal = self.journal
        n = len(journal)
        if not n:
            return
        # The lists made below may run the collector under the pool's lock (gc_paused_lock).
        paused = gc.isenabled()
        if paused:
            gc.disable()
        try:
            entries = journal[:n]
            del journal[:n]  # appends made since the copy are past n: they stay
            current = self.total_bytes - self.freed_bytes
            count = self.total_count - self.freed_count
            if n < _SETTLE_IN_NUMPY:
                peak_bytes, peak_count = current, count
                allocated_bytes = allocated = 0
                for e in entries:
                    current += e
                    if e > 0:
                        allocated_bytes += e
                        allocated += 1
                        count += 1
                        if current > peak_bytes:
                            peak_bytes = current
                        if count > peak_count:
                            peak_count = count
                    else:
                        count -= 1
                net = current - (self.total_bytes - self.freed_bytes)  # the loop's running sum
            else:
                import numpy as np

                # struct packs a list of ints faster than np.array() converts one (bench/README.md).
                sizes = np.frombuffer(struct.pack(f"{n}q", *entries), dtype=np.int64)
                running = sizes.cumsum()
                net = int(running[-1])
                peak_bytes = current + max(int(running.max()), 0)
                # No entry is 0: +1 per allocation, -1 per free.
                steps = np.sign(sizes).cumsum()
                peak_count = count + max(int(steps.max()), 0)
                allocated = (n + int(steps[-1])) >> 1  # allocations + frees = n
                allocated_bytes = (int(np.abs(sizes).sum()) + net) >> 1
            if peak_bytes > self.peak_bytes:
                self.peak_bytes = peak_bytes
            if peak_bytes > self.interval_peak:
                self.interval_peak = peak_bytes
            if peak_count > self.peak_count:
                self.peak_count = peak_count
            self.total_bytes += allocated_bytes
            self.freed_bytes += allocated_bytes - net
            self.total_count += allocated
            self.freed_count += n - allocated

        finally:
            if paused:
                gc.enable()


#: Journal entries at which an allocation settles the counters itself (bounds the journal's
#: memory and each settle's pause; its length in bench/README.md, "Design measurements").
JOURNAL_LIMIT = 4096
_SETTLE_IN_NUMPY = 160  # journals at least this long are folded with NumPy (faster from ~200)


class OwnerAccounts:
    """How a pool charges each allocation to an owner
    (:meth:`~dask_rmm.mr.pool.PoolMemoryResource.charge_owners`): ``get_owner() -> owner key``
    (any object, None too) runs on the allocating thread before the pool's lock is taken;
    ``accounts`` maps owner keys to *accounts*, lists ``[current_bytes, peak_bytes]`` the pool
    updates under its lock (a free, on any thread, from its allocation's); ``open_account(key)
    -> account`` serves a key missing there (or unhashable), under the lock with the collector
    paused: it may add the account to ``accounts`` and must not call into the pool.
    """

    __slots__ = ("get_owner", "accounts", "open_account")

    def __init__(
        self,
        get_owner: Callable[[], Any],
        accounts: dict[Hashable, list[int]],
        open_account: Callable[[Any], list[int]],
    ) -> None:
        self.get_owner = get_owner
        self.accounts = accounts
        self.open_account = open_account
