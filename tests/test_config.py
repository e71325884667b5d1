"""dask_rmm.config: defaults registered under "dask-rmm", schema agreement, parse_device_bytes."""

from __future__ import annotations

import subprocess
import sys

import dask.config
import numpy as np
import pytest
import yaml

from dask_rmm import _cuda
from dask_rmm.config import SCHEMA_PATH, YAML_PATH, defaults
from dask_rmm.sizes import parse_device_bytes

HAS_GPU = _cuda.is_available()


def _schema_without_defaults(schema: dict, value, path: str = "dask-rmm") -> list[str]:
    """The schema against the defaults: each property with no default or no description."""
    missing = [] if "description" in schema else [f"{path}: no description"]
    for name, sub in schema.get("properties", {}).items():
        if not isinstance(value, dict) or name not in value:
            missing.append(f"{path}.{name}: no default")
        else:
            missing += _schema_without_defaults(sub, value[name], f"{path}.{name}")
    return missing


def _schema() -> dict:
    with open(SCHEMA_PATH) as f:
        return yaml.safe_load(f)


@pytest.fixture
def jsonschema():
    return pytest.importorskip("jsonschema")  # a test dependency, as for distributed's schema


def test_defaults_and_schema_agree(jsonschema):
    # the defaults against the schema, as distributed checks its own
    with open(YAML_PATH) as f:
        assert yaml.safe_load(f) == defaults
    jsonschema.validate(defaults, _schema())
    # and the schema against the defaults
    schema = _schema()["properties"]["dask-rmm"]
    assert _schema_without_defaults(schema, defaults["dask-rmm"]) == []


def test_the_schema_checks_catch_a_mismatch(jsonschema):
    for wrong in ({"undocumented-key": 1}, {"statistics": "yes"}):
        with pytest.raises(jsonschema.ValidationError):
            jsonschema.validate({"dask-rmm": {**defaults["dask-rmm"], **wrong}}, _schema())
    schema = _schema()["properties"]["dask-rmm"]
    no_default = {k: v for k, v in defaults["dask-rmm"].items() if k != "spill-on-oom"}
    assert _schema_without_defaults(schema, no_default) == ["dask-rmm.spill-on-oom: no default"]


def test_registered_with_dask():
    assert dask.config.get("dask-rmm.base-resource") == "cuda"
    assert dask.config.get("dask-rmm.pool-size") is None
    assert dask.config.get("dask-rmm.metrics.sample-interval") == "100ms"
    assert dask.config.get("dask-rmm.metrics.top-task-groups") == 10
    assert dask.config.get("dask-rmm.scheduler.timeline-length") == 512
    with dask.config.set({"dask-rmm.pool-size": "4GiB"}):
        assert parse_device_bytes(dask.config.get("dask-rmm.pool-size")) == 4 << 30


def test_import_does_not_import_distributed():
    code = "import sys, dask_rmm.config; assert 'distributed' not in sys.modules"
    subprocess.run([sys.executable, "-c", code], check=True)


@pytest.mark.parametrize(
    "value, expected",
    [
        (4 << 30, 4 << 30),
        ("4GiB", 4 << 30),
        ("500MB", 500_000_000 // 256 * 256),
        ("4 GB", 4_000_000_000),
        (" 1 KiB ", 1024),
        ("1024", 1024),
        ("1e9", 1_000_000_000 // 256 * 256),
        (1000, 768),
        (0, None),
        ("0", None),
        (None, None),
        (4e9, 4_000_000_000),
        (np.int64(512), 512),
    ],
)
def test_sizes(value, expected):
    assert parse_device_bytes(value) == expected


def test_fractions_with_given_total():
    total = 80 << 30
    assert parse_device_bytes(0.5, total_memory=total) == 40 << 30
    assert parse_device_bytes("0.9", total_memory=total) == int(total * 0.9) // 256 * 256
    assert parse_device_bytes(1.0, total_memory=total) == total
    assert parse_device_bytes("1.0", total_memory=total) == total
    assert parse_device_bytes(0.3, total_memory=1000) == 256
    assert parse_device_bytes(1000, alignment=1) == 1000
    assert parse_device_bytes(4096, alignment=1024) == 4096


@pytest.mark.parametrize(
    "value, exc",
    [
        ("4 gigs", ValueError),
        ("-1GB", ValueError),
        ("GiB", ValueError),
        ("", ValueError),
        ("1.5", ValueError),
        ("-0.5", ValueError),
        (1.5, ValueError),
        (-0.5, ValueError),
        (float("nan"), ValueError),
        (float("inf"), ValueError),
        (-1, ValueError),
        (100, ValueError),  # non-zero but below the alignment
        (True, TypeError),
        ("1.5GiBs", ValueError),
        ([4], TypeError),
    ],
)
def test_bad_sizes_name_the_value(value, exc):
    with pytest.raises(exc) as info:
        parse_device_bytes(value, total_memory=1 << 30)
    assert repr(value) in str(info.value)


@pytest.mark.parametrize("alignment", [0, -256, True, 2.5])
def test_bad_alignment(alignment):
    with pytest.raises(ValueError, match="alignment"):
        parse_device_bytes(1024, alignment=alignment)


@pytest.mark.parametrize("total", [0, -5, True, 1.5])
def test_bad_total_memory(total):
    with pytest.raises(ValueError, match="total_memory"):
        parse_device_bytes(0.5, total_memory=total)


@pytest.mark.skipif(HAS_GPU, reason="checks the no-GPU path")
def test_fraction_without_gpu_is_clear_error():
    with pytest.raises(ValueError, match="no usable CUDA device.*total_memory"):
        parse_device_bytes(0.5)


@pytest.mark.gpu
def test_fraction_of_device_memory():
    total = _cuda.device_total_memory()
    assert parse_device_bytes(0.5) == int(total * 0.5) // 256 * 256
    assert parse_device_bytes(1.0, device=_cuda.get_device()) == total // 256 * 256


@pytest.mark.parametrize(
    "key, value, variable",
    [
        ("metrics.sample-interval", "banana", "DASK_DASK_RMM__METRICS__SAMPLE_INTERVAL"),
        ("metrics.top-task-groups", "abc", "DASK_DASK_RMM__METRICS__TOP_TASK_GROUPS"),
        ("pool-size", "lots", "DASK_DASK_RMM__POOL_SIZE"),
        ("base-resource", "tpu", "DASK_DASK_RMM__BASE_RESOURCE"),
        ("scheduler.timeline-length", 0, "DASK_DASK_RMM__SCHEDULER__TIMELINE_LENGTH"),
    ],
)
def test_bad_config_names_the_key_and_variable_and_installs_nothing(key, value, variable):
    from dask_rmm import mr
    from dask_rmm.config import ConfigError
    from dask_rmm.mr.registry import get_per_device_resource, set_per_device_resource
    from dask_rmm.plugin import RMMPlugin

    before = mr.SystemMemoryResource()
    set_per_device_resource(0, before)
    with dask.config.set({f"dask-rmm.{key}": value}):
        with pytest.raises(ConfigError, match=rf"dask-rmm.{key}=.*\({variable}\)"):
            # a config value an explicit option replaces is not read
            RMMPlugin(**({} if key == "base-resource" else {"base_resource": "system"}))
    assert get_per_device_resource(0) is before


@pytest.mark.parametrize(
    "key, value, reason",
    [
        ("metrics.sample-interval", "-1", "negative; 0 turns sampling off"),
        ("metrics.sample-interval", -0.5, "negative; 0 turns sampling off"),
        ("metrics.top-task-groups", 10**9, "must be at most 64"),
    ],
)
def test_a_negative_interval_or_too_many_task_groups_says_so(key, value, reason):
    from dask_rmm.config import ConfigError, validate_config

    with dask.config.set({f"dask-rmm.{key}": value}):
        with pytest.raises(ConfigError, match=f"dask-rmm.{key}=.*{reason}"):
            validate_config()


def test_unknown_keys_warn():
    from dask_rmm.config import validate_config

    with dask.config.set(dask.config.collect_env({"DASK_DASK_RMM__POOLSIZE": "1GB"})):
        with pytest.warns(UserWarning, match=r"dask-rmm.poolsize \(DASK_DASK_RMM__POOLSIZE\)"):
            validate_config()
