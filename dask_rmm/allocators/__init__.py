"""Library allocators: point CuPy, Numba, PyTorch and the compiled RMM at dask-rmm's current
device resource (:func:`set_allocators`); the hooks live in the submodules. Importing this
package imports none of the libraries.
"""

from __future__ import annotations

import importlib
from collections.abc import Iterable
from typing import Any

__all__ = [
    "CACHED_ALLOCATORS",
    "SUPPORTED_ALLOCATORS",
    "check_allocators",
    "reset_allocators",
    "set_allocators",
]

#: Library name -> (its hook's module in dask_rmm.allocators, setter, resetter, what to install).
#: "rmm": RAPIDS libraries (cuDF, cuML, ...) allocate through the compiled RMM's resource.
_HOOKS = {
    "cupy": ("cupy", "set_cupy_allocator", "reset_cupy_allocator", "cupy-cuda13x"),
    "numba": ("numba", "set_numba_allocator", "reset_numba_allocator", "numba-cuda"),
    "rmm": ("rmm_interop", "set_rmm_callback_resource", "reset_rmm_callback_resource", "rmm-cu13"),
    "torch": ("torch", "set_torch_allocator", "reset_torch_allocator", "torch (a CUDA build)"),
}

#: Names accepted by :func:`set_allocators`.
SUPPORTED_ALLOCATORS: tuple[str, ...] = tuple(sorted(_HOOKS))
#: Libraries whose own compiled cache serves their allocations by default (``exact=`` routes
#: each allocation through the stack instead); Numba allocates every array through the stack.
CACHED_ALLOCATORS: tuple[str, ...] = ("cupy", "rmm", "torch")


def allocator_names(names: Any, option: str = "allocators") -> list[str]:
    """``names`` as known library names, each once (a string may be comma-separated, names are
    case insensitive); the errors name ``option``."""
    try:
        given: list[Any] = names.split(",") if isinstance(names, str) else list(names or ())
    except TypeError:
        given = [names]
    result: list[str] = []
    for name in given:
        if not isinstance(name, str):
            raise TypeError(
                f"`{option}` must be library names such as ['cupy', 'numba'] or 'cupy,numba', "
                f"got {names!r}"
            )
        key = name.strip().lower()
        if key and key not in _HOOKS:
            raise ValueError(
                f"unknown library {name!r} in `{option}`; supported: {', '.join(SUPPORTED_ALLOCATORS)}"
            )
        if key and key not in result:
            result.append(key)
    return result


def _hook(name: str, which: int):
    """The setter (``which == 0``) or resetter of library ``name``; ImportError when the
    library cannot be imported."""
    module_name, setter, resetter, requirement = _HOOKS[name]
    try:
        module = importlib.import_module(f"dask_rmm.allocators.{module_name}")
        # a hook module that imports its library lazily records why that failed
        error = getattr(module, "_library_import_error", None)
    except ImportError as e:
        error = e
    if error is not None:
        raise ImportError(
            f"the {name!r} allocator needs {name} installed, but importing it failed ({error}); "
            f"install {requirement} (pip install 'dask-rmm[{name}]') or drop {name!r} from "
            "the allocators"
        ) from error
    return getattr(module, setter if which == 0 else resetter)


def check_allocators(names: str | Iterable[str] | None) -> list[str]:
    """Raise what :func:`set_allocators` would raise for ``names`` (an unknown name, a library
    that is not installed) without changing any library; the normalized names otherwise."""
    selected = allocator_names(names)
    for name in selected:
        _hook(name, 0)
    return selected


def set_allocators(
    names: str | Iterable[str] | None, exact: str | Iterable[str] | bool | None = None
) -> list[str]:
    """Point each named library's device allocations at the current device resource.

    Parameters
    ----------
    names : str or iterable of str
        Library names from :data:`SUPPORTED_ALLOCATORS` (``"cupy"``, ``"numba"``, ``"rmm"``,
        ``"torch"``), case insensitive; a string may hold several separated by commas
        (``"cupy,numba"``).
    exact : str, iterable of str or bool, optional
        Libraries of :data:`CACHED_ALLOCATORS` whose every allocation should go through the
        resource (exact per-allocation statistics, attribution and logs; slower with several
        threads) instead of through their own compiled cache drawing blocks from it (the
        default). True: all of them.

    Returns the normalized names set (what :func:`reset_allocators` takes); ValueError for an
    unsupported name and ImportError for a missing library, before any library is touched.
    The hooks look the resource up at every allocation; Numba's and PyTorch's exact path must
    be set before their first CUDA call (see their modules). Setting twice is harmless.

    Examples
    --------
    >>> from dask_rmm.allocators import reset_allocators, set_allocators
    >>> libs = set_allocators(["cupy", "numba"])
    >>> reset_allocators(libs)
    """
    selected = allocator_names(names)
    exact_names = set(CACHED_ALLOCATORS) if exact is True else set(allocator_names(exact, "exact"))
    setters = [_hook(name, 0) for name in selected]  # import all before changing any
    for name, setter in zip(selected, setters, strict=True):
        if name in CACHED_ALLOCATORS:
            setter(cache=name not in exact_names)
        else:
            setter()
    return selected


def reset_allocators(names: str | Iterable[str] | None) -> None:
    """Give the named libraries (as for :func:`set_allocators`; those not installed are
    skipped) back the allocators they had before :func:`set_allocators`."""
    for name in allocator_names(names):
        try:
            resetter = _hook(name, 1)
        except ImportError:
            continue
        resetter()
