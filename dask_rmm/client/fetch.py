"""The client side of cluster memory reports: fetch the report document from the scheduler
(``cluster_report(client)``, and ``iter_reports(address)`` for the CLI, which needs no Client).
Rendering is ``dask_rmm.report``'s; the scheduler side is ``dask_rmm.scheduler``.
"""

from __future__ import annotations

import asyncio
import json
from typing import TYPE_CHECKING, Any

from dask_rmm.report.memory_report import ClusterMemoryReport
from dask_rmm.scheduler import install_scheduler_plugin

if TYPE_CHECKING:
    from distributed import Client

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
    if isinstance(data, (str, bytes)):  # built off the scheduler's event loop as JSON text
        try:
            data = json.loads(data)
        except ValueError:
            pass
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

    Parameters
    ----------
    client : distributed.Client, optional
        Default: the current default client.
    timeline : bool
        Fetch the per-device sample timelines (needed for plots and the cluster's peak).
    last : int, optional
        Only the newest ``last`` points of each timeline.
    top : int, optional
        Only the first ``top`` devices in ``sort`` order (the totals still cover all devices).
    sort : {"worker", "current", "peak", "fragmentation"}, optional
        Order of the devices: by worker address (the default), or largest first; "peak" when
        ``top`` leaves devices out and no order is given.
    worker : str, optional
        Only the devices of workers whose address or name contains this text.

    Returns
    -------
    ClusterMemoryReport
        (or an awaitable of one with an asynchronous client). A cluster without dask-rmm
        workers gives a report that says so.

    Examples
    --------
    With ``client`` a Client of a running cluster (the doctest run skips these lines):

    >>> client.register_plugin(RMMPlugin(pool_size="4GiB"))  # doctest: +SKIP
    >>> print(cluster_report(client))  # doctest: +SKIP
    """
    if client is None:
        from distributed import default_client

        client = default_client()
    elif not hasattr(client, "sync") or not hasattr(client, "scheduler"):
        raise TypeError(
            f"client must be a distributed.Client, got {client!r}; for a scheduler address use "
            "cluster_report(Client(address)) or `dask rmm report ADDRESS`"
        )
    if last is not None and (isinstance(last, bool) or not isinstance(last, int) or last < 0):
        raise ValueError(f"last must be a number of samples (an int >= 0) or None, got {last!r}")
    from dask_rmm.scheduler.report_build import ReportRequest

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
    :func:`fetch_report_data`). Each answer gets ``timeout`` seconds; an
    ``OSError`` names the address and the reason (a hint when the address answers HTTP).
    ``security`` (a ``distributed.Security``) defaults to the dask config's."""
    from distributed import Security
    from distributed.core import rpc

    await check_address(address, timeout)
    security = security or Security()
    scheduler = rpc(
        address, timeout=timeout, connection_args=security.get_connection_args("client")
    )
    install = True
    try:
        while True:
            fetch = asyncio.ensure_future(
                fetch_report_data(
                    scheduler, timeline=timeline, last=last, install=install, **request
                )
            )
            probe = asyncio.ensure_future(_http_hint(address, delay=min(0.5, timeout / 2)))
            try:
                deadline = asyncio.get_running_loop().time() + timeout
                done, _ = await asyncio.wait(
                    {fetch, probe}, timeout=timeout, return_when="FIRST_COMPLETED"
                )
                if probe in done and probe.result():
                    raise NotDaskAddressError(probe.result())
                if fetch not in done:  # not HTTP: wait out the timeout
                    left = deadline - asyncio.get_running_loop().time()
                    await asyncio.wait({fetch}, timeout=max(0.0, left))
                if not fetch.done():
                    raise asyncio.TimeoutError(f"no answer within {timeout:g} s")
                data = fetch.result()
            except NotDaskAddressError:
                raise
            except asyncio.TimeoutError as e:
                reason = str(e) or type(e).__name__
                raise OSError(f"could not reach the Dask scheduler at {address}: {reason}") from e
            except Exception as e:
                # Bytes that are not Dask's framing fail anywhere in distributed's reader (a
                # length of exabytes, a short buffer, a closed stream): look at them ourselves.
                answer = await _non_dask_greeting(address, min(timeout, 2.0))
                if answer is not None:
                    raise NotDaskAddressError(_not_dask_message(address, answer)) from e
                if isinstance(e, OSError):
                    reason = str(e) or type(e).__name__
                    raise OSError(
                        f"could not reach the Dask scheduler at {address}: {reason}"
                    ) from e
                raise  # the scheduler's own answer, an error it raised
            finally:
                fetch.cancel()
                probe.cancel()
            install = False
            yield ClusterMemoryReport.from_dict(data)
            if interval is None:
                return
            await asyncio.sleep(interval)
    finally:
        await scheduler.close_rpc()


def _not_reachable(address: str, reason: str) -> OSError:
    return OSError(f"could not reach the Dask scheduler at {address}: {reason}")


async def check_address(address: str, timeout: float) -> None:
    """Before any of distributed's machinery runs (which retries a refused connection until the
    timeout, and reads a non-Dask answer as a length of exabytes): ``address`` names a host and a
    port in range (else :class:`BadAddressError`), the host resolves and something listens there
    (else ``OSError`` saying which), and over plain TCP whatever listens speaks Dask's protocol
    whichever side speaks first (else :class:`NotDaskAddressError`)."""
    import socket

    from distributed.comm.addressing import parse_address, parse_host_port

    try:
        scheme, location = parse_address(address)
    except (ValueError, TypeError) as e:
        raise BadAddressError(f"{address!r} is not a scheduler address: {e}") from e
    if scheme not in ("tcp", "tls"):
        return  # ucx, inproc, ...: distributed's own errors
    try:
        host, port = parse_host_port(location)
    except (ValueError, TypeError) as e:
        raise BadAddressError(
            f"{address!r} is not a scheduler address such as tcp://HOST:8786 ({e})"
        ) from e
    if not 0 < port < 65536:
        raise BadAddressError(
            f"{address!r} is not a scheduler address: port {port} is out of range (1-65535)"
        )
    loop = asyncio.get_running_loop()
    try:
        # RFC 6761: names under .invalid never resolve; no query needs to leave the host.
        if host.rstrip(".").lower().rpartition(".")[2] == "invalid":
            raise socket.gaierror(socket.EAI_NONAME, "Name or service not known")
        await asyncio.wait_for(
            loop.getaddrinfo(host, port, type=socket.SOCK_STREAM), timeout=timeout
        )
    except socket.gaierror as e:
        raise _not_reachable(address, f"cannot resolve host {host!r} ({e.strerror})") from e
    except asyncio.TimeoutError as e:
        raise _not_reachable(
            address, f"resolving host {host!r} took more than {timeout:g} s"
        ) from e
    try:
        _, writer = await asyncio.wait_for(asyncio.open_connection(host, port), timeout)
    except ConnectionRefusedError as e:
        raise _not_reachable(
            address, f"connection refused (nothing listens on port {port} of {host})"
        ) from e
    except asyncio.TimeoutError as e:
        raise _not_reachable(address, f"no connection within {timeout:g} s") from e
    except OSError as e:
        raise _not_reachable(address, e.strerror or str(e) or type(e).__name__) from e
    writer.close()
    if scheme == "tcp":
        answer = await _non_dask_greeting(address, timeout)
        if answer is not None:
            raise NotDaskAddressError(_not_dask_message(address, answer))


def _not_dask_message(address: str, answer: str) -> str:
    return (
        f"{address} does not speak Dask's protocol: it {answer}; give the "
        "scheduler's address (`dask scheduler` prints it, usually port 8786)"
    )


async def _http_hint(address: str, delay: float) -> str | None:
    """After ``delay`` seconds without an answer: a hint if ``address`` speaks HTTP (a Dask
    server greets first; an HTTP server answers a request), else None."""
    await asyncio.sleep(delay)
    host, _, port = address.split("://", 1)[-1].rpartition(":")
    writer = None
    try:
        reader, writer = await asyncio.wait_for(
            asyncio.open_connection(host.strip("[]") or "127.0.0.1", int(port)), 1.0
        )
        try:
            await asyncio.wait_for(reader.read(1), 0.3)
            return None  # it greeted: not HTTP
        except asyncio.TimeoutError:
            writer.write(b"HEAD / HTTP/1.0\r\n\r\n")
            if await asyncio.wait_for(reader.read(5), 1.0) == b"HTTP/":
                return (
                    f"{address} answers HTTP: that is a dashboard port, not the scheduler's "
                    "(the scheduler address usually ends in :8786, the dashboard's in :8787)"
                )
    except (OSError, ValueError, asyncio.TimeoutError):
        pass
    finally:
        if writer is not None:
            writer.close()
    return None


#: A Dask server's greeting (its handshake, a few hundred bytes) is far below this.
_GREETING_MAX = 1 << 16

#: Seconds to wait for a server's greeting before speaking first, as a Dask client does.
_GREETING_WAIT = 0.5


def _client_handshake() -> bytes:
    """A Dask client's first message (its handshake) in the TCP framing: total length, frame
    count, frame lengths, frames."""
    import pickle
    import sys

    from distributed.protocol.core import dumps

    # What distributed's comm sends (Comm.handshake_info): a server missing any of these keys
    # logs "Your Dask versions may not be in sync" with its traceback.
    info = {
        "compression": None,
        "python": tuple(sys.version_info)[:3],
        "pickle-protocol": pickle.HIGHEST_PROTOCOL,
    }
    frames = [bytes(f) for f in dumps(info)]
    header = b"".join(n.to_bytes(8, "little") for n in (len(frames), *map(len, frames)))
    body = header + b"".join(frames)
    return len(body).to_bytes(8, "little") + body


async def _non_dask_greeting(address: str, timeout: float) -> str | None:
    """What the server at a ``tcp://`` ``address`` said on connecting (or, when it waits for the
    client, in answer to a Dask client's handshake), in words, if that is not a Dask greeting (a
    handshake message in Dask's framing); None if it is one, if nothing could be connected to or
    read, or for other protocols (TLS, UCX: not looked into)."""
    from distributed.protocol.core import loads

    scheme, sep, rest = address.rpartition("://")
    if sep and scheme != "tcp":
        return None
    host, _, port = rest.rpartition(":")
    writer = None
    data = b""
    try:
        reader, writer = await asyncio.wait_for(
            asyncio.open_connection(host.strip("[]") or "127.0.0.1", int(port)), timeout
        )
        spoke = False
        try:  # a Dask server greets at once (its handshake)
            data = await asyncio.wait_for(reader.read(8), min(timeout, _GREETING_WAIT))
        except asyncio.TimeoutError:  # a server that waits for the client: speak first
            writer.write(_client_handshake())
            await writer.drain()
            spoke = True
            data = await asyncio.wait_for(reader.read(8), min(timeout, 2.0))
        while 0 < len(data) < 8:
            more = await asyncio.wait_for(reader.read(8 - len(data)), timeout)
            if not more:
                break
            data += more
        if not data:
            return "closed the connection without sending anything"
        if len(data) < 8:
            return f"sent {data!r} and closed the connection"
        total = int.from_bytes(data, "little")
        if 16 <= total <= _GREETING_MAX:
            body = await asyncio.wait_for(reader.readexactly(total), timeout)
            data += body
            if _is_handshake(body, loads):
                if not spoke:  # answer it, so that the server logs no broken handshake
                    writer.write(_client_handshake())
                    await writer.drain()
                return None
        else:  # show what it sent
            try:
                data += await asyncio.wait_for(reader.read(64), min(timeout, 0.3))
            except asyncio.TimeoutError:
                pass
    except asyncio.IncompleteReadError as e:
        data += e.partial
        return f"sent {data[:48]!r}{'...' if len(data) > 48 else ''} and closed the connection"
    except (OSError, ValueError, asyncio.TimeoutError):
        if not data:
            return None
    finally:
        if writer is not None:
            writer.close()
    cut = "..." if len(data) > 48 else ""
    what = " (an HTTP server: a dashboard or a proxy?)" if data.startswith(b"HTTP/") else ""
    return f"answered {data[:48]!r}{cut}{what}"


def _is_handshake(body: bytes, loads: Any) -> bool:
    """Whether ``body`` (a message after its length) unpacks as Dask frames to a handshake."""
    try:
        n = int.from_bytes(body[:8], "little")
        if not 1 <= n <= 64 or 8 * (n + 1) > len(body):
            return False
        lengths = [int.from_bytes(body[8 * (i + 1) : 8 * (i + 2)], "little") for i in range(n)]
        start = 8 * (n + 1)
        if start + sum(lengths) != len(body):
            return False
        frames = []
        for length in lengths:
            frames.append(body[start : start + length])
            start += length
        msg = loads(frames, deserialize=False)
    except Exception:  # any garbage: not a greeting
        return False
    return isinstance(msg, dict) and "compression" in msg
