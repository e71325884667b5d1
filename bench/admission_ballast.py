"""Make the device itself short: a separate process holds all of the device's free memory but
``--free-gib`` GiB, until it is stopped (or its parent exits), so that workloads are sized to
what is left and "out of memory" means the device, not a configured threshold.

    python bench/admission_ballast.py --free-gib 24        # holds until Ctrl-C
    python bench/admission_ballast.py --free-gib 24 --dry-run

From a bench script: ``with ballast(24): ...`` (prints what it took and what is left).
"""

from __future__ import annotations

import argparse
import contextlib
import faulthandler
import functools
import json
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

MiB, GiB = 1 << 20, 1 << 30
#: What a worker's CUDA context takes of the free memory the ballast leaves (H100 80 GB,
#: 2026-12-07: 4.0 GiB free, 3.49 GiB after a second process's context and CuPy).
CONTEXT_BYTES = 512 * MiB
#: Seconds a bench cluster's worker may take to come up; then the turn fails (a failed worker
#: start leaves a LocalCUDACluster with no worker, and every task would wait for ever).
WORKER_START_TIMEOUT = 90


def dask_cuda_pool_size(free: int) -> int:
    """The ``rmm_pool_size`` a dask-cuda user would give a worker with ``free`` device bytes:
    75 % of what its CUDA context leaves, in 256 MiB steps. A pool of all of it does not start
    (``Maximum pool size exceeded`` at worker start, H100, 2026-12-07); one of 90 % started but
    left too little for cuDF's kernels, loaded as they are first used (``Failed to initialize
    CUDA context``, ``invalid device ordinal`` in the first merge, H100, 2026-12-07, tenth
    session)."""
    return int((free - CONTEXT_BYTES) * 0.75) // (256 * MiB) * (256 * MiB)


def hold(free_gib: float) -> None:
    """In this process: take all but ``free_gib`` GiB of device 0, print ``ready <taken>``, wait
    until stdin closes (the parent went away) or a signal."""
    from dask_rmm import _cuda

    free, _total = _cuda.mem_get_info()
    take = max(int(free - free_gib * GiB), 0)
    ptr = _cuda.malloc(take) if take else 0
    print(f"ready {take}", flush=True)
    try:
        sys.stdin.read()  # returns when the parent closes the pipe
    except KeyboardInterrupt:
        pass
    if ptr:
        _cuda.free(ptr)


@contextlib.contextmanager
def ballast(free_gib: float | None, *, dry_run: bool = False) -> Iterator[int]:
    """Run :func:`hold` in a child process for the ``with`` block; yields the bytes it took
    (0 with ``free_gib`` None or ``dry_run``: nothing is taken)."""
    if free_gib is None or dry_run:
        yield 0
        return
    child = subprocess.Popen(
        [sys.executable, os.path.abspath(__file__), "--free-gib", str(free_gib), "--child"],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    assert child.stdout is not None and child.stdin is not None
    line = child.stdout.readline().split()
    if not line or line[0] != "ready":
        child.kill()
        raise RuntimeError(f"the ballast process did not start (it said {line!r})")
    taken = int(line[1])
    print(f"ballast: holding {taken / GiB:.1f} GiB, {free_gib} GiB left free", file=sys.stderr)
    try:
        yield taken
    finally:
        child.stdin.close()
        try:
            child.wait(10)
        except subprocess.TimeoutExpired:
            child.send_signal(signal.SIGKILL)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--free-gib", type=float, required=True, help="GiB of the device left free")
    p.add_argument("--dry-run", action="store_true", help="parse, take nothing, exit")
    p.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.dry_run:
        print(f"would leave {args.free_gib} GiB of device 0 free")
        return
    if args.child:
        hold(args.free_gib)
        return
    with ballast(args.free_gib):
        try:
            while True:
                time.sleep(3600)
        except KeyboardInterrupt:
            pass


if __name__ == "__main__":
    main()


def client_context_first(use_cudf: bool) -> None:
    """With cuDF: make this (the client's) process's CUDA context and a first cuDF buffer now,
    before the ballast measures what is free. dask_cudf's meta is made in the client, and the
    context that takes (about 0.5 GiB) must not come out of what the ballast leaves the
    workers."""
    if use_cudf:
        import cudf

        cudf.DataFrame({"a": [1]})


def one_worker_cluster(kind: str, threads: int, options: dict, env: dict | None = None) -> Any:
    """(cluster, client) of one worker with ``threads`` threads: dask-cuda's LocalCUDACluster
    with ``options`` (kind "dask-cuda" or "cudf-spill"), or a LocalCluster with
    ``RMMPlugin(**options)`` registered (kind "dask-rmm")."""
    from distributed import Client, LocalCluster

    if kind == "dask-rmm":
        from dask_rmm import RMMPlugin

        cluster = LocalCluster(
            n_workers=1, threads_per_worker=threads, processes=True, host="127.0.0.1",
            dashboard_address=":0", worker_dashboard_address=None, env=env or {},
        )  # fmt: skip
        client = _worker_up(cluster, Client(cluster))
        client.register_plugin(RMMPlugin(**options))
        return cluster, client
    from dask_cuda import LocalCUDACluster

    cluster = LocalCUDACluster(
        n_workers=1, threads_per_worker=threads, host="127.0.0.1", dashboard_address=":0",
        **options,
    )  # fmt: skip
    if options.get("enable_cudf_spill"):
        # LocalCUDACluster turns cuDF's spilling on in this (the client's) process too; a
        # client that spills sends spillable buffers (dask_cudf's meta) that a later setup's
        # worker without spilling cannot take ("cannot create SpillableBufferOwner without a
        # global spill manager": the worker died, H100, 2026-12-07).
        import cudf

        cudf.set_option("spill", False)
    return cluster, _worker_up(cluster, Client(cluster))


#: Seconds a bench waits for a cluster to close, or for a figure read from its worker.
CLOSE_TIMEOUT = 30


def close_cluster(cluster: Any, client: Any) -> None:
    """Close ``client`` and ``cluster``, each within :data:`CLOSE_TIMEOUT` seconds: a wedged
    worker must not stall the bench (one did for 7 minutes after a failed warm-up, H100,
    2026-12-07)."""
    try:
        client.close(timeout=CLOSE_TIMEOUT)
    finally:
        cluster.close(timeout=CLOSE_TIMEOUT)


def run_on_worker(client: Any, function: Any) -> dict:
    """``client.run(function)``, or TimeoutError after :data:`CLOSE_TIMEOUT` seconds (a thread
    that waits: ``Client.run`` takes no timeout)."""
    import concurrent.futures

    pool = concurrent.futures.ThreadPoolExecutor(1)
    try:
        return pool.submit(client.run, function).result(CLOSE_TIMEOUT)
    finally:
        pool.shutdown(wait=False)


def _worker_up(cluster: Any, client: Any) -> Any:
    """``client`` once the cluster's worker is up (its stacks printed on SIGUSR1, see
    :func:`watch_turn`); else both closed and a RuntimeError."""
    try:
        client.wait_for_workers(1, timeout=WORKER_START_TIMEOUT)
        _worker_pids[:] = client.run(_stacks_on_signal).values()
    except Exception as e:
        close_cluster(cluster, client)
        raise RuntimeError(
            f"the worker did not start in {WORKER_START_TIMEOUT} s ({type(e).__name__}: {e})"
        ) from e
    return client


def computed(client: Any, collections: list, timeout: float) -> list:
    """``collections`` computed on the cluster, or TimeoutError after ``timeout`` seconds (the
    futures cancelled): a round whose tasks wait for a worker that never comes, or for memory,
    fails; the bench goes on."""
    from distributed import wait

    futures = client.compute(collections)
    try:
        wait(futures, timeout=timeout)
    except TimeoutError:
        client.cancel(futures)
        raise TimeoutError(f"not done in {timeout:g} s (--round-timeout)") from None
    return client.gather(futures)


@functools.cache
def device_name() -> str:
    """Device 0's name as nvidia-smi says it (no CUDA context made), or "no GPU"."""
    query = ["nvidia-smi", "--query-gpu=name", "--format=csv,noheader", "-i", "0"]
    try:
        out = subprocess.run(query, capture_output=True, text=True, timeout=30).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        out = ""
    return out or "no GPU"


def save_rounds(path: str | None, ran: str, setups: Sequence[Any], fields: Sequence[str]) -> None:
    """The setups' ``fields`` so far, what ``ran`` and on which card, as JSON in ``path`` (None:
    nothing)."""
    if path:
        rows = [{k: getattr(s, k) for k in fields} for s in setups]
        saved = {"ran": ran, "device": device_name(), "setups": rows}
        Path(path).write_text(json.dumps(saved, indent=1))


def resume_rounds(path: str, ran: str, setups: Sequence[Any], fields: Sequence[str]) -> int:
    """The rounds an earlier call saved in ``path`` (:func:`save_rounds`), put back into
    ``setups``: the next round to run. A device call has a time limit, so a run of >= 5 rounds
    may take two calls on one machine; a saved run of another workload, card or set of setups,
    or one cut short inside a round, is refused (SystemExit), as its times would not compare."""
    saved = json.loads(Path(path).read_text())
    rows = saved.get("setups") or []
    names, saved_names = [s.name for s in setups], [r.get("name") for r in rows]
    done = {len(r.get("times", [])) + r.get("failed_rounds", 0) for r in rows}
    problem = ""
    if saved.get("ran") != ran:
        problem = f"it ran {saved.get('ran')!r}, this run is {ran!r}"
    elif saved.get("device") != device_name():
        problem = f"its card was {saved.get('device')!r}, this one is {device_name()!r}"
    elif saved_names != names:
        problem = f"its setups were {saved_names}, these are {names}"
    elif len(done) != 1:
        problem = "it was cut short inside a round (its setups ran different numbers of rounds)"
    if problem:
        raise SystemExit(f"--resume {path}: {problem}; start a new run")
    for setup, row in zip(setups, rows, strict=True):
        for k in fields:
            if k in row and k != "name":
                setattr(setup, k, row[k])
    (start,) = done
    print(f"resumed {path}: {start} rounds of each setup done", file=sys.stderr)
    return start


def out_of_time(started: float, budget: float | None, round_seconds: list[float]) -> bool:
    """Whether another round, as long as the longest so far, would end after ``budget``
    seconds from ``started`` (time.monotonic()); never with no budget or no round yet."""
    if budget is None or not round_seconds:
        return False
    return time.monotonic() - started + max(round_seconds) > budget


def interleaved_rounds(
    setups: Sequence[Any], first: int, count: int, budget: float | None
) -> Iterator[tuple[int, Sequence[Any]]]:
    """``(round, setups in this round's order)`` for rounds ``first`` to ``count - 1``, the
    order reversed every other round; the caller runs the round before asking for the next. No
    round starts that would end after ``budget`` seconds (:func:`out_of_time`; printed)."""
    started, took = time.monotonic(), []
    for r in range(first, count):
        if out_of_time(started, budget, took):
            print(f"--time-budget: stopped before round {r}; --resume goes on", file=sys.stderr)
            return
        round_started = time.monotonic()
        yield r, setups if r % 2 == 0 else setups[::-1]
        took.append(time.monotonic() - round_started)


#: The pids of the current bench cluster's workers, whose stacks a stuck turn prints.
_worker_pids: list[int] = []
_watch: threading.Timer | None = None
_turn_started = 0.0  # time.monotonic() at the turn's watch_turn: a turn's whole cost


def _stacks_on_signal() -> int:
    """On a worker: print every thread's stack to stderr on SIGUSR1; the worker's pid."""
    faulthandler.register(signal.SIGUSR1, all_threads=True)
    return os.getpid()


def _print_stacks() -> None:
    print("turn still going: the stacks of the bench, then of its worker", file=sys.stderr)
    faulthandler.dump_traceback(all_threads=True)
    for pid in _worker_pids:
        with contextlib.suppress(OSError):
            os.kill(pid, signal.SIGUSR1)


def watch_turn(round_timeout: float, show_free: bool = False) -> None:
    """Print every thread's stack, in the bench and in its worker, if this turn is still going
    after it should have ended (worker start, warm-up and round, closing): where a stuck bench
    waits (one waited 7 minutes, H100, 2026-12-07). Cancelled by :func:`end_turn`. With
    ``show_free`` (this process has a CUDA context already), print the device's free memory
    first: what the turn before left (rounds failed only from the third on, H100, 2026-12-07)."""
    global _watch, _turn_started
    if show_free:
        from dask_rmm import _cuda

        print(f"  device free at the turn's start: {_cuda.mem_get_info()[0] / GiB:.2f} GiB")
    _turn_started = time.monotonic()
    limit = WORKER_START_TIMEOUT + 2 * round_timeout + 3 * CLOSE_TIMEOUT
    _watch = threading.Timer(limit, _print_stacks)
    _watch.daemon = True
    _watch.start()


def end_turn(setup: Any, r: int, ok: bool, took: float) -> None:
    """The end of ``setup``'s turn in round ``r``: its cluster closed (a failure to close is
    printed; the next turn starts a fresh one), the round counted (its time if ``ok``, else a
    failed round, ``setup.error`` saying why) and printed. ``setup`` has ``name``, ``times``,
    ``failed_rounds``, ``error`` and ``stop()``."""
    if _watch is not None:
        _watch.cancel()
    try:
        setup.stop()
    except Exception as e:
        print(f"  closing {setup.name}: {type(e).__name__}: {e}", file=sys.stderr)
    if ok:
        setup.times.append(took)
    else:
        setup.failed_rounds += 1
    outcome = "ok" if ok else "FAILED " + setup.error
    whole = f" (turn {time.monotonic() - _turn_started:.0f} s)" if _turn_started else ""
    print(f"round {r} {setup.name}: {took:.2f} s {outcome}{whole}", file=sys.stderr)
