"""The options table of docs/workers.md against the code: every option it lists exists, every
flag it names is the preload's, and none that works is called reserved or without effect."""

from __future__ import annotations

import re
from dataclasses import fields
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def _option_rows() -> list[tuple[list[str], str, str]]:
    """``(options, preload flag, meaning)`` for each row of the table that names an option."""
    rows = []
    for line in (ROOT / "docs" / "workers.md").read_text().splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) != 4 or not cells[0].startswith("`"):
            continue
        options = [re.match(r"\w+", o).group() for o in re.findall(r"`([^`]+)`", cells[0])]
        rows.append((options, cells[1], cells[3]))
    return rows


def test_the_table_is_found():
    names = {o for opts, _f, _m in _option_rows() for o in opts}
    assert {"pool_size", "device_memory_limit", "spill_on_oom", "device_pause_fraction"} <= names


@pytest.mark.parametrize("row", _option_rows(), ids=lambda r: r[0][0])
def test_a_documented_option_exists_and_is_not_called_reserved(row):
    from dask_rmm.plugin import RMMPlugin
    from dask_rmm.stack.options import RMMOptions

    options, _flag, meaning = row
    known = {f.name for f in fields(RMMOptions)} | set(
        RMMPlugin.__init__.__code__.co_varnames[: RMMPlugin.__init__.__code__.co_argcount]
    )
    assert set(options) <= known, options
    # Every option of the table is wired to the stack or the pressure layer.
    assert not re.search(r"no effect|reserved(?: for|,|:| as)", meaning), meaning


@pytest.mark.parametrize("row", [r for r in _option_rows() if r[1]], ids=lambda r: r[0][0])
def test_a_documented_flag_is_the_preloads(row):
    from dask_rmm.preload import _FLAGS

    flags = {name for f, _o, _s in _FLAGS for name in f.split("/")}
    assert set(re.findall(r"`([^`]+)`", row[1])) <= flags, row[1]
