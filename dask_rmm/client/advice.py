"""Sizing advice (``dask rmm advise``): ``pool_size``, ``maximum_pool_size`` and allocator per
worker device, each with its reason, from allocation logs or a cluster report. Not here: reading
logs and replaying them (:mod:`dask_rmm.logs`).
"""

from __future__ import annotations

import os
from collections.abc import Iterable, Sequence
from dataclasses import asdict, dataclass, field, replace
from typing import TYPE_CHECKING, Any

from dask_rmm.report.memory_report import visible
from dask_rmm.sizes import align_up, format_bytes

if TYPE_CHECKING:
    from dask_rmm.report.memory_report import ClusterMemoryReport, DeviceMemory

__all__ = [
    "Advice",
    "advise_from_logs",
    "advise_from_report",
    "combine",
    "format_advice",
    "nice_size",
    "size_text",
]

#: Pool sizes replayed, as multiples of the log's peak in use; the first that serves every
#: allocation is the pool the workload needs.
CANDIDATE_FACTORS = (1.0625, 1.125, 1.25, 1.5, 2.0, 3.0, 4.0)
#: A workload whose smallest sufficient pool is more than this times its peak in use fragments.
FRAGMENTING = 1.25
#: Room kept above what the workload needed, as a fraction of its peak.
HEADROOM = 0.10
#: Share of the device a pool may grow to (the rest: CUDA context, libraries outside RMM).
DEVICE_SHARE = 0.90
#: What :attr:`Advice.replays` keeps of each replay.
_REPLAYED = ("new_failures", "peak_upstream_bytes", "host_memory")


@dataclass(frozen=True)
class Advice:
    """Recommended settings for one worker device (or, :func:`combine`, for all), with reasons.

    ``required_pool_bytes`` is the smallest pool that served every allocation of the replayed
    log (None: not replayed, or none of the candidates did); ``allocator`` is ``"pool"`` (a
    ``PoolMemoryResource``) or ``"async"`` (cudaMallocAsync, ``async_alloc=True``).
    """

    source: str
    peak_bytes: int
    allocator: str = "pool"
    pool_size: int = 0
    maximum_pool_size: int | None = None
    reasons: dict[str, str] = field(default_factory=dict)
    fragmenting: bool = False
    required_pool_bytes: int | None = None
    device_total_bytes: int = 0
    notes: tuple[str, ...] = ()
    replays: tuple[dict[str, Any], ...] = field(default=())
    #: the base resource the advice is for when it is not the default ``"cuda"``: ``"system"``
    #: for host-memory workers, whose pasted setup must say so (a host without a GPU refuses
    #: the default)
    base_resource: str | None = None

    def plugin_args(self) -> dict[str, Any]:
        """The ``RMMPlugin`` keyword arguments (sizes as strings)."""
        args: dict[str, Any] = {"pool_size": size_text(self.pool_size)}
        if self.base_resource is not None:
            args["base_resource"] = self.base_resource
        if self.maximum_pool_size is not None:
            args["maximum_pool_size"] = size_text(self.maximum_pool_size)
        if self.allocator == "async":
            args["async_alloc"] = True
        return args

    def plugin_call(self) -> str:
        """``RMMPlugin(...)`` to paste."""
        return "RMMPlugin(" + ", ".join(f"{k}={v!r}" for k, v in self.plugin_args().items()) + ")"

    def worker_flags(self) -> str:
        """The ``dask worker --preload dask_rmm.preload`` flags to paste (dask-cuda's names)."""
        from dask_rmm.preload import _PARAMS  # option -> the flag's parameter name

        flags = [("--" + _PARAMS[k].replace("_", "-"), v) for k, v in self.plugin_args().items()]
        return " ".join(flag if v is True else f"{flag} {v}" for flag, v in flags)

    def to_dict(self) -> dict[str, Any]:
        pasted = {"plugin_args": self.plugin_args(), "plugin_call": self.plugin_call()}
        return asdict(self) | pasted | {"worker_flags": self.worker_flags()}


def nice_size(nbytes: float) -> int:
    """``nbytes`` (at least 1 MiB) rounded up to a size that reads well: a multiple of an eighth
    of its power of two, at most 12.5 % more."""
    n = max(int(nbytes), 1 << 20)
    step = 1 << (n.bit_length() - 4)
    return -(-n // step) * step


def size_text(nbytes: int) -> str:
    """``"4GiB"``, ``"1536MiB"``, or bytes: a size the options parse back exactly."""
    for unit, shift in (("GiB", 30), ("MiB", 20), ("KiB", 10)):
        if nbytes and nbytes % (1 << shift) == 0:
            return f"{nbytes >> shift}{unit}"
    return str(nbytes)


def _maximum(pool_size: int, device_total: int) -> tuple[int | None, str]:
    if device_total <= 0:
        return None, (
            "not advised: the device's size is unknown (host memory, or logs: give "
            "--device-memory); the pool may grow as far as its upstream lets it"
        )
    cap = int(device_total * DEVICE_SHARE) // (1 << 20) << 20
    if cap <= pool_size:
        return pool_size, (
            f"the pool already takes {pool_size / device_total:.0%} of the device "
            f"({format_bytes(device_total)}): no room to grow beyond it; consider "
            "device_memory_limit= and spill_on_oom=True (docs/memory-pressure.md)"
        )
    return cap, (
        f"{DEVICE_SHARE:.0%} of the device ({format_bytes(device_total)}): the pool may grow for "
        "a larger run, leaving room for the CUDA context and libraries that allocate outside RMM"
    )


def _decide(facts: Advice, evidence: str, on_device: bool, required_what: str = "") -> Advice:
    """``facts`` (the peak, the pool the workload needs, the fragmentation) with the allocator,
    the pool's sizes and their reasons; ``required_what`` says where the needed pool comes from."""
    peak, required, fragmenting = facts.peak_bytes, facts.required_pool_bytes, facts.fragmenting
    required_what = required_what or "the smallest replayed pool that served every allocation"
    reasons: dict[str, str] = {}
    notes = list(facts.notes)
    if fragmenting and on_device:
        allocator = "async"
        reasons["allocator"] = (
            f"{evidence}; cudaMallocAsync (async_alloc=True) backs its pool with device pages "
            "mapped on demand, so freed memory in pieces does not force it to grow as a "
            "pool's address range does"
        )
        pool_size = nice_size(peak * (1 + HEADROOM))
        reasons["pool_size"] = (
            f"the peak in use ({format_bytes(peak)}) + {HEADROOM:.0%}: cudaMallocAsync's initial "
            "pool, kept across synchronizations"
        )
        if required is not None:
            notes.append(
                f"with a PoolMemoryResource instead, pool_size={size_text(nice_size(required))}"
                f" ({required_what})"
            )
    else:
        allocator = "pool"
        needed = peak if required is None else required
        pool_size = nice_size(needed + peak * HEADROOM)
        reasons["allocator"] = (
            f"{evidence}; on host memory there is no cudaMallocAsync: a pool sized for it"
            if fragmenting
            else f"{evidence}: a PoolMemoryResource (the fastest here) needs no more than that"
        )
        if required is not None:
            reasons["pool_size"] = (
                f"{required_what} ({format_bytes(required)}, {required / max(peak, 1):.2f}x the "
                f"peak in use) + {HEADROOM:.0%} of the peak: a run like this one never grows the "
                "pool"
            )
        else:
            reasons["pool_size"] = (
                f"the peak in use ({format_bytes(peak)}) + {HEADROOM:.0%}"
                + (" (at least what the pool held)" if fragmenting else "")
                + ": a run like this one never grows the pool"
            )
    maximum, reasons["maximum_pool_size"] = _maximum(pool_size, facts.device_total_bytes)
    return replace(
        facts,
        allocator=allocator,
        pool_size=pool_size,
        maximum_pool_size=maximum,
        reasons=reasons,
        notes=tuple(notes),
    )


def advise_from_logs(
    paths: Sequence[str | os.PathLike] | str | os.PathLike,
    *,
    device_memory: int = 0,
    on_device: bool = True,
    gpu: bool | None = None,
    progress: bool = False,
) -> list[Advice]:
    """Advice for each log (one worker device each), from its peak and replays of it on pools
    of :data:`CANDIDATE_FACTORS` times the peak (docs/gpu-memory-tools.md). ``device_memory``
    (bytes; 0: unknown) bounds ``maximum_pool_size``; ``on_device``: the logs come from GPU
    workers (cudaMallocAsync is an option there); ``gpu`` is :func:`~dask_rmm.logs.replay.replay`'s;
    ``progress`` draws click's progress bar on stderr."""
    from dask_rmm.logs.replay import replay
    from dask_rmm.logs.summary import summarize

    paths = [paths] if isinstance(paths, (str, os.PathLike)) else list(paths)
    out = []
    summaries = summarize(paths, progress=progress).files
    for path, summary in zip(paths, summaries, strict=True):
        peak = summary.peak_bytes
        failed = (
            f"{summary.failures} allocations failed in the original run (not counted in the peak)"
        )
        notes = [failed] if summary.failures else []
        replays: list[dict[str, Any]] = []
        required = None
        if peak > 0:
            for factor in CANDIDATE_FACTORS:
                size = align_up(int(peak * factor))
                sizes: dict[str, Any] = {"initial_pool_size": size, "maximum_pool_size": size}
                r = replay(path, "pool", gpu=gpu, progress=progress, **sizes)
                kept = {k: getattr(r, k) for k in _REPLAYED}
                replays.append({"resource": "pool", "pool_size": size, **kept})
                if not r.failed:
                    required = size
                    break
        if required is None:
            fragmenting = peak > 0
            top = CANDIDATE_FACTORS[-1]
            evidence = (
                f"no replayed pool up to {top:g}x the peak in use ({format_bytes(peak)}) served "
                "every allocation: the workload fragments memory"
            )
        else:
            ratio = required / max(peak, 1)
            fragmenting = ratio > FRAGMENTING
            evidence = f"the workload needs a pool of {ratio:.2f}x its peak in use" + (
                " (fragmentation: freed memory comes back in pieces too small to reuse)"
                if fragmenting
                else ""
            )
        facts = Advice(
            source=summary.name,
            peak_bytes=peak,
            fragmenting=fragmenting,
            required_pool_bytes=required,
            device_total_bytes=device_memory,
            notes=tuple(notes),
            replays=tuple(replays),
            base_resource=None if on_device else "system",
        )
        out.append(_decide(facts, evidence, on_device))
    return out


def advise_from_report(report: ClusterMemoryReport) -> list[Advice]:
    """Advice for each running worker device of a cluster report (no replay): fragmentation is
    an OOM verdict "fragmentation", or fragmentation >= 0.5 with a quarter of the pool free."""
    return [_advise_device(d) for d in report.running]


def _advise_device(d: DeviceMemory) -> Advice:
    peak = max(d.peak_bytes or 0, d.timeline_peak)
    verdicts = [e.get("verdict") for e in d.oom_events]
    notes: list[str] = []
    if d.unmeasured:  # statistics=False: the peak in use is not measured
        peak = d.reserved_bytes if d.measured == "pool" else 0
        notes.append(
            "statistics off (statistics=False): the peak in use is not measured; "
            + (
                f"this advice takes the pool's reserved bytes ({format_bytes(peak)}), at least "
                "the peak while the pool gave nothing back; "
                if d.measured == "pool"
                else "without a pool nothing is; "
            )
            + "register with statistics=True for advice from the real peak"
        )
    frag = d.fragmentation  # None: none of the pool in use, nothing to call fragmented
    pieces = frag is not None and frag >= 0.5 and d.pool_free_bytes * 4 >= d.reserved_bytes
    fragmenting = "fragmentation" in verdicts or pieces
    if "fragmentation" in verdicts:
        evidence = (
            f"{verdicts.count('fragmentation')} out-of-memory error(s) had enough memory free, "
            "in pieces too small (verdict 'fragmentation')"
        )
    elif pieces:
        evidence = (
            f"the pool's free memory is in pieces (fragmentation {frag:.0%}, largest "
            f"free block {format_bytes(d.largest_free_block)} of {format_bytes(d.pool_free_bytes)}"
            " free)"
        )
    else:
        evidence = (
            "no sign of fragmentation ("
            + ("none of the pool in use now" if frag is None else f"fragmentation {frag:.0%} now")
            + ", no OOM with verdict 'fragmentation')"
        )
    if "demand" in verdicts:
        notes.append(
            f"{verdicts.count('demand')} out-of-memory error(s) from demand: the workload "
            "needed more than the pool could get; consider device_memory_limit= and "
            "spill_on_oom=True"
        )
    required = max(d.reserved_bytes or 0, peak) if fragmenting else None
    on_device = d.gpu_name != "host" and d.device_total_bytes > 0
    facts = Advice(
        source=d.label,
        peak_bytes=peak,
        fragmenting=fragmenting,
        required_pool_bytes=required,
        device_total_bytes=d.device_total_bytes,
        notes=tuple(notes),
        base_resource="system" if d.gpu_name == "host" else None,
    )
    return _decide(facts, evidence, on_device, "what the pool grew to for it (its reserved bytes)")


def combine(advices: Iterable[Advice]) -> Advice | None:
    """One setting for every worker (``RMMPlugin`` gives all workers the same options): the
    largest pool, the smallest maximum, cudaMallocAsync when any device needs it."""
    advices = list(advices)
    if not advices:
        return None
    pool = max(a.pool_size for a in advices)
    maximum = min((a.maximum_pool_size for a in advices if a.maximum_pool_size), default=None)
    notes: list[str] = []
    if maximum is not None and maximum < pool:
        notes.append(
            f"the largest pool ({format_bytes(pool)}) exceeds the smallest device's maximum: "
            "set them per worker (dask worker flags) instead"
        )
        maximum = pool
    allocator = "async" if any(a.allocator == "async" for a in advices) else "pool"
    worst = max(advices, key=lambda a: a.pool_size)
    bases = {a.base_resource for a in advices}
    if len(bases) > 1:
        notes.append(
            "some workers run on host memory, some on a GPU: give each its own setup "
            "(--rmm-base-resource system on the host-memory ones)"
        )
    base_resource = bases.pop() if len(bases) == 1 else None
    return Advice(
        source=f"all {len(advices)} worker devices",
        peak_bytes=max(a.peak_bytes for a in advices),
        allocator=allocator,
        pool_size=pool,
        maximum_pool_size=maximum,
        reasons={
            "allocator": "cudaMallocAsync on every worker, as one device needs it"
            if allocator == "async"
            else "every device is served by a pool",
            "pool_size": f"the largest device's advice ({worst.source})",
            "maximum_pool_size": "the smallest device's advice"
            if maximum is not None
            else "no device size known",
        },
        fragmenting=any(a.fragmenting for a in advices),
        device_total_bytes=min((a.device_total_bytes for a in advices), default=0),
        notes=tuple(notes),
        base_resource=base_resource,
    )


def format_advice(advices: Sequence[Advice], *, combined: bool = True) -> str:
    """The advice as text: per worker device, each number with its reason and the arguments to
    paste; then one setting for all of them."""
    blocks = [_format_one(a) for a in advices]
    if combined and len(advices) > 1 and (every := combine(advices)) is not None:
        blocks.append(_format_one(every))
    return "\n\n".join(blocks) if blocks else "no worker devices to advise on"


def _format_one(a: Advice) -> str:
    head = f"{a.source}: peak {format_bytes(a.peak_bytes)} in use"
    if a.device_total_bytes:
        head += f", device {format_bytes(a.device_total_bytes)}"
    maximum = "-" if a.maximum_pool_size is None else size_text(a.maximum_pool_size)
    rows = [
        ("allocator", a.allocator, a.reasons.get("allocator", "")),
        ("pool_size", size_text(a.pool_size), a.reasons.get("pool_size", "")),
        ("maximum_pool_size", maximum, a.reasons.get("maximum_pool_size", "")),
    ]
    lines = [head]
    lines += [f"  {name:<18} {value:<8} {why}" for name, value, why in rows]
    for r in a.replays:
        n = r["new_failures"]
        verdict = f"{n} allocations failed" if n else "served every allocation"
        lines.append(f"  replayed on a pool of {format_bytes(r['pool_size'])}: {verdict}")
    lines += [f"  note: {n}" for n in a.notes]
    lines.append(f"  paste: {a.plugin_call()}")
    lines.append(f"         dask worker ... --preload dask_rmm.preload {a.worker_flags()}")
    return "\n".join(visible(line) for line in lines)  # worker names: in the head, reasons, notes
