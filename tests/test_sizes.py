"""dask_rmm.sizes: the one size parser (dask-cuda's parse_device_bytes semantics)."""

from __future__ import annotations

import subprocess
import sys

import pytest

from dask_rmm import mr
from dask_rmm.sizes import host_total_memory, parse_device_bytes, parse_size


def test_one_is_a_byte_and_one_point_zero_is_all_memory():
    assert parse_device_bytes(1, alignment=1) == 1
    assert parse_device_bytes("1", alignment=1) == 1
    assert parse_device_bytes("1.0", total_memory=1 << 30) == 1 << 30
    assert parse_device_bytes(".5", total_memory=1 << 30) == 1 << 29


def test_fraction_total_is_asked_only_for_fractions():
    def total():
        raise AssertionError("asked for the total of a byte size")

    assert parse_device_bytes("4GiB", total_memory=total) == 4 << 30


@pytest.mark.parametrize("value", ["GiB", "4 gigs", "-1GB", "1.5"])
def test_errors_name_the_option_and_value(value):
    with pytest.raises(ValueError) as info:
        parse_device_bytes(value, total_memory=1 << 30, option="pool_size")
    assert f"pool_size={value!r}" in str(info.value)


def test_resource_sizes_take_fractions_of_the_resources_memory():
    up = mr.SystemMemoryResource()
    assert parse_device_bytes(0.5, up) == host_total_memory() // 2 // 256 * 256
    assert parse_device_bytes(0, up) is None
    pool = mr.PoolMemoryResource(up, initial_pool_size=1000, maximum_pool_size="0.001")
    assert pool.pool_size() == 768


@pytest.mark.parametrize(
    "value, expected",
    [
        ("4GiB", 4 << 30),
        ("0.8", 0.8),
        (0.5, 0.5),
        ("1024", 1024),
        (4e9, 4_000_000_000),
        ("0", None),
    ],
)
def test_parsed_once_into_bytes_or_a_fraction(value, expected):
    assert parse_size(value) == expected
    assert parse_size(parse_size(value)) == expected  # a parsed value travels as itself


@pytest.mark.parametrize("value", ["1e300GiB", 1e300, 1 << 64, "20000 PiB"])
def test_too_large_is_a_clear_error(value):
    with pytest.raises(ValueError, match=r"pool_size=.*more memory than any device or host") as e:
        parse_size(value, "pool_size")
    assert len(str(e.value)) < 150, e.value  # 1e300 read as a 300-digit number of PiB


def test_importing_sizes_imports_neither_dask_nor_cuda():
    code = (
        "import sys, dask_rmm.sizes as s; s.parse_device_bytes(1 << 20); "
        "print(sorted(m for m in sys.modules if m.split('.')[0] in ('dask', 'distributed', 'cuda')))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"
