"""dask-rmm's Dask configuration (namespace ``dask-rmm``) and the one parser for memory sizes.

Importing this module registers ``dask-rmm.yaml``'s defaults with ``dask.config``; the schema
beside it documents every key. It never imports distributed. Building resources from these
settings is the plugin's job, not this module's.
"""

from __future__ import annotations

import math
import os
import re
from typing import Any

import dask.config
import yaml
from dask.utils import parse_bytes

__all__ = ["SCHEMA_PATH", "YAML_PATH", "defaults", "parse_device_bytes"]

YAML_PATH = os.path.join(os.path.dirname(__file__), "dask-rmm.yaml")
SCHEMA_PATH = os.path.join(os.path.dirname(__file__), "dask-rmm-schema.yaml")

with open(YAML_PATH) as f:
    #: The defaults as read from dask-rmm.yaml (``{"dask-rmm": {...}}``).
    defaults: dict = yaml.safe_load(f)

dask.config.update_defaults(defaults)

# A plain number written as a string: "0.9", "1.0", "1e9", "1024".
_NUMBER = re.compile(r"^\s*[+-]?(\d+\.?\d*|\.\d+)([eE][+-]?\d+)?\s*$")


def _fraction_bytes(fraction: float, value: Any, device: int | None, total_memory: Any) -> int:
    if not 0 < fraction <= 1:
        raise ValueError(
            f"invalid device memory size {value!r}: a float is a fraction of the device's memory "
            "and must be in (0, 1]; give bytes as an int or a string such as '4GiB'"
        )
    if total_memory is None:
        from dask_rmm import _cuda

        if not _cuda.is_available():
            raise ValueError(
                f"cannot turn the fraction {value!r} into bytes: this host has no usable CUDA "
                "device to take a fraction of; give bytes ('4GiB') or pass total_memory="
            )
        total_memory = _cuda.device_total_memory(device)
    elif isinstance(total_memory, bool) or not isinstance(total_memory, int) or total_memory <= 0:
        raise ValueError(f"total_memory must be a positive int of bytes, got {total_memory!r}")
    return int(total_memory * fraction)


def parse_device_bytes(
    value: int | str | float,
    device: int | None = None,
    alignment: int = 256,
    *,
    total_memory: int | None = None,
) -> int:
    """A memory size in bytes, from an int, a size string or a fraction of device memory.

    The result is rounded *down* to a multiple of ``alignment`` (256, the CUDA allocation
    alignment RMM requires of pool sizes), so that a maximum is never exceeded and a fraction
    of memory never asks for more than the device has.

    Parameters
    ----------
    value : int, str or float
        * an int: bytes (``4 << 30``);
        * a size string understood by :func:`dask.utils.parse_bytes`: ``"4GiB"``, ``"500MB"``,
          ``"4 GB"``;
        * a float in (0, 1], or a string holding one (``"0.9"``): that fraction of the total
          memory of ``device``. Plain whole numbers in a string (``"1024"``, ``"1e9"``) are bytes.
    device : int, optional
        The device a fraction refers to; default the current device.
    alignment : int
        Round down to a multiple of this (a positive int).
    total_memory : int, optional
        The total to take a fraction of, instead of asking CUDA (lets hosts without a GPU, and
        clients sizing a remote worker, parse fractions).

    Returns
    -------
    int
        Bytes, a multiple of ``alignment``. 0 only when ``value`` is 0.

    Raises
    ------
    TypeError
        For bools, None and other non-size types.
    ValueError
        For negative sizes, unparseable strings (``"4 gigs"``, ``"-1GB"``), floats outside
        (0, 1] (``1.5``), a fraction on a host without a GPU and no ``total_memory``, and a
        non-zero size smaller than ``alignment``.

    Examples
    --------
    >>> parse_device_bytes("4GiB")
    4294967296
    >>> parse_device_bytes(1000)
    768
    >>> parse_device_bytes(0.5, total_memory=80 << 30)
    42949672960
    """
    if isinstance(alignment, bool) or not isinstance(alignment, int) or alignment < 1:
        raise ValueError(f"alignment must be a positive int, got {alignment!r}")
    if isinstance(value, bool) or value is None:
        raise TypeError(
            f"invalid device memory size {value!r}: expected an int of bytes, a size string "
            "such as '4GiB' or a fraction of device memory in (0, 1]"
        )
    if isinstance(value, float):
        if not math.isfinite(value):
            raise ValueError(f"invalid device memory size {value!r}")
        nbytes = _fraction_bytes(value, value, device, total_memory)
    elif isinstance(value, str):
        text = value.strip()
        if not text:
            raise ValueError(f"invalid device memory size {value!r}: empty string")
        if _NUMBER.match(text):
            number = float(text)
            if 0 < number <= 1 and not text.lstrip("+").isdigit():
                nbytes = _fraction_bytes(number, value, device, total_memory)
            elif number.is_integer() and number >= 0:
                nbytes = int(text) if text.isdigit() else int(number)
            else:
                raise ValueError(
                    f"invalid device memory size {value!r}: a number must be whole bytes "
                    "or a fraction of device memory in (0, 1]"
                )
        else:
            if not text[0].isdigit():
                # parse_bytes reads a bare unit ("GiB") as one of it and "-1GB" as negative
                raise ValueError(
                    f"invalid device memory size {value!r}: expected a non-negative number "
                    "and a unit, such as '4GiB' or '500MB'"
                )
            try:
                nbytes = parse_bytes(text)
            except ValueError as e:
                raise ValueError(f"invalid device memory size {value!r}: {e}") from None
    elif hasattr(value, "__index__"):
        nbytes = value.__index__()
    else:
        raise TypeError(
            f"invalid device memory size {value!r} ({type(value).__name__}): expected an int "
            "of bytes, a size string such as '4GiB' or a fraction of device memory in (0, 1]"
        )
    if nbytes < 0:
        raise ValueError(f"invalid device memory size {value!r}: must be >= 0")
    aligned = nbytes // alignment * alignment
    if nbytes and not aligned:
        raise ValueError(
            f"device memory size {value!r} ({nbytes} bytes) is smaller than the "
            f"{alignment}-byte alignment"
        )
    return aligned
