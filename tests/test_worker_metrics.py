"""dask_rmm.worker_metrics helpers: retired bytes of replaced stacks, the physical device's name."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from dask_rmm.worker_metrics import device_identity, retired_bytes


@pytest.mark.parametrize(
    "stack, expected",
    [
        (SimpleNamespace(), 0),
        (SimpleNamespace(retired_bytes=300), 300),
        (SimpleNamespace(retired_bytes=lambda: 512), 512),
        (SimpleNamespace(retired_bytes=None), 0),
    ],
)
def test_retired_bytes_reads_what_the_stack_offers(stack, expected):
    assert retired_bytes(stack) == expected


def test_host_memory_is_named_host():
    assert device_identity(0, True) == {"gpu_name": "host", "gpu_uuid": "", "pci_bus_id": ""}


@pytest.mark.gpu
def test_gpu_identity_names_the_physical_device():
    ident = device_identity(0, False)
    assert ident["gpu_name"] and ident["gpu_name"] != "host"
    assert ident["gpu_uuid"].startswith("GPU-") and len(ident["gpu_uuid"]) == 40
    assert ident["pci_bus_id"].count(":") == 2
