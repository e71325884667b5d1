"""``dask rmm report`` against real ``dask scheduler`` / ``dask worker`` processes."""

from __future__ import annotations

import contextlib
import json
import os
import random
import re
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import pytest
from click.testing import CliRunner
from conftest import HAS_GPU
from distributed import Client, wait

from dask_rmm.cli import main

ROOT = Path(__file__).resolve().parents[2]
MiB = 1 << 20


def _env(**config: str) -> dict:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH")]))
    env.update({f"DASK_DASK_RMM__{k.upper()}": v for k, v in config.items()})
    return env


def _dask() -> list[str]:
    exe = shutil.which("dask", path=os.path.dirname(sys.executable))
    return [exe] if exe else [sys.executable, "-m", "dask"]


def _cli(*args: str, timeout: float = 60) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "dask_rmm.cli", "report", *args],
        capture_output=True,
        text=True,
        env=_env(),
        timeout=timeout,
        cwd=ROOT,
    )


def _start_scheduler(tmp_path: Path, name: str) -> tuple[subprocess.Popen, str, Path]:
    sched_file = tmp_path / f"{name}.json"
    proc = subprocess.Popen(
        [*_dask(), "scheduler", "--host", "127.0.0.1", "--port", "0", "--dashboard-address", ":0",
         "--scheduler-file", str(sched_file)],
        env=_env(), stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
    )  # fmt: skip
    deadline = time.monotonic() + 60
    while not sched_file.exists() or not sched_file.read_text().strip():
        if proc.poll() is not None or time.monotonic() > deadline:
            proc.kill()
            raise AssertionError("dask scheduler did not start")
        time.sleep(0.1)
    time.sleep(0.2)  # the file is written in one go, but give the writer a moment to close it
    return proc, json.loads(sched_file.read_text())["address"], sched_file


def _stop(*procs: subprocess.Popen) -> None:
    for p in procs:
        if p.poll() is None:
            p.terminate()
    for p in procs:
        try:
            p.wait(timeout=20)
        except subprocess.TimeoutExpired:
            p.kill()


@pytest.fixture(scope="module")
def rmm_cluster(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("cli")
    sched, address, sched_file = _start_scheduler(tmp, "scheduler")
    worker = subprocess.Popen(
        [*_dask(), "worker", "--scheduler-file", str(sched_file), "--nthreads", "1", "--no-dashboard",
         "--preload", "dask_rmm.preload"],
        env=_env(pool_size="32MiB", base_resource="cuda" if HAS_GPU else "system"), stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
    )  # fmt: skip
    try:
        with Client(address, timeout=30) as client:
            client.wait_for_workers(1, timeout=60)
            # DeviceBuffer itself is the task (the worker cannot import this test module).
            from dask_rmm import DeviceBuffer

            held = [client.submit(DeviceBuffer, size=n * MiB, key=f"hold-{n}") for n in (1, 2)]
            wait(held)
            # Results stay on the worker while these futures live; let a heartbeat carry them.
            deadline = time.monotonic() + 30
            while True:
                out = _cli(address, "--json")
                if (
                    out.returncode == 0
                    and json.loads(out.stdout)["totals"]["current_bytes"] == 3 * MiB
                ):
                    break
                assert time.monotonic() < deadline, out
                time.sleep(0.2)
            yield address, sched_file, tmp
    finally:
        _stop(worker, sched)


@pytest.mark.slow
def test_table(rmm_cluster):
    address, _, _ = rmm_cluster
    out = _cli(address)
    assert out.returncode == 0, out.stderr
    assert "dask-rmm cluster memory report" in out.stdout
    assert "hold" in out.stdout and "3.00 MiB" in out.stdout and "32.00 MiB" in out.stdout


@pytest.mark.slow
def test_json_and_scheduler_file(rmm_cluster):
    _, sched_file, _ = rmm_cluster
    out = _cli("--scheduler-file", str(sched_file), "--json", "--timelines")
    assert out.returncode == 0, out.stderr
    data = json.loads(out.stdout)
    (worker,) = data["workers"]
    dev = worker["devices"]["0"]
    assert dev["current_bytes"] == 3 * MiB and dev["reserved_bytes"] == 32 * MiB
    assert dev["timeline"]
    # Without --timelines: no per-device timeline, the cluster's peak all the same.
    bare = json.loads(_cli("--scheduler-file", str(sched_file), "--json").stdout)
    assert "timeline" not in bare["workers"][0]["devices"]["0"]
    assert bare["totals"]["peak_bytes"] >= 3 * MiB
    assert data["totals"]["workers"] == 1


@pytest.mark.slow
def test_plot_run_twice_replaces_its_own_output(rmm_cluster):
    address, _, tmp = rmm_cluster
    for _ in range(2):
        out = _cli(address, "--plot", str(tmp / "cli.png"))
        assert out.returncode == 0, out.stderr
        assert (tmp / "cli.png").read_bytes()[:4] == b"\x89PNG"
        assert f"wrote {tmp / 'cli.png'}" in out.stdout
    assert [p.name for p in tmp.iterdir() if "cli.png" in p.name] == ["cli.png"]


def test_plot_refuses_to_overwrite_the_scheduler_file(tmp_path):
    sched_file = tmp_path / "scheduler.json"
    sched_file.write_text(json.dumps({"address": "tcp://127.0.0.1:9"}))
    before = sched_file.read_bytes()
    r = CliRunner().invoke(
        main, ["report", "--scheduler-file", str(sched_file), "--plot", str(sched_file)]
    )
    assert r.exit_code == 2 and "it is also an input" in r.output, r.output
    assert sched_file.read_bytes() == before


def _default_sigint() -> None:
    """In the watcher's process before exec: Ctrl-C's default action. A test run started in the
    background by a shell (``pytest ... &``, nohup, CI wrappers) inherits SIGINT ignored, and an
    ignored signal stays ignored across exec: the watcher would never see the Ctrl-C."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)


def _interrupt(proc: subprocess.Popen, timeout: float = 30) -> None:
    """Ctrl-C a ``--watch`` process and check it ends cleanly, reading its output meanwhile (a
    watcher blocked on a full pipe could not act on the signal). If it does not end, its
    threads' stacks (faulthandler, on SIGABRT) go into the failure."""
    proc.send_signal(signal.SIGINT)
    try:
        _, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        proc.send_signal(signal.SIGABRT)
        _, err = proc.communicate(timeout=30)
        pytest.fail(f"still running {timeout:g} s after SIGINT; its stacks:\n{err[-8000:]}")
    assert proc.returncode == 0, err


@pytest.mark.slow
def test_watch_refreshes_until_interrupted(rmm_cluster):
    address, _, _ = rmm_cluster
    proc = subprocess.Popen(
        [sys.executable, "-m", "dask_rmm.cli", "report", address, "--watch", "0.2", "--json"],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env={**_env(), "PYTHONFAULTHANDLER": "1"}, cwd=ROOT, preexec_fn=_default_sigint,
    )  # fmt: skip
    # The scheduler serves one snapshot until a heartbeat brings news (scheduler/report_build),
    # so refreshes 0.2 s apart may repeat a report: read until a newer one comes (at most 50).
    with proc:  # closes the pipes
        lines = []
        while len(lines) < 3 or (lines[-1]["time"] == lines[0]["time"] and len(lines) < 50):
            line = proc.stdout.readline()
            assert line, proc.stderr.read()
            lines.append(json.loads(line))
        _interrupt(proc)
    assert lines[-1]["time"] > lines[0]["time"]


@pytest.mark.slow
def test_watch_shows_the_total_peak_like_the_one_shot_report(rmm_cluster):
    address, _, _ = rmm_cluster
    proc = subprocess.Popen(
        [sys.executable, "-m", "dask_rmm.cli", "report", address, "--watch", "0.2"],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env={**_env(), "PYTHONFAULTHANDLER": "1"}, cwd=ROOT, preexec_fn=_default_sigint,
    )  # fmt: skip
    with proc:  # closes the pipes
        totals = []
        while len(totals) < 2:
            line = proc.stdout.readline()
            assert line, proc.stderr.read()
            if line.startswith("total ("):
                totals.append(line)
        _interrupt(proc)
    one_shot = [r for r in _cli(address).stdout.splitlines() if r.startswith("total (")]
    # "total (1 worker)  1  3.00 MiB  3.00 MiB *": the peak is a size, as in the one-shot table.
    peak = re.compile(r"(\d+\.\d\d \w+) \*")
    assert peak.search(totals[-1]).group(1) == peak.search(one_shot[0]).group(1)


@pytest.mark.slow
def test_top_and_worker_filter_limit_the_rows_not_the_totals(rmm_cluster):
    address, _, _ = rmm_cluster
    none = json.loads(_cli(address, "--json", "--worker", "no-such-worker").stdout)
    assert none["workers"] == [] and none["totals"]["current_bytes"] == 3 * MiB
    assert "showing 0 of 0 devices" in none["selection"]
    top = _cli(address, "--top", "1", "--sort", "current")
    assert top.returncode == 0, top.stderr
    assert "3.00 MiB" in top.stdout
    assert _cli(address, "--top", "0").returncode == 2
    assert json.loads(_cli(address, "--json", "--top", str(10**20)).stdout)["totals"]["devices"]


@pytest.mark.slow
def test_unreachable_scheduler_fails_fast():
    start = time.monotonic()
    out = _cli("tcp://127.0.0.1:9", "--timeout", "1")
    assert out.returncode == 1
    assert "could not reach the Dask scheduler at tcp://127.0.0.1:9" in out.stderr
    assert time.monotonic() - start < 30


@pytest.mark.slow
def test_scheduler_without_dask_rmm_workers(tmp_path):
    sched, address, _ = _start_scheduler(tmp_path, "bare")
    try:
        out = _cli(address)
    finally:
        _stop(sched)
    assert out.returncode == 1
    assert "no dask-rmm workers on the scheduler at" in out.stderr


def test_address_or_scheduler_file_is_required(tmp_path):
    r = CliRunner().invoke(main, ["report"])
    assert r.exit_code == 2 and "SCHEDULER_ADDRESS or --scheduler-file" in r.output
    bad = tmp_path / "bad.json"
    bad.write_text("{}")
    r = CliRunner().invoke(main, ["report", "--scheduler-file", str(bad)])
    assert r.exit_code == 1 and "cannot read a scheduler address" in r.output


def test_negative_timeout_is_a_usage_error():
    r = CliRunner().invoke(main, ["report", "tcp://127.0.0.1:9", "--timeout", "-1"])
    assert r.exit_code == 2 and "--timeout" in r.output and "Traceback" not in r.output


def test_unreachable_scheduler_names_the_reason():
    out = _cli("tcp://127.0.0.1:9", "--timeout", "0.5")
    assert out.returncode == 1
    reason = out.stderr.split("tcp://127.0.0.1:9:", 1)[1].strip()
    assert reason  # used to be empty


def test_an_http_port_gets_a_hint():
    import asyncio
    import threading
    from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

    from dask_rmm.client.fetch import iter_reports

    server = ThreadingHTTPServer(("127.0.0.1", 0), BaseHTTPRequestHandler)
    threading.Thread(target=server.serve_forever, daemon=True).start()

    async def first():
        async for r in iter_reports(f"tcp://127.0.0.1:{server.server_port}", timeout=60):
            return r

    try:
        with pytest.raises(OSError, match="answers HTTP: that is a dashboard port"):
            asyncio.run(first())
    finally:
        server.shutdown()
        server.server_close()


def _peer(answer: bytes | None, *, greets: bool = True) -> tuple[int, Callable[[], None]]:
    """A TCP server on localhost that writes ``answer`` to every connection and closes it: at
    once (``greets``), or once the client spoke (a proxy, an HTTP server, a Redis-style
    service; None: nothing)."""
    import socket
    import threading

    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    sock.listen(16)

    def answer_one(conn: socket.socket) -> None:
        with conn, contextlib.suppress(OSError):
            if (greets or conn.recv(4096)) and answer is not None:
                conn.sendall(answer)

    def serve() -> None:
        while True:
            try:
                conn, _ = sock.accept()
            except OSError:  # closed: the test is over
                return
            threading.Thread(target=answer_one, args=(conn,), daemon=True).start()

    threading.Thread(target=serve, daemon=True).start()
    return sock.getsockname()[1], sock.close


@pytest.mark.parametrize(
    "payload",
    [
        b"HTTP/1.1 404 Not Found\r\n\r\n",
        b"HTTP/1.1 502 Bad Gateway\r\nContent-Length: 0\r\nConnection: close\r\n\r\n",
        b"",
        b"\x05\x00",
        random.Random(1).randbytes(64),
        random.Random(2).randbytes(4096),
        (40).to_bytes(8, "little") + random.Random(3).randbytes(40),  # framed garbage
        (1 << 62).to_bytes(8, "little"),  # a length of exabytes, then nothing
    ],
    ids=[
        "http-404",
        "proxy-502",
        "empty-close",
        "short",
        "random-64",
        "random-4k",
        "framed",
        "huge",
    ],
)
def test_an_address_that_does_not_speak_dask_is_one_line_and_exit_2(payload):
    port, close = _peer(payload)
    try:
        r = CliRunner().invoke(main, ["report", f"tcp://127.0.0.1:{port}", "--timeout", "5"])
    finally:
        close()
    assert r.exit_code == 2, (r.output, r.exception)
    lines = r.output.strip().splitlines()
    assert len(lines) == 1 and "does not speak Dask's protocol" in lines[0], r.output
    assert f"tcp://127.0.0.1:{port}" in lines[0]


def test_a_scheduler_is_recognised_as_dask_and_logs_no_error():
    """The address check completes Dask's handshake (distributed's connect): a partial one made
    the scheduler log "Your Dask versions may not be in sync" with two tracebacks."""
    import asyncio
    import logging

    from distributed import Scheduler
    from distributed.utils_test import captured_logger

    from dask_rmm.client.fetch import _check_address

    async def check() -> None:
        async with Scheduler(host="127.0.0.1", port=0, dashboard_address=":0") as s:
            await _check_address(s.address, {}, 5.0)
            await asyncio.sleep(0.5)  # the scheduler reads the handshake after we hung up

    # its own event loop, as the command's: after the CLI tests' asyncio.run loops, a
    # gen_cluster test here got a future of another loop from distributed's shared state
    with captured_logger("tornado.application", level=logging.WARNING) as tornado_log:
        with captured_logger("distributed", level=logging.WARNING) as distributed_log:
            asyncio.run(check())
    assert tornado_log.getvalue() == "" and distributed_log.getvalue() == ""


def _one_line_error(r, status: int) -> str:
    assert r.exit_code == status, (r.output, r.exception)
    assert "Traceback" not in r.output and "EiB" not in r.output, r.output
    lines = r.output.strip().splitlines()
    assert len(lines) == 1, r.output
    return lines[0]


@pytest.mark.parametrize("command", ["report", "advise"])
@pytest.mark.parametrize(
    "answer",
    [
        b"HTTP/1.1 400 Bad Request\r\nContent-Length: 0\r\nConnection: close\r\n\r\n",
        b"HTTP/1.1 404 Not Found\r\n\r\n",
        b"-ERR unknown command\r\n",
        b"+OK\r\n",
        b"\x00" * 3,
        (1 << 40).to_bytes(8, "little") + b"x" * 16,
        None,
    ],
    ids=["http-400", "http-404", "redis-err", "redis-ok", "short", "huge-length", "silent-close"],
)
def test_a_peer_that_waits_for_the_client_is_not_dask_in_one_line(command, answer):
    port, close = _peer(answer, greets=False)
    try:
        r = CliRunner().invoke(main, [command, f"tcp://127.0.0.1:{port}", "--timeout", "10"])
    finally:
        close()
    line = _one_line_error(r, 2)
    assert "does not speak Dask's protocol" in line and f"tcp://127.0.0.1:{port}" in line


@pytest.mark.parametrize("command", ["report", "advise"])
def test_a_peer_that_greets_first_is_not_dask_in_one_line_in_advise_too(command):
    port, close = _peer(b"-ERR greeting\r\n")
    try:
        r = CliRunner().invoke(main, [command, f"tcp://127.0.0.1:{port}", "--timeout", "10"])
    finally:
        close()
    assert "does not speak Dask's protocol" in _one_line_error(r, 2)


@pytest.mark.parametrize("command", ["report", "advise"])
@pytest.mark.parametrize(
    "address",
    ["tcp://127.0.0.1:70000", "tcp://127.0.0.1:0", "127.0.0.1:99999999", "tcp://127.0.0.1"],
)
def test_an_address_that_cannot_be_a_schedulers_is_one_line_and_exit_2(command, address):
    line = _one_line_error(CliRunner().invoke(main, [command, address]), 2)
    assert address in line and "is not a scheduler address" in line


@pytest.fixture
def loopback_only_resolver(monkeypatch):
    """Resolve loopback names only; any other name fails as an unknown host would, so that no
    query leaves the host. Returns the names asked for."""
    import socket

    asked: list[str] = []
    real = socket.getaddrinfo

    def getaddrinfo(host, *args, **kwargs):
        if host not in ("127.0.0.1", "localhost", "::1", None):
            asked.append(host)
            raise socket.gaierror(socket.EAI_NONAME, "Name or service not known")
        return real(host, *args, **kwargs)

    monkeypatch.setattr(socket, "getaddrinfo", getaddrinfo)
    return asked


@pytest.mark.parametrize("command", ["report", "advise"])
@pytest.mark.parametrize("host", ["nohost.invalid", "a.b.c.invalid", "NoHost.INVALID."])
def test_an_unresolvable_host_says_so_not_timed_out(command, host, loopback_only_resolver):
    line = _one_line_error(
        CliRunner().invoke(main, [command, f"tcp://{host}:8786", "--timeout", "30"]), 1
    )
    assert f"could not reach the Dask scheduler at tcp://{host}:8786" in line
    assert f"cannot resolve host {host!r}" in line and "imed out" not in line
    assert loopback_only_resolver == [host]  # asked once, of the fixture: no query left


@pytest.mark.parametrize("command", ["report", "advise"])
def test_a_closed_port_is_connection_refused(command):
    import socket

    with socket.socket() as sock:  # bound, never listening: the port stays closed and ours
        sock.bind(("127.0.0.1", 0))
        address = f"tcp://127.0.0.1:{sock.getsockname()[1]}"
        r = CliRunner().invoke(main, [command, address, "--timeout", "60"])
    line = _one_line_error(r, 1)
    assert f"could not reach the Dask scheduler at {address}: connection refused" in line


@pytest.mark.parametrize("command", ["report", "advise"])
@pytest.mark.parametrize(
    ("address", "says"),
    [
        ("ucx://127.0.0.1:8786", "no ucx:// transport (install distributed-ucxx"),
        ("tls://127.0.0.1:8786", "needs a TLS client configuration"),
        ("inproc://x", "reachable only inside its own process"),
        ("foo://127.0.0.1:8786", "no foo:// transport"),
    ],
)
def test_an_address_this_process_cannot_use_says_why_in_one_line(command, address, says):
    """No scheduler was reached: the line says what is wrong with the address, never "is
    dask-rmm installed on the scheduler?" (ucx, tls) or "not enough values to unpack" (inproc)."""
    line = _one_line_error(CliRunner().invoke(main, [command, address, "--timeout", "5"]), 2)
    assert address in line and says in line and "scheduler?" not in line, line


def test_a_plain_address_under_required_encryption_says_so_in_one_line():
    """distributed's connect raised a RuntimeError, worded "not in Dask's framing"."""
    import dask

    with dask.config.set({"distributed.comm.require-encryption": True}):
        r = CliRunner().invoke(main, ["report", "tcp://127.0.0.1:8786", "--timeout", "5"])
    line = _one_line_error(r, 2)
    assert "tcp://127.0.0.1:8786" in line and "requires encryption" in line, line


def test_the_timeout_is_the_whole_wait():
    """A peer that accepts and never answers: the command gives up after --timeout seconds in
    all, as its line says (it waited N + min(N, 0.5) + min(N, 2) s)."""
    import socket

    with socket.socket() as sock:  # listening, never accepting: the handshake gets no answer
        sock.bind(("127.0.0.1", 0))
        sock.listen(8)
        address = f"tcp://127.0.0.1:{sock.getsockname()[1]}"
        start = time.monotonic()
        r = CliRunner().invoke(main, ["report", address, "--timeout", "2"])
        waited = time.monotonic() - start
    assert "no answer within 2 s" in _one_line_error(r, 1)
    assert waited < 3.5, waited  # 2 s and the command's own work; it was 4.5 s and more


@pytest.mark.parametrize(
    "extra", [[], ["--plot", "x.png"], ["--watch", "1"], ["--top", "3"]], ids=str
)
def test_timelines_without_json_is_a_usage_error(extra):
    r = CliRunner().invoke(main, ["report", "tcp://127.0.0.1:9", "--timelines", *extra])
    assert r.exit_code == 2, r.output
    assert "--timelines goes with --json" in r.output and "Traceback" not in r.output
