"""What the scheduler keeps of a worker's dask-rmm heartbeat: each one checked against the wire
format (:mod:`dask_rmm.wire`) when it arrives, so that no worker's data (another version, a bug,
a wrong clock, a hand-made client) can make a page, the Prometheus collector, ``cluster_report``
or the CLI fail, or grow the scheduler's memory or loop time without bound.

What is valid is kept; what is not is left out (a field takes its default, a device or sample is
dropped) and named in the problems, which the plugin logs (rate-limited) and shows as the
worker's error in the report. Fields this scheduler does not know are ignored, never rejected
(newer workers add optional fields). Not here: keeping the records (``timeline.py``).
"""

from __future__ import annotations

import dataclasses
import math
import operator
import reprlib
from collections.abc import Mapping
from itertools import chain
from typing import Any, NamedTuple

import numpy as np

from dask_rmm.scheduler.resolution import SAMPLE_DTYPE
from dask_rmm.wire import METRICS_VERSION, SAMPLE_STRUCT, DeviceSample, pack_samples

__all__ = [
    "MAX_AHEAD",
    "MAX_BYTES",
    "MAX_DEVICES",
    "MAX_SAMPLES",
    "Checked",
    "check_metrics",
    "check_samples",
]

#: Devices kept of one worker (a host has at most 16 GPUs; dask-cuda gives a worker one).
MAX_DEVICES = 64
#: Samples kept of one device's heartbeat (a worker sends at most 2 x 1000).
MAX_SAMPLES = 8192
#: Largest byte count or count kept (1 PiB, in absolute value; a sample's bytes are at least 0):
#: a sum over 8192 devices cannot wrap an int64.
MAX_BYTES = 1 << 50
#: Seconds a sample time may be ahead of the scheduler's clock (heartbeat latency, small skew).
MAX_AHEAD = 60.0
#: Characters kept of a string field (a name, a resource, an error).
MAX_TEXT = 1024
#: Task groups kept a device; OOM events kept a device; items kept in one OOM event's lists.
MAX_TASK_GROUPS = 64
MAX_OOM_EVENTS = 16
MAX_ITEMS = 256
#: OOM event fields that renderers read as numbers.
_OOM_NUMBERS = ("time", "requested", "free_bytes", "largest_free_block", "spilled_trying")

_FIELDS = {f.name: f.type for f in dataclasses.fields(DeviceSample)}
_INTS = tuple(k for k, t in _FIELDS.items() if t == "int")
_FLOATS = tuple(k for k, t in _FIELDS.items() if t == "float")
_STRS = tuple(k for k, t in _FIELDS.items() if t == "str")
_ints_of = operator.itemgetter(*_INTS)
_floats_of = operator.itemgetter(*_FLOATS, *_FLOATS)  # a tuple even for one field
_strs_of = operator.itemgetter(*_STRS)
_INT, _STR, _NUMBER = {int}, {str}, {int, float}
_SEQUENCE, _THREE, _DICT = {list, tuple}, {3}, {dict}
_BLOBS = {bytes, type(None)}
_RECORD = SAMPLE_STRUCT.size


class Checked(NamedTuple):
    """One heartbeat as checked: ``metrics`` the heartbeat with only valid data (None: nothing
    usable), ``samples`` each device's packed samples still to check (:func:`check_samples`),
    ``problems`` what was left out and why."""

    metrics: dict | None
    samples: list[tuple[str, bytes]]
    problems: list[str]


def check_metrics(m: Any, now: float) -> Checked:
    """``m`` (a worker's ``metrics["dask-rmm"]``) with what is malformed left out; ``now`` is
    the scheduler's clock. Never raises."""
    if not isinstance(m, Mapping):
        return Checked(None, [], [f"metrics are {_kind(m)}, not a mapping"])
    problems: list[str] = []
    version = m.get("version", 1)
    if type(version) is not int or version < 1:
        return Checked(None, [], [f"unknown wire version {_short(version)}"])
    if version > METRICS_VERSION:
        problems.append(
            f"wire version {version} is newer than this scheduler's {METRICS_VERSION}: "
            "fields it does not know are ignored"
        )
    raw = m.get("devices")
    if not isinstance(raw, Mapping):
        return Checked(None, [], [*problems, f"devices are {_kind(raw)}, not a mapping"])
    sent: Any = m.get("time")
    t = now
    if _number(sent) and math.isfinite(sent) and sent <= now + MAX_AHEAD:
        t = float(sent)
    elif sent is not None:
        problems.append(f"heartbeat time {_short(sent)} is not a time up to now; taken as now")
    devices: dict[str, Mapping] = {}
    samples: list[tuple[str, bytes]] = []
    if _all_well_formed(raw):  # what a worker of this version sends: checked in bulk
        blobs = [d.get("samples") for d in raw.values()]
        if set(map(type, blobs)) <= _BLOBS and all(len(b) % _RECORD == 0 for b in blobs if b):
            samples = [(dev, b) for dev, b in zip(raw, blobs, strict=True) if b]
            if not samples or max(len(b) for _, b in samples) <= MAX_SAMPLES * _RECORD:
                raw = {}
                devices = dict(m["devices"])
            else:
                samples = []
    for dev, d in raw.items():
        if len(devices) == MAX_DEVICES:
            problems.append(f"{len(raw)} devices: only the first {MAX_DEVICES} kept")
            break
        if type(dev) is int:
            dev = str(dev)
        if type(dev) is not str or not 0 < len(dev) <= 64:
            problems.append(f"device id {_short(dev)} dropped (not a short str or int)")
            continue
        if dev in devices:
            problems.append(f"device {dev!r} sent twice (as int and str); the second dropped")
            continue
        if not isinstance(d, Mapping):
            problems.append(f"device {dev!r} is {_kind(d)}, not a mapping; dropped")
            continue
        d = _check_device(dev, d, now, problems)
        blob = d.get("samples")
        if blob:
            blob = _packed(dev, blob, problems)
            if blob:
                samples.append((dev, blob))
        devices[dev] = d
    out = dict(m)
    out["version"], out["time"], out["devices"] = version, t, devices
    return Checked(out, samples, problems)


def _all_well_formed(devices: Mapping) -> bool:
    """:func:`_well_formed` for every device of a heartbeat at once (ids short str, entries
    dicts), a few C calls for all of them."""
    if not 0 < len(devices) <= MAX_DEVICES or set(map(type, devices)) != _STR:
        return False
    if not 0 < min(map(len, devices)) or max(map(len, devices)) > 64:
        return False
    ds = list(devices.values())
    if set(map(type, ds)) != _DICT:
        return False
    try:
        ints = list(chain.from_iterable(map(_ints_of, ds)))
        floats = list(chain.from_iterable(map(_floats_of, ds)))
        strs = list(chain.from_iterable(map(_strs_of, ds)))
    except KeyError:  # an older producer: some fields missing
        return False
    errors = [e for d in ds if (e := d.get("error")) is not None]
    groups = [g for d in ds if (g := d.get("task_groups"))]
    return (
        _scalars_ok(ints, floats, strs)
        and (not errors or (set(map(type, errors)) == _STR and max(map(len, errors)) <= MAX_TEXT))
        and (
            not groups
            or (
                set(map(type, groups)) <= _SEQUENCE
                and max(map(len, groups)) <= MAX_TASK_GROUPS
                and _groups_ok(list(chain.from_iterable(groups)), len(ds) * MAX_TASK_GROUPS)
            )
        )
        and not any(d.get("oom_events") for d in ds)
    )


def _scalars_ok(ints: list, floats: list, strs: list) -> bool:
    """Byte counts are ints within bounds, figures finite non-negative numbers, texts short
    strings: a few C calls for all of them."""
    return (
        set(map(type, ints)) == _INT
        and -MAX_BYTES <= min(ints)
        and max(ints) <= MAX_BYTES
        and set(map(type, floats)) <= _NUMBER
        and 0 <= min(floats)
        and math.isfinite(sum(floats))
        and set(map(type, strs)) == _STR
        and max(map(len, strs)) <= MAX_TEXT
    )


def _well_formed(d: Mapping) -> bool:
    """Every known field there and well formed (what a worker of this version sends): checked
    a few C calls at a time."""
    try:
        ints, floats, strs = _ints_of(d), _floats_of(d), _strs_of(d)
    except KeyError:  # an older producer: some fields missing
        return False
    error, groups, events = d.get("error"), d.get("task_groups"), d.get("oom_events")
    return (
        _scalars_ok(ints, floats, strs)
        and (error is None or (type(error) is str and len(error) <= MAX_TEXT))
        and (not groups or _groups_ok(groups))
        and not events
    )


def _check_device(dev: str, d: Mapping, now: float, problems: list[str]) -> Mapping:
    """The device entry with malformed known fields left out (they read as their default).
    Task groups are only bounded here: their readers take each one apart safely."""
    if _well_formed(d):
        return d
    fast = False
    out = dict(d)
    bad = []
    if not fast:
        for k in _INTS:
            if k in out:
                v = out[k]
                if type(v) is bool:
                    out[k] = int(v)
                elif type(v) is not int or not -MAX_BYTES <= v <= MAX_BYTES:
                    bad.append(k)
    for k in _FLOATS:
        if k in out:
            v = out[k]
            if not _number(v) or not (math.isfinite(v) and v >= 0):
                bad.append(k)
    for k in _STRS:
        if k in out:
            v = out[k]
            if type(v) is not str:
                bad.append(k)
            elif len(v) > MAX_TEXT:
                out[k] = v[:MAX_TEXT] + "..."
                problems.append(f"device {dev!r}: {k} of {len(v)} characters cut")
    error = out.get("error")
    if error is not None and type(error) is not str:
        out["error"] = f"(an error of type {type(error).__name__}, not text)"
        problems.append(f"device {dev!r}: error={_short(error)} is not text")
    elif error is not None and len(error) > MAX_TEXT:
        out["error"] = error[:MAX_TEXT] + "..."
        problems.append(f"device {dev!r}: error of {len(error)} characters cut")
    for k in bad:
        problems.append(f"device {dev!r}: {k}={_short(out.pop(k))} dropped (wrong type or range)")
    groups = out.get("task_groups")
    if groups:
        out["task_groups"] = _task_groups(dev, groups, problems)
    events = out.get("oom_events")
    if events:
        out["oom_events"] = _oom_events(dev, events, now, problems)
    return out


def _groups_ok(groups: Any, most: int = MAX_TASK_GROUPS) -> bool:
    """Task groups all ``[str, int, int]`` in bounds, at most ``most`` (a few C calls, not a
    loop)."""
    if type(groups) not in _SEQUENCE or len(groups) > most:
        return False
    if not set(map(type, groups)) <= _SEQUENCE or set(map(len, groups)) != _THREE:
        return False
    prefixes, current, peak = zip(*groups, strict=True)
    numbers = current + peak
    return (
        set(map(type, prefixes)) == _STR
        and max(map(len, prefixes)) <= MAX_TEXT
        and set(map(type, numbers)) == _INT
        and min(numbers) >= 0
        and max(numbers) <= MAX_BYTES
    )


def _task_groups(dev: str, groups: Any, problems: list[str]) -> list:
    if _groups_ok(groups):
        return groups
    if not isinstance(groups, (list, tuple)):
        problems.append(f"device {dev!r}: task_groups are {_kind(groups)}; dropped")
        return []
    kept = [g for g in groups[:MAX_TASK_GROUPS] if _groups_ok([g])]
    if len(kept) < len(groups):
        problems.append(f"device {dev!r}: {len(groups) - len(kept)} task groups dropped")
    return kept


def _oom_events(dev: str, events: Any, now: float, problems: list[str]) -> list:
    if not isinstance(events, (list, tuple)):
        problems.append(f"device {dev!r}: oom_events are {_kind(events)}; dropped")
        return []
    kept = []
    for e in events[-MAX_OOM_EVENTS:]:
        if not isinstance(e, Mapping):
            continue
        try:
            event = _plain(e, 3)
        except ValueError:
            continue
        when = event.get("time")
        if all(event.get(k) is None or _number(event[k]) for k in _OOM_NUMBERS) and (
            when is None or -1e12 < when <= now + MAX_AHEAD
        ):
            kept.append(event)
    if len(kept) < len(events):
        problems.append(f"device {dev!r}: {len(events) - len(kept)} OOM events dropped")
    return kept


def _plain(value: Any, depth: int) -> Any:
    """``value`` as plain JSON data (str keys, finite numbers, bounded sizes) or ValueError."""
    t = type(value)
    if value is None or t is bool or t is int:
        if t is int and abs(value) >= 1 << 63:
            raise ValueError("integer out of range")
        return value
    if t is float:
        if not math.isfinite(value):
            raise ValueError("not finite")
        return value
    if t is str:
        return value if len(value) <= MAX_TEXT else value[:MAX_TEXT] + "..."
    if depth > 0 and isinstance(value, Mapping) and len(value) <= MAX_ITEMS:
        if not all(type(k) is str for k in value):
            raise ValueError("a key that is no str")
        return {k: _plain(v, depth - 1) for k, v in value.items()}
    if depth > 0 and isinstance(value, (list, tuple)):
        return [_plain(v, depth - 1) for v in value[:MAX_ITEMS]]
    raise ValueError(f"{t.__name__} is no plain data")


def _packed(dev: str, samples: Any, problems: list[str]) -> bytes | None:
    """The device's samples packed (version 3 sends bytes, version 2 lists), or None."""
    if type(samples) is bytes:
        if len(samples) % _RECORD:
            problems.append(f"device {dev!r}: {len(samples)} bytes of samples are no whole records")
            return None
    elif isinstance(samples, (list, tuple)) and len(samples) <= MAX_SAMPLES:
        try:
            samples = pack_samples(samples)
        except (TypeError, IndexError, KeyError, ValueError):
            problems.append(f"device {dev!r}: samples are not [time, int, int] rows; dropped")
            return None
    else:
        problems.append(f"device {dev!r}: samples are {_kind(samples)}; dropped")
        return None
    if len(samples) > MAX_SAMPLES * _RECORD:
        problems.append(
            f"device {dev!r}: {len(samples) // _RECORD} samples in one heartbeat, more than "
            f"{MAX_SAMPLES}; dropped"
        )
        return None
    return samples


def check_samples(blobs: list[bytes], now: float) -> list[tuple[bytes, str | None]]:
    """Each packed blob's valid samples (finite times up to ``MAX_AHEAD`` past ``now``, bytes in
    ``[0, MAX_BYTES]``, in time order) and what was wrong (None: nothing). One numpy pass over
    all of them: the poller checks every heartbeat it reads at once."""
    if not blobs:
        return []
    a = np.frombuffer(b"".join(blobs), SAMPLE_DTYPE)
    t, c, m = a["t"], a["c"], a["m"]
    good = (t > -np.inf) & (t <= now + MAX_AHEAD) & (c >= 0) & (c <= MAX_BYTES)
    good &= (m >= 0) & (m <= MAX_BYTES)
    back = t[1:] < t[:-1]
    ends = np.cumsum([len(b) // _RECORD for b in blobs])
    back[ends[:-1] - 1] = False  # one blob's last sample and the next one's first
    if good.all() and not back.any():
        return [(b, None) for b in blobs]
    out: list[tuple[bytes, str | None]] = []
    start = 0
    for b, end in zip(blobs, ends.tolist(), strict=True):
        if good[start:end].all() and not back[start : end - 1].any():
            out.append((b, None))
        else:
            out.append(_fix(a[start:end], now))
        start = end
    return out


def _fix(a: np.ndarray, now: float) -> tuple[bytes, str]:
    t = a["t"]
    reasons = []
    with np.errstate(invalid="ignore"):
        nan = ~np.isfinite(t)
        ahead = ~nan & (t > now + MAX_AHEAD)
    out_of_range = (a["c"] < 0) | (a["c"] > MAX_BYTES) | (a["m"] < 0) | (a["m"] > MAX_BYTES)
    if nan.any():
        reasons.append(f"{int(nan.sum())} with a time that is no finite number")
    if ahead.any():
        reasons.append(
            f"{int(ahead.sum())} up to {float(t[ahead].max()) - now:.0f} s ahead of the "
            "scheduler's clock (is the worker's clock right?)"
        )
    if out_of_range.any():
        reasons.append(f"{int(out_of_range.sum())} with bytes outside [0, 2**50]")
    kept = a[~(nan | ahead | out_of_range)]
    text = f"{len(a) - len(kept)} of {len(a)} samples dropped: " + "; ".join(reasons)
    if len(kept) > 1 and (kept["t"][1:] < kept["t"][:-1]).any():
        kept = kept[np.argsort(kept["t"], kind="stable")]
        text = "samples out of time order, sorted" + ("" if len(kept) == len(a) else "; " + text)
    return kept.tobytes(), text


def _number(v: Any) -> bool:
    return type(v) is float or type(v) is int


def _kind(v: Any) -> str:
    return f"a {type(v).__name__}"


def _short(v: Any) -> str:
    """A short repr (never the whole of a huge value)."""
    return _REPR.repr(v)


_REPR = reprlib.Repr()
_REPR.maxstring = _REPR.maxother = 40
