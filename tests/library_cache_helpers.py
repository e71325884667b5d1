"""A library cache that runs without CUDA, for tests of the accounting around caches: it behaves
like CuPy's MemoryPool in front of the stack (exact-size blocks drawn from the device's current
resource, freed blocks kept per size, given back on ``release`` and when the stack is out of
memory) and keeps its own counts of what it drew, to compare with the stack's statistics."""

from __future__ import annotations

import contextlib
from collections import defaultdict

from dask_rmm.mr.registry import get_per_device_resource
from dask_rmm.sizes import align_up


class HostLibraryCache:
    """``malloc``/``free`` of arrays served from cached blocks drawn from device ``device``'s
    resource (host memory on CI)."""

    name = "fakelib"

    def __init__(self, device: int = 0):
        self.device = device
        self.free_blocks: dict[int, list[int]] = defaultdict(list)
        self.in_use: dict[int, int] = {}  # ptr -> block size
        self.block_sizes: dict[int, int] = {}  # every block drawn and not given back
        self.block_resources: dict[int, object] = {}  # ... and the resource it came from
        # independent per-draw counts: what the stack's statistics must equal
        self.draws = 0
        self.drawn_bytes = 0
        self.peak_drawn_bytes = 0
        self.releases = 0

    # -- the library's side ---------------------------------------------------------------------

    def malloc(self, nbytes: int) -> int:
        size = align_up(max(nbytes, 1))
        blocks = self.free_blocks.get(size)
        if blocks:
            ptr = blocks.pop()
        else:
            mr = get_per_device_resource(self.device)
            try:
                ptr = mr.allocate(size)
            except MemoryError:  # as CuPy's pool: give the cache back and retry once
                self.release(self.device)
                ptr = mr.allocate(size)
            self.block_sizes[ptr] = size
            self.block_resources[ptr] = mr  # a block goes back where it came from, as CuPy's
            self.draws += 1
            self.drawn_bytes += size
            self.peak_drawn_bytes = max(self.peak_drawn_bytes, self.live_drawn_bytes())
        self.in_use[ptr] = size
        return ptr

    def free(self, ptr: int) -> None:
        size = self.in_use.pop(ptr)
        self.free_blocks[size].append(ptr)

    def live_drawn_bytes(self) -> int:
        return sum(self.block_sizes.values())

    def array_bytes(self) -> int:
        return sum(self.in_use.values())

    def in_use_bytes(self, device: int) -> int:
        return self.array_bytes() if device == self.device else 0

    # -- the LibraryCache protocol -------------------------------------------------------------

    def cached_bytes(self, device: int) -> int:
        if device != self.device:
            return 0
        return sum(size * len(ptrs) for size, ptrs in self.free_blocks.items())

    def release(self, device: int) -> int:
        if device != self.device:
            return 0
        released = 0
        for size, ptrs in self.free_blocks.items():
            while ptrs:
                ptr = ptrs.pop()
                self.block_resources.pop(ptr).deallocate(ptr, size)
                del self.block_sizes[ptr]
                released += size
        self.releases += 1 if released else 0
        return released


class HostOutsideCache:
    """A library cache *beside* the stack, as PyTorch's caching allocator is on a GPU: it takes
    host memory from its own resource (the stack never sees it), keeps freed blocks, and keeps
    its reserved bytes within the room a pool's budget leaves it (``budget(device)``)."""

    name = "outsidelib"
    outside_stack = True

    def __init__(self, device: int = 0):
        from dask_rmm.mr import SystemMemoryResource

        self.device = device
        self.source = SystemMemoryResource()
        self.in_use: dict[int, int] = {}
        self.free_blocks: list[tuple[int, int]] = []
        self.room: int | None = None
        self.releases = 0

    def malloc(self, nbytes: int) -> int:
        size = align_up(max(nbytes, 1))
        for i, (ptr, bsize) in enumerate(self.free_blocks):
            if bsize == size:
                del self.free_blocks[i]
                self.in_use[ptr] = size
                return ptr
        if self.room is not None and self.reserved_bytes(self.device) + size > self.room:
            self.release(self.device)
            if self.reserved_bytes(self.device) + size > self.room:
                raise MemoryError(f"outsidelib: {size} bytes do not fit in its room {self.room}")
        ptr = self.source.allocate(size)
        self.in_use[ptr] = size
        return ptr

    def free(self, ptr: int) -> None:
        self.free_blocks.append((ptr, self.in_use.pop(ptr)))

    # -- the LibraryCache protocol, for a cache outside the stack -------------------------------

    def in_use_bytes(self, device: int) -> int:
        return sum(self.in_use.values()) if device == self.device else 0

    def cached_bytes(self, device: int) -> int:
        return sum(s for _, s in self.free_blocks) if device == self.device else 0

    def reserved_bytes(self, device: int) -> int:
        return self.in_use_bytes(device) + self.cached_bytes(device)

    def release(self, device: int) -> int:
        if device != self.device:
            return 0
        released = 0
        while self.free_blocks:
            ptr, size = self.free_blocks.pop()
            self.source.deallocate(ptr, size)
            released += size
        self.releases += 1 if released else 0
        return released

    def budget(self, device: int):
        cache = self

        class Budget:
            name = cache.name

            def reserved_bytes(self) -> int:
                return cache.reserved_bytes(device)

            def set_room(self, nbytes):
                cache.room = nbytes

            def release(self) -> int:
                return cache.release(device)

        return Budget()


@contextlib.contextmanager
def cached_array_type(cache):
    """A spillable array type whose arrays live in ``cache``'s blocks (as CuPy's arrays live in
    its MemoryPool), registered with the pressure layer for the block; yields the class."""
    from dask_rmm.pressure import device_objects

    class CachedArray:
        def __init__(self, nbytes):
            self.nbytes = nbytes
            self.ptr = cache.malloc(nbytes)

        def __del__(self):
            cache.free(self.ptr)

    device_objects.register_device_type(
        CachedArray,
        lambda a: [device_objects.DeviceAllocation(0, a.ptr, a.nbytes)],
        lambda a: device_objects.HostCopy("CachedArray", 0, None, None, a.nbytes),
        "CachedArray",
        lambda copy: CachedArray(copy.nbytes),
    )
    try:
        yield CachedArray
    finally:
        device_objects._TYPES.pop(CachedArray, None)
        device_objects._REBUILD.pop("CachedArray", None)
