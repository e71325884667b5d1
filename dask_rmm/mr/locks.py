"""The locks of the resources: :class:`ListLock` (the pool's), taking a contended lock without a
convoy, and holding a lock with the garbage collector paused. Not here: what the locks guard.
"""

from __future__ import annotations

import _thread
import gc
import time

__all__ = ["ListLock", "Mutex", "acquire_contended", "gc_paused_lock"]


class ListLock:
    """A mutex made of one atomic list operation: ``pop`` takes it, ``append`` gives it back.

    The pool's lock. It behaves as ``threading.Lock`` (``acquire(blocking)``, ``release``,
    ``with``), but its hot-path use costs two argument-free list calls on :attr:`unlocked`
    (``unlocked.pop()`` to take, ``unlocked.append(True)`` to release), about a third of
    ``Lock.acquire(False)`` + ``release`` in CPython, whose argument parsing dominates. A waiter
    yields the GIL (``time.sleep(0)``) and retries: the pool holds it for bookkeeping only, so a
    waiter never waits long, and no lock convoy forms (see :func:`acquire_contended`).

    Attributes
    ----------
    unlocked : list
        ``[True]`` while the lock is free, ``[]`` while it is held.
    """

    __slots__ = ("unlocked",)

    def __init__(self) -> None:
        self.unlocked: list[bool] = [True]

    def acquire(self, blocking: bool = True, timeout: float = -1) -> bool:
        unlocked = self.unlocked
        try:
            unlocked.pop()
            return True
        except IndexError:
            if not blocking:
                return False
        deadline = None if timeout is None or timeout < 0 else time.monotonic() + timeout
        while True:
            time.sleep(0)
            try:
                unlocked.pop()
                return True
            except IndexError:
                if deadline is not None and time.monotonic() >= deadline:
                    return False

    def release(self) -> None:
        if self.unlocked:
            raise RuntimeError("release unlocked lock")
        self.unlocked.append(True)

    def locked(self) -> bool:
        return not self.unlocked

    def __enter__(self) -> bool:
        return self.acquire()

    def __exit__(self, *exc: object) -> None:
        self.release()


#: What the helpers here take: a ``threading.Lock`` or a :class:`ListLock`.
Mutex = _thread.LockType | ListLock


def acquire_contended(lock: Mutex) -> None:
    """Take a lock that another thread holds, without sleeping on it.

    Hot paths call ``if not lock.acquire(False): acquire_contended(lock)``. A blocking
    ``acquire`` parks the thread on a futex; with the GIL in play the holder then often waits
    for the GIL behind other parked threads (a lock convoy: 8 threads on one pool ran 3-5x
    slower than one). Yielding the GIL with ``sleep(0)`` and retrying lets the holder finish
    its few hundred nanoseconds of bookkeeping first.
    """
    while not lock.acquire(False):
        time.sleep(0)


class gc_paused_lock:
    """``with gc_paused_lock(lock):`` holds ``lock`` with the garbage collector paused.

    For the slow paths that make objects while holding a resource's lock: making an object may
    run the collector, whose finalizers (a DeviceBuffer's, a CuPy array's) may free into the same
    resource on the same thread and then wait forever on the lock it holds. The collector is
    paused before the lock is taken (making this object may run it: harmless then). Code that is
    already under the lock pauses it in place (``gc.isenabled()``/``gc.disable()``).
    """

    __slots__ = ("lock", "paused")

    def __init__(self, lock: Mutex) -> None:
        self.lock = lock

    def __enter__(self) -> gc_paused_lock:
        self.paused = gc.isenabled()
        if self.paused:
            gc.disable()
        try:
            if not self.lock.acquire(False):
                acquire_contended(self.lock)
        except BaseException:
            if self.paused:
                gc.enable()
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        self.lock.release()
        if self.paused:
            gc.enable()
