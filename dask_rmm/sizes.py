"""Memory sizes: the one parser (:func:`parse_size`, read once where a size is given), a fraction
of a device's memory resolved to bytes (:func:`parse_device_bytes`, dask-cuda's name and forms),
and the 256-byte CUDA alignment. Units are ``dask.utils.parse_bytes``'s, imported on first use.
"""

from __future__ import annotations

import math
import os
from collections.abc import Callable
from typing import Any

__all__ = [
    "ALIGNMENT",
    "MAX_SIZE",
    "align_up",
    "format_bytes",
    "host_total_memory",
    "parse_device_bytes",
    "parse_size",
]

#: Every allocation is aligned to (every size rounded up to) cudaMalloc's alignment.
ALIGNMENT = 256

#: No memory is 16 EiB (a 64-bit address space) or more: a size at or above it is refused.
MAX_SIZE = 1 << 64

_FORMS = "bytes (an int or '4GiB') or a fraction of device memory in (0, 1]"


def align_up(nbytes: int, alignment: int = ALIGNMENT) -> int:
    """Round ``nbytes`` up to a multiple of ``alignment`` (a power of two)."""
    return (nbytes + alignment - 1) & ~(alignment - 1)


def format_bytes(n: int | float | None) -> str:
    """``dask.utils.format_bytes`` with a sign, and ``"unlimited"`` for None:
    ``format_bytes(3 << 30) == '3.00 GiB'``."""
    from dask.utils import format_bytes as dask_format_bytes

    if n is None:
        return "unlimited"
    return ("-" if n < 0 else "") + dask_format_bytes(abs(int(n)))


def host_total_memory() -> int:
    """Physical memory of this host in bytes (what fractions of host memory refer to)."""
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


def parse_size(
    value: Any, option: str | None = None, alignment: int = ALIGNMENT
) -> int | float | None:
    """A size as bytes (an int: ints, digit strings, ``dask.utils.parse_bytes`` strings, whole
    floats above 1), a fraction of memory (a float in (0, 1]), or None (``None``, ``0``,
    ``"0"``). Errors name ``option`` and the value.

    >>> parse_size("4GiB"), parse_size("0.8"), parse_size(0)
    (4294967296, 0.8, None)
    """
    what = f"{option}={value!r}" if option else f"invalid size {value!r}"
    if isinstance(value, bool) or not isinstance(value, (int, float, str, type(None))):
        if isinstance(value, bool) or not hasattr(value, "__index__"):
            raise TypeError(f"{what} ({type(value).__name__}): expected {_FORMS}")
        value = value.__index__()
    if isinstance(value, str):
        text = value.strip()
        if not text[:1].isdigit() and text[:1] != ".":  # "GiB", "-1GB", "inf": not a size
            raise ValueError(f"{what}: not a size; expected {_FORMS}, such as '4GiB' or 0.8")
        try:
            value = int(text) if text.isdigit() else float(text)  # "1" a byte, "1.0" all memory
        except ValueError:
            from dask.utils import parse_bytes

            try:
                value = parse_bytes(text)
            except OverflowError:
                value = MAX_SIZE
            except ValueError as e:
                raise ValueError(f"{what}: {e}; use B, kB, MB, GB, KiB, MiB, GiB, TiB") from None
    if isinstance(value, float):
        if not math.isfinite(value) or value < 0:
            raise ValueError(f"{what}: expected {_FORMS}")
        if 0 < value <= 1:
            return value
        if not value.is_integer():
            raise ValueError(f"{what}: a number must be whole bytes or a fraction in (0, 1]")
        value = int(value)
    if not value:
        return None
    if value < 0:
        raise ValueError(f"{what}: must be >= 0")
    if value >= MAX_SIZE:
        raise ValueError(
            f"{what}: more memory than any device or host can have "
            f"(a 64-bit address space holds less than {format_bytes(MAX_SIZE)})"
        )
    if value < alignment:
        raise ValueError(f"{what}: {value} bytes is smaller than the {alignment}-byte alignment")
    return value


def _total(total_memory: Any, device: Any, what: str) -> int:
    if callable(total_memory):
        total_memory = total_memory()
    elif total_memory is None:
        from dask_rmm import _cuda

        if getattr(device, "is_host_memory", False):  # a resource drawing host memory
            return host_total_memory()
        device = getattr(device, "device_id", device)
        if not _cuda.is_available():
            raise ValueError(
                f"{what}: this host has no usable CUDA device to take a fraction of; give bytes "
                "('4GiB') or pass total_memory="
            )
        return _cuda.device_total_memory(device)
    if isinstance(total_memory, bool) or not isinstance(total_memory, int) or total_memory <= 0:
        raise ValueError(f"total_memory must be a positive int of bytes, got {total_memory!r}")
    return total_memory


def parse_device_bytes(
    value: int | str | float | None,
    device: Any = None,
    alignment: int = ALIGNMENT,
    *,
    total_memory: int | Callable[[], int] | None = None,
    option: str | None = None,
) -> int | None:
    """:func:`parse_size` in bytes (or None), a fraction taken of the memory of ``device`` (the
    current one, or a resource's: the host's for host memory) or of ``total_memory`` (an int, or
    a callable called only for a fraction), rounded *down* to a multiple of ``alignment``.
    ``option`` is named in errors.

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
    size = parse_size(value, option, alignment)
    if size is None:
        return None
    what = f"{option}={value!r}" if option else f"invalid size {value!r}"
    nbytes = int(_total(total_memory, device, what) * size) if isinstance(size, float) else size
    aligned = nbytes // alignment * alignment
    if not aligned:
        raise ValueError(f"{what}: {nbytes} bytes is smaller than the {alignment}-byte alignment")
    return aligned
