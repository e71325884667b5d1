"""``dask worker --preload dask_rmm.preload --rmm-*``: flags through real ``dask scheduler`` and
``dask worker`` processes, config from the environment, and usage errors for bad flags."""

from __future__ import annotations

import contextlib
import json
import os
import re
import shutil
import subprocess
import sys

import dask
import pytest
from click.testing import CliRunner
from conftest import HAS_GPU, wait_until

from dask_rmm.preload import dask_setup, plugin_from_flags
from dask_rmm.stack.build import log_file_path
from dask_rmm.wire import device_entries
from dask_rmm.worker.metrics import METRICS_KEY

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
DASK = [sys.executable, "-m", "dask"]
BASE = "cuda" if HAS_GPU else "system"


def _env(**extra: str) -> dict[str, str]:
    env = dict(os.environ)
    env["PYTHONPATH"] = ROOT + os.pathsep + env.get("PYTHONPATH", "")
    env.update(extra)
    return env


@pytest.fixture
def scheduler_process(tmp_path):
    """A real ``dask scheduler`` process; yields it and its address."""
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
        wait_until(
            lambda: file.exists() and file.stat().st_size, 60, "the scheduler file", interval=0.1
        )
        yield proc, json.loads(file.read_text())["address"]
    finally:
        proc.terminate()
        proc.wait(30)


@pytest.fixture
def scheduler(scheduler_process):
    """A real ``dask scheduler`` process; yields its address."""
    return scheduler_process[1]


def _start_worker(
    address: str, *flags: str, name: str, env: dict[str, str] | None = None, nanny: bool = False
):
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
            "--nanny" if nanny else "--no-nanny",
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
_plugin_options = lambda dask_worker: dask_worker.plugins["dask-rmm"].options.to_dict()  # noqa: E731


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
            metrics = wait_until(
                lambda: client.run_on_scheduler(
                    lambda dask_scheduler: [
                        ws.metrics.get(METRICS_KEY) for ws in dask_scheduler.workers.values()
                    ]
                )[0],
                30,
                "dask-rmm metrics on the scheduler",
                interval=0.1,
            )
            d = device_entries(metrics)["0"]
            assert d["reserved_bytes"] == 24 << 20
            assert "TrackingResourceAdaptor>PoolMemoryResource" in d["resource"]
            assert not os.path.exists(log_file_path(logs, "flags-1", 0))  # made at the 1st row
            client.run(_allocate, 4096)
            assert os.path.exists(log_file_path(logs, "flags-1", 0))
    finally:
        out = _stop(worker)
    # on the worker's stderr under distributed's default logging configuration
    assert " - distributed.worker.dask_rmm - INFO - dask-rmm: worker flags-1 installed" in out


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
@pytest.mark.parametrize(
    "failure, nanny",
    [
        ("pool larger than memory", False),
        ("directory as log file", False),
        ("pool larger than memory", True),
        ("directory as log file", True),
    ],
)
def test_a_failing_setup_stops_the_worker_with_one_line_and_a_nonzero_status(
    scheduler, tmp_path, failure, nanny
):
    """A supervisor (systemd, Kubernetes, dask-jobqueue) must see that the worker failed: the
    ``dask worker`` process exits with status 1, and its output gives the reason on one line,
    with no traceback (distributed, the nanny and the command would each add theirs)."""
    flags = ["--rmm-base-resource", "system", "--rmm-pool-size", "1PiB"]
    reason = "is larger than"
    if failure == "directory as log file":
        logs = tmp_path / "logs"
        os.makedirs(log_file_path(logs, "bad-1", 0))  # a directory where the log file goes
        flags = ["--rmm-base-resource", "system", "--rmm-log-directory", str(logs)]
        reason = "cannot write the allocation log"
    worker = _start_worker(scheduler, *flags, name="bad-1", nanny=nanny)
    out = worker.communicate(timeout=90)[0]  # the worker closed itself: it exits
    assert worker.returncode == 1, out
    said = [line for line in out.splitlines() if reason in line]
    assert len(said) == 1, out
    assert "dask-rmm setup failed" in said[0] and "bad-1" in said[0]
    assert "Traceback" not in out and "Error" not in out.replace(said[0], ""), out


@pytest.mark.slow
@pytest.mark.skipif(HAS_GPU, reason="checks the no-GPU hint; this host has a GPU")
def test_a_worker_without_a_gpu_names_the_flag_for_host_memory(scheduler):
    worker = _start_worker(scheduler, "--rmm-pool-size", "64MiB", name="nogpu-1")
    out = worker.communicate(timeout=90)[0]
    assert worker.returncode == 1, out
    (said,) = [line for line in out.splitlines() if "needs a CUDA device" in line]
    assert "give --rmm-base-resource system" in said and "SystemMemoryResource()" not in said


_exit_process = lambda: os._exit(1)  # noqa: E731
_status = lambda dask_worker: dask_worker.status.name  # noqa: E731


@pytest.mark.slow
def test_a_worker_whose_setup_fails_when_its_nanny_restarts_it_stops_for_good(scheduler, tmp_path):
    """The nanny restarts a worker that died; if dask-rmm's setup then fails, the worker must
    not run without it (nor be restarted again and again): ``dask worker`` exits with status 1
    and says why on one line."""
    from distributed import Client

    logs = tmp_path / "logs"
    flags = ("--rmm-base-resource", "system", "--rmm-log-directory", str(logs))
    worker = _start_worker(scheduler, *flags, name="again-2", nanny=True)
    try:
        with Client(scheduler, timeout="60s") as client:
            client.wait_for_workers(1, timeout=60)
            # The worker registers with the scheduler before its nanny hears it started; a
            # worker that dies in between fails the nanny's own start (no restart to test).
            wait_until(
                lambda: set(client.run(_status, nanny=True).values()) == {"running"},
                60,
                "the nanny to finish starting",
                interval=0.1,
            )
            # the next start cannot log: the log directory became a file
            shutil.rmtree(logs)
            logs.write_text("")
            with contextlib.suppress(Exception):
                client.run(_exit_process, nanny=False)
        out = worker.communicate(timeout=90)[0]
    finally:
        if worker.poll() is None:  # pragma: no cover - the assertion below says why
            _stop(worker)
    assert worker.returncode == 1, out
    said = [line for line in out.splitlines() if "is a file" in line]
    assert len(said) == 1 and "dask-rmm" in said[0], out
    assert "Traceback" not in out, out


_allocate = lambda nbytes: __import__("dask_rmm").DeviceBuffer(size=nbytes).size  # noqa: E731


@pytest.mark.slow
def test_a_worker_restarted_under_its_name_appends_to_its_log(scheduler, tmp_path):
    """The same ``dask worker`` command run again (a supervisor's restart) keeps the rows the
    first run logged: the log is appended to, never truncated."""
    from distributed import Client

    logs = tmp_path / "logs"
    path = log_file_path(logs, "again-1", 0)
    flags = ("--rmm-base-resource", "system", "--rmm-log-directory", str(logs))
    for nbytes in (4096, 8192):
        worker = _start_worker(scheduler, *flags, name="again-1")
        try:
            with Client(scheduler, timeout="60s") as client:
                client.wait_for_workers(1, timeout=60)
                assert list(client.run(_allocate, nbytes).values()) == [nbytes]
        finally:
            _stop(worker)
        assert worker.returncode is not None
    with open(path) as f:
        text = f.read()
    assert ",allocate,0x" in text and ",4096," in text and ",8192," in text
    assert text.count("Thread,Time,Action") == 2  # the header, then the restart marker


@pytest.mark.parametrize(
    "flags, message",
    [
        (["--rmm-pool-size", "4gigs"], "--rmm-pool-size='4gigs': Could not interpret 'gigs'"),
        (
            ["--rmm-release-threshold", "1GiB"],
            "--rmm-release-threshold requires a pool: --rmm-pool-size",
        ),
        (
            ["--rmm-async", "--rmm-managed-memory"],
            "--rmm-managed-memory is incompatible with --rmm-async",
        ),
        (["--set-rmm-allocator-for-libs", "tensorflow"], "unknown library 'tensorflow'"),
        (["--rmm-exact-allocators", "jax"], "unknown library 'jax'"),
        (["--rmm-base-resource", "tpu"], "Invalid value for '--rmm-base-resource'"),
        (["--rmm-pool-sise", "1GiB"], "No such option"),
    ],
)
def test_bad_flags_are_usage_errors(flags, message):
    result = CliRunner().invoke(dask_setup, flags)
    assert result.exit_code == 2, result.output
    assert message in result.output


def test_a_bad_size_says_the_size_rules_once():
    result = CliRunner().invoke(dask_setup, ["--rmm-pool-size", "lots"])
    assert result.exit_code == 2, result.output
    assert "'lots': not a size" in result.output
    assert result.output.count("fraction") == 1, result.output


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
        "--rmm-exact-allocators",
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
    assert "--rmm-release-threshold requires a pool: --rmm-pool-size" in out.stderr
    assert "Usage: dask worker SCHEDULER --preload dask_rmm.preload [OPTIONS]" in out.stderr


def test_bad_config_is_a_usage_error_naming_the_variable():
    from dask_rmm.preload import _main

    env = {"DASK_DASK_RMM__METRICS__TOP_TASK_GROUPS": "abc"}
    with dask.config.set(dask.config.collect_env(env)), pytest.raises(SystemExit) as info:
        _main(["--rmm-base-resource", "system"])
    assert info.value.code == 2


def test_plugin_from_flags_maps_dask_cuda_names():
    p = plugin_from_flags(
        rmm_pool_size="0.5",
        rmm_maximum_pool_size="0.9",
        rmm_base_resource="system",
        rmm_statistics=False,
        rmm_track_allocations=True,
    )
    p = p.options
    assert (p.pool_size, p.maximum_pool_size, p.statistics, p.track_allocations) == (
        0.5,
        0.9,
        False,
        True,
    )


# --- The scheduler address: `dask worker` takes the first flag as SCHEDULER when none is given ---

_BASE_CLASS = {"system": "SystemMemoryResource", "cuda": "CudaMemoryResource"}[BASE]
# The worker's current resource stack, described (pickled by value, like _plugin_options).
_describe_resource = lambda dask_worker: repr(  # noqa: E731
    __import__("dask_rmm.mr", fromlist=["mr"]).get_current_device_resource()
)

_n_workers = lambda dask_scheduler: len(dask_scheduler.workers)  # noqa: E731


def _run_worker(argv: list[str], name: str):
    """``dask worker <argv>`` with the preload; argv says where the scheduler comes from."""
    return subprocess.Popen(
        [*DASK, "worker", *argv, "--name", name, "--nthreads", "1", "--no-dashboard"],
        env=_env(),
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )


@pytest.mark.slow
@pytest.mark.parametrize(
    "address_first, nanny, flags, recovered",
    [
        # `--flag value`: dask worker takes --rmm-pool-size, the preload gets "32MiB ...".
        (
            False,
            "--no-nanny",
            ["--rmm-pool-size", "32MiB", "--rmm-base-resource", BASE],
            "--rmm-pool-size",
        ),
        # `--flag=value`: the whole flag is taken; the worker process is a nanny's child.
        (
            False,
            "--nanny",
            ["--rmm-pool-size=32MiB", "--rmm-base-resource", BASE],
            "--rmm-pool-size",
        ),
        # Whichever flag comes first is the one taken.
        (
            False,
            "--no-nanny",
            ["--rmm-base-resource", BASE, "--rmm-pool-size", "32MiB"],
            "--rmm-base-resource",
        ),
        # The address before the flags: nothing is taken, nothing to recover.
        (True, "--no-nanny", ["--rmm-pool-size", "32MiB", "--rmm-base-resource", BASE], None),
    ],
)
def test_flags_survive_scheduler_file_without_an_address(
    scheduler, tmp_path, address_first, nanny, flags, recovered
):
    from distributed import Client

    where = [scheduler] if address_first else ["--scheduler-file", str(tmp_path / "scheduler.json")]
    worker = _run_worker([*where, nanny, "--preload", "dask_rmm.preload", *flags], name="sf-1")
    out = ""
    try:
        with Client(scheduler, timeout="30s") as client:
            wait_until(
                lambda: worker.poll() is not None or client.run_on_scheduler(_n_workers),
                20,
                "the worker to join (or exit)",
                interval=0.1,
            )
            assert worker.poll() is None, "the worker exited"
            description = next(iter(client.run(_describe_resource).values()))
            options = next(iter(client.run(_plugin_options).values()))
    finally:
        out = _stop(worker)
    assert (
        f"PoolMemoryResource device=0 pool_size=32.00 MiB maximum=unlimited upstream=<{_BASE_CLASS}"
        in description
    ), (description, out)
    assert (options["pool_size"], options["base_resource"]) == (32 << 20, BASE)
    if recovered:
        assert f"recovered {recovered} for dask_rmm.preload" in out, out
    else:
        assert "SCHEDULER address" not in out, out


@pytest.mark.slow
@pytest.mark.parametrize(
    "argv, env, message",
    [
        # No address anywhere on the command line (the config gives one): the worker would dial
        # the flag, and the preload would lose it.
        (
            ["--rmm-pool-size=32MiB", "--rmm-base-resource", "system"],
            {"DASK_SCHEDULER_ADDRESS": "tcp://127.0.0.1:1"},
            "took '--rmm-pool-size=32MiB' as its SCHEDULER address, so the preload lost "
            "--rmm-pool-size",
        ),
        # An address after the flags: SCHEDULER is still the first flag.
        (
            ["--scheduler-file", "unused.json", "--rmm-async", "tcp://127.0.0.1:1"],
            {},
            "Got unexpected extra argument (tcp://127.0.0.1:1)",
        ),
    ],
)
def test_a_flag_taken_as_the_address_is_a_usage_error_when_not_recoverable(argv, env, message):
    out = subprocess.run(
        [*DASK, "worker", "--no-nanny", "--preload", "dask_rmm.preload", *argv],
        env=_env(**env),
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert out.returncode == 2, out.stderr
    assert message in out.stderr
    assert "give the scheduler address before the flags" in out.stderr
    assert "DASK_DASK_RMM__" in out.stderr


def test_a_recovery_record_applies_only_to_the_argv_it_was_made_for(monkeypatch):
    from dask_rmm.preload import _RECOVERED_ENV

    typed = ["--rmm-pool-size=1GiB", "--rmm-base-resource", "system"]
    monkeypatch.setenv(_RECOVERED_ENV, json.dumps({"received": typed[1:], "argv": typed}))
    ctx = dask_setup.make_context("dask_setup", typed[1:])
    assert (ctx.params["rmm_pool_size"], ctx.params["rmm_base_resource"]) == ("1GiB", "system")
    # Another worker's flags (say, a cluster started from a task) are left alone.
    ctx = dask_setup.make_context("dask_setup", ["--rmm-base-resource", "cuda"])
    assert (ctx.params["rmm_pool_size"], ctx.params["rmm_base_resource"]) == (None, "cuda")
    monkeypatch.setenv(_RECOVERED_ENV, "not json")
    assert dask_setup.make_context("dask_setup", typed[1:]).params["rmm_pool_size"] is None


# A task that allocates and frees through the worker's resource for a while (n rounds); pickled
# by value, as the lambdas above.
_churn = lambda n, nbytes: sum(  # noqa: E731
    __import__("time").sleep(0.01) or __import__("dask_rmm").DeviceBuffer(size=nbytes).size > 0
    for _ in range(n)
)
_stack_of = lambda dask_worker: [  # noqa: E731
    (s.pool_size, s.chain)
    for s in __import__("dask_rmm.worker.stacks").worker.stacks.worker_stack(dask_worker).active
]


@pytest.mark.slow
def test_unregistering_a_plugin_brings_back_the_command_lines_setup_and_metrics(scheduler):
    """Unregistering left preload-configured workers with the default CudaMemoryResource: every
    running task failed (CUDAUnavailableError without a GPU) and the report had no workers."""
    from distributed import Client

    from dask_rmm import RMMPlugin, cluster_report

    flags = ("--rmm-pool-size", "24MiB", "--rmm-base-resource", BASE)
    workers = [_start_worker(scheduler, *flags, name=f"cl-{i}") for i in range(2)]
    try:
        with Client(scheduler, timeout="60s") as client:
            client.wait_for_workers(2, timeout=60)
            command_line = client.run(_stack_of)
            assert all(v[0][0] == 24 << 20 for v in command_line.values()), command_line
            client.register_plugin(RMMPlugin(base_resource=BASE, pool_size="32MiB"))
            assert all(v[0][0] == 32 << 20 for v in client.run(_stack_of).values())
            running = client.map(_churn, [150] * 4, [1 << 20] * 4, pure=False)
            wait_until(lambda: sum(len(p) for p in client.processing().values()) == 4, 30, "tasks")
            client.unregister_worker_plugin("dask-rmm")
            assert client.gather(running) == [150] * 4  # none failed
            assert client.run(_stack_of) == command_line
            options = client.run(_plugin_options)
            assert all(o["pool_size"] == 24 << 20 for o in options.values())

            def reserved():
                report = cluster_report(client, timeline=False)
                return sorted(d.reserved_bytes for d in report.devices) == [24 << 20] * 2

            wait_until(reserved, 30, "both workers' command-line pools in the report")
    finally:
        for w in workers:
            _stop(w)


_SPHINX_MARKUP = re.compile(r"``|:(func|class|meth|mod|attr|data|exc|ref):`")


@pytest.mark.parametrize("flag", ["--help", "-h"])
def test_python_m_dask_rmm_preload_help_is_plain_text(flag):
    # ROOT first, the rest of PYTHONPATH kept (the GPU host finds Dask there)
    path = os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH", "")) if p)
    env = dict(os.environ, PYTHONPATH=path)
    out = subprocess.run(
        [sys.executable, "-m", "dask_rmm.preload", flag],
        capture_output=True,
        text=True,
        timeout=120,
        env=env,
    )
    assert out.returncode == 0, out.stderr
    assert out.stdout.startswith("Usage: dask worker SCHEDULER --preload dask_rmm.preload")
    assert "--rmm-pool-size" in out.stdout and "--rmm-base-resource" in out.stdout
    assert not _SPHINX_MARKUP.search(out.stdout), out.stdout
    same = CliRunner().invoke(
        dask_setup, [flag], prog_name="dask worker SCHEDULER --preload dask_rmm.preload"
    )
    assert same.exit_code == 0 and not _SPHINX_MARKUP.search(same.output), same.output


@pytest.mark.slow
@pytest.mark.parametrize("nanny", [True, False], ids=["nanny", "no-nanny"])
def test_an_unknown_config_key_is_reported_once_per_worker_start(scheduler, nanny):
    from distributed import Client

    env = _env(DASK_DASK_RMM__POOLSIZE="1GB", DASK_DASK_RMM__BASE_RESOURCE=BASE)
    worker = _start_worker(
        scheduler, "--rmm-pool-size", "16MiB", name="typo-1", env=env, nanny=nanny
    )
    try:
        with Client(scheduler, timeout="60s") as client:
            client.wait_for_workers(1, timeout=60)
            assert next(iter(client.run(_plugin_options).values()))["pool_size"] == 16 << 20
    finally:
        out = _stop(worker)
    assert out.count("unknown config key dask-rmm.poolsize (DASK_DASK_RMM__POOLSIZE)") == 1, out


def test_an_unknown_config_key_warns_once_per_process():
    from dask_rmm.config import validate_config

    with dask.config.set({"dask-rmm.pool-szie": "1GB"}):
        with pytest.warns(UserWarning, match=r"dask-rmm.pool-szie") as caught:
            for _ in range(4):
                validate_config()
                plugin_from_flags(rmm_base_resource="system")
    assert len([w for w in caught if "pool-szie" in str(w.message)]) == 1


def test_h_is_help_also_after_a_context_made_as_distributed_makes_it():
    import click

    # distributed checks preload flags with a Context of its own (no context_settings); click
    # keeps the first help option it builds for a command
    assert "-h" in dask_setup.get_help_option(click.Context(dask_setup)).opts
    result = CliRunner().invoke(dask_setup, ["-h"])
    assert result.exit_code == 0 and "--rmm-pool-size" in result.output, result.output


@pytest.mark.slow
@pytest.mark.parametrize("nanny", [False, True], ids=["no-nanny", "nanny"])
def test_a_preloaded_worker_exits_on_sigterm_after_tearing_dask_rmm_down(scheduler, nanny):
    """dask-rmm's teardown waits on nothing (the scheduler least): SIGTERM ends the worker, its
    plugin removed, without the nanny having to kill it."""
    import signal

    from distributed import Client

    worker = _start_worker(scheduler, "--rmm-base-resource", BASE, name="sigterm", nanny=nanny)
    try:
        with Client(scheduler, timeout="60s") as client:
            client.wait_for_workers(1, timeout=60)
            assert list(
                client.run(lambda dask_worker: "dask-rmm" in dask_worker.plugins).values()
            ) == [True]
        worker.send_signal(signal.SIGTERM)
        out = worker.communicate(timeout=60)[0]  # a guard: it exits in about a second
    finally:
        if worker.poll() is None:  # pragma: no cover
            worker.kill()
    assert worker.returncode == 0, out
    assert "Removing Worker plugin dask-rmm" in out and "killing" not in out, out


@pytest.mark.slow
def test_a_preloaded_worker_sigtermed_with_its_scheduler_exits(scheduler_process):
    """``dask worker --preload dask_rmm.preload`` SIGTERMed together with its scheduler stayed
    alive (issue 46 item 22). With the nanny (the default) it exits: its worker process, stuck
    in ``Worker.close`` asking the closing nanny to close before dask-rmm's teardown is
    reached, is killed by the nanny after 8 s, as a plain worker's is. Without a nanny it is
    distributed's race, dask-rmm or not: the signal ends ``asyncio.run`` while the scheduler's
    close runs ``Worker.close``; the cancel stops it in ``rpc.close`` (closing the pooled comm
    to the scheduler) and ``handle_scheduler``'s ``finally`` awaits ``Worker.finished()`` for
    ever (a plain ``dask worker --no-nanny`` stuck so 4 times in 5, 3 s after its start)."""
    import signal

    proc, address = scheduler_process
    worker = _start_worker(address, "--rmm-base-resource", BASE, name="together", nanny=True)
    try:
        from distributed import Client

        with Client(address, timeout="60s") as client:
            client.wait_for_workers(1, timeout=60)
        proc.send_signal(signal.SIGTERM)
        worker.send_signal(signal.SIGTERM)
        out = worker.communicate(timeout=60)[0]  # a guard: it exits in about 8 s
    finally:
        if worker.poll() is None:  # pragma: no cover
            worker.kill()
    # (not its exit status: a SIGTERM while the nanny still finishes its start ends the CLI
    # with the nanny's CommClosedError after "End worker", seen once in CI)
    assert "End worker" in out, out


@pytest.mark.slow
def test_a_rejected_registration_is_one_line_in_a_nanny_workers_log(scheduler):
    """Issue 46 item 23: with the nanny, a rejected registration wrote 4-5 tracebacks per
    worker; it is one line, as in-process (tests/worker/test_plugin.py)."""
    from distributed import Client

    from dask_rmm import RMMPlugin, RMMSetupError

    worker = _start_worker(scheduler, "--rmm-base-resource", BASE, name="rejected", nanny=True)
    try:
        with Client(scheduler, timeout="60s") as client:
            client.wait_for_workers(1, timeout=60)
            with pytest.raises(RMMSetupError, match="failed on 1 worker"):
                client.register_plugin(RMMPlugin(base_resource="system", pool_size="1PiB"))
            assert client.submit(int, 1).result() == 1  # the worker kept its setup
    finally:
        out = _stop(worker)
    assert "Traceback" not in out, out
    assert len([line for line in out.splitlines() if "setup failed on 1 worker" in line]) == 1, out
