"""Draws the memory timeline, and where each device's bytes are, as self-contained inline SVG
strings (no JavaScript, no CDN) for the report's HTML and the scheduler's /dask-rmm page."""

from __future__ import annotations

import html
import math
from collections.abc import Sequence

from dask_rmm.sizes import format_bytes

__all__ = ["PALETTE", "breakdown_svg", "bucket_maxima", "timeline_svg"]

#: Line colours, one per series in order (Tableau 10, readable on white).
PALETTE = (
    "#4e79a7",
    "#f28e2b",
    "#e15759",
    "#76b7b2",
    "#59a14f",
    "#edc948",
    "#b07aa1",
    "#ff9da7",
    "#9c755f",
    "#bab0ac",
)

Series = tuple[str, str, Sequence[Sequence[float]]]


def _nice_step(span: float, ticks: int = 5) -> float:
    """A round step (1, 2, 2.5 or 5 times a power of ten) giving about ``ticks`` ticks."""
    raw = span / ticks  # span > 0
    magnitude = 10.0 ** math.floor(math.log10(raw))
    return next(m * magnitude for m in (1, 2, 2.5, 5, 10) if m * magnitude >= raw)


def byte_step(top: float) -> float:
    """A power of two giving at most 5 ticks up to ``top``: labels at round binary sizes."""
    return 2.0 ** max(0, math.ceil(math.log2(max(top, 5) / 5)))


def bucket_maxima(
    points: Sequence[Sequence[float]], t0: float, t1: float, buckets: int
) -> list[float | None]:
    """The most in use in each of ``buckets`` equal time buckets of ``[t0, t1]``, from samples
    ``(time, current_bytes, max_bytes_in_interval)`` oldest first (None: a bucket the samples do
    not cover). A sample's maximum counts in every bucket its interval (since the sample before
    it) touches, and in no other."""
    out: list[float | None] = [None] * buckets
    if not points or buckets < 1:
        return out
    scale = buckets / (t1 - t0) if t1 > t0 else 0.0

    def bucket(t: float) -> int:
        return min(max(int((t - t0) * scale), 0), buckets - 1)

    previous: float | None = None
    for p in points:
        t, m = p[0], p[2]
        first = bucket(t if previous is None else previous)
        for k in range(first, bucket(t) + 1):
            old = out[k]
            out[k] = m if old is None or m > old else old
        previous = t
    return out


def _step_paths(values: Sequence[float | None], xs: Sequence[float], y) -> list[str]:
    """``points`` attributes of polylines drawing ``values`` as steps: bucket ``k`` flat from
    ``xs[k]`` to ``xs[k + 1]``; a run of uncovered buckets breaks the line."""
    paths: list[str] = []
    current: list[str] = []
    for k, v in enumerate([*values, None]):
        if v is None:
            if current:
                paths.append(" ".join(current))
            current = []
            continue
        yy = f"{y(v):.1f}"
        if current and current[-1].endswith("," + yy):  # the same height: extend the step
            current[-1] = f"{xs[k + 1]:.1f},{yy}"
        else:
            current += [f"{xs[k]:.1f},{yy}", f"{xs[k + 1]:.1f},{yy}"]
    return paths


def timeline_svg(series: Sequence[Series], *, width: int = 900, height: int = 280) -> str:
    """An ``<svg>`` element of ``width`` x ``height`` pixels: memory over time, one line per
    ``(label, status, samples)`` series, drawn as steps: the most in use in each time bucket of
    a pixel (:func:`bucket_maxima` of the samples' ``max_bytes_in_interval``; samples
    are ``(time, current_bytes, max_bytes_in_interval)``); dashed unless "running" or "total"
    (drawn dark)."""
    left, right, top, bottom = 78, 190, 12, 34
    pw, ph = width - left - right, height - top - bottom
    pts = [p for _, _, s in series for p in s]
    if not pts:
        return f'<svg xmlns="http://www.w3.org/2000/svg" width="{width}" height="40"><text x="8" y="24">no samples yet</text></svg>'
    t0 = min(p[0] for p in pts)
    t1 = max(p[0] for p in pts)
    ymax = max(max(p[2] for p in pts), 1)
    ystep = byte_step(ymax)
    ytop = ystep * (int(ymax / ystep) + 1)
    tspan = max(t1 - t0, 1e-9)

    def x(t: float) -> float:
        return left + (t - t0) / tspan * pw

    def y(v: float) -> float:
        return top + ph - v / ytop * ph

    out = [
        f'<svg xmlns="http://www.w3.org/2000/svg" width="{width}" height="{height}" '
        f'viewBox="0 0 {width} {height}" font-family="sans-serif" font-size="11">',
        f'<rect x="{left}" y="{top}" width="{pw}" height="{ph}" fill="#fafafa" stroke="#ccc"/>',
    ]
    for i in range(round(ytop / ystep) + 1):
        v = i * ystep
        yy = y(v)
        out += [
            f'<line x1="{left}" x2="{left + pw}" y1="{yy:.1f}" y2="{yy:.1f}" stroke="#e4e4e4"/>',
            f'<text x="{left - 6}" y="{yy + 4:.1f}" text-anchor="end">{format_bytes(v)}</text>',
        ]
    tstep = _nice_step(tspan)
    for k in range(int((tspan + 1e-9) / tstep) + 1):
        xx = x(t0 + k * tstep)
        out += [
            f'<line x1="{xx:.1f}" x2="{xx:.1f}" y1="{top + ph}" y2="{top + ph + 4}" '
            'stroke="#888"/>',
            f'<text x="{xx:.1f}" y="{top + ph + 16}" text-anchor="middle">{k * tstep:g}s</text>',
        ]
    out.append(
        f'<text x="{left + pw / 2:.0f}" y="{height - 3}" text-anchor="middle" fill="#555">'
        "seconds since the oldest sample</text>"
    )
    buckets = max(1, pw)
    edges = [left + k * pw / buckets for k in range(buckets + 1)]
    for i, (label, status, samples) in enumerate(series):
        color = "#222" if status == "total" else PALETTE[i % len(PALETTE)]
        dash = ' stroke-dasharray="5,3"' if status not in ("running", "total") else ""
        if len(samples) == 1:
            t, _, m = samples[0]
            out.append(f'<circle cx="{x(t):.1f}" cy="{y(m):.1f}" r="2.5" fill="{color}"/>')
        else:
            for line in _step_paths(bucket_maxima(samples, t0, t1, buckets), edges, y):
                out.append(
                    f'<polyline fill="none" stroke="{color}" stroke-width="1.5"{dash} '
                    f'points="{line}"/>'
                )
        ly = top + 8 + 16 * i
        if ly < top + ph:
            out += [
                f'<line x1="{left + pw + 12}" x2="{left + pw + 32}" y1="{ly}" y2="{ly}" stroke="{color}" stroke-width="2"{dash}/>',
                f'<text x="{left + pw + 38}" y="{ly + 4}">{html.escape(label)}</text>',
            ]
    out.append("</svg>")
    return "".join(out)


#: Colour of the breakdown's fixed parts; libraries take the palette in order.
_PART_COLORS = {
    "other allocations": "#9c755f",
    "pool free": "#d7d7d7",
    "retired stacks": "#bab0ac",
    "outside dask-rmm": "#555555",
    "outside dask-rmm (measured)": "#555555",
    "other processes": "#2f2f2f",
}

Bar = tuple[str, Sequence[tuple[str, int]], int]


def breakdown_svg(bars: Sequence[Bar], *, width: int = 900) -> str:
    """An ``<svg>`` element with one stacked bar per ``(label, parts, total)``: the ``(part,
    bytes)`` pieces left to right, scaled to the largest ``total`` (the device's memory; the
    sum of the parts when it is 0), a legend of the parts under them. A library's two parts
    (``"<lib> in use"``, ``"<lib> cache free"``) share its colour, the free one lighter."""
    left, right, bar_h, gap = 220, 20, 18, 8
    pw = width - left - right
    names: list[str] = []
    for _, parts, _ in bars:
        names += [p for p, _ in parts if p not in names]
    libs = [n[: -len(" in use")] for n in names if n.endswith(" in use")]
    colors: dict[str, tuple[str, str]] = {}
    for name in names:
        lib = name.rsplit(" ", 2)[0] if name.endswith((" in use", " cache free")) else None
        if lib in libs:
            base = PALETTE[libs.index(lib) % len(PALETTE)]
            colors[name] = (base, "0.45" if name.endswith("cache free") else "1")
        else:
            colors[name] = (_PART_COLORS.get(name, "#bbbbbb"), "1")
    scale = max((t or sum(b for _, b in parts) for _, parts, t in bars), default=0) or 1
    height = len(bars) * (bar_h + gap) + 16 + (len(names) + 3) // 4 * 16 + 8
    out = [
        f'<svg xmlns="http://www.w3.org/2000/svg" width="{width}" height="{height}" '
        f'viewBox="0 0 {width} {height}" font-family="sans-serif" font-size="11">'
    ]
    for i, (label, parts, total) in enumerate(bars):
        y = 4 + i * (bar_h + gap)
        full = (total or sum(b for _, b in parts)) / scale * pw
        out += [
            f'<text x="{left - 6}" y="{y + bar_h - 5}" text-anchor="end">'
            f"{html.escape(label)}</text>",
            f'<rect x="{left}" y="{y}" width="{full:.1f}" height="{bar_h}" fill="#fafafa" '
            'stroke="#ccc"/>',
        ]
        x = float(left)
        for part, nbytes in parts:
            w = nbytes / scale * pw
            if w <= 0:
                continue
            color, opacity = colors[part]
            tip = html.escape(f"{part}: {format_bytes(nbytes)}")
            out.append(
                f'<rect x="{x:.1f}" y="{y}" width="{w:.1f}" height="{bar_h}" fill="{color}" '
                f'fill-opacity="{opacity}"><title>{tip}</title></rect>'
            )
            x += w
        used = sum(b for _, b in parts)
        text = f"{format_bytes(used)} of {format_bytes(total)}" if total else format_bytes(used)
        out.append(
            f'<text x="{min(x + 4, width - 4):.1f}" y="{y + bar_h - 5}" fill="#333">{text}</text>'
        )
    y0 = 4 + len(bars) * (bar_h + gap) + 4
    for k, name in enumerate(names):
        lx = left + (k % 4) * (pw // 4)
        ly = y0 + (k // 4) * 16
        color, opacity = colors[name]
        out.append(
            f'<rect x="{lx}" y="{ly}" width="12" height="10" fill="{color}" '
            f'fill-opacity="{opacity}"/>'
        )
        out.append(f'<text x="{lx + 16}" y="{ly + 9}">{html.escape(name)}</text>')
    out.append("</svg>")
    return "".join(out)
