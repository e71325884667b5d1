"""Sizing advice: from logs of known workloads written here (one that fragments, one that does
not, which must get different answers), from cluster reports, through ``dask rmm advise``, and
from a live LocalCluster."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
from conftest import HAS_GPU, local_process_cluster
from distributed import wait

from dask_rmm.client.advice import (
    CANDIDATE_FACTORS,
    advise_from_logs,
    advise_from_report,
    combine,
    format_advice,
    nice_size,
    size_text,
)
from dask_rmm.logs import HEADER, Action, LogEvent, format_event
from dask_rmm.plugin import RMMPlugin
from dask_rmm.report.memory_report import ClusterMemoryReport

KiB, MiB, GiB = 1 << 10, 1 << 20, 1 << 30


class _Log:
    """Writes an RMM-format log of the calls made on it (made-up addresses, one thread)."""

    def __init__(self) -> None:
        self.rows: list[str] = [",".join(HEADER)]
        self.t = 12 * 3600.0
        self.next_ptr = 0x7F0000000000
        self.live: dict[int, int] = {}
        self.peak = self.current = 0

    def _row(self, action: Action, ptr: int, size: int) -> None:
        self.t += 1e-4
        self.rows.append(format_event(LogEvent(1, self.t, action, ptr, size, 0, 0, "", "")))

    def alloc(self, size: int) -> int:
        ptr, self.next_ptr = self.next_ptr, self.next_ptr + size + 4096
        self.live[ptr] = size
        self.current += size
        self.peak = max(self.peak, self.current)
        self._row(Action.ALLOCATE, ptr, size)
        return ptr

    def free(self, ptr: int) -> None:
        size = self.live.pop(ptr)
        self.current -= size
        self._row(Action.FREE, ptr, size)

    def write(self, path) -> str:
        path.write_text("\n".join(self.rows) + "\n")
        return str(path)


def steady_log(path) -> tuple[str, int]:
    """Rounds of four 1 MiB blocks allocated and freed: a pool of the peak serves it."""
    log = _Log()
    for _ in range(50):
        blocks = [log.alloc(MiB) for _ in range(4)]
        for b in blocks:
            log.free(b)
    return log.write(path), log.peak


def fragmenting_log(path) -> tuple[str, int]:
    """Small blocks kept between large ones that are freed, then requests larger than any hole:
    the pool must hold far more than the bytes ever in use at once."""
    log = _Log()
    large = []
    for _ in range(64):
        log.alloc(64 * KiB)  # kept to the end
        large.append(log.alloc(MiB))
    for b in large:
        log.free(b)
    for b in [log.alloc(2 * MiB) for _ in range(16)]:
        log.free(b)
    return log.write(path), log.peak


def test_nice_sizes_round_up_by_at_most_an_eighth_and_print_back_exactly():
    assert nice_size(4 * MiB + 1) == 4 * MiB + 512 * KiB
    for n in (1, 3 * MiB + 7, 100 * MiB, 17 * GiB + 1):
        assert n <= nice_size(n) <= max(n * 1.125, MiB)
    assert size_text(4 * GiB) == "4GiB" and size_text(1536 * MiB) == "1536MiB"


def test_a_workload_that_fragments_is_advised_otherwise_than_one_that_does_not(tmp_path):
    steady_path, steady_peak = steady_log(tmp_path / "steady.csv")
    frag_path, frag_peak = fragmenting_log(tmp_path / "frag.csv")
    steady, frag = advise_from_logs([steady_path, frag_path], device_memory=GiB, gpu=False)

    assert steady.peak_bytes == steady_peak == 4 * MiB
    assert not steady.fragmenting and steady.allocator == "pool"
    first = (int(steady_peak * CANDIDATE_FACTORS[0]) + 255) & -256
    assert steady.required_pool_bytes == first  # the first candidate served it
    assert steady.pool_size == nice_size(first + steady_peak * 0.1)
    assert "1.06x its peak in use" in steady.reasons["allocator"]

    assert frag.peak_bytes == frag_peak == 64 * (64 * KiB + MiB)
    assert frag.fragmenting and frag.allocator == "async"
    assert frag.required_pool_bytes >= 1.25 * frag_peak
    assert [r["new_failures"] > 0 for r in frag.replays][-1] is False
    assert any(r["new_failures"] for r in frag.replays)  # smaller candidates failed
    assert "fragmentation" in frag.reasons["allocator"]
    assert frag.plugin_args()["async_alloc"] is True
    assert "--rmm-async" in frag.worker_flags()

    for a in (steady, frag):
        assert a.maximum_pool_size == int(GiB * 0.9) // MiB * MiB
        assert "90% of the device (1.00 GiB)" in a.reasons["maximum_pool_size"]


def test_on_host_memory_a_fragmenting_workload_gets_a_pool_of_the_size_it_needs(tmp_path):
    frag_path, peak = fragmenting_log(tmp_path / "frag.csv")
    [a] = advise_from_logs(frag_path, on_device=False, gpu=False)
    assert a.allocator == "pool" and a.fragmenting
    assert a.pool_size >= a.required_pool_bytes >= 1.25 * peak
    assert a.maximum_pool_size is None
    assert "device's size is unknown" in a.reasons["maximum_pool_size"]
    assert (
        a.plugin_call()
        == f"RMMPlugin(pool_size={size_text(a.pool_size)!r}, base_resource='system')"
    )


def _device(**fields) -> dict:
    return {
        "gpu_name": "NVIDIA H200",
        "device_total_bytes": 80 * GiB,
        "reserved_bytes": 8 * GiB,
        **fields,
    }


def test_advice_from_a_report_reads_fragmentation_from_oom_verdicts_and_free_pieces():
    report = ClusterMemoryReport.from_dict(
        {
            "workers": [
                {"address": "tcp://a:1", "devices": {"0": _device(peak_bytes=6 * GiB)}},
                {
                    "address": "tcp://b:2",
                    "devices": {
                        "0": _device(
                            peak_bytes=6 * GiB,
                            oom_events=[{"verdict": "fragmentation", "time": 1.0}],
                        )
                    },
                },
                {
                    "address": "tcp://c:3",
                    "devices": {
                        "0": _device(
                            peak_bytes=2 * GiB,
                            pool_free_bytes=4 * GiB,
                            largest_free_block=GiB,
                        )
                    },
                },
            ]
        }
    )
    a, b, c = advise_from_report(report)
    assert (a.allocator, b.allocator, c.allocator) == ("pool", "async", "async")
    assert a.pool_size == nice_size(6 * GiB * 1.1)
    assert "verdict 'fragmentation'" in b.reasons["allocator"]
    assert "fragmentation 75%" in c.reasons["allocator"]
    assert a.maximum_pool_size == 72 * GiB
    every = combine([a, b, c])
    assert every.allocator == "async" and every.pool_size == max(x.pool_size for x in (a, b, c))
    text = format_advice([a, b, c])
    assert text.count("paste: RMMPlugin(") == 4
    assert "all 3 worker devices" in text


def test_a_pool_that_takes_the_device_has_no_room_to_grow_and_points_at_spilling():
    report = ClusterMemoryReport.from_dict(
        {"workers": [{"address": "tcp://a:1", "devices": {"0": _device(peak_bytes=70 * GiB)}}]}
    )
    (a,) = advise_from_report(report)
    assert a.maximum_pool_size == a.pool_size == nice_size(70 * GiB * 1.1)
    assert "no room to grow" in a.reasons["maximum_pool_size"]
    assert "device_memory_limit= and spill_on_oom=True" in a.reasons["maximum_pool_size"]


def _cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "dask_rmm.cli", "advise", *args],
        capture_output=True,
        text=True,
        timeout=120,
    )


def test_dask_rmm_advise_logs_prints_each_number_with_its_reason_and_what_to_paste(tmp_path):
    steady, _ = steady_log(tmp_path / "steady.csv")
    frag, _ = fragmenting_log(tmp_path / "frag.csv")
    out = _cli("--logs", steady, frag, "--device-memory", "1GiB")
    assert out.returncode == 0, out.stderr
    assert "steady: peak 4.00 MiB in use, device 1.00 GiB" in out.stdout
    assert out.stdout.count("paste: RMMPlugin(") == 3
    assert "--rmm-async" in out.stdout
    doc = json.loads(_cli("--logs", steady, frag, "--json").stdout)
    assert [d["allocator"] for d in doc["devices"]] == ["pool", "async"]
    assert doc["all"]["allocator"] == "async"
    bad = _cli(str(tmp_path / "nope.csv"), "--logs")
    assert bad.returncode == 2 and "no such log file" in bad.stderr
    usage = _cli("--device-memory", "1GiB", "tcp://127.0.0.1:1")
    assert usage.returncode == 2 and "go with --logs" in usage.stderr


def burst(nbytes: int) -> int:
    from dask_rmm import DeviceBuffer

    b = DeviceBuffer(size=nbytes)
    del b
    return nbytes


@pytest.mark.slow
def test_dask_rmm_advise_on_a_live_cluster_sizes_the_pool_from_the_observed_peak():
    with local_process_cluster() as (cluster, client):
        client.register_plugin(
            RMMPlugin(base_resource="cuda" if HAS_GPU else "system", pool_size="16MiB")
        )
        wait(client.map(burst, [40 * MiB, 40 * MiB], pure=False))
        client.run(_beat)
        out = _cli(cluster.scheduler_address, "--json", "--timeout", "20")
    assert out.returncode == 0, out.stderr
    doc = json.loads(out.stdout)
    assert len(doc["devices"]) == 2
    for d in doc["devices"]:
        assert d["peak_bytes"] >= 40 * MiB
        assert d["pool_size"] >= 44 * MiB
        assert d["allocator"] == "pool"
    assert doc["all"]["plugin_call"].startswith("RMMPlugin(pool_size=")


async def _beat(dask_worker=None) -> None:
    await dask_worker.heartbeat()


def _host_report() -> ClusterMemoryReport:
    host = {"gpu_name": "host", "device_total_bytes": 0, "reserved_bytes": 64 * MiB}
    return ClusterMemoryReport.from_dict(
        {
            "workers": [
                {"address": "tcp://a:1", "devices": {"0": {**host, "peak_bytes": 40 * MiB}}},
                {"address": "tcp://b:2", "devices": {"0": {**host, "peak_bytes": 20 * MiB}}},
            ]
        }
    )


def _host_advices(kind: str, tmp_path):
    if kind == "logs":
        steady, _ = steady_log(tmp_path / "steady.csv")
        frag, _ = fragmenting_log(tmp_path / "frag.csv")
        advices = advise_from_logs([steady, frag], on_device=False, gpu=False)
    else:
        advices = advise_from_report(_host_report())
    return [*advices, combine(advices)]


@pytest.mark.parametrize("kind", ["logs", "report"])
def test_host_memory_advice_pastes_a_setup_that_builds_on_host_memory(kind, tmp_path):
    import shlex

    from dask_rmm.preload import dask_setup, plugin_from_flags
    from dask_rmm.stack.build import build_stack

    for a in _host_advices(kind, tmp_path):
        assert "base_resource='system'" in a.plugin_call()
        assert "--rmm-base-resource system" in a.worker_flags()
        pasted = eval(a.plugin_call(), {"RMMPlugin": RMMPlugin})
        with dask_setup.make_context("preload", shlex.split(a.worker_flags())) as ctx:
            flagged = plugin_from_flags(**ctx.params)
        for plugin in (pasted, flagged):
            assert plugin.options.base_resource == "system"
            assert plugin.options.pool_size == a.pool_size
            stack = build_stack(plugin.options, 0)  # what a worker builds: works without a GPU
            assert stack.host_memory and stack.chain.endswith("SystemMemoryResource")
            assert stack.pool_size == a.pool_size
        assert a.to_dict()["base_resource"] == "system"


def test_gpu_advice_pastes_no_base_resource():
    [a] = advise_from_report(
        ClusterMemoryReport.from_dict(
            {"workers": [{"address": "tcp://a:1", "devices": {"0": _device(peak_bytes=GiB)}}]}
        )
    )
    assert a.base_resource is None
    assert "base_resource" not in a.plugin_call() and "base-resource" not in a.worker_flags()


def test_combined_advice_of_host_and_gpu_workers_says_to_set_them_apart():
    [gpu] = advise_from_report(
        ClusterMemoryReport.from_dict(
            {"workers": [{"address": "tcp://a:1", "devices": {"0": _device(peak_bytes=GiB)}}]}
        )
    )
    host = advise_from_report(_host_report())[0]
    every = combine([gpu, host])
    assert every.base_resource is None
    assert any("--rmm-base-resource system on the host-memory ones" in n for n in every.notes)


def test_dask_rmm_advise_logs_on_host_memory_prints_the_host_memory_setup(tmp_path):
    steady, _ = steady_log(tmp_path / "steady.csv")
    out = _cli("--logs", steady, "--host-memory")
    assert out.returncode == 0, out.stderr
    assert "base_resource='system'" in out.stdout
    assert "--rmm-base-resource system" in out.stdout


def test_advise_logs_progress_goes_to_stderr(tmp_path):
    from click.testing import CliRunner

    from dask_rmm.cli import main

    steady, _ = steady_log(tmp_path / "steady.csv")
    r = CliRunner().invoke(
        main, ["advise", "--logs", steady, "--host-memory", "--json", "--progress"]
    )
    assert r.exit_code == 0, r.output
    assert "reading logs" in r.stderr and "replay pool" in r.stderr
    json.loads(r.stdout)  # the bar never reaches stdout
    quiet = CliRunner().invoke(main, ["advise", "--logs", steady, "--host-memory", "--no-progress"])
    assert "replay pool" not in quiet.stderr


@pytest.mark.parametrize("largest", [GiB, 2 * GiB, 4 * GiB])
def test_advice_does_not_act_on_the_free_chunks_of_an_idle_pool(largest):
    idle = _device(peak_bytes=GiB, reserved_bytes=8 * GiB, pool_free_bytes=8 * GiB)
    idle["largest_free_block"] = largest
    [a] = advise_from_report(
        ClusterMemoryReport.from_dict(
            {"workers": [{"address": "tcp://a:1", "devices": {"0": idle}}]}
        )
    )
    assert a.allocator == "pool" and not a.fragmenting
    assert "none of the pool in use now" in a.reasons["allocator"]
    assert "%" not in a.reasons["allocator"]
