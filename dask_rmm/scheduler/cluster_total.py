"""The cluster's memory over time: the sum over devices of each device's latest sample, kept as
samples arrive, so its peak is exact and survives workers that leave. Not here: the devices' own
timelines (``resolution.py``), the plugin that feeds it (``timeline.py``)."""

from __future__ import annotations

from typing import NamedTuple

import numpy as np

from dask_rmm.scheduler.resolution import SAMPLE_DTYPE, Timeline
from dask_rmm.wire import SAMPLE_STRUCT

__all__ = ["ClusterTotal", "TotalSnapshot"]

#: Arrays of waiting changes kept before they are merged into one: a safety net (a device
#: ahead of the others leaves a part of every batch waiting; the scheduler accepts sample times
#: up to 60 s ahead and ``max_lag`` 30 s behind, so about 180 arrays at most at one a 0.5 s).
MAX_WAITING_ARRAYS = 256
#: Device rows up to which the sum takes every sample (above: ``COARSE_SECONDS`` buckets).
EXACT_ROWS = 4096
COARSE_SECONDS = 1.0
#: Sums at least this large (in absolute value) are computed saturating, not in int64.
_SAFE = float(1 << 62)


class ClusterTotal:
    """``S(t) = sum over devices of (current, max_bytes_in_interval) of each device's latest
    sample at or before t``, for every sample time t, and its peak.

    Each device's samples arrive in time order, so each becomes, on arrival, a change of the
    sum; ``S`` is then the running sum of the changes in time order. Heartbeats of different
    workers arrive up to a heartbeat interval apart, so a time is final only once every running
    device has sent a sample at or after it (the watermark); later changes wait. A device more
    than ``max_lag`` seconds behind no longer holds the watermark back: its late changes count
    from the watermark on. A device that stops (its worker left) counts 0 from just after its
    last sample.

    Parameters
    ----------
    timeline : Timeline
        Where the final summed points go (``current``: the sum of the devices' current bytes;
        ``max``: the sum of their ``max_bytes_in_interval``).
    max_lag : float
        Seconds a device may be behind the others before the sum goes on without it.
    exact_rows : int
        Up to this many device rows the sum takes every sample; above, each device's samples
        count a ``coarse`` seconds bucket at a time (its last current bytes, its largest
        ``max_bytes_in_interval``), so that the work per sample stays small at thousands of
        devices: the sum's peak is then the peak at that resolution, never below the exact one.
    coarse : float
        Seconds of a bucket above ``exact_rows`` rows.
    """

    def __init__(
        self,
        timeline: Timeline,
        max_lag: float = 30.0,
        exact_rows: int = EXACT_ROWS,
        coarse: float = COARSE_SECONDS,
    ):
        self.timeline = timeline
        self.max_lag = max_lag
        self.exact_rows = exact_rows
        self.coarse = coarse
        #: The largest final sum of the devices' ``max_bytes_in_interval`` (0: none yet).
        self.peak = 0
        # Per row (numpy, read and updated a batch at a time; grown by doubling): the latest
        # (current, max) arrived, the largest max_bytes_in_interval arrived, the newest sample
        # time arrived and whether it runs.
        self._latest = np.zeros((2, 16), np.int64)
        self._row_peak = np.zeros(16, np.int64)
        self._newest = np.full(16, -np.inf)
        self._running = np.zeros(16, bool)
        self._n = 0  # rows ever made
        self._free: list[int] = []
        self._rows: list[int] = []  # rows and their packed samples not yet changes
        self._blobs: list[bytes] = []
        self._pending: set[int] = set()  # the rows in _rows (each once: add)
        # Changes (columns, _t: time, current, max) waiting for the watermark, each in time order.
        self._waiting: list[np.ndarray] = []
        self._sum = np.zeros(2, np.int64)  # the final sum (current, max)
        self._final_time = float("-inf")

    # -- rows ---------------------------------------------------------------------------------

    def add_row(self) -> int:
        """A new device row (running), reusing a released one."""
        if self._free:
            row = self._free.pop()
        else:
            row, self._n = self._n, self._n + 1
            if row == len(self._row_peak):
                self._grow()
        self._latest[:, row] = 0
        self._row_peak[row] = 0
        self._newest[row] = float("-inf")
        self._running[row] = True
        return row

    def _grow(self) -> None:
        for name in ("_latest", "_row_peak", "_newest", "_running"):
            a = getattr(self, name)
            fill = -np.inf if name == "_newest" else 0
            setattr(self, name, np.concatenate([a, np.full_like(a, fill)], axis=-1))

    @property
    def rows(self) -> int:
        """Rows in use (running or stopped, not yet released)."""
        return self._n - len(self._free)

    def add(self, rows: list[int], blobs: list[bytes], newest: list[float]) -> None:
        """Packed samples of each of ``rows`` (oldest first, all newer than the row's previous
        ones), the newest at time ``newest``: the work is done a batch at a time."""
        if len(set(rows)) < len(rows):
            # A row's samples change the sum from its previous ones: once a row a batch.
            for row, blob, t in zip(rows, blobs, newest, strict=True):
                self.add([row], [blob], [t])
            return
        if not self._pending.isdisjoint(rows):
            self._take_chunks()
        self._pending.update(rows)
        self._rows += rows
        self._blobs += blobs
        self._newest[rows] = newest
        self._running[rows] = True

    def stop(self, row: int) -> None:
        """The row's device is gone: it counts 0 from just after its newest sample."""
        self._take_chunks()
        newest = float(self._newest[row])
        c, m = self._latest[:, row].tolist()
        if newest > float("-inf") and (c or m):
            zero = np.array([[0], [-c], [-m]], np.int64)
            _t(zero)[0] = np.nextafter(newest, np.inf)
            self._waiting.append(zero)
        self._latest[:, row] = 0
        self._running[row] = False

    def release(self, row: int) -> None:
        """Forget a row (stopped first if it was not); its number is reused."""
        if self._running[row]:
            self.stop(row)
        self._newest[row] = float("-inf")
        self._free.append(row)

    # -- summing ------------------------------------------------------------------------------

    def _take_chunks(self) -> None:
        """The samples added since the last call, as changes (one more waiting array, in time
        order)."""
        chunks, blobs, self._rows, self._blobs = self._rows, self._blobs, [], []
        self._pending = set()
        if not chunks:
            return
        rows = np.array(chunks, np.int64)  # each once (add)
        raw = np.frombuffer(b"".join(blobs), SAMPLE_DTYPE)
        counts = np.fromiter(map(len, blobs), np.int64, len(blobs)) // SAMPLE_STRUCT.size
        if self.rows > self.exact_rows:
            raw, counts = _coarsen(raw, counts, self.coarse)
        starts = np.cumsum(counts) - counts
        x = raw.view(np.int64).reshape(-1, 3)  # a sample a row: time's bits, current, max
        # Each sample changes the sum by its difference to the one before; a chunk's first
        # sample by its difference to its row's latest. The changes are columns (_t):
        # numpy gathers, masks and sums a few contiguous rows many times faster than a record
        # array's fields (and the samples are read once, no transposed copy).
        change = np.empty((3, len(x)), np.int64)
        change[0] = x[:, 0]
        np.subtract(x[1:, 1], x[:-1, 1], out=change[1, 1:])
        np.subtract(x[1:, 2], x[:-1, 2], out=change[2, 1:])
        change[1:, starts] = x[starts, 1:].T - np.take(self._latest, rows, axis=1)
        self._latest[:, rows] = x[starts + counts - 1, 1:].T
        np.maximum.at(self._row_peak, rows, np.maximum.reduceat(x[:, 2], starts))
        change = _merge_same_times(change, counts, starts)
        # Changes at the same time count together (a point is the sum after all of them), so
        # their order is free: an unstable sort (introsort, SIMD where numpy has it) took half
        # of timsort's time for a poll's interleaved chunks (bench/README.md, issue 45 item 3).
        self._waiting.append(np.take(change, np.argsort(_t(change)), axis=1))

    def advance(self, now: float) -> None:
        """Sum every change up to the watermark into :attr:`timeline` and :attr:`peak`."""
        if not self._rows and not self._waiting:
            return
        self._take_chunks()
        newest = self._newest[: self._n][self._running[: self._n]]
        newest = newest[np.isfinite(newest)]
        watermark = float(newest.min()) if len(newest) else float("inf")
        watermark = max(watermark, now - self.max_lag)
        final, waiting = [], []
        for changes in self._waiting:  # each in time order
            cut = int(np.searchsorted(_t(changes), watermark, side="right"))
            if cut:
                final.append(changes[:, :cut])
            if cut < changes.shape[1]:
                # A view keeps its whole array alive: copy once most of it is summed.
                rest = changes[:, cut:]
                waiting.append(rest.copy() if cut > rest.shape[1] else rest)
        if len(waiting) > MAX_WAITING_ARRAYS:
            merged = np.concatenate(waiting, axis=1)
            waiting = [np.take(merged, np.argsort(_t(merged)), axis=1)]
        self._waiting = waiting
        if not final:
            return
        points = _sum_changes(np.concatenate(final, axis=1), self._sum, self._final_time)
        self._sum = np.array([points["c"][-1], points["m"][-1]], np.int64)
        self._final_time = float(points["t"][-1])
        self.timeline.append_packed(points.tobytes())
        self.peak = max(self.peak, int(points["m"].max()))

    def snapshot(self) -> TotalSnapshot:
        """What :meth:`TotalSnapshot.points` needs, taken on the event loop (cheap: nothing in
        it is changed in place afterwards) and readable in another thread."""
        self._take_chunks()
        return TotalSnapshot(
            list(self._waiting),
            self._sum.copy(),
            self._final_time,
            self.peak,
            self.timeline.parts(),
            self._row_peak.copy(),
        )

    @property
    def waiting(self) -> int:
        """Samples held back until every running device has caught up (those of one time of
        a worker's devices, sampled together, count once)."""
        chunks = sum(map(len, self._blobs)) // SAMPLE_DTYPE.itemsize
        return sum(w.shape[1] for w in self._waiting) + chunks


def _t(a: np.ndarray) -> np.ndarray:
    """The times of changes ``a``: a ``(3, n)`` int64 array of columns (the times' float64
    bits, current bytes, ``max_bytes_in_interval``)."""
    return a[0].view(np.float64)


def _sum_changes(changes: np.ndarray, start: np.ndarray, final_time: float) -> np.ndarray:
    """The summed points (:data:`SAMPLE_DTYPE`) after ``changes`` (:func:`_t`),
    starting from the sum ``start`` (current, max); a change at or before ``final_time``
    (late) counts just after it."""
    late = _t(changes) <= final_time
    if late.any():
        changes = changes.copy()
        _t(changes)[late] = np.nextafter(final_time, np.inf)
    changes = np.take(changes, np.argsort(_t(changes)), axis=1)  # at one time: order free
    times = _t(changes)
    # Samples at the same time count together (the sum after all of them).
    end = np.ones(len(times), bool)
    end[:-1] = times[1:] != times[:-1]
    points = np.empty(int(end.sum()), SAMPLE_DTYPE)
    points["t"] = times[end]
    points["c"], points["m"] = np.compress(end, _cumsum(start, changes[1:]), axis=1)
    return points


def _merge_same_times(changes: np.ndarray, counts: np.ndarray, starts: np.ndarray) -> np.ndarray:
    """``changes`` (:func:`_t`) of chunks of ``counts`` samples, those of each chunk whose
    times are those of the chunk before it (a worker's devices, sampled together) added into
    that one's: fewer changes to sort, the same sums (a point is the sum after every change at
    its time). Where the added changes could wrap an int64, none are."""
    n = len(counts)
    t = _t(changes)
    same = np.zeros(n, bool)  # first as long as the chunk before and starting at its time
    same[1:] = (counts[1:] == counts[:-1]) & (counts[1:] > 0)
    same[1:] &= t[np.minimum(starts[1:], len(t) - 1)] == t[starts[:-1]]
    if not same.any():
        return changes
    k = np.arange(len(t))
    shift = np.repeat(np.where(same, counts, 0), counts)  # the same place in the chunk before
    same &= np.logical_and.reduceat(t == t[k - shift], starts)
    if not same.any() or int(np.abs(changes[1:]).max()) * n >= _SAFE:
        return changes
    lead = np.where(same, 0, np.arange(n))  # each chunk's first chunk of these times
    np.maximum.accumulate(lead, out=lead)
    offset = np.repeat((np.arange(n) - lead) * counts, counts)
    moved = offset > 0
    to = (k - offset)[moved]
    np.add.at(changes[1], to, changes[1][moved])
    np.add.at(changes[2], to, changes[2][moved])
    return np.compress(~moved, changes, axis=1)


def _coarsen(a: np.ndarray, counts: np.ndarray, seconds: float) -> tuple[np.ndarray, np.ndarray]:
    """Samples ``a`` of chunks of ``counts`` samples, each chunk's a ``seconds`` bucket at a
    time: the bucket's last time and current bytes, its largest ``max_bytes_in_interval`` (one
    numpy pass over all chunks). Returns the samples, chunk after chunk, and how many each
    chunk has."""
    chunk = np.repeat(np.arange(len(counts)), counts)
    bucket = np.floor(a["t"] / seconds)
    first = np.ones(len(a), bool)
    first[1:] = (bucket[1:] != bucket[:-1]) | (chunk[1:] != chunk[:-1])
    starts = np.flatnonzero(first)
    ends = np.r_[starts[1:], len(a)] - 1
    out = np.empty(len(starts), SAMPLE_DTYPE)
    out["t"], out["c"] = a["t"][ends], a["c"][ends]
    out["m"] = np.maximum.reduceat(a["m"], starts)
    return out, np.bincount(chunk[starts], minlength=len(counts))


def _cumsum(start: np.ndarray, changes: np.ndarray) -> np.ndarray:
    """``start`` (a column each row of ``changes``) plus the running sums of ``changes``'
    rows, never wrapping: where an int64 could overflow (it cannot with the scheduler's
    bounds on what a device sends, but the bounds are per device) the sums are taken in float
    and held to the int64 range."""
    start = start[:, None]
    largest = np.abs(start).max() + np.abs(changes.astype(np.float64)).sum(axis=1).max()
    if float(largest) < _SAFE:
        return start + np.cumsum(changes, axis=1)
    total = start + np.cumsum(changes.astype(np.float64), axis=1)
    return np.clip(total, -_SAFE, _SAFE).astype(np.int64)


class TotalSnapshot(NamedTuple):
    """A :class:`ClusterTotal`'s state at one moment (see :meth:`ClusterTotal.snapshot`)."""

    waiting: list[np.ndarray]
    total: np.ndarray
    final_time: float
    peak: int
    levels: tuple[bytes, ...]
    #: Per row: the largest ``max_bytes_in_interval`` the row's device ever sent.
    row_peaks: np.ndarray

    def points(self) -> tuple[int, np.ndarray]:
        """``(peak, points)``: the summed points oldest first, the final ones then those not
        final yet (counted as if every device had caught up), and their peak."""
        final = np.frombuffer(b"".join(reversed(self.levels)), SAMPLE_DTYPE)
        if not self.waiting:
            return self.peak, final
        provisional = _sum_changes(
            np.concatenate(self.waiting, axis=1), self.total, self.final_time
        )
        peak = max(self.peak, int(provisional["m"].max()))
        return peak, np.concatenate([final, provisional])
