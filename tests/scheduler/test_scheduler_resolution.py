"""Timeline (fixed points, several resolutions), downsample and ClusterTotal against the full
resolution: peaks and sums are never lost."""

from __future__ import annotations

import random

import numpy as np
import pytest

from dask_rmm.report.memory_report import peak_of_sum, summed_series
from dask_rmm.scheduler.cluster_total import ClusterTotal
from dask_rmm.scheduler.resolution import SAMPLE_DTYPE, Timeline, compact_all, downsample
from dask_rmm.wire import pack_samples, unpack_samples


def _heartbeats(rng: random.Random, n: int, per_beat: int, t0: float = 0.0):
    """``n`` heartbeats of one device as WorkerMetrics sends them (each repeats the previous
    one's samples), and the raw samples in order."""
    raw, previous, t, beats = [], [], t0, []
    for _ in range(n):
        batch = []
        for _ in range(rng.randint(0, per_beat)):
            t += rng.choice([0.1, 0.1, 0.2, 1.0])
            current = rng.randrange(1 << 30)
            batch.append([t, current, current + rng.randrange(1 << 20)])
        beats.append(pack_samples(previous + batch))
        raw += batch
        previous = batch
    return beats, raw


def test_packed_samples_round_trip_and_reject_a_partial_record():
    rows = [[1.5, 10, 20], [2.5, 30, 40]]
    assert unpack_samples(pack_samples(rows)) == rows
    with pytest.raises(ValueError, match="multiple of 24"):
        unpack_samples(pack_samples(rows)[:-1])


def test_timeline_is_exact_until_its_first_level_fills():
    tl = Timeline(64)
    rows = [[float(i), i, 10 * i] for i in range(20)]
    tl.extend(rows[:12])
    tl.extend(rows[5:])  # overlapping heartbeats add only the new samples
    assert tl.to_list() == rows and len(tl) == 20 and tl.peak() == 190
    assert tl.to_list(last=2) == rows[-2:] and tl.to_list(last=0) == []


@pytest.mark.parametrize("capacity,levels", [(2, 1), (5, 3), (64, 3), (512, 3), (300, 5)])
def test_timeline_keeps_every_peak_the_first_and_newest_sample_in_bounded_points(capacity, levels):
    rng = random.Random(capacity * levels)
    tl = Timeline(capacity, levels=levels)
    beats, raw = _heartbeats(rng, 400, 30)
    seen: list[list] = []
    for beat in beats:
        tl.extend(beat)
        assert len(tl) <= capacity
        seen += unpack_samples(beat)
        if seen:
            pts = tl.points()
            assert int(pts["m"].max()) == tl.peak() == max(r[2] for r in seen)
            assert pts["t"][0] == raw[0][0] and pts["c"][-1] == seen[-1][1]
            if len(tl.levels) > 1:  # the newest level holds samples as they came
                assert list(pts[-1]) == seen[-1]
            assert np.all(np.diff(pts["t"]) > 0)


def test_timeline_recent_points_are_at_full_resolution():
    tl = Timeline(512)
    beats, raw = _heartbeats(random.Random(1), 300, 20)
    for beat in beats:
        tl.extend(beat)
    # Level 0 holds at least a quarter of the capacity unmerged.
    assert tl.to_list(last=128) == raw[-128:]


def test_compact_all_merges_many_timelines_as_each_would_alone():
    rng = random.Random(7)
    streams = [_heartbeats(rng, 120, 40)[0] for _ in range(6)]
    alone = [Timeline(96) for _ in streams]
    batched = [Timeline(96) for _ in streams]
    for k in range(120):
        full = []
        for s, a, b in zip(streams, alone, batched, strict=True):
            a.extend(s[k])
            b.extend_packed(s[k])
            if b.overflowing:
                full += [b, b]  # a timeline listed twice is merged once
        if k % 3 == 0:
            compact_all(full)
    compact_all(batched)
    for a, b in zip(alone, batched, strict=True):
        assert b.points().tolist() == a.points().tolist()


@pytest.mark.parametrize(
    "bad", [[[4.0, 2]], [[4.0, "x", 3]], [None], [[4.0, 2.5, 3]], b"\x00" * 23]
)
def test_timeline_malformed_samples_change_nothing(bad):
    tl = Timeline(8)
    tl.extend([[0.0, 1, 1], [1.0, 2, 2], [2.0, 3, 3]])
    with pytest.raises((IndexError, TypeError, ValueError)):
        tl.extend(bad if isinstance(bad, bytes) else [[3.0, 4, 4], *bad])
    assert tl.to_list() == [[0.0, 1, 1], [1.0, 2, 2], [2.0, 3, 3]]


@pytest.mark.parametrize("bad", [0, 1, -1, 2.5, True, "10"])
def test_timeline_rejects_a_capacity_below_two(bad):
    with pytest.raises(ValueError, match="capacity must be an int >= 2"):
        Timeline(bad)


@pytest.mark.parametrize("width", [1, 3, 50, 640])
def test_downsample_keeps_the_peak_the_ends_and_fits_the_width(width):
    rng = np.random.default_rng(width)
    pts = np.zeros(5000, SAMPLE_DTYPE)
    pts["t"] = np.cumsum(rng.uniform(0.01, 1.0, 5000))
    pts["m"] = rng.integers(0, 1 << 30, 5000)
    pts["m"][rng.integers(0, 5000)] = 1 << 40  # one narrow spike
    out = downsample(pts, width)
    assert len(out) <= 2 * width
    assert out["m"].max() == 1 << 40 and out["m"].min() == pts["m"].min()
    assert out["t"][0] == pts["t"][0] and out["t"][-1] == pts["t"][-1]
    assert np.all(np.diff(out["t"]) >= 0)
    small = pts[:10]
    assert downsample(small, width if width >= 5 else 5).tolist() == small.tolist()


def _reference_peak(raw: list[list[list]]) -> int | None:
    return peak_of_sum(raw)


@pytest.mark.parametrize("seed", range(6))
def test_cluster_total_equals_the_peak_of_the_summed_full_resolution_timelines(seed):
    rng = random.Random(seed)
    total = ClusterTotal(Timeline(64), max_lag=1e9)
    devices = rng.randint(1, 30)
    rows = [total.add_row() for _ in range(devices)]
    streams = [_heartbeats(rng, 40, 12, t0=rng.random()) for _ in range(devices)]
    timelines = [Timeline(16) for _ in range(devices)]
    # Heartbeats of different devices arrive interleaved, some devices far behind others.
    order = [d for d in range(devices) for _ in range(40)]
    rng.shuffle(order)
    sent = [0] * devices
    for step, d in enumerate(order):
        beat = streams[d][0][sent[d]]
        sent[d] += 1
        first = timelines[d].extend(beat)
        if first * 24 < len(beat):
            total.add([rows[d]], [beat[first * 24 :]], [timelines[d].newest])
        if step % 7 == 0:
            total.advance(now=0.0)
    raw = [s[1] for s in streams]
    peak, points = total.snapshot().points()
    assert peak == _reference_peak(raw)
    assert int(points["m"].max()) == peak
    # What is final never exceeds it; once no device can send older samples, all is final.
    assert total.peak <= peak
    total.max_lag = 0.0
    total.advance(now=1e9)
    assert total.waiting == 0 and total.peak == peak
    assert total.snapshot().points()[1]["c"][-1] == sum(r[-1][1] for r in raw if r)


@pytest.mark.parametrize("seed", range(6))
def test_cluster_total_of_workers_whose_devices_share_sample_times_is_the_summed_series(seed):
    """A worker samples its devices together, so their changes of one time count as one (fewer
    to sort); a worker's heartbeats may come twice in one batch, in one call or two."""
    rng = random.Random(seed)
    total = ClusterTotal(Timeline(100_000), max_lag=1e9)
    workers = [[total.add_row() for _ in range(rng.randint(1, 4))] for _ in range(8)]
    clocks = [1e9 + rng.choice([0.0, 0.05, rng.random()]) for _ in workers]
    raw: dict[int, list] = {row: [] for rows in workers for row in rows}
    for batch in range(30):  # every device in the first (none is late: it holds the others)
        calls = []
        some = rng.sample(range(len(workers)), rng.randint(1, len(workers)))
        for w in range(len(workers)) if batch == 0 else some:
            for _ in range(rng.choice([1, 1, 2])):  # sometimes two heartbeats of one worker
                times = []
                for _ in range(rng.randint(1, 4)):
                    clocks[w] += rng.choice([0.1, 0.1, 0.3])
                    times.append(clocks[w])
                rows, blobs = [], []
                for row in workers[w]:
                    if batch and rng.random() < 0.1:  # a device without samples this time
                        continue
                    samples = []
                    for t in times:
                        current = rng.randrange(1 << 30)
                        samples.append([t, current, current + rng.randrange(1 << 20)])
                    raw[row] += samples
                    rows.append(row)
                    blobs.append(pack_samples(samples))
                calls.append((rows, blobs, [times[-1]] * len(rows)))
        if rng.random() < 0.5:  # the batch in one call
            calls = [tuple(sum((list(c[i]) for c in calls), []) for i in range(3))]
        for call in calls:
            total.add(*call)
        total.advance(now=0.0)
    points = total.snapshot().points()[1]
    series = list(raw.values())
    for column, field in ((1, "c"), (2, "m")):
        expected = summed_series([([(s[0], s[column]) for s in r], False) for r in series])
        assert list(zip(points["t"].tolist(), points[field].tolist(), strict=True)) == expected


def test_cluster_total_adds_together_only_chunks_of_the_very_same_times():
    """Chunks as long as the one before and starting at its time, but not of its times all
    through, each count at their own times."""
    total = ClusterTotal(Timeline(64), max_lag=1e9)
    a, b, c = (total.add_row() for _ in range(3))
    blobs = [
        pack_samples([[1.0, 10, 10], [2.0, 20, 20], [3.0, 30, 30]]),
        pack_samples([[1.0, 1, 1], [2.5, 2, 2], [3.0, 3, 3]]),  # the second time differs
        pack_samples([[1.0, 100, 100], [2.5, 200, 200], [3.0, 300, 300]]),  # b's times: added
    ]
    total.add([a, b, c], blobs, [3.0, 3.0, 3.0])
    total.advance(now=0.0)
    points = total.snapshot().points()[1]
    assert points["t"].tolist() == [1.0, 2.0, 2.5, 3.0]
    assert points["m"].tolist() == [111, 121, 222, 333] and total.peak == 333


def test_cluster_total_counts_a_stopped_device_as_zero_after_its_last_sample():
    total = ClusterTotal(Timeline(64), max_lag=1e9)
    a, b = total.add_row(), total.add_row()
    total.add([a], [pack_samples([[1.0, 100, 100]])], [1.0])
    total.add([b], [pack_samples([[0.5, 50, 50]])], [0.5])
    total.stop(a)
    total.add([b], [pack_samples([[3.0, 70, 70]])], [3.0])
    total.advance(now=0.0)
    pts = total.snapshot().points()[1]
    assert pts["m"].tolist() == [50, 150, 50, 70] and total.peak == 150


def test_cluster_total_rows_are_reused_so_memory_stays_bounded_as_workers_come_and_go():
    total = ClusterTotal(Timeline(64), max_lag=1e9)
    t = 0.0
    for _ in range(500):  # 500 workers come, send, leave and are forgotten, 4 at a time
        rows = [total.add_row() for _ in range(4)]
        for r in rows:
            t += 1.0
            total.add([r], [pack_samples([[t, 10, 10]])], [t])
        for r in rows:
            total.stop(r)
            total.release(r)
        total.advance(now=0.0)
    assert total.rows == 0 and len(total._newest) <= 16 and total.waiting == 0


def test_above_exact_rows_the_sum_takes_a_bucket_a_device_and_never_lowers_the_peak():
    import random

    from dask_rmm.report.memory_report import peak_of_sum
    from dask_rmm.scheduler.cluster_total import ClusterTotal
    from dask_rmm.scheduler.resolution import Timeline

    rng = random.Random(3)
    exact = ClusterTotal(Timeline(100_000))
    coarse = ClusterTotal(Timeline(100_000), exact_rows=2, coarse=1.0)
    rows = [(exact.add_row(), coarse.add_row()) for _ in range(4)]
    raw: list[list] = [[] for _ in rows]
    clock = [1e9 + rng.random() for _ in rows]
    for beat in range(20):
        for i, (e, c) in enumerate(rows):
            batch = []
            for _ in range(10):
                clock[i] += 0.1
                current = rng.randrange(1 << 20)
                batch.append([clock[i], current, current + rng.randrange(1 << 16)])
            raw[i] += batch
            exact.add([e], [pack_samples(batch)], [clock[i]])
            coarse.add([c], [pack_samples(batch)], [clock[i]])
        exact.advance(1e9 + beat)
        coarse.advance(1e9 + beat)
    (peak_e, pts_e), (peak_c, pts_c) = exact.snapshot().points(), coarse.snapshot().points()
    assert peak_e == peak_of_sum(raw)
    assert peak_of_sum(raw) <= peak_c <= sum(max(s[2] for s in r) for r in raw)
    assert pts_c["c"][-1] == pts_e["c"][-1] == sum(r[-1][1] for r in raw)
    assert len(pts_c) <= len(pts_e) // 5
    assert list(coarse.snapshot().row_peaks[:4]) == [max(s[2] for s in r) for r in raw]


def test_pushed_points_stay_chunks_until_read_and_parts_taken_before_do_not_change():
    """The scheduler's newest points go in as chunks (no copy of level 0 a heartbeat), joined
    when the timeline is read or merged; parts taken for a snapshot keep what they had."""
    tl = Timeline(64)
    tl.extend(pack_samples([[0.0, 1, 1]]))
    level0 = tl.levels[0]
    tl.push(pack_samples([[1.0, 2, 2]]), 1.0)
    assert tl.levels[0] is level0 and tl.newest == 1.0
    before = tl.parts()
    tl.push(pack_samples([[2.0, 3, 3]]), 2.0)
    assert unpack_samples(b"".join(reversed(before))) == [[0.0, 1, 1], [1.0, 2, 2]]
    assert tl.to_list() == [[0.0, 1, 1], [1.0, 2, 2], [2.0, 3, 3]] and len(tl) == 3
