"""Record one real dask-rmm heartbeat (``worker.metrics["dask-rmm"]``) of the dask-rmm on
PYTHONPATH, as msgpack (what the scheduler receives): the test data of the mixed-version tests.

    PYTHONPATH=<a dask-rmm checkout> python tests/scheduler/data/record_heartbeat.py OUT.msgpack
"""

import asyncio
import sys
import time

import msgpack


async def main(out: str) -> None:
    from distributed import Client, Scheduler, Worker

    from dask_rmm import RMMPlugin

    async with Scheduler(dashboard_address=":0", port=0) as s:
        async with Worker(s.address, nthreads=1, name="recorded-worker") as w:
            async with Client(s.address, asynchronous=True) as c:
                await c.register_plugin(RMMPlugin(pool_size="64MiB", base_resource="system"))

                def work() -> int:
                    from distributed import get_worker

                    from dask_rmm import DeviceBuffer

                    keep = [DeviceBuffer(size=1 << 20) for _ in range(3)]
                    time.sleep(0.3)
                    del keep[0]
                    time.sleep(0.3)
                    get_worker().recorded_buffers = keep  # 2 MiB held at the heartbeat
                    return len(keep)

                await c.submit(work, key="work-1")
                metrics = w.metrics["dask-rmm"]
                metrics(w)
                await asyncio.sleep(0.5)
                beat = metrics(w)
    with open(out, "wb") as f:
        f.write(msgpack.packb(beat, use_bin_type=True))
    print(
        out, beat["version"], {d: len(v.get("samples") or ()) for d, v in beat["devices"].items()}
    )


if __name__ == "__main__":
    asyncio.run(main(sys.argv[1]))
