"""dask_rmm.worker.metrics helpers: retired bytes of replaced stacks, the physical device's name."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from dask_rmm.worker.metrics import device_identity, retired_bytes


def test_retired_bytes_sum_the_live_bytes_of_that_device_only():
    dev0 = [SimpleNamespace(device=0, live_bytes=300), SimpleNamespace(device=0, live_bytes=12)]
    dev1 = [SimpleNamespace(device=1, live_bytes=7)]
    assert retired_bytes(dev0 + dev1, 0) == 312
    assert retired_bytes(dev0 + dev1, 1) == 7
    assert retired_bytes([], 0) == 0


def test_host_memory_is_named_host():
    assert device_identity(0, True) == {"gpu_name": "host", "gpu_uuid": "", "pci_bus_id": ""}


@pytest.mark.gpu
def test_gpu_identity_names_the_physical_device():
    ident = device_identity(0, False)
    assert ident["gpu_name"] and ident["gpu_name"] != "host"
    assert ident["gpu_uuid"].startswith("GPU-") and len(ident["gpu_uuid"]) == 40
    assert ident["pci_bus_id"].count(":") == 2
