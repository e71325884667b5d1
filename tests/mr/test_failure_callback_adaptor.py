"""FailureCallbackResourceAdaptor: retry while the callback says so."""

from __future__ import annotations

import pytest

from dask_rmm.mr import (
    CallbackMemoryResource,
    FailureCallbackResourceAdaptor,
    LimitingResourceAdaptor,
)


def test_retries_until_callback_gives_up(base_resource):
    limited = LimitingResourceAdaptor(base_resource, allocation_limit=1024)
    held = [limited.allocate(1024)]
    calls = []

    def free_cache(nbytes):
        calls.append(nbytes)
        if held:
            limited.deallocate(held.pop(), 1024)
            return True
        return False

    mr = FailureCallbackResourceAdaptor(limited, free_cache)
    p = mr.allocate(1000)  # fails, callback frees, retry succeeds
    assert calls == [1000]
    with pytest.raises(MemoryError):
        mr.allocate(1000)  # callback has nothing left: gives up
    assert calls == [1000, 1000]
    mr.deallocate(p, 1000)
    assert limited.get_allocated_bytes() == 0


def test_callback_called_n_times():
    attempts = []

    def alloc(n, s):
        attempts.append(n)
        if len(attempts) < 4:
            raise MemoryError("full")
        return 0x1000

    retries = []
    mr = FailureCallbackResourceAdaptor(
        CallbackMemoryResource(alloc, lambda p, n, s: None), lambda n: retries.append(n) or True
    )
    assert mr.allocate(64) == 0x1000
    assert len(attempts) == 4 and retries == [64, 64, 64]


def test_other_errors_and_callback_errors_propagate():
    def alloc(n, s):
        raise RuntimeError("not memory")

    mr = FailureCallbackResourceAdaptor(
        CallbackMemoryResource(alloc, lambda p, n, s: None), lambda n: True
    )
    with pytest.raises(RuntimeError, match="not memory"):
        mr.allocate(1)

    def oom(n, s):
        raise MemoryError("oom")

    def bad_callback(n):
        raise KeyError("callback broke")

    mr = FailureCallbackResourceAdaptor(
        CallbackMemoryResource(oom, lambda p, n, s: None), bad_callback
    )
    with pytest.raises(KeyError, match="callback broke"):
        mr.allocate(1)


def test_wrong_free_passes_upstream_error(base_resource):
    mr = FailureCallbackResourceAdaptor(base_resource, lambda n: False)
    p = mr.allocate(256)
    with pytest.raises(ValueError):
        mr.deallocate(p, 128)
    mr.deallocate(p, 256)
    assert mr.callback(1) is False


def test_callback_must_be_callable(base_resource):
    with pytest.raises(TypeError, match="callable"):
        FailureCallbackResourceAdaptor(base_resource, 3)
