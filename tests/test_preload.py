"""``dask worker --preload dask_rmm.preload --rmm-*``: flags through real ``dask scheduler`` and
``dask worker`` processes, config from the environment, and usage errors for bad flags."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time

import pytest
from click.testing import CliRunner
from conftest import HAS_GPU

from dask_rmm.plugin import METRICS_KEY, log_file_path
from dask_rmm.preload import dask_setup, plugin_from_flags

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DASK = [sys.executable, "-m", "dask"]
BASE = "cuda" if HAS_GPU else "system"


def _env(**extra: str) -> dict[str, str]:
    env = dict(os.environ)
    env["PYTHONPATH"] = ROOT + os.pathsep + env.get("PYTHONPATH", "")
    env.update(extra)
    return env


def _wait_for(predicate, timeout: float, what: str):
    deadline = time.monotonic() + timeout
    while True:
        value = predicate()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout}s waiting for {what}")
        time.sleep(0.1)


@pytest.fixture
def scheduler(tmp_path):
    """A real ``dask scheduler`` process; yields its address."""
    file = tmp_path / "scheduler.json"
    proc = subprocess.Popen(
        [
            *DASK,
            "scheduler",
            "--host",
            "127.0.0.1",
            "--port",
            "0",
            "--no-dashboard",
            "--scheduler-file",
            str(file),
        ],
        env=_env(),
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:
        _wait_for(lambda: file.exists() and file.stat().st_size, 60, "the scheduler file")
        yield json.loads(file.read_text())["address"]
    finally:
        proc.terminate()
        proc.wait(30)


def _start_worker(address: str, *flags: str, name: str, env: dict[str, str] | None = None):
    return subprocess.Popen(
        [
            *DASK,
            "worker",
            address,
            "--name",
            name,
            "--nthreads",
            "1",
            "--no-dashboard",
            "--no-nanny",
            "--preload",
            "dask_rmm.preload",
            *flags,
        ],
        env=env or _env(),
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )


def _stop(proc):
    proc.terminate()
    try:
        return proc.communicate(timeout=30)[0]
    except subprocess.TimeoutExpired:  # pragma: no cover
        proc.kill()
        return proc.communicate()[0]


# A lambda is pickled by value (this test module is not importable in the worker process).
_plugin_options = lambda dask_worker: dask_worker.plugins["dask-rmm"].options  # noqa: E731


@pytest.mark.slow
def test_flags_reach_a_real_worker(scheduler, tmp_path):
    from distributed import Client

    logs = tmp_path / "logs"
    worker = _start_worker(
        scheduler,
        "--rmm-pool-size",
        "24MiB",
        "--rmm-base-resource",
        BASE,
        "--rmm-log-directory",
        str(logs),
        "--rmm-track-allocations",
        name="flags-1",
    )
    try:
        with Client(scheduler, timeout="60s") as client:
            client.wait_for_workers(1, timeout=60)
            options = next(iter(client.run(_plugin_options).values()))
            assert options["pool_size"] == 24 << 20
            assert options["track_allocations"] is True and options["statistics"] is True
            assert options["base_resource"] == BASE
            metrics = _wait_for(
                lambda: client.run_on_scheduler(
                    lambda dask_scheduler: [
                        ws.metrics.get(METRICS_KEY) for ws in dask_scheduler.workers.values()
                    ]
                )[0],
                30,
                "dask-rmm metrics on the scheduler",
            )
            d = metrics["devices"]["0"]
            assert d["reserved_bytes"] == 24 << 20
            assert "TrackingResourceAdaptor>PoolMemoryResource" in d["resource"]
            assert os.path.exists(log_file_path(logs, "flags-1", 0))
    finally:
        _stop(worker)


@pytest.mark.slow
def test_environment_configures_a_preloaded_worker(scheduler):
    from distributed import Client

    env = _env(DASK_DASK_RMM__POOL_SIZE="40MiB", DASK_DASK_RMM__BASE_RESOURCE=BASE)
    worker = _start_worker(scheduler, name="env-1", env=env)
    try:
        with Client(scheduler, timeout="60s") as client:
            client.wait_for_workers(1, timeout=60)
            options = next(iter(client.run(_plugin_options).values()))
            assert (options["pool_size"], options["base_resource"]) == (40 << 20, BASE)
    finally:
        _stop(worker)


@pytest.mark.slow
def test_a_failing_setup_stops_the_worker_with_the_reason(scheduler):
    worker = _start_worker(
        scheduler, "--rmm-pool-size", "1PiB", "--rmm-base-resource", "system", name="big-1"
    )
    out = worker.communicate(timeout=60)[0]
    assert worker.returncode != 0
    assert "RMMSetupError" in out and "is larger than" in out


@pytest.mark.parametrize(
    "flags, message",
    [
        (["--rmm-pool-size", "4gigs"], "Invalid value for '--rmm-pool-size'"),
        (["--rmm-release-threshold", "1GiB"], "--rmm-release-threshold requires --rmm-async"),
        (
            ["--rmm-async", "--rmm-managed-memory"],
            "--rmm-managed-memory is incompatible with --rmm-async",
        ),
        (["--set-rmm-allocator-for-libs", "torch"], "supported: cupy, numba"),
        (["--rmm-base-resource", "tpu"], "Invalid value for '--rmm-base-resource'"),
        (["--rmm-pool-sise", "1GiB"], "No such option"),
    ],
)
def test_bad_flags_are_usage_errors(flags, message):
    result = CliRunner().invoke(dask_setup, flags)
    assert result.exit_code == 2, result.output
    assert message in result.output


def test_help_lists_every_flag():
    result = CliRunner().invoke(dask_setup, ["--help"])
    assert result.exit_code == 0
    for flag in [
        "--rmm-pool-size",
        "--rmm-maximum-pool-size",
        "--rmm-managed-memory / --no-rmm-managed-memory",
        "--rmm-async / --no-rmm-async",
        "--rmm-release-threshold",
        "--rmm-log-directory",
        "--rmm-track-allocations / --no-rmm-track-allocations",
        "--set-rmm-allocator-for-libs",
        "--rmm-base-resource",
        "--rmm-statistics / --no-rmm-statistics",
    ]:
        assert flag in result.output


@pytest.mark.slow
def test_dask_worker_cli_rejects_a_bad_flag_before_starting():
    out = subprocess.run(
        [
            *DASK,
            "worker",
            "tcp://127.0.0.1:1",
            "--preload",
            "dask_rmm.preload",
            "--rmm-release-threshold",
            "1GiB",
        ],
        env=_env(),
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert out.returncode == 2
    assert "--rmm-release-threshold requires --rmm-async" in out.stderr


def test_plugin_from_flags_maps_dask_cuda_names():
    p = plugin_from_flags(
        rmm_pool_size="0.5",
        rmm_maximum_pool_size="0.9",
        rmm_base_resource="system",
        rmm_statistics=False,
        rmm_track_allocations=True,
    )
    assert (p.pool_size, p.maximum_pool_size, p.statistics, p.track_allocations) == (
        0.5,
        0.9,
        False,
        True,
    )
