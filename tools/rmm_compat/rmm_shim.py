"""Make ``import rmm`` (and its submodules) resolve to dask-rmm's modules, for running RMM's
own Python tests against dask-rmm.

Loaded as a pytest plugin (``-p rmm_shim`` with this directory on ``sys.path``), it puts an
import finder first on ``sys.meta_path``, so a compiled ``rmm`` installed on the same host is
shadowed. The table below only renames: every name an RMM test reaches is dask-rmm's own
object. A module RMM has and dask-rmm does not raises ``ModuleNotFoundError`` naming both.
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.machinery
import sys
import types

#: RMM module -> dask-rmm module it is served by. ``None`` makes a namespace-like package
#: (``rmm.pylibrmm``) whose children are listed here too.
MODULES: dict[str, str | None] = {
    "rmm.mr": "dask_rmm.mr",
    "rmm.mr.experimental": "dask_rmm.mr.experimental",
    "rmm.statistics": "dask_rmm.statistics",
    "rmm.allocators": "dask_rmm.allocators",
    "rmm.allocators.cupy": "dask_rmm.allocators.cupy",
    "rmm.allocators.numba": "dask_rmm.allocators.numba",
    "rmm.allocators.torch": "dask_rmm.allocators.torch",
    "rmm.pylibrmm": None,
    "rmm.pylibrmm.stream": "dask_rmm.stream",
    "rmm.pylibrmm.cuda_stream_pool": "dask_rmm.stream",
    "rmm.pylibrmm.device_buffer": "dask_rmm.device_buffer",
    "rmm.pylibrmm.logger": "dask_rmm.logger",
    "rmm.pylibrmm.memory_resource": "dask_rmm.mr",
    "rmm.pylibrmm.memory_resource._memory_resource": "dask_rmm.mr.registry",
    "rmm.pylibrmm.memory_resource.experimental": "dask_rmm.mr.experimental",
    "rmm._cuda": None,
    "rmm._cuda.gpu": None,
    "rmm.rmm": "dask_rmm.initialize",
}

#: Names of the top-level ``rmm`` package -> dask-rmm module holding each (same name).
TOP_LEVEL = {
    "__version__": "dask_rmm",
    "__git_commit__": "dask_rmm",
    "DeviceBuffer": "dask_rmm.device_buffer",
    "RMMError": "dask_rmm.initialize",
    "disable_logging": "dask_rmm.initialize",
    "enable_logging": "dask_rmm.initialize",
    "get_log_filenames": "dask_rmm.initialize",
    "is_initialized": "dask_rmm.initialize",
    "register_reinitialize_hook": "dask_rmm.initialize",
    "reinitialize": "dask_rmm.initialize",
    "unregister_reinitialize_hook": "dask_rmm.initialize",
    "flush_logger": "dask_rmm.logger",
    "get_flush_level": "dask_rmm.logger",
    "get_logging_level": "dask_rmm.logger",
    "level_enum": "dask_rmm.logger",
    "set_flush_level": "dask_rmm.logger",
    "set_logging_level": "dask_rmm.logger",
    "should_log": "dask_rmm.logger",
}


#: Synthetic RMM modules whose functions dask-rmm has under other names: name -> (module, name).
RENAMED: dict[str, dict[str, tuple[str, str]]] = {
    "rmm._cuda.gpu": {
        "getDevice": ("dask_rmm._cuda", "get_device"),
        "setDevice": ("dask_rmm._cuda", "set_device"),
        "getDeviceCount": ("dask_rmm._cuda", "get_device_count"),
        "getDeviceAttribute": ("dask_rmm._cuda", "get_device_attribute"),
        "runtimeGetVersion": ("dask_rmm._cuda", "runtime_get_version"),
        "driverGetVersion": ("dask_rmm._cuda", "driver_get_version"),
    },
}


def _package(name: str) -> types.ModuleType:
    mod = types.ModuleType(name, f"dask-rmm standing in for {name}")
    mod.__path__ = []  # a package: submodules are found through the finder
    for attr, (source, source_attr) in RENAMED.get(name, {}).items():
        setattr(mod, attr, getattr(importlib.import_module(source), source_attr))
    return mod


def _top_level() -> types.ModuleType:
    mod = _package("rmm")
    for attr, source in TOP_LEVEL.items():
        setattr(mod, attr, getattr(importlib.import_module(source), attr))
    return mod


class _Loader(importlib.abc.Loader):
    def __init__(self, target: str | None):
        self.target = target

    def create_module(self, spec):
        if spec.name == "rmm":
            return _top_level()
        if self.target is None:
            return _package(spec.name)
        module = importlib.import_module(self.target)
        self.original_spec = module.__spec__
        return module

    def exec_module(self, module):
        # importlib set the module's __spec__ to the rmm one; dask-rmm's module keeps its own.
        original = getattr(self, "original_spec", None)
        if original is not None:
            module.__spec__ = original


class RMMShimFinder(importlib.abc.MetaPathFinder):
    """Serves ``rmm`` and ``rmm.*`` from dask-rmm; never lets the real package load."""

    def find_spec(self, fullname, path=None, target=None):
        if fullname != "rmm" and not fullname.startswith("rmm."):
            return None
        if fullname == "rmm":
            return importlib.machinery.ModuleSpec(fullname, _Loader(None), is_package=True)
        if fullname not in MODULES:
            raise ModuleNotFoundError(
                f"{fullname} has no dask-rmm counterpart in tools/rmm_compat/rmm_shim.py",
                name=fullname,
            )
        return importlib.machinery.ModuleSpec(fullname, _Loader(MODULES[fullname]), is_package=True)


def install() -> None:
    """Put the finder first and forget any ``rmm`` imported before."""
    if not any(isinstance(f, RMMShimFinder) for f in sys.meta_path):
        sys.meta_path.insert(0, RMMShimFinder())
    for name in [n for n in sys.modules if n == "rmm" or n.startswith("rmm.")]:
        del sys.modules[name]


install()
# RMM's packages import these at their own import; tests reach them as attributes
# (``rmm.pylibrmm.stream.Stream()`` without importing ``rmm.pylibrmm.stream``).
for _name in (
    "rmm.mr",
    "rmm.statistics",
    "rmm._cuda.gpu",
    *(n for n in MODULES if n.startswith("rmm.pylibrmm.") and n.count(".") == 2),
):
    importlib.import_module(_name)
