"""The bounds on a worker's dask-rmm heartbeat, enforced when the scheduler reads it: counts,
string lengths, nesting and times, so that no worker (a bug, a wrong clock, a hand-made client)
can grow the scheduler's memory, a page's time or a chart's axis without bound.

Types are not checked: every reader takes a device's fields through ``DeviceSample.from_dict`` or
:func:`dask_rmm.wire.to_int`, which never raise. What is beyond a bound is left out (an entry, a
field, a device or a sample), counted, and named in the problems, which the plugin shows as the
worker's error and logs once per worker and kind a minute. Not here: keeping the records
(``timeline.py``).
"""

from __future__ import annotations

import dataclasses
import math
import reprlib
from collections.abc import Mapping
from itertools import chain, compress, islice
from typing import Any, NamedTuple

import numpy as np

from dask_rmm.scheduler.resolution import SAMPLE_DTYPE
from dask_rmm.wire import METRICS_VERSION, SAMPLE_STRUCT, DeviceSample

__all__ = ["MAX_AHEAD", "MAX_DEVICES", "MAX_ENTRIES", "MAX_SAMPLES", "Checked", "check_metrics"]

#: Devices kept of one worker (a host has at most 16 GPUs; dask-cuda gives a worker one).
MAX_DEVICES = 64
#: Fields kept of one device entry (``DeviceSample`` has about 55).
MAX_FIELDS = 128
#: Entries kept of each list a device carries (task groups, libraries, expected peaks), and
#: values in one entry; OOM events kept a device (each plain data, nested at most 3 deep).
MAX_ENTRIES = 64
MAX_ENTRY = 8
MAX_OOM_EVENTS = 16
#: Characters kept of a string (a name, a resource, an error), and of a field name or device id.
MAX_TEXT = 1024
MAX_KEY = 64
#: Samples kept of one device's heartbeat (a worker sends at most 2 x 1000).
MAX_SAMPLES = 8192
#: Largest byte count of a sample (1 PiB): a sum over 8192 devices cannot wrap an int64.
MAX_BYTES = 1 << 50
#: Seconds a sample time may be ahead of the scheduler's clock (later ones are dropped: a worker
#: whose clock is ahead would hold the cluster total back); a heartbeat whose time is off the
#: scheduler's by more than this either way is logged as clock skew.
MAX_AHEAD = 60.0
#: Times before 2000-01-01 or more than a day ahead are no times: dropped and counted.
EARLIEST = 946684800.0
LATEST_AHEAD = 86400.0
_RECORD = SAMPLE_STRUCT.size
#: OOM event fields that renderers read as numbers.
_OOM_NUMBERS = ("time", "requested", "free_bytes", "largest_free_block", "spilled_trying")
_SCALARS = {int, float, bool, type(None)}
_FLAT = {int, float, bool, type(None), str}
_SEQUENCES = {list, tuple}
_STR, _DICT = {str}, {dict}
_is_str = str.__instancecheck__
_CONTAINERS = {list, tuple, dict}
_VALUES = _FLAT | _CONTAINERS | {bytes}
_ENTRIES = _FLAT | _SEQUENCES
#: Field names of this version (a device's; the heartbeat's own).
_KNOWN = frozenset(
    {f.name for f in dataclasses.fields(DeviceSample)} | {"samples", "fragmentation"}
)
_TOP = frozenset({"version", "time", "worker", "devices"})


class Checked(NamedTuple):
    """One heartbeat as bounded: ``metrics`` (None: nothing usable), ``samples`` each device's
    packed samples still to check (:func:`check_samples`), ``problems`` as ``(kind, text)``."""

    metrics: dict | None
    samples: list[tuple[str, bytes]]
    problems: list[tuple[str, str]]


def check_metrics(m: Any, now: float, arrived: float | None = None) -> Checked:
    """``m`` (a worker's ``metrics["dask-rmm"]``) within the bounds; ``now`` is the scheduler's
    clock, ``arrived`` when the heartbeat came (``WorkerState.last_seen``). Never raises."""
    if not isinstance(m, Mapping):
        return Checked(None, [], [("format", f"metrics are {_kind(m)}, not a mapping")])
    version = m.get("version")
    if version != METRICS_VERSION or type(version) is not int:
        return Checked(None, [], [("format", _version_line(version))])
    raw = m.get("devices")
    if not isinstance(raw, Mapping):
        return Checked(None, [], [("format", f"devices are {_kind(raw)}, not a mapping")])
    problems: list[tuple[str, str]] = []
    t = _heartbeat_time(m.get("time"), now, now if arrived is None else arrived, problems)
    devices: dict[str, Any] = {}
    samples: list[tuple[str, bytes]] = []
    fast = _all_within(raw)  # what a worker sends: bounded in a few C calls for every device
    if len(raw) > MAX_DEVICES:
        problems.append(("bounds", f"{len(raw)} devices: the first {MAX_DEVICES} kept"))
    for dev, d in islice(raw.items(), MAX_DEVICES):
        if not fast:
            dev = str(dev) if type(dev) is int else dev
            if type(dev) is not str or not 0 < len(dev) <= MAX_KEY:
                problems.append(("bounds", f"device id {_short(dev)} dropped (no short str)"))
                continue
            if dev in devices:
                problems.append(("format", f"device {dev!r} sent twice (as int and str)"))
                continue
            if not isinstance(d, Mapping):
                problems.append(("format", f"device {dev!r} is {_kind(d)}; dropped"))
                continue
            d = _bound(f"device {dev!r}", d, now, problems)
        blob = d.get("samples")
        if blob and (blob := _packed(dev, blob, problems)):
            samples.append((dev, blob))
        devices[dev] = d
    worker = m.get("worker")
    if m.keys() <= _TOP and (type(worker) is not str or len(worker) <= MAX_TEXT):
        top: Mapping = {"version": version, "worker": worker}
    else:
        top = _bound("the heartbeat", {k: v for k, v in m.items() if k != "devices"}, now, problems)
    return Checked({**top, "time": t, "devices": devices}, samples, problems)


def _all_within(devices: Mapping) -> bool:
    """Every device of a heartbeat within the bounds (ids, fields, strings, list and map
    entries), checked a few C calls at a time for all of them; False sends the heartbeat
    through the field-by-field path (also for OOM events, which :func:`_oom_events` reads)."""
    if not 0 < len(devices) <= MAX_DEVICES or "" in devices:
        return False
    if not _short_texts(devices, MAX_KEY, True):
        return False
    ds = list(devices.values())
    if set(map(type, ds)) != _DICT:
        return False
    if not all(map(_KNOWN.issuperset, ds)) and (
        max(map(len, ds)) > MAX_FIELDS or not _short_texts(list(chain(*ds)), MAX_KEY, True)
    ):
        return False
    values = list(chain.from_iterable(map(dict.values, ds)))
    types = list(map(type, values))
    if not _VALUES.issuperset(types) or not _short_texts(values):
        return False
    if types.count(bytes) > sum(type(d.get("samples")) is bytes for d in ds):
        return False
    containers = list(compress(values, map(_CONTAINERS.__contains__, types)))
    if not containers:
        return True
    if max(map(len, containers)) > MAX_ENTRIES:
        return False
    maps = [c for c in containers if type(c) is dict]
    if maps and not _flat_ok(chain.from_iterable(maps)):
        return False
    entries = list(chain.from_iterable(c.values() if type(c) is dict else c for c in containers))
    types = list(map(type, entries))
    if not _ENTRIES.issuperset(types) or not _short_texts(entries):
        return False
    seqs = list(compress(entries, map(_SEQUENCES.__contains__, types)))
    return not seqs or (max(map(len, seqs)) <= MAX_ENTRY and _flat_ok(chain(*seqs)))


def _short_texts(values: Any, most: int = MAX_TEXT, only: bool = False) -> bool:
    """The strings of ``values`` at most ``most`` characters (``only``: all of them strings)."""
    if only:
        return _STR.issuperset(map(type, values)) and max(map(len, values)) <= most
    return max(map(len, filter(_is_str, values)), default=0) <= most


def _version_line(version: Any) -> str:
    return (
        f"heartbeat version {_short(version)}; this scheduler reads version {METRICS_VERSION} "
        "only: run the same dask-rmm on the workers and the scheduler"
    )


def _heartbeat_time(sent: Any, now: float, arrived: float, problems: list) -> float:
    """The heartbeat's time: taken as now when it is no time (counted) or ahead of the
    scheduler's clock (a skew either way is logged)."""
    if type(sent) not in (int, float) or not EARLIEST <= sent <= now + LATEST_AHEAD:
        if sent is not None:
            problems.append(("time", f"heartbeat time {_short(sent)} is no time; taken as now"))
        return now
    skew = sent - arrived
    if abs(skew) > MAX_AHEAD:
        where = "ahead of" if skew > 0 else "behind"
        problems.append(("clock", f"clock {abs(skew):.0f} s {where} the scheduler's"))
    return float(sent) if sent <= now + MAX_AHEAD else now


def _bound(where: str, d: Mapping, now: float, problems: list) -> Mapping:
    """A device entry (or the heartbeat's own fields) within the bounds: the same dict when it
    already is. Fields are numbers, short strings, packed ``samples``, lists or maps of flat
    entries (:func:`_entries`), and ``oom_events``."""
    src, out = d, None
    if len(d) > MAX_FIELDS:
        problems.append(("bounds", f"{where}: {len(d)} fields, the first {MAX_FIELDS} kept"))
        src = dict(islice(d.items(), MAX_FIELDS))
        out = dict(src)
    if not (set(map(type, src)) <= _STR and max(map(len, src), default=0) <= MAX_KEY):
        keys = [k for k in src if type(k) is str and len(k) <= MAX_KEY]
        problems.append(("bounds", f"{where}: {len(src) - len(keys)} field names dropped"))
        out = {k: src[k] for k in keys}
        src = dict(out)
    for k, v in src.items():
        t = type(v)
        if t in _SCALARS:
            continue
        new: Any = v
        if t is str:
            if len(v) > MAX_TEXT:
                new = v[:MAX_TEXT] + "..."
                problems.append(("bounds", f"{where}: {k} of {len(v)} characters cut"))
        elif t is bytes:
            if k != "samples" and len(v) > MAX_TEXT:
                new = _DROP
                problems.append(("bounds", f"{where}: {k} of {len(v)} bytes dropped"))
        elif t in _SEQUENCES and k == "oom_events":
            new = _oom_events(where, v, now, problems)
        elif t in _SEQUENCES or t is dict:
            new = _entries(where, k, v, problems)
        else:
            new = _DROP
            problems.append(("bounds", f"{where}: {k} is {_kind(v)}; dropped"))
        if new is not v:
            if out is None:
                out = dict(d)
            if new is _DROP:
                del out[k]
            else:
                out[k] = new
    return d if out is None else out


_DROP = object()


def _entries(where: str, name: str, v: Any, problems: list) -> Any:
    """A list (or map) field: at most :data:`MAX_ENTRIES` entries (keys short strings), each a
    number, a short string or a flat sequence of at most :data:`MAX_ENTRY` of them (a few C
    calls when it already is)."""
    n = len(v)
    if n > MAX_ENTRIES:
        problems.append(("bounds", f"{where}: {name} of {n} entries, {MAX_ENTRIES} kept"))
        v = dict(islice(v.items(), MAX_ENTRIES)) if type(v) is dict else v[:MAX_ENTRIES]
    if not v:
        return v
    values = list(v.values()) if type(v) is dict else v
    if (type(v) is not dict or _flat_ok(v)) and (
        _flat_ok(values)
        or (
            set(map(type, values)) <= _SEQUENCES
            and max(map(len, values)) <= MAX_ENTRY
            and _flat_ok(list(chain.from_iterable(values)))
        )
    ):
        return v
    if type(v) is dict:
        kept: Any = {k: e for k, e in v.items() if _flat_ok([k]) and _entry_ok(e)}
    else:
        kept = [e for e in v if _entry_ok(e)]
    problems.append(("bounds", f"{where}: {n - len(kept)} {name} entries nested or long; dropped"))
    return kept


def _entry_ok(e: Any) -> bool:
    if type(e) in _SEQUENCES:
        return len(e) <= MAX_ENTRY and _flat_ok(e)
    return _flat_ok([e])


def _flat_ok(values: Any) -> bool:
    """Every one of ``values`` a number or a string of at most :data:`MAX_TEXT` characters."""
    values = list(values)
    return _FLAT.issuperset(map(type, values)) and _short_texts(values)


def _oom_events(where: str, events: list | tuple, now: float, problems: list) -> list:
    """The last :data:`MAX_OOM_EVENTS` events of plain data, nested at most 3 deep, whose
    figures the renderers read are numbers and whose time is a time."""
    kept = []
    for e in events[-MAX_OOM_EVENTS:]:
        try:
            event = _plain(e, 3)
        except ValueError:
            continue
        if type(event) is not dict or not all(
            event.get(k) is None or type(event[k]) in (int, float) for k in _OOM_NUMBERS
        ):
            continue
        if event.get("time") is None or EARLIEST <= event["time"] <= now + MAX_AHEAD:
            kept.append(event)
    if len(kept) < len(events):
        problems.append(
            ("bounds", f"{where}: {len(events) - len(kept)} of {len(events)} OOM events dropped "
             f"(kept: the last {MAX_OOM_EVENTS} of plain data with a time)")
        )  # fmt: skip
    return kept


def _plain(value: Any, depth: int) -> Any:
    """``value`` as plain JSON data (str keys, finite numbers, bounded sizes) or ValueError."""
    t = type(value)
    if t in _SCALARS:
        if (t is int and abs(value) >= 1 << 63) or (t is float and not math.isfinite(value)):
            raise ValueError("out of range")
        return value
    if t is str:
        return value if len(value) <= MAX_TEXT else value[:MAX_TEXT] + "..."
    if depth > 0 and t is dict and len(value) <= MAX_ENTRIES:
        if not all(type(k) is str for k in value):
            raise ValueError("a key that is no str")
        return {k: _plain(v, depth - 1) for k, v in value.items()}
    if depth > 0 and t in _SEQUENCES:
        return [_plain(v, depth - 1) for v in value[:MAX_ENTRIES]]
    raise ValueError(f"{t.__name__} is no plain data")


def _packed(dev: str, samples: Any, problems: list) -> bytes | None:
    """The device's packed samples, or None (and why)."""
    if type(samples) is not bytes:
        problems.append(("format", f"device {dev!r}: samples are {_kind(samples)}, not packed"))
    elif len(samples) % _RECORD:
        problems.append(("format", f"device {dev!r}: {len(samples)} bytes of samples"))
    elif len(samples) > MAX_SAMPLES * _RECORD:
        problems.append(
            ("bounds", f"device {dev!r}: {len(samples) // _RECORD} samples, more than "
             f"{MAX_SAMPLES}; dropped")
        )  # fmt: skip
    else:
        return samples
    return None


def check_samples(blobs: list[bytes], now: float) -> list[tuple[bytes, tuple[str, str] | None]]:
    """Each packed blob's valid samples (times from 2000 to ``MAX_AHEAD`` past ``now``, bytes in
    ``[0, MAX_BYTES]``, in time order) and what was wrong (None: nothing). One numpy pass over
    all of them: the poller checks every heartbeat it reads at once."""
    if not blobs:
        return []
    a = np.frombuffer(b"".join(blobs), SAMPLE_DTYPE)
    t, c, m = a["t"], a["c"], a["m"]
    good = (t >= EARLIEST) & (t <= now + MAX_AHEAD) & (c >= 0) & (c <= MAX_BYTES)
    good &= (m >= 0) & (m <= MAX_BYTES)
    back = t[1:] < t[:-1]
    ends = np.cumsum([len(b) // _RECORD for b in blobs])
    back[ends[:-1] - 1] = False  # one blob's last sample and the next one's first
    if good.all() and not back.any():
        return [(b, None) for b in blobs]
    out: list[tuple[bytes, tuple[str, str] | None]] = []
    start = 0
    for b, end in zip(blobs, ends.tolist(), strict=True):
        if good[start:end].all() and not back[start : end - 1].any():
            out.append((b, None))
        else:
            out.append(_fix(a[start:end], now))
        start = end
    return out


def _fix(a: np.ndarray, now: float) -> tuple[bytes, tuple[str, str]]:
    t = a["t"]
    reasons = []
    with np.errstate(invalid="ignore"):
        absurd = ~(t >= EARLIEST) | (t > now + LATEST_AHEAD)
        ahead = ~absurd & (t > now + MAX_AHEAD)
    out_of_range = (a["c"] < 0) | (a["c"] > MAX_BYTES) | (a["m"] < 0) | (a["m"] > MAX_BYTES)
    if absurd.any():
        reasons.append(f"{int(absurd.sum())} at no time (before 2000 or a day ahead)")
    if ahead.any():
        reasons.append(
            f"{int(ahead.sum())} up to {float(t[ahead].max()) - now:.0f} s ahead of the "
            "scheduler's clock"
        )
    if out_of_range.any():
        reasons.append(f"{int(out_of_range.sum())} with bytes outside [0, 2**50]")
    kept = a[~(absurd | ahead | out_of_range)]
    text = f"{len(a) - len(kept)} of {len(a)} samples dropped: " + "; ".join(reasons)
    if len(kept) > 1 and (kept["t"][1:] < kept["t"][:-1]).any():
        kept = kept[np.argsort(kept["t"], kind="stable")]
        text = "samples out of time order, sorted" + ("" if len(kept) == len(a) else "; " + text)
    return kept.tobytes(), ("clock" if ahead.any() else "time", text)


def _kind(v: Any) -> str:
    return f"a {type(v).__name__}"


def _short(v: Any) -> str:
    """A short repr (never the whole of a huge value)."""
    return _REPR.repr(v)


_REPR = reprlib.Repr()
_REPR.maxstring = _REPR.maxother = 40
