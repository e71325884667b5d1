"""The bounds on a worker's dask-rmm heartbeat, enforced when the scheduler reads it (counts,
lengths, nesting, times): what is beyond one is left out, counted and named as the worker's error
(docs/reports.md); types are not checked (the readers never raise). Not here: the records."""

from __future__ import annotations

from collections.abc import Mapping
from itertools import islice
from reprlib import repr as _short
from typing import Any, NamedTuple, cast

import numpy as np

from dask_rmm.scheduler.resolution import SAMPLE_DTYPE
from dask_rmm.wire import METRICS_VERSION, NUMBERS_STRUCT, ROW_FIELDS, SAMPLE_STRUCT, TEXTS

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
#: What a worker sends at the top of a heartbeat.
_TOP = frozenset({"version", "time", "worker", "devices", "numbers", "text", "samples", "other",
                  *ROW_FIELDS})  # fmt: skip


class Checked(NamedTuple):
    """One heartbeat as bounded: ``metrics`` (None: nothing usable), each device's ``samples``
    to check (:func:`check_samples`) by id, ``problems`` as ``(kind, text)``."""

    metrics: dict | None
    samples: dict[str, bytes]
    problems: list[tuple[str, str]]


def check_metrics(m: Any, now: float, arrived: float | None = None) -> Checked:
    """``m`` (a worker's ``metrics["dask-rmm"]``: :func:`dask_rmm.wire.heartbeat`) within the
    bounds, a few checks a column; ``now`` is the scheduler's clock, ``arrived`` when the
    heartbeat came (``WorkerState.last_seen``). Never raises."""
    if type(m) is not dict and not isinstance(m, Mapping):
        return Checked(None, {}, [("format", f"metrics are {_kind(m)}, not a mapping")])
    version = m.get("version")
    if version != METRICS_VERSION or type(version) is not int:
        line = (
            f"heartbeat version {_short(version)}; this scheduler reads version "
            f"{METRICS_VERSION} only: run the same dask-rmm on the workers and the scheduler"
        )
        return Checked(None, {}, [("format", line)])
    problems: list[tuple[str, str]] = []
    t = _heartbeat_time(m.get("time"), now, now if arrived is None else arrived, problems)
    ids, text, blobs = cast(Any, (m.get("devices"), m.get("text"), m.get("samples")))
    if why := _columns_wrong(ids, m.get("numbers"), text, blobs):
        return Checked(None, {}, [*problems, ("format", why)])
    kept = {"devices": ids, "numbers": m["numbers"], "text": text, "samples": blobs}
    if sum(map(len, text)) > MAX_TEXT and max(map(len, text)) > MAX_TEXT:
        kept["text"] = [x if len(x) <= MAX_TEXT else x[:MAX_TEXT] + "..." for x in text]
        cut = sum(len(x) > MAX_TEXT for x in text)
        problems.append(("bounds", f"{cut} text fields cut to {MAX_TEXT} characters"))
    samples = {}  # a dict, not a tuple a device: fewer objects for the collector
    for dev, blob in zip(ids, blobs, strict=True):
        if type(blob) is not bytes or len(blob) % _RECORD or len(blob) > _BLOB:
            what = f"{len(blob)} bytes" if type(blob) is bytes else _kind(blob)
            problems.append(("format", f"device {dev!r}: samples are {what}, not packed"))
        elif blob:
            samples[dev] = blob
    for k, width in ROW_FIELDS.items():
        if k in m and _rows_wrong(k, width, m[k], len(ids)):
            problems.append(("bounds", f"{k} {_short(m[k])}: not {len(ids)} devices' rows, at "
                             f"most {MAX_ENTRIES} a device of names of {MAX_TEXT} characters"))  # fmt: skip
        elif k in m:
            kept[k] = m[k]
    if "other" in m:  # those of no device sent, or no map: dropped and named
        other = m["other"] if type(m["other"]) is dict else {None: m["other"]}
        kept["other"] = {dev: _bound(f"device {dev!r}", d, now, problems)
            for dev, d in islice(other.items(), MAX_DEVICES) if dev in ids and type(d) is dict}  # fmt: skip
        if len(kept["other"]) < min(len(other), MAX_DEVICES):
            problems.append(("format", f"other fields {_short(other)}: not of its devices"))
    worker = m.get("worker")
    if m.keys() <= _TOP and (type(worker) is not str or len(worker) <= MAX_TEXT):
        kept.update(version=version, worker=worker, time=t)
    else:
        rest = {k: v for k, v in m.items() if k not in _TOP or k in ("version", "worker")}
        kept.update(_bound("the heartbeat", rest, now, problems), time=t)
    return Checked(kept, samples, problems)


def _columns_wrong(ids: Any, numbers: Any, text: Any, blobs: Any) -> str | None:
    """What is wrong with the columns every heartbeat has (None: nothing)."""
    if type(ids) not in _SEQUENCES or type(text) not in _SEQUENCES:
        return f"devices are {_kind(ids)} and text {_kind(text)}, not lists"
    if (n := len(ids)) > MAX_DEVICES:
        return f"{n} devices, more than a worker has ({MAX_DEVICES}): none kept"
    try:
        "".join(ids), "".join(text)  # TypeError unless every one is a str
    except TypeError:
        return f"device ids {_short(ids)} or their text fields are not all str"
    if n and not 0 < min(map(len, ids)) <= max(map(len, ids)) <= MAX_KEY or len(set(ids)) < n:
        return f"device ids {_short(ids)}: not distinct str of 1 to {MAX_KEY} characters"
    if (type(numbers) is not bytes or len(numbers) != n * NUMBERS_STRUCT.size
            or len(text) != n * len(TEXTS) or type(blobs) not in _SEQUENCES or len(blobs) != n):  # fmt: skip
        return (f"numbers {_short(numbers)}, {len(text)} text fields or samples "
                f"{_short(blobs)}: not the columns of {n} devices")  # fmt: skip
    return None


def _rows_wrong(k: str, width: int, v: Any, n: int) -> bool:
    """Whether row field ``k`` (``[rows a device, names, int64 numbers]``) is out of bounds."""
    try:
        counts, names, blob = v
        total = sum(counts)
        return not (
            type(counts) in _SEQUENCES and len(counts) == n and type(total) is int  # all ints
            and 0 <= min(counts, default=0) and max(counts, default=0) <= MAX_ENTRIES
            and type(names) in _SEQUENCES and len(names) == total and type(blob) is bytes
            and len(blob) == 8 * total * (width - 1)
            and (len("".join(names)) <= MAX_TEXT or max(map(len, names)) <= MAX_TEXT)
        )  # fmt: skip
    except (TypeError, ValueError):
        return True


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
    it already is: at most :data:`MAX_FIELDS` fields of short names;
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
        elif t in _NUMBERS or (t in (str, bytes) and len(v) <= MAX_TEXT):
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
    kept = [e for e in events[-MAX_OOM_EVENTS:] if _event(e, now)]
    if len(kept) == len(events):
        return events
    problems.append(
        ("bounds", f"{where}: {len(events) - len(kept)} of {len(events)} OOM events dropped "
         f"(kept: the last {MAX_OOM_EVENTS} of plain data with a time)")
    )  # fmt: skip
    return kept


def _event(e: Any, now: float) -> bool:
    """``e`` is an OOM event :func:`_oom_events` keeps."""
    return (
        type(e) is dict
        and _within(e, 3)
        and all(e.get(k) is None or type(e[k]) in (int, float) for k in _OOM_NUMBERS)
        and (e.get("time") is None or EARLIEST <= e["time"] <= now + MAX_AHEAD)
    )


def check_samples(
    blobs: list[bytes], now: float, newest: list[float]
) -> tuple[list[bytes], list[float], dict[int, tuple[str, str]]]:
    """Each packed blob's valid samples (times from 2000 to ``MAX_AHEAD`` past ``now``, bytes in
    ``[0, MAX_BYTES]``, in time order) newer than its device's ``newest``, the time of the last
    of them, and what was wrong with the blobs that had a problem (by index). One numpy pass
    over all of them: the poller checks every heartbeat it reads at once."""
    if not blobs:
        return [], [], {}
    joined = b"".join(blobs)
    a = np.frombuffer(joined, SAMPLE_DTYPE)
    t = a["t"]
    back = t[1:] < t[:-1]
    counts = np.fromiter(map(len, blobs), np.int64, len(blobs)) // _RECORD
    ends = np.cumsum(counts)
    starts = ends - counts
    back[ends[:-1] - 1] = False  # one blob's last sample and the next one's first
    # (NaN times fail the first test: a NaN minimum compares False; a negative byte count is
    # above MAX_BYTES as an unsigned one; fields, not a 2D view: many times faster)
    if (
        t.min() >= EARLIEST
        and t.max() <= now + MAX_AHEAD
        and a["c"].view(np.uint64).max() <= MAX_BYTES
        and a["m"].view(np.uint64).max() <= MAX_BYTES
        and not back.any()
    ):  # samples come in order: the new ones are the last ones
        fresh = np.add.reduceat(t > np.repeat(newest, counts), starts, dtype=np.int64)
        first = ((counts - fresh) * _RECORD).tolist()
        news = [b[f:] if f else b for b, f in zip(blobs, first, strict=True)]
        return news, t[ends - 1].tolist(), {}
    cm = np.frombuffer(joined, np.int64).reshape(-1, 3)[:, 1:]  # bytes, current and max
    good = (t >= EARLIEST) & (t <= now + MAX_AHEAD) & (cm >= 0).all(1) & (cm <= MAX_BYTES).all(1)
    news, lasts, problems = [], [], {}
    for i, (start, end) in enumerate(zip(starts.tolist(), ends.tolist(), strict=True)):
        kept = a[start:end]
        if not good[start:end].all() or back[start : end - 1].any():
            kept, problems[i] = _fix(kept, now)
        new = kept[int(np.searchsorted(kept["t"], newest[i], side="right")) :]
        news.append(new.tobytes())
        lasts.append(float(new["t"][-1]) if len(new) else newest[i])
    return news, lasts, problems


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
