"""Worker CLI flags: ``dask worker SCHED --preload dask_rmm.preload --rmm-pool-size 4GiB ...``
become one :class:`~dask_rmm.plugin.RMMPlugin` set up when the worker starts (flags not given
fall back to the config); a failing setup stops the worker (:mod:`dask_rmm.worker.fatal`).
docs/workers.md describes the flags; docs/internals.md dask-cuda's and a recovered SCHEDULER.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import re
import sys
from typing import Any

import click

from dask_rmm.allocators import allocator_names
from dask_rmm.config import config_value, unknown_keys_unreported
from dask_rmm.plugin import RMMPlugin, RMMSetupError
from dask_rmm.sizes import parse_size
from dask_rmm.stack.options import BASE_RESOURCES
from dask_rmm.worker import dask_cuda, fatal
from dask_rmm.worker.stacks import worker_stack

__all__ = ["WorkerSetupFailed", "dask_setup", "plugin_from_flags"]

logger = logging.getLogger(__name__)

#: What ``dask worker`` recovered: ``{"received": [argv it handed the preload], "argv": [the
#: flags as typed]}``; set in the ``dask worker`` process, inherited by its worker processes.
_RECOVERED_ENV = "_DASK_RMM_PRELOAD_RECOVERED"


def _libraries(ctx: Any, param: click.Parameter, value: Any) -> Any:
    try:
        return value if value is None else allocator_names(value)
    except ValueError as e:
        raise click.BadParameter(str(e)) from None


#: How usage errors name this command.
PROG = "dask worker SCHEDULER --preload dask_rmm.preload"


class _PreloadCommand(click.Command):
    """Checks the flags together right after parsing (a usage error of ``dask worker`` itself),
    and recovers a flag that ``dask worker`` took as its scheduler address."""

    def get_help_option_names(self, ctx: click.Context) -> list[str]:
        # -h too: distributed makes the preload's context without our context_settings
        names = dict.fromkeys(["-h", "--help", *ctx.help_option_names])
        for param in self.params:
            for name in (*param.opts, *param.secondary_opts):
                names.pop(name, None)
        return list(names)

    def parse_args(self, ctx: click.Context, args: list[str]) -> list[str]:
        # parsed again at worker start: an error there distributed would log and go on
        at_worker_start = ctx.info_name == "dask_setup"
        # distributed checks the flags with a context that has no name ("Usage:  [OPTIONS]")
        ctx.info_name = ctx.info_name or PROG
        try:
            return self._parse(ctx, args)
        except click.UsageError as e:
            if not at_worker_start:
                raise
            # dask_setup stops the worker with this reason
            ctx.params = {"flags_error": f"dask-rmm's flags: {e.format_message()}"}
            return []

    def _parse(self, ctx: click.Context, args: list[str]) -> list[str]:
        # `dask worker` checks preload flags in its own command's callback, with a fresh context
        outer = click.get_current_context(silent=True)
        worker_params = {p.name for p in outer.command.params} if outer is not None else set()
        checking_for_dask_worker = (
            outer is not None and outer is not ctx and _WORKER_PARAMS <= worker_params
        )
        if checking_for_dask_worker and outer is not None:
            args = _check_scheduler_argument(self, outer, list(args))
            fatal.arm_worker_command()
        else:
            args = _recovered_argv(list(args))
        rest = super().parse_args(ctx, args)
        # an unknown config key is reported once, where the worker starts
        quiet = unknown_keys_unreported() if checking_for_dask_worker else contextlib.nullcontext()
        try:
            with quiet:
                plugin_from_flags(**ctx.params)
        except click.UsageError as e:
            e.ctx = ctx  # the usage shown is this command's
            raise
        return rest


def _check_scheduler_argument(
    command: click.Command, worker_ctx: click.Context, args: list[str]
) -> list[str]:
    """The flags as typed: ``dask worker`` takes the first flag as its SCHEDULER address when
    none came before; with ``--scheduler-file`` that flag is put back (logged, and recorded for
    the worker processes), otherwise it is a UsageError naming it."""
    swallowed = worker_ctx.params.get("scheduler")
    if not (isinstance(swallowed, str) and swallowed.startswith("-")):
        os.environ.pop(_RECOVERED_ENV, None)  # a stale record inherited from elsewhere
        return args
    flag = swallowed.split("=", 1)[0]
    took = f"dask worker took {swallowed!r} as its SCHEDULER address"
    fix = (
        "give the scheduler address before the flags (dask worker tcp://HOST:8786 --preload "
        "dask_rmm.preload --rmm-...), or configure dask-rmm with DASK_DASK_RMM__* environment "
        "variables"
    )
    if not worker_ctx.params.get("scheduler_file"):
        raise click.UsageError(
            f"{took}, so the preload lost {flag}: no scheduler address came before the flags; "
            f"{fix}."
        )
    typed = [swallowed, *args]
    try:
        click.Command.parse_args(command, click.Context(command), list(typed))
    except click.UsageError as e:
        raise click.UsageError(f"{e.message}\n({took}: {fix}.)", e.ctx) from e
    _log_recovered(typed)
    os.environ[_RECOVERED_ENV] = json.dumps({"received": args, "argv": typed})
    return typed


def _recovered_argv(args: list[str]) -> list[str]:
    """The flags as typed if ``dask worker`` recovered one from ``args``; otherwise ``args``."""
    try:
        record = json.loads(os.environ.get(_RECOVERED_ENV) or "null")
        received, typed = record["received"], record["argv"]
    except (ValueError, TypeError, KeyError):
        return args
    if received != args or not isinstance(typed, list):
        return args
    _log_recovered(typed)
    return list(typed)


def _log_recovered(typed: list[str]) -> None:
    logger.warning(
        "dask worker took %r as its SCHEDULER address (the address comes from "
        "--scheduler-file): recovered %s for dask_rmm.preload, which gets: %s",
        typed[0],
        typed[0].split("=", 1)[0],
        " ".join(typed),
    )


#: Parameters of distributed's `dask worker` command: the context the preload runs in.
_WORKER_PARAMS = {"scheduler", "scheduler_file", "preload_argv"}

#: The flags: (flag, RMMPlugin option, click settings). A ``/--no-`` flag is a switch.
_FLAGS: list[tuple[str, str, dict[str, Any]]] = [
    ("--rmm-pool-size", "pool_size", dict(metavar="SIZE", help="Initial pool size: bytes, '4GiB' "
        "or a fraction of device memory ('0.8'). No pool when not given.")),
    ("--rmm-maximum-pool-size", "maximum_pool_size", dict(metavar="SIZE", help="The pool never "
        "grows beyond this (needs --rmm-pool-size or --rmm-async).")),
    ("--rmm-managed-memory/--no-rmm-managed-memory", "managed_memory",
        dict(help="Allocate CUDA managed (unified) memory.")),
    ("--rmm-async/--no-rmm-async", "async_alloc",
        dict(help="Use cudaMallocAsync (CudaAsyncMemoryResource) instead of a pool.")),
    ("--rmm-release-threshold", "release_threshold", dict(metavar="SIZE", help="Bytes the pool "
        "keeps: free memory above it goes back to the device (needs --rmm-pool-size or "
        "--rmm-async).")),
    ("--rmm-log-directory", "log_directory", dict(type=click.Path(file_okay=False), help="Write "
        "one CSV allocation log per worker and device into this directory.")),
    ("--rmm-track-allocations/--no-rmm-track-allocations", "track_allocations",
        dict(help="Track outstanding allocations (TrackingResourceAdaptor).")),
    ("--set-rmm-allocator-for-libs", "allocators", dict(callback=_libraries, metavar="LIBS",
        help="Point these libraries at the worker's resource: 'cupy', 'numba', 'torch' or "
        "several ('cupy,torch').")),
    ("--rmm-exact-allocators", "exact_allocators", dict(callback=_libraries, metavar="LIBS",
        help="Send every allocation of these libraries ('cupy', 'rmm') through the worker's "
        "resource (exact per-allocation statistics) instead of their own cache over it.")),
    ("--rmm-base-resource", "base_resource", dict(type=click.Choice(
        BASE_RESOURCES, case_sensitive=False),
        help="Where memory comes from; 'system' (host memory) for hosts without a GPU.")),
    ("--device-memory-limit", "device_memory_limit", dict(metavar="SIZE", help="Spill task "
        "outputs to host memory above this many bytes in use on the device.")),
    ("--spill-on-oom/--no-spill-on-oom", "spill_on_oom",
        dict(help="Spill task outputs and retry when an allocation runs out of memory.")),
    ("--rmm-memory-admission/--no-rmm-memory-admission", "memory_admission",
        dict(help="Start a task only when its expected peak (learned per task prefix) fits "
        "under the worker's limit beside the running tasks'.")),
    ("--rmm-oom-retry/--no-rmm-oom-retry", "oom_retry", dict(help="Run a task once more after "
        "PyTorch's own allocator ran out of device memory (with memory admission; on by default).")),
    ("--rmm-statistics/--no-rmm-statistics", "statistics", dict(help="Count allocations per "
        "worker and task prefix for the heartbeat metrics (on by default).")),
]  # fmt: skip
#: Parameter name (``rmm_pool_size``) -> RMMPlugin option (``pool_size``).
_FLAG_TO_OPTION = {f.split("/")[0][2:].replace("-", "_"): o for f, o, _ in _FLAGS}
#: RMMPlugin option -> parameter name.
_PARAMS = {o: f for f, o in _FLAG_TO_OPTION.items()}


#: dask-cuda's own preload flag: ``dask cuda worker`` and ``LocalCUDACluster`` give it to every
#: preload (they add ``dask_cuda.initialize``, and distributed passes one argv to all preloads).
_DASK_CUDA_FLAG = "--create-cuda-context/--no-create-cuda-context"


def _with_flags(command: Any) -> Any:
    for flag, _, settings in reversed(_FLAGS):
        command = click.option(flag, default=None, **settings)(command)
    command = click.option(_DASK_CUDA_FLAG, "dask_cuda_context", hidden=True, expose_value=False)(
        command
    )
    return click.command(
        name="dask_rmm.preload",
        cls=_PreloadCommand,
        help=_HELP,
        context_settings={"help_option_names": ["-h", "--help"]},
    )(command)


#: The command's help (``--help``, ``-h``): plain text, not the docstring's Sphinx markup.
_HELP = """Set the worker's memory resources up from the --rmm-* flags (one RMMPlugin for
this worker).

\b
  dask worker tcp://HOST:8786 --preload dask_rmm.preload --rmm-pool-size 4GiB

Give the scheduler address before these flags: dask worker takes the first flag as its address
otherwise (with --scheduler-file that flag is recovered and logged). Under dask-cuda, its own
--rmm-* settings configure dask-rmm. A setup that fails stops the worker with the reason.
Without a GPU, add --rmm-base-resource system (host memory).

python -m dask_rmm.preload FLAGS checks the flags and prints the RMMPlugin they make, without
starting anything.
"""


@_with_flags
async def dask_setup(worker: Any, **flags: Any) -> None:
    """Set the worker's memory resources up from the ``--rmm-*`` flags (or stop it)."""
    _hide_own_flags_from_other_preloads(worker)
    if (flags_error := flags.pop("flags_error", None)) is not None:
        await fatal.stop_worker(worker, flags_error)
        raise WorkerSetupFailed(flags_error)
    try:
        plugin = plugin_for_worker(worker, flags)
    except Exception as e:
        await fatal.stop_worker(worker, _reason(e))
        raise WorkerSetupFailed(_reason(e)) from e
    plugin.coordinated = False  # this worker alone: no vote with the others
    plugin.host_memory_form = "--rmm-base-resource system"
    # distributed's plugin_add, without its traceback: stop_worker logs the reason once
    worker.plugins[plugin.name] = plugin
    try:
        await plugin.setup(worker)
        worker_stack(worker).command_line = plugin
    except Exception as e:
        worker.plugins.pop(plugin.name, None)
        failed = "; ".join(e.failures.values()) if isinstance(e, RMMSetupError) else ""
        reason = f"dask-rmm setup failed: {failed or _reason(e)}"
        await fatal.stop_worker(worker, reason)
        raise WorkerSetupFailed(reason) from e


def _same(option: str, a: Any, b: Any) -> bool:
    """Whether two spellings of an option mean the same (``"32MiB"`` and ``33554432``)."""
    try:
        return a == b or parse_size(a, option) == parse_size(b, option)
    except (TypeError, ValueError):
        return False


def _reason(e: BaseException) -> str:
    message = e.format_message() if isinstance(e, click.ClickException) else str(e)
    return f"{type(e).__name__}: {message}"


def plugin_for_worker(worker: Any, flags: dict[str, Any]) -> Any:
    """The RMMPlugin for ``worker`` from ``flags`` and, on a dask-cuda worker, dask-cuda's
    ``rmm_*`` settings (then switched off; compiled ``rmm`` served from dask-rmm's stack). A
    setting given both ways with different values is a usage error."""
    setup = dask_cuda.find_rmm_setup(worker)
    if setup is None:
        return plugin_from_flags(**flags)
    typed = dask_cuda.options_from_rmm_setup(setup)
    flags = dict(flags)
    for option, (value, flag) in typed.items():
        ours = _PARAMS[option]
        given = flags.get(ours)
        if option == "allocators":
            flags[ours] = [*dict.fromkeys([*(given or ()), *value])]
        elif given is None or _same(option, given, value):
            flags[ours] = value
        else:
            raise click.UsageError(
                f"dask-cuda's {flag} {value} and dask_rmm.preload's "
                f"--{ours.replace('_', '-')} {given} disagree; give it once"
            )
    base = flags.get("rmm_base_resource") or config_value("base-resource")
    if dask_cuda.compiled_rmm_installed() and base not in ("system", "pinned"):
        libs = flags.get("set_rmm_allocator_for_libs") or []
        flags["set_rmm_allocator_for_libs"] = [*dict.fromkeys([*libs, "rmm"])]
    plugin = plugin_from_flags(**flags)
    dask_cuda.switch_off(setup)
    fatal.WORKER_LOGGER.info(
        "dask-rmm: worker %s: dask-cuda's RMM settings (%s) configure dask-rmm; compiled "
        "RMM's own pool is not made",
        worker.name,
        " ".join(f"{flag} {v}" for v, flag in typed.values()) or "none",
    )
    return plugin


def _hide_own_flags_from_other_preloads(worker: Any) -> None:
    """Take dask-rmm's flags out of the other click preloads' argv (distributed hands every
    preload the same one; ``dask_cuda.initialize`` would reject ``--rmm-base-resource``)."""
    ours: dict[str, bool] = {}  # option string -> takes a value
    for param in dask_setup.params:
        if isinstance(param, click.Option) and param.name != "dask_cuda_context":
            for opt in [*param.opts, *param.secondary_opts]:
                ours[opt] = not param.is_flag
    for preload in getattr(worker, "preloads", ()):
        command = getattr(getattr(preload, "module", None), "dask_setup", None)
        if command is dask_setup or not isinstance(command, click.Command):
            continue
        argv, kept = list(getattr(preload, "argv", ())), []
        i = 0
        while i < len(argv):
            name = argv[i].split("=", 1)[0]
            if name in ours:
                i += 2 if ours[name] and "=" not in argv[i] else 1
                continue
            kept.append(argv[i])
            i += 1
        preload.argv = kept


class WorkerSetupFailed(BaseException):
    """The preload's worker could not be set up; fails the worker's start. A BaseException:
    distributed logs and ignores an ``Exception`` from a preload."""


def plugin_from_flags(**flags: Any):
    """An RMMPlugin from parsed flags (``rmm_pool_size="4GiB"``...); unset flags use config.

    Examples
    --------
    >>> plugin_from_flags(rmm_pool_size="1GiB", rmm_base_resource="system").options.pool_size
    1073741824
    """
    if unknown := set(flags) - set(_FLAG_TO_OPTION):
        raise TypeError(f"unknown flags: {sorted(unknown)}")
    options = {_FLAG_TO_OPTION[k]: v for k, v in flags.items() if v is not None}
    try:
        return RMMPlugin(**options)
    except (TypeError, ValueError) as e:

        def as_flag(match: re.Match) -> str:  # `pool_size`, `async_alloc=True`, pool_size='x'
            param = _PARAMS.get(match.group(1) or match.group(2))
            return match.group(0) if param is None else "--" + param.replace("_", "-")

        message = re.sub(r"`(\w+)(?:=True)?`|^(\w+)(?==)", as_flag, str(e))
        raise click.UsageError(message) from e


def _main(argv: list[str] | None = None) -> None:
    """``python -m dask_rmm.preload [--help] [FLAGS]``: print the RMMPlugin FLAGS make."""
    try:
        with dask_setup.make_context(PROG, list(sys.argv[1:] if argv is None else argv)) as ctx:
            click.echo(repr(plugin_from_flags(**ctx.params)))
    except click.exceptions.Exit as e:
        raise SystemExit(e.exit_code) from None
    except click.ClickException as e:
        e.show()
        raise SystemExit(e.exit_code) from None


if __name__ == "__main__":
    _main()
