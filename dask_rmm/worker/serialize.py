"""Dask serializers for :class:`~dask_rmm.DeviceBuffer`: host frames (``dask``) and device
frames (``cuda``), registered with ``distributed.protocol`` when this module is imported.

``import dask_rmm`` arranges that distributed imports this module the first time it
(de)serializes a dask_rmm object, whenever distributed is loaded before dask_rmm (always so in
workers). Pickling is ``DeviceBuffer.__reduce__``, not here.
"""

from __future__ import annotations

import logging
import math
from typing import Any

from distributed.protocol import (
    cuda_deserialize,
    cuda_serialize,
    dask_deserialize,
    dask_serialize,
)

from dask_rmm._cuda import CUDAUnavailableError
from dask_rmm.device_buffer import DeviceBuffer, to_device
from dask_rmm.mr.registry import get_current_device_resource
from dask_rmm.sizes import format_bytes

__all__ = [
    "NoMemoryForDeviceBufferError",
    "cuda_deserialize_device_buffer",
    "cuda_serialize_device_buffer",
    "dask_deserialize_device_buffer",
    "dask_serialize_device_buffer",
]


class NoMemoryForDeviceBufferError(CUDAUnavailableError):
    """A DeviceBuffer arrived in a process whose current resource needs a GPU it lacks (a
    client without a GPU gathering a result from host-memory workers)."""


def _receiving_resource(nbytes: int) -> Any:
    """The resource a received DeviceBuffer of ``nbytes`` is made from; one line naming the fix
    when it needs a GPU this process lacks (no host memory is picked silently)."""
    try:
        return get_current_device_resource()
    except CUDAUnavailableError as e:
        raise NoMemoryForDeviceBufferError(
            e.error_name,
            e.call,
            f"cannot receive a DeviceBuffer ({format_bytes(nbytes)}): this process has no usable "
            "GPU for its default resource. To receive DeviceBuffers in host memory, call "
            'dask_rmm.reinitialize(base_resource="system") in it first (on a client: before '
            "gathering the result).",
        ) from None


class _OneLineForNoMemory(logging.Filter):
    """distributed logs every deserialization error at CRITICAL with its traceback, then raises
    it: for :class:`NoMemoryForDeviceBufferError` the error's own line says it all."""

    def filter(self, record: logging.LogRecord) -> bool:
        error = record.exc_info[1] if record.exc_info else None
        if isinstance(error, NoMemoryForDeviceBufferError):
            record.msg, record.args = "Failed to deserialize: %s", (error,)
            record.exc_info = record.exc_text = None
        return True


_one_line = _OneLineForNoMemory()
logging.getLogger("distributed.protocol.core").addFilter(_one_line)


def _check_size(header: dict, nbytes: int) -> None:
    if header.get("size", nbytes) != nbytes:
        raise ValueError(
            f"DeviceBuffer frames hold {nbytes} bytes, but the header says {header['size']}"
        )


@cuda_serialize.register(DeviceBuffer)
def cuda_serialize_device_buffer(buf: DeviceBuffer) -> tuple[dict, list]:
    """Device frames: the buffer itself, for comms that move device memory (UCX).

    The header carries the size and the CUDA array interface's shape and type, as RMM's
    serializer does, so a receiver can allocate a matching frame.
    """
    header = {
        "size": buf.size,
        "shape": (buf.size,),
        "typestr": "|u1",
        "strides": (1,),
    }
    return header, [buf]


@cuda_deserialize.register(DeviceBuffer)
def cuda_deserialize_device_buffer(header: dict, frames: list) -> DeviceBuffer:
    """A DeviceBuffer from one device frame.

    A frame that already is a DeviceBuffer is returned as is. Any other device frame (what a
    comm allocated to receive into, e.g. an ``rmm.DeviceBuffer`` or a Numba array) is copied
    into a new buffer from the current device resource; a host frame is copied to the device.
    """
    (frame,) = frames
    if isinstance(frame, DeviceBuffer):
        _check_size(header, frame.size)
        return frame
    if hasattr(frame, "__cuda_array_interface__"):
        cai = frame.__cuda_array_interface__
        nbytes = header.get("size", math.prod(cai["shape"]) * int(cai["typestr"][2:]))
        buf = DeviceBuffer(size=nbytes, mr=_receiving_resource(nbytes))
        buf.copy_from_device(frame)
        return buf
    buf = to_device(frame, mr=_receiving_resource(header.get("size", 0)))
    _check_size(header, buf.size)
    return buf


@dask_serialize.register(DeviceBuffer)
def dask_serialize_device_buffer(buf: DeviceBuffer) -> tuple[dict, list]:
    """Host frames: one frame with a host copy of the buffer's bytes (for TCP and spilling)."""
    return {"size": buf.size}, [memoryview(buf.copy_to_host())]


@dask_deserialize.register(DeviceBuffer)
def dask_deserialize_device_buffer(header: dict, frames: list[Any]) -> DeviceBuffer:
    """A DeviceBuffer from the current device resource holding the host frames' bytes."""
    if len(frames) == 1:
        frame = frames[0]
    else:  # pragma: no cover - distributed merges split frames before calling us
        frame = b"".join(memoryview(f).cast("B") for f in frames)
    buf = to_device(frame, mr=_receiving_resource(header.get("size", 0)))
    _check_size(header, buf.size)
    return buf
