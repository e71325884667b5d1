"""LoggingResourceAdaptor: RMM's CSV, parsed back row by row; file naming; flush; errors."""

from __future__ import annotations

import csv
import os
import re
import threading

import pytest
from conftest import make_test_streams

from dask_rmm.mr import CallbackMemoryResource, LimitingResourceAdaptor, LoggingResourceAdaptor
from dask_rmm.mr.logging_adaptor import CSV_HEADER, format_pointer, format_stream

TIME = re.compile(r"^\d\d:\d\d:\d\d\.\d{6}$")


def read_rows(mr):
    mr.flush()
    with open(mr.get_file_name(), newline="") as f:
        return list(csv.reader(f))


def test_csv_rows(tmp_path, base_resource):
    mr = LoggingResourceAdaptor(base_resource, log_file_name=tmp_path / "rmm.csv")
    assert mr.get_file_name() == str(tmp_path / f"rmm.dev{base_resource.device_id}.csv")
    # A real stream on a GPU resource (CUDA sees it), a made-up handle on host memory.
    (s,) = make_test_streams(1, base_resource)
    a = mr.allocate(1000)
    b = mr.allocate(24, s)
    mr.deallocate(a, 1000)
    mr.deallocate(b, 24, s)
    rows = read_rows(mr)
    assert ",".join(rows[0]) == CSV_HEADER
    body = rows[1:]
    assert s.handle > 2 and format_stream(s.handle) == f"{s.handle:#x}"
    assert [(r[2], int(r[3], 16), int(r[4]), r[5]) for r in body] == [
        ("allocate", a, 1000, "0"),
        ("allocate", b, 24, f"{s.handle:#x}"),
        ("free", a, 1000, "0"),
        ("free", b, 24, f"{s.handle:#x}"),
    ]
    for r in body:
        assert int(r[0]) == threading.get_native_id()
        assert TIME.match(r[1]), r[1]
        assert r[3].startswith("0x")
    assert [r[1] for r in body] == sorted(r[1] for r in body)


def test_failure_row_and_refused_free(tmp_path, base_resource):
    limited = LimitingResourceAdaptor(base_resource, allocation_limit=256)
    mr = LoggingResourceAdaptor(limited, log_file_name=str(tmp_path / "x.log"))
    with pytest.raises(MemoryError):
        mr.allocate(1000)
    p = mr.allocate(256)
    with pytest.raises(ValueError):
        mr.deallocate(p, 100)  # refused upstream: no row
    mr.deallocate(p, 256)
    rows = read_rows(mr)[1:]
    assert [(r[2], r[3], r[4]) for r in rows] == [
        ("allocate failure", "(nil)", "1000"),
        ("allocate", f"{p:#x}", "256"),
        ("free", f"{p:#x}", "256"),
    ]


def test_rows_from_threads_are_whole(tmp_path, base_resource):
    mr = LoggingResourceAdaptor(base_resource, log_file_name=tmp_path / "t.csv")

    def work():
        for _ in range(50):
            mr.deallocate(mr.allocate(256), 256)

    threads = [threading.Thread(target=work) for _ in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    rows = read_rows(mr)[1:]
    assert len(rows) == 8 * 50 * 2 and all(len(r) == 6 for r in rows)
    assert len({r[0] for r in rows}) == 8


def test_auto_flush_and_flush(tmp_path, base_resource):
    mr = LoggingResourceAdaptor(base_resource, log_file_name=tmp_path / "a.csv", auto_flush=True)
    p = mr.allocate(256)
    with open(mr.get_file_name()) as f:
        assert len(f.read().splitlines()) == 2  # visible without flush()
    mr.deallocate(p, 256)
    lazy = LoggingResourceAdaptor(base_resource, log_file_name=tmp_path / "b.csv")
    lazy.deallocate(lazy.allocate(256), 256)
    assert len(read_rows(lazy)) == 3
    lazy.close()
    lazy.deallocate(lazy.allocate(256), 256)  # still allocates, rows dropped
    with open(lazy.get_file_name()) as f:
        assert len(f.read().splitlines()) == 3


def test_env_var_and_missing_name(tmp_path, monkeypatch, base_resource):
    monkeypatch.setenv("RMM_LOG_FILE", str(tmp_path / "env.csv"))
    mr = LoggingResourceAdaptor(base_resource)
    assert os.path.basename(mr.get_file_name()) == f"env.dev{base_resource.device_id}.csv"
    monkeypatch.delenv("RMM_LOG_FILE")
    with pytest.raises(ValueError, match="RMM_LOG_FILE"):
        LoggingResourceAdaptor(base_resource)
    with pytest.raises(TypeError):
        LoggingResourceAdaptor(base_resource, log_file_name=5)


def test_relative_name_becomes_absolute(tmp_path, monkeypatch, base_resource):
    monkeypatch.chdir(tmp_path)
    mr = LoggingResourceAdaptor(base_resource, log_file_name="noext")
    assert mr.get_file_name() == str(tmp_path / f"noext.dev{base_resource.device_id}")


def test_formats():
    assert format_pointer(0) == "(nil)" and format_pointer(0x7F0A) == "0x7f0a"
    assert format_stream(0) == "0" and format_stream(2) == "0x2"


def test_size_zero_logged_with_nil_pointer(tmp_path):
    mr = LoggingResourceAdaptor(
        CallbackMemoryResource(lambda n, s: 0, lambda p, n, s: None, device_id=0),
        log_file_name=tmp_path / "z.csv",
    )
    mr.deallocate(mr.allocate(0), 0)
    assert [r[2:5] for r in read_rows(mr)[1:]] == [
        ["allocate", "(nil)", "0"],
        ["free", "(nil)", "0"],
    ]
