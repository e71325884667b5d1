"""The ``dask rmm ...`` command line (also ``python -m dask_rmm.cli``): argument parsing and
output only; each command imports the module that implements it when it runs."""

from __future__ import annotations

import contextlib
import json
import math
import os
import sys
import warnings
from collections.abc import Callable, Iterator
from typing import Any

import click

__all__ = ["main"]

#: Exit status of ``dask rmm log replay`` when the replay failed allocations the original
#: run did not (1 is an error, 2 a usage error).
EXIT_NEW_FAILURES = 3


@click.group(name="rmm", context_settings={"help_option_names": ["-h", "--help"]})
def main() -> None:
    """dask-rmm: RMM memory resources for Dask; cluster reports and allocation logs."""


@main.group(name="log")
def log() -> None:
    """Summarize, plot, merge and replay RMM allocation logs (CSV).

    Logs are what LoggingResourceAdaptor (RMM's or dask-rmm's) writes, for example after
    ``dask_rmm.reinitialize(logging=True)``: one file per process and device with the columns
    Thread,Time,Action,Pointer,Size,Stream.
    """


@contextlib.contextmanager
def _user_errors() -> Iterator[None]:
    """Turn bad input into a one-line error (exit 1) and warnings into ``warning:`` lines."""
    from dask_rmm.logs import LogFormatError

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        try:
            yield
        except (LogFormatError, OSError, ImportError, RuntimeError, ValueError) as e:
            raise click.ClickException(str(e)) from e
        finally:
            for message in dict.fromkeys(str(w.message) for w in caught):
                click.echo(f"warning: {message}", err=True)


def _parse_size(ctx: click.Context, param: click.Parameter, value: str | None) -> int | None:
    if value is None:
        return None
    from dask_rmm.sizes import parse_device_bytes

    try:
        size = parse_device_bytes(value)
    except (ValueError, TypeError) as e:
        raise click.BadParameter(f"{value!r} is not a size such as 4GiB or 1073741824 ({e})") from e
    if size is None and param.name == "block_size":  # parse_device_bytes: 0 is "unset"
        raise click.BadParameter(f"{value!r} is not a positive size such as 1MiB")
    return size


def _progress_option(what: str) -> Callable[[Any], Any]:
    """``--progress/--no-progress``: click's progress bar on stderr, by default on a terminal."""
    return click.option(
        "--progress/--no-progress",
        default=None,
        callback=lambda ctx, param, flag: sys.stderr.isatty() if flag is None else flag,
        help=f"Progress bar on stderr while {what} (default: when stderr is a terminal).",
    )


_FILES = click.argument(
    "files", nargs=-1, required=True, type=click.Path(exists=True, dir_okay=False)
)


@log.command()
@_FILES
@click.option("--json", "as_json", is_flag=True, help="Print the summaries as JSON.")
@click.option(
    "--top",
    type=click.IntRange(min=0),
    default=10,
    show_default=True,
    help="Largest outstanding allocations to list.",
)
@_progress_option("reading the logs")
def summary(files: tuple[str, ...], as_json: bool, top: int, progress: bool) -> None:
    """Duration, counts, peak, leaks, size histogram and per-thread/stream totals of FILES.

    With several files (one per worker), also their combination merged by time.
    """
    from dask_rmm.logs import summary as log_summary

    with _user_errors():
        report = log_summary.summarize(files, top=top, progress=progress)
    if as_json:
        from dask_rmm.report.memory_report import strict_json

        click.echo(strict_json(report.to_dict(), indent=2))
        return
    summaries = [s for s in (*report.files, report.combined) if s is not None]
    click.echo("\n\n".join(map(log_summary.format_summary, summaries)))


@log.command()
@_FILES
@click.option(
    "-o", "--output", required=True, type=click.Path(dir_okay=False), help="Image to write."
)
@click.option("--title", default=None, help="Plot title.")
@_progress_option("reading the logs")
def plot(files: tuple[str, ...], output: str, title: str | None, progress: bool) -> None:
    """Plot bytes in use over time, one line per file (worker), each peak marked.

    Writes PNG, SVG or PDF by OUTPUT's extension; needs matplotlib.
    """
    from dask_rmm.logs import timeline as log_timeline

    with _user_errors():
        timelines = log_timeline.plot_logs(files, output, title=title, progress=progress)
    peaks = ", ".join(f"{t.source} {t.peak_bytes:,} B" for t in timelines)
    click.echo(f"wrote {output} (peaks: {peaks})")


@log.command()
@_FILES
@click.option(
    "-o", "--output", required=True, type=click.Path(dir_okay=False), help="Merged CSV to write."
)
def merge(files: tuple[str, ...], output: str) -> None:
    """Merge several workers' logs by time into one CSV with a Worker column.

    OUTPUT must not be one of FILES; it is written under a temporary name and renamed at the end.
    """
    from dask_rmm import logs

    with _user_errors():
        n = logs.merge_logs(files, output)
    click.echo(f"merged {n:,} rows from {len(files)} files into {output}")


# dask_rmm.logs.replay.RESOURCES, repeated so that importing the CLI stays light (a test checks).
_RESOURCE_NAMES = ("pool", "arena", "binning", "fixed_size", "async", "cuda")


@log.command()
@click.argument("file", type=click.Path(exists=True, dir_okay=False))
@click.option(
    "-r",
    "--resource",
    type=click.Choice(_RESOURCE_NAMES),
    default="pool",
    show_default=True,
    help="Resource to replay on ('cuda' is the base resource alone).",
)
@click.option(
    "--compare",
    default=None,
    metavar="NAMES",
    help="Comma-separated resources (or 'all') to replay one after another; prints one table.",
)
@click.option("--initial-pool-size", callback=_parse_size, help="Pool size (arena size for arena).")
@click.option("--maximum-pool-size", callback=_parse_size, help="Largest the pool may grow.")
@click.option("--block-size", callback=_parse_size, help="Block size of fixed_size (1MiB).")
@click.option(
    "--host-memory", is_flag=True, help="Replay on host memory even when a GPU is present."
)
@click.option(
    "--retry-failures",
    is_flag=True,
    help="Re-issue the log's 'allocate failure' rows too (successes are freed at once).",
)
@_progress_option("replaying")
@click.option("--json", "as_json", is_flag=True, help="Print the results as JSON.")
def replay(
    file: str,
    resource: str,
    compare: str | None,
    initial_pool_size: int | None,
    maximum_pool_size: int | None,
    block_size: int | None,
    host_memory: bool,
    retry_failures: bool,
    progress: bool,
    as_json: bool,
) -> None:
    """Re-issue FILE's allocations and frees, in order, on a fresh resource.

    Reports the peak memory the resource took from its upstream, the rows that failed and the
    time. Exits with status 3 when an allocation that succeeded originally failed here (with
    --compare: on a resource that can serve the log's sizes; fixed_size cannot serve requests
    larger than its block, which the table says).
    """
    from dask_rmm.logs import replay as rp

    names = [resource]
    if compare:
        names = list(rp.RESOURCES) if compare.strip() == "all" else compare.split(",")
        names = [n.strip() for n in names if n.strip()]
        unknown = [n for n in names if n not in rp.RESOURCES]
        if unknown or not names:
            raise click.BadParameter(
                f"unknown resource(s) {', '.join(unknown) or repr(compare)}; choose from "
                f"{', '.join(rp.RESOURCES)}",
                param_hint="--compare",
            )
    with _user_errors():
        gpu = not host_memory and rp._has_gpu()
        if not gpu:
            if compare and "async" in names:
                names.remove("async")
                click.echo("skipping async: it needs a CUDA device", err=True)
            reason = "--host-memory" if host_memory else "no GPU on this host"
            click.echo(
                f"{reason}: replaying on host memory (SystemMemoryResource upstream)", err=True
            )
        results = [
            rp.replay(
                file,
                name,
                gpu=gpu,
                block_size=block_size,
                retry_failures=retry_failures,
                progress=progress,
                initial_pool_size=initial_pool_size,
                maximum_pool_size=maximum_pool_size,
            )
            for name in names
        ]
    if as_json:
        from dask_rmm.report.memory_report import strict_json

        out = [r.to_dict() for r in results]
        click.echo(strict_json(out if compare else out[0], indent=2))
    elif compare:
        for r in results:
            if r.failed and r.can_serve:
                click.echo(rp.format_result(r, max_failures=3))
        click.echo(f"replay of {file} ({results[0].rows:,} rows)")
        click.echo(rp.format_comparison(results))
    else:
        click.echo(rp.format_result(results[0]))
    # Compared, a resource that cannot serve the log at all (fixed_size under larger requests)
    # is a finding of the table; asked for alone, it is the answer: the replay failed.
    if any(r.failed and (r.can_serve or not compare) for r in results):
        sys.exit(EXIT_NEW_FAILURES)


def _finite_seconds(
    ctx: click.Context, param: click.Parameter, value: float | None
) -> float | None:
    # click's FloatRange lets nan and inf through; the scheduler rpc then fails on them with a
    # KeyError traceback ("Invalid time unit: nan").
    if value is not None and not math.isfinite(value):
        raise click.BadParameter(f"{value} is not a finite number of seconds")
    return value


def _address(targets: tuple[str, ...], scheduler_file: str | None, other: str = "") -> str:
    """The one scheduler address given, or the one in ``scheduler_file``."""
    if len(targets) + bool(scheduler_file) != 1:
        raise click.UsageError(f"give one SCHEDULER_ADDRESS or --scheduler-file{other}")
    if not scheduler_file:
        return targets[0]
    try:
        with open(scheduler_file) as f:
            return json.load(f)["address"]
    except (OSError, ValueError, KeyError) as e:
        raise click.ClickException(
            f"cannot read a scheduler address from {scheduler_file}: {e!r}"
        ) from e


_SCHEDULER_FILE = click.option(
    "--scheduler-file",
    type=click.Path(exists=True, dir_okay=False),
    help="Read the scheduler address from this file (dask scheduler --scheduler-file).",
)


def _timeout_option(help: str) -> Callable[[Any], Any]:
    """``--timeout``: finite seconds above 0, 5 by default."""
    return click.option(
        "--timeout",
        type=click.FloatRange(min=0, min_open=True),
        callback=_finite_seconds,
        default=5.0,
        show_default=True,
        help=help,
    )


@main.command()
@click.argument("scheduler_address", required=False)
@_SCHEDULER_FILE
@click.option("--json", "as_json", is_flag=True, help="Print the report as JSON.")
@click.option(
    "--top",
    type=click.IntRange(min=1),
    default=None,
    metavar="N",
    help="Only the first N devices in --sort order (default order then: peak); totals cover all.",
)
@click.option(
    "--sort",
    type=click.Choice(["worker", "current", "peak", "fragmentation"]),
    default=None,
    help="Order of the devices: by worker address (default) or largest first.",
)
@click.option(
    "--worker",
    "worker_filter",
    metavar="TEXT",
    default=None,
    help="Only the devices of workers whose address or name contains TEXT.",
)
@click.option(
    "--timelines",
    is_flag=True,
    help="With --json: each device's timeline too (every point the scheduler keeps).",
)
@click.option(
    "--watch",
    type=click.FloatRange(min=0.1),
    callback=_finite_seconds,
    default=None,
    metavar="SECONDS",
    help="Refresh every SECONDS until interrupted (with --json: one JSON document a line).",
)
@click.option(
    "--plot",
    "plot_path",
    type=click.Path(dir_okay=False),
    help="Also write a PNG: memory over time and task-group peaks (needs matplotlib).",
)
@_timeout_option("Seconds to wait for each answer from the scheduler.")
def report(
    scheduler_address: str | None,
    scheduler_file: str | None,
    as_json: bool,
    top: int | None,
    sort: str | None,
    worker_filter: str | None,
    timelines: bool,
    watch: float | None,
    plot_path: str | None,
    timeout: float,
) -> None:
    """GPU memory of every dask-rmm worker of the scheduler at SCHEDULER_ADDRESS.

    Per worker and device: used, peak, reserved, free in the pool, largest free block,
    fragmentation, failed allocations and the task groups holding the most. Exits with
    status 1 when the scheduler cannot be reached (the host does not resolve, the connection
    is refused, no answer in time) or no worker reports dask-rmm metrics, 2 when the address
    is not one of a scheduler (no port, a port out of range) or answers but not as a Dask
    scheduler (a dashboard, a proxy, another service).
    """
    from dask_rmm._output import refuse_input
    from dask_rmm.client.fetch import iter_reports

    address = _address((scheduler_address,) if scheduler_address else (), scheduler_file)
    if timelines and not as_json:
        raise click.UsageError(
            "--timelines goes with --json (the table shows no timelines; --plot draws them)"
        )
    if scheduler_file:
        try:
            refuse_input(plot_path or "", [scheduler_file])
        except ValueError as e:
            raise click.BadParameter(str(e), param_hint="--plot") from e
    timeline = timelines or plot_path is not None
    clear = watch is not None and not as_json and sys.stdout.isatty()
    # More devices than any cluster has is all of them (msgpack refuses ints >= 2**64).
    top = None if top is None else min(top, 1 << 32)
    request: dict[str, Any] = {"top": top, "sort": sort, "worker": worker_filter}

    async def run() -> None:
        async for r in iter_reports(
            address, interval=watch, timeout=timeout, timeline=timeline, **request
        ):
            if not r.devices and not r.totals.devices and watch is None:
                raise click.ClickException(
                    f"no dask-rmm workers on the scheduler at {address} "
                    f"({len(r.workers_without_dask_rmm)} workers without dask-rmm metrics); "
                    "register dask_rmm.RMMPlugin on the workers"
                )
            if plot_path is not None:
                r.plot(plot_path)
            if as_json:
                click.echo(r.to_json(timeline=timeline, indent=None if watch else 2))
            else:
                click.echo(("\x1b[2J\x1b[H" if clear else "") + str(r))
                if plot_path is not None:
                    click.echo(f"wrote {plot_path}")

    with contextlib.suppress(KeyboardInterrupt):
        _run_at_scheduler(run())


class _WrongAddress(click.ClickException):
    """An address that is not a Dask scheduler's: a usage error (exit 2)."""

    exit_code = 2


def _run_at_scheduler(coroutine: Any) -> Any:
    """Run ``coroutine``: a wrong scheduler address exits 2, an unreachable one 1, in one line."""
    import asyncio

    from dask_rmm.client.fetch import BadAddressError, NotDaskAddressError

    with _user_errors():
        try:
            return asyncio.run(coroutine)
        except (NotDaskAddressError, BadAddressError) as e:
            raise _WrongAddress(str(e)) from e


@main.command()
@click.argument("targets", nargs=-1)
@_SCHEDULER_FILE
@click.option(
    "--logs",
    is_flag=True,
    help="TARGETS are allocation logs (one per worker device), not a scheduler address.",
)
@click.option(
    "--device-memory",
    callback=_parse_size,
    default=None,
    metavar="SIZE",
    help="With --logs: the workers' device memory (e.g. 80GiB), which bounds maximum_pool_size.",
)
@click.option(
    "--host-memory",
    is_flag=True,
    help="With --logs: the logs come from host memory (no cudaMallocAsync to advise).",
)
@click.option("--json", "as_json", is_flag=True, help="Print the advice as JSON.")
@_progress_option("reading and replaying --logs")
@_timeout_option("Seconds to wait for the scheduler.")
def advise(
    targets: tuple[str, ...],
    scheduler_file: str | None,
    logs: bool,
    device_memory: int | None,
    host_memory: bool,
    as_json: bool,
    progress: bool,
    timeout: float,
) -> None:
    """Recommend pool_size, maximum_pool_size and the allocator per worker device.

    From the live cluster at the scheduler address TARGETS (peaks, fragmentation,
    out-of-memory verdicts, device size), or with --logs from the allocation logs TARGETS
    (peak, and replays of each log on pools of increasing size: the smallest that serves every
    allocation is what the workload needs). Each number comes with its reason, then the
    RMMPlugin(...) arguments and the worker flags to paste, per device and for all of them.
    """
    from dask_rmm.client import advice as advice_mod

    if logs:
        if not targets or scheduler_file:
            raise click.UsageError("--logs needs log files (and no --scheduler-file)")
        if missing := [t for t in targets if not os.path.isfile(t)]:
            raise click.BadParameter(f"no such log file: {', '.join(missing)}")
        with _user_errors():
            advices = advice_mod.advise_from_logs(
                list(targets),
                device_memory=device_memory or 0,
                on_device=not host_memory,
                progress=progress,
            )
    else:
        if device_memory is not None or host_memory:
            raise click.UsageError("--device-memory and --host-memory go with --logs")
        address = _address(targets, scheduler_file, " or --logs FILE...")
        from dask_rmm.client.fetch import iter_reports

        async def fetch() -> Any:
            async for r in iter_reports(address, timeout=timeout, timeline=True):
                return r

        report = _run_at_scheduler(fetch())
        if not report.running:
            raise click.ClickException(
                f"no running dask-rmm workers on the scheduler at {address}; "
                "register dask_rmm.RMMPlugin on the workers"
            )
        advices = advice_mod.advise_from_report(report)
    if as_json:
        from dask_rmm.report.memory_report import strict_json

        combined = advice_mod.combine(advices)
        doc = {"devices": [a.to_dict() for a in advices], "all": combined and combined.to_dict()}
        click.echo(strict_json(doc, indent=2))
    else:
        click.echo(advice_mod.format_advice(advices))


if __name__ == "__main__":
    main(prog_name="python -m dask_rmm.cli")
