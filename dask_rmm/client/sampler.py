"""``GPUMemorySampler``: distributed's ``MemorySampler`` for the cluster's RMM memory, read from the
scheduler's timelines (its report handler) while a block of work runs. Not here: the timelines
themselves (:mod:`dask_rmm.scheduler`), the report of one moment (:mod:`dask_rmm.report`).
"""

from __future__ import annotations

import asyncio
import contextlib
import time
import uuid
from collections.abc import AsyncIterator, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
from distributed import Client, get_client

from dask_rmm._output import save_figure
from dask_rmm.client.fetch import fetch_report_data
from dask_rmm.plotting.figures import byte_axis, figure
from dask_rmm.report.memory_report import _device_label, require_pandas, summed_series
from dask_rmm.sizes import format_bytes
from dask_rmm.worker.metrics import send_metrics

__all__ = ["DeviceSeries", "GPUMemorySampler", "GPUSamples", "summed_series", "time_mean"]

#: What ``to_pandas``/``plot`` can show (and the plot's words for it): bytes in use at each
#: sample, the most in use within each sample interval, or what the pools held from their devices.
MEASURES = {
    "used": "in use",
    "used_max": "in use (max per sample interval)",
    "reserved": "reserved",
}
# Samples asked for per device on each poll at first; doubled while a poll misses some.
_FIRST_LAST = 64


@dataclass
class DeviceSeries:
    """What was sampled of one worker device during one block.

    ``used``: ``(time, current_bytes, max_bytes_in_interval)`` timeline samples, oldest first
    (times are the worker's clock); ``reserved``: ``(time, reserved_bytes)`` at each heartbeat
    the sampler saw. ``status`` is the worker's last known one ("running" or "gone").
    """

    worker: str
    name: str
    device: str
    status: str = "running"
    used: list[tuple[float, int, int]] = field(default_factory=list)
    reserved: list[tuple[float, int]] = field(default_factory=list)

    @property
    def label(self) -> str:
        return _device_label(self)

    def add_used(
        self, samples: Iterable[Sequence[float]], start: float, stop: float | None
    ) -> None:
        """Keep the samples newer than the newest kept, from ``start`` to ``stop`` and the first
        one after ``stop`` (its interval maximum covers the block's last moments)."""
        newest = self.used[-1][0] if self.used else start - 1e-9
        end = float("inf") if stop is None else stop
        for s in samples:
            t = float(s[0])
            if t <= newest or t < start:
                continue
            if newest > end:
                break
            self.used.append((t, int(s[1]), int(s[2])))
            newest = t

    def add_reserved(self, when: float, nbytes: int) -> None:
        """Keep a heartbeat's reserved bytes (one value per time: a later one replaces)."""
        if not self.reserved or when > self.reserved[-1][0]:
            self.reserved.append((when, int(nbytes)))
        elif when == self.reserved[-1][0]:
            self.reserved[-1] = (when, int(nbytes))


@dataclass
class GPUSamples:
    """One labelled block: its start and stop times (the client's clock) and each device's series,
    keyed by ``(worker address, device id)``; devices of workers that died stay."""

    label: str
    start: float
    stop: float | None = None
    devices: dict[tuple[str, str], DeviceSeries] = field(default_factory=dict)

    def _series(self, measure: str) -> list[tuple[list[tuple[float, int]], bool]]:
        if measure not in MEASURES:
            raise ValueError(f"measure must be one of {', '.join(MEASURES)}, got {measure!r}")
        column = 1 if measure == "used" else 2
        out = []
        for d in self.devices.values():
            points = (
                d.reserved if measure == "reserved" else [(s[0], int(s[column])) for s in d.used]
            )
            out.append((points, d.status != "running"))
        return out

    def summed(self, measure: str = "used") -> list[tuple[float, int]]:
        """``measure`` summed over the devices at every sample time (see :func:`summed_series`)."""
        return summed_series(self._series(measure))

    @property
    def peak_used(self) -> int:
        """The most the devices held at once: the peak of the summed per-interval maxima."""
        return max((v for _, v in self.summed("used_max")), default=0)

    @property
    def mean_used(self) -> float:
        """Bytes in use, summed over the devices, averaged over the block's time."""
        return time_mean(self.summed("used"), self.stop)

    @property
    def peak_reserved(self) -> int:
        return max((v for _, v in self.summed("reserved")), default=0)

    @property
    def mean_reserved(self) -> float:
        return time_mean(self.summed("reserved"), self.stop)

    @property
    def workers_lost(self) -> list[str]:
        """Workers that left while (or before the end of) the block."""
        return sorted({d.worker for d in self.devices.values() if d.status != "running"})

    def _add_report(self, data: Mapping[str, Any], last: int | None) -> bool:
        """Add a report's new samples (its timelines' ``last`` points); False when some device's
        timeline starts after what was kept (samples were missed: ask again for more)."""
        complete = True
        start = self.start
        present = set()
        for w in data.get("workers") or ():
            address = str(w.get("address", ""))
            for dev, d in (w.get("devices") or {}).items():
                key = (address, str(dev))
                present.add(key)
                series = self.devices.get(key)
                if series is None:
                    series = self.devices[key] = DeviceSeries(
                        address, str(w.get("name", "")), str(dev)
                    )
                series.status = str(w.get("status", "running"))
                timeline = d.get("timeline") or []
                newest = series.used[-1][0] if series.used else start
                if last and len(timeline) >= last and float(timeline[0][0]) > newest:
                    complete = False
                stop = self.stop
                series.add_used(timeline, start, stop)
                if series.status == "running" and w.get("last_seen"):
                    # A heartbeat's reserved bytes stand from the block's start to its stop.
                    when = max(float(w["last_seen"]), start)
                    when = when if stop is None else min(when, stop)
                    series.add_reserved(when, int(d.get("reserved_bytes") or 0))
        # Devices no longer in the report at all (forgotten by the scheduler): their worker left.
        for key, series in self.devices.items():
            if key not in present:
                series.status = "gone"
        return complete


def time_mean(points: Sequence[tuple[float, float]], stop: float | None = None) -> float:
    """The time-weighted mean of a step series (each value holds until the next sample, the
    last one until ``stop``); the plain mean when it spans no time, 0.0 when empty."""
    if not points:
        return 0.0
    t, v = np.asarray(points, dtype=float).T
    span = max(t[-1], stop or t[-1]) - t[0]
    return float(v.mean() if span <= 0 else v @ np.diff(t, append=t[0] + span) / span)


class GPUMemorySampler:
    """Sample the cluster's RMM (GPU) memory while blocks of work run, like distributed's
    :class:`~distributed.diagnostics.MemorySampler` (how: docs/gpu-memory-tools.md). Needs
    ``RMMPlugin`` (or the preload) on the workers; pandas and matplotlib for :meth:`to_pandas`
    and :meth:`plot`.
    """

    def __init__(self) -> None:
        self.samples: dict[str, GPUSamples] = {}

    def sample(
        self, label: str | None = None, *, client: Client | None = None, interval: float = 0.5
    ) -> Any:
        """Context manager that samples the cluster's RMM memory into ``self.samples[label]``
        (its ``stop`` None until the block ends): ``async with`` with an asynchronous client.

        Parameters
        ----------
        label : str, optional
            Key of the samples (default: a random one). Sampling a label again replaces it.
        client : distributed.Client, optional
            Default: the current client.
        interval : float
            Seconds between two reads of the scheduler's timelines (what a worker killed
            mid-block can lose; the workers sample every ``dask-rmm.metrics.sample-interval``).

        Raises ValueError for an interval that is not a positive number.
        """
        if isinstance(interval, bool) or not isinstance(interval, (int, float)) or interval <= 0:
            raise ValueError(f"interval must be a positive number of seconds, got {interval!r}")
        if client is None:
            client = get_client()
        label = str(label) if label is not None else uuid.uuid4().hex
        if client.asynchronous:
            return self._sample_async(label, client, float(interval))
        return self._sample_sync(label, client, float(interval))

    @contextlib.contextmanager
    def _sample_sync(self, label: str, client: Client, interval: float) -> Iterator[None]:
        # The polls run on the client's event loop (its own thread) while the block runs here.
        sampling = self._sample_async(label, client, interval)
        client.sync(sampling.__aenter__)
        try:
            yield
        finally:
            client.sync(sampling.__aexit__, None, None, None)

    @contextlib.asynccontextmanager
    async def _sample_async(
        self, label: str, client: Client, interval: float
    ) -> AsyncIterator[None]:
        samples = self.samples[label] = GPUSamples(label, start=time.time())
        last: int | None = _FIRST_LAST
        install = True

        async def poll() -> None:
            nonlocal last, install
            while True:
                data = await fetch_report_data(
                    client.scheduler, timeline=True, last=last, install=install
                )
                install = False
                if samples._add_report(data, last) or last is None:
                    return
                last = last * 2 if last < 1 << 16 else None

        await poll()
        done = asyncio.Event()

        async def loop() -> None:
            while True:
                with contextlib.suppress(asyncio.TimeoutError):
                    await asyncio.wait_for(done.wait(), interval)
                    return
                with contextlib.suppress(Exception):  # keep what was read; again at the next tick
                    await poll()

        task = asyncio.ensure_future(loop())
        try:
            yield
        finally:
            done.set()
            await task
            samples.stop = time.time()
            with contextlib.suppress(Exception):
                await client.run(_flush, on_error="ignore")
            with contextlib.suppress(Exception):
                await poll()
            self.samples[label] = samples

    # -- results ----------------------------------------------------------------------------

    def summary(self):
        """One row per label: start, seconds, devices, workers lost, peak and time-weighted
        mean of the bytes in use and reserved, summed over the devices (a pandas DataFrame)."""
        pd = require_pandas("GPUMemorySampler.summary")
        figures = ("peak_used", "mean_used", "peak_reserved", "mean_reserved")
        rows = [
            {
                "label": label,
                "start": pd.to_datetime(s.start, unit="s"),
                "seconds": (s.stop if s.stop is not None else time.time()) - s.start,
                "devices": len(s.devices),
                "workers_lost": len(s.workers_lost),
                **{f"{name}_bytes": getattr(s, name) for name in figures},
            }
            for label, s in self.samples.items()
        ]
        return pd.DataFrame(rows).set_index("label") if rows else pd.DataFrame()

    def to_pandas(self, *, align: bool = False, measure: str = "used", per_worker: bool = False):
        """The samples as a pandas DataFrame, one column per label (``per_worker``: one per
        label and worker device, a two-level column index), bytes summed over the devices.

        Parameters
        ----------
        align : bool
            Index by the time since each label's start (a ``Timedelta``) instead of the time,
            so that several runs line up.
        measure : {"used", "used_max", "reserved"}
            Bytes in use at each sample, the most in use within each sample interval (short
            peaks included), or what the pools held from their devices.
        per_worker : bool
            A column per worker device rather than their sum.
        """
        pd = require_pandas("GPUMemorySampler.to_pandas")
        columns: dict[Any, Any] = {}
        for label, s in self.samples.items():
            parts: list[tuple[Any, list[tuple[float, int]]]]
            if per_worker:
                parts = [
                    ((label, d.label), summed_series([pair]))
                    for d, pair in zip(s.devices.values(), s._series(measure), strict=True)
                ]
            else:
                parts = [(label, s.summed(measure))]
            for key, points in parts:
                if not points:
                    continue
                series = pd.Series(
                    [v for _, v in points],
                    index=pd.to_datetime([t for t, _ in points], unit="s"),
                    dtype="int64",
                )
                if align:
                    series.index = series.index - pd.to_datetime(s.start, unit="s")
                columns[key] = series[~series.index.duplicated(keep="last")]
        df = pd.DataFrame(columns)
        if per_worker and columns:
            df.columns = pd.MultiIndex.from_tuples(list(columns), names=["label", "device"])
        if len(columns) > 1:
            # Hold each column's value between its own samples, never past its last one.
            df = df.ffill().where(~pd.isna(df.bfill()))
        return df

    def plot(
        self,
        *,
        align: bool = False,
        measure: str = "used",
        per_worker: bool = False,
        path: str | None = None,
        ax: Any = None,
        **kwargs: Any,
    ):
        """Plot :meth:`to_pandas` (same arguments) as steps, bytes on a binary axis.

        ``path`` writes a PNG; ``ax`` draws into existing matplotlib axes; ``kwargs`` go to
        :meth:`pandas.DataFrame.plot`. Returns the axes.

        Raises ValueError when there is nothing to draw (no block sampled, or none of the blocks
        saw a dask-rmm worker report this measure) rather than drawing empty axes.
        """
        df = self.to_pandas(align=align, measure=measure, per_worker=per_worker)
        if not len(df.columns):
            if not self.samples:
                raise ValueError(
                    "GPUMemorySampler.plot: nothing sampled yet; sample a block first "
                    "(with sampler.sample('label', client=client): ...)"
                )
            raise ValueError(
                f"GPUMemorySampler.plot: no {measure!r} samples in "
                f"{', '.join(map(repr, self.samples))}: no dask-rmm worker reported during "
                "those blocks (is RMMPlugin registered on the workers?)"
            )
        if ax is None:
            ax = figure("GPUMemorySampler.plot", figsize=(10, 4.5), layout="constrained").subplots()
        if align and len(df.index):
            df.index = df.index.total_seconds()
        df.plot(ax=ax, drawstyle="steps-post", **kwargs)
        byte_axis(ax.yaxis, float(df.max().max()))
        ax.set_ylim(bottom=0)
        ax.set_ylabel(f"RMM bytes {MEASURES[measure]}")
        ax.set_xlabel("seconds since each label's start" if align else "time")
        ax.grid(alpha=0.3)
        if path is not None:
            save_figure(ax.figure, path, dpi=100)
        return ax

    def __repr__(self) -> str:
        parts = [
            f"{label}: peak {format_bytes(s.peak_used)} used, {format_bytes(s.peak_reserved)} "
            "reserved"
            for label, s in self.samples.items()
        ]
        return f"<GPUMemorySampler {'; '.join(parts) or 'no samples'}>"


async def _flush(dask_worker: Any = None) -> None:
    """On a worker: take a sample now (it holds the most used since the last one) and send
    its metrics at once, returning once the scheduler read them: the block's end is on the scheduler."""
    metrics = getattr(dask_worker.plugins.get("dask-rmm"), "worker_metrics", None)
    if metrics is not None:
        metrics.sample()
    await send_metrics(dask_worker)
