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


_POOL_SCENARIO = textwrap.dedent(
    """
    import json
    import sys
    if sys.argv[1] == "before":
        import cudf  # imported before the pool is installed: its option is set
    from dask_rmm.allocators import caches, set_allocators
    from dask_rmm.allocators.rmm_interop import get_rmm_cache
    from dask_rmm.stack.build import build_stack
    from dask_rmm.stack.options import RMMOptions
    from dask_rmm.worker.stacks import install_stack

    MiB = 1 << 20
    options = RMMOptions(allocators=["rmm"], pool_size=256 * MiB, maximum_pool_size=256 * MiB)
    install_stack(build_stack(options, 0))
    set_allocators(["rmm"])  # compiled RMM's pool, with dask-rmm's failure callback
    import cudf  # "after": imported only now, its option read from the environment
    n = 48 * MiB // 8
    frames = [cudf.DataFrame({"a": range(i * n, (i + 1) * n)}) for i in range(6)]  # 288 MiB
    out = {
        "spill_on_demand": cudf.get_option("spill_on_demand"),
        "spilled": caches.spilled_by_libraries().get("cudf", (0, 0))[0],
        "retries": get_rmm_cache(0).retries,
        "sums": [int(f["a"].sum()) for f in frames],
    }
    print("RESULT" + json.dumps(out))
    """
)


@pytest.mark.parametrize("imported", ["before", "after"])
def test_cudf_spilling_on_beside_dask_rmms_rmm_pool_spills_through_its_callback(imported):
    # CUDF_SPILL=on with allocators=["rmm"]: cuDF's own spill on demand would refuse the pool's
    # failure callback (ValueError at its first buffer); the pool's callback spills cuDF's
    # buffers instead, and what does not fit in the 256 MiB budget is spilled, not lost.
    pytest.importorskip("cudf", reason="cuDF is not installed")
    import json
    import os
    import subprocess
    import sys

    env = dict(os.environ, PYTHONPATH=os.pathsep.join([ROOT, os.environ.get("PYTHONPATH", "")]))
    env["CUDF_SPILL"] = "on"
    env.pop("CUDF_SPILL_ON_DEMAND", None)
    proc = subprocess.run(
        [sys.executable, "-c", _POOL_SCENARIO, imported],
        capture_output=True, text=True, env=env, timeout=240,
    )  # fmt: skip
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT")]
    assert lines, proc.stderr[-3000:]
    out = json.loads(lines[-1][len("RESULT") :])
    assert out["spill_on_demand"] is False
    assert out["spilled"] >= 32 << 20 and out["retries"] >= 1, out
    n = 48 * (1 << 20) // 8
    assert out["sums"] == [(2 * i + 1) * n * n // 2 - n // 2 for i in range(6)]
