"""worker_stack helpers that need no cluster: which allocator CuPy uses, in words."""

from __future__ import annotations

import pytest

from dask_rmm.worker.stacks import cupy_allocator_note


def test_cupy_allocator_note_names_the_allocator_cupy_uses():
    cupy = pytest.importorskip("cupy")
    from dask_rmm.allocators.cupy import reset_cupy_allocator, set_cupy_allocator

    before = cupy.cuda.get_allocator()
    assert "dask-rmm does not see or count it" in cupy_allocator_note()
    set_cupy_allocator()
    try:
        note = cupy_allocator_note()
        assert note.startswith("CuPy allocates through its own MemoryPool over dask-rmm's")
        assert "library_cached_bytes" in note
        set_cupy_allocator(cache=False)
        note = cupy_allocator_note()
        assert note.startswith(
            "CuPy allocates through dask_rmm.allocators.cupy.lean_cupy_allocator"
        )
        assert "counted in its metrics" in note
        # a compiled-RMM allocator (dask-cuda's rmm_allocator_external_lib_list) is named so
        fake = lambda nbytes: None  # noqa: E731
        fake.__module__, fake.__qualname__ = "rmm.allocators.cupy", "rmm_cupy_allocator"
        cupy.cuda.set_allocator(fake)
        assert cupy_allocator_note() == (
            "CuPy allocates through rmm.allocators.cupy.rmm_cupy_allocator (compiled RMM's "
            "current device resource; dask-rmm does not see or count it)"
        )
    finally:
        cupy.cuda.set_allocator(before)
        reset_cupy_allocator()
    assert cupy.cuda.get_allocator() is before
