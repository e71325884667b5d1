"""The client side of cluster memory reports: fetch the report document from the scheduler
(``cluster_report(client)``, and ``iter_reports(address)`` for the CLI, which needs no Client).
Rendering is ``dask_rmm.report``'s; the scheduler side is ``dask_rmm.scheduler``.
"""

from __future__ import annotations

import asyncio
import json
import socket
from typing import Any

from distributed import Client, Security, default_client
from distributed.comm import CommClosedError, connect
from distributed.comm.addressing import parse_address, parse_host_port
from distributed.comm.registry import get_backend
from distributed.core import rpc

from dask_rmm.report.memory_report import ClusterMemoryReport
from dask_rmm.scheduler import install_scheduler_plugin
from dask_rmm.scheduler.report_build import ReportRequest

__all__ = [
    "BadAddressError",
    "NotDaskAddressError",
    "cluster_report",
    "fetch_report_data",
    "iter_reports",
]


class NotDaskAddressError(OSError):
    """The address answers, but not with Dask's protocol (an HTTP server, a proxy, another
    service): a wrong address rather than a scheduler that is down."""


class BadAddressError(ValueError):
    """The address cannot be one of a scheduler: no port, a port out of range, not host:port."""


async def fetch_report_data(
    scheduler_rpc: Any,
    *,
    timeline: bool = True,
    last: int | None = None,
    install: bool = True,
    **request: Any,
) -> dict:
    """The report document from ``scheduler_rpc`` (``client.scheduler`` or a ``rpc``); the
    scheduler plugin is installed first (a no-op when it is there), so that the scheduler never
    sees a request for a handler it lacks. ``request`` takes the other fields of
    :class:`dask_rmm.scheduler.report_build.ReportRequest` (``top``, ``sort``, ``worker``,
    ``width``); None ones are not sent."""
    if install:
        try:
            await install_scheduler_plugin(scheduler_rpc)
        except (ImportError, AttributeError, TypeError) as e:
            raise RuntimeError(
                f"could not install dask-rmm's scheduler plugin ({type(e).__name__}: {e}); "
                "is dask-rmm installed on the scheduler?"
            ) from e
    query = {k: v for k, v in request.items() if v is not None}
    data = await scheduler_rpc.dask_rmm_report(timeline=timeline, last=last, **query)
    if isinstance(data, bytes):  # built off the scheduler's event loop as JSON
        data = json.loads(data)
    if not isinstance(data, dict) or "workers" not in data:
        raise RuntimeError(f"the scheduler answered the dask-rmm report request with {data!r}")
    return data


def cluster_report(
    client: Client | None = None,
    *,
    timeline: bool = True,
    last: int | None = None,
    top: int | None = None,
    sort: str | None = None,
    worker: str | None = None,
):
    """The cluster's RMM memory now, per worker and device, with the recent timeline.

    ``client`` defaults to the current one (TypeError for anything but a Client); ``timeline``,
    ``last``, ``top``, ``sort`` and ``worker`` are
    :class:`~dask_rmm.scheduler.report_build.ReportRequest`'s (the timelines are needed for plots
    and the cluster's peak). Returns a :class:`ClusterMemoryReport` (an awaitable of one with an
    asynchronous client); a cluster without dask-rmm workers gives a report that says so
    (docs/reports.md).
    """
    if client is None:
        client = default_client()
    elif not hasattr(client, "sync") or not hasattr(client, "scheduler"):
        raise TypeError(
            f"client must be a distributed.Client, got {client!r}; for a scheduler address use "
            "cluster_report(Client(address)) or `dask rmm report ADDRESS`"
        )
    ReportRequest(timeline=timeline, last=last, top=top, sort=sort, worker=worker)  # checks

    async def _report() -> ClusterMemoryReport:
        data = await fetch_report_data(
            client.scheduler, timeline=timeline, last=last, top=top, sort=sort, worker=worker
        )
        return ClusterMemoryReport.from_dict(data)

    return client.sync(_report)


async def iter_reports(
    address: str,
    *,
    interval: float | None = None,
    timeout: float = 5.0,
    timeline: bool = True,
    last: int | None = None,
    security: Any = None,
    **request: Any,
):
    """Reports from the scheduler at ``address`` without a Client (the CLI's path): once, or
    every ``interval`` seconds until the caller stops (``request``: as for
    :func:`fetch_report_data`). Each round, the first one's connection included, gets
    ``timeout`` seconds in all; an ``OSError`` names the address and the reason.
    ``security`` (a ``distributed.Security``) defaults to the dask config's."""
    args = (security or Security()).get_connection_args("client")
    scheduler = rpc(address, timeout=timeout, connection_args=args)
    install = True
    try:
        while True:

            async def round_(install: bool = install) -> dict:
                if install:  # the first round: is it a Dask scheduler at all?
                    await _check_address(address, args, timeout)
                try:
                    return await fetch_report_data(
                        scheduler, timeline=timeline, last=last, install=install, **request
                    )
                except OSError as e:
                    raise _not_reachable(address, str(e) or type(e).__name__) from e

            try:
                data = await asyncio.wait_for(round_(), timeout)
            except asyncio.TimeoutError as e:
                raise _not_reachable(address, f"no answer within {timeout:g} s") from e
            install = False
            yield ClusterMemoryReport.from_dict(data)
            if interval is None:
                return
            await asyncio.sleep(interval)
    finally:
        await scheduler.close_rpc()


def _not_reachable(address: str, reason: str) -> OSError:
    return OSError(f"could not reach the Dask scheduler at {address}: {reason}")


async def _check_address(address: str, connection_args: dict, timeout: float) -> None:
    """One connection to ``address`` through ``distributed.comm.connect``, after the checks its
    retries would hide: :class:`BadAddressError`, ``OSError`` (no such host, nothing listening)
    or :class:`NotDaskAddressError` (no Dask handshake; a hint for an HTTP port)."""
    try:
        scheme, location = parse_address(address)
        host, port = parse_host_port(location) if scheme in ("tcp", "tls") else ("", 1)
        if not 0 < port < 65536:
            raise ValueError(f"port {port} is out of range (1-65535)")
    except (ValueError, TypeError) as e:
        raise BadAddressError(
            f"{address!r} is not a scheduler address such as tcp://HOST:8786 ({e})"
        ) from e
    if scheme == "inproc":
        raise BadAddressError(
            f"{address!r} is not a scheduler address for this command: an inproc:// address "
            "is reachable only inside its own process; give the scheduler's tcp:// address"
        )
    if scheme != "tls" and connection_args.get("require_encryption"):
        raise BadAddressError(
            f"cannot connect to {address}: the Dask config requires encryption "
            "(distributed.comm.require-encryption): give the scheduler's tls:// address"
        )
    if scheme == "tls" and not connection_args.get("ssl_context"):
        raise BadAddressError(
            f"cannot connect to {address}: a tls:// address needs a TLS client configuration "
            "(distributed.comm.tls.* in the Dask config), and none is set"
        )
    try:
        get_backend(scheme).get_connector()
    except Exception as e:  # ucx:// without distributed-ucxx, an unknown scheme
        raise BadAddressError(
            f"cannot connect to {address}: this process has no {scheme}:// transport "
            f"({'install distributed-ucxx; ' if scheme == 'ucx' else ''}{e})"
        ) from e
    # distributed's connect retries these until the timeout, and a peer that hangs up at once
    if scheme in ("tcp", "tls"):
        try:
            what = await _probe(scheme, host, port)
        except socket.gaierror as e:
            raise _not_reachable(address, f"cannot resolve host {host!r} ({e.strerror})") from e
        except ConnectionRefusedError as e:
            raise _not_reachable(
                address, f"connection refused (nothing listens on port {port} of {host})"
            ) from e
        except OSError as e:
            raise _not_reachable(address, e.strerror or str(e) or type(e).__name__) from e
        if what is not None:
            raise _not_dask(address, what)
    try:
        comm = await connect(address, timeout=timeout, **connection_args)
    except CommClosedError:
        raise _not_dask(address, "it closed the connection during Dask's handshake") from None
    except OSError:  # not reached, or no answer in time (TimeoutError)
        raise
    except Exception:  # a length of exabytes, a short frame, ...: not Dask's framing
        raise _not_dask(address, "its answer is not in Dask's framing") from None
    await comm.close()


def _not_dask(address: str, what: str) -> NotDaskAddressError:
    return NotDaskAddressError(
        f"{address} does not speak Dask's protocol: {what}; give the scheduler's address "
        "(`dask scheduler` prints it, usually port 8786)"
    )


async def _probe(scheme: str, host: str, port: int) -> str | None:
    """One plain connection to ``host:port``: what shows it is not Dask (a tcp peer that hangs
    up without a word, or answers HTTP), or None (Dask's handshake then decides)."""
    reader, writer = await asyncio.open_connection(host, port)
    try:
        if scheme == "tcp":
            try:  # a Dask server greets first
                greeting = await asyncio.wait_for(reader.read(5), 0.3)
                if not greeting:
                    return "it closed the connection without a word"
            except asyncio.TimeoutError:
                writer.write(b"HEAD / HTTP/1.0\r\n\r\n")
                greeting = await asyncio.wait_for(reader.read(5), 1.0)
            if greeting == b"HTTP/":
                return (
                    "it answers HTTP: that is a dashboard port, not the scheduler's (the "
                    "scheduler address usually ends in :8786, the dashboard's in :8787)"
                )
    except asyncio.TimeoutError:  # no answer to HTTP either: Dask's handshake decides
        pass
    finally:
        writer.close()
    return None
