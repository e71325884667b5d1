"""``release_unused``'s arguments are checked on the client: a bad ``size`` raised in every
worker's log, and one address string was taken as a list of its characters. (Apart from
test_release_unused.py: gen_cluster's leak checks cannot run beside its module-wide cluster of
worker processes.)"""

from __future__ import annotations

import pytest
from distributed.utils_test import gen_cluster

import dask_rmm
from dask_rmm.plugin import RMMPlugin


@pytest.mark.parametrize(
    "size, error",
    [(-5, ValueError), ("abc", ValueError), (100, ValueError), (1.5, ValueError),
     (1 << 70, ValueError), ([1], TypeError), (True, TypeError)],
)  # fmt: skip
def test_release_unused_checks_its_size_on_the_client(size, error):
    """A bad ``size`` raised in every worker's ``trim_worker`` (a traceback in each log); now it
    is refused before any client is looked for, naming ``size``."""
    with pytest.raises(error, match="size"):
        dask_rmm.release_unused(None, size)


@pytest.mark.parametrize(
    "kwargs, match",
    [({"workers": 5}, "`workers` must be a worker address"),
     ({"workers": [5]}, "`workers` must be worker addresses"),
     ({"library_caches": "no"}, "`library_caches` must be True or False")],
)  # fmt: skip
def test_release_unused_checks_workers_and_library_caches_on_the_client(kwargs, match):
    with pytest.raises(TypeError, match=match):
        dask_rmm.release_unused(None, **kwargs)


@gen_cluster(client=True, nthreads=[("127.0.0.1", 1), ("127.0.0.1", 1)])
async def test_release_unused_takes_one_address_as_one_worker(c, s, a, b):
    """``workers="tcp://..."`` was iterated character by character (one scheduler error each)."""
    await c.register_plugin(RMMPlugin(base_resource="system", pool_size="8MiB"))
    released = await dask_rmm.release_unused(c, workers=a.address)
    assert list(released) == [a.address]
    assert len(released[a.address]) == 1
    both = await dask_rmm.release_unused(c, 0, workers=(a.address, b.address))
    assert sorted(both) == sorted([a.address, b.address])


@gen_cluster(client=True, nthreads=[("127.0.0.1", 1)])
async def test_release_unused_at_an_address_that_is_no_worker_says_so(c, s, a):
    """It waited 30 s for a port where no worker listens; the scheduler's: a raw TypeError."""
    await c.register_plugin(RMMPlugin(base_resource="system", pool_size="8MiB"))
    for address in ("tcp://127.0.0.1:9", s.address):
        with pytest.raises(ValueError, match=rf"{address} is not a worker of the scheduler"):
            await dask_rmm.release_unused(c, workers=[a.address, address])
