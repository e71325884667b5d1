"""The cluster's memory over time: the sum over devices of each device's latest sample, kept
as it arrives (vectorized, a batch at a time), so that the cluster's peak is exact, costs no
pass over every device's timeline, and survives workers that leave or restart. Not here: the
devices' own timelines (``resolution.py``), the plugin that feeds it (``timeline.py``).
"""

from __future__ import annotations

import numpy as np

from dask_rmm.scheduler.resolution import SAMPLE_DTYPE, Timeline

__all__ = ["ClusterTotal", "TotalSnapshot"]

_EVENT = np.dtype([("t", "<f8"), ("row", "<i8"), ("c", "<i8"), ("m", "<i8")])


class ClusterTotal:
    """``S(t) = sum over devices of (current, max_bytes_in_interval) of each device's latest
    sample at or before t``, for every sample time t, and its peak.

    Devices send their samples with heartbeats that arrive up to a heartbeat interval apart, so
    a time is final only once every running device has sent a sample at or after it (the
    watermark); samples newer than that wait. A device that sends nothing for ``max_lag``
    seconds no longer holds the watermark back: its late samples then count from the watermark.
    A device that stops (its worker left) counts 0 from just after its last sample on.

    Parameters
    ----------
    timeline : Timeline
        Where the summed points go (``current`` the sum of the devices' current bytes,
        ``max`` the sum of their ``max_bytes_in_interval``).
    """

    def __init__(self, timeline: Timeline, max_lag: float = 30.0):
        self.timeline = timeline
        self.max_lag = max_lag
        #: The largest sum of the devices' ``max_bytes_in_interval`` at one time (0: none yet).
        self.peak = 0
        self._value = np.zeros((0, 2), np.int64)  # per row: latest final (current, max)
        self._newest = np.zeros(0, np.float64)  # per row: newest sample time received
        self._running = np.zeros(0, bool)
        self._n = 0  # rows ever made (the arrays are longer)
        self._free: list[int] = []
        self._released: list[int] = []  # free once no waiting sample refers to them
        self._chunks: list[tuple[int, bytes]] = []  # (row, packed samples) not yet final
        self._waiting: list[np.ndarray] = []  # of _EVENT, each sorted by time
        self._sum = np.zeros(2, np.int64)  # the final sum (current, max)
        self._final_time = float("-inf")

    # -- rows ---------------------------------------------------------------------------------

    def add_row(self) -> int:
        """A new device row (running), reusing a released one."""
        if self._free:
            row = self._free.pop()
        else:
            row, self._n = self._n, self._n + 1
            if row == len(self._newest):
                grow = max(16, row)
                self._value = np.concatenate([self._value, np.zeros((grow, 2), np.int64)])
                self._newest = np.concatenate([self._newest, np.zeros(grow)])
                self._running = np.concatenate([self._running, np.zeros(grow, bool)])
        self._newest[row] = float("-inf")
        self._running[row] = True
        return row

    @property
    def rows(self) -> int:
        """Rows in use (running or stopped, not yet released)."""
        return self._n - len(self._free) - len(self._released)

    def add(self, row: int, blob: bytes, newest: float) -> None:
        """Packed samples of ``row`` (oldest first, all newer than its previous ones), the
        newest at time ``newest``. O(1): the work is done in :meth:`advance`."""
        self._chunks.append((row, blob))
        self._newest[row] = newest
        self._running[row] = True

    def stop(self, row: int) -> None:
        """The row's device is gone: it counts 0 from just after its newest sample."""
        newest = self._newest[row]
        if np.isfinite(newest):
            zero = np.zeros(1, _EVENT)
            zero["t"], zero["row"] = np.nextafter(newest, np.inf), row
            self._take_chunks()  # the zero comes after the row's samples
            self._waiting.append(zero)
        self._running[row] = False

    def release(self, row: int) -> None:
        """Forget a stopped row (its number is reused once nothing refers to it)."""
        self._running[row] = False
        self._released.append(row)

    # -- summing ------------------------------------------------------------------------------

    def advance(self, now: float) -> None:
        """Sum every sample up to the watermark into :attr:`timeline` and :attr:`peak`."""
        self._take_chunks()
        newest = self._newest[: self._n][self._running[: self._n]]
        newest = newest[np.isfinite(newest)]
        watermark = float(newest.min()) if len(newest) else float("inf")
        watermark = max(watermark, now - self.max_lag)
        final, waiting = [], []
        for events in self._waiting:  # each sorted by time
            cut = int(np.searchsorted(events["t"], watermark, side="right"))
            final.append(events[:cut])
            if cut < len(events):
                waiting.append(events[cut:])
        self._waiting = waiting
        events = _clamp_late(np.concatenate(final), self._final_time) if final else None
        if events is not None and len(events):
            points, value, total = _sum_events(events, self._value, self._sum)
            self._value, self._sum = value, total
            self._final_time = max(self._final_time, float(points["t"][-1]))
            self.timeline.append_packed(points.tobytes())
            self.peak = max(self.peak, int(points["m"].max()))
        if self._released:
            busy = {int(r) for events in waiting for r in np.unique(events["row"])}
            free = [r for r in self._released if r not in busy]
            if free:
                self._value = self._value.copy()  # a snapshot may be reading the old one
                self._value[free] = 0
                self._free += free
            self._released = [r for r in self._released if r in busy]

    def snapshot(self) -> TotalSnapshot:
        """What :meth:`TotalSnapshot.provisional` needs, taken on the event loop (cheap: the
        arrays are never changed in place) and readable in another thread."""
        self._take_chunks()
        return TotalSnapshot(
            list(self._waiting),
            self._value,
            self._sum,
            self._final_time,
            self.peak,
            tuple(self.timeline.levels),
        )

    def _take_chunks(self) -> None:
        """The samples added since the last call, as one more time-sorted waiting array."""
        chunks, self._chunks = self._chunks, []
        if not chunks:
            return
        samples = np.frombuffer(b"".join(b for _, b in chunks), SAMPLE_DTYPE)
        counts = [len(b) // SAMPLE_DTYPE.itemsize for _, b in chunks]
        new = np.empty(len(samples), _EVENT)
        new["t"], new["c"], new["m"] = samples["t"], samples["c"], samples["m"]
        new["row"] = np.repeat(np.fromiter((r for r, _ in chunks), np.int64), counts)
        self._waiting.append(new[np.argsort(new["t"], kind="stable")])

    @property
    def waiting(self) -> int:
        """Samples held back until every running device has caught up."""
        chunks = sum(len(b) for _, b in self._chunks) // SAMPLE_DTYPE.itemsize
        return sum(len(w) for w in self._waiting) + chunks


def _clamp_late(events: np.ndarray, final_time: float) -> np.ndarray:
    # A late sample (its device was more than max_lag behind) counts from the last final time.
    late = events["t"] <= final_time
    if late.any():
        events = events.copy()
        events["t"][late] = np.nextafter(final_time, np.inf)
    return events


def _sum_events(
    events: np.ndarray, start_value: np.ndarray, start_sum: np.ndarray
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """The summed points of ``events`` after the rows' values ``start_value`` (summing to
    ``start_sum``), the rows' values after them, and the sum after them."""
    by_row = events[np.lexsort((events["t"], events["row"]))]
    row = by_row["row"]
    values = np.stack([by_row["c"], by_row["m"]], axis=1)
    first = np.ones(len(row), bool)
    first[1:] = row[1:] != row[:-1]
    previous = np.empty_like(values)
    previous[1:] = values[:-1]
    previous[first] = start_value[row[first]]
    deltas = values - previous
    value = start_value.copy()
    last = np.ones(len(row), bool)
    last[:-1] = first[1:]
    value[row[last]] = values[last]
    order = np.argsort(by_row["t"], kind="stable")
    times = by_row["t"][order]
    sums = start_sum + np.cumsum(deltas[order], axis=0)
    # Samples at the same time count together (the sum after all of them).
    end = np.ones(len(times), bool)
    end[:-1] = times[1:] != times[:-1]
    points = np.empty(int(end.sum()), SAMPLE_DTYPE)
    points["t"], points["c"], points["m"] = times[end], sums[end, 0], sums[end, 1]
    return points, value, sums[-1]


class TotalSnapshot:
    """A :class:`ClusterTotal`'s state at one moment (see :meth:`ClusterTotal.snapshot`)."""

    def __init__(
        self,
        waiting: list[np.ndarray],
        value: np.ndarray,
        total: np.ndarray,
        final_time: float,
        peak: int,
        levels: tuple[bytes, ...],
    ):
        self._waiting, self._value, self._sum = waiting, value, total
        self._final_time, self.peak, self.levels = final_time, peak, levels

    def provisional(self) -> tuple[int, np.ndarray]:
        """``(peak, points)``: the peak and the summed points (after the final ones) counting
        the samples not final yet as if every device had caught up."""
        if not self._waiting:
            return self.peak, np.zeros(0, SAMPLE_DTYPE)
        events = _clamp_late(np.concatenate(self._waiting), self._final_time)
        points, _, _ = _sum_events(events, self._value, self._sum)
        return max(self.peak, int(points["m"].max())), points

    def points(self) -> tuple[int, np.ndarray]:
        """``(peak, points)``: the peak as :meth:`provisional` counts it, and the summed points
        oldest first, the final ones then the provisional ones."""
        final = np.frombuffer(b"".join(reversed(self.levels)), SAMPLE_DTYPE)
        peak, provisional = self.provisional()
        return peak, np.concatenate([final, provisional]) if len(provisional) else final
