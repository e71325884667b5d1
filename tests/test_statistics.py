"""dask_rmm.statistics: enable/disable, the statistics() context, the stack, the profiler."""

from __future__ import annotations

import threading

import pytest

from dask_rmm import statistics
from dask_rmm.mr import (
    StatisticsResourceAdaptor,
    get_current_device_resource,
    set_current_device_resource,
)
from dask_rmm.statistics import ProfilerRecords, Statistics


@pytest.fixture
def current(base_resource):
    set_current_device_resource(base_resource)
    statistics.default_profiler_records.clear()
    yield base_resource
    statistics.default_profiler_records.clear()


def alloc(n):
    mr = get_current_device_resource()
    return mr, mr.allocate(n)


def test_enable_is_idempotent_and_disable_unwraps(current):
    assert statistics.get_statistics() is None
    statistics.enable_statistics()
    mr = get_current_device_resource()
    assert isinstance(mr, StatisticsResourceAdaptor) and mr.get_upstream() is current
    statistics.enable_statistics()
    assert get_current_device_resource() is mr
    assert statistics.get_statistics() == Statistics(0, 0, 0, 0, 0, 0)
    statistics.disable_statistics()
    assert get_current_device_resource() is current
    statistics.disable_statistics()
    assert get_current_device_resource() is current


def test_buffer_from_disabled_adaptor_frees_through_it(current):
    statistics.enable_statistics()
    mr, p = alloc(100)
    statistics.disable_statistics()
    mr.deallocate(p, 100)
    assert mr.allocation_counts.current_bytes == 0


def test_push_pop_disabled_are_none(current):
    assert statistics.push_statistics() is None
    assert statistics.pop_statistics() is None


def test_push_pop(current):
    statistics.enable_statistics()
    mr, a = alloc(1000)
    assert statistics.push_statistics() == Statistics(1000, 1, 1000, 1, 1000, 1)
    _, b = alloc(24)
    assert statistics.get_statistics() == Statistics(24, 1, 24, 1, 24, 1)
    assert statistics.pop_statistics() == Statistics(24, 1, 24, 1, 24, 1)
    assert statistics.get_statistics() == Statistics(1024, 2, 1024, 2, 1024, 2)
    with pytest.raises(IndexError):
        statistics.pop_statistics()
    mr.deallocate(a, 1000)
    mr.deallocate(b, 24)


def test_statistics_context_enables_and_restores(current):
    with statistics.statistics():
        mr, p = alloc(300)
        mr.deallocate(p, 300)
        assert statistics.get_statistics().peak_bytes == 300
    assert get_current_device_resource() is current
    assert statistics.get_statistics() is None


def test_statistics_context_nested_pushes(current):
    statistics.enable_statistics()
    outer_mr = get_current_device_resource()
    _, a = alloc(100)
    with statistics.statistics():
        assert get_current_device_resource() is outer_mr
        _, b = alloc(50)
        assert statistics.get_statistics().current_bytes == 50
        with statistics.statistics():
            assert outer_mr.counter_depth == 3
    assert outer_mr.counter_depth == 1
    assert statistics.get_statistics() == Statistics(150, 2, 150, 2, 150, 2)
    outer_mr.deallocate(a, 100)
    outer_mr.deallocate(b, 50)


def test_statistics_context_detects_changed_stack(current, base_resource):
    with pytest.raises(ValueError, match="changed inside"):
        with statistics.statistics():
            set_current_device_resource(base_resource)
    # Nothing was restored over the foreign change.
    assert get_current_device_resource() is base_resource


def test_profiler_context_and_nesting(current):
    statistics.enable_statistics()
    records = ProfilerRecords()
    with statistics.profiler(name="outer", records=records):
        mr, a = alloc(1000)
        with statistics.profiler(name="inner", records=records):
            _, b = alloc(500)
            mr.deallocate(b, 500)
        mr.deallocate(a, 1000)
    r = records.records
    assert (r["inner"].num_calls, r["inner"].memory_peak, r["inner"].memory_total) == (1, 500, 500)
    assert (r["outer"].num_calls, r["outer"].memory_peak, r["outer"].memory_total) == (
        1,
        1500,
        1500,
    )


def test_profiler_decorator_default_name_and_records(current):
    statistics.enable_statistics()

    @statistics.profiler()
    def work(n):
        mr, p = alloc(n)
        mr.deallocate(p, n)
        return n

    assert work(256) == 256 and work(512) == 512
    ((name, data),) = statistics.default_profiler_records.records.items()
    assert name.endswith("(test_profiler_decorator_default_name_and_records.<locals>.work)")
    assert "test_statistics.py:" in name
    assert (data.num_calls, data.memory_peak, data.memory_total) == (2, 512, 768)


def test_profiler_records_even_when_function_raises(current):
    statistics.enable_statistics()

    @statistics.profiler(name="fails")
    def fails():
        alloc(256)  # leaked on purpose
        raise KeyError("x")

    with pytest.raises(KeyError):
        fails()
    assert statistics.default_profiler_records.records["fails"].memory_total == 256
    assert get_current_device_resource().counter_depth == 1


def test_profiler_disabled_is_a_no_op(current):
    with statistics.profiler(name="off"):
        pass
    assert statistics.default_profiler_records.records == {}


def test_profiler_bad_input(current):
    with pytest.raises(ValueError, match="needs a name"):
        with statistics.profiler():
            pass
    with pytest.raises(TypeError):
        statistics.profiler(records={})
    with pytest.raises(TypeError):
        statistics.profiler(name=3)


def test_report_layout():
    records = ProfilerRecords()
    assert (
        records.report()
        == "Memory Profiling\n================\n\nNo data, maybe profiling wasn't enabled?"
    )
    records.add("a.py:1(f)", Statistics(0, 0, 1000, 1, 5000, 3))
    records.add("a.py:1(f)", Statistics(0, 0, 2000, 1, 1000, 1))
    records.add("b", Statistics(0, 0, 1_234_567, 1, 10, 1))
    assert records.report() == (
        "Memory Profiling\n"
        "================\n"
        "\n"
        "Ordered by:   memory_peak\n"
        "Memory units: bytes\n"
        "\n"
        "ncalls     memory_peak    memory_total  filename:lineno(function)\n"
        "     1       1,234,567              10  b\n"
        "     2           2,000           6,000  a.py:1(f)"
    )
    assert records.report("num_calls").splitlines()[-2].endswith("a.py:1(f)")
    assert str(records) == records.report()
    with pytest.raises(ValueError):
        records.report("bytes")


def test_profiler_records_thread_safe():
    records = ProfilerRecords()

    def work():
        for _ in range(200):
            records.add("x", Statistics(0, 0, 1, 1, 2, 1))

    threads = [threading.Thread(target=work) for _ in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert records.records["x"].num_calls == 1600 and records.records["x"].memory_total == 3200


def test_top_level_module():
    import dask_rmm

    assert dask_rmm.statistics is statistics
    assert statistics.Statistics is Statistics
