"""The one module that imports ``cuda.bindings`` (on first use): checked CUDA runtime calls
taking and returning ints or raising :class:`CUDAError` (:class:`CUDAUnavailableError` without a
usable GPU). Not here: memory-resource policy (``dask_rmm.mr``).
"""

from __future__ import annotations

import contextlib
import functools
import inspect
import re
from collections.abc import Callable, Iterator
from typing import Any, NamedTuple

#: ``cudaCpuDeviceId``: pass as ``device`` to :func:`mem_prefetch_async` to move pages to the host.
CPU_DEVICE_ID = -1

# Values fixed by the CUDA runtime API (and so usable before cuda-python is imported).
_MEMCPY_DEFAULT = 4  # cudaMemcpyDefault: direction inferred from the pointers (UVA)
_STREAM_NON_BLOCKING = 1  # cudaStreamNonBlocking
_EVENT_DISABLE_TIMING = 2  # cudaEventDisableTiming
_MEM_ATTACH_GLOBAL = 1  # cudaMemAttachGlobal


class CUDAError(RuntimeError):
    """A CUDA runtime call failed: ``call`` (the function or operation) with ``error_name``,
    CUDA's name for the error (``"cudaErrorMemoryAllocation"``)."""

    def __init__(self, error_name: str, call: str, message: str | None = None):
        self.error_name = error_name
        self.call = call
        super().__init__(message or f"{call} failed: {error_name}")

    def __reduce__(self):
        return (type(self), (self.error_name, self.call, self.args[0]))


class CUDAUnavailableError(CUDAError):
    """CUDA was asked for on a host with no usable driver or device."""


@functools.cache
def _rt():
    try:
        from cuda.bindings import runtime
    except ImportError as e:  # pragma: no cover - cuda-python is a dependency
        raise CUDAUnavailableError(
            "ImportError", "import cuda.bindings", f"cuda-python is not importable: {e}"
        ) from e
    return runtime


def fail(err, call: str):
    """Raise for the nonzero error code ``err`` of runtime (or driver) function ``call``:
    :class:`CUDAUnavailableError` without a usable GPU, else :class:`CUDAError`. Clears the
    last-error slot first, as RMM does (a handled failure must not surface in another library)."""
    if not is_available():
        require_cuda(call)
    with contextlib.suppress(Exception):  # clearing is best effort
        _rt().cudaGetLastError()
    raise CUDAError(getattr(err, "name", str(err)), call)  # cuda-python's error enums are named


def check(result, call: str):
    """cuda-python's ``(err, *values)`` as None, the single value or a tuple of the values;
    raises as :func:`fail` does when ``err`` is not ``cudaSuccess``."""
    if result[0]:  # cudaError_t is an int enum; cudaSuccess is 0
        fail(result[0], call)
    return result[1] if len(result) == 2 else result[1:] or None


@functools.cache
def _probe() -> str:
    """Why CUDA is not usable on this host, or "" (probed once)."""
    try:
        err, count = _rt().cudaGetDeviceCount()
    except CUDAUnavailableError as e:
        return str(e)
    if err:
        return err.name
    return "" if count >= 1 else "no CUDA device found"


def is_available() -> bool:
    """True when a CUDA driver and at least one device are usable (probed once)."""
    return not _probe()


def require_cuda(what: str) -> None:
    """Raise one clear CUDAUnavailableError when CUDA is not usable on this host."""
    if not is_available():
        raise CUDAUnavailableError(
            "cudaErrorNoDevice",
            what,
            f"{what} needs a CUDA device, but none is usable on this host ({_probe()}). "
            "Use host memory explicitly: SystemMemoryResource(), reinitialize(base_resource='system') "
            "or config 'dask-rmm.base-resource: system'.",
        )


def runtime_function(name: str):
    """The cuda-python runtime function ``name`` itself, for a memory resource's hot path: one
    call, no wrapper frame. It returns ``(err, *values)``; pass :data:`stream_objects` /
    :data:`mem_pool_objects` entries as handles, and raise with :func:`fail`."""
    return getattr(_rt(), name)


class HandleObjects(dict):
    """``int handle -> cuda-python handle object`` (``cudaStream_t``...), made on first lookup
    and kept (up to 4096): cuda-python converts an int argument at every call, about as costly
    as the call (bench/README.md, "Design measurements")."""

    __slots__ = ("type_name",)

    def __init__(self, type_name: str):
        super().__init__()
        self.type_name = type_name

    def __missing__(self, handle):
        obj = getattr(_rt(), self.type_name)(handle)
        if type(handle) is int:
            if len(self) >= 4096:
                self.clear()
            self[handle] = obj
        return obj


#: Stream handle -> ``cudaStream_t`` (see :class:`HandleObjects`).
stream_objects = HandleObjects("cudaStream_t")
#: Memory pool handle -> ``cudaMemPool_t`` (see :class:`HandleObjects`).
mem_pool_objects = HandleObjects("cudaMemPool_t")


def _checked(call: str, params: str, doc: str, *fixed: int) -> Callable[..., Any]:
    """The function of ``params`` (positional) returning :func:`check` of runtime ``call`` of
    them and the ``fixed`` arguments; its docstring is ``call``'s name and ``doc``."""

    def function(*args: Any) -> Any:
        return check(getattr(_rt(), call)(*args, *fixed), call)

    kind = inspect.Parameter.POSITIONAL_ONLY
    function.__signature__ = inspect.Signature(  # type: ignore[attr-defined]
        [inspect.Parameter(name, kind) for name in params.split()]
    )
    function.__doc__ = f"``{call}``: {doc}"
    # Named as the module names it (cudaMemPoolTrimTo: mem_pool_trim_to), for pickle and tracebacks.
    function.__name__ = function.__qualname__ = re.sub("(?<!^)([A-Z])", r"_\1", call[4:]).lower()
    return function


# --- calls that take and return what the runtime does -------------------------------------------

get_device = _checked("cudaGetDevice", "", "the calling thread's current CUDA device.")
runtime_get_version = _checked("cudaRuntimeGetVersion", "", "``1000 * major + 10 * minor``.")
driver_get_version = _checked("cudaDriverGetVersion", "", "the newest CUDA it supports.")
device_synchronize = _checked("cudaDeviceSynchronize", "", "wait for the current device.")
malloc = _checked("cudaMalloc", "nbytes", "device memory on the current device.")
free = _checked("cudaFree", "ptr", "free device memory (synchronizes the device).")
free_host = _checked("cudaFreeHost", "ptr", "free :func:`malloc_host`'s memory.")
mem_pool_destroy = _checked("cudaMemPoolDestroy", "pool", "allocations keep their memory.")
mem_pool_trim_to = _checked("cudaMemPoolTrimTo", "pool min_bytes_to_keep", "release unused.")
malloc_managed = _checked("cudaMallocManaged", "nbytes", "unified memory.", _MEM_ATTACH_GLOBAL)
memcpy = _checked("cudaMemcpy", "dst src nbytes", "direction from the pointers.", _MEMCPY_DEFAULT)
memset = _checked("cudaMemset", "ptr value nbytes", "set ``nbytes`` bytes at ``ptr`` to ``value``.")
memset_async = _checked("cudaMemsetAsync", "ptr value nbytes stream_handle", "in stream order.")
stream_destroy = _checked("cudaStreamDestroy", "handle", "destroy a stream.")
stream_wait_event = _checked("cudaStreamWaitEvent", "stream_handle event", "later work waits.", 0)
event_record = _checked("cudaEventRecord", "event stream_handle", "in stream order.")
event_destroy = _checked("cudaEventDestroy", "event", "destroy an event.")

# --- devices -----------------------------------------------------------------------------------


def get_device_count() -> int:
    """Number of CUDA devices (0 on a host without a driver or GPU)."""
    if not is_available():
        return 0
    return check(_rt().cudaGetDeviceCount(), "cudaGetDeviceCount")


def current_device() -> int:
    """:func:`get_device`, or 0 (where host memory is) on a host without CUDA."""
    return get_device() if is_available() else 0


def check_device(device: Any, host_memory: bool = False) -> int:
    """``device`` if this host has it; with ``host_memory``, device 0 also without CUDA (where
    host memory is)."""
    if isinstance(device, bool) or not isinstance(device, int):
        raise TypeError(
            f"device must be an int device id, got {device!r} ({type(device).__name__})"
        )
    if not host_memory:
        require_cuda(f"device {device}")
    count = get_device_count()
    if not 0 <= device < max(count, 1):
        where = (
            f"{count} CUDA device(s)"
            if count
            else "no CUDA device (only device 0, for host memory)"
        )
        raise ValueError(f"device {device} does not exist: this host has {where}")
    return device


def set_device(device: int) -> None:
    """Make ``device`` the calling thread's current device (``cudaSetDevice``)."""
    (err,) = _rt().cudaSetDevice(device)
    if err:
        check_device(device)
        fail(err, f"cudaSetDevice({device})")


def mem_get_info() -> tuple[int, int]:
    """``(free, total)`` bytes of the current device (``cudaMemGetInfo``)."""
    free_bytes, total = check(_rt().cudaMemGetInfo(), "cudaMemGetInfo")
    return int(free_bytes), int(total)


def device_total_memory(device: int | None = None) -> int:
    """Total memory of ``device`` (default: the current device) in bytes."""
    with on_device(current_device() if device is None else check_device(device)):
        return mem_get_info()[1]


@contextlib.contextmanager
def on_device(device: int) -> Iterator[None]:
    """Make ``device`` the calling thread's current device for the block (no-op without CUDA)."""
    current = get_device() if is_available() else device
    if current != device:
        set_device(device)
    try:
        yield
    finally:
        if current != device:
            set_device(current)


def device_identity(device: int) -> tuple[str, str, str]:
    """``(name, uuid, pci_bus_id)`` of ``device``: its marketing name, ``GPU-xxxxxxxx-...`` as
    nvidia-smi prints it, and ``DDDDDDDD:BB:DD.0``. Names the physical GPU whatever the index
    (under CUDA_VISIBLE_DEVICES every worker's device is 0)."""
    props = check(_rt().cudaGetDeviceProperties(check_device(device)), "cudaGetDeviceProperties")
    name = props.name
    name = name.split(b"\0", 1)[0].decode() if isinstance(name, bytes) else str(name)
    u = bytes(props.uuid.bytes).hex()
    uuid = f"GPU-{u[:8]}-{u[8:12]}-{u[12:16]}-{u[16:20]}-{u[20:32]}"
    pci = f"{props.pciDomainID:08X}:{props.pciBusID:02X}:{props.pciDeviceID:02X}.0"
    return name, uuid, pci


@functools.cache
def nvml() -> Any:
    """cuda-python's NVML, initialised once; None where it cannot be (tried once)."""
    try:
        from cuda.bindings import nvml

        nvml.init_v2()
    except Exception:
        return None
    return nvml


def _member(enum: str, name: str):
    """cuda-python's ``enum`` member ``name`` (``"PageableMemoryAccess"`` for
    ``cudaDeviceAttr.cudaDevAttrPageableMemoryAccess``)."""
    prefix = {"cudaDeviceAttr": "cudaDevAttr"}.get(enum, enum)
    member = getattr(getattr(_rt(), enum), prefix + name, None)
    if member is None:
        raise ValueError(f"unknown {enum} {name!r}: see cuda-python's {enum} for the names")
    return member


def get_device_attribute(attr: Any, device: int | None = None) -> int:
    """Attribute ``attr`` of ``device`` (default: the current one): a ``cudaDeviceAttr`` member,
    as RMM's ``getDeviceAttribute`` takes it, or its name without ``cudaDevAttr``
    (``"PageableMemoryAccess"``)."""
    if isinstance(attr, str):
        attr = _member("cudaDeviceAttr", attr)
    require_cuda("cudaDeviceGetAttribute")
    device = get_device() if device is None else check_device(device)
    return int(check(_rt().cudaDeviceGetAttribute(attr, device), "cudaDeviceGetAttribute"))


# --- allocation --------------------------------------------------------------------------------


def malloc_host(nbytes: int, flags: int = 0) -> int:
    """``cudaHostAlloc``: page-locked host memory; free with :func:`free_host`."""
    return check(_rt().cudaHostAlloc(nbytes, flags), "cudaHostAlloc")


def malloc_from_pool_async(nbytes: int, pool: int, stream_handle: int) -> int:
    """``cudaMallocFromPoolAsync`` from an explicit memory pool."""
    result = _rt().cudaMallocFromPoolAsync(
        nbytes, mem_pool_objects[pool], stream_objects[stream_handle]
    )
    return check(result, "cudaMallocFromPoolAsync")


def free_async(ptr: int, stream_handle: int) -> None:
    """``cudaFreeAsync``: return ``ptr`` to its pool in stream order."""
    check(_rt().cudaFreeAsync(ptr, stream_objects[stream_handle]), "cudaFreeAsync")


# --- memory pools (stream-ordered allocator) ---------------------------------------------------


def mem_pool_create(
    device: int | None = None,
    *,
    release_threshold: int | None = None,
    handle_types: int = 0,
    max_size: int = 0,
) -> int:
    """``cudaMemPoolCreate`` of a pinned pool on ``device`` (default the current one); its handle.
    ``release_threshold`` None keeps CUDA's (0), ``handle_types`` is a
    ``cudaMemAllocationHandleType`` (1: POSIX file descriptor, 8: fabric), ``max_size`` 0: CUDA's."""
    rt = _rt()
    require_cuda("cudaMemPoolCreate")
    device = get_device() if device is None else check_device(device)
    props = rt.cudaMemPoolProps()
    props.allocType = rt.cudaMemAllocationType.cudaMemAllocationTypePinned
    props.handleTypes = rt.cudaMemAllocationHandleType(handle_types)
    props.location.type = rt.cudaMemLocationType.cudaMemLocationTypeDevice
    props.location.id = device
    props.maxSize = max_size
    pool = int(check(rt.cudaMemPoolCreate(props), "cudaMemPoolCreate"))
    if release_threshold is not None:
        try:
            mem_pool_set_release_threshold(pool, release_threshold)
        except BaseException:
            rt.cudaMemPoolDestroy(pool)
            raise
    return pool


def device_get_default_managed_mem_pool(device: int | None = None) -> int:
    """The handle of ``device``'s default *managed* memory pool (``cudaMemGetDefaultMemPool``
    with ``cudaMemAllocationTypeManaged``; CUDA 13 and a device with concurrent managed access).
    """
    rt = _rt()
    require_cuda("cudaMemGetDefaultMemPool")
    loc = _location(get_device() if device is None else check_device(device))
    managed = rt.cudaMemAllocationType.cudaMemAllocationTypeManaged
    return int(check(rt.cudaMemGetDefaultMemPool(loc, managed), "cudaMemGetDefaultMemPool"))


def device_get_default_mem_pool(device: int | None = None) -> int:
    """The handle of ``device``'s default memory pool (what ``cudaMallocAsync`` uses)."""
    require_cuda("cudaDeviceGetDefaultMemPool")
    device = get_device() if device is None else check_device(device)
    return int(check(_rt().cudaDeviceGetDefaultMemPool(device), "cudaDeviceGetDefaultMemPool"))


def mem_pool_set_release_threshold(pool: int, nbytes: int) -> None:
    """Set ``cudaMemPoolAttrReleaseThreshold``."""
    from cuda.bindings import driver

    attr = _member("cudaMemPoolAttr", "ReleaseThreshold")
    result = _rt().cudaMemPoolSetAttribute(pool, attr, driver.cuuint64_t(nbytes))
    check(result, "cudaMemPoolSetAttribute(ReleaseThreshold)")


def mem_pool_get_attribute(pool: int, name: str) -> int:
    """A 64-bit pool attribute by short name: ``"ReleaseThreshold"``, ``"ReservedMemCurrent"``,
    ``"ReservedMemHigh"``, ``"UsedMemCurrent"`` or ``"UsedMemHigh"``."""
    result = _rt().cudaMemPoolGetAttribute(pool, _member("cudaMemPoolAttr", name))
    return int(check(result, f"cudaMemPoolGetAttribute({name})"))


def mem_pool_export_to_shareable_handle(pool: int, handle_type: int = 1) -> int:
    """Export an IPC-capable pool; for a POSIX file descriptor (1) the result is one."""
    rt = _rt()
    result = rt.cudaMemPoolExportToShareableHandle(
        pool, rt.cudaMemAllocationHandleType(handle_type), 0
    )
    return int(check(result, "cudaMemPoolExportToShareableHandle"))


# --- copies ------------------------------------------------------------------------------------


def memcpy_async(dst: int, src: int, nbytes: int, stream_handle: int) -> None:
    """``cudaMemcpyAsync`` with ``cudaMemcpyDefault`` on ``stream_handle``."""
    result = _rt().cudaMemcpyAsync(dst, src, nbytes, _MEMCPY_DEFAULT, stream_objects[stream_handle])
    check(result, "cudaMemcpyAsync")


def _location(device: int):
    types, loc = _rt().cudaMemLocationType, _rt().cudaMemLocation()
    host = device == CPU_DEVICE_ID
    loc.type = types.cudaMemLocationTypeHost if host else types.cudaMemLocationTypeDevice
    loc.id = 0 if host else device
    return loc


def mem_prefetch_async(ptr: int, nbytes: int, device: int, stream_handle: int) -> None:
    """Prefetch managed (or system-allocated) memory to ``device``; ``CPU_DEVICE_ID`` means host."""
    result = _rt().cudaMemPrefetchAsync(ptr, nbytes, _location(device), 0, stream_handle)
    check(result, "cudaMemPrefetchAsync")


def mem_advise_preferred_location(ptr: int, nbytes: int, device: int) -> None:
    """``cudaMemAdvise(cudaMemAdviseSetPreferredLocation)``; ``CPU_DEVICE_ID`` means host."""
    rt = _rt()
    advice = rt.cudaMemoryAdvise.cudaMemAdviseSetPreferredLocation
    check(
        rt.cudaMemAdvise(ptr, nbytes, advice, _location(device)),
        "cudaMemAdvise(SetPreferredLocation)",
    )


class PointerAttributes(NamedTuple):
    """What CUDA knows about a pointer. ``type`` is ``"unregistered"`` (plain host memory),
    ``"host"`` (pinned), ``"device"`` or ``"managed"``."""

    type: str
    device: int
    device_pointer: int
    host_pointer: int


def pointer_attributes(ptr: int) -> PointerAttributes:
    """``cudaPointerGetAttributes``: tell host, pinned, device and managed pointers apart."""
    attrs = check(_rt().cudaPointerGetAttributes(ptr), "cudaPointerGetAttributes")
    return PointerAttributes(
        attrs.type.name.removeprefix("cudaMemoryType").lower(),  # cudaMemoryTypeHost: "host"
        int(attrs.device),
        int(attrs.devicePointer or 0),
        int(attrs.hostPointer or 0),
    )


# --- streams and events ------------------------------------------------------------------------


def stream_create(flags: int = _STREAM_NON_BLOCKING) -> int:
    """Create a stream (``cudaStreamCreateWithFlags``) and return its handle; ``flags`` 0
    (``cudaStreamDefault``) makes one that synchronizes with the legacy default stream."""
    return int(check(_rt().cudaStreamCreateWithFlags(flags), "cudaStreamCreateWithFlags"))


def stream_synchronize(handle: int) -> None:
    """Wait for all work queued on the stream."""
    check(_rt().cudaStreamSynchronize(stream_objects[handle]), "cudaStreamSynchronize")


def event_create(disable_timing: bool = True) -> int:
    """Create an event (``cudaEventCreateWithFlags``) and return its handle."""
    flags = _EVENT_DISABLE_TIMING if disable_timing else 0
    return int(check(_rt().cudaEventCreateWithFlags(flags), "cudaEventCreateWithFlags"))


def stream_wait_stream(stream_handle: int, other_handle: int) -> None:
    """Make future work on ``stream_handle`` wait for the work queued so far on
    ``other_handle`` (an event recorded there, waited on, destroyed)."""
    event = event_create(disable_timing=True)
    try:
        event_record(event, other_handle)
        stream_wait_event(stream_handle, event)
    finally:
        event_destroy(event)


# --- IPC (used by the Numba EMM plugin's get_ipc_handle) ----------------------------------------


def mem_get_address_range(ptr: int) -> tuple[int, int]:
    """``(base, size)`` of the whole allocation holding device pointer ``ptr``
    (``cuMemGetAddressRange``; a pool block lies inside one upstream allocation)."""
    require_cuda("cuMemGetAddressRange")
    from cuda.bindings import driver

    base, size = check(driver.cuMemGetAddressRange(ptr), f"cuMemGetAddressRange({ptr:#x})")
    return int(base), int(size)


def ipc_get_mem_handle(ptr: int) -> bytes:
    """The 64-byte CUDA IPC handle of the allocation starting at ``ptr`` (``cudaIpcGetMemHandle``;
    ``ptr`` must be the base of a ``cudaMalloc`` allocation, see :func:`mem_get_address_range`)."""
    handle = check(_rt().cudaIpcGetMemHandle(ptr), "cudaIpcGetMemHandle")
    return bytes(handle.reserved)
