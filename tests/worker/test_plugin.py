"""RMMPlugin: options, config, the worker's stack, log files, heartbeat metrics, attribution,
re-registration, teardown and failing setups; gen_cluster, plus one real LocalCluster."""

from __future__ import annotations

import asyncio
import logging
import os
import pathlib
import time

import dask
import pytest
from conftest import BASE_RESOURCES, HAS_GPU, hold, local_process_cluster, log_records
from distributed import wait
from distributed.utils_test import gen_cluster

from dask_rmm import mr
from dask_rmm.mr.registry import get_per_device_resource, set_per_device_resource
from dask_rmm.plugin import RMMPlugin, RMMSetupError
from dask_rmm.stack.build import log_file_path
from dask_rmm.wire import DeviceSample, device_entries, unpack_samples
from dask_rmm.worker.metrics import METRICS_KEY
from dask_rmm.worker.stacks import worker_stack

MiB = 1 << 20

#: RMMPlugin options per base resource of conftest.BASE_RESOURCES.
_BASE_OPTIONS = {
    "system": {"base_resource": "system"},
    "cuda": {"base_resource": "cuda"},
    "managed": {"base_resource": "cuda", "managed_memory": True},
    "async": {"base_resource": "cuda", "async_alloc": True},
}
_BASE_NAMES = {
    "system": "SystemMemoryResource",
    "cuda": "CudaMemoryResource",
    "managed": "ManagedMemoryResource",
}


@pytest.fixture(params=BASE_RESOURCES)
def base(request):
    return request.param


def _chain(resource) -> list[str]:
    names = []
    while resource is not None:
        names.append(type(resource).__name__)
        resource = getattr(resource, "upstream_mr", None)
    return names


async def _poll(predicate, timeout=10.0, what="condition"):
    deadline = time.monotonic() + timeout
    while True:
        value = predicate()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout}s waiting for {what}")
        await asyncio.sleep(0.02)


def _stack_names(dask_worker=None):
    from dask_rmm.mr.registry import get_per_device_resource

    return _chain(get_per_device_resource(0))


# -- options on the client ------------------------------------------------------------------------


@pytest.mark.parametrize(
    "kwargs, match",
    [
        (
            {"async_alloc": True, "managed_memory": True},
            "`managed_memory` is incompatible with `async_alloc`",
        ),
        ({"release_threshold": "1GiB"}, "`release_threshold` requires a pool: `pool_size`"),
        (
            {"pool_size": "4GiB", "maximum_pool_size": "1GiB"},
            "`maximum_pool_size` .* smaller than `pool_size`",
        ),
        ({"maximum_pool_size": "1GiB"}, "`maximum_pool_size` was given without `pool_size`"),
        ({"pool_size": "4 gigs"}, "pool_size='4 gigs'"),
        ({"pool_size": "GiB"}, "pool_size='GiB'"),
        ({"pool_size": 1.5}, "pool_size=1.5"),
        ({"base_resource": "gpu"}, "`base_resource` must be one of"),
        ({"allocators": ["cupy", "tensorflow"]}, "unknown library 'tensorflow' in `allocators`"),
        ({"exact_allocators": ["cupy", "jax"]}, "unknown library 'jax' in `exact_allocators`"),
        (
            {"base_resource": "system", "async_alloc": True},
            "`async_alloc=True` means base_resource='async', which conflicts",
        ),
        ({"log_directory": 123}, "`log_directory` must be a directory path, got 123"),
        ({"log_directory": "/tmp/a\0b"}, "`log_directory` '/tmp/a\\\\x00b' holds a NUL byte"),
        ({"device_pause_fraction": 1.5}, "`device_pause_fraction`"),
        ({"device_memory_limit": "lots"}, "device_memory_limit='lots'"),
        ({"base_resource": "system", "allocators": "cupy"}, "`allocators`"),
        ({"devices": [0, 0]}, "`devices`"),
        ({"log_directory": ""}, "`log_directory`"),
    ],
)
def test_incompatible_options_fail_on_the_client(kwargs, match):
    with pytest.raises((ValueError, TypeError), match=match):
        RMMPlugin(**kwargs)


_SIZE_OPTIONS = ["pool_size", "maximum_pool_size", "release_threshold", "device_memory_limit"]


@pytest.mark.parametrize("option", _SIZE_OPTIONS)
@pytest.mark.parametrize(
    "value, match",
    [
        (100, "smaller than the 256-byte alignment"),
        (1, "smaller than the 256-byte alignment"),
        ("255", "smaller than the 256-byte alignment"),
        ("200B", "smaller than the 256-byte alignment"),
        (1 << 64, "more memory than any device or host"),
        (10**30, "more memory than any device or host"),
        ("100000000PiB", "more memory than any device or host"),
        (1e25, "more memory than any device or host"),
    ],
)
def test_sizes_no_worker_can_take_fail_on_the_client_naming_the_option(option, value, match):
    """``RMMPlugin(pool_size=100)`` and ``pool_size=10**30`` were accepted here and failed on
    every worker (README: options are checked on the client)."""
    kwargs = {"base_resource": "system", "pool_size": "1MiB", option: value}
    with pytest.raises(ValueError, match=match) as info:
        RMMPlugin(**kwargs)
    assert str(info.value).startswith(f"{option}=")


def test_the_smallest_and_largest_sizes_a_worker_may_take_are_accepted_on_the_client():
    assert RMMPlugin(base_resource="system", pool_size=256).options.pool_size == 256
    huge = (1 << 64) - 256
    assert RMMPlugin(base_resource="system", pool_size=huge).options.pool_size == huge


@gen_cluster(client=True, nthreads=[("127.0.0.1", 1)])
async def test_a_device_the_workers_lack_is_an_rmm_setup_error_and_changes_nothing(c, s, a):
    """``devices=[5]`` failed while installing, after the vote, with a plain ValueError."""
    import dask_rmm

    await c.register_plugin(RMMPlugin(base_resource="system", pool_size="8MiB"))
    before = get_per_device_resource(0)
    for devices in ([5], [0, 5]):
        with pytest.raises(dask_rmm.RMMSetupError, match=rf"{a.address}: .*device 5 does not"):
            await c.register_plugin(RMMPlugin(base_resource="system", devices=devices))
        assert get_per_device_resource(0) is before
        assert [st.device for st in worker_stack(a).active] == [0]


def test_rmm_setup_error_is_exported_without_importing_distributed():
    import subprocess
    import sys

    code = (
        "import sys, dask_rmm; assert 'distributed' not in sys.modules; "
        "assert 'RMMSetupError' in dask_rmm.__all__; "
        "from dask_rmm import RMMSetupError; from dask_rmm.plugin import RMMSetupError as E; "
        "assert RMMSetupError is E"
    )
    subprocess.run([sys.executable, "-c", code], check=True)


def test_exact_allocators_name_libraries_or_all_of_the_cached_ones():
    assert RMMPlugin().options.exact_allocators == ()
    routed = RMMPlugin(allocators="cupy,rmm", exact_allocators="RMM, cupy")
    assert routed.options.exact_allocators == ("rmm", "cupy")
    every = RMMPlugin(allocators="cupy", exact_allocators=True).options.exact_allocators
    assert every == ("cupy", "rmm", "torch")
    assert RMMPlugin(exact_allocators=False).options.exact_allocators == ()
    assert "exact_allocators=['cupy']" in repr(
        RMMPlugin(allocators="cupy", exact_allocators=["cupy"])
    )
    # A library named exact but not routed was left on its own allocator, silently (H100).
    with pytest.raises(ValueError, match=r"`exact_allocators` \['rmm'\] need `allocators`"):
        RMMPlugin(allocators=["cupy", "torch"], exact_allocators=["rmm"])
    for alone in (["cupy"], True, "all"):  # installed nothing, silently
        with pytest.raises(ValueError, match=r"`exact_allocators` \[.*\] need `allocators`"):
            RMMPlugin(exact_allocators=alone)
        with pytest.raises(ValueError, match="need `allocators`"):
            RMMPlugin(exact_allocators=alone, base_resource="system")


def test_dask_cuda_names_choose_the_base_resource():
    assert RMMPlugin(managed_memory=True).options.base_resource == "managed"
    assert RMMPlugin(base_resource="cuda", async_alloc=True).options.base_resource == "async"
    assert RMMPlugin(base_resource="managed").options.base_resource == "managed"


def test_fractions_and_sizes_are_kept_for_the_worker():
    p = RMMPlugin(pool_size="0.5", maximum_pool_size=0.9, base_resource="system").options
    assert p.pool_size == 0.5 and p.maximum_pool_size == 0.9
    p = RMMPlugin(pool_size="64MiB", maximum_pool_size=1 << 30, base_resource="system")
    assert (p.options.pool_size, p.options.maximum_pool_size) == (64 * MiB, 1 << 30)
    assert "pool_size=67108864" in repr(p)
    assert RMMPlugin.name == "dask-rmm" and RMMPlugin.idempotent is False


def test_config_supplies_defaults_and_arguments_win():
    with dask.config.set(
        {
            "dask-rmm.pool-size": "48MiB",
            "dask-rmm.base-resource": "system",
            "dask-rmm.track-allocations": True,
        }
    ):
        p = RMMPlugin().options
        assert (p.pool_size, p.base_resource, p.track_allocations) == (48 * MiB, "system", True)
        p = RMMPlugin(pool_size=None, track_allocations=False).options
        assert (p.pool_size, p.track_allocations) == (None, False)
    assert RMMPlugin(base_resource="system").options.statistics is True
    p = RMMPlugin(base_resource="system", device_memory_limit="0.5", spill_on_oom=True).options
    assert (p.device_memory_limit, p.spill_on_oom, p.device_pause_fraction) == (0.5, True, 0.8)


def test_environment_variables_configure_the_plugin():
    env = {
        "DASK_DASK_RMM__POOL_SIZE": "96MiB",
        "DASK_DASK_RMM__BASE_RESOURCE": "system",
        "DASK_DASK_RMM__ALLOCATORS": "[]",
        "DASK_DASK_RMM__STATISTICS": "false",
    }
    # What dask.config reads from os.environ at import (the preload test uses real variables).
    with dask.config.set(dask.config.collect_env(env)):
        p = RMMPlugin().options
    assert (p.pool_size, p.base_resource, p.statistics) == (96 * MiB, "system", False)


def test_log_file_names_are_safe_and_per_device(tmp_path):
    assert log_file_path(tmp_path, "tcp://10.0.0.1:4242", 1) == str(
        tmp_path / "rmm_log_tcp_10.0.0.1_4242.dev1.csv"
    )
    assert log_file_path(tmp_path, "../../etc/passwd", 0) == str(
        tmp_path / "rmm_log_etc_passwd.dev0.csv"
    )


# -- the worker's stack ---------------------------------------------------------------------------


def test_settings_reach_the_workers_stack(base):
    options = dict(_BASE_OPTIONS[base], track_allocations=True)
    if base != "async":
        options["pool_size"] = "32MiB"

    @gen_cluster(client=True, nthreads=[("127.0.0.1", 1)])
    async def run(c, s, a):
        await c.register_plugin(RMMPlugin(**options))
        names = await c.run(_stack_names)
        expected = [
            "AttributionResourceAdaptor",
            "StatisticsResourceAdaptor",
            "TrackingResourceAdaptor",
        ]
        if base == "async":
            expected += ["CudaAsyncMemoryResource"]
        else:
            expected += ["PoolMemoryResource", _BASE_NAMES[base]]
        assert names == {a.address: expected}
        pool = a.plugins["dask-rmm"].resources()[0]
        while not isinstance(pool, (mr.PoolMemoryResource, mr.CudaAsyncMemoryResource)):
            pool = pool.upstream_mr
        if base != "async":
            assert pool.pool_size() == 32 * MiB

    run()


@gen_cluster(client=True, nthreads=[("127.0.0.1", 1)])
async def test_statistics_off_leaves_only_the_memory_layers(c, s, a):
    await c.register_plugin(RMMPlugin(base_resource="system", statistics=False))
    assert await c.run(_stack_names) == {a.address: ["SystemMemoryResource"]}
    m = device_entries(a.metrics[METRICS_KEY](a))["0"]
    # at their default (0, none, no samples): left out of the heartbeat
    assert m.keys().isdisjoint({"current_bytes", "task_groups", "samples"}), m


@gen_cluster(client=True, nthreads=[("127.0.0.1", 1), ("127.0.0.1", 1)])
async def test_one_log_file_per_worker_and_device(c, s, a, b, tmp_path_factory=None):
    import tempfile

    with tempfile.TemporaryDirectory() as d:
        log_dir = os.path.join(d, "logs")  # made by setup
        await c.register_plugin(RMMPlugin(base_resource="system", log_directory=log_dir))
        futures = c.map(hold, [1000, 2000], workers=[a.address])
        await wait(futures)
        del futures
        paths = {w: log_file_path(log_dir, w.name, 0) for w in (a, b)}
        assert len(set(paths.values())) == 2
        await c.unregister_worker_plugin("dask-rmm")  # closes (flushes) the logs
        # a and b share this process's registry: the allocations went through the newest
        # stack; the other wrote no row, so it made no file.
        (name,) = os.listdir(log_dir)
        assert name in {os.path.basename(p) for p in paths.values()}
        with open(os.path.join(log_dir, name)) as f:
            assert f.readline().strip() == "Thread,Time,Action,Pointer,Size,Stream"
            rows = f.read()
        assert ",allocate,0x" in rows and ",1000," in rows and ",2000," in rows


@gen_cluster(client=True, nthreads=[("127.0.0.1", 1)])
async def test_a_log_file_held_by_another_worker_is_not_shared(c, s, a):
    import fcntl
    import tempfile

    with tempfile.TemporaryDirectory() as d:
        taken = log_file_path(d, a.name, 0)
        fd = os.open(taken, os.O_RDWR | os.O_CREAT)
        fcntl.flock(fd, fcntl.LOCK_EX)  # as another live worker of the same name would
        try:
            await c.register_plugin(RMMPlugin(base_resource="system", log_directory=d))
            path = worker_stack(a).active[0].log_path
            assert path != taken and f"-{os.getpid()}.dev0.csv" in path
            assert not os.path.exists(path)  # made at the first row
            held = c.submit(hold, 1000, workers=[a.address])
            await wait(held)
            worker_stack(a).flush_logs()
            assert ",1000," in pathlib.Path(path).read_text() and os.path.getsize(taken) == 0
            del held
        finally:
            os.close(fd)


# -- metrics and attribution ----------------------------------------------------------------------


@gen_cluster(
    client=True,
    nthreads=[("127.0.0.1", 2)],
    worker_kwargs={"heartbeat_interval": "50ms"},
    config={"dask-rmm.metrics.sample-interval": "20ms"},
)
async def test_metrics_reach_the_scheduler_with_the_right_numbers(c, s, a):
    await c.register_plugin(RMMPlugin(base_resource="system", pool_size="16MiB"))
    # Waited for, never gathered: a gathered copy would be allocated (unattributed) by the client,
    # which shares this process's resource with the worker.
    held = c.map(hold, [1 * MiB, 2 * MiB], key=["hold-1", "hold-2"])
    other = c.submit(hold, 3 * MiB, key="other-1")
    await wait(held + [other])

    def device_metrics():
        m = s.workers[a.address].metrics.get(METRICS_KEY)
        if m and device_entries(m)["0"].get("current_bytes") == 6 * MiB:
            return m
        return None

    m = await _poll(device_metrics, what="6 MiB current on the scheduler")
    assert m["version"] == 4 and m["worker"] == a.name and m["time"] > 0
    d = device_entries(m)["0"]
    assert d["current_count"] == 3 and d["peak_bytes"] == 6 * MiB and d["total_count"] == 3
    assert d["reserved_bytes"] == 16 * MiB
    assert d["pool_free_bytes"] == 10 * MiB and d["largest_free_block"] == 10 * MiB
    # 0 on host memory: at their default, left out (readers take 0)
    assert d.keys().isdisjoint({"failed_allocations", "error", "device_used_bytes"})
    assert "device_total_bytes" not in d
    assert d["resource"] == (
        "AttributionResourceAdaptor>StatisticsResourceAdaptor>PoolMemoryResource>SystemMemoryResource"
    )
    groups = {g[0]: (g[1], g[2]) for g in DeviceSample.from_dict(d).task_groups}
    assert groups["hold"] == (3 * MiB, 3 * MiB)
    assert groups["other"] == (3 * MiB, 3 * MiB)

    # Samples arrive with heartbeats: time, current, max in interval; each is sent with its
    # heartbeat and repeated with the next (the scheduler keeps only the new ones).
    samples, seen = [], set()

    def new_heartbeat():
        m = s.workers[a.address].metrics[METRICS_KEY]
        return m if m["time"] not in seen else None

    while len(seen) < 3:
        m = await _poll(new_heartbeat, what="a new heartbeat")
        seen.add(m["time"])
        samples += unpack_samples(device_entries(m)["0"]["samples"])
    times = [t for t, _, _ in dict.fromkeys(map(tuple, samples))]
    assert samples and times == sorted(times) and len(set(times)) == len(times)
    assert all(cur <= mx for _, cur, mx in samples)

    assert s.workers[a.address].metrics["rmm"] == {"rmm-used": 6 * MiB, "rmm-total": 16 * MiB}

    del held, other
    await _poll(
        lambda: (
            "current_bytes" not in device_entries(s.workers[a.address].metrics[METRICS_KEY])["0"]
        ),
        what="frees to reach the scheduler",
    )
    d = device_entries(s.workers[a.address].metrics[METRICS_KEY])["0"]
    groups = {g[0]: g[1:] for g in DeviceSample.from_dict(d).task_groups}
    assert groups["hold"] == (0, 3 * MiB)


@gen_cluster(client=True, nthreads=[("127.0.0.1", 1)])
async def test_metrics_never_raise(c, s, a):
    await c.register_plugin(RMMPlugin(base_resource="system"))
    plugin = a.plugins["dask-rmm"]

    class Broken:
        @property
        def allocation_counts(self):
            raise RuntimeError("counter exploded")

        def take_interval_peak(self):
            raise RuntimeError("sampler exploded")

    worker_stack(a).active[0].statistics = Broken()
    plugin.worker_metrics.sample()  # logged, not raised
    m = a.metrics[METRICS_KEY](a)
    assert "counter exploded" in device_entries(m)["0"]["error"]
    assert a.metrics["rmm"](a) == {"rmm-used": 0, "rmm-total": 0}


@gen_cluster(
    client=True, nthreads=[("127.0.0.1", 1)], config={"dask-rmm.metrics.top-task-groups": 2}
)
async def test_heartbeat_carries_the_top_task_prefixes(c, s, a):
    await c.register_plugin(RMMPlugin(base_resource="system"))
    futures = [
        c.submit(hold, size, key=f"{name}-1")
        for name, size in [("small", 256), ("large", 8192), ("medium", 2048)]
    ]
    await wait(futures)
    groups = DeviceSample.from_dict(device_entries(a.metrics[METRICS_KEY](a))["0"]).task_groups
    assert [g[0] for g in groups] == ["large", "medium"]


# -- re-registration, teardown, failures ----------------------------------------------------------


@gen_cluster(client=True, nthreads=[("127.0.0.1", 1)])
async def test_registering_again_replaces_and_unregistering_restores(c, s, a):
    # distributed adds its own "rmm" metric when RMM is importable (the GPU machine has it)
    rmm_metric_before = a.metrics.get("rmm")
    before = mr.SystemMemoryResource()
    set_per_device_resource(0, before)
    await c.register_plugin(RMMPlugin(base_resource="system", pool_size="8MiB"))
    first = get_per_device_resource(0)
    await c.register_plugin(RMMPlugin(base_resource="system", pool_size="16MiB"))
    second = get_per_device_resource(0)
    assert second is not first
    names = _chain(second)
    assert names.count("AttributionResourceAdaptor") == 1 and names.count("PoolMemoryResource") == 1
    assert names[-1] == "SystemMemoryResource" and len(names) == 4
    assert device_entries(a.metrics[METRICS_KEY](a))["0"]["reserved_bytes"] == 16 * MiB
    assert list(a.periodic_callbacks).count("dask-rmm-sampler") == 1

    await c.unregister_worker_plugin("dask-rmm")
    assert get_per_device_resource(0) is before
    assert METRICS_KEY not in a.metrics and a.metrics.get("rmm") is rmm_metric_before
    assert "dask-rmm-sampler" not in a.periodic_callbacks


@gen_cluster(client=True, nthreads=[("127.0.0.1", 1)])
async def test_teardown_is_idempotent_and_stops_the_sampler(c, s, a):
    before = mr.SystemMemoryResource()
    set_per_device_resource(0, before)
    await c.register_plugin(RMMPlugin(base_resource="system", pool_size="8MiB"))
    plugin = a.plugins["dask-rmm"]
    sampler = a.periodic_callbacks["dask-rmm-sampler"]
    await wait(c.submit(hold, 4096))
    plugin.teardown(a)
    plugin.teardown(a)  # again (worker close after unregistering, a failed setup...): no-op
    assert not sampler.is_running()
    await _poll(lambda: get_per_device_resource(0) is before, what="the stack removed")
    # A tick or a metrics call that was already on its way when teardown ran does nothing.
    plugin.worker_metrics.sample()
    assert device_entries(plugin.worker_metrics.heartbeat_metrics(a)) == {}
    assert plugin.worker_metrics.rmm_metrics(a) == {"rmm-used": 0, "rmm-total": 0}


@gen_cluster(client=True, nthreads=[("127.0.0.1", 1), ("127.0.0.1", 1)])
async def test_workers_sharing_a_process_tear_down_in_any_order(c, s, a, b):
    before = mr.SystemMemoryResource()
    set_per_device_resource(0, before)
    await c.register_plugin(RMMPlugin(base_resource="system"))
    pa, pb = a.plugins["dask-rmm"], b.plugins["dask-rmm"]
    newest = get_per_device_resource(0)
    assert newest in (pa.resources()[0], pb.resources()[0])
    older = pa if newest is pb.resources()[0] else pb
    older.teardown(a if older is pa else b)
    await asyncio.sleep(0.05)
    assert get_per_device_resource(0) is newest
    await c.unregister_worker_plugin("dask-rmm")
    assert get_per_device_resource(0) is before


@gen_cluster(client=True, nthreads=[("127.0.0.1", 1)])
async def test_a_pool_larger_than_memory_fails_register_plugin_with_the_address(c, s, a):
    before = mr.SystemMemoryResource()
    set_per_device_resource(0, before)
    with pytest.raises(RMMSetupError, match=rf"{a.address}: .*`pool_size` .* is larger than"):
        await c.register_plugin(RMMPlugin(base_resource="system", pool_size="1PiB"))
    assert get_per_device_resource(0) is before  # nothing half-installed
    assert METRICS_KEY not in a.metrics
    # A corrected registration replaces the failed one.
    await c.register_plugin(RMMPlugin(base_resource="system", pool_size="8MiB"))
    assert "PoolMemoryResource" in _chain(get_per_device_resource(0))


def test_a_file_as_log_directory_is_refused_on_the_client(tmp_path):
    (tmp_path / "file").write_text("")
    with pytest.raises(ValueError, match="`log_directory` .*file.* is not a directory"):
        RMMPlugin(base_resource="system", log_directory=tmp_path / "file")


@pytest.mark.skipif(HAS_GPU, reason="checks the no-GPU error; this host has a GPU")
@gen_cluster(client=True, nthreads=[("127.0.0.1", 1)])
async def test_cuda_on_a_host_without_gpu_is_a_clear_error(c, s, a):
    with pytest.raises(RMMSetupError, match=rf"{a.address}: .*needs a CUDA device") as info:
        await c.register_plugin(RMMPlugin(pool_size="64MiB"))
    # the hint names what the user typed, not another API
    assert 'give RMMPlugin(base_resource="system")' in str(info.value)
    assert "SystemMemoryResource()" not in str(info.value)
    # allocators for a library: the missing GPU is the news, not how to install the library
    with pytest.raises(RMMSetupError, match="needs a CUDA device") as info:
        await c.register_plugin(RMMPlugin(allocators=["torch"]))
    assert "install torch" not in str(info.value)


@gen_cluster(client=True, nthreads=[("127.0.0.1", 1)])
async def test_scheduler_plugin_is_installed_once(c, s, a):
    await c.register_plugin(RMMPlugin(base_resource="system"))
    await c.register_plugin(RMMPlugin(base_resource="system"))
    from dask_rmm.wire import PLUGIN_NAME

    assert PLUGIN_NAME in s.plugins


# -- a real cluster of worker processes -----------------------------------------------------------


def _held_bytes(dask_worker):
    m = dask_worker.metrics[METRICS_KEY](dask_worker)
    return {d: v.get("current_bytes", 0) for d, v in device_entries(m).items()}


@pytest.mark.slow
def test_local_cluster_end_to_end(tmp_path, base):
    options = dict(_BASE_OPTIONS[base], log_directory=str(tmp_path))
    if base != "async":
        options["pool_size"] = "32MiB"
    with local_process_cluster() as (cluster, client):
        client.register_plugin(RMMPlugin(**options))
        futures = client.map(hold, [MiB] * 4, key=[f"hold-{i}" for i in range(4)])
        wait(futures)
        held = client.run(_held_bytes)
        assert sum(v["0"] for v in held.values()) == 4 * MiB
        deadline = time.monotonic() + 20
        while True:
            metrics = client.run_on_scheduler(
                lambda dask_scheduler: [
                    ws.metrics.get(METRICS_KEY) for ws in dask_scheduler.workers.values()
                ]
            )
            held = sum(device_entries(m)["0"].get("current_bytes", 0) for m in metrics if m)
            if all(metrics) and held == 4 * MiB:
                break
            assert time.monotonic() < deadline, metrics
            time.sleep(0.1)
        for m in metrics:
            d = device_entries(m)["0"]
            if d.get("current_bytes"):
                assert [g[0] for g in DeviceSample.from_dict(d).task_groups] == ["hold"]
        names = client.run(lambda dask_worker: dask_worker.name)
        expected = sorted(os.path.basename(log_file_path(tmp_path, n, 0)) for n in names.values())
        assert sorted(os.listdir(tmp_path)) == expected


def test_every_argument_of_the_plugin_reaches_its_options(tmp_path):
    """Options are forwarded by name: an argument added to ``RMMPlugin.__init__`` but not to the
    forwarding (``memory_admission`` was, once) would silently keep its default."""
    import inspect

    given = {
        "pool_size": "16MiB",
        "maximum_pool_size": "32MiB",
        "managed_memory": True,
        "async_alloc": False,
        "release_threshold": None,
        "log_directory": str(tmp_path),
        "track_allocations": True,
        "allocators": ["numba"],
        "exact_allocators": ["cupy"],
        "statistics": False,
        "base_resource": "system",
        "devices": [0],
        "device_memory_limit": "24MiB",
        "spill_on_oom": True,
        "device_pause_fraction": 0.5,
        "memory_admission": True,
        "oom_retry": False,
    }
    params = set(inspect.signature(RMMPlugin.__init__).parameters) - {"self"}
    assert params == set(given), "every argument needs a case here"
    for name, value in given.items():
        if name in ("managed_memory", "async_alloc", "release_threshold"):
            continue  # these select base_resource / pool settings checked below
        base = {"pool_size": "8MiB"} if name != "pool_size" else {}
        if name in ("device_pause_fraction", "memory_admission", "oom_retry"):
            base["device_memory_limit"] = "24MiB"
        if name == "exact_allocators":
            base["allocators"] = ["cupy"]
        options = RMMPlugin(**base, **{name: value}).options.to_dict()
        assert options != RMMPlugin(**base).options.to_dict(), f"{name} did not reach the options"
    assert RMMPlugin(managed_memory=True).options.base_resource == "managed"


def test_a_rejected_registration_is_one_line_in_each_log():
    """It wrote a traceback in the scheduler's log and in each worker's; with in-process
    workers (inproc) the client got an AssertionError from distributed instead of the error."""
    from distributed import Client, LocalCluster

    with (
        log_records("distributed.core") as scheduler,
        log_records("distributed.worker") as workers,
        LocalCluster(n_workers=2, threads_per_worker=1, processes=False,
                     dashboard_address=":0", worker_dashboard_address=None) as cluster,
        Client(cluster) as client,
    ):  # fmt: skip
        with pytest.raises(RMMSetupError, match="failed on 2 workers"):
            client.register_plugin(RMMPlugin(base_resource="system", pool_size="1PiB"))
    logged = [r for r in [*scheduler, *workers] if r.levelno >= logging.ERROR]
    assert len(logged) == 3, [r.getMessage() for r in logged]
    for r in logged:
        assert r.exc_info is None and "failed on 2 workers" in r.getMessage(), r.getMessage()
