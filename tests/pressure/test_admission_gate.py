"""The admission policy (Dask-free): what it learns per task prefix, and its rules: a prefix never
seen runs alone, at least one task always runs, tasks needing no memory never wait, tasks start
in order once their expected peak fits, and closing or dropping hands every waiting task back."""

from __future__ import annotations

import pytest

from dask_rmm.pressure.admission import NO_MEMORY, AdmissionGate, ExpectedPeaks

MiB = 1 << 20


class Gate:
    """An AdmissionGate over a made-up limit and bytes held, recording what started."""

    def __init__(self, limit: int = 100 * MiB, held: int = 0):
        self.limit, self.held = limit, held
        self.started: list[str] = []
        self.gate = AdmissionGate(lambda: self.limit, lambda: self.held)

    def request(self, key: str, given: int | None = None) -> bool:
        prefix = key.rsplit("-", 1)[0]
        return self.gate.request(key, prefix, given, lambda: self.started.append(key), key)

    def learn(self, prefix: str, peak: int) -> None:
        self.gate.peaks.observe(prefix, peak)


def test_the_expected_peak_is_a_high_quantile_of_the_last_peaks():
    peaks = ExpectedPeaks(quantile=0.9, history=10)
    assert peaks.expected("x") is None
    for i in range(1, 11):
        peaks.observe("x", i * MiB)
    assert peaks.expected("x") == 9 * MiB  # nearest rank: the 9th of 10
    for _ in range(10):  # only the last ``history`` count
        peaks.observe("x", MiB)
    assert peaks.expected("x") == MiB
    assert peaks.to_list() == [("x", MiB, 10)]
    with pytest.raises(ValueError, match="quantile"):
        ExpectedPeaks(quantile=0)


def test_tasks_start_while_their_expected_peaks_fit_then_as_others_finish():
    g = Gate(limit=100 * MiB)
    g.learn("big", 30 * MiB)
    assert [g.request(f"big-{i}") for i in range(5)] == [True, True, True, False, False]
    assert g.gate.metrics().held_tasks == 2
    g.gate.finished("big-0", peak=30 * MiB)
    assert g.started == ["big-0", "big-1", "big-2", "big-3"]
    # Bytes held (stored outputs, running tasks' arrays) count against the limit.
    g.held = 50 * MiB
    g.gate.finished("big-1", peak=30 * MiB)
    assert g.started == ["big-0", "big-1", "big-2", "big-3"]
    g.held = 0
    g.gate.finished("big-2", peak=30 * MiB)
    assert g.started[-1] == "big-4"
    assert g.gate.metrics().held_tasks == 0 and g.gate.metrics().total_held == 2


def test_what_running_tasks_already_hold_is_not_counted_twice():
    g = Gate(limit=100 * MiB)
    g.learn("big", 40 * MiB)
    assert g.request("big-0") and g.request("big-1")
    assert not g.request("big-2")  # 100 - 0 held - 80 to come < 40
    g.gate.accounts["big-0"][0] = 40 * MiB  # big-0 took its peak: it is in ``held`` now
    g.held = 40 * MiB
    g.gate.pump()
    assert "big-2" not in g.started  # 100 - 40 - 40 = 20 < 40
    g.gate.accounts["big-1"][0] = 40 * MiB
    g.held = 80 * MiB
    g.gate.pump()
    assert "big-2" not in g.started  # still 20 left
    g.gate.finished("big-0")
    g.held = 40 * MiB
    g.gate.pump()
    assert "big-2" in g.started


def test_a_prefix_never_seen_runs_alone_until_its_first_peak_is_known():
    g = Gate(limit=100 * MiB)
    g.learn("known", 10 * MiB)
    assert g.request("new-0")  # nothing runs: it starts
    assert not g.request("new-1")  # unknown: waits for new-0's peak
    assert not g.request("known-0")  # nothing that needs memory starts beside an unknown
    g.gate.finished("new-0", peak=20 * MiB)
    assert g.started == ["new-0", "new-1", "known-0"]  # 20 and 10 MiB fit together now
    assert g.gate.peaks.expected("new") == 20 * MiB


def test_an_unknown_prefix_waits_for_the_running_tasks_then_runs_alone():
    g = Gate(limit=100 * MiB)
    g.learn("known", 10 * MiB)
    assert g.request("known-0")
    assert not g.request("new-0")
    assert not g.request("known-1")  # in order: behind the unknown one
    g.gate.finished("known-0")
    assert g.started == ["known-0", "new-0"]


def test_at_least_one_task_always_runs_even_above_the_limit():
    g = Gate(limit=100 * MiB, held=90 * MiB)
    g.learn("huge", 150 * MiB)
    assert g.request("huge-0")  # nothing else runs: it runs (and may spill or fail)
    assert not g.request("huge-1")
    g.gate.finished("huge-0")
    assert g.started == ["huge-0", "huge-1"]
    # A broken counter holds nothing back forever either.
    g2 = AdmissionGate(lambda: 1 // 0, lambda: 0)
    g2.peaks.observe("x", 10 * MiB)
    assert g2.request("x-0", "x", None, lambda: None) and g2.request("x-1", "x", None, lambda: None)


def test_tasks_that_need_no_memory_are_never_held_back():
    g = Gate(limit=100 * MiB)
    g.learn("cpu", 0)
    g.learn("small", NO_MEMORY)
    g.learn("big", 60 * MiB)
    assert g.request("new-0")  # an unknown prefix runs
    assert not g.request("big-0")  # ... alone
    assert g.request("cpu-0") and g.request("small-0")  # but these never wait
    assert g.request("big-1", given=0)  # an annotation of 0 says the same
    g.gate.finished("new-0", peak=60 * MiB)
    assert g.started[-1] == "big-0"
    assert not g.request("big-2")  # 60 + 60 > 100
    assert g.request("cpu-1")  # behind a waiting task too


def test_an_annotated_peak_is_used_before_any_is_learned():
    g = Gate(limit=100 * MiB)
    assert g.request("load-0", given=40 * MiB)
    assert g.request("load-1", given=40 * MiB)  # known by annotation: not alone
    assert not g.request("load-2", given=40 * MiB)
    g.learn("load", 10 * MiB)
    assert not g.request("load-3", given=40 * MiB)  # the annotation wins over what is learned


def test_the_peak_observed_is_the_tasks_account_peak():
    g = Gate(limit=100 * MiB)
    assert g.request("f-0")
    account = g.gate.accounts["f-0"]
    account[:] = [5 * MiB, 12 * MiB]  # what the allocation path charges
    g.gate.finished("f-0")
    assert g.gate.peaks.expected("f") == 12 * MiB
    assert "f-0" not in g.gate.accounts


def test_close_starts_every_waiting_task_and_drop_hands_them_back():
    g = Gate(limit=100 * MiB)
    g.learn("big", 60 * MiB)
    assert g.request("big-0") and not g.request("big-1") and not g.request("big-2")
    assert g.gate.close() == ["big-1", "big-2"]
    assert g.started == ["big-0", "big-1", "big-2"]
    assert g.request("big-3")  # closed: nothing waits any more

    g = Gate(limit=100 * MiB)
    g.learn("big", 60 * MiB)
    assert g.request("big-0") and not g.request("big-1")
    assert g.gate.drop_waiting() == ["big-1"]  # the handle given with the request
    g.gate.finished("big-0")
    assert g.started == ["big-0"]  # dropped: never started


def test_a_withdrawn_task_no_longer_blocks_the_queue():
    g = Gate(limit=100 * MiB)
    g.learn("big", 60 * MiB)
    g.learn("mid", 30 * MiB)
    assert g.request("big-0") and not g.request("big-1") and not g.request("mid-0")
    g.gate.withdraw("big-1")
    assert g.started == ["big-0", "mid-0"]


def test_the_metrics_count_waits():
    g = Gate(limit=100 * MiB)
    g.learn("big", 60 * MiB)
    g.request("big-0")
    g.request("big-1")
    m = g.gate.metrics()
    assert m.held_tasks == 1 and m.total_held == 1 and m.admitted == 1
    assert m.longest_wait_seconds <= m.wait_seconds
    assert m.expected_peaks == (("big", 60 * MiB, 1),)
    assert m.limit == 100 * MiB
    g.gate.finished("big-0")
    m = g.gate.metrics()
    assert m.held_tasks == 0 and m.admitted == 2
    assert m.to_dict()["expected_peaks"] == [["big", 60 * MiB, 2]]


def test_admit_now_starts_only_what_request_would_start_at_once():
    g = Gate(limit=100 * MiB)
    g.learn("big", 60 * MiB)
    g.learn("cpu", 0)
    assert g.gate.admit_now("big-0", "big", None)
    assert not g.gate.admit_now("big-1", "big", None)  # changes nothing: not queued
    assert g.gate.metrics().held_tasks == 0 and g.gate.running_keys() == ["big-0"]
    assert not g.request("big-1")
    assert g.gate.admit_now("cpu-0", "cpu", None)  # needs no memory: also past a waiting one
    assert not g.gate.admit_now("new-0", "new", None)  # behind the waiting one
