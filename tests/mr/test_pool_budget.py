"""PoolMemoryResource.share_budget: a library cache taking memory beside the pool (PyTorch's, on
a GPU) shares the pool's maximum. Here the sharer is a made-up library on host memory that keeps
to the room it is given, and both draw from one counted "device", so the tests can check that
the two together never pass the maximum, with threads racing on both sides."""

from __future__ import annotations

import random
import threading

import pytest

from dask_rmm.mr import OutOfMemoryError, PoolMemoryResource, SystemMemoryResource
from dask_rmm.mr.callback import CallbackMemoryResource

MiB = 1 << 20


class CountedDevice:
    """Bytes taken from the "device" by the pool (through its upstream) and by the sharer, and
    the most ever taken at once."""

    def __init__(self):
        self.lock = threading.Lock()
        self.used = 0
        self.peak = 0

    def take(self, n: int) -> None:
        with self.lock:
            self.used += n
            self.peak = max(self.peak, self.used)

    def give(self, n: int) -> None:
        with self.lock:
            self.used -= n

    def upstream(self):
        base = SystemMemoryResource()

        def allocate(nbytes, stream):
            ptr = base.allocate(nbytes, stream)
            self.take(nbytes)
            return ptr

        def deallocate(ptr, nbytes, stream):
            base.deallocate(ptr, nbytes, stream)
            self.give(nbytes)

        return CallbackMemoryResource(allocate, deallocate)


class FakeSharer:
    """A library cache beside the pool: reserves whole segments within its room (as PyTorch's
    cap: checked and taken under its own lock), keeps freed segments until released."""

    name = "fakelib"

    def __init__(self, device: CountedDevice):
        self.device = device
        self.lock = threading.Lock()
        self.room: int | None = None
        self.in_use = 0
        self.free = 0
        self.rooms: list[int | None] = []
        self.releases = 0

    # the library's side
    def malloc(self, n: int) -> None:
        with self.lock:
            if self.free >= n:
                self.free -= n
                self.in_use += n
                return
            if self.room is not None and self.in_use + self.free + n > self.room:
                self.device.give(self.free)  # as PyTorch: free the cache, try once more
                self.free = 0
                if self.in_use + n > self.room:
                    raise MemoryError(f"fakelib: {n} bytes over its room {self.room}")
            self.device.take(n)
            self.in_use += n

    def free_bytes(self, n: int) -> None:
        with self.lock:
            self.in_use -= n
            self.free += n

    # the BudgetSharer side
    def reserved_bytes(self) -> int:
        with self.lock:
            return self.in_use + self.free

    def set_room(self, nbytes):
        with self.lock:
            self.room = nbytes
            self.rooms.append(nbytes)

    def release(self) -> int:
        with self.lock:
            n, self.free = self.free, 0
            self.device.give(n)
            self.releases += 1
            return n


@pytest.fixture
def device():
    return CountedDevice()


def test_the_sharer_gets_the_room_the_pool_leaves_and_it_follows_growth_and_trim(device):
    pool = PoolMemoryResource(
        device.upstream(), initial_pool_size=4 * MiB, maximum_pool_size=64 * MiB
    )
    lib = FakeSharer(device)
    pool.share_budget(lib)
    assert lib.room == 60 * MiB
    assert pool.budget_sharers() == (lib,)
    ptr = pool.allocate(8 * MiB)  # grows: the room shrinks by the growth
    assert pool.pool_size() > 4 * MiB
    assert lib.room == 64 * MiB - pool.pool_size()
    pool.deallocate(ptr, 8 * MiB)
    assert pool.trim() > 0  # back to 4 MiB: the room grows back
    assert pool.pool_size() == 4 * MiB and lib.room == 60 * MiB
    pool.stop_sharing(lib)
    assert pool.budget_sharers() == ()


def test_growth_counts_what_the_sharer_holds_and_names_it_when_there_is_no_room(device):
    pool = PoolMemoryResource(
        device.upstream(), initial_pool_size=4 * MiB, maximum_pool_size=64 * MiB
    )
    lib = FakeSharer(device)
    pool.share_budget(lib)
    lib.malloc(50 * MiB)  # in use: cannot be given back
    with pytest.raises(OutOfMemoryError, match="fakelib beside the pool holds 50.00 MiB") as info:
        pool.allocate(20 * MiB)
    assert info.value.requested == 20 * MiB
    # nothing changed: no growth, nothing set aside, the room as it was
    assert pool.pool_size() == 4 * MiB and pool._growing == 0
    assert lib.room == 60 * MiB
    assert device.used == 54 * MiB
    ptr = pool.allocate(8 * MiB)  # what fits still does
    assert pool.pool_size() + lib.reserved_bytes() <= 64 * MiB
    pool.deallocate(ptr, 8 * MiB)


def test_growth_makes_the_sharer_give_its_free_bytes_back_first(device):
    pool = PoolMemoryResource(
        device.upstream(), initial_pool_size=4 * MiB, maximum_pool_size=64 * MiB
    )
    lib = FakeSharer(device)
    pool.share_budget(lib)
    lib.malloc(50 * MiB)
    lib.free_bytes(40 * MiB)  # held free in its cache
    ptr = pool.allocate(30 * MiB)
    assert lib.releases >= 1 and lib.reserved_bytes() == 10 * MiB
    assert pool.pool_size() + lib.reserved_bytes() <= 64 * MiB
    assert lib.room == 64 * MiB - pool.pool_size()
    with pytest.raises(MemoryError, match="over its room"):  # and now the sharer is capped
        lib.malloc(64 * MiB - pool.pool_size())
    pool.deallocate(ptr, 30 * MiB)


def test_give_room_trims_free_chunks_for_the_sharer(device):
    pool = PoolMemoryResource(
        device.upstream(), initial_pool_size=4 * MiB, maximum_pool_size=64 * MiB
    )
    lib = FakeSharer(device)
    pool.share_budget(lib)
    ptr = pool.allocate(32 * MiB)
    pool.deallocate(ptr, 32 * MiB)
    before = lib.room
    assert pool.give_room(16 * MiB) >= 16 * MiB
    assert lib.room >= before + 16 * MiB
    assert lib.room == 64 * MiB - pool.pool_size()


def test_without_a_maximum_the_sharer_has_no_limit(device):
    pool = PoolMemoryResource(device.upstream(), initial_pool_size=4 * MiB)
    lib = FakeSharer(device)
    pool.share_budget(lib)
    assert lib.room is None
    lib.malloc(100 * MiB)
    ptr = pool.allocate(8 * MiB)  # nothing counted, nothing refused
    pool.deallocate(ptr, 8 * MiB)


def test_two_sharers_each_get_the_room_less_what_the_other_holds(device):
    pool = PoolMemoryResource(
        device.upstream(), initial_pool_size=4 * MiB, maximum_pool_size=64 * MiB
    )
    a, b = FakeSharer(device), FakeSharer(device)
    b.name = "otherlib"
    pool.share_budget(a)
    pool.share_budget(b)
    a.malloc(10 * MiB)
    ptr = pool.allocate(8 * MiB)
    room = 64 * MiB - pool.pool_size()
    assert a.room == room and b.room == room - 10 * MiB
    pool.deallocate(ptr, 8 * MiB)


def test_threads_on_both_sides_never_pass_the_maximum_together(device):
    maximum = 96 * MiB
    pool = PoolMemoryResource(
        device.upstream(), initial_pool_size=2 * MiB, maximum_pool_size=maximum
    )
    lib = FakeSharer(device)
    pool.share_budget(lib)
    errors: list[BaseException] = []
    stop = threading.Event()

    def pool_side(seed):
        rng = random.Random(seed)
        live = []
        try:
            for _ in range(300):
                if live and rng.random() < 0.45:
                    ptr, n = live.pop(rng.randrange(len(live)))
                    pool.deallocate(ptr, n)
                else:
                    n = rng.choice([1, 3, 6, 12]) * MiB
                    try:
                        live.append((pool.allocate(n), n))
                    except OutOfMemoryError:
                        pass
                if rng.random() < 0.05:
                    pool.trim()
        except BaseException as e:
            errors.append(e)
        finally:
            for ptr, n in live:
                pool.deallocate(ptr, n)

    def library_side(seed):
        rng = random.Random(seed)
        held = []
        try:
            while not stop.is_set():
                if held and rng.random() < 0.45:
                    lib.free_bytes(held.pop())
                else:
                    n = rng.choice([2, 4, 8]) * MiB
                    try:
                        lib.malloc(n)
                        held.append(n)
                    except MemoryError:
                        pass
                if rng.random() < 0.05:
                    lib.release()
        except BaseException as e:
            errors.append(e)
        finally:
            for n in held:
                lib.free_bytes(n)

    pools = [threading.Thread(target=pool_side, args=(i,)) for i in range(3)]
    libs = [threading.Thread(target=library_side, args=(100 + i,)) for i in range(3)]
    for t in pools + libs:
        t.start()
    for t in pools:
        t.join(60)
    stop.set()
    for t in libs:
        t.join(60)
    assert not any(t.is_alive() for t in pools + libs)
    assert errors == []
    assert 0 < device.peak <= maximum
    assert lib.room == maximum - pool.pool_size()


def test_a_pool_sharing_its_maximum_grows_by_its_size_not_by_half_the_room(device):
    alone = PoolMemoryResource(
        device.upstream(), initial_pool_size=4 * MiB, maximum_pool_size=64 * MiB
    )
    shared = PoolMemoryResource(
        device.upstream(), initial_pool_size=4 * MiB, maximum_pool_size=64 * MiB
    )
    shared.share_budget(FakeSharer(device))
    a, b = alone.allocate(5 * MiB), shared.allocate(5 * MiB)
    assert alone.pool_size() == 4 * MiB + 30 * MiB  # half the room, as RMM's pool
    assert shared.pool_size() == 4 * MiB + 5 * MiB  # the request (more than the pool's size)
    c = shared.allocate(6 * MiB)  # more than the 4 MiB free
    assert shared.pool_size() == 9 * MiB + 9 * MiB  # by its own size
    alone.deallocate(a, 5 * MiB)
    shared.deallocate(b, 5 * MiB)
    shared.deallocate(c, 6 * MiB)


def test_a_request_past_the_maximum_says_what_the_sharer_holds(device):
    pool = PoolMemoryResource(
        device.upstream(), initial_pool_size=4 * MiB, maximum_pool_size=64 * MiB
    )
    lib = FakeSharer(device)
    pool.share_budget(lib)
    lib.malloc(8 * MiB)
    with pytest.raises(OutOfMemoryError, match="leaves no room; fakelib beside the pool hold"):
        pool.allocate(80 * MiB)
