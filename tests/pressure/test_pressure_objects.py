"""What can be spilled (dask_rmm.pressure.device_objects) and the coalescing victim choice
(dask_rmm.pressure.victims)."""

from __future__ import annotations

import pickle

import numpy as np
import pytest

from dask_rmm import DeviceBuffer
from dask_rmm.mr import SystemMemoryResource, set_per_device_resource
from dask_rmm.pressure.device_objects import HostCopy, device_allocations, to_host
from dask_rmm.pressure.victims import coalescing_victims, lru_victims


def test_non_device_values_are_not_spillable():
    for value in (1, "x", b"y", np.zeros(3), None, [1, 2], (), {"a": 1}, [[DeviceBuffer]]):
        assert device_allocations(value) is None


def test_device_buffer_roundtrip_is_bit_identical():
    mr = SystemMemoryResource()
    set_per_device_resource(0, mr)  # copies come back on the device's current resource
    buf = DeviceBuffer.to_device(bytes(range(256)) * 5, mr=mr)
    (alloc,) = device_allocations(buf)
    assert (alloc.ptr, alloc.nbytes, alloc.device) == (buf.ptr, 1280, 0)
    copy = to_host(buf)
    assert isinstance(copy, HostCopy) and copy.nbytes == 1280
    back = copy.to_device()
    assert isinstance(back, DeviceBuffer) and back.ptr != buf.ptr
    assert back.tobytes() == buf.tobytes()
    # A pickled copy (distributed spilling it to disk) rebuilds the same bytes.
    again = pickle.loads(pickle.dumps(copy)).to_device()
    assert again.tobytes() == buf.tobytes()


def test_containers_keep_their_structure_and_other_items():
    mr = SystemMemoryResource()
    set_per_device_resource(0, mr)
    a = DeviceBuffer.to_device(b"a" * 300, mr=mr)
    b = DeviceBuffer.to_device(b"b" * 500, mr=mr)
    value = {"x": (a, 5, "s"), "y": [b]}
    allocs = device_allocations(value)
    assert sorted(x.nbytes for x in allocs) == [300, 500]
    copy = to_host(value)
    assert copy.nbytes == 800
    back = copy.to_device()
    assert type(back) is dict and type(back["x"]) is tuple and type(back["y"]) is list
    assert back["x"][1:] == (5, "s")
    assert back["x"][0].tobytes() == b"a" * 300 and back["y"][0].tobytes() == b"b" * 500


def test_big_containers_are_not_walked():
    mr = SystemMemoryResource()
    buf = DeviceBuffer(size=10, mr=mr)
    assert device_allocations([buf] * 65) is None
    assert device_allocations([buf] * 64) is not None


# -- victims ----------------------------------------------------------------------------------

# One 1000-byte chunk: A [0,100) free [100,200) X [200,300) C [300,400) free [400,450)
# D [450,600) free [600,1000). A, C, D are spillable; X is held by something else.
CHUNKS = [(0, 1000)]
FREE = [(100, 100), (400, 50), (600, 400)]
LIVE = [(0, 100), (200, 100), (300, 100), (450, 150)]
CANDS = [("A", 100, [0]), ("C", 100, [300]), ("D", 150, [450])]


@pytest.mark.parametrize(
    "request_bytes, expected",
    [(200, []), (500, ["D"]), (700, ["C", "D"]), (800, None), (1001, None)],
)
def test_coalescing_victims_pick_the_cheapest_window(request_bytes, expected):
    assert coalescing_victims(CANDS, request_bytes, CHUNKS, FREE, LIVE) == expected


def test_coalescing_victims_never_cross_chunks():
    chunks = [(0, 500), (500, 500)]
    free = [(400, 100), (500, 100)]
    live = [(0, 400), (600, 400)]
    cands = [("L", 400, [0]), ("R", 400, [600])]
    assert coalescing_victims(cands, 200, chunks, free, live) == ["L"]  # 400+100 in chunk 0
    assert coalescing_victims(cands, 600, chunks, free, live) is None


def test_coalescing_prefers_older_on_ties():
    chunks = [(0, 300)]
    free = [(100, 100)]
    live = [(0, 100), (200, 100)]
    assert coalescing_victims(
        [("old", 100, [0]), ("new", 100, [200])], 200, chunks, free, live
    ) == ["old"]
    assert coalescing_victims(
        [("new", 100, [200]), ("old", 100, [0])], 200, chunks, free, live
    ) == ["new"]


# One 1000-byte chunk in which a library cache (CuPy's MemoryPool) drew two blocks and carved
# arrays out of them: block P [0,400) holds a at 0 and b at 256 (b's pointer is inside the block,
# not at its start); free [400,600); block Q [600,1000) holds c at 600.
CACHE_CHUNKS = [(0, 1000)]
CACHE_FREE = [(400, 200)]
CACHE_LIVE = [(0, 400), (600, 400)]


@pytest.mark.parametrize(
    "cands, request_bytes, expected",
    [
        # a block is freed only with every candidate inside it, whatever their order or offsets
        ([("a", 256, [0]), ("b", 144, [256])], 600, ["a", "b"]),
        ([("b", 144, [256]), ("a", 256, [0])], 600, ["b", "a"]),
        ([("b", 144, [399]), ("a", 256, [0])], 600, ["b", "a"]),
        # only a pointer inside the block: the block is that candidate's
        ([("b", 144, [256])], 600, ["b"]),
        # both blocks, three candidates
        ([("a", 256, [0]), ("b", 144, [256]), ("c", 400, [600])], 1000, ["a", "b", "c"]),
        # equal cost, Q's candidate is older: Q, and P's two arrays stay
        ([("c", 400, [600]), ("a", 256, [0]), ("b", 144, [256])], 600, ["c"]),
        # a pointer outside every live block owns nothing
        ([("x", 100, [450])], 600, None),
    ],
)
def test_coalescing_victims_count_every_candidate_inside_a_block(cands, request_bytes, expected):
    """Only the array at a cache block's start was mapped to the block: spilling it freed
    nothing while the others in the block lived, and spill-on-OOM then gave up with most of the
    pool spillable (the H200's "OOM with 7.92 MiB free of a 64 MiB pool" through CuPy's cache)."""
    assert coalescing_victims(cands, request_bytes, CACHE_CHUNKS, CACHE_FREE, CACHE_LIVE) == (
        expected
    )


def test_lru_victims():
    cands = [("a", 10, []), ("b", 20, []), ("c", 30, [])]
    assert lru_victims(cands, 0) == []
    assert lru_victims(cands, 10) == ["a"]
    assert lru_victims(cands, 11) == ["a", "b"]
    assert lru_victims(cands, 1000) == ["a", "b", "c"]


def test_importing_the_pressure_layer_imports_no_library():
    import subprocess
    import sys

    code = (
        "import sys, dask_rmm; before = set(sys.modules); import dask_rmm.pressure.worker; "
        "print(sorted(m for m in set(sys.modules) - before if m.split('.')[0] in "
        "('cupy', 'numba', 'distributed', 'cuda') or m == 'dask_rmm._cuda'))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"


def test_a_spill_batch_synchronizes_each_device_once_per_thread():
    from dask_rmm.pressure.device_objects import _synchronize, spill_batch

    calls = []
    sync = {d: (lambda d=d: calls.append(d)) for d in (0, 1)}
    _synchronize(0, sync[0])
    _synchronize(0, sync[0])  # outside a batch: every time
    assert calls == [0, 0]
    calls.clear()
    with spill_batch():
        for d in (0, 1, 0, 1, 0):
            _synchronize(d, sync[d])
        with spill_batch():  # nested: still the outer batch
            _synchronize(0, sync[0])
        _synchronize(1, sync[1])
    assert calls == [0, 1]
    _synchronize(0, sync[0])  # the batch is over
    assert calls == [0, 1, 0]
