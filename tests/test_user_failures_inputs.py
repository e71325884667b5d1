"""Bad input to public functions: the error names the argument the caller used and leaves the
state as it was. Found by probing every public function with wrong types and sizes."""

from __future__ import annotations

import pytest

import dask_rmm
from dask_rmm import mr
from dask_rmm.plugin import RMMPlugin


@pytest.mark.parametrize(
    "kwargs, error, names",
    [
        (dict(initial_pool_size=-1), ValueError, "initial_pool_size"),
        (dict(initial_pool_size="abc"), ValueError, "initial_pool_size"),
        (dict(initial_pool_size=[1]), TypeError, "initial_pool_size"),
        (dict(initial_pool_size=float("nan")), ValueError, "initial_pool_size"),
        (dict(initial_pool_size=1 << 22, maximum_pool_size=-5), ValueError, "maximum_pool_size"),
        (dict(logging=True, log_file_name=123), TypeError, "log_file_name"),
        (dict(devices="0"), TypeError, "devices"),
        (dict(devices=-1), ValueError, "devices"),
    ],
)
def test_a_failed_reinitialize_names_the_argument_and_keeps_the_resource(kwargs, error, names):
    """``reinitialize(initial_pool_size=-1)`` said "pool_size=-1", a name reinitialize does not
    have; ``log_file_name=123`` raised os.fspath's "expected str, bytes or os.PathLike"."""
    dask_rmm.reinitialize(pool_allocator=True, initial_pool_size=1 << 22, base_resource="system")
    before = mr.get_current_device_resource()
    with pytest.raises(error) as info:
        dask_rmm.reinitialize(pool_allocator=True, base_resource="system", **kwargs)
    message = str(info.value)
    assert message.startswith(names) or f"`{names}`" in message or f"{names} " in message, message
    assert mr.get_current_device_resource() is before


def test_allocators_that_are_not_names_are_refused_naming_the_option():
    """``RMMPlugin(allocators=5)`` raised "'int' object is not iterable"."""
    with pytest.raises(TypeError, match="`allocators` must be library names .* got 5"):
        RMMPlugin(allocators=5)
    with pytest.raises(ValueError, match="unknown library 'nope' in `allocators`"):
        RMMPlugin(allocators=["nope"])
