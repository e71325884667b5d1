"""The one options model of a worker's memory setup (:mod:`~dask_rmm.stack.options`) and the one
stack builder (:mod:`~dask_rmm.stack.build`): options and a device in, a resource stack out.
Used by ``reinitialize`` and by the worker plugin alike. Not here: installing stacks on a worker
(:mod:`dask_rmm.worker`); no Dask is imported (Dask's config only when asked for it).
"""

from dask_rmm.stack.build import DeviceStack, build_stack, make_base_resource
from dask_rmm.stack.options import BASE_RESOURCES, OptionError, RMMOptions

__all__ = [
    "BASE_RESOURCES",
    "DeviceStack",
    "OptionError",
    "RMMOptions",
    "build_stack",
    "make_base_resource",
]
