"""CallbackMemoryResource: RMM's callback signatures."""

from __future__ import annotations

import pytest

from dask_rmm.mr import CallbackMemoryResource, SystemMemoryResource
from dask_rmm.stream import DEFAULT_STREAM, Stream


def test_calls_with_rmm_signatures(base_resource):
    calls = []

    def alloc(nbytes, stream):
        calls.append(("a", nbytes, stream))
        return base_resource.allocate(nbytes, stream)

    def dealloc(ptr, nbytes, stream):
        calls.append(("d", ptr, nbytes, stream))
        base_resource.deallocate(ptr, nbytes, stream)

    mr = CallbackMemoryResource(alloc, dealloc)
    p = mr.allocate(256)
    mr.deallocate(p, 256)
    assert calls == [("a", 256, DEFAULT_STREAM), ("d", p, 256, DEFAULT_STREAM)]
    assert isinstance(calls[0][2], Stream)


def test_stream_passed_through_as_stream():
    seen = []
    mr = CallbackMemoryResource(
        lambda n, s: seen.append(s) or 0x100, lambda p, n, s: seen.append(s)
    )
    mr.allocate(1, None)
    mr.deallocate(0x100, 1, 7)
    assert seen == [DEFAULT_STREAM, Stream(7)]


def test_errors_propagate_and_bad_returns_refused():
    def dealloc(p, n, s):
        raise ValueError("not mine")

    mr = CallbackMemoryResource(lambda n, s: "nope", dealloc)
    with pytest.raises(TypeError, match="must return the pointer as an int"):
        mr.allocate(1)
    with pytest.raises(ValueError, match="not mine"):
        mr.deallocate(1, 1)


def test_needs_callables():
    with pytest.raises(TypeError, match="allocate_func"):
        CallbackMemoryResource(None, lambda p, n, s: None)
    with pytest.raises(TypeError, match="deallocate_func"):
        CallbackMemoryResource(lambda n, s: 0, 5)


@pytest.mark.parametrize(
    "raised, caught",
    [
        (MemoryError, MemoryError),
        (RuntimeError, RuntimeError),
        (ValueError, RuntimeError),
        (Exception, RuntimeError),
        (BaseException, RuntimeError),
    ],
)
def test_allocate_callback_errors_map_as_rmm(raised, caught):
    base = SystemMemoryResource()

    def allocate(nbytes, stream):
        raise raised("my alloc error")

    mr = CallbackMemoryResource(allocate, base.deallocate)
    with pytest.raises(caught, match="my alloc error") as info:
        mr.allocate(256)
    if caught is not raised:
        assert type(info.value.__cause__) is raised


def test_allocate_callback_keyboard_interrupt_passes_through():
    def allocate(nbytes, stream):
        raise KeyboardInterrupt

    mr = CallbackMemoryResource(allocate, lambda *a: None)
    with pytest.raises(KeyboardInterrupt):
        mr.allocate(256)
