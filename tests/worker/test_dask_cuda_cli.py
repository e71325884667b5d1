"""dask-cuda users on dask-rmm: ``dask cuda worker ... --preload dask_rmm.preload`` and
``LocalCUDACluster(..., preload=["dask_rmm.preload"])`` configure dask-rmm from dask-cuda's own
``--rmm-*`` flags and keyword arguments, and compiled RMM's pool is not made beside it.

Without a GPU (CI): dask-cuda's command line parsed with dask-rmm's flags, and a real worker
given dask-cuda's ``RMMSetup`` plugin and ``dask_cuda.initialize`` preload as dask-cuda gives
them, on host memory. With a GPU and dask-cuda: real ``dask cuda worker`` processes and
``LocalCUDACluster``, their report, and a dask-cudf workload (skips with a reason otherwise).
"""

from __future__ import annotations

import os
import subprocess

import click
import pytest
from conftest import HAS_GPU
from distributed import Scheduler, Worker
from distributed.utils_test import captured_logger, gen_test
from gpu_cluster import beat, compiled_rmm_resource, device_total_memory, gpu_uuid
from test_preload import DASK, _env, _stop, scheduler, scheduler_process  # noqa: F401  (fixtures)

from dask_rmm.preload import WorkerSetupFailed, dask_setup
from dask_rmm.worker import dask_cuda as dask_cuda_setup
from dask_rmm.worker.stacks import worker_stack

dask_cuda = pytest.importorskip("dask_cuda", reason="needs dask-cuda (pip install dask-cuda)")
from dask_cuda.plugins import RMMSetup  # noqa: E402

TESTS = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
MiB = 1 << 20
BASE = "cuda" if HAS_GPU else "system"


@pytest.fixture
def armed(monkeypatch):
    """Parsing ``dask cuda worker``'s flags here arms this process as a worker command (its
    exit status would follow its workers' failures): record the call instead."""
    calls = []
    monkeypatch.setattr("dask_rmm.worker.fatal.arm_worker_command", lambda: calls.append(1))
    return calls


def _cuda_worker_params(argv: list[str]) -> dict:
    from dask_cuda.cli import worker

    with worker.make_context("worker", list(argv)) as ctx:
        return ctx.params


def test_dask_cuda_worker_keeps_its_rmm_flags_and_hands_dask_rmm_flags_to_the_preload(armed):
    params = _cuda_worker_params(
        [
            "tcp://127.0.0.1:8786",
            "--rmm-pool-size",
            "4GiB",
            "--rmm-async",
            "--preload",
            "dask_rmm.preload",
            "--rmm-base-resource",
            "async",
            "--spill-on-oom",
        ]
    )
    assert (params["rmm_pool_size"], params["rmm_async"]) == ("4GiB", True)
    assert params["preload_argv"] == ("--rmm-base-resource", "async", "--spill-on-oom")
    assert armed  # the command exits with status 1 when a worker's dask-rmm setup fails


def test_dask_cuda_worker_rejects_a_bad_dask_rmm_flag_before_starting(armed):
    with pytest.raises(click.UsageError, match="'x' is not one of 'cuda'"):
        _cuda_worker_params(
            ["tcp://127.0.0.1:8786", "--preload", "dask_rmm.preload", "--rmm-base-resource", "x"]
        )


def test_the_preload_accepts_the_flag_dask_cuda_gives_every_preload():
    """dask-cuda appends ``--create-cuda-context`` to the argv of all preloads (it is its own
    ``dask_cuda.initialize``'s); the preload must not fail on it."""
    ctx = dask_setup.make_context(
        "dask_setup", ["--rmm-base-resource", "system", "--create-cuda-context"]
    )
    assert ctx.params["rmm_base_resource"] == "system"
    assert "flags_error" not in ctx.params


def _rmm_setup(**given) -> RMMSetup:
    """dask-cuda's plugin as ``worker_plugins`` makes it from ``rmm_*`` arguments."""
    options = dict(
        initial_pool_size=None,
        maximum_pool_size=None,
        managed_memory=False,
        async_alloc=False,
        release_threshold=None,
        log_directory=None,
        track_allocations=False,
        external_lib_list=None,
    )
    return RMMSetup(**{**options, **given})


def test_dask_cuda_settings_become_dask_rmm_options_with_dask_cuda_meanings():
    setup = _rmm_setup(
        initial_pool_size="0.5",
        maximum_pool_size="8GiB",
        async_alloc=True,
        release_threshold="1GiB",
        log_directory="/tmp/logs",
        track_allocations=True,
        external_lib_list=["cupy"],
    )
    options = {k: v for k, (v, _) in dask_cuda_setup.options_from_rmm_setup(setup).items()}
    assert options == {
        "pool_size": "0.5",  # a fraction of each worker's GPU, resolved there
        "maximum_pool_size": "8GiB",
        "async_alloc": True,
        "release_threshold": "1GiB",
        "log_directory": "/tmp/logs",
        "track_allocations": True,
        "allocators": ["cupy"],
    }
    dask_cuda_setup.switch_off(setup)
    assert dask_cuda_setup.options_from_rmm_setup(setup) == {}
    setup.setup(worker=None)  # dask-cuda's setup now touches nothing (no rmm import needed)


async def _worker_as_dask_cuda_starts_it(s, setup, argv, **kwargs):
    return Worker(
        s.address,
        nthreads=1,
        plugins={setup},
        preload=["dask_rmm.preload", "dask_cuda.initialize"],
        preload_argv=[*argv, "--no-create-cuda-context"],
        **kwargs,
    )


@pytest.fixture
def rmm_free_thread():
    """dask-rmm's thread for RMM frees deferred out of a garbage collection lives as long as the
    process (started once, when compiled RMM is first served from dask-rmm): start it before
    distributed's thread-leak check takes its snapshot, so that it is not counted as leaked."""
    if HAS_GPU and dask_cuda_setup.compiled_rmm_installed():
        from dask_rmm.allocators import rmm_interop

        rmm_interop._start_free_thread()


@pytest.mark.slow
@gen_test(timeout=60)
async def test_a_worker_with_dask_cudas_rmm_setup_runs_dask_rmm_with_those_settings(
    tmp_path, rmm_free_thread
):
    setup = _rmm_setup(
        initial_pool_size="32MiB",
        maximum_pool_size="64MiB",
        log_directory=str(tmp_path),
        track_allocations=True,
    )
    async with Scheduler(host="127.0.0.1", dashboard_address=":0") as s:
        w = await _worker_as_dask_cuda_starts_it(s, setup, ["--rmm-base-resource", BASE])
        with captured_logger("distributed.preloading") as preloading:
            await w
        async with w:
            options = w.plugins["dask-rmm"].options
            assert (options.pool_size, options.maximum_pool_size) == (32 * MiB, 64 * MiB)
            assert options.track_allocations and options.log_directory == str(tmp_path)
            assert options.base_resource == BASE  # dask-rmm's own flag, beside dask-cuda's
            # compiled RMM (cuDF) is served from dask-rmm's pool where it is installed
            served = "rmm" in options.allocators
            assert served == (dask_cuda_setup.compiled_rmm_installed() and HAS_GPU)
            (stack,) = worker_stack(w).active
            assert stack.pool_size == 32 * MiB and "TrackingResourceAdaptor" in stack.chain
            # dask-cuda's plugin ran, but made nothing: no compiled RMM pool beside ours
            assert w.plugins[next(n for n, p in w.plugins.items() if p is setup)] is setup
            assert setup.initial_pool_size is None and not setup.rmm_track_allocations
            # dask-cuda's preload started too: dask-rmm's flags were not handed to it
            assert "Run preload setup: dask_cuda.initialize" in preloading.getvalue()
            assert "Failed to start preload" not in preloading.getvalue()
            logs = [m for _, m in w.get_logs() if "dask-rmm: worker" in m]
            assert any("--rmm-pool-size 32MiB" in m for m in logs), logs


@pytest.mark.slow
@gen_test(timeout=60)
async def test_a_setting_given_to_dask_cuda_and_to_the_preload_differently_stops_the_worker():
    async with Scheduler(host="127.0.0.1", dashboard_address=":0") as s:
        w = await _worker_as_dask_cuda_starts_it(
            s,
            _rmm_setup(initial_pool_size="32MiB"),
            ["--rmm-base-resource", "system", "--rmm-pool-size", "16MiB"],
        )
        with pytest.raises(WorkerSetupFailed, match="--rmm-pool-size 32MiB .* disagree"):
            await w
        assert w.status.name in ("closed", "failed")  # closed before its start failed
        # the same size spelled another way is no conflict
        w = await _worker_as_dask_cuda_starts_it(
            s,
            _rmm_setup(initial_pool_size="32MiB"),
            ["--rmm-base-resource", "system", "--rmm-pool-size", str(32 * MiB)],
        )
        async with w:
            assert w.plugins["dask-rmm"].options.pool_size == 32 * MiB


# -- with a GPU and dask-cuda ----------------------------------------------------------------


def _worker_env() -> dict[str, str]:
    """The environment of a ``dask cuda worker`` process: functions of tests/gpu_cluster.py,
    which ``client.run`` sends by name, import there."""
    env = _env()
    env["PYTHONPATH"] = TESTS + os.pathsep + env["PYTHONPATH"]
    return env


def _physical_gpu_uuids() -> list[str]:
    """Each visible GPU's UUID, in CUDA_VISIBLE_DEVICES order, as NVML (dask-cuda) reads it."""
    import pynvml
    from gpu_cluster import visible_gpus

    pynvml.nvmlInit()
    n = pynvml.nvmlDeviceGetCount()
    out = []
    for gpu in visible_gpus(n):
        handle = pynvml.nvmlDeviceGetHandleByIndex(int(gpu))
        uuid = pynvml.nvmlDeviceGetUUID(handle)
        out.append(uuid.decode() if isinstance(uuid, bytes) else uuid)
    return out


@pytest.mark.parametrize("pool, expected", [("1GiB", 1 << 30), ("0.1", None)])
@pytest.mark.gpu
@pytest.mark.slow
@pytest.mark.skipif(not HAS_GPU, reason="needs a CUDA device")
def test_dask_cuda_worker_flags_give_each_gpu_a_dask_rmm_pool(scheduler, pool, expected):  # noqa: F811
    from distributed import Client

    from dask_rmm.client.fetch import cluster_report

    pytest.importorskip("rmm", reason="dask-cuda's --rmm-pool-size needs compiled RMM")
    uuids = _physical_gpu_uuids()
    proc = subprocess.Popen(
        [
            *DASK,
            "cuda",
            "worker",
            scheduler,
            "--rmm-pool-size",
            pool,
            "--rmm-maximum-pool-size",
            "0.5",
            "--rmm-track-allocations",
            "--no-dashboard",
            "--preload",
            "dask_rmm.preload",
        ],
        env=_worker_env(),
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    try:
        with Client(scheduler, timeout="60s") as client:
            client.wait_for_workers(len(uuids), timeout=120)
            client.run(beat)
            report = cluster_report(client)
            assert not report.workers_without_dask_rmm
            seen = client.run(gpu_uuid)
            totals = client.run(device_total_memory)
            for w in report.workers:
                dev = report.device(w, 0)
                want = expected or int(totals[w] * 0.1) // 256 * 256
                assert dev.reserved_bytes == want, (w, dev.reserved_bytes, want)
                assert dev.gpu_uuid == seen[w]
            # one worker per physical GPU, each on its own
            assert sorted(seen.values()) == sorted(uuids)
            compiled = set(client.run(compiled_rmm_resource).values())
            assert compiled <= {"no rmm", "CallbackMemoryResource"}, compiled  # no compiled pool
    finally:
        out = _stop(proc)
    assert "Failed to start preload" not in out, out
    assert "dask-cuda's RMM settings (--rmm-pool-size" in out, out


@pytest.mark.gpu
@pytest.mark.slow
@pytest.mark.skipif(not HAS_GPU, reason="needs a CUDA device")
def test_dask_cuda_worker_with_a_failing_dask_rmm_setup_exits_with_one_line(scheduler):  # noqa: F811
    pytest.importorskip("rmm", reason="dask-cuda's --rmm-pool-size needs compiled RMM")
    proc = subprocess.run(
        [
            *DASK,
            "cuda",
            "worker",
            scheduler,
            "--rmm-pool-size",
            "1PiB",
            "--no-dashboard",
            "--preload",
            "dask_rmm.preload",
        ],
        env=_worker_env(),
        capture_output=True,
        text=True,
        timeout=180,
    )
    out = proc.stdout + proc.stderr
    assert proc.returncode == 1, out
    said = [line for line in out.splitlines() if "is larger than" in line]
    # one line per worker that got as far as its setup before the command ended
    assert 1 <= len(said) <= len(_physical_gpu_uuids()), out
    assert "dask-rmm setup failed" in said[0], out
    assert "Traceback" not in out, out


_plugin_options = lambda dask_worker: dask_worker.plugins["dask-rmm"].options.to_dict()  # noqa: E731


@pytest.mark.gpu
@pytest.mark.slow
@pytest.mark.skipif(not HAS_GPU, reason="needs a CUDA device")
@pytest.mark.parametrize(
    "kwargs, base, pool",
    [
        (dict(rmm_pool_size="512MiB", rmm_maximum_pool_size="1GiB"), "cuda", 512 * MiB),
        # dask-cuda warns that a pool size with rmm_async will be an error: none given
        (dict(rmm_async=True, rmm_release_threshold="1GiB"), "async", None),
        (dict(rmm_managed_memory=True, rmm_pool_size="512MiB"), "managed", 512 * MiB),
    ],
)
def test_local_cuda_cluster_keywords_configure_dask_rmm(kwargs, base, pool):
    pytest.importorskip("rmm", reason="dask-cuda's rmm_* keywords need compiled RMM")
    from distributed import Client

    from dask_rmm.client.fetch import cluster_report

    with (
        dask_cuda.LocalCUDACluster(
            n_workers=1, protocol="tcp", dashboard_address=":0", preload=["dask_rmm.preload"],
            **kwargs,
        ) as cluster,
        Client(cluster) as client,
    ):  # fmt: skip
        (options,) = client.run(_plugin_options).values()
        assert options["base_resource"] == base
        assert options["pool_size"] == pool
        client.run(beat)
        report = cluster_report(client)
        (w,) = report.workers
        if pool is not None:
            assert report.device(w, 0).reserved_bytes == pool
        # compiled RMM draws from dask-rmm (a callback at the bottom), never its own cudaMalloc pool
        assert set(client.run(compiled_rmm_resource).values()) <= {
            "no rmm",
            "CallbackMemoryResource",
        }


def _cudf_workload(client, n: int):
    import cudf
    import dask.dataframe as dd
    import dask_cudf  # noqa: F401  (dask's cuDF backend)

    def part(i: int):  # made on the worker: no data in the graph
        start = i * (n // 4)
        return cudf.DataFrame({"a": cudf.Series(range(start, start + n // 4), dtype="int64")})

    df = dd.from_map(part, range(4))
    return (df.a * 2 + 1).persist()


@pytest.mark.gpu
@pytest.mark.slow
@pytest.mark.skipif(not HAS_GPU, reason="needs a CUDA device")
def test_a_dask_cudf_workload_shows_in_the_report_under_its_task_groups():
    pytest.importorskip("cudf", reason="needs cuDF")
    pytest.importorskip("dask_cudf", reason="needs dask-cudf")
    pytest.importorskip("rmm", reason="needs compiled RMM (cuDF allocates through it)")
    from distributed import Client, wait

    from dask_rmm.client.fetch import cluster_report

    n = 1 << 22
    with (
        dask_cuda.LocalCUDACluster(
            n_workers=1, protocol="tcp", dashboard_address=":0", rmm_pool_size="1GiB",
            preload=["dask_rmm.preload"],
        ) as cluster,
        Client(cluster) as client,
    ):  # fmt: skip
        y = _cudf_workload(client, n)
        wait(y)
        client.run(beat)
        report = cluster_report(client)
        (w,) = report.workers
        dev = report.device(w, 0)
        assert dev.reserved_bytes == 1 << 30
        assert dev.current_bytes >= n * 8  # the persisted int64 column lives in our pool
        groups = {g.prefix: g.current_bytes for g in dev.task_groups}
        assert sum(groups.values()) >= n * 8, groups
        del y


def test_without_dask_cuda_worker_environment_nothing_is_armed():
    """The test process itself is never a worker command (a failure would end pytest)."""
    from dask_rmm.worker import fatal

    assert fatal._armed is None
    assert not os.environ.get(fatal.FAILURE_FILE_ENV)
