# ruff: noqa  (a record of what ran on the H200 on 2026-12-01, kept as it ran)
"""Reproduce the per-thread-stream device-sync hang outside pytest.
mode A: the test's scenario (thread 1 spins on its ptds and exits; thread 2 allocates -> sync)
mode B: as A, but thread 1 stays alive until thread 2 has allocated
mode C: no dask_rmm: thread 1 launches the spin on its ptds and exits; thread 2 cudaDeviceSynchronize
Loops for SECS; a watchdog dumps this process's native stacks once if one step exceeds 8 s."""

import os, subprocess, sys, threading, time

sys.path.insert(0, "tests")
mode, secs = sys.argv[1], float(sys.argv[2])
from test_user_failures_streams import N, _suballocator, fill, spin_fill, read
from dask_rmm.stream import PER_THREAD_DEFAULT_STREAM as PT
from cuda.bindings import runtime as rt
import cupy

state = {"t": None, "what": ""}
dumped = []


def watchdog():
    while True:
        time.sleep(1)
        t = state["t"]
        if t is not None and time.monotonic() - t > 8 and not dumped:
            dumped.append(1)
            out = f"{os.environ.get('R', '.')}/stack.{mode}.{os.getpid()}"
            with open(out, "w") as f:
                f.write(f"stuck in {state['what']} for {time.monotonic() - t:.1f} s\n")
                f.flush()
                r = subprocess.run(
                    ["/tmp/pyspy/bin/py-spy", "dump", "--native", "--pid", str(os.getpid())],
                    stdout=f,
                    stderr=f,
                )
                if r.returncode:
                    subprocess.run(
                        ["gdb", "-p", str(os.getpid()), "-batch", "-ex", "thread apply all bt"],
                        stdout=f,
                        stderr=f,
                    )
            subprocess.run(f"nvidia-smi >> {out} 2>&1", shell=True)


threading.Thread(target=watchdog, daemon=True).start()


def step(what, fn):
    state["what"] = what
    state["t"] = time.monotonic()
    fn()
    dt = time.monotonic() - state["t"]
    state["t"] = None
    return dt


worst = 0.0
n = 0
t_end = time.monotonic() + secs
while time.monotonic() < t_end:
    res = _suballocator("pool") if mode != "C" else None
    got = {}
    gate = threading.Event()
    times = {}

    def first():
        if mode == "C":
            buf = cupy.empty(N, cupy.uint8)
            spin_fill(buf.data.ptr, N, 1, PT)
            got["buf"] = buf
            return
        p = res.allocate(N, PT)
        spin_fill(p, N, 1, PT)
        res.deallocate(p, N, PT)
        got["p"] = p
        if mode == "B":
            gate.wait()

    def second():
        if mode == "C":
            times["s"] = step("cudaDeviceSynchronize", lambda: rt.cudaDeviceSynchronize())
            return
        times["s"] = step("allocate", lambda: got.__setitem__("q", res.allocate(N, PT)))
        gate.set()
        fill(got["q"], N, 2, PT)

    t1 = threading.Thread(target=first)
    t1.start()
    if mode != "B":
        t1.join()
    t2 = threading.Thread(target=second)
    t2.start()
    t2.join()
    t1.join()
    if mode != "C":
        ok = set(read(got["q"], N)[:: 1 << 20].tolist()) == {2}
        if not ok:
            print("WRONG DATA", flush=True)
        res.deallocate(got["q"], N, PT)
    worst = max(worst, times["s"])
    n += 1
    del res
print(
    f"mode {mode} pid {os.getpid()}: {n} rounds, worst step {worst:.2f} s, dumped {bool(dumped)}",
    flush=True,
)
