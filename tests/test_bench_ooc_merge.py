"""The GPU benches' turns end (bench/admission_ballast.py, shared by ooc_merge.py and
one_budget.py): a worker that never comes up fails the turn (on an H100 a LocalCUDACluster whose
pool did not fit came up with no worker, and the merge waited for ever), a merge not done in
``--round-timeout`` fails its round, and dask-cuda's pool leaves room for a worker's CUDA
context."""

from __future__ import annotations

import contextlib
import importlib.util
import time
from pathlib import Path

import pytest
from dask import delayed
from distributed import Client, LocalCluster

_spec = importlib.util.spec_from_file_location(
    "admission_ballast_bench",
    Path(__file__).resolve().parents[1] / "bench" / "admission_ballast.py",
)
assert _spec is not None and _spec.loader is not None
admission_ballast = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(admission_ballast)

GiB, MiB = 1 << 30, 1 << 20


@contextlib.contextmanager
def _one_worker(threads: int = 1, processes: bool = False):
    """(cluster, client) of a LocalCluster of one worker."""
    with (
        LocalCluster(
            n_workers=1, threads_per_worker=threads, processes=processes, dashboard_address=":0"
        ) as cluster,
        Client(cluster) as client,
    ):
        yield cluster, client


def test_a_cluster_whose_worker_never_comes_fails_the_turn_and_is_closed(monkeypatch):
    monkeypatch.setattr(admission_ballast, "WORKER_START_TIMEOUT", 1)
    cluster = LocalCluster(n_workers=0, processes=False, dashboard_address=":0")
    client = Client(cluster)
    with pytest.raises(RuntimeError, match="the worker did not start in 1 s"):
        admission_ballast._worker_up(cluster, client)
    assert client.status == "closed" and cluster.status.name == "closed"


def test_a_merge_not_done_in_time_fails_with_the_timeout_named():
    with _one_worker(threads=2) as (cluster, client):
        assert admission_ballast._worker_up(cluster, client) is client  # a worker: no wait
        with pytest.raises(TimeoutError, match=r"not done in 0\.3 s \(--round-timeout\)"):
            admission_ballast.computed(client, [delayed(time.sleep)(3)], 0.3)
        assert admission_ballast.computed(client, [delayed(sum)([1, 2])], 30) == [3]


@pytest.mark.parametrize(("free", "pool"), [(4 * GiB, 2560 * MiB), (8 * GiB, 5632 * MiB)])
def test_dask_cudas_pool_leaves_room_for_a_workers_context_and_kernels(free, pool):
    got = admission_ballast.dask_cuda_pool_size(free)
    assert got == pool and got % (256 * MiB) == 0
    # H100, 4 GiB left by the ballast: 3.49 GiB after a second process's context (3.5 GiB failed);
    # a 3 GiB pool left cuDF's kernels too little ("Failed to initialize CUDA context").
    assert got <= free - admission_ballast.CONTEXT_BYTES - 512 * MiB


def test_a_figure_read_from_a_stuck_worker_times_out(monkeypatch):
    # Client.run takes no timeout: a wedged worker stalled a GPU bench for 7 minutes.
    monkeypatch.setattr(admission_ballast, "CLOSE_TIMEOUT", 0.5)
    with _one_worker() as (cluster, client):
        assert admission_ballast.run_on_worker(client, lambda: 7) == {
            w: 7 for w in cluster.scheduler.workers
        }
        start = time.monotonic()
        with pytest.raises(TimeoutError):
            admission_ballast.run_on_worker(client, lambda: time.sleep(3))
        assert time.monotonic() - start < 2.5
        time.sleep(3)  # the sleeping run ends before the cluster closes


def test_a_stuck_turn_prints_the_stacks_of_the_bench_and_of_its_worker(monkeypatch, capfd):
    # A GPU bench waited 7 minutes after a failed warm-up with nothing said about where.
    monkeypatch.setattr(admission_ballast, "WORKER_START_TIMEOUT", 30)
    with _one_worker(processes=True) as (cluster, client):
        admission_ballast._worker_up(cluster, client)
        assert admission_ballast._worker_pids == [w.pid for w in cluster.scheduler.workers.values()]
        monkeypatch.setattr(admission_ballast, "WORKER_START_TIMEOUT", 0)
        monkeypatch.setattr(admission_ballast, "CLOSE_TIMEOUT", 0)
        admission_ballast.watch_turn(0.1)  # fires after 0.2 s
        time.sleep(3)
        err = capfd.readouterr().err
        assert "turn still going" in err
        assert err.count("Current thread") == 2, err[-3000:]  # the bench's timer, the worker


def test_a_turn_that_ends_in_time_prints_nothing(monkeypatch, capfd):
    monkeypatch.setattr(admission_ballast, "WORKER_START_TIMEOUT", 0)
    monkeypatch.setattr(admission_ballast, "CLOSE_TIMEOUT", 0)

    class Turn:
        name, times, failed_rounds, error = "t", [], 0, ""

        def stop(self):
            pass

    admission_ballast.watch_turn(0.25)  # would fire after 0.5 s
    admission_ballast.end_turn(Turn(), 0, True, 0.1)
    time.sleep(1)
    assert "turn still going" not in capfd.readouterr().err


class _Setup:
    def __init__(self, name):
        self.name, self.times, self.failed_rounds, self.error = name, [], 0, ""


def test_a_run_of_two_device_calls_goes_on_from_the_rounds_the_first_saved(tmp_path):
    # A device call has a time limit: >= 5 interleaved rounds may need two calls on one machine.
    path = str(tmp_path / "rounds.json")
    fields = ("name", "times", "failed_rounds", "error")
    first = [_Setup("a"), _Setup("b")]
    first[0].times, first[1].times, first[1].failed_rounds = [1.0, 2.0], [3.0], 1
    admission_ballast.save_rounds(path, "merge", first, fields)
    again = [_Setup("a"), _Setup("b")]
    assert admission_ballast.resume_rounds(path, "merge", again, fields) == 2
    assert again[0].times == [1.0, 2.0] and (again[1].times, again[1].failed_rounds) == ([3.0], 1)

    for ran, setups, why in [
        ("another", [_Setup("a"), _Setup("b")], "it ran 'merge'"),
        ("merge", [_Setup("a")], "its setups were"),
    ]:
        with pytest.raises(SystemExit, match=why):
            admission_ballast.resume_rounds(path, ran, setups, fields)
    first[1].times = []  # cut short inside a round: b has a round fewer than a
    admission_ballast.save_rounds(path, "merge", first, fields)
    with pytest.raises(SystemExit, match="cut short inside a round"):
        admission_ballast.resume_rounds(path, "merge", [_Setup("a"), _Setup("b")], fields)


def test_rounds_saved_on_another_card_are_not_resumed(tmp_path, monkeypatch):
    path = str(tmp_path / "rounds.json")
    monkeypatch.setattr(admission_ballast, "device_name", lambda: "NVIDIA H200")
    admission_ballast.save_rounds(path, "merge", [_Setup("a")], ("name", "times"))
    monkeypatch.setattr(admission_ballast, "device_name", lambda: "NVIDIA H100 80GB HBM3")
    with pytest.raises(SystemExit, match="its card was 'NVIDIA H200'"):
        admission_ballast.resume_rounds(path, "merge", [_Setup("a")], ("name", "times"))


def test_rounds_alternate_their_order_and_stop_before_the_budget_runs_out(capsys):
    got = [(r, list(order)) for r, order in admission_ballast.interleaved_rounds("ab", 1, 4, None)]
    assert got == [(1, ["b", "a"]), (2, ["a", "b"]), (3, ["b", "a"])]
    ran = []
    for r, _order in admission_ballast.interleaved_rounds("ab", 0, 5, 0.55):
        ran.append(r)
        time.sleep(0.2)  # rounds of 0.2 s: the second ends at 0.4 s, a third would at 0.6 s
    assert ran == [0, 1] and "stopped before round 2" in capsys.readouterr().err


def test_no_round_is_started_that_would_end_after_the_time_budget():
    started = time.monotonic() - 100
    assert not admission_ballast.out_of_time(started, None, [50.0])
    assert not admission_ballast.out_of_time(started, 120, [])
    assert not admission_ballast.out_of_time(started, 160, [50.0])
    assert admission_ballast.out_of_time(started, 140, [30.0, 50.0])
