"""Memory sizes in one place: the parser (bytes, ``"4GiB"`` strings, fractions of device memory),
the formatter (``format_bytes``) and the 256-byte CUDA alignment (``ALIGNMENT``, ``align_up``).

The forms of dask-cuda's ``parse_device_bytes`` (bytes, strings with a unit, fractions in (0, 1]
of the device's memory; ``0`` and ``None`` mean none), with two differences: the result is
rounded down to 256 bytes by default (the CUDA allocation alignment; dask-cuda's
``alignment_size`` defaults to 1, and its RMM setup passes 256), and a non-zero size below the
alignment is an error where dask-cuda rounds it down to 0. Used by ``mr`` (pool sizes),
``reinitialize``, the options of the Dask layer, the preload flags and the CLI. Imports neither
Dask nor CUDA (a fraction asks ``dask_rmm._cuda`` for the device's memory when it is parsed).
"""

from __future__ import annotations

import math
import os
import re
from collections.abc import Callable
from typing import Any

__all__ = [
    "ALIGNMENT",
    "align_up",
    "format_bytes",
    "host_total_memory",
    "parse_device_bytes",
    "parse_resource_size",
]

#: Every allocation is aligned to (and every size rounded up to) this many bytes,
#: the alignment cudaMalloc guarantees.
ALIGNMENT = 256


def align_up(nbytes: int, alignment: int = ALIGNMENT) -> int:
    """Round ``nbytes`` up to a multiple of ``alignment`` (a power of two)."""
    return (nbytes + alignment - 1) & ~(alignment - 1)


def format_bytes(n: int | float | None) -> str:
    """Human-readable binary size: ``format_bytes(3 << 30) == '3.00 GiB'``."""
    if n is None:
        return "unlimited"
    n = float(n)
    for unit in ("B", "KiB", "MiB", "GiB", "TiB", "PiB"):
        if abs(n) < 1024:
            return f"{int(n)} B" if unit == "B" else f"{n:.2f} {unit}"
        n /= 1024
    return f"{n:.2f} EiB"


_UNITS = {
    "b": 1, "k": 10**3, "m": 10**6, "g": 10**9, "t": 10**12, "p": 10**15,
    "ki": 2**10, "mi": 2**20, "gi": 2**30, "ti": 2**40, "pi": 2**50,
}  # fmt: skip
# A number, then an optional unit: "4GiB", "4 GB", "500mb", "1.5 KiB", "1024", "0.8", "1e9".
_SIZE = re.compile(r"^([0-9]*\.?[0-9]+(?:[eE][+-]?[0-9]+)?)\s*([a-zA-Z]*)$")

_FORMS = "bytes (an int or '4GiB') or a fraction of device memory in (0, 1]"


def host_total_memory() -> int:
    """Physical memory of this host in bytes (what fractions of host memory refer to)."""
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


def _device_total_memory(device: int | None) -> int:
    from dask_rmm import _cuda

    if not _cuda.is_available():
        raise ValueError("this host has no usable CUDA device to take a fraction of")
    return _cuda.device_total_memory(device)


def _fraction(value: Any, fraction: float, total: Any, device: int | None, what: str) -> int:
    if not 0 < fraction <= 1:
        raise ValueError(f"{what}: a fraction of device memory must be in (0, 1]; give {_FORMS}")
    if callable(total):
        total = total()
    elif total is None:
        try:
            total = _device_total_memory(device)
        except ValueError as e:
            raise ValueError(f"{what}: {e}; give bytes ('4GiB') or pass total_memory=") from None
    if isinstance(total, bool) or not isinstance(total, int) or total <= 0:
        raise ValueError(f"total_memory must be a positive int of bytes, got {total!r}")
    return int(total * fraction)


def parse_device_bytes(
    value: int | str | float | None,
    device: int | None = None,
    alignment: int = ALIGNMENT,
    *,
    total_memory: int | Callable[[], int] | None = None,
    option: str | None = None,
) -> int | None:
    """A memory size in bytes, or None for "none".

    * ``None``, ``0``, ``"0"``: None (no pool, no limit: "none" as in dask-cuda);
    * an int, or a string of digits (``"1024"``, ``"1"``): bytes;
    * a string with a unit: ``"4GiB"``, ``"500MB"``, ``"4 GB"`` (``k`` is 1000, ``Ki`` 1024);
      a bare unit (``"GiB"``) is an error;
    * a float in (0, 1], or a string holding one (``"0.8"``, ``"1.0"``): that fraction of the
      total memory of ``device`` (or of ``total_memory``). A whole float above 1 (``4e9``) is
      bytes.

    The result is rounded *down* to a multiple of ``alignment`` so that a maximum is never
    exceeded; a non-zero size below ``alignment`` is an error.

    Parameters
    ----------
    value : int, str, float or None
        The size.
    device : int, optional
        The device a fraction refers to; default the current device.
    alignment : int
        Round down to a multiple of this (a positive int; 1 for exact bytes).
    total_memory : int or callable, optional
        What a fraction is taken of, instead of the device's memory (a callable is called only
        when a fraction is given): lets hosts without a GPU and host-memory resources parse
        fractions.
    option : str, optional
        The option being parsed, named in error messages (``"pool_size"``).

    Raises
    ------
    TypeError
        For bools and other non-size types.
    ValueError
        For negative or unparseable sizes, fractions outside (0, 1], a fraction on a host
        without a GPU and no ``total_memory``, and a non-zero size below ``alignment``.

    Examples
    --------
    >>> parse_device_bytes("4GiB")
    4294967296
    >>> parse_device_bytes(1000)
    768
    >>> parse_device_bytes(0.5, total_memory=80 << 30)
    42949672960
    >>> parse_device_bytes("0") is None
    True
    """
    if isinstance(alignment, bool) or not isinstance(alignment, int) or alignment < 1:
        raise ValueError(f"alignment must be a positive int, got {alignment!r}")
    what = f"{option}={value!r}" if option else f"invalid size {value!r}"
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, float, str)):
        if isinstance(value, bool) or not hasattr(value, "__index__"):
            raise TypeError(f"{what} ({type(value).__name__}): expected {_FORMS}")
        value = value.__index__()
    if isinstance(value, str):
        m = _SIZE.match(value.strip())
        if m is None:
            raise ValueError(f"{what}: not a size; expected {_FORMS}, such as '4GiB' or 0.8")
        number, unit = float(m.group(1)), m.group(2).lower().removesuffix("b") or "b"
        if m.group(2):
            if unit not in _UNITS:
                raise ValueError(
                    f"{what}: unknown unit {m.group(2)!r}; use B, kB, MB, GB, KiB, MiB, GiB, TiB"
                )
            nbytes = int(number * _UNITS[unit])
        elif m.group(1).isdigit():
            nbytes = int(m.group(1))
        elif 0 < number <= 1:
            nbytes = _fraction(value, number, total_memory, device, what)
        elif number.is_integer():
            nbytes = int(number)
        else:
            raise ValueError(f"{what}: a number must be whole bytes or a fraction in (0, 1]")
    elif isinstance(value, float):
        if not math.isfinite(value) or value < 0:
            raise ValueError(f"{what}: expected {_FORMS}")
        if value == 0:
            return None
        if value <= 1:
            nbytes = _fraction(value, value, total_memory, device, what)
        elif value.is_integer():
            nbytes = int(value)
        else:
            raise ValueError(f"{what}: a float above 1 must be whole bytes")
    else:
        nbytes = value
    if nbytes < 0:
        raise ValueError(f"{what}: must be >= 0")
    if nbytes == 0:
        return None
    aligned = nbytes // alignment * alignment
    if not aligned:
        raise ValueError(f"{what}: {nbytes} bytes is smaller than the {alignment}-byte alignment")
    return aligned


def parse_resource_size(value: int | str | float, upstream: Any, option: str) -> int:
    """A size given to a memory resource (``PoolMemoryResource(initial_pool_size=...)``): as
    :func:`parse_device_bytes`, a fraction taken of ``upstream``'s memory (the host's for a
    host-memory resource), and 0 for "none"."""

    def total() -> int:
        if getattr(upstream, "is_host_memory", False):
            return host_total_memory()
        return _device_total_memory(getattr(upstream, "device_id", None))

    return parse_device_bytes(value, total_memory=total, option=option) or 0
