"""Synthetic ``worker.metrics["dask-rmm"]`` callables in the heartbeat format (``dask_rmm.wire``),
for driving the scheduler plugin without RMMPlugin or a GPU."""

from __future__ import annotations

import time

from dask_rmm.wire import heartbeat, pack_samples


class FakeDevice:
    """Counters of one device that a test moves by hand."""

    def __init__(self, reserved: int = 1 << 20):
        self.current = self.current_count = self.peak = self.peak_count = 0
        self.total = self.total_count = self.failures = 0
        self.reserved = reserved
        self.largest_free = reserved
        self.task_groups: dict[str, list[int]] = {}
        self.samples: list[list] = []
        self.error: str | None = None
        #: more wire fields, sent as they are (newer fields a test sets by hand)
        self.extra: dict = {}

    def allocate(self, nbytes: int, group: str = "task") -> None:
        self.current += nbytes
        self.current_count += 1
        self.total += nbytes
        self.total_count += 1
        self.peak = max(self.peak, self.current)
        self.peak_count = max(self.peak_count, self.current_count)
        g = self.task_groups.setdefault(group, [0, 0])
        g[0] += nbytes
        g[1] = max(g[1], g[0])
        self._sample()

    def free(self, nbytes: int, group: str = "task") -> None:
        self.current -= nbytes
        self.current_count -= 1
        self.task_groups[group][0] -= nbytes
        self._sample()

    def _sample(self) -> None:
        last = self.samples[-1][0] if self.samples else 0.0
        self.samples.append([max(time.time(), last + 1e-6), self.current, self.current])

    def snapshot(self) -> dict:
        # Like WorkerMetrics: this heartbeat's samples after the previous heartbeat's.
        batch, self.samples = self.samples, []
        samples, self.previous_batch = getattr(self, "previous_batch", []) + batch, batch
        out = {
            "current_bytes": self.current,
            "current_count": self.current_count,
            "peak_bytes": self.peak,
            "peak_count": self.peak_count,
            "total_bytes": self.total,
            "total_count": self.total_count,
            "reserved_bytes": self.reserved,
            "pool_free_bytes": self.reserved - self.current,
            "largest_free_block": min(self.largest_free, self.reserved - self.current),
            "failed_allocations": self.failures,
            "device_used_bytes": 0,
            "device_total_bytes": 0,
            "resource": "StatisticsResourceAdaptor>PoolMemoryResource>SystemMemoryResource",
            "task_groups": sorted(
                ([k, v[0], v[1]] for k, v in self.task_groups.items()), key=lambda g: -g[2]
            ),
            "samples": pack_samples(samples),
        }
        out.update(self.extra)
        if self.error:
            out["error"] = self.error
        return out


class FakeRMMMetrics:
    """``worker.metrics["dask-rmm"] = FakeRMMMetrics()``: returns the contract dict each heartbeat."""

    def __init__(self, devices: tuple[str, ...] = ("0",)):
        self.devices = {d: FakeDevice() for d in devices}
        self.calls = 0

    def __getitem__(self, device: str) -> FakeDevice:
        return self.devices[device]

    def __call__(self, worker) -> dict:
        self.calls += 1
        devices = {d: dev.snapshot() for d, dev in self.devices.items()}
        return heartbeat(str(worker.name), time.time(), devices)


class SimulatedCluster:
    """Heartbeat metrics of ``workers`` x ``devices`` simulated devices, fed straight to a
    SchedulerTimelinePlugin (no Worker objects), and every sample they sent: the full
    resolution the report is checked against."""

    def __init__(self, workers: int, devices: int, seed: int = 0):
        import random

        self.rng = random.Random(seed)
        self.workers = [
            type("SimulatedWorker", (), {})() for _ in range(workers)
        ]  # what _ingest reads of a WorkerState: address, name, metrics
        for i, ws in enumerate(self.workers):
            ws.address, ws.name, ws.metrics = (
                f"tcp://10.{i // 250}.{i % 250}.1:4000",
                f"sim-{i}",
                {},
            )
        self.devices = [str(d) for d in range(devices)]
        self.raw = {(w.address, d): [] for w in self.workers for d in self.devices}
        self._previous = {k: [] for k in self.raw}
        self._clock = {k: 1e9 + self.rng.random() for k in self.raw}

    def beat(self, plugin, samples: int) -> None:
        """Every worker sends a heartbeat with ``samples`` new samples a device."""
        for ws in self.workers:
            devices = {}
            for d in self.devices:
                key = (ws.address, d)
                batch = []
                for _ in range(samples):
                    self._clock[key] += 0.1
                    current = self.rng.randrange(1 << 30)
                    batch.append([self._clock[key], current, current + self.rng.randrange(1 << 28)])
                self.raw[key] += batch
                rows = self._previous[key] + batch
                self._previous[key] = batch
                last = batch[-1] if batch else [0, 0, 0]
                devices[d] = {
                    "current_bytes": last[1],
                    "peak_bytes": max(s[2] for s in self.raw[key]) if self.raw[key] else 0,
                    "reserved_bytes": 2 << 30,
                    "pool_free_bytes": (2 << 30) - last[1],
                    "largest_free_block": (1 << 30) - last[1] // 2,
                    "gpu_name": "Simulated GPU",
                    "samples": pack_samples(rows),
                }
            ws.metrics = {"dask-rmm": heartbeat(ws.name, self._clock[key], devices)}
            ws.last_seen = self._clock[key]  # as the scheduler sets it when a heartbeat arrives
            plugin._ingest(ws)
