"""The locks of the resources: :class:`ListLock` (the pool's), taking a contended lock without a
convoy, and holding a lock with the garbage collector paused. Not here: what the locks guard.
"""

from __future__ import annotations

import _thread
import gc
import time

__all__ = ["ListLock", "Mutex", "acquire_contended", "gc_paused_lock"]


class ListLock:
    """The pool's mutex as ``threading.Lock`` (``acquire(blocking)``, ``release``, ``with``),
    one atomic list operation: ``unlocked`` is ``[True]`` while free, ``pop()`` takes it and
    ``append(True)`` gives it back, a third of ``Lock.acquire(False)`` + ``release`` on the hot
    paths. A waiter yields the GIL and retries (:func:`acquire_contended`)."""

    __slots__ = ("unlocked",)

    def __init__(self) -> None:
        self.unlocked: list[bool] = [True]

    def acquire(self, blocking: bool = True) -> bool:
        try:
            self.unlocked.pop()
        except IndexError:
            if not blocking:
                return False
            acquire_contended(self)
        return True

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
    """Take a lock that another thread holds, yielding the GIL (``sleep(0)``) between tries: a
    blocking ``acquire`` parks the thread, and the holder then often waits for the GIL behind
    parked threads (a lock convoy: 8 threads on one pool ran 3-5x slower than one)."""
    while not lock.acquire(False):
        time.sleep(0)


class gc_paused_lock:
    """``with gc_paused_lock(lock):`` holds ``lock`` with the garbage collector paused, for paths
    that make objects under a resource's lock: a finalizer (a DeviceBuffer's, a CuPy array's)
    freeing into the same resource on the same thread would wait forever on the lock (code
    already under the lock pauses it in place)."""

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
