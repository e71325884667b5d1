"""Draw the dashboard's panel layout (titles and queries) from its JSON, as a PNG: a preview
of where each panel sits, not a Grafana screenshot.

    python examples/grafana/draw_layout.py [-o docs/grafana-layout.png]
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from dask_rmm.plotting.figures import figure

HERE = Path(__file__).resolve().parent


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("-o", "--output", default="grafana-layout.png")
    args = ap.parse_args()
    dash = json.loads((HERE / "dask-rmm-dashboard.json").read_text())
    rows = max(p["gridPos"]["y"] + p["gridPos"]["h"] for p in dash["panels"])
    fig = figure("the layout drawing", figsize=(14, rows * 0.33))
    ax = fig.add_axes((0.01, 0.01, 0.98, 0.95))
    ax.set_xlim(0, 24)
    ax.set_ylim(rows, 0)
    ax.axis("off")
    for p in dash["panels"]:
        g = p["gridPos"]
        colour = "#e8eef6" if p["type"] == "timeseries" else "#f6efe3"
        ax.add_patch(_rect(g["x"] + 0.1, g["y"] + 0.1, g["w"] - 0.2, g["h"] - 0.2, colour))
        ax.text(
            g["x"] + 0.3,
            g["y"] + 0.5,
            p["title"],
            fontsize=10,
            weight="bold",
            va="top",
            parse_math=False,
        )
        width = int(g["w"] * 7.5)
        queries = "\n".join(
            e if len(e) <= width else e[: width - 3] + "..."
            for e in (t["expr"] for t in p["targets"])
        )
        ax.text(
            g["x"] + 0.3,
            g["y"] + 1.5,
            queries,
            fontsize=7,
            family="monospace",
            va="top",
            parse_math=False,
        )
    fig.suptitle(f"{dash['title']}: panel layout and queries (drawn from the dashboard JSON)")
    fig.savefig(args.output, dpi=90)
    print(f"wrote {args.output}")


def _rect(x: float, y: float, w: float, h: float, colour: str):
    from matplotlib.patches import Rectangle

    return Rectangle((x, y), w, h, facecolor=colour, edgecolor="#889", linewidth=1)


if __name__ == "__main__":
    main()
