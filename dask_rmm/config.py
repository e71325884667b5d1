"""dask-rmm's Dask configuration (namespace ``dask-rmm``): defaults, reading, validation.

Importing this module registers ``dask-rmm.yaml``'s defaults with ``dask.config``; the schema
beside it documents every key and :func:`validate_config` checks against it. It never imports
distributed. Turning the settings into options is :mod:`dask_rmm.stack`' job.
"""

from __future__ import annotations

import contextlib
import contextvars
import os
import warnings
from collections.abc import Iterator
from typing import Any

import dask.config
import yaml

__all__ = [
    "SCHEMA_PATH",
    "YAML_PATH",
    "ConfigError",
    "config_value",
    "defaults",
    "environment_variable",
    "unknown_keys_unreported",
    "validate_config",
]

#: Unknown keys already warned about in this process: a worker start validates the config
#: several times (flags, plugin, setup), and the user needs to read it once.
_warned_unknown: set[str] = set()
_report_unknown = contextvars.ContextVar("dask_rmm_report_unknown_config_keys", default=True)


@contextlib.contextmanager
def unknown_keys_unreported() -> Iterator[None]:
    """Validate without warning about unknown keys inside this block: for a check whose
    process hands the same config on to one that validates it again (``dask worker``'s nanny
    checking the preload flags before it starts the worker process)."""
    token = _report_unknown.set(False)
    try:
        yield
    finally:
        _report_unknown.reset(token)


YAML_PATH = os.path.join(os.path.dirname(__file__), "dask-rmm.yaml")
SCHEMA_PATH = os.path.join(os.path.dirname(__file__), "dask-rmm-schema.yaml")

with open(YAML_PATH) as f:
    #: The defaults as read from dask-rmm.yaml (``{"dask-rmm": {...}}``).
    defaults: dict = yaml.safe_load(f)

dask.config.update_defaults(defaults)

with open(SCHEMA_PATH) as f:
    _SCHEMA: dict = yaml.safe_load(f)["properties"]["dask-rmm"]

_JSON_TYPES: dict[str, type | tuple[type, ...]] = {
    "string": str,
    "integer": int,
    "number": (int, float),
    "boolean": bool,
    "array": (list, tuple),
    "object": dict,
    "null": type(None),
}


def environment_variable(key: str) -> str:
    """The environment variable that sets config ``key``: ``dask-rmm.pool-size`` ->
    ``DASK_DASK_RMM__POOL_SIZE``."""
    return "DASK_" + key.upper().replace(".", "__").replace("-", "_")


class ConfigError(ValueError):
    """A ``dask-rmm.*`` config value is wrong; the message names the key and its variable."""

    def __init__(self, key: str, value: Any, reason: str):
        self.key = key
        super().__init__(f"config {key}={value!r} ({environment_variable(key)}): {reason}")


def config_value(key: str) -> Any:
    """``dask.config.get("dask-rmm.<key>")``, dask-rmm.yaml's default when unset (defaults
    survive code that resets Dask's config, such as distributed's test fixtures)."""
    default = defaults["dask-rmm"]
    for part in key.split("."):
        default = default[part]
    return dask.config.get(f"dask-rmm.{key}", default)


def _check(key: str, value: Any, schema: dict, unknown: list[str]) -> None:
    types = schema.get("type", [])
    types = [types] if isinstance(types, str) else types
    if types and not any(
        isinstance(value, _JSON_TYPES[t])
        and not (t in ("integer", "number") and isinstance(value, bool))
        for t in types
    ):
        raise ConfigError(key, value, f"expected {' or '.join(types)}")
    if "enum" in schema and value not in schema["enum"]:
        raise ConfigError(key, value, f"expected one of {', '.join(map(str, schema['enum']))}")
    if "minimum" in schema and isinstance(value, (int, float)) and value < schema["minimum"]:
        raise ConfigError(key, value, f"must be at least {schema['minimum']}")
    if "maximum" in schema and isinstance(value, (int, float)) and value > schema["maximum"]:
        raise ConfigError(key, value, f"must be at most {schema['maximum']}")
    if isinstance(value, dict):
        properties = schema.get("properties", {})
        for name, item in value.items():
            name = str(name).replace("_", "-")
            if name in properties:
                _check(f"{key}.{name}", item, properties[name], unknown)
            else:
                unknown.append(f"{key}.{name}")
    if isinstance(value, (list, tuple)) and "items" in schema:
        for item in value:
            _check(key, item, schema["items"], unknown)


def validate_config() -> None:
    """Check the ``dask-rmm.*`` config against dask-rmm-schema.yaml (and the interval by
    parsing it; sizes and the other options are parsed once, into :class:`~dask_rmm.stack.RMMOptions`,
    which names the key too); warn about keys the schema does not know (``dask-rmm.poolsize``), each
    once per process (not inside :func:`unknown_keys_unreported`).

    Raises
    ------
    ConfigError
        Naming the key and its environment variable: ``config
        dask-rmm.metrics.sample-interval='banana' (DASK_DASK_RMM__METRICS__SAMPLE_INTERVAL):
        ...``.
    """
    from dask.utils import parse_timedelta

    unknown: list[str] = []
    config = dask.config.get("dask-rmm", {})
    _check("dask-rmm", config, _SCHEMA, unknown)
    key, interval = "dask-rmm.metrics.sample-interval", config_value("metrics.sample-interval")
    try:
        if str(interval).strip().startswith("-"):  # dask's parser reads "-1" as "1-1"
            raise ValueError("negative; 0 turns sampling off")
        parse_timedelta(interval, default="ms")
    except (TypeError, ValueError, KeyError) as e:
        raise ConfigError(key, interval, f"not a time interval such as '100ms' ({e})") from None
    if not _report_unknown.get():
        return
    for key in unknown:
        if key in _warned_unknown:
            continue
        _warned_unknown.add(key)
        warnings.warn(
            f"unknown config key {key} ({environment_variable(key)}) ignored; dask-rmm's keys "
            f"are {', '.join(sorted(_SCHEMA['properties']))}",
            UserWarning,
            stacklevel=3,
        )
