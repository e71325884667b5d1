"""cuDF inside the budget (host memory, a stand-in for cuDF's spill manager with its public
interface: ``get_global_manager()``, ``spill_device_memory(nbytes)``, ``buffers()`` of objects
with ``size``, ``is_spilled``, ``spillable``): when an allocation fails, the library caches give
back first, then cuDF spills its least recently used spillable buffers, then task outputs
spill; the allocation is retried in place after each step. Real cuDF: test_cudf_spilling_gpu."""

from __future__ import annotations

import sys
import types

import pytest
from library_cache_helpers import HostLibraryCache

from dask_rmm.allocators import arbitration, caches
from tests.pressure_helpers import MiB, patterned_buffer, pressure_stack


class _Buffer:
    """A cuDF buffer holding device memory of the worker's stack until it is spilled."""

    def __init__(self, nbytes: int, spillable: bool = True):
        self.size = nbytes
        self.spillable = spillable
        self.device = patterned_buffer(nbytes, nbytes)
        self.host: bytes | None = None

    @property
    def is_spilled(self) -> bool:
        return self.device is None

    def spill(self) -> None:
        self.host = bytes(self.device.copy_to_host())
        self.device = None


class _SpillManager:
    def __init__(self) -> None:
        self._buffers: list[_Buffer] = []  # least recently used first

    def buffers(self) -> tuple[_Buffer, ...]:
        return tuple(self._buffers)

    def spill_device_memory(self, nbytes: int) -> int:
        spilled = 0
        for buf in self._buffers:
            if not buf.is_spilled and buf.spillable:
                buf.spill()
                spilled += buf.size
                if spilled >= nbytes:
                    break
        return spilled


@pytest.fixture
def cudf(monkeypatch):
    """cuDF with its spilling on, as far as dask-rmm can tell: its manager."""
    manager = _SpillManager()
    spill_manager = types.ModuleType("cudf.core.buffer.spill_manager")
    spill_manager.get_global_manager = lambda: manager  # type: ignore[attr-defined]
    for name in ("cudf", "cudf.core", "cudf.core.buffer"):
        monkeypatch.setitem(sys.modules, name, types.ModuleType(name))
    monkeypatch.setitem(sys.modules, spill_manager.__name__, spill_manager)
    return manager


def test_a_failed_allocation_has_caches_give_back_then_cudf_spill_then_outputs(cudf):
    wp, top = pressure_stack(8 * MiB, spill_on_oom=True)
    cache = HostLibraryCache()
    caches.register_cache(cache)
    wp.store["out"] = patterned_buffer(2 * MiB, 1)
    cudf._buffers += [_Buffer(MiB), _Buffer(MiB, spillable=False), _Buffer(2 * MiB)]
    cache.free(cache.malloc(2 * MiB))  # 8 MiB taken: 2 output, 4 cuDF, 2 free in the cache
    held = [patterned_buffer(2 * MiB, 2)]  # the cache gave back: cuDF and the output stay
    assert cache.cached_bytes(0) == 0 and not any(b.is_spilled for b in cudf._buffers)
    assert caches.spilled_by_libraries() == {"cudf": (0, 3 * MiB)}
    held.append(patterned_buffer(2 * MiB, 3))  # cuDF spills its spillable buffers
    assert [b.is_spilled for b in cudf._buffers] == [True, False, True]
    assert caches.spilled_by_libraries() == {"cudf": (3 * MiB, 0)}
    assert wp.metrics()[0].total_spilled_count == 0  # outputs not spilled yet
    held.append(patterned_buffer(2 * MiB, 4))  # cuDF has nothing left to spill: the output
    assert wp.metrics()[0].total_spilled_bytes == 2 * MiB
    assert wp.oom_events() == []


def test_make_room_spills_cudfs_buffers_before_outputs(cudf):
    wp, top = pressure_stack(8 * MiB, spill_on_oom=True)
    wp.store["out"] = patterned_buffer(2 * MiB, 1)
    cudf._buffers += [_Buffer(2 * MiB)]
    caches.set_oom_handler(0, wp.devices[0].spill_for_cache)
    room = arbitration.make_room(0, 2 * MiB, library="rmm")
    assert room.released == {"cudf": 2 * MiB} and room.spilled == 0
    room = arbitration.make_room(0, 2 * MiB, library="rmm")
    assert room.released == {} and room.spilled == 2 * MiB


def test_without_cudf_imported_nothing_is_asked_of_it():
    assert "cudf" not in sys.modules
    assert caches.spill_libraries(MiB) == {} and caches.spilled_by_libraries() == {}


def test_cudf_is_never_imported_from_here_while_it_is_being_imported(monkeypatch):
    """cuDF half imported (by another thread, whose allocation may be the one failing): its spill
    manager is looked up, never imported. Importing it from here met the importing thread's
    module lock and raised _DeadlockError in a task on the GPU."""
    attempts: list[str] = []

    class _Recorder:
        def find_spec(self, name, path=None, target=None):
            if name.startswith("cudf"):
                attempts.append(name)
            return None

    package = types.ModuleType("cudf")
    package.__path__ = []  # a package: its submodules would be looked for
    monkeypatch.setitem(sys.modules, "cudf", package)
    monkeypatch.setattr(sys, "meta_path", [_Recorder(), *sys.meta_path])
    assert caches.spill_libraries(MiB) == {} and caches.spilled_by_libraries() == {}
    # Half initialised: the module is there, its function not yet.
    half = types.ModuleType("cudf.core.buffer.spill_manager")
    monkeypatch.setitem(sys.modules, half.__name__, half)
    assert caches.spill_libraries(MiB) == {} and caches.spilled_by_libraries() == {}
    assert attempts == []
