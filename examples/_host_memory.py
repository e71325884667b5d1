"""The examples' one rule for host memory: used when asked, or said on stdout when this host has
no GPU (nothing falls back silently). Imported by the example scripts beside it."""

from __future__ import annotations

from dask_rmm import _cuda


def use_host_memory(asked: bool) -> bool:
    """Whether to run on host memory: when asked (``--host-memory``), or, as the quickstart
    does, when this host has no GPU (said on stdout, so that nothing falls back silently)."""
    if asked:
        return True
    if _cuda.is_available():
        return False
    print(
        "No GPU on this host: using base_resource='system' (host memory), as --host-memory "
        "does; pass --host-memory to choose it yourself"
    )
    return True
