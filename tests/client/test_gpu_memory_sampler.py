"""GPUMemorySampler: summing and averaging device series (no cluster), then end to end on a
LocalCluster of worker processes (host memory without a GPU): labels, peaks, the plot, and a
worker killed in the middle of a block."""

from __future__ import annotations

import os
import signal

import pytest
from conftest import HAS_GPU, hold, local_process_cluster, wait_until
from distributed import wait
from distributed.utils_test import gen_cluster

from dask_rmm.client.sampler import (
    DeviceSeries,
    GPUMemorySampler,
    GPUSamples,
    summed_series,
    time_mean,
)
from dask_rmm.plugin import RMMPlugin

MiB = 1 << 20


def test_summed_series_holds_each_devices_latest_value_and_drops_a_gone_one_after_its_last():
    a = [(1.0, 10), (3.0, 30)]
    b = [(2.0, 5), (4.0, 7)]
    assert summed_series([(a, False), (b, False)]) == [(1.0, 10), (2.0, 15), (3.0, 35), (4.0, 37)]
    total = summed_series([(a, True), (b, False)])
    assert total[:3] == [(1.0, 10), (2.0, 15), (3.0, 35)]
    assert total[3] == (pytest.approx(3.0 + 1e-6), 5)  # the dead worker's memory went with it
    assert total[-1] == (4.0, 7)


def test_time_mean_weights_each_value_by_how_long_it_held():
    assert time_mean([(0.0, 0), (1.0, 100)], stop=4.0) == pytest.approx(75.0)
    assert time_mean([(2.0, 8)]) == 8.0
    assert time_mean([]) == 0.0


def _two_device_block() -> GPUSamples:
    s = GPUSamples("run", start=100.0, stop=104.0)
    d0 = s.devices[("tcp://a:1", "0")] = DeviceSeries("tcp://a:1", "w0", "0")
    d1 = s.devices[("tcp://b:2", "0")] = DeviceSeries("tcp://b:2", "w1", "0")
    d0.add_used(
        [(99.0, 1, 1), (100.5, 10, 12), (101.5, 20, 40), (104.5, 0, 20), (105.0, 99, 99)],
        100.0,
        104.0,
    )
    d1.add_used([(101.0, 5, 5), (102.0, 0, 50)], 100.0, 104.0)
    d0.add_reserved(100.0, 64)
    d1.add_reserved(100.0, 64)
    d1.add_reserved(103.0, 128)
    return s


def test_a_blocks_peak_is_the_peak_of_the_summed_interval_maxima_within_its_start_and_stop():
    s = _two_device_block()
    assert [t for t, *_ in s.devices[("tcp://a:1", "0")].used] == [100.5, 101.5, 104.5]
    assert s.peak_used == 40 + 50
    assert s.peak_reserved == 64 + 128
    # used: 10 from 100.5, 15 from 101, 25 from 101.5, 20 from 102, 0 from the first sample
    # after the stop (kept: its interval maximum covers the block's end)
    assert s.mean_used == pytest.approx((10 * 0.5 + 15 * 0.5 + 25 * 0.5 + 20 * 2.5) / 4)
    assert s.workers_lost == []


def test_to_pandas_sums_per_label_or_keeps_each_worker_device_and_aligns_on_the_start():
    pd = pytest.importorskip("pandas")
    ms = GPUMemorySampler()
    ms.samples["run"] = _two_device_block()
    df = ms.to_pandas()
    assert list(df.columns) == ["run"]
    assert df["run"].max() == 25
    aligned = ms.to_pandas(align=True)
    assert aligned.index[0] == pd.Timedelta(seconds=0.5)
    per = ms.to_pandas(per_worker=True, measure="used_max")
    assert list(per.columns.get_level_values("device")) == ["a:1 (w0)/dev0", "b:2 (w1)/dev0"]
    assert per.max().tolist() == [40, 50]
    summary = ms.summary()
    assert summary.loc["run", "peak_used_bytes"] == 90
    assert summary.loc["run", "peak_reserved_bytes"] == 192
    with pytest.raises(ValueError, match="measure must be one of used, used_max, reserved"):
        ms.to_pandas(measure="free")


def test_sample_refuses_an_interval_that_is_not_a_positive_number():
    with pytest.raises(ValueError, match="interval must be a positive number of seconds, got 0"):
        GPUMemorySampler().sample("x", client=object(), interval=0)


def burst(nbytes: int) -> int:
    """Allocate and free: raises the peak within a sample interval, not the current bytes."""
    from dask_rmm import DeviceBuffer

    b = DeviceBuffer(size=nbytes)
    del b
    return nbytes


@gen_cluster(client=True, nthreads=[("127.0.0.1", 1)])
async def test_async_with_an_asynchronous_client_samples_the_block(c, s, a):
    await c.register_plugin(RMMPlugin(base_resource="system", pool_size="8MiB"))
    ms = GPUMemorySampler()
    async with ms.sample("async", client=c, interval=0.05):
        assert await c.submit(burst, 6 * MiB, pure=False) == 6 * MiB
    samples = ms.samples["async"]
    assert samples.stop is not None
    assert samples.peak_used >= 6 * MiB
    assert samples.peak_reserved >= 8 * MiB


@pytest.fixture(scope="module")
def cluster():
    with local_process_cluster() as (cluster, client):
        client.register_plugin(
            RMMPlugin(base_resource="cuda" if HAS_GPU else "system", pool_size="32MiB")
        )
        yield cluster, client


@pytest.mark.slow
def test_two_labels_sampled_on_a_local_cluster_show_their_own_peaks_on_one_plot(cluster, tmp_path):
    cluster, client = cluster
    ms = GPUMemorySampler()
    with ms.sample("small", interval=0.2):
        wait(client.map(burst, [4 * MiB, 4 * MiB], pure=False))
    with ms.sample("large", interval=0.2):
        wait(client.map(burst, [24 * MiB, 24 * MiB], pure=False))
    small, large = ms.samples["small"], ms.samples["large"]
    assert len(small.devices) == len(large.devices) == 2
    assert 4 * MiB <= small.peak_used < 24 * MiB
    assert 24 * MiB <= large.peak_used <= 48 * MiB
    # two pools of 32 MiB, grown by the 24 MiB bursts beyond the initial chunk
    assert small.peak_reserved >= 64 * MiB
    assert large.peak_reserved > small.peak_reserved - 1
    df = ms.to_pandas(align=True, measure="used_max")
    assert list(df.columns) == ["small", "large"]
    ax = ms.plot(align=True, measure="used_max", path=str(tmp_path / "sampler.png"))
    assert [line.get_label() for line in ax.get_lines()] == ["small", "large"]
    assert (tmp_path / "sampler.png").stat().st_size > 10_000


@pytest.mark.slow
def test_what_was_sampled_of_a_worker_killed_mid_block_stays_after_its_restart(cluster):
    cluster, client = cluster
    info = client.scheduler_info()["workers"]
    victim, name = sorted((a, w["name"]) for a, w in info.items())[0]
    ms = GPUMemorySampler()
    with ms.sample("killed", interval=0.2):
        held = client.map(hold, [3 * MiB], workers=[victim], pure=False)
        wait(held)
        wait_until(
            lambda: any(
                d.worker == victim and any(s[1] >= 3 * MiB for s in d.used)
                for d in list(ms.samples["killed"].devices.values())
            ),
            what="the victim's held bytes in the sampler, while the block runs",
        )
        pid = client.run(os.getpid, workers=[victim])[victim]
        os.kill(pid, signal.SIGKILL)
        wait_until(
            lambda: any(
                w["name"] == name and a != victim
                for a, w in client.scheduler_info()["workers"].items()
            ),
            60,
            "the nanny's restart of the killed worker",
        )
        wait(client.map(burst, [2 * MiB], pure=False))
    s = ms.samples["killed"]
    dead = s.devices[(victim, "0")]
    assert dead.status == "gone"
    assert max(v for _, v, _ in dead.used) == 3 * MiB
    assert victim in s.workers_lost
    assert s.peak_used >= 3 * MiB
    # after the kill its bytes are no longer counted in the cluster's sum
    assert s.summed("used")[-1][1] < 3 * MiB


def _block_without_samples(label: str) -> GPUSamples:
    s = GPUSamples(label, start=100.0, stop=104.0)
    s.devices[("tcp://a:1", "0")] = DeviceSeries("tcp://a:1", "w0", "0")  # seen, never sampled
    return s


@pytest.mark.parametrize("blocks", [[], ["run"], ["first", "second"]])
@pytest.mark.parametrize("measure", ["used", "used_max", "reserved"])
@pytest.mark.parametrize("per_worker", [False, True])
def test_plotting_a_sampler_with_nothing_sampled_says_so_and_writes_nothing(
    tmp_path, blocks, measure, per_worker
):
    pytest.importorskip("pandas")
    pytest.importorskip("matplotlib")
    ms = GPUMemorySampler()
    for label in blocks:
        ms.samples[label] = _block_without_samples(label)
    path = tmp_path / "empty.png"
    what = "nothing sampled yet" if not blocks else f"no {measure!r} samples in {blocks[0]!r}"
    with pytest.raises(ValueError, match=what):
        ms.plot(path=str(path), measure=measure, per_worker=per_worker)
    assert not path.exists() and list(tmp_path.iterdir()) == []
