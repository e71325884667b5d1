# ruff: noqa  (a record of what ran on the H200 on 2026-12-01, kept as it ran)
"""Does cuda-python release the GIL in blocking calls? A 1 s %globaltimer spin kernel runs;
another thread calls the blocking function; the main thread counts loop turns meanwhile."""

import threading, time
import cupy
from cuda.bindings import runtime as rt

SRC = r"""extern "C" __global__ void spin(unsigned long long ns){unsigned long long s,n;
asm volatile("mov.u64 %0, %%globaltimer;":"=l"(s)); do{asm volatile("mov.u64 %0, %%globaltimer;":"=l"(n));}while(n-s<ns);}"""
k = cupy.RawKernel(SRC, "spin")
buf = cupy.zeros(1 << 20, cupy.uint8)
host = bytearray(1 << 20)
import ctypes

hbuf = (ctypes.c_char * (1 << 20)).from_buffer(host)
calls = {
    "cudaDeviceSynchronize": lambda: rt.cudaDeviceSynchronize(),
    "cudaStreamSynchronize(0)": lambda: rt.cudaStreamSynchronize(0),
    "cudaMemcpy D2H pageable": lambda: rt.cudaMemcpy(
        ctypes.addressof(hbuf), buf.data.ptr, 1 << 20, rt.cudaMemcpyKind.cudaMemcpyDeviceToHost
    ),
    "cudaMemset (legacy)": lambda: rt.cudaMemset(buf.data.ptr, 1, 1 << 20),
    "cudaEventSynchronize": None,
}
for name, fn in calls.items():
    if fn is None:
        _, ev = rt.cudaEventCreate()
    cupy.cuda.Device().synchronize()
    k((1,), (1,), (cupy.uint64(1_000_000_000),), stream=cupy.cuda.Stream.null)
    if fn is None:
        rt.cudaEventRecord(ev, 0)
        fn = lambda: rt.cudaEventSynchronize(ev)
    done = []
    t = threading.Thread(target=lambda: (fn(), done.append(time.perf_counter())))
    t0 = time.perf_counter()
    t.start()
    n = 0
    while not done and time.perf_counter() - t0 < 3:
        n += 1
    t.join()
    print(
        f"{name:28s} blocked {done[0] - t0 if done else -1:.2f} s; main thread turns meanwhile {n}",
        flush=True,
    )
