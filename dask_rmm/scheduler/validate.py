"""The bounds on a worker's dask-rmm heartbeat, enforced when the scheduler reads it: counts,
string lengths, nesting and times, so that no worker (a bug, a wrong clock, a hand-made client)
can grow the scheduler's memory, a page's time or a chart's axis without bound.

Types are not checked: readers take fields through ``DeviceSample.from_dict`` or
:func:`dask_rmm.wire.to_int`, which never raise. What is beyond a bound is left out (an entry, a
field, a device or a sample), counted, and named in the problems, which the plugin shows as the
worker's error and logs once per worker and kind a minute. Not here: keeping the records
(``timeline.py``).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import fields
from functools import lru_cache
from itertools import chain, islice, repeat
from operator import itemgetter
from reprlib import repr as _short
from typing import Any, NamedTuple

import numpy as np

from dask_rmm.scheduler.resolution import SAMPLE_DTYPE
from dask_rmm.wire import METRICS_VERSION, SAMPLE_STRUCT, DeviceSample

__all__ = ["MAX_AHEAD", "MAX_DEVICES", "MAX_ENTRIES", "MAX_SAMPLES", "Checked", "check_metrics"]

#: Devices kept of one worker (a host has at most 16 GPUs; dask-cuda gives a worker one).
MAX_DEVICES = 64
#: Fields kept of one device entry, or of the heartbeat (``DeviceSample`` has about 55).
MAX_FIELDS = 128
#: Entries kept of a list or map, and values in one entry (nested no deeper); OOM events kept.
MAX_ENTRIES = 64
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
_BLOB = MAX_SAMPLES * _RECORD
#: OOM event fields that renderers read as numbers.
_OOM_NUMBERS = ("time", "requested", "free_bytes", "largest_free_block", "spilled_trying")
_NUMBERS = {int, float, bool, type(None)}
_SEQUENCES = {list, tuple}
#: A device entry's fields by kind (:class:`DeviceSample`); each row of a list is a str, then
#: numbers (``width`` columns in all).
_TEXT_FIELDS = (*(f.name for f in fields(DeviceSample) if f.type == "str"), "error")
_LIST_FIELDS = {"task_groups": 3, "libraries": 4, "admission_expected_peaks": 3}
_NOT_NUMBERS = frozenset((*_TEXT_FIELDS, *_LIST_FIELDS, "samples", "oom_events"))
_WIRE = _NOT_NUMBERS | {f.name for f in fields(DeviceSample)} | {"fragmentation"}
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
        line = (
            f"heartbeat version {_short(version)}; this scheduler reads version "
            f"{METRICS_VERSION} only: run the same dask-rmm on the workers and the scheduler"
        )
        return Checked(None, [], [("format", line)])
    raw = m.get("devices")
    if not isinstance(raw, Mapping):
        return Checked(None, [], [("format", f"devices are {_kind(raw)}, not a mapping")])
    problems: list[tuple[str, str]] = []
    t = _heartbeat_time(m.get("time"), now, now if arrived is None else arrived, problems)
    if _plain(raw):  # what a worker sends: bounded a few C calls at a time for every device
        devices = raw if type(raw) is dict else dict(raw)
    else:
        devices = {}
        if len(raw) > MAX_DEVICES:
            problems.append(("bounds", f"{len(raw)} devices: the first {MAX_DEVICES} kept"))
        for dev, d in islice(raw.items(), MAX_DEVICES):
            if type(dev) is not str or not 0 < len(dev) <= MAX_KEY:
                problems.append(("bounds", f"device id {_short(dev)} dropped (no short str)"))
            elif not isinstance(d, Mapping):
                problems.append(("format", f"device {dev!r} is {_kind(d)}; dropped"))
            else:
                devices[dev] = _bound(f"device {dev!r}", d, now, problems)
    samples = []
    for dev, d in devices.items():
        blob = d.get("samples")
        if blob and type(blob) is bytes and not len(blob) % _RECORD:
            samples.append((dev, blob))
        elif blob:
            what = f"{len(blob)} bytes" if type(blob) is bytes else _kind(blob)
            problems.append(("format", f"device {dev!r}: samples are {what}, not packed"))
    worker = m.get("worker")
    if m.keys() <= _TOP and (type(worker) is not str or len(worker) <= MAX_TEXT):
        top: Mapping = {"version": version, "worker": worker}
    else:
        top = _bound("the heartbeat", {k: v for k, v in m.items() if k != "devices"}, now, problems)
    return Checked({**top, "time": t, "devices": devices}, samples, problems)


def _plain(devices: Mapping) -> bool:
    """Every device entry within the bounds and of the wire's form (:class:`DeviceSample`'s
    field names, each with a value of its kind: numbers, strings of at most :data:`MAX_TEXT`
    characters, lists of at most :data:`MAX_ENTRIES` rows of their columns; packed ``samples``;
    no OOM events), checked a few C calls at a time for all devices. False: device by device,
    field by field (:func:`_bound`)."""
    ds = list(devices.values())
    if not 0 < len(ds) <= MAX_DEVICES or not {dict}.issuperset(map(type, ds)):
        return False
    try:
        "".join(devices)  # TypeError unless every id is a str
        if not 0 < min(map(len, devices)) <= max(map(len, devices)) <= MAX_KEY:
            return False
        if any(d.get("oom_events") for d in ds):
            return False
        try:  # the devices of a worker have the same names (KeyError if not): C calls
            first: Any = _getters(tuple(ds[0])) if len(set(map(len, ds))) == 1 else None
            numbers, strings = (list(chain.from_iterable(map(g, ds))) for g in first)
        except (KeyError, TypeError):
            getters: list = list(map(_getters, map(tuple, ds)))
            if None in getters:
                return False
            numbers, strings = (
                list(chain.from_iterable(map(_call, [g[i] for g in getters], ds))) for i in (0, 1)
            )
        sum(filter(None, numbers))  # TypeError unless numbers (falsy ones, None among them, are)
        texts = list(filter(None, strings))
        blobs = list(filter(None, map(dict.get, ds, repeat("samples"))))
        for name, width in _LIST_FIELDS.items():
            lists = list(filter(None, map(dict.get, ds, repeat(name))))
            if not lists:
                continue
            if not _SEQUENCES.issuperset(map(type, lists)) or max(map(len, lists)) > MAX_ENTRIES:
                return False
            rows = list(chain.from_iterable(lists))
            if not _SEQUENCES.issuperset(map(type, rows)):  # zip would take a map's keys
                return False
            columns = list(zip(*rows, strict=True))  # ValueError unless all of one width
            if len(columns) != width:
                return False
            texts += columns[0]
            sum(filter(None, chain.from_iterable(columns[1:])))
        "".join(texts), b"".join(blobs)  # TypeError unless strings and bytes
    except (TypeError, ValueError, KeyError):
        return False
    return max(map(len, texts), default=0) <= MAX_TEXT and max(map(len, blobs), default=0) <= _BLOB


@lru_cache(256)
def _getters(names: tuple[str, ...]) -> tuple | None:
    """The getters of the numbers and of the strings of a device entry of these field names
    (None unless they are the wire's)."""
    if not _WIRE.issuperset(names):
        return None
    numbers = [k for k in names if k not in _NOT_NUMBERS]
    texts = [k for k in names if k in _TEXT_FIELDS]
    # The first key twice: itemgetter of one key gives no tuple.
    return tuple(itemgetter(*keys, keys[0]) if keys else lambda d: () for keys in (numbers, texts))


def _call(f: Any, x: Any) -> Any:
    return f(x)


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
    """A device entry (or the heartbeat's own fields) within the bounds, the same mapping when
    it already is: at most :data:`MAX_FIELDS` fields of short names; packed ``samples``;
    ``oom_events`` (:func:`_oom_events`); numbers, strings cut to :data:`MAX_TEXT` characters,
    short bytes, and lists or maps cut to :data:`MAX_ENTRIES` entries of flat data
    (:func:`_within`); the rest dropped."""
    out: dict = {}
    if len(d) > MAX_FIELDS:
        problems.append(("bounds", f"{where}: {len(d)} fields, the first {MAX_FIELDS} kept"))
    names = 0
    for k, v in islice(d.items(), MAX_FIELDS):
        t = type(v)
        if type(k) is not str or len(k) > MAX_KEY:
            names += 1
        elif t in _NUMBERS or (t is str and len(v) <= MAX_TEXT):
            out[k] = v
        elif t is bytes and len(v) <= (_BLOB if k == "samples" else MAX_TEXT):
            out[k] = v
        elif t is str:
            out[k] = v[:MAX_TEXT] + "..."
            problems.append(("bounds", f"{where}: {k} of {len(v)} characters cut"))
        elif k == "oom_events" and t in _SEQUENCES:
            out[k] = _oom_events(where, v, now, problems)
        elif t in _SEQUENCES or t is dict:
            n = len(v)
            if n > MAX_ENTRIES:
                problems.append(("bounds", f"{where}: {k} of {n} entries, {MAX_ENTRIES} kept"))
            items = islice(v.items(), MAX_ENTRIES) if t is dict else enumerate(v[:MAX_ENTRIES])
            kept = {
                i: x
                for i, x in items
                if (t is not dict or (type(i) is str and len(i) <= MAX_KEY)) and _within(x, 1)
            }
            if dropped := min(n, MAX_ENTRIES) - len(kept):
                problems.append(
                    ("bounds", f"{where}: {dropped} {k} entries nested or long; dropped")
                )
            out[k] = v if len(kept) == n else kept if t is dict else list(kept.values())
        else:
            problems.append(("bounds", f"{where}: {k} is {_kind(v)}; dropped"))
    if names:
        problems.append(("bounds", f"{where}: {names} field names dropped"))
    return d if len(out) == len(d) and all(out[k] is v for k, v in d.items()) else out


def _within(v: Any, depth: int) -> bool:
    """``v`` is plain data within the bounds: a number, a string of at most :data:`MAX_TEXT`
    characters, or a list or map (of short str keys) of at most :data:`MAX_ENTRIES` of them,
    nested at most ``depth`` deep."""
    t = type(v)
    if t in _NUMBERS:
        return True
    if t is str:
        return len(v) <= MAX_TEXT
    if depth <= 0 or (t not in _SEQUENCES and t is not dict) or len(v) > MAX_ENTRIES:
        return False
    if t is dict:
        return all(type(k) is str and len(k) <= MAX_KEY for k in v) and all(
            _within(x, depth - 1) for x in v.values()
        )
    return all(_within(x, depth - 1) for x in v)


def _oom_events(where: str, events: list | tuple, now: float, problems: list) -> Any:
    """The last :data:`MAX_OOM_EVENTS` events that are maps of plain data (:func:`_within`,
    nested at most 3 deep) whose figures the renderers read are numbers and whose time is a
    time."""
    kept = [
        e
        for e in events[-MAX_OOM_EVENTS:]
        if type(e) is dict
        and _within(e, 3)
        and all(e.get(k) is None or type(e[k]) in (int, float) for k in _OOM_NUMBERS)
        and (e.get("time") is None or EARLIEST <= e["time"] <= now + MAX_AHEAD)
    ]
    if len(kept) == len(events):
        return events
    problems.append(
        ("bounds", f"{where}: {len(events) - len(kept)} of {len(events)} OOM events dropped "
         f"(kept: the last {MAX_OOM_EVENTS} of plain data with a time)")
    )  # fmt: skip
    return kept


def check_samples(
    blobs: list[bytes], now: float, newest: list[float]
) -> list[tuple[bytes, float, tuple[str, str] | None]]:
    """Each packed blob's valid samples (times from 2000 to ``MAX_AHEAD`` past ``now``, bytes in
    ``[0, MAX_BYTES]``, in time order) newer than its device's ``newest``, the time of the last
    of them, and what was wrong (None: nothing). One numpy pass over all of them: the poller
    checks every heartbeat it reads at once."""
    if not blobs:
        return []
    a = np.frombuffer(b"".join(blobs), SAMPLE_DTYPE)
    t, c, m = a["t"], a["c"], a["m"]
    good = (t >= EARLIEST) & (t <= now + MAX_AHEAD) & (c >= 0) & (c <= MAX_BYTES)
    good &= (m >= 0) & (m <= MAX_BYTES)
    back = t[1:] < t[:-1]
    counts = np.fromiter(map(len, blobs), np.int64, len(blobs)) // _RECORD
    ends = np.cumsum(counts)
    starts = ends - counts
    back[ends[:-1] - 1] = False  # one blob's last sample and the next one's first
    if good.all() and not back.any():  # samples come in order: the new ones are the last ones
        fresh = np.add.reduceat(t > np.repeat(newest, counts), starts, dtype=np.int64)
        first = ((counts - fresh) * _RECORD).tolist()
        last = t[ends - 1].tolist()
        return [(b[f:] if f else b, x, None) for b, f, x in zip(blobs, first, last, strict=True)]
    out: list[tuple[bytes, float, tuple[str, str] | None]] = []
    for i, (start, end) in enumerate(zip(starts.tolist(), ends.tolist(), strict=True)):
        kept, problem = a[start:end], None
        if not good[start:end].all() or back[start : end - 1].any():
            kept, problem = _fix(kept, now)
        new = kept[int(np.searchsorted(kept["t"], newest[i], side="right")) :]
        out.append((new.tobytes(), float(new["t"][-1]) if len(new) else newest[i], problem))
    return out


def _fix(a: np.ndarray, now: float) -> tuple[np.ndarray, tuple[str, str]]:
    t, c, m = a["t"], a["c"], a["m"]
    with np.errstate(invalid="ignore"):
        absurd = ~(t >= EARLIEST) | (t > now + LATEST_AHEAD)
    ahead = ~absurd & (t > now + MAX_AHEAD)
    why = {
        "at no time (before 2000 or a day ahead)": absurd,
        f"up to {np.max(t[ahead], initial=now) - now:.0f} s ahead of the scheduler's clock": ahead,
        "with bytes outside [0, 2**50]": (c < 0) | (c > MAX_BYTES) | (m < 0) | (m > MAX_BYTES),
    }
    kept = a[~np.logical_or.reduce(list(why.values()))]
    text = f"{len(a) - len(kept)} of {len(a)} samples dropped: " + "; ".join(
        f"{int(x.sum())} {reason}" for reason, x in why.items() if x.any()
    )
    if len(kept) > 1 and (kept["t"][1:] < kept["t"][:-1]).any():
        kept = kept[np.argsort(kept["t"], kind="stable")]
        text = "samples out of time order, sorted" + ("" if len(kept) == len(a) else "; " + text)
    return kept, ("clock" if ahead.any() else "time", text)


def _kind(v: Any) -> str:
    return f"a {type(v).__name__}"
