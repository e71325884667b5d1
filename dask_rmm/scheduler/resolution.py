"""A device's memory timeline in a fixed number of points: the newest samples at full
resolution, older ones merged ``factor`` at a time, the oldest merged pairwise so that the
timeline always reaches back to the first sample; a merged point keeps the largest
``max_bytes_in_interval`` it covers, so no peak is ever lost. Not here: which devices are kept
(``timeline.py``), the cluster's summed timeline (``cluster_total.py``).
"""

from __future__ import annotations

import struct
from collections.abc import Sequence

import numpy as np

from dask_rmm.wire import SAMPLE_STRUCT, pack_samples

__all__ = ["SAMPLE_DTYPE", "Timeline", "compact_all", "downsample", "merge_points"]

#: One point as numpy reads a packed sample (:data:`dask_rmm.wire.SAMPLE_STRUCT`).
SAMPLE_DTYPE = np.dtype([("t", "<f8"), ("c", "<i8"), ("m", "<i8")])
_RECORD = SAMPLE_STRUCT.size
_TIME = struct.Struct("<d")
assert SAMPLE_DTYPE.itemsize == _RECORD


def merge_points(blob: bytes, count: int, factor: int) -> bytes:
    """The first ``count`` packed points of ``blob`` (a multiple of ``factor``) merged
    ``factor`` at a time: the first point's time, the last one's current bytes and the largest
    ``max_bytes_in_interval``."""
    a = np.frombuffer(blob, SAMPLE_DTYPE, count=count).reshape(-1, factor)
    out = np.empty(count // factor, SAMPLE_DTYPE)
    out["t"] = a["t"][:, 0]
    out["c"] = a["c"][:, -1]
    out["m"] = a["m"].max(axis=1)
    return out.tobytes()


class Timeline:
    """At most ``capacity`` points ``(time, current_bytes, max_bytes_in_interval)`` of one
    device, in ``levels`` levels: half of them for the newest samples as they came (level 0),
    the rest shared by the coarser levels.

    A full level passes its oldest points to the next, ``factor`` merged into one; the last
    level, when full, merges its points pairwise, so it always starts at the first sample ever
    added. Points are packed bytes (24 a point, :data:`dask_rmm.wire.SAMPLE_STRUCT`), replaced
    rather than changed in place, so :meth:`parts` taken on the event loop can be read in
    another thread; the newest come as chunks (:meth:`push`), joined when read or merged.

    Parameters
    ----------
    capacity : int
        Points kept at most (memory: 24 bytes a point).
    levels : int
        Resolutions kept (fewer when ``capacity`` is too small for them).
    factor : int
        Points of one level merged into one point of the next.
    """

    __slots__ = ("capacity", "factor", "levels", "newest", "_limits", "_batches", "_new")

    def __init__(self, capacity: int, levels: int = 3, factor: int = 8):
        bounds = {"capacity": (capacity, 2), "levels": (levels, 1), "factor": (factor, 2)}
        for name, (value, least) in bounds.items():
            if isinstance(value, bool) or not isinstance(value, int) or value < least:
                raise ValueError(f"Timeline {name} must be an int >= {least}, got {value!r}")
        self.capacity = capacity
        self.factor = factor
        # Level 0 takes half the points; a level above the last passes on half of its points at
        # a time (a multiple of factor): merging costs a few numpy calls a batch, not a point.
        levels = max(1, min(levels, capacity // (4 * factor) + 1))
        if levels == 1:
            self._limits = [capacity]
        else:
            rest = (capacity - capacity // 2) // (levels - 1)
            self._limits = [capacity // 2] + [rest] * (levels - 1)
        self._batches = [max(factor, n // 2 // factor * factor) for n in self._limits]
        self.levels: list[bytes] = [b""] * levels
        self._new: list[bytes] = []  # chunks newer than level 0
        #: Time of the newest point (-inf when empty).
        self.newest = float("-inf")

    def __len__(self) -> int:
        return sum(len(level) for level in self._settled()) // _RECORD

    def push(self, blob: bytes, newest: float) -> None:
        """Add packed points newer than :attr:`newest` (the last at ``newest``) as a chunk."""
        self._new.append(blob)
        self.newest = newest

    def _settled(self) -> list[bytes]:
        if self._new:
            self.levels[0] = b"".join([self.levels[0], *self._new])
            self._new = []
        return self.levels

    def parts(self) -> tuple[bytes, ...]:
        """The packed points, newest first (``b"".join(reversed(parts))`` is every point)."""
        return (*reversed(self._new), *self.levels)

    def extend(self, samples: Sequence[Sequence[float]] | bytes) -> int:
        """Add the samples (packed bytes, or ``[time, current, max]`` rows; oldest first) newer
        than the newest kept (heartbeats overlap); the index of the first added (``len(samples)``
        when none was new). Malformed samples raise before anything changes."""
        packed = isinstance(samples, (bytes, bytearray, memoryview))
        blob = bytes(samples) if packed else pack_samples(samples)  # type: ignore[arg-type]
        if len(blob) % _RECORD:
            raise ValueError(f"packed samples are {len(blob)} bytes, not a multiple of {_RECORD}")
        first = (len(blob) - len(self.extend_packed(blob))) // _RECORD
        self.compact()
        return first

    def extend_packed(self, blob: bytes) -> bytes:
        """:meth:`extend` for packed samples known to be well formed (the scheduler's path),
        without merging: returns the samples that were new. When :attr:`overflowing`, the
        caller merges with :meth:`compact` or :func:`compact_all` (the timeline then holds up
        to one heartbeat's samples more than ``capacity`` until it does)."""
        times = np.frombuffer(blob, SAMPLE_DTYPE, count=len(blob) // _RECORD)["t"]
        first = int(np.searchsorted(times, self.newest, side="right"))
        new = blob[first * _RECORD :] if first else blob
        if new:
            self.push(new, _TIME.unpack_from(new, len(new) - _RECORD)[0])
        return new

    @property
    def overflowing(self) -> bool:
        """The newest level is full: :meth:`compact` has points to merge."""
        return len(self.levels[0]) + sum(map(len, self._new)) >= self._limits[0] * _RECORD

    def compact(self, start: int = 0) -> None:
        """Merge each full level into the next, from level ``start`` on."""
        levels = self._settled()
        for i in range(start, len(levels)):
            if len(levels[i]) < self._limits[i] * _RECORD:
                break
            self._pass_on(i)

    def append_packed(self, blob: bytes) -> None:
        """Append packed points (oldest first, none older than :attr:`newest`) as they are."""
        if blob:
            self.push(blob, _TIME.unpack_from(blob, len(blob) - _RECORD)[0])
        if self.overflowing:
            self.compact()

    def _passed(self, i: int) -> int:
        """How many points level ``i`` (not the last) passes on: whole batches, until it is
        below its limit."""
        n = len(self.levels[i]) // _RECORD
        limit, batch = self._limits[i], self._batches[i]
        return ((n - limit) // batch + 1) * batch if n >= limit else 0

    def _pass_on(self, i: int) -> None:
        levels = self.levels
        level = levels[i]
        if i == len(levels) - 1:  # the last level: merge all of it pairwise until it fits
            while len(level) >= self._limits[i] * _RECORD and len(level) >= 2 * _RECORD:
                pairs = len(level) // _RECORD // 2 * 2
                level = merge_points(level, pairs, 2) + level[pairs * _RECORD :]
            levels[i] = level
            return
        passed = self._passed(i)
        if passed:
            levels[i + 1] += merge_points(level, passed, self.factor)
            levels[i] = level[passed * _RECORD :]

    def points(self, last: int | None = None) -> np.ndarray:
        """The points oldest first as a numpy array of :data:`SAMPLE_DTYPE` (fields ``t``,
        ``c``, ``m``); only the newest ``last`` if given."""
        a = np.frombuffer(b"".join(reversed(self._settled())), SAMPLE_DTYPE)
        return a if last is None else a[len(a) - min(max(last, 0), len(a)) :]

    def to_list(self, last: int | None = None) -> list[list[float | int]]:
        """The points oldest first as ``[time, current_bytes, max_bytes_in_interval]`` lists."""
        return [list(p) for p in self.points(last).tolist()]

    def peak(self) -> int:
        """The largest ``max_bytes_in_interval`` ever added (0 when empty): merging keeps it."""
        a = self.points()
        return int(a["m"].max()) if len(a) else 0


def downsample(points: np.ndarray, width: int) -> np.ndarray:
    """``points`` (:data:`SAMPLE_DTYPE`, oldest first) in at most ``width`` equal time buckets,
    two points a bucket: its first time with its lowest ``max_bytes_in_interval``, its last
    time with its highest (so a spike narrower than a bucket still shows, at its height)."""
    if width < 1 or len(points) <= 2 * width:
        return points
    t = points["t"]
    span = float(t[-1] - t[0]) or 1.0
    bucket = np.minimum(((t - t[0]) * (width / span)).astype(np.int64), width - 1)
    starts = np.flatnonzero(np.r_[True, bucket[1:] != bucket[:-1]])
    ends = np.r_[starts[1:], len(points)] - 1
    out = np.empty(2 * len(starts), SAMPLE_DTYPE)
    out["t"][0::2], out["t"][1::2] = t[starts], t[ends]
    out["c"][0::2], out["c"][1::2] = points["c"][starts], points["c"][ends]
    m = points["m"]
    out["m"][0::2] = np.minimum.reduceat(m, starts)
    out["m"][1::2] = np.maximum.reduceat(m, starts)
    return out


def compact_all(timelines: list[Timeline]) -> None:
    """:meth:`Timeline.compact` for many timelines of the same ``factor`` (the scheduler's
    devices), each level but the last merged in one numpy pass for all of them: a few calls a
    level, not a few per device."""
    timelines = list(dict.fromkeys(timelines))  # once each, in order
    for tl in timelines:
        tl._settled()
    if any(tl.factor != timelines[0].factor for tl in timelines):
        raise ValueError("compact_all needs timelines of one factor")
    for i in range(max((len(tl.levels) for tl in timelines), default=1) - 1):
        full = [tl for tl in timelines if i < len(tl.levels) - 1 and tl._passed(i)]
        if not full:
            break
        counts, factor = [tl._passed(i) for tl in full], full[0].factor  # lists: few objects
        # Each timeline passes a multiple of factor points: no merged point mixes two devices.
        merged = merge_points(
            b"".join(tl.levels[i][: n * _RECORD] for tl, n in zip(full, counts, strict=True)),
            sum(counts),
            factor,
        )
        at = 0
        for tl, n in zip(full, counts, strict=True):
            size = n // factor * _RECORD
            tl.levels[i + 1] += merged[at : at + size]
            tl.levels[i] = tl.levels[i][n * _RECORD :]
            at += size
    for tl in timelines:
        tl.compact(len(tl.levels) - 1)  # the last level merges pairwise
