"""PyTorch inside the worker's budget at every pool kind, on a GPU with a CUDA build of torch:
after the stack's pool grew and its arrays were freed, the room made for PyTorch's
out-of-memory (``make_room(library="torch")``, what a task's re-run calls first) gives that
memory back where PyTorch allocates: to PyTorch's cap (a pool with a maximum) or to the device
(the async resource, a pool without a maximum). Each kind runs in its own process."""

from __future__ import annotations

import textwrap

import pytest

from tests.allocators.test_torch_cache_gpu import _run

pytestmark = pytest.mark.gpu

_SCENARIO = textwrap.dedent(
    """
    import json, sys
    import torch
    from dask_rmm import DeviceBuffer, _cuda
    from dask_rmm.allocators import arbitration, set_allocators
    from dask_rmm.allocators.torch import get_torch_cache
    from dask_rmm.stack.build import build_stack
    from dask_rmm.stack.options import RMMOptions
    from dask_rmm.worker.stacks import install_stack

    MiB = 1 << 20
    kinds = {
        "async": dict(base_resource="async", release_threshold=4096 * MiB),
        "pool": dict(pool_size=256 * MiB),
        "pool-max": dict(pool_size=256 * MiB, maximum_pool_size=4096 * MiB),
    }
    stack = build_stack(RMMOptions(allocators=["torch"], **kinds[sys.argv[1]]), 0)
    install_stack(stack)
    set_allocators(["torch"])
    cache = get_torch_cache()
    torch.empty(MiB, dtype=torch.uint8, device="cuda")  # PyTorch's context
    buf = DeviceBuffer(size=2048 * MiB)  # the stack grows ...
    del buf  # ... and its arrays are freed: the pool or the async pool keeps the memory
    _cuda.device_synchronize()
    out = {"free_before": _cuda.mem_get_info()[0], "cap_before": cache.cap(0)}
    room = arbitration.make_room(0, 1024 * MiB, library="torch")
    _cuda.device_synchronize()
    out["free_after"] = _cuda.mem_get_info()[0]
    out["cap_after"] = cache.cap(0)
    out["released"] = room.released
    x = torch.empty(1024 * MiB, dtype=torch.uint8, device="cuda")  # PyTorch uses it
    out["torch_in_use"] = cache.in_use_bytes(0)
    print("RESULT" + json.dumps(out))
    """
)


@pytest.mark.parametrize("kind", ["async", "pool", "pool-max"])
def test_after_the_pool_grew_and_shrank_pytorch_gets_the_memory_given_back(kind):
    MiB = 1 << 20
    out = _run(_SCENARIO, kind)
    assert out["released"].get("pool", 0) >= 1024 * MiB, out
    if kind == "pool-max":  # PyTorch's cap follows the room the pool leaves
        assert out["cap_after"] - out["cap_before"] >= 1024 * MiB, out
    else:  # the device got it back
        assert out["free_after"] - out["free_before"] >= 1024 * MiB, out
    assert out["torch_in_use"] >= 1024 * MiB


_HEARTBEAT = textwrap.dedent(
    """
    import json
    import torch
    from dask_rmm import DeviceBuffer
    from dask_rmm.allocators import set_allocators
    from dask_rmm.stack.build import build_stack
    from dask_rmm.stack.options import RMMOptions
    from dask_rmm.wire import DeviceSample
    from dask_rmm.worker.metrics import WorkerMetrics, _DeviceSamples
    from dask_rmm.worker.stacks import install_stack

    MiB = 1 << 20
    stack = build_stack(RMMOptions(pool_size=512 * MiB, allocators=["torch"]), 0)
    install_stack(stack)
    set_allocators(["torch"])
    x = torch.empty(256 * MiB, dtype=torch.uint8, device="cuda")
    buf = DeviceBuffer(size=128 * MiB)
    s = DeviceSample.from_dict(WorkerMetrics._device_metrics(_DeviceSamples(stack), 10, []))
    out = {
        "process": s.process_used_bytes, "measured": s.outside_measured,
        "outside": s.outside_dask_rmm_bytes, "used": s.device_used_bytes,
        "held": s.reserved_bytes + s.library_outside_bytes, "breakdown": s.breakdown(),
    }
    print("RESULT" + json.dumps(out))
    """
)


def test_outside_dask_rmm_is_measured_from_the_drivers_figure_for_this_process():
    out = _run(_HEARTBEAT)
    assert out["measured"], out  # NVML told this process's device memory
    assert out["process"] >= out["held"] >= 768 << 20  # the pool's 512 MiB + PyTorch's 256
    assert out["outside"] == out["process"] - out["held"] > 0  # the CUDA context at least
    assert out["process"] <= out["used"]
    parts = dict((k, v) for k, v in out["breakdown"])
    assert "outside dask-rmm (measured)" in parts and sum(parts.values()) == out["used"]


_OUT_OF_MEMORY = textwrap.dedent(
    """
    import importlib.util, json
    import numpy as np
    from dask_rmm import _cuda
    from dask_rmm.allocators.arbitration import is_device_out_of_memory, runs_again

    too_much = 2 * _cuda.mem_get_info()[1]  # twice the device: out of memory in every library
    tries = {"numpy (host)": lambda: np.empty(1 << 60, dtype=np.uint8)}

    def dask_rmm_buffer():
        from dask_rmm import DeviceBuffer, mr
        DeviceBuffer(size=too_much, mr=mr.CudaMemoryResource())

    tries["DeviceBuffer"] = dask_rmm_buffer
    if importlib.util.find_spec("cupy"):
        tries["cupy"] = lambda: __import__("cupy").empty(too_much, dtype="uint8")
    if importlib.util.find_spec("numba"):
        tries["numba"] = lambda: __import__("numba.cuda").cuda.device_array(too_much, dtype="uint8")
    if importlib.util.find_spec("torch"):
        import torch
        tries["torch"] = lambda: torch.empty(too_much, dtype=torch.uint8, device="cuda")
    if importlib.util.find_spec("rmm"):
        tries["rmm"] = lambda: __import__("rmm").DeviceBuffer(size=too_much)
    out = {}
    for name, attempt in tries.items():
        try:
            attempt()
            out[name] = "no error"
        except BaseException as e:
            out[name] = [type(e).__module__ + "." + type(e).__name__, is_device_out_of_memory(e), runs_again(e)]
    print("RESULT" + json.dumps(out))
    """
)


def test_each_librarys_device_out_of_memory_is_one_and_only_pytorchs_runs_a_task_again():
    """Issue 43 item 1 on the real libraries: a device out-of-memory error of each, told apart
    from NumPy's host one; only PyTorch's own allocator's re-runs a task (every other was
    retried in place by the stack, or never drew from it)."""
    out = _run(_OUT_OF_MEMORY)
    assert out["numpy (host)"][1:] == [False, False], out
    for name, got in out.items():
        if name != "numpy (host)":
            assert got != "no error" and got[1] is True, (name, got)
            assert got[2] is (name == "torch"), (name, got)
