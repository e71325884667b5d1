# ruff: noqa  (a record of what ran on the H200 on 2026-12-01, kept as it ran)
"""pytest plugin (-p hangwatch, PYTHONPATH=gpu): when one test has run > 25 s, dump this
process's native stacks (gdb, all threads) and Python stacks (py-spy), then probe whether the
legacy default stream still drains (event record + query, from a helper thread)."""

import os, subprocess, sys, threading, time
import pytest

_cur = {"t": None, "name": None, "dumped": set()}
R = os.environ.get("R", ".")


def _probe(out):
    try:
        from cuda.bindings import runtime as rt

        err, ev = rt.cudaEventCreate()
        out.write(f"eventCreate {err}\n")
        out.flush()
        out.write(f"eventRecord(legacy) {rt.cudaEventRecord(ev, 0)}\n")
        out.flush()
        for i in range(5):
            out.write(f"eventQuery t+{i}s {rt.cudaEventQuery(ev)}\n")
            out.flush()
            time.sleep(1)
        err, ev2 = rt.cudaEventCreate()
        out.write(
            f"eventRecord(ptds of watchdog) {rt.cudaEventRecord(ev2, 2)} query {rt.cudaEventQuery(ev2)}\n"
        )
        out.write(f"memGetInfo {rt.cudaMemGetInfo()}\n")
        out.flush()
    except Exception as e:  # noqa
        out.write(f"probe error {e!r}\n")


def _watch():
    while True:
        time.sleep(2)
        t, name = _cur["t"], _cur["name"]
        if t is None or time.monotonic() - t < 25 or name in _cur["dumped"]:
            continue
        _cur["dumped"].add(name)
        path = f"{R}/hang.{os.getpid()}.txt"
        with open(path, "a") as f:
            f.write(f"=== {name} running {time.monotonic() - t:.0f} s, pid {os.getpid()}\n")
            f.flush()
            for tid in sorted(os.listdir("/proc/self/task")):
                try:
                    d = f"/proc/self/task/{tid}"
                    comm = open(f"{d}/comm").read().strip()
                    wchan = open(f"{d}/wchan").read().strip()
                    st = open(f"{d}/stat").read().split(")")[1].split()[0]
                    f.write(f"tid {tid} {comm!r} state {st} wchan {wchan}\n")
                except Exception as e:  # noqa
                    f.write(f"tid {tid}: {e!r}\n")
            f.flush()
            for what, cmd, lim in (
                (
                    "py-spy",
                    ["/tmp/pyspy/bin/py-spy", "dump", "--native", "--pid", str(os.getpid())],
                    40,
                ),
                ("probe", None, 0),
                (
                    "gdb",
                    [
                        "gdb",
                        "-p",
                        str(os.getpid()),
                        "-batch",
                        "-ex",
                        "set auto-solib-add off",
                        "-ex",
                        "info threads",
                        "-ex",
                        "thread apply all bt 25",
                    ],
                    60,
                ),
            ):
                f.write(f"=== {what}\n")
                f.flush()
                try:
                    if cmd is None:
                        th = threading.Thread(target=_probe, args=(f,), daemon=True)
                        th.start()
                        th.join(12)
                        f.write(f"probe thread alive after 12 s: {th.is_alive()}\n")
                    else:
                        subprocess.run(cmd, stdout=f, stderr=subprocess.STDOUT, timeout=lim)
                except Exception as e:  # noqa
                    f.write(f"{what} failed: {e!r}\n")
                f.flush()


threading.Thread(target=_watch, daemon=True, name="hangwatch").start()


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item, nextitem):
    _cur["name"], _cur["t"] = item.nodeid, time.monotonic()
    yield
    _cur["t"] = None
