"""PyTorch's own caching allocator under the worker's budget (``allocators=["torch"]``), on a GPU
with a CUDA build of torch: PyTorch allocates natively beside the pool, its cap follows the pool,
the pool counts PyTorch before it grows, the heartbeat breaks the device down, release and
spilling empty PyTorch's cache, and 8 threads under stress neither deadlock nor pass the
maximum. Each scenario runs in its own process (PyTorch's allocator is per process). The limits
are checked on in-process figures (the pool's bytes and PyTorch's), not on the device's used
memory, which other tests running on the GPU at the same time move too."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
import time

import pytest

pytestmark = pytest.mark.gpu

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _torch_cuda() -> bool:
    try:
        import torch
    except ImportError:
        return False
    return bool(torch.cuda.is_available())


def _wait_for_free_device_memory(nbytes: int, seconds: float) -> None:
    from dask_rmm import _cuda

    deadline = time.monotonic() + seconds
    while _cuda.mem_get_info()[0] < nbytes and time.monotonic() < deadline:
        time.sleep(1)


def _stopped_at_the_budget(out: dict) -> bool:
    """Whether every library of a fill run stopped at the budget (PyTorch at its cap, the
    others at the pool's maximum beside PyTorch), not at a device another process filled."""
    torch_error = str(out.get("torch", {}).get("error"))
    return "allowed" in torch_error and all(
        "torch beside the pool holds" in str(out.get(lib, {}).get("error"))
        for lib in ("cupy", "numba", "DeviceBuffer")
    )


def _budget_child(*args: str, timeout: float = 240) -> dict:
    """One of bench/torch_budget.py's children (``stress``, ``fill``): its result."""
    return _run(
        "", os.path.join(ROOT, "bench", "torch_budget.py"), "--child", *args, timeout=timeout
    )


def _run(code: str, *args: str, timeout: float = 240) -> dict:
    if not _torch_cuda():
        pytest.skip("torch with CUDA is not installed")
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([ROOT, env.get("PYTHONPATH", "")])
    proc = subprocess.run(
        [sys.executable, *(["-c", code] if code else []), *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        env=env,
        cwd=ROOT,
    )
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT")]
    assert lines, f"rc {proc.returncode}: {proc.stderr[-3000:]}"
    return json.loads(lines[-1][len("RESULT") :])


_SCENARIO = textwrap.dedent(
    """
    import gc, json
    import torch
    from dask_rmm import DeviceBuffer, mr
    from dask_rmm.allocators import caches, set_allocators
    from dask_rmm.allocators.torch import get_torch_cache, set_torch_allocator
    from dask_rmm.stack.build import build_stack
    from dask_rmm.stack.options import RMMOptions
    from dask_rmm.worker.metrics import WorkerMetrics, _DeviceSamples
    from dask_rmm.worker.stacks import install_stack
    from dask_rmm.wire import DeviceSample

    MiB = 1 << 20
    opts = RMMOptions(pool_size=256 * MiB, maximum_pool_size=2048 * MiB, allocators=["torch"])
    stack = build_stack(opts, 0)
    install_stack(stack)
    pool = stack.top.upstream_mr
    set_allocators(["torch"])
    cache = get_torch_cache()
    out = {"cap_at_start": cache.cap(0), "pool_at_start": pool.pool_size()}
    x = torch.empty(512 * MiB, dtype=torch.uint8, device="cuda")
    out["stack_bytes_with_tensor"] = stack.statistics.current_bytes
    out["torch_in_use"] = cache.in_use_bytes(0)
    try:
        torch.empty(1400 * MiB, dtype=torch.uint8, device="cuda")  # 512 + 1400 > 1792 - 2
        out["torch_past_cap"] = "no error"
    except torch.OutOfMemoryError as e:
        out["torch_past_cap"] = "OutOfMemoryError"
    buf = DeviceBuffer(size=600 * MiB)  # the pool grows: PyTorch's room shrinks first
    out["pool_after_growth"] = pool.pool_size()
    out["cap_after_growth"] = cache.cap(0)
    try:
        DeviceBuffer(size=900 * MiB)  # 512 of PyTorch's + the pool's > 2 GiB
        out["pool_past_torch"] = "no error"
    except MemoryError as e:
        out["pool_past_torch"] = str(e)
    del x  # now free in PyTorch's cache: the pool's growth makes it give it back
    out["torch_cached_after_del"] = cache.cached_bytes(0)
    big = DeviceBuffer(size=900 * MiB)
    out["torch_reserved_after_pool_took_room"] = cache.reserved_bytes(0)
    d = WorkerMetrics._device_metrics(_DeviceSamples(stack), 10, [])
    s = DeviceSample.from_dict(d)
    out["error"] = d.get("error")
    out["libraries"] = [list(x) for x in s.libraries]
    out["breakdown"] = s.breakdown()
    out["device_used"] = s.device_used_bytes
    out["outside"] = s.outside_dask_rmm_bytes
    del big, buf
    out["made_room"] = cache.make_room(0, 2048 * MiB)  # what a retry after PyTorch's OOM calls
    out["cap_after_trim"] = cache.cap(0)
    out["pool_after_trim"] = pool.pool_size()
    y = torch.empty(64 * MiB, dtype=torch.uint8, device="cuda")
    del y
    out["released"] = caches.release_cached(0)
    try:
        set_torch_allocator(cache=False)
        out["exact_after_cache"] = "no error"
    except RuntimeError as e:
        out["exact_after_cache"] = str(e)
    print("RESULT" + json.dumps(out))
    """
)


def test_torch_cache_shares_the_pools_maximum_and_reports_its_bytes():
    MiB = 1 << 20
    out = _run(_SCENARIO)
    assert out["pool_at_start"] == 256 * MiB
    assert out["cap_at_start"] == 2048 * MiB - 256 * MiB
    assert out["stack_bytes_with_tensor"] == 0  # PyTorch's cache is beside the stack
    assert out["torch_in_use"] == 512 * MiB
    assert out["torch_past_cap"] == "OutOfMemoryError"
    assert out["cap_after_growth"] == 2048 * MiB - out["pool_after_growth"]
    assert "torch beside the pool holds" in out["pool_past_torch"]
    assert out["torch_cached_after_del"] >= 512 * MiB
    assert out["torch_reserved_after_pool_took_room"] < 512 * MiB  # empty_cache gave it back
    assert out["error"] is None
    libs = {x[0]: x for x in out["libraries"]}
    assert libs["torch"][3] == 1  # beside the stack
    assert sum(n for _, n in out["breakdown"]) == out["device_used"]
    assert out["outside"] > 0  # the CUDA context at least
    assert out["made_room"] >= 1500 * MiB
    assert out["cap_after_trim"] == 2048 * MiB - out["pool_after_trim"]
    assert out["released"] >= 64 * MiB
    assert "caching allocator already serves" in out["exact_after_cache"]


def test_the_exact_paths_private_pytorch_name_is_still_there():
    """``exact_allocators=["torch"]`` needs ``torch._C._cuda_customAllocator`` (private); the
    cache path uses public names only. Fails when PyTorch moves it."""
    if not _torch_cuda():
        pytest.skip("torch with CUDA is not installed")
    import torch

    assert hasattr(torch._C, "_cuda_customAllocator"), torch.__version__


def test_eight_threads_of_stress_neither_deadlock_nor_pass_the_maximum():
    out = _budget_child(
        "stress",
        "--stress",
        "15",
        "--threads",
        "8",
        "--maximum",
        str(3 << 30),
        timeout=200,
    )
    assert out["deadlocked_threads"] == 0, out
    assert out["errors"] == [], out
    assert out["torch_oom"] > 0 and out["backward"] > 0 and out["ops"] > 1000, out
    # At every growth of the pool, its bytes plus PyTorch's, and plus PyTorch's room, were
    # within the maximum (in-process figures: other tests may use the GPU meanwhile)
    assert out["pool_growth_checks"] > 0 and out["within_maximum"], out


_WITHOUT_THE_PRIVATE_HOOK = textwrap.dedent(
    """
    import json, logging
    import torch
    del torch._C._cuda_customAllocator  # a PyTorch that moved it
    from dask_rmm import mr
    from dask_rmm.allocators import set_allocators
    from dask_rmm.allocators import torch as torch_hook

    records = []
    logging.getLogger("dask_rmm.allocators.torch").addHandler(
        type("H", (logging.Handler,), {"emit": lambda self, r: records.append(r.getMessage())})()
    )
    stats = mr.StatisticsResourceAdaptor(
        mr.PoolMemoryResource(mr.CudaMemoryResource(), initial_pool_size=1 << 26,
                              maximum_pool_size=1 << 30))
    mr.set_current_device_resource(stats)
    set_allocators(["torch"], exact=["torch"])
    set_allocators(["torch"], exact=["torch"])
    x = torch.ones(1 << 20, device="cuda")
    print("RESULT" + json.dumps({
        "allocator_none": torch_hook.rmm_torch_allocator is None,
        "cache": torch_hook.get_torch_cache() is not None,
        "stack_bytes": stats.allocation_counts.current_bytes,
        "cap": torch_hook.get_torch_cache().cap(0),
        "warnings": [m for m in records if "_cuda_customAllocator" in m],
    }))
    """
)


def test_without_the_private_hook_the_exact_path_falls_back_to_the_cache_with_one_warning():
    out = _run(_WITHOUT_THE_PRIVATE_HOOK)
    assert out["allocator_none"] and out["cache"]
    assert out["stack_bytes"] == 0  # PyTorch's own allocator served the tensor
    assert out["cap"] == (1 << 30) - (1 << 26)
    assert len(out["warnings"]) == 1, out["warnings"]


@pytest.mark.timeout(400)
def test_each_library_filled_past_the_maximum_stops_at_it_and_the_error_says_why():
    """PyTorch, CuPy, Numba and DeviceBuffers, each filled while the others hold memory: the
    pool's bytes plus PyTorch's never pass the maximum; PyTorch stops with its own out-of-memory
    error at its cap, the others with the pool's, which names PyTorch's share."""
    pytest.importorskip("cupy")
    pytest.importorskip("numba")
    maximum = 2 << 30
    # Under a parallel suite other processes may fill the device itself for a while (pools of
    # half the free memory): a library then stops at the device, not at the budget, and the
    # run says nothing about the budget. Wait for room, and run again when that happened.
    deadline = time.monotonic() + 200
    while True:
        _wait_for_free_device_memory(maximum + (4 << 30), seconds=30)
        out = _budget_child("fill", "--maximum", str(maximum), timeout=120)
        if _stopped_at_the_budget(out) or time.monotonic() > deadline:
            break
        time.sleep(5)
    assert set(out) >= {"torch", "cupy", "numba", "DeviceBuffer"}, out
    for library in ("torch", "cupy", "numba", "DeviceBuffer"):
        got = out[library]
        assert got["error"] is not None and not got["over_maximum"], (library, got)
        assert got["pool_plus_torch"] <= maximum, (library, got)
        assert got["filled_bytes"] > 0, (library, got)
    assert "OutOfMemoryError" in out["torch"]["error"] and "allowed" in out["torch"]["error"]
    for library in ("cupy", "numba", "DeviceBuffer"):
        assert "torch beside the pool holds" in out[library]["error"], out[library]
    if "rmm" in out:  # compiled RMM (cuDF's allocations), where installed: under the same cap
        got = out["rmm"]
        assert got["error"] is not None and not got["over_maximum"], got
        assert got["pool_plus_torch"] <= maximum and got["filled_bytes"] > 0, got
