"""The one module that imports ``cuda.bindings``: checked wrappers over the CUDA runtime.

Every call returns plain Python values or raises :class:`CUDAError`; no ``(err, value)``
tuple leaves this module. Importing it never touches the driver.
"""

from __future__ import annotations

import threading

__all__ = [
    "CUDAError",
    "CUDAUnavailableError",
    "check",
    "get_device",
    "get_device_count",
    "is_available",
]


class CUDAError(RuntimeError):
    """A CUDA runtime call failed. ``error_name`` is CUDA's name for the error
    (``"cudaErrorMemoryAllocation"``), ``call`` the function that failed."""

    def __init__(self, error_name: str, call: str, message: str | None = None):
        self.error_name = error_name
        self.call = call
        super().__init__(message or f"{call} failed: {error_name}")

    def __reduce__(self):
        return (type(self), (self.error_name, self.call, self.args[0]))


class CUDAUnavailableError(CUDAError):
    """CUDA was asked for on a host with no usable driver or device."""


_runtime = None
_available: bool | None = None
_probe_lock = threading.Lock()
_probe_reason = ""


def _rt():
    global _runtime
    if _runtime is None:
        try:
            from cuda.bindings import runtime
        except ImportError as e:  # pragma: no cover - cuda-python is a dependency
            raise CUDAUnavailableError(
                "ImportError", "import cuda.bindings", f"cuda-python is not importable: {e}"
            ) from e
        _runtime = runtime
    return _runtime


def _error_name(err) -> str:
    try:
        ok, name = _rt().cudaGetErrorName(err)
        return name.decode() if isinstance(name, bytes) else str(name)
    except Exception:
        return str(err)


def check(result, call: str):
    """Turn cuda-python's ``(err, *values)`` into the value(s) or raise CUDAError."""
    err = result[0]
    if err != 0:  # cudaSuccess; cudaError_t compares with ints
        raise CUDAError(_error_name(err), call)
    if len(result) == 1:
        return None
    if len(result) == 2:
        return result[1]
    return result[1:]


def is_available() -> bool:
    """True when a CUDA driver and at least one device are usable (probed once)."""
    global _available, _probe_reason
    if _available is None:
        with _probe_lock:
            if _available is None:
                try:
                    err, count = _rt().cudaGetDeviceCount()
                    if err != 0:
                        _probe_reason = _error_name(err)
                        _available = False
                    elif count < 1:
                        _probe_reason = "no CUDA device found"
                        _available = False
                    else:
                        _available = True
                except CUDAUnavailableError as e:
                    _probe_reason = str(e)
                    _available = False
    return _available


def require_cuda(what: str) -> None:
    """Raise one clear CUDAUnavailableError when CUDA is not usable on this host."""
    if not is_available():
        raise CUDAUnavailableError(
            "cudaErrorNoDevice",
            what,
            f"{what} needs a CUDA device, but none is usable on this host ({_probe_reason}). "
            "Use host memory explicitly: SystemMemoryResource(), reinitialize(base_resource='system') "
            "or config 'dask-rmm.base-resource: system'.",
        )


def get_device_count() -> int:
    """Number of CUDA devices (0 on a host without a driver or GPU)."""
    if not is_available():
        return 0
    return check(_rt().cudaGetDeviceCount(), "cudaGetDeviceCount")


def get_device() -> int:
    """The calling thread's current CUDA device."""
    require_cuda("cudaGetDevice")
    return check(_rt().cudaGetDevice(), "cudaGetDevice")
