"""dask-rmm's Dask configuration (namespace ``dask-rmm``): importing registers ``dask-rmm.yaml``'s
defaults; reading, and the checks of the keys that are not options (docs/internals.md, Config).
It never imports distributed.
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
from dask.utils import parse_timedelta

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

#: Unknown keys already warned about in this process: a preloaded worker makes its plugin
#: twice (the flags checked when parsed, then at setup), and the user needs to read it once.
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

#: The keys that are integers and not options: ``(least, most)`` (None: no bound).
_INTEGERS = {
    "metrics.top-task-groups": (0, 64),
    "scheduler.timeline-length": (2, None),
    "scheduler.timeline-levels": (1, None),
    "scheduler.keep-gone": (0, None),
    "scheduler.page-rows": (1, None),
    "scheduler.prometheus-device-limit": (0, None),
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


def _unknown(config: Any, known: dict, prefix: str) -> Iterator[str]:
    for name, value in config.items() if isinstance(config, dict) else ():
        key, name = f"{prefix}.{name}", str(name).replace("_", "-")
        if name not in known:
            yield key
        elif isinstance(known[name], dict):
            yield from _unknown(value, known[name], key)


def validate_config() -> None:
    """Check the ``dask-rmm.*`` keys that are not options (:class:`ConfigError`); warn about
    keys dask-rmm.yaml does not have, each once per process (not inside
    :func:`unknown_keys_unreported`)."""
    for name, (least, most) in _INTEGERS.items():
        value = config_value(name)
        if isinstance(value, bool) or not isinstance(value, int):
            raise ConfigError(f"dask-rmm.{name}", value, "expected an integer")
        if value < least or (most is not None and value > most):
            bound = f"at least {least}" if value < least else f"at most {most}"
            raise ConfigError(f"dask-rmm.{name}", value, f"must be {bound}")
    key, interval = "dask-rmm.metrics.sample-interval", config_value("metrics.sample-interval")
    try:
        if str(interval).strip().startswith("-"):  # dask's parser reads "-1" as "1-1"
            raise ValueError("negative; 0 turns sampling off")
        parse_timedelta(interval, default="ms")
    except (TypeError, ValueError, KeyError) as e:
        raise ConfigError(key, interval, f"not a time interval such as '100ms' ({e})") from None
    if not _report_unknown.get():
        return
    for key in _unknown(dask.config.get("dask-rmm", {}), defaults["dask-rmm"], "dask-rmm"):
        if key in _warned_unknown:
            continue
        _warned_unknown.add(key)
        warnings.warn(
            f"unknown config key {key} ({environment_variable(key)}) ignored; dask-rmm's keys "
            f"are {', '.join(sorted(defaults['dask-rmm']))}",
            UserWarning,
            stacklevel=3,
        )
