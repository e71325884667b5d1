"""Stream order between stream-ordered suballocators' free lists (events between streams; a device
sync before memory goes upstream). Call only with CUDA available and outside any resource lock."""

from __future__ import annotations

from collections.abc import Hashable, Iterable
from typing import Any, Final

from dask_rmm import _cuda
from dask_rmm.stream import Stream, own_per_thread_key

__all__ = ["FRESH_KEY", "order_after", "stream_ordered", "synchronize_streams"]

#: The order key of memory no stream has used yet (fresh from upstream): taken without a wait.
FRESH_KEY: Final = "fresh"


def stream_ordered(upstream: Any) -> bool:
    """Whether a suballocator over ``upstream`` orders its frees between streams: only device
    memory with CUDA (a host-memory replay or test may use made-up stream handles)."""
    return _cuda.is_available() and not upstream.is_host_memory


def order_after(victims: Iterable[tuple[Hashable, Stream | None]], stream: Stream) -> None:
    """Make ``stream`` wait for the work queued so far on each victim stream: ``(order key,
    Stream)`` pairs of the streams whose freed blocks it takes over. Another thread's per-thread
    default stream, or an invalid handle, is covered by a device synchronization instead."""
    mine = own_per_thread_key()  # None: every per-thread key is another thread's
    for key, victim in victims:
        if key == FRESH_KEY or victim is None or key == stream.order_key():
            continue
        if isinstance(key, tuple) and key != mine:
            _cuda.device_synchronize()
            continue
        try:
            _cuda.stream_wait_stream(stream.handle, victim.handle)
        except _cuda.CUDAError:
            _cuda.device_synchronize()


def synchronize_streams(victims: list[tuple[Hashable, Stream | None]]) -> None:
    """Wait for all work on every victim stream (as for :func:`order_after`) before their
    freed memory goes upstream."""
    if not victims:
        return
    if any(isinstance(key, tuple) for key, _ in victims):
        _cuda.device_synchronize()
        return
    for _key, victim in victims:
        if victim is not None:
            try:
                _cuda.stream_synchronize(victim.handle)
            except _cuda.CUDAError:
                _cuda.device_synchronize()
