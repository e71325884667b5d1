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


class _NotAClientYet:
    """Enough of a Client for cluster_report to check its arguments (never reached)."""

    scheduler = None

    def sync(self, *args, **kwargs):  # pragma: no cover - the checks come first
        raise AssertionError("the bad argument reached the scheduler")


def test_cluster_report_names_a_bad_client_or_last():
    """``cluster_report("tcp://...:8786")`` raised "'str' object has no attribute 'sync'";
    ``last="x"`` or ``1.5`` failed inside the scheduler's handler."""
    from dask_rmm.client.fetch import cluster_report

    with pytest.raises(TypeError, match="client must be a distributed.Client, got 'tcp://"):
        cluster_report("tcp://127.0.0.1:8786")
    for last in ("x", 1.5, -1, True):
        with pytest.raises(ValueError, match="last must be an int >= 0 or None"):
            cluster_report(_NotAClientYet(), last=last)


@pytest.mark.parametrize("bad", ["nan", "inf"])
@pytest.mark.parametrize("option", ["--timeout", "--watch"])
def test_dask_rmm_report_refuses_seconds_that_are_not_finite(option, bad):
    """``dask rmm report ADDR --timeout nan`` passed click's range check and ended in a
    KeyError traceback from distributed ("Invalid time unit: nan")."""
    from click.testing import CliRunner

    from dask_rmm.cli import main

    result = CliRunner().invoke(main, ["report", "tcp://127.0.0.1:1", option, bad])
    assert result.exit_code == 2, result.output
    assert f"Invalid value for '{option}'" in result.output
    assert "not a finite number of seconds" in result.output


def test_writing_a_plot_to_a_directory_or_a_missing_one_names_the_path(tmp_path):
    """``report.plot("/tmp")`` said "Format 'partial' is not supported"; a missing directory
    named a temporary file the user never gave; ``plot(5)``: os.fspath's TypeError."""
    from dask_rmm._output import atomic_output
    from dask_rmm.report.memory_report import ClusterMemoryReport

    with pytest.raises(IsADirectoryError, match=f"directory, not a file: '{tmp_path}'"):
        ClusterMemoryReport.from_dict({}).plot(str(tmp_path))
    missing = str(tmp_path / "nope" / "x.png")
    with pytest.raises(FileNotFoundError, match="directory does not exist: '.*nope/x.png'"):
        with atomic_output(missing):
            pass
    with pytest.raises(TypeError, match="the output must be a file path, got 5"):
        with atomic_output(5):
            pass
    assert list(tmp_path.iterdir()) == []  # no temporary file left behind


@pytest.mark.parametrize("bad", [-1, "a", 1.0, True])
def test_system_memory_resource_refuses_a_device_id_that_is_not_one(bad):
    """``SystemMemoryResource(device_id="a")`` was accepted and named its log files
    ``.deva``."""
    with pytest.raises(ValueError, match=f"device_id must be a device id .*got {bad!r}"):
        mr.SystemMemoryResource(device_id=bad)


@pytest.mark.parametrize(
    "key, value",
    [("log-directory", "__file__"), ("device-pause-fraction", 5)],
)
def test_bad_config_the_schema_lets_through_names_its_key_and_variable(key, value):
    """``DASK_DASK_RMM__LOG_DIRECTORY=/etc/passwd`` or ``..._DEVICE_PAUSE_FRACTION=5`` passed
    the schema and then failed without naming the config key or its environment variable."""
    import dask

    from dask_rmm.config import ConfigError, environment_variable

    value = __file__ if value == "__file__" else value
    with dask.config.set({f"dask-rmm.{key}": value}):
        with pytest.raises(ConfigError) as info:
            RMMPlugin(base_resource="system")
        with pytest.raises(ValueError, match=key.replace("-", "_")) as explicit:
            RMMPlugin(base_resource="system", **{key.replace("-", "_"): value})
        assert not isinstance(explicit.value, ConfigError)  # given explicitly: not the config's
    message = str(info.value)
    assert f"dask-rmm.{key}" in message and environment_variable(f"dask-rmm.{key}") in message


def test_sizes_travel_parsed_and_resolve_on_the_device_without_parsing_again():
    from dask_rmm.stack import OptionError, RMMOptions

    options = RMMOptions(pool_size="0.5", maximum_pool_size="1GiB", base_resource="system")
    assert (options.pool_size, options.maximum_pool_size) == (0.5, 1 << 30)
    assert options.resolve_size("pool_size", 0, 1000 << 20) == 500 << 20
    assert options.resolve_size("maximum_pool_size", 0, 2 << 30) == 1 << 30
    tiny = RMMOptions(pool_size=1e-12, base_resource="system")
    with pytest.raises(OptionError, match="`pool_size` .* is below 256 bytes"):
        tiny.resolve_size("pool_size", 0, 1 << 30)
    with pytest.raises(OptionError, match="`maximum_pool_size` .* is larger than host memory"):
        options.resolve_size("maximum_pool_size", 0, 1 << 29)
