"""Draws the memory timeline, and where each device's bytes are, as self-contained inline SVG
strings (no JavaScript, no CDN).

Used by the report's HTML and the scheduler's /dask-rmm page; the PNG plot is in ``plot.py``.
"""

from __future__ import annotations

import html
import math
from collections.abc import Sequence

from dask_rmm.sizes import format_bytes

__all__ = ["PALETTE", "breakdown_svg", "timeline_svg"]

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
    raw = span / max(ticks, 1)
    if raw <= 0:
        return 1.0
    magnitude = 10.0 ** math.floor(math.log10(raw))
    return next(m * magnitude for m in (1, 2, 2.5, 5, 10) if m * magnitude >= raw)


def byte_step(top: float) -> float:
    # Ticks at round binary sizes (1, 2, 4, ... x KiB/MiB/GiB) so the labels read cleanly.
    step = 1.0
    while top / step > 5:
        step *= 2
    return step


def _downsample(
    points: Sequence[Sequence[float]], t0: float, t1: float, width: int
) -> list[tuple[float, float]]:
    """At most two points per pixel column (its min and max), so peaks are never lost."""
    if len(points) <= 2 * width or t1 <= t0:
        return [(p[0], p[2]) for p in points]
    buckets: dict[int, list[tuple[float, float]]] = {}
    scale = (width - 1) / (t1 - t0)
    for p in points:
        buckets.setdefault(int((p[0] - t0) * scale), []).append((p[0], p[2]))
    out: list[tuple[float, float]] = []
    for _, pts in sorted(buckets.items()):
        lo = min(pts, key=lambda q: q[1])
        hi = max(pts, key=lambda q: q[1])
        out.extend(sorted({lo, hi}))
    return out


def timeline_svg(series: Sequence[Series], *, width: int = 900, height: int = 280) -> str:
    """An ``<svg>`` element of ``width`` x ``height`` pixels: memory over time, one line per
    ``(label, status, samples)`` series following the samples' ``max_bytes_in_interval``
    (samples are ``(time, current_bytes, max_bytes_in_interval)``); dashed unless "running"
    or "total" (drawn dark)."""
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
        out.append(
            f'<line x1="{left}" x2="{left + pw}" y1="{yy:.1f}" y2="{yy:.1f}" stroke="#e4e4e4"/>'
        )
        out.append(
            f'<text x="{left - 6}" y="{yy + 4:.1f}" text-anchor="end">{format_bytes(v)}</text>'
        )
    tstep = _nice_step(tspan)
    for k in range(int((tspan + 1e-9) / tstep) + 1):
        xx = x(t0 + k * tstep)
        out.append(
            f'<line x1="{xx:.1f}" x2="{xx:.1f}" y1="{top + ph}" y2="{top + ph + 4}" stroke="#888"/>'
        )
        out.append(
            f'<text x="{xx:.1f}" y="{top + ph + 16}" text-anchor="middle">{k * tstep:g}s</text>'
        )
    out.append(
        f'<text x="{left + pw / 2:.0f}" y="{height - 3}" text-anchor="middle" fill="#555">'
        "seconds since the oldest sample</text>"
    )
    for i, (label, status, samples) in enumerate(series):
        color = "#222" if status == "total" else PALETTE[i % len(PALETTE)]
        dash = ' stroke-dasharray="5,3"' if status not in ("running", "total") else ""
        line = " ".join(f"{x(t):.1f},{y(m):.1f}" for t, m in _downsample(samples, t0, t1, pw))
        if len(samples) == 1:
            t, _, m = samples[0]
            out.append(f'<circle cx="{x(t):.1f}" cy="{y(m):.1f}" r="2.5" fill="{color}"/>')
        else:
            out.append(
                f'<polyline fill="none" stroke="{color}" stroke-width="1.5"{dash} points="{line}"/>'
            )
        ly = top + 8 + 16 * i
        if ly < top + ph:
            out.append(
                f'<line x1="{left + pw + 12}" x2="{left + pw + 32}" y1="{ly}" y2="{ly}" stroke="{color}" stroke-width="2"{dash}/>'
            )
            out.append(f'<text x="{left + pw + 38}" y="{ly + 4}">{html.escape(label)}</text>')
    out.append("</svg>")
    return "".join(out)


#: Colour of the breakdown's fixed parts; libraries take the palette in order.
_PART_COLORS = {
    "other allocations": "#9c755f",
    "pool free": "#d7d7d7",
    "retired stacks": "#bab0ac",
    "outside dask-rmm": "#555555",
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
    scale = max((t or sum(b for _, b in parts)) for _, parts, t in bars) if bars else 0
    scale = max(scale, 1)
    legend_rows = (len(names) + 3) // 4
    height = len(bars) * (bar_h + gap) + 16 + legend_rows * 16 + 8
    out = [
        f'<svg xmlns="http://www.w3.org/2000/svg" width="{width}" height="{height}" '
        f'viewBox="0 0 {width} {height}" font-family="sans-serif" font-size="11">'
    ]
    for i, (label, parts, total) in enumerate(bars):
        y = 4 + i * (bar_h + gap)
        out.append(
            f'<text x="{left - 6}" y="{y + bar_h - 5}" text-anchor="end">{html.escape(label)}</text>'
        )
        full = (total or sum(b for _, b in parts)) / scale * pw
        out.append(
            f'<rect x="{left}" y="{y}" width="{full:.1f}" height="{bar_h}" fill="#fafafa" '
            'stroke="#ccc"/>'
        )
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
