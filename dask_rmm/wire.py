"""The heartbeat and report format: the only place its key, versions and field names are defined
(docs/reports.md). To add a per-device field, add it to :class:`DeviceSample` with a default (a
heartbeat leaves out the fields at theirs; ``_exported(...)`` also exports it to Prometheus). No
Dask, no CUDA here."""

from __future__ import annotations

import dataclasses
import struct
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from itertools import compress
from typing import Any, NamedTuple

__all__ = [
    "METRICS_KEY",
    "METRICS_VERSION",
    "NUMBERS",
    "NUMBERS_STRUCT",
    "TEXTS",
    "PLUGIN_NAME",
    "METRICS_HANDLER",
    "REPORT_HANDLER",
    "REPORT_VERSION",
    "SAMPLE_FIELDS",
    "SAMPLE_STRUCT",
    "NOT_MEASURED_WITHOUT_A_POOL",
    "ROW_FIELDS",
    "STATISTICS_ONLY",
    "DeviceSample",
    "LibraryShare",
    "TaskGroup",
    "device_entries",
    "fragmentation",
    "heartbeat",
    "pack_samples",
    "to_int",
    "unmeasured_fields",
    "unpack_samples",
]


def fragmentation(reserved_bytes: int, free_bytes: int, largest_free_block: int) -> float | None:
    """How much of a pool's free memory is in pieces: ``1 - largest free block / free bytes``,
    the one definition (reports, Prometheus, sorting, advice, ``ReservedMemoryInfo``).

    None when none of the pool is in use (``reserved_bytes <= free_bytes``): its free pieces are
    then the separate blocks it took from upstream, which no allocation split, and there is
    nothing to call fragmented. 0.0 when nothing is free.

    Examples
    --------
    >>> fragmentation(256 << 20, 256 << 20, 128 << 20) is None  # two free chunks, none in use
    True
    >>> fragmentation(256 << 20, 128 << 20, 32 << 20)  # half in use, free in 32 MiB pieces
    0.75
    """
    if reserved_bytes <= free_bytes:
        return None
    if free_bytes <= 0:
        return 0.0
    return min(1.0, max(0.0, 1.0 - largest_free_block / free_bytes))


#: Key of the heartbeat metrics in ``worker.metrics`` (and so in ``WorkerState.metrics``).
METRICS_KEY = "dask-rmm"
#: Version of the heartbeat dict: the scheduler reads this one only (another is one clear line
#: in the report and the log); readers ignore the fields they do not know. 4: columns.
METRICS_VERSION = 4
#: Version of the report document (``ClusterMemoryReport.to_dict``, report.json, ``--json``).
REPORT_VERSION = 2
#: Name of the scheduler plugin that keeps the timelines (its key in ``Scheduler.plugins``).
PLUGIN_NAME = "dask-rmm-timeline"
#: Scheduler RPC handler that returns the report document.
REPORT_HANDLER = "dask_rmm_report"
#: The scheduler handler a worker sends its ``METRICS_KEY`` entry to at once (``send_metrics``).
METRICS_HANDLER = "dask_rmm_metrics"
#: One timeline sample: ``[time, current_bytes, max_bytes_in_interval]``.
SAMPLE_FIELDS = ("time", "current_bytes", "max_bytes_in_interval")
#: One packed sample: little-endian float64 time, int64 current bytes, int64 max bytes.
SAMPLE_STRUCT = struct.Struct("<dqq")


class TaskGroup(NamedTuple):
    """Bytes one task group (key prefix) holds on one worker device, now and at its peak."""

    prefix: str
    current_bytes: int
    peak_bytes: int


class LibraryShare(NamedTuple):
    """What one library holds on one worker device: bytes in its objects (arrays, tensors),
    bytes held free in its cache, and whether they come from the stack (in ``current_bytes``:
    CuPy's, compiled RMM's caches) or beside it (``outside_stack``: PyTorch's caching
    allocator, within the room the pool's maximum leaves)."""

    library: str
    in_use_bytes: int
    cached_bytes: int
    outside_stack: bool = False

    @property
    def held_bytes(self) -> int:
        return self.in_use_bytes + self.cached_bytes


def _exported(name: str, help: str, kind: str = "gauge") -> Any:
    """An int field (default 0) that Prometheus exports as ``name``."""
    return field(default=0, metadata={"gauge": name, "help": help, "kind": kind})


@dataclass(frozen=True)
class DeviceSample:
    """One worker device's memory at one heartbeat (the ``devices[id]`` entry of the heartbeat).

    ``retired_bytes`` counts buffers still alive in stacks that a re-registration replaced
    (they are not in ``current_bytes`` any more). ``library_cached_bytes`` is the part of
    ``current_bytes`` that library caches hold free (``in_array_bytes`` is the rest). ``gpu_*`` name the physical device (under
    dask-cuda every worker's device id is 0); on host memory ``gpu_name`` is ``"host"``.
    """

    resource: str = ""
    #: Where the figures come from: ``"statistics"`` (a StatisticsResourceAdaptor counts every
    #: allocation), ``"pool"`` (``statistics=False`` over a pool: ``current_bytes`` is the
    #: pool's reserved minus its free bytes; the :data:`STATISTICS_ONLY` figures and task groups
    #: are not measured) or ``"none"`` (``statistics=False`` without a pool: nothing is).
    measured: str = "statistics"
    current_bytes: int = _exported("dask_rmm_used_bytes", "Bytes allocated through RMM now")
    current_count: int = 0
    peak_bytes: int = _exported(
        "dask_rmm_peak_bytes",
        "Most bytes allocated at once (on the scheduler: since it first saw the worker's name)",
    )
    peak_count: int = 0
    total_bytes: int = 0
    total_count: int = 0
    failed_allocations: int = _exported(
        "dask_rmm_failed_allocations", "Allocations whose upstream raised", "counter"
    )
    reserved_bytes: int = _exported(
        "dask_rmm_reserved_bytes", "Bytes the pool holds from its upstream"
    )
    pool_free_bytes: int = _exported("dask_rmm_pool_free_bytes", "Bytes free inside the pool")
    largest_free_block: int = _exported(
        "dask_rmm_largest_free_block_bytes", "Largest free block in the pool"
    )
    retired_bytes: int = _exported(
        "dask_rmm_retired_bytes", "Bytes still held in stacks replaced by a re-registration"
    )
    #: Of ``current_bytes``: free bytes that library caches in front of the stack (CuPy's
    #: MemoryPool, compiled RMM's pool) hold, in no array. In arrays: the difference.
    library_cached_bytes: int = _exported(
        "dask_rmm_library_cached_bytes",
        "Of dask_rmm_used_bytes, bytes held free in library caches (CuPy's, compiled RMM's pool)",
    )
    #: The libraries whose caches draw from this stack, comma-separated ("cupy,rmm"); with
    #: one, statistics and task groups count the caches' blocks, not each array.
    library_caches: str = ""
    #: Bytes libraries hold beside the stack (PyTorch's reserved bytes), not in ``current_bytes``.
    library_outside_bytes: int = _exported(
        "dask_rmm_library_outside_bytes",
        "Bytes library caches hold beside the stack (PyTorch's caching allocator)",
    )
    #: Per library: in its objects and held free (:class:`LibraryShare`); absent from old workers.
    libraries: tuple[LibraryShare, ...] = ()
    #: The device's used memory (cudaMemGetInfo: total - free; 0 on host memory).
    device_used_bytes: int = _exported(
        "dask_rmm_device_used_bytes", "Device memory in use, by anything (0 on host memory)"
    )
    device_total_bytes: int = _exported(
        "dask_rmm_device_total_bytes", "Total device memory (0 on host memory)"
    )
    #: The device memory the worker's process uses, per the driver (NVML's running compute
    #: processes; 0 where it cannot tell: host memory, MIG, a container hiding PIDs).
    process_used_bytes: int = _exported(
        "dask_rmm_process_device_bytes", "Device memory the worker's process uses (NVML)"
    )
    #: cuDF's buffers on host now, and those on the device it could spill (its spill manager;
    #: 0 without cuDF's spilling).
    cudf_spilled_bytes: int = _exported(
        "dask_rmm_cudf_spilled_bytes", "Bytes of cuDF's buffers spilled to host now"
    )
    cudf_spillable_bytes: int = _exported(
        "dask_rmm_cudf_spillable_bytes", "Bytes of cuDF's buffers on the device it could spill"
    )
    gpu_name: str = ""
    gpu_uuid: str = ""
    pci_bus_id: str = ""
    #: Largest peak first.
    task_groups: tuple[TaskGroup, ...] = ()
    # Memory pressure (dask_rmm.pressure; zero without device_memory_limit / spill_on_oom).
    spilled_bytes: int = _exported("dask_rmm_spilled_bytes", "Device bytes of outputs on host now")
    spilled_count: int = 0
    total_spilled_bytes: int = _exported("dask_rmm_spill_bytes", "Bytes spilled to host", "counter")
    total_spilled_count: int = 0
    total_unspilled_bytes: int = _exported(
        "dask_rmm_unspill_bytes", "Bytes brought back to the device", "counter"
    )
    total_unspilled_count: int = 0
    spill_seconds: float = 0.0
    unspill_seconds: float = 0.0
    ooms_avoided: int = _exported(
        "dask_rmm_ooms_avoided", "Failed allocations served after spilling", "counter"
    )
    oom_count: int = _exported(
        "dask_rmm_oom_events", "OutOfMemoryErrors that reached a task", "counter"
    )
    pauses: int = _exported("dask_rmm_pauses", "Pauses for device memory", "counter")
    paused: int = _exported("dask_rmm_paused", "1 while paused for device memory")
    device_memory_limit: int = _exported(
        "dask_rmm_device_memory_limit_bytes", "device_memory_limit (0: none)"
    )
    #: Tasks that raised an out-of-memory error and ran once more after room was made.
    task_retries: int = _exported(
        "dask_rmm_task_oom_retries", "Tasks run again after an out-of-memory error", "counter"
    )
    task_retries_succeeded: int = 0
    #: Memory admission (dask_rmm.pressure.admission; per worker, on its first device only):
    #: tasks held back now and since setup, seconds they waited in all and the longest wait.
    admission_held_tasks: int = _exported(
        "dask_rmm_admission_held_tasks", "Tasks held back by memory admission now"
    )
    admission_total_held: int = _exported(
        "dask_rmm_admission_held_total", "Tasks that waited for memory admission", "counter"
    )
    admission_wait_seconds: float = 0.0
    admission_longest_wait_seconds: float = 0.0
    #: Expected peak per task prefix: ``(prefix, bytes, observations)``, largest first.
    admission_expected_peaks: tuple[tuple[str, int, int], ...] = ()
    #: The last OOM snapshots (``dask_rmm.pressure.OOMEvent.to_dict()``), oldest first.
    oom_events: tuple[dict, ...] = ()
    error: str | None = None

    @property
    def unmeasured(self) -> tuple[str, ...]:
        """The fields this device did not measure (see ``measured``): their 0 means "n/a"."""
        return unmeasured_fields(self.measured)

    @property
    def in_array_bytes(self) -> int:
        """``current_bytes`` less what library caches hold free: bytes in arrays."""
        return max(0, (self.current_bytes or 0) - self.library_cached_bytes)

    @property
    def direct_bytes(self) -> int:
        """Of ``current_bytes``, what no library cache in front of the stack drew: DeviceBuffers,
        Numba arrays and the exact per-allocation paths."""
        drawn = sum(x.held_bytes for x in self.libraries if not x.outside_stack)
        return max(0, (self.current_bytes or 0) - drawn)

    @property
    def outside_dask_rmm_bytes(self) -> int | None:
        """Device memory of the worker's process that neither the stack nor the libraries beside
        it hold (CUDA contexts, cuBLAS/cuDNN workspaces, unknown libraries), measured: the
        process's device memory per the driver less the stack's reserved bytes, the libraries'
        outside the stack, and retired stacks'. Where the driver cannot tell the process's
        (:attr:`outside_measured` False), the device's used memory less those: other processes
        included. None without a device figure (host memory, or an old worker)."""
        if self.device_total_bytes <= 0:
            return None
        held = (self.reserved_bytes or 0) + self.library_outside_bytes + self.retired_bytes
        used = self.process_used_bytes if self.outside_measured else self.device_used_bytes
        return max(0, used - held)

    @property
    def outside_measured(self) -> bool:
        """Whether :attr:`outside_dask_rmm_bytes` is measured per process (the driver told)."""
        return self.device_total_bytes > 0 and self.process_used_bytes > 0

    def breakdown(self) -> list[tuple[str, int]]:
        """Where this device's bytes are, as ``(part, bytes)``: each library's in use and held
        free (stack libraries first), other allocations through the stack, the pool's free
        bytes, retired stacks, and (with a device figure) memory outside dask-rmm. With a device
        figure the parts add up to ``device_used_bytes`` (unless the figures, read at slightly
        different moments, disagree by more than the outside part)."""
        libs = sorted(self.libraries, key=lambda x: (x.outside_stack, x.library))
        parts: list[tuple[str, int]] = []
        for x in libs:
            parts.append((f"{x.library} in use", x.in_use_bytes))
            parts.append((f"{x.library} cache free", x.cached_bytes))
        parts.append(("other allocations", self.direct_bytes))
        parts.append(("pool free", max(0, (self.reserved_bytes or 0) - (self.current_bytes or 0))))
        if self.retired_bytes:
            parts.append(("retired stacks", self.retired_bytes))
        outside = self.outside_dask_rmm_bytes
        if outside is not None and self.outside_measured:
            parts.append(("outside dask-rmm (measured)", outside))
            parts.append(
                ("other processes", max(0, self.device_used_bytes - self.process_used_bytes))
            )
        elif outside is not None:
            parts.append(("outside dask-rmm", outside))
        return parts

    @property
    def fragmentation(self) -> float | None:
        """:func:`fragmentation` of this device's pool (None: nothing of it in use)."""
        sizes = (self.reserved_bytes, self.pool_free_bytes, self.largest_free_block)
        return fragmentation(*(n or 0 for n in sizes))  # None (not measured) as 0: None

    def to_dict(self) -> dict[str, Any]:
        """Plain data: every field, with ``fragmentation`` for readers without this class (the
        report document)."""
        out = {f.name: getattr(self, f.name) for f in _FIELDS if f.name != "error"}
        out["task_groups"] = [list(g) for g in self.task_groups or ()]
        out["libraries"] = [
            [x.library, x.in_use_bytes, x.cached_bytes, int(x.outside_stack)]
            for x in self.libraries
        ]
        out["oom_events"] = [dict(e) for e in self.oom_events]
        out["admission_expected_peaks"] = [list(p) for p in self.admission_expected_peaks]
        if self.error:
            out["error"] = self.error
        out["fragmentation"] = self.fragmentation
        return out

    @classmethod
    def from_dict(cls, d: Mapping[str, Any], **extra: Any) -> Any:
        """Read a wire entry; missing or malformed fields take their default, unknown ones are
        ignored (``extra`` sets the fields of a subclass)."""
        values = {k: _READERS[k](v) for k, v in d.items() if k in _READERS}
        events = tuple(dict(e) for e in _sequence(d.get("oom_events")) if isinstance(e, Mapping))
        return cls(
            **values,
            task_groups=_read_rows(d, "task_groups", TaskGroup),
            libraries=_read_rows(d, "libraries", lambda n, u, c, o: LibraryShare(n, u, c, bool(o))),
            oom_events=events,
            admission_expected_peaks=_read_rows(d, "admission_expected_peaks", lambda *p: p),
            error=str(d["error"]) if d.get("error") else None,
            **extra,
        )


_FIELDS = dataclasses.fields(DeviceSample)
#: How each scalar field is read from the wire (never raising), by name.
_READERS = {
    f.name: {
        "int": lambda v: to_int(v),
        "float": lambda v: to_int(v, float),
        "str": lambda v: "" if v is None else str(v),
    }[f.type]
    for f in _FIELDS
    if f.type in ("int", "float", "str")
}
_DEFAULTS = {f.name: f.default for f in _FIELDS}


#: The fields that are lists of rows, and each row's width (a str, then numbers); a heartbeat
#: sends each as columns (:func:`heartbeat`).
ROW_FIELDS = {"task_groups": 3, "libraries": 4, "admission_expected_peaks": 3}


#: Fields exported to Prometheus: ``(field name, metric name, help, "gauge" or "counter")``.
GAUGES = tuple(
    (f.name, f.metadata["gauge"], f.metadata["help"], f.metadata["kind"])
    for f in _FIELDS
    if "gauge" in f.metadata
)
#: The figures only a StatisticsResourceAdaptor measures: with ``statistics=False`` they are
#: not measured (0: left out of the heartbeat; "n/a" in the report, None in its JSON, absent in
#: Prometheus).
STATISTICS_ONLY = (
    "current_count", "peak_bytes", "peak_count", "total_bytes", "total_count",
    "failed_allocations",
)  # fmt: skip

#: What ``statistics=False`` without a pool does not measure either.
NOT_MEASURED_WITHOUT_A_POOL = (
    "current_bytes", "reserved_bytes", "pool_free_bytes", "largest_free_block",
)  # fmt: skip


def unmeasured_fields(measured: Any) -> tuple[str, ...]:
    """The fields a device whose ``measured`` is this did not measure (``()``: all measured)."""
    if measured == "pool":
        return STATISTICS_ONLY
    if measured == "none":
        return (*STATISTICS_ONLY, *NOT_MEASURED_WITHOUT_A_POOL)
    return ()


#: The integer fields, in order (table, DataFrame and totals columns).
COUNTERS = tuple(f.name for f in _FIELDS if f.type == "int")
#: A heartbeat's columns of numbers (a record a device, int64 and float64) and of text.
NUMBERS = tuple(f.name for f in _FIELDS if f.type in ("int", "float"))
_KINDS = [float if f.type == "float" else int for f in _FIELDS if f.type in ("int", "float")]
NUMBERS_STRUCT = struct.Struct("<" + "".join("d" if k is float else "q" for k in _KINDS))
TEXTS = tuple(f.name for f in _FIELDS if f.type == "str")
_NAMED = (*NUMBERS, *TEXTS, "samples")
_COLUMNS = frozenset({*NUMBERS, *TEXTS, *ROW_FIELDS, "samples", "fragmentation"})


def heartbeat(worker: str | int, time: float, devices: Mapping[str, Mapping[str, Any]]) -> dict:
    """The heartbeat of ``devices`` (an id to ``DeviceSample.to_dict()`` and ``samples``, the
    previous and this heartbeat's rows by :func:`pack_samples`), a field a column (the scheduler
    checks a column at once): ids, a :data:`NUMBERS` record and :data:`TEXTS` a device, samples,
    each :data:`ROW_FIELDS` field ``[rows a device, names, int64 numbers]``, ``other`` by id."""
    entries = list(devices.values())
    out: dict[str, Any] = {"version": METRICS_VERSION, "time": time, "worker": worker,
        "devices": list(devices), "numbers": b"".join(map(_packed, entries)),
        "text": [str(d.get(k) or _DEFAULTS[k]) for d in entries for k in TEXTS],
        "samples": [d.get("samples") or b"" for d in entries]}  # fmt: skip
    for k, width in ROW_FIELDS.items():
        rows = [[r for r in _sequence(d.get(k)) if _row(r, width)] for d in entries]
        if any(rows):
            flat = [_int64(to_int(x)) for rs in rows for r in rs for x in r[1:width]]
            names = [str(r[0]) for rs in rows for r in rs]
            out[k] = [list(map(len, rows)), names, struct.pack(f"<{len(flat)}q", *flat)]
    other = {i: {k: v for k, v in d.items() if k not in _COLUMNS and v} for i, d in devices.items()}
    if any(other.values()):
        out["other"] = {dev: d for dev, d in other.items() if d}
    return out


def device_entries(m: Any) -> dict[str, dict[str, Any]]:
    """The devices of a :func:`heartbeat` (or of one the scheduler kept) a dict each, fields at
    0 or empty left out, as :meth:`DeviceSample.from_dict` reads it; ``{}`` for none."""
    if not isinstance(m, Mapping) or type(m.get("devices")) not in (list, tuple):
        return {}
    ids, w, text, out = m["devices"], len(TEXTS), m["text"], {}
    numbers = NUMBERS_STRUCT.iter_unpack(m["numbers"])
    for i, (dev, values, blob) in enumerate(zip(ids, numbers, m["samples"], strict=True)):
        values += (*text[i * w : i * w + w], blob)
        out[dev] = dict(compress(zip(_NAMED, values, strict=True), values))
    for k, width in ROW_FIELDS.items():
        if k in m:  # rows as tuples, made by zip (a few C calls, not a few a row)
            counts, names, blob = m[k]
            flat = struct.unpack(f"<{len(blob) // 8}q", blob)
            rows = list(zip(names, *(flat[i :: width - 1] for i in range(width - 1)), strict=True))
            for d, n in zip(out.values(), counts, strict=True):
                d[k], rows = rows[:n], rows[n:]
    for dev, d in (m.get("other") or {}).items():
        out[dev].update(d)  # the scheduler keeps only those of its devices
    return out


def _packed(d: Mapping[str, Any]) -> bytes:
    values = map(to_int, [d.get(k, 0) for k in NUMBERS], _KINDS)
    return NUMBERS_STRUCT.pack(*map(_int64, values))


def _row(r: Any, width: int) -> bool:
    return type(r) in (list, tuple) and len(r) >= width


def _int64(v: Any) -> Any:
    return v if type(v) is float else max(-(1 << 63), min(v, (1 << 63) - 1))


def pack_samples(rows: Sequence[Sequence[float]]) -> bytes:
    """``[time, current_bytes, max_bytes_in_interval]`` rows, oldest first, as the heartbeat's
    packed ``samples``: one :data:`SAMPLE_STRUCT` record a row (24 bytes; the scheduler appends
    them to its timelines without making a Python object per sample)."""
    if not rows:
        return b""
    flat = [v for r in rows for v in (r[0], r[1], r[2])]
    try:
        return struct.pack("<" + "dqq" * len(rows), *flat)
    except struct.error as e:  # a time that is no number, bytes that are no integer
        raise TypeError(f"malformed samples (need [time, int, int] rows): {e}") from None


def unpack_samples(blob: bytes) -> list[list[float | int]]:
    """The rows :func:`pack_samples` packed (a trailing partial record raises ValueError)."""
    if len(blob) % SAMPLE_STRUCT.size:
        raise ValueError(
            f"packed samples are {len(blob)} bytes, not a multiple of {SAMPLE_STRUCT.size}"
        )
    return [list(r) for r in SAMPLE_STRUCT.iter_unpack(blob)]


def _read_rows(d: Mapping[str, Any], key: str, make: Any) -> tuple:
    """The rows (lists) of :data:`ROW_FIELDS` field ``key``, each ``make(str, int, ...)``: a row
    no list or too short skipped, a number that is none read as 0."""
    width = ROW_FIELDS[key]
    rows = [r for r in _sequence(d.get(key)) if _row(r, width)]
    return tuple(make(str(r[0]), *map(to_int, r[1:width])) for r in rows)


def _sequence(value: Any) -> Any:
    """``value`` if it is a list or tuple, else ``()`` (a reader of the wire never raises)."""
    return value if type(value) in (list, tuple) else ()


def to_int(value: Any, kind: type = int) -> Any:
    """``kind(value)`` (int, or float), or 0 when the value is missing or malformed (the wire
    never raises)."""
    try:
        return kind(value)
    except (TypeError, ValueError, OverflowError):
        return kind(0)
