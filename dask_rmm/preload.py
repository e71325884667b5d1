"""Worker CLI flags: ``dask worker SCHED --preload dask_rmm.preload --rmm-pool-size 4GiB ...``.

The flags carry dask-cuda's names and become an :class:`~dask_rmm.plugin.RMMPlugin` set up when
the worker starts (a failing setup stops the worker with the reason). Flags not given fall back
to the worker's ``dask-rmm.*`` config. What the options mean is documented on RMMPlugin.
Run ``python -m dask_rmm.preload --help`` to list the flags.
"""

from __future__ import annotations

import re
import sys
from typing import Any

import click

__all__ = ["dask_setup", "plugin_from_flags"]


class _SizeType(click.ParamType):
    """A memory size: bytes, a size string such as ``4GiB``, or a fraction of device memory."""

    name = "size"

    def convert(self, value: Any, param: Any, ctx: Any) -> Any:
        from dask_rmm.plugin import _check_size

        try:
            _check_size("size", value)
        except (TypeError, ValueError) as e:
            reason = str(e).removeprefix("`size`: ")
            self.fail(f"{reason} (give bytes, a size such as 4GiB or a fraction such as 0.8)")
        return value


class _LibrariesType(click.ParamType):
    """A comma-separated list of libraries to point at the worker's resource."""

    name = "libs"

    def convert(self, value: Any, param: Any, ctx: Any) -> Any:
        from dask_rmm.plugin import _check_allocators

        try:
            return list(_check_allocators(value))
        except ValueError as e:
            self.fail(str(e), param, ctx)


SIZE = _SizeType()


class _PreloadCommand(click.Command):
    """Checks the flags together right after parsing, so that incompatible flags are a usage
    error of ``dask worker`` itself (distributed parses preload flags before starting)."""

    def parse_args(self, ctx: click.Context, args: list[str]) -> list[str]:
        rest = super().parse_args(ctx, args)
        plugin_from_flags(**ctx.params)
        return rest


@click.command(name="dask_rmm.preload", cls=_PreloadCommand)
@click.option(
    "--rmm-pool-size",
    type=SIZE,
    default=None,
    help="Initial pool size: bytes, '4GiB' or a fraction of device memory ('0.8'). "
    "No pool when not given.",
)
@click.option(
    "--rmm-maximum-pool-size",
    type=SIZE,
    default=None,
    help="The pool never grows beyond this (needs --rmm-pool-size or --rmm-async).",
)
@click.option(
    "--rmm-managed-memory/--no-rmm-managed-memory",
    default=None,
    help="Allocate CUDA managed (unified) memory.",
)
@click.option(
    "--rmm-async/--no-rmm-async",
    default=None,
    help="Use cudaMallocAsync (CudaAsyncMemoryResource) instead of a pool.",
)
@click.option(
    "--rmm-release-threshold",
    type=SIZE,
    default=None,
    help="Bytes the async pool keeps when idle (needs --rmm-async).",
)
@click.option(
    "--rmm-log-directory",
    type=click.Path(file_okay=False),
    default=None,
    help="Write one CSV allocation log per worker and device into this directory.",
)
@click.option(
    "--rmm-track-allocations/--no-rmm-track-allocations",
    default=None,
    help="Track outstanding allocations (TrackingResourceAdaptor).",
)
@click.option(
    "--set-rmm-allocator-for-libs",
    type=_LibrariesType(),
    default=None,
    help="Point these libraries at the worker's resource: 'cupy', 'numba' or 'cupy,numba'.",
)
@click.option(
    "--rmm-base-resource",
    type=click.Choice(["cuda", "system"], case_sensitive=False),
    default=None,
    help="'cuda' (device memory) or 'system' (host memory, for hosts without a GPU).",
)
@click.option(
    "--rmm-statistics/--no-rmm-statistics",
    default=None,
    help="Count allocations per worker and task prefix for the heartbeat metrics (on by default).",
)
def dask_setup(worker: Any, **flags: Any):
    """Set the worker's memory resources up from the ``--rmm-*`` flags.

    distributed calls this with the worker when it starts (``--preload dask_rmm.preload``).
    """
    plugin = plugin_from_flags(**flags)
    pending = getattr(worker, "_pending_plugins", None)
    if isinstance(pending, tuple):
        # distributed logs and ignores errors raised by preloads, which would leave a worker
        # running without its memory setup. Plugins passed to the worker are set up right after
        # the preloads, and their errors stop the worker: join them.
        worker._pending_plugins = (*pending, plugin)
        return None
    return worker.plugin_add(plugin, catch_errors=False)


_FLAG_TO_OPTION = {
    "rmm_pool_size": "pool_size",
    "rmm_maximum_pool_size": "maximum_pool_size",
    "rmm_managed_memory": "managed_memory",
    "rmm_async": "async_alloc",
    "rmm_release_threshold": "release_threshold",
    "rmm_log_directory": "log_directory",
    "rmm_track_allocations": "track_allocations",
    "set_rmm_allocator_for_libs": "allocators",
    "rmm_base_resource": "base_resource",
    "rmm_statistics": "statistics",
}


def plugin_from_flags(**flags: Any):
    """An RMMPlugin from parsed flags (``rmm_pool_size="4GiB"``...); unset flags use config.

    Examples
    --------
    >>> plugin_from_flags(rmm_pool_size="1GiB", rmm_base_resource="system").pool_size
    1073741824
    """
    from dask_rmm.plugin import RMMPlugin

    unknown = set(flags) - set(_FLAG_TO_OPTION)
    if unknown:
        raise TypeError(f"unknown flags: {sorted(unknown)}")
    options = {_FLAG_TO_OPTION[k]: v for k, v in flags.items() if v is not None}
    try:
        return RMMPlugin(**options)
    except (TypeError, ValueError) as e:
        # Incompatible flags: a usage error naming the flags, not a traceback.
        flags_by_option = {o: "--" + f.replace("_", "-") for f, o in _FLAG_TO_OPTION.items()}

        def as_flag(match: re.Match) -> str:
            flag = flags_by_option.get(match.group(1))
            return match.group(0) if flag is None else flag

        message = re.sub(r"`(\w+)(?:=True)?`", as_flag, str(e))
        raise click.UsageError(message) from e


def _main(argv: list[str] | None = None) -> None:
    """``python -m dask_rmm.preload [--help] [FLAGS]``: list the flags, or check flags and
    print the RMMPlugin they make (without starting anything)."""
    prog = "dask worker SCHEDULER --preload dask_rmm.preload"
    try:
        with dask_setup.make_context(prog, list(sys.argv[1:] if argv is None else argv)) as ctx:
            click.echo(repr(plugin_from_flags(**ctx.params)))
    except click.exceptions.Exit as e:
        raise SystemExit(e.exit_code) from None
    except click.ClickException as e:
        e.show()
        raise SystemExit(e.exit_code) from None


if __name__ == "__main__":
    _main()
