"""FixedSizeMemoryResource: blocks of one size from chunks taken from upstream, free blocks kept
per stream as the pool's; the bins of BinningMemoryResource."""

from __future__ import annotations

import bisect
import threading
from collections import Counter
from collections.abc import Hashable
from typing import Any

from dask_rmm import _cuda
from dask_rmm.mr.base import (
    DeviceMemoryResource,
    OutOfMemoryError,
    ReservedMemoryInfo,
    UpstreamResourceAdaptor,
    check_nbytes,
    deallocate_refused,
)
from dask_rmm.mr.locks import gc_paused_lock
from dask_rmm.mr.size_classes import pop_all
from dask_rmm.mr.stream_order import FRESH_KEY, order_after, stream_ordered
from dask_rmm.sizes import align_up, format_bytes
from dask_rmm.stream import DEFAULT_STREAM, PER_THREAD_HANDLE, Stream, as_stream

__all__ = ["FixedSizeMemoryResource"]


class FixedSizeMemoryResource(UpstreamResourceAdaptor):
    """Blocks of ``block_size`` bytes, as RMM's ``FixedSizeMemoryResource``.

    Parameters
    ----------
    upstream_mr : DeviceMemoryResource
        Where the chunks come from.
    block_size : int
        Size of every block (rounded up to 256 bytes); larger requests raise ``ValueError``.
    blocks_to_preallocate : int
        Blocks per upstream chunk, taken at construction and whenever all blocks are in use.

    Examples
    --------
    >>> from dask_rmm.mr import FixedSizeMemoryResource, SystemMemoryResource
    >>> mr = FixedSizeMemoryResource(SystemMemoryResource(), block_size=4096, blocks_to_preallocate=8)
    >>> ptr = mr.allocate(1000)
    >>> mr.deallocate(ptr, 1000)
    """

    def __init__(
        self,
        upstream_mr: DeviceMemoryResource,
        block_size: int = 1 << 20,
        blocks_to_preallocate: int = 128,
    ):
        super().__init__(upstream_mr)
        block_size = check_nbytes(block_size, "block_size")
        blocks_to_preallocate = check_nbytes(blocks_to_preallocate, "blocks_to_preallocate")
        if block_size == 0 or blocks_to_preallocate == 0:
            raise ValueError("block_size and blocks_to_preallocate must be positive")
        self._ordered = stream_ordered(upstream_mr)
        self._block_size = align_up(block_size)
        self._per_chunk = blocks_to_preallocate
        self._lock = threading.Lock()
        self._free: dict[Any, list[int]] = {}  # order key -> free block pointers
        self._streams: dict[Any, Stream] = {}  # order key -> stream (kept for events)
        self._live: dict[int, int] = {}  # ptr -> nbytes
        self._chunks: dict[int, int] = {}  # chunk start -> size
        self._add_chunk(DEFAULT_STREAM, fresh=True)

    @property
    def block_size(self) -> int:
        """The size of every block."""
        return self._block_size

    def get_block_size(self) -> int:
        return self._block_size

    def allocate(self, nbytes: int, stream: Stream = DEFAULT_STREAM) -> int:
        if type(nbytes) is not int or nbytes <= 0:
            nbytes = check_nbytes(nbytes)
            if nbytes == 0:
                return 0
        if nbytes > self._block_size:
            raise ValueError(
                f"FixedSizeMemoryResource.allocate({nbytes}): larger than the block size "
                f"{self._block_size}"
            )
        try:
            key: Hashable = stream.handle
        except AttributeError:
            stream = as_stream(stream)
            key = stream.handle
        if key == PER_THREAD_HANDLE:
            key = stream.order_key()
        # Lock-free: list.pop and the dict store are atomic, so each block goes to one caller.
        blocks = self._free.get(key)
        if blocks:
            try:
                ptr = blocks.pop()
            except IndexError:  # another thread took the last one
                pass
            else:
                self._live[ptr] = nbytes
                return ptr
        return self._allocate_slow(nbytes, key, stream)

    def deallocate(self, ptr: int, nbytes: int, stream: Stream = DEFAULT_STREAM) -> None:
        try:
            key: Hashable = stream.handle
        except AttributeError:
            stream = as_stream(stream)
            key = stream.handle
        if key == PER_THREAD_HANDLE:
            key = stream.order_key()
        # Lock-free: of two threads freeing one pointer only one pops it from the live table.
        live = self._live
        n = live.pop(ptr, None)
        if n == nbytes and type(ptr) is int:
            blocks = self._free.get(key)
            if blocks is None:
                with gc_paused_lock(self._lock):  # a stream's first free: one list made
                    blocks = self._free.get(key)
                    if blocks is None:
                        blocks = self._free[key] = []
                        self._streams[key] = stream
            blocks.append(ptr)
            return
        if n is not None:
            live[ptr] = n
        return deallocate_refused(self, "FixedSizeMemoryResource", ptr, nbytes, n, stream)

    def reserved_memory_info(self) -> ReservedMemoryInfo:
        with self._lock:
            reserved = sum(self._chunks.values())
            nfree = sum(len(b) for b in self._free.values())
            return ReservedMemoryInfo(
                reserved, nfree * self._block_size, self._block_size if nfree else 0
            )

    def release(self) -> int:
        """Give chunks whose blocks are all free back to upstream; return the bytes released."""
        with self._lock:
            starts = sorted(self._chunks)

            def chunk(p: int) -> int:
                return starts[bisect.bisect_right(starts, p) - 1]

            # Taken out first (lock-free callers may pop or append meanwhile), those of the
            # chunks that stay put back.
            taken = {key: list(pop_all(blocks)) for key, blocks in self._free.items()}
            free = Counter(chunk(p) for ps in taken.values() for p in ps)
            gone = {c for c in starts if free[c] == self._per_chunk}
            keys = set()
            for key, ps in taken.items():
                kept = [p for p in ps if chunk(p) not in gone]
                if len(kept) != len(ps):
                    keys.add(key)
                self._free[key].extend(reversed(kept))
            sizes = [(c, self._chunks.pop(c)) for c in sorted(gone)]
        if self._ordered and keys:
            _cuda.device_synchronize()
        for c, size in sizes:
            self.upstream_mr.deallocate(c, size, DEFAULT_STREAM)
        return sum(size for _, size in sizes)

    def __del__(self):
        try:
            chunks = list(self._chunks.items())
            self._chunks.clear()
            for start, size in chunks:
                self.upstream_mr.deallocate(start, size, DEFAULT_STREAM)
        except Exception:
            pass

    def _repr_fields(self) -> str:
        return f"block_size={format_bytes(self._block_size)}"

    # -- internals -------------------------------------------------------------------------

    def _add_chunk(self, stream: Stream, fresh: bool = False) -> None:
        size = self._block_size * self._per_chunk
        try:
            start = self.upstream_mr.allocate(size, stream)
        except MemoryError as e:
            raise OutOfMemoryError(
                f"FixedSizeMemoryResource out of memory: could not get another chunk of "
                f"{self._per_chunk} x {format_bytes(self._block_size)} from upstream ({e})",
                requested=size,
                resource="FixedSizeMemoryResource",
                stream=stream.handle,
                pool_size=sum(self._chunks.values()),
                free_bytes=0,
                largest_free_block=0,
            ) from e
        with self._lock:
            self._chunks[start] = size
            key = FRESH_KEY if fresh else stream.order_key()
            blocks = self._free.setdefault(key, [])
            if not fresh:
                self._streams[key] = stream
            # reversed so that pop() hands out addresses in increasing order
            blocks.extend(range(start + size - self._block_size, start - 1, -self._block_size))

    def _allocate_slow(self, nbytes: int, key: Any, stream: Stream) -> int:
        victim: tuple[Hashable, Stream | None] | None = None
        with self._lock:
            ptr = 0
            for k, blocks in self._free.items():
                if k != key and blocks:
                    try:
                        ptr = blocks.pop()
                    except IndexError:  # taken by a lock-free caller meanwhile
                        continue
                    victim = (k, self._streams.get(k))
                    self._live[ptr] = nbytes
                    break
        if ptr:
            if self._ordered and victim is not None:
                order_after([victim], stream)
            return ptr
        self._add_chunk(stream)
        return self.allocate(nbytes, stream)
