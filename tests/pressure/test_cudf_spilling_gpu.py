"""cuDF inside the budget with real cuDF (its spilling on), in a process of its own: dask-rmm
reads cuDF's spilled and spillable bytes from its spill manager, and making room spills cuDF's
buffers (LRU first) before any task output. Skipped without cuDF."""

from __future__ import annotations

import textwrap

import pytest

from tests.allocators.test_torch_cache_gpu import ROOT

pytestmark = pytest.mark.gpu

_SCENARIO = textwrap.dedent(
    """
    import json
    import cudf
    cudf.set_option("spill", True)
    from dask_rmm.allocators import arbitration, caches

    MiB = 1 << 20
    df = cudf.DataFrame({"a": range(16 * MiB // 8)})  # 16 MiB of int64, spillable
    out = {"before": caches.spilled_by_libraries().get("cudf")}
    room = arbitration.make_room(0, 8 * MiB, library="rmm")
    out["released"] = room.released
    out["after"] = caches.spilled_by_libraries().get("cudf")
    out["sum"] = int(df["a"].sum())  # unspilled on access
    print("RESULT" + json.dumps(out))
    """
)


def test_making_room_spills_cudfs_buffers_and_the_figures_say_so():
    pytest.importorskip("cudf", reason="cuDF is not installed")
    import json
    import os
    import subprocess
    import sys

    env = dict(os.environ, PYTHONPATH=os.pathsep.join([ROOT, os.environ.get("PYTHONPATH", "")]))
    proc = subprocess.run(
        [sys.executable, "-c", _SCENARIO], capture_output=True, text=True, env=env, timeout=240
    )
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT")]
    assert lines, proc.stderr[-3000:]
    out = json.loads(lines[-1][len("RESULT") :])
    MiB = 1 << 20
    assert out["before"][0] == 0 and out["before"][1] >= 16 * MiB
    assert out["released"]["cudf"] >= 8 * MiB
    assert out["after"][0] >= 8 * MiB
    n = 16 * MiB // 8
    assert out["sum"] == n * (n - 1) // 2
