import pickle

import pytest

from dask_rmm.mr import OutOfMemoryError, SystemMemoryResource
from dask_rmm.mr.base import ReservedMemoryInfo, check_nbytes
from dask_rmm.sizes import align_up, format_bytes


def test_align_up():
    assert [align_up(n) for n in (0, 1, 255, 256, 257)] == [0, 256, 256, 256, 512]


@pytest.mark.parametrize("bad", [-1, 1.5, "3", None, True])
def test_check_nbytes_refuses(bad):
    with pytest.raises((TypeError, ValueError), match="nbytes"):
        check_nbytes(bad)


@pytest.mark.parametrize(
    "n, text",
    [(100, "100 B"), (3 << 30, "3.00 GiB"), (3 << 50, "3.00 PiB"), (-(2 << 50), "-2.00 PiB")],
)
def test_format_bytes_is_dasks_with_a_sign(n, text):
    assert format_bytes(n) == text
    assert format_bytes(None) == "unlimited"


def test_oom_pickles_with_fields():
    e = OutOfMemoryError("x", requested=5, pool_size=7, resource="Pool")
    e2 = pickle.loads(pickle.dumps(e))
    assert isinstance(e2, MemoryError)
    assert (e2.requested, e2.pool_size, e2.resource, str(e2)) == (5, 7, "Pool", "x")


def test_fragmentation():
    assert ReservedMemoryInfo(100, 0, 0).fragmentation == 0.0
    assert ReservedMemoryInfo(100, 80, 20).fragmentation == pytest.approx(0.75)


@pytest.mark.parametrize("free, largest", [(100, 50), (100, 100), (100, 25), (0, 0)])
def test_a_pool_with_nothing_in_use_has_no_fragmentation_figure(free, largest):
    assert ReservedMemoryInfo(free, free, largest).fragmentation is None


def test_system_resource_roundtrip_and_bad_frees():
    import ctypes

    mr = SystemMemoryResource()
    p = mr.allocate(1000)
    assert p % 256 == 0
    ctypes.memset(p, 7, 1000)
    with pytest.raises(ValueError, match="wrong size"):
        mr.deallocate(p, 999)
    with pytest.raises(ValueError, match="foreign pointer"):
        mr.deallocate(p + 256, 1000)
    mr.deallocate(p, 1000)
    with pytest.raises(ValueError, match="double free"):
        mr.deallocate(p, 1000)
    assert mr.allocate(0) == 0
    mr.deallocate(0, 0)


def test_gc_paused_lock_holds_the_lock_with_the_collector_off():
    import gc
    import threading

    from dask_rmm.mr.locks import gc_paused_lock

    lock = threading.Lock()
    assert gc.isenabled()
    with gc_paused_lock(lock):
        assert lock.locked() and not gc.isenabled()
    assert not lock.locked() and gc.isenabled()
    gc.disable()
    try:
        with gc_paused_lock(lock):
            pass
        assert not gc.isenabled()  # a collector the caller turned off stays off
    finally:
        gc.enable()


def test_an_adaptor_forwards_what_it_does_not_override():
    from dask_rmm.mr.base import UpstreamResourceAdaptor

    class Bare(UpstreamResourceAdaptor):
        pass

    mr = Bare(SystemMemoryResource())
    ptr = mr.allocate(100)
    assert ptr and ptr % 256 == 0
    with pytest.raises(ValueError, match="deallocate"):
        mr.deallocate(ptr, 99)
    mr.deallocate(ptr, 100)


def test_a_base_resource_names_the_call_for_a_pointer_of_the_wrong_type():
    import numpy as np

    mr = SystemMemoryResource()
    ptr = mr.allocate(100)
    with pytest.raises(TypeError, match=r"SystemMemoryResource\.deallocate\(1\.5, 100\)"):
        mr.deallocate(1.5, 100)
    mr.deallocate(np.int64(ptr), 100)
    assert mr.live_allocations == 0


def test_oom_pickles_with_its_notes_and_attributes_set_later():
    e = OutOfMemoryError("x", requested=5)
    e.add_note("while spilling")
    e.retried = 3  # set after construction, as an adaptor might
    e2 = pickle.loads(pickle.dumps(e))
    assert (e2.requested, e2.retried, e2.__notes__) == (5, 3, ["while spilling"])
