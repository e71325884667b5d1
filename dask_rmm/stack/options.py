"""The one options model of a worker's memory setup: :class:`RMMOptions`, built from every
place options are given and owning their validation. Imports neither distributed nor CUDA."""

from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass
from typing import Any

from dask_rmm.allocators import CACHED_ALLOCATORS, allocator_names
from dask_rmm.sizes import ALIGNMENT, format_bytes, parse_size

__all__ = ["BASE_RESOURCES", "OptionError", "RMMOptions"]

#: Where memory comes from: cudaMalloc, cudaMallocManaged, cudaMallocAsync, pinned host memory,
#: host memory (the only one that works without a GPU; never picked silently).
BASE_RESOURCES = ("cuda", "managed", "async", "pinned", "system")


class OptionError(ValueError, RuntimeError):
    """Options that cannot go together (``initial_pool_size > maximum_pool_size``, ...).

    A ValueError, and a RuntimeError as RMM raises for the same mistakes in ``reinitialize``.
    """


def _bool(option: str, value: Any) -> bool:
    text = value.strip().lower() if isinstance(value, str) else None
    if text in ("true", "1", "yes", "on"):
        return True
    if text in ("false", "0", "no", "off", ""):
        return False
    if isinstance(value, bool) or (isinstance(value, int) and value in (0, 1)):
        return bool(value)
    raise TypeError(f"`{option}` must be True or False, got {value!r}")


def _devices(value: Any) -> tuple[int, ...] | None:
    if value is None:
        return None
    if isinstance(value, str):
        value = [v for v in value.replace(" ", "").split(",") if v]
    elif isinstance(value, int) and not isinstance(value, bool):
        value = [value]
    try:
        devices = tuple(int(d) for d in value)
    except (TypeError, ValueError):
        raise TypeError(
            f"`devices` must be device ids such as [0, 1] or '0,1', got {value!r}"
        ) from None
    if any(d < 0 for d in devices) or len(set(devices)) != len(devices):
        raise ValueError(f"`devices` must be distinct non-negative device ids, got {list(devices)}")
    return devices or None


def _log_directory(value: Any) -> str | None:
    if value is None:
        return None
    if not isinstance(value, (str, os.PathLike)) or not os.fspath(value):
        raise TypeError(f"`log_directory` must be a directory path, got {value!r}")
    path = os.fspath(value)
    if "\0" in path:
        raise ValueError(f"`log_directory` {path!r} holds a NUL byte, which no path can")
    if os.path.exists(path) and not os.path.isdir(path):
        raise ValueError(f"`log_directory` {path!r} exists and is not a directory")
    return path


def _pause_fraction(value: Any) -> float | None:
    if value is None or value is False:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 < value <= 1:
        raise ValueError(f"`device_pause_fraction` must be in (0, 1], None or False, got {value!r}")
    return float(value)


def base_resource_of(base: Any, managed_memory: Any = False, async_alloc: Any = False) -> Any:
    """``base_resource`` with dask-cuda's switches folded in: ``managed_memory=True`` is
    ``"managed"``, ``async_alloc=True`` ``"async"`` (over ``"cuda"``, the default, or None)."""
    managed = _bool("managed_memory", managed_memory or False)
    asynchronous = _bool("async_alloc", async_alloc or False)
    if managed and asynchronous:
        raise OptionError("`managed_memory` is incompatible with `async_alloc`: pick one")
    alias = "managed" if managed else "async" if asynchronous else None
    if alias is None or base in (None, "cuda", alias):
        return alias or base
    raise OptionError(
        f"`{'managed_memory' if managed else 'async_alloc'}=True` means "
        f"base_resource={alias!r}, which conflicts with base_resource={base!r}"
    )


def _check_pool_sizes(pool: Any, maximum: Any, where: str = "") -> None:
    """RMM's error when the maximum pool size is below the initial one (both bytes, or both
    fractions)."""

    def describe(value: int | float) -> str:
        return f"{value:.0%} of device memory" if isinstance(value, float) else format_bytes(value)

    if type(pool) is type(maximum) and pool is not None and maximum < pool:
        raise OptionError(
            f"Initial pool size exceeds the maximum pool size: `maximum_pool_size` "
            f"({describe(maximum)}) is smaller than `pool_size` ({describe(pool)}){where}"
        )


@dataclass(frozen=True)
class RMMOptions:
    """What a worker's (or ``reinitialize``'s) memory setup is made of, checked once.

    The fields are the options of docs/workers.md's table (the config keys of
    dask-rmm-schema.yaml, ``_`` written ``-``), plus ``pool_allocator`` (true whenever
    ``pool_size`` is given) and ``log_file_name`` (``reinitialize(logging=True)``'s file). Sizes
    are bytes (an int), or fractions of each device's memory (a float in (0, 1]) that
    :func:`build_stack` resolves on the device; both aligned down to 256 bytes there.
    """

    base_resource: str = "cuda"  # one of BASE_RESOURCES
    pool_allocator: bool = False
    pool_size: int | float | None = None
    maximum_pool_size: int | float | None = None
    release_threshold: int | float | None = None
    log_directory: str | None = None
    log_file_name: str | None = None
    track_allocations: bool = False
    statistics: bool = True
    allocators: tuple[str, ...] = ()
    exact_allocators: tuple[str, ...] = ()
    devices: tuple[int, ...] | None = None
    device_memory_limit: int | float | None = None
    spill_on_oom: bool = False
    device_pause_fraction: float | None = 0.8
    memory_admission: bool = False
    oom_retry: bool = True

    def __post_init__(self) -> None:
        base = self.base_resource
        if not isinstance(base, str) or base.strip().lower() not in BASE_RESOURCES:
            raise ValueError(
                f"`base_resource` must be one of {', '.join(map(repr, BASE_RESOURCES))}, got {base!r}"
            )
        exact = self.exact_allocators
        if exact is True or (isinstance(exact, str) and exact.strip().lower() in ("true", "all")):
            exact = CACHED_ALLOCATORS
        parsed = {
            "base_resource": base.strip().lower(),
            **{name: parse_size(getattr(self, name), name) for name in _SIZES},
            **{name: _bool(name, getattr(self, name)) for name in _SWITCHES},
            "allocators": tuple(allocator_names(self.allocators)),
            "exact_allocators": tuple(allocator_names(exact or (), "exact_allocators")),
            "devices": _devices(self.devices),
            "log_directory": _log_directory(self.log_directory),
            "device_pause_fraction": _pause_fraction(self.device_pause_fraction),
        }
        if self.log_file_name is not None:
            parsed["log_file_name"] = os.fspath(self.log_file_name)
        parsed["pool_allocator"] = parsed["pool_allocator"] or parsed["pool_size"] is not None
        for name, value in parsed.items():
            object.__setattr__(self, name, value)
        # options that do not go together
        unrouted = [name for name in self.exact_allocators if name not in self.allocators]
        if unrouted and (exact is not CACHED_ALLOCATORS or not self.allocators):  # else ignored
            raise OptionError(
                f"`exact_allocators` {unrouted} need `allocators` naming them too (an exact "
                f"path is a way of routing one; `allocators` is {list(self.allocators)})"
            )
        pool = self.pool_allocator or self.base_resource == "async"
        if self.release_threshold is not None and not pool:
            raise OptionError(
                "`release_threshold` requires a pool: `pool_size` (a PoolMemoryResource) or "
                "`async_alloc=True`"
            )
        if self.maximum_pool_size is not None and not pool:
            raise OptionError(
                "`maximum_pool_size` was given without `pool_size`; set `pool_size` to use a pool"
            )
        _check_pool_sizes(self.pool_size, self.maximum_pool_size)
        if self.host_memory and self.allocators:
            raise OptionError(
                f"`allocators` {list(self.allocators)} need device memory: they cannot use "
                f"host memory from base_resource={self.base_resource!r}"
            )

    @classmethod
    def from_config(cls, **given: Any) -> RMMOptions:
        """Options from keyword arguments (RMMPlugin's names, including the dask-cuda aliases
        ``managed_memory=True`` and ``async_alloc=True``), the rest from the ``dask-rmm.*``
        config: its other keys checked by :func:`dask_rmm.config.validate_config`, a bad value
        of an option raising :class:`~dask_rmm.config.ConfigError` (naming the key and its
        environment variable)."""
        from dask_rmm.config import ConfigError, config_value, validate_config

        validate_config()
        aliases = given.pop("managed_memory", False), given.pop("async_alloc", False)
        base = base_resource_of(given.get("base_resource"), *aliases)
        if base is not None:
            given["base_resource"] = base
        configured = {
            f.name: config_value(f.name.replace("_", "-"))
            for f in CONFIG_FIELDS
            if f.name not in given
        }
        try:
            return cls(**configured, **given)
        except (TypeError, ValueError) as e:
            for name, value in sorted(configured.items()):  # a config value alone at fault?
                try:
                    cls(pool_allocator=True, **{name: value})
                except (TypeError, ValueError) as own:
                    raise ConfigError(f"dask-rmm.{name.replace('_', '-')}", value, str(own)) from e
            raise

    def to_dict(self) -> dict[str, Any]:
        """The options as plain values (lists for tuples)."""
        return {
            k: list(v) if isinstance(v, tuple) else v for k, v in dataclasses.asdict(self).items()
        }

    def resolve_size(self, option: str, device: int, total: int) -> int | None:
        """Option ``option`` (parsed already: bytes or a fraction) in bytes on a device of
        ``total`` bytes, aligned down to 256."""
        value = getattr(self, option)
        if value is None:
            return None
        nbytes = int(total * value) if isinstance(value, float) else value
        nbytes = nbytes // ALIGNMENT * ALIGNMENT
        if not nbytes:
            raise OptionError(
                f"`{option}` ({value:.0%} of {format_bytes(total)}) is below 256 bytes"
            )
        if nbytes > total:
            where = "host memory" if self.host_memory else f"device {device}'s memory"
            raise OptionError(
                f"`{option}` ({format_bytes(nbytes)}) is larger than {where} ({format_bytes(total)})"
            )
        return nbytes

    @property
    def host_memory(self) -> bool:
        return self.base_resource in ("system", "pinned")


#: Sizes: bytes or a fraction of each device's memory.
_SIZES = ("pool_size", "maximum_pool_size", "release_threshold", "device_memory_limit")
#: Switches: every bool field.
_SWITCHES = tuple(f.name for f in dataclasses.fields(RMMOptions) if f.type == "bool")
#: Options with a ``dask-rmm.<name>`` config key (``_`` written ``-``).
CONFIG_FIELDS = [
    f for f in dataclasses.fields(RMMOptions) if f.name not in ("pool_allocator", "log_file_name")
]
