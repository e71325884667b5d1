"""Tests of ``dask rmm log ...`` (dask_rmm.cli): through click's CliRunner, and once each as a
real process (``python -m dask_rmm.cli`` and the ``dask rmm`` entry point)."""

from __future__ import annotations

import gzip
import importlib.util
import json
import os
import re
import shutil
import stat
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest
from click.testing import CliRunner
from logdata import write_synthetic

from dask_rmm import cli, logs
from dask_rmm.logs import replay

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture
def runner():
    return CliRunner()


@pytest.fixture
def two_logs(tmp_path):
    a, b = tmp_path / "worker-0.csv", tmp_path / "worker-1.csv"
    ea = write_synthetic(a, 2000, seed=1, failure_rate=0.0)
    eb = write_synthetic(b, 1500, seed=2, start=12 * 3600.0 + 0.01, failure_rate=0.0)
    return a, b, ea, eb


def test_summary_text(runner, two_logs):
    a, b, ea, eb = two_logs
    result = runner.invoke(cli.main, ["log", "summary", str(a), str(b)])
    assert result.exit_code == 0, result.output
    out = result.stdout
    assert "== worker-0" in out and "== worker-1" in out and "== combined" in out
    assert f"{ea.peak_bytes:,} B" in out
    assert "per thread" in out and "per stream" in out and "sizes" in out


def test_summary_json(runner, two_logs):
    a, b, ea, eb = two_logs
    result = runner.invoke(cli.main, ["log", "summary", "--json", str(a), str(b)])
    assert result.exit_code == 0, result.output
    data = json.loads(result.stdout)
    assert [f["peak_bytes"] for f in data["files"]] == [ea.peak_bytes, eb.peak_bytes]
    assert data["files"][0]["outstanding_bytes"] == ea.outstanding_bytes
    assert data["combined"]["allocations"] == ea.allocations + eb.allocations


def test_summary_of_a_malformed_log_names_the_line(runner, tmp_path):
    p = tmp_path / "bad.csv"
    p.write_text(
        "Thread,Time,Action,Pointer,Size,Stream\n"
        "1,00:00:01.000000,allocate,0x100,256,0\n"
        "1,00:00:01.000001,allocate,0x200,,0\n"
        "1,00:00:01.000002,free,0x100,256,0\n"
    )
    result = runner.invoke(cli.main, ["log", "summary", str(p)])
    assert result.exit_code == 1
    assert f"{p}:3: malformed row" in result.output
    assert "Traceback" not in result.output


def test_summary_of_a_cut_log_warns_and_succeeds(runner, tmp_path):
    p = tmp_path / "cut.csv"
    exp = write_synthetic(p, 300, seed=4)
    with open(p, "a") as f:
        f.write("140001,12:00:09.1")
    result = runner.invoke(cli.main, ["log", "summary", str(p)])
    assert result.exit_code == 0, result.output
    assert "warning:" in result.stderr and ":302:" in result.stderr
    assert f"{exp.peak_bytes:,} B" in result.stdout


def test_plot(runner, two_logs, tmp_path):
    pytest.importorskip("matplotlib")
    a, b, _, _ = two_logs
    out = tmp_path / "plot.png"
    result = runner.invoke(cli.main, ["log", "plot", str(a), str(b), "-o", str(out)])
    assert result.exit_code == 0, result.output
    assert out.read_bytes()[:4] == b"\x89PNG"


def test_plot_without_matplotlib_says_what_to_install(runner, two_logs, tmp_path, monkeypatch):
    a, _, _, _ = two_logs
    monkeypatch.setitem(sys.modules, "matplotlib", None)
    result = runner.invoke(cli.main, ["log", "plot", str(a), "-o", str(tmp_path / "x.png")])
    assert result.exit_code == 1
    assert "needs matplotlib" in result.output


def test_merge(runner, two_logs, tmp_path):
    a, b, ea, eb = two_logs
    out = tmp_path / "merged.csv"
    result = runner.invoke(cli.main, ["log", "merge", str(a), str(b), "-o", str(out)])
    assert result.exit_code == 0, result.output
    assert "merged 3,500 rows from 2 files" in result.stdout
    merged = list(logs.read_log(out))
    assert [e.time for e in merged] == sorted(e.time for e in merged)
    assert {e.source for e in merged} == {"worker-0", "worker-1"}


def test_merge_and_plot_run_twice_give_the_same_output(runner, two_logs, tmp_path):
    a, b, _, _ = two_logs
    runs = [["log", "merge", str(a), str(b), "-o", str(tmp_path / "all.csv")]]
    try:
        import matplotlib  # noqa: F401

        runs.append(["log", "plot", str(a), str(b), "-o", str(tmp_path / "plot.svg")])
    except ImportError:
        pass
    for args in runs:
        outputs = []
        for _ in range(2):
            assert runner.invoke(cli.main, args).exit_code == 0
            outputs.append(Path(args[-1]).read_bytes())
        assert outputs[0] and len(outputs[1]) > 0.9 * len(outputs[0])
        if args[1] == "merge":
            assert outputs[0] == outputs[1]
    assert a.read_bytes() and b.read_bytes()
    assert not [p.name for p in tmp_path.iterdir() if ".partial" in p.name]


def test_merge_run_twice_refuses_its_own_output(runner, two_logs, tmp_path, monkeypatch):
    # `dask rmm log merge *.csv -o all.csv` run twice: the second run's inputs include all.csv.
    a, b, _, _ = two_logs
    monkeypatch.chdir(a.parent)
    args = ["log", "merge", a.name, b.name, "-o", "all.csv"]
    assert runner.invoke(cli.main, args).exit_code == 0
    before = (a.parent / "all.csv").read_bytes()
    result = runner.invoke(cli.main, ["log", "merge", a.name, b.name, "all.csv", "-o", "./all.csv"])
    assert result.exit_code == 1 and "refusing to write ./all.csv" in result.output
    assert (a.parent / "all.csv").read_bytes() == before


def test_merge_refuses_a_worker_log_as_output_also_through_a_link(runner, two_logs, tmp_path):
    a, b, _, _ = two_logs
    before = a.read_bytes()
    link = tmp_path / "link.csv"
    link.symlink_to(a)
    for out in (a, link):
        result = runner.invoke(cli.main, ["log", "merge", str(a), str(b), "-o", str(out)])
        assert result.exit_code == 1 and "it is also an input" in result.output
    assert a.read_bytes() == before


def test_merge_failure_leaves_no_partial_output(runner, two_logs, tmp_path, monkeypatch):
    a, b, _, _ = two_logs
    out = tmp_path / "merged.csv"
    out.write_text("previous\n")
    rows = []

    def format_event(e):
        rows.append(e)
        if len(rows) > 100:
            raise OSError("disk full")
        return "row"

    monkeypatch.setattr(logs.reader, "format_event", format_event)
    result = runner.invoke(cli.main, ["log", "merge", str(a), str(b), "-o", str(out)])
    assert result.exit_code == 1 and "disk full" in result.output
    assert out.read_text() == "previous\n"
    assert sorted(p.name for p in tmp_path.iterdir()) == [
        "merged.csv",
        "worker-0.csv",
        "worker-1.csv",
    ]


def test_merge_into_a_fifo_writes_through_it_and_keeps_it(runner, two_logs, tmp_path):
    # Renamed over, a FIFO (or /dev/null, /dev/full as root) would become a regular file.
    a, _, _, _ = two_logs
    fifo = tmp_path / "fifo"
    os.mkfifo(fifo)
    # The reader writes to an unnamed file, not a pipe: a pipe nobody reads until the merge ends
    # fills at 64 KiB and blocks the reader, then the merge (seen with the GPU's longer handles).
    with tempfile.TemporaryFile() as sink:
        reader = subprocess.Popen(["cat", str(fifo)], stdout=sink)
        try:
            result = runner.invoke(cli.main, ["log", "merge", str(a), "-o", str(fifo)])
            assert result.exit_code == 0, result.output
            assert stat.S_ISFIFO(os.lstat(fifo).st_mode)
            reader.wait(timeout=60)
        finally:
            reader.kill()
        sink.seek(0)
        out = sink.read().decode()
    assert out.startswith("Thread,Time,Action,Pointer,Size,Stream,Worker\n")
    assert out.count("\n") == 2001
    assert sorted(p.name for p in tmp_path.iterdir()) == ["fifo", "worker-0.csv", "worker-1.csv"]


def test_merge_through_a_link_writes_the_file_it_points_to(runner, two_logs, tmp_path):
    a, _, _, _ = two_logs
    (tmp_path / "old.csv").write_text("previous\n")
    link = tmp_path / "link.csv"
    link.symlink_to("old.csv")
    result = runner.invoke(cli.main, ["log", "merge", str(a), "-o", str(link)])
    assert result.exit_code == 0, result.output
    assert os.readlink(link) == "old.csv"
    assert len(list(logs.read_log(tmp_path / "old.csv"))) == 2000


def test_plot_without_an_extension_writes_png(runner, two_logs, tmp_path):
    pytest.importorskip("matplotlib")
    a, _, _, _ = two_logs
    out = tmp_path / "usage"
    result = runner.invoke(cli.main, ["log", "plot", str(a), "-o", str(out)])
    assert result.exit_code == 0, result.output
    assert out.read_bytes()[:4] == b"\x89PNG"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["usage", "worker-0.csv", "worker-1.csv"]


@pytest.mark.parametrize(
    "command",
    [
        ["log", "summary"],
        ["log", "summary", "--json"],
        ["log", "plot", "-o", "{tmp}/p.png"],
        ["log", "merge", "-o", "{tmp}/m.csv"],
        ["log", "replay"],
        ["log", "replay", "--compare", "pool,arena"],
        ["advise", "--logs"],
    ],
)
def test_a_truncated_gz_log_names_the_file_and_what_was_read(runner, tmp_path, command):
    plain = tmp_path / "w.csv"
    write_synthetic(plain, 3000, seed=3)
    data = gzip.compress(plain.read_bytes())
    cut = tmp_path / "w.csv.gz"
    cut.write_bytes(data[: len(data) // 2])
    args = [c.format(tmp=tmp_path) for c in command] + [str(cut)]
    result = runner.invoke(cli.main, args)
    assert result.exit_code == 1, result.output
    line = result.output.strip().splitlines()[-1]
    assert line.startswith(f"Error: {cut}:") and "gzip file is truncated" in line, line
    assert re.search(r"read [\d,]+ rows in [\d,]+ lines before it$", line), line
    assert sorted(p.name for p in tmp_path.iterdir()) == ["w.csv", "w.csv.gz"]


def test_a_gz_log_that_is_no_gzip_file_names_the_file(runner, tmp_path):
    log = tmp_path / "w.csv.gz"
    log.write_text("Thread,Time,Action,Pointer,Size,Stream\n")  # named .gz, never compressed
    result = runner.invoke(cli.main, ["log", "summary", str(log)])
    assert result.exit_code == 1, result.output
    line = result.output.strip().splitlines()[-1]
    assert line.startswith(f"Error: {log}:") and "Not a gzipped file" in line, line


def test_plot_refuses_to_overwrite_an_input(runner, two_logs):
    a, b, _, _ = two_logs
    before = a.read_bytes()
    result = runner.invoke(cli.main, ["log", "plot", str(a), str(b), "-o", str(a)])
    assert result.exit_code == 1 and "it is also an input" in result.output
    assert a.read_bytes() == before


def test_replay(runner, two_logs):
    a, _, ea, _ = two_logs
    result = runner.invoke(cli.main, ["log", "replay", str(a), "-r", "cuda", "--host-memory"])
    assert result.exit_code == 0, result.output
    assert "replaying on host memory" in result.stderr
    assert f"({ea.peak_bytes:,} B)" in result.stdout  # peak in use reproduced


def test_replay_json_and_sizes(runner, two_logs):
    a, _, ea, _ = two_logs
    result = runner.invoke(
        cli.main,
        ["log", "replay", str(a), "--resource", "pool", "--initial-pool-size", "64MiB", "--json"],
    )
    assert result.exit_code == 0, result.output
    data = json.loads(result.stdout)
    assert data["peak_bytes"] == ea.peak_bytes
    assert data["peak_upstream_bytes"] >= 64 << 20
    assert data["new_failures"] == 0


def test_replay_exit_code_on_new_failures(runner, two_logs):
    a, _, _, _ = two_logs
    result = runner.invoke(
        cli.main,
        [
            "log",
            "replay",
            str(a),
            "--initial-pool-size",
            "1MiB",
            "--maximum-pool-size",
            "2MiB",
        ],
    )
    assert result.exit_code == cli.EXIT_NEW_FAILURES, result.output
    assert "NEW FAILURES" in result.stdout
    assert "line " in result.stdout


def test_replay_compare(runner, two_logs):
    a, _, _, _ = two_logs
    result = runner.invoke(cli.main, ["log", "replay", str(a), "--compare", "pool,cuda"])
    assert result.exit_code == 0, result.output
    lines = result.stdout.splitlines()
    assert any(line.startswith("pool ") for line in lines)
    assert any(line.startswith("cuda ") for line in lines)
    assert "smallest footprint" in result.stdout


def test_replay_bad_arguments(runner, two_logs):
    a, _, _, _ = two_logs
    result = runner.invoke(cli.main, ["log", "replay", str(a), "--compare", "pool,tlsf"])
    assert result.exit_code == 2 and "tlsf" in result.output
    result = runner.invoke(cli.main, ["log", "replay", str(a), "--initial-pool-size", "lots"])
    assert result.exit_code == 2 and "lots" in result.output


def test_progress_bar_goes_to_stderr(runner, two_logs):
    a, _, _, _ = two_logs
    result = runner.invoke(cli.main, ["log", "replay", str(a), "-r", "cuda", "--progress"])
    assert result.exit_code == 0, result.output
    # click hides the bar itself when stderr is not a terminal, but still names the replay there.
    assert "replay cuda" in result.stderr and "replay cuda" not in result.stdout


def test_resource_names_match_replay():
    assert cli._RESOURCE_NAMES == replay.RESOURCES


def _env():
    env = dict(os.environ)
    env["PYTHONPATH"] = str(ROOT) + os.pathsep + env.get("PYTHONPATH", "")
    return env


#: What ``import dask_rmm.cli`` must not load (each command imports what it needs).
_HEAVY = (
    "dask_rmm.logs",
    "dask_rmm.logs.reader",
    "dask_rmm.logs.summary",
    "dask_rmm.logs.timeline",
    "dask_rmm.logs.replay",
    "dask_rmm.report",
    "matplotlib",
    "distributed",
    "cuda",
)


def test_every_module_the_light_import_check_names_exists():
    # A renamed module would make the check below pass whatever the CLI imports.
    for name in _HEAVY:
        assert importlib.util.find_spec(name) is not None, name


def test_importing_the_cli_is_light():
    code = (
        "import sys, dask_rmm.cli; "
        f"heavy = [m for m in {_HEAVY!r} if m in sys.modules]; print(heavy)"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, env=_env(), check=True
    )
    assert out.stdout.strip() == "[]"


def test_python_m_dask_rmm_cli(two_logs):
    a, b, ea, _ = two_logs
    out = subprocess.run(
        [sys.executable, "-m", "dask_rmm.cli", "log", "summary", "--json", str(a), str(b)],
        capture_output=True,
        text=True,
        env=_env(),
    )
    assert out.returncode == 0, out.stderr
    assert json.loads(out.stdout)["files"][0]["peak_bytes"] == ea.peak_bytes


def test_dask_rmm_entry_point(two_logs):
    dask = shutil.which("dask", path=os.path.dirname(sys.executable)) or shutil.which("dask")
    if dask is None:
        pytest.skip("the dask command is not installed")
    check = subprocess.run([dask, "rmm", "--help"], capture_output=True, text=True)
    if check.returncode != 0:
        pytest.skip("dask-rmm is not installed (pip install -e .): no `dask rmm` entry point")
    a, _, ea, _ = two_logs
    out = subprocess.run(
        [dask, "rmm", "log", "replay", str(a), "-r", "cuda", "--host-memory", "--json"],
        capture_output=True,
        text=True,
    )
    assert out.returncode == 0, out.stderr
    assert json.loads(out.stdout)["peak_bytes"] == ea.peak_bytes


def test_replay_counts_the_failures_it_does_not_list(runner, tmp_path):
    from logdata import write_log

    from dask_rmm.logs import Action, LogEvent

    path = tmp_path / "big.csv"
    events = []
    for i in range(120):  # 2 MiB each: fixed_size (1 MiB blocks) fails every one
        ptr = 0x7F0000000000 + (i << 22)
        t = 100.0 + i
        events.append(LogEvent(1, t, Action.ALLOCATE, ptr, 2 << 20, 0, 2 * i + 2, "big", ""))
        events.append(LogEvent(1, t + 0.5, Action.FREE, ptr, 2 << 20, 0, 2 * i + 3, "big", ""))
    write_log(path, events)
    result = runner.invoke(cli.main, ["log", "replay", str(path), "-r", "fixed_size"])
    assert result.exit_code == cli.EXIT_NEW_FAILURES, result.output
    assert "NEW FAILURES     120 allocations" in result.stdout
    listed = [ln for ln in result.stdout.splitlines() if ln.strip().startswith("line ")]
    assert len(listed) == 10
    assert "110 more new failures not listed" in result.stdout, result.stdout
    assert "more failed rows not listed" not in result.stdout
    data = json.loads(
        runner.invoke(cli.main, ["log", "replay", str(path), "-r", "fixed_size", "--json"]).stdout
    )
    assert data["failed_rows"] == 120 and len(data["failures"]) == 50


def test_summary_says_why_its_peak_may_differ_from_the_reports(runner, tmp_path):
    from logdata import logging_adaptor, run_workload

    from dask_rmm import mr
    from dask_rmm.logs.summary import summarize

    peaks = {}
    for threads in (1, 3):
        stats = mr.StatisticsResourceAdaptor(
            logging_adaptor(mr.SystemMemoryResource(), tmp_path / f"t{threads}.csv")
        )
        for blk in run_workload(stats, 400, seed=threads, threads=threads):
            stats.deallocate(*blk)
        log = stats.upstream_mr
        log.close()
        summary = summarize([log.get_file_name()]).files[0]
        peaks[threads] = (summary.peak_bytes, stats.allocation_counts.peak_bytes)
        text = runner.invoke(cli.main, ["log", "summary", log.get_file_name()]).stdout
        data = json.loads(
            runner.invoke(cli.main, ["log", "summary", "--json", log.get_file_name()]).stdout
        )["files"][0]
        said = "the report's peak (a counter in the worker) orders" in text
        assert said == (threads > 1) and bool(data["notes"]) == (threads > 1), text
    # One thread: one order, the same peak as the statistics adaptor's.
    assert peaks[1][0] == peaks[1][1]


def _outstanding_rows(text: str) -> int:
    return sum(1 for line in text.splitlines() if "  ptr 0x" in line)


@pytest.mark.parametrize("top", [0, 1, 8, 9, 25, 200])
def test_summary_top_lists_as_many_rows_in_text_as_in_json(runner, tmp_path, top):
    p = tmp_path / "leaky.csv"
    exp = write_synthetic(p, 3000, seed=5, failure_rate=0.0)
    assert exp.outstanding_count > 30  # enough never-freed blocks for every top here
    text = runner.invoke(cli.main, ["log", "summary", "--top", str(top), str(p)])
    as_json = runner.invoke(cli.main, ["log", "summary", "--json", "--top", str(top), str(p)])
    assert text.exit_code == 0 and as_json.exit_code == 0, (text.output, as_json.output)
    listed = len(json.loads(as_json.stdout)["files"][0]["largest_outstanding"])
    assert listed == min(top, exp.outstanding_count)
    assert _outstanding_rows(text.stdout) == listed


@pytest.mark.parametrize("top", ["-5", "-1", "two"])
def test_summary_top_must_be_a_count(runner, two_logs, top):
    a, _, _, _ = two_logs
    result = runner.invoke(cli.main, ["log", "summary", "--top", top, str(a)])
    assert result.exit_code == 2 and "--top" in result.output, result.output


@pytest.mark.parametrize("top", [-5, -1, 1.5, True, "3"])
def test_summarize_refuses_a_top_that_is_not_a_count(two_logs, top):
    from dask_rmm.logs import summary as log_summary

    with pytest.raises(ValueError, match="top must be"):
        log_summary.summarize(two_logs[0], top=top)


def _small_and_large_log(tmp_path) -> Path:
    """One 1 MB block, then one of 75 MB: larger than fixed_size's default 1 MiB block."""
    p = tmp_path / "large.csv"
    p.write_text(
        "Thread,Time,Action,Pointer,Size,Stream\n"
        "1,01:00:00.000000,allocate,0x1000,1000000,0x0\n"
        "1,01:00:00.100000,allocate,0x2000,75000000,0x0\n"
        "1,01:00:00.200000,free,0x1000,1000000,0x0\n"
        "1,01:00:00.300000,free,0x2000,75000000,0x0\n"
    )
    return p


def _footprints(stdout: str) -> dict[str, str]:
    """resource -> its row of the comparison table (the first line naming it)."""
    rows: dict[str, str] = {}
    for line in stdout.splitlines():
        if line.split() and line.split()[0] in replay.RESOURCES:
            rows.setdefault(line.split()[0], line)
    return rows


@pytest.mark.parametrize("names", ["pool,cuda", "cuda,pool", "arena,cuda,binning"])
def test_compare_names_the_smallest_footprint_of_all_that_served(runner, tmp_path, names):
    p = _small_and_large_log(tmp_path)
    result = runner.invoke(cli.main, ["log", "replay", str(p), "--compare", names, "--json"])
    assert result.exit_code == 0, result.output
    results = json.loads(result.stdout)
    smallest = min(results, key=lambda r: r["peak_upstream_bytes"])["resource"]
    assert smallest == "cuda"  # the base alone: exactly what was asked, rounded
    text = runner.invoke(cli.main, ["log", "replay", str(p), "--compare", names])
    verdict = next(x for x in text.stdout.splitlines() if x.startswith("smallest footprint"))
    assert verdict.startswith(f"smallest footprint without new failures: {smallest} (")
    assert "of the pooled resources:" in verdict  # and which pool, the question of a pool


def test_compare_all_reports_a_resource_that_cannot_serve_the_log(runner, tmp_path):
    p = _small_and_large_log(tmp_path)
    result = runner.invoke(cli.main, ["log", "replay", str(p), "--compare", "all"])
    assert result.exit_code == 0, result.output
    rows = _footprints(result.stdout)
    assert "cannot serve" in rows["fixed_size"]
    assert "fixed_size cannot serve this log" in result.stdout
    assert "larger than the block size" in result.stdout
    assert "NEW FAILURES" not in result.stdout
    # asked for alone, the answer is the failure
    alone = runner.invoke(cli.main, ["log", "replay", str(p), "-r", "fixed_size"])
    assert alone.exit_code == cli.EXIT_NEW_FAILURES and "CANNOT SERVE" in alone.stdout


def test_compare_still_fails_when_a_resource_that_can_serve_runs_out(runner, tmp_path):
    p = _small_and_large_log(tmp_path)
    args = ["--compare", "pool,fixed_size", "--maximum-pool-size", "8MiB"]
    result = runner.invoke(cli.main, ["log", "replay", str(p), *args])
    assert result.exit_code == cli.EXIT_NEW_FAILURES, result.output
    assert "NEW FAILURES" in result.stdout


@pytest.mark.parametrize("size", ["0", "0B", "0.0", "-1", "lots"])
def test_block_size_must_be_positive(runner, two_logs, size):
    a, _, _, _ = two_logs
    result = runner.invoke(
        cli.main, ["log", "replay", str(a), "-r", "fixed_size", f"--block-size={size}"]
    )
    assert result.exit_code == 2 and "--block-size" in result.output, result.output


@pytest.mark.parametrize("size", [0, -1])
def test_build_resource_refuses_a_block_size_that_is_not_positive(size):
    with pytest.raises(ValueError, match="block_size must be a positive"):
        replay.build_resource("fixed_size", gpu=False, block_size=size)


@pytest.mark.parametrize("resource", ["pool", "arena"])
@pytest.mark.parametrize("size", ["1PiB", "100TiB", "4096TiB"])
def test_replay_on_a_pool_larger_than_memory_is_one_line(runner, tmp_path, resource, size):
    p = _small_and_large_log(tmp_path)
    args = ["log", "replay", str(p), "-r", resource, "--host-memory", "--initial-pool-size", size]
    result = runner.invoke(cli.main, args)
    assert result.exit_code == 1, (result.output, result.exception)
    assert "Traceback" not in result.output
    (line,) = [x for x in result.stderr.splitlines() if x.startswith("Error:")]
    assert (
        f"cannot build the {resource!r} resource to replay on" in line and "out of memory" in line
    )


@pytest.mark.parametrize("size", [str(1 << 64), str(10**23), "9" * 40])
@pytest.mark.parametrize("command", [["replay"], ["replay", "--compare", "all"], ["summary"]])
def test_a_log_with_a_size_no_allocation_can_have_is_one_line(runner, tmp_path, size, command):
    p = tmp_path / "absurd.csv"
    p.write_text(
        "Thread,Time,Action,Pointer,Size,Stream\n"
        f"1,01:00:00.000000,allocate,0x1000,{size},0x0\n"
        f"1,01:00:00.100000,free,0x1000,{size},0x0\n"
    )
    result = runner.invoke(cli.main, ["log", command[0], str(p), *command[1:]])
    assert result.exit_code == 1, (result.output, result.exception)
    assert "Traceback" not in result.output
    (line,) = [x for x in result.stderr.splitlines() if x.startswith("Error:")]
    assert ":2:" in line and "larger than any size RMM logs" in line


def test_merge_refuses_a_file_given_twice_by_any_name(runner, two_logs, tmp_path):
    a, b, _, _ = two_logs
    link = tmp_path / "link.csv"
    link.symlink_to(a)
    relative = os.path.relpath(a)
    for inputs in ([a, a], [a, b, a], [a, link], [relative, a]):
        out = tmp_path / "merged.csv"
        result = runner.invoke(cli.main, ["log", "merge", *map(str, inputs), "-o", str(out)])
        assert result.exit_code == 1, (inputs, result.output)
        assert "is given twice" in result.output and not out.exists()


@pytest.mark.parametrize(
    "command, label",
    [(["summary", "--json"], "reading logs"), (["plot", "-o", "{tmp}/p.png"], "reading logs")],
)
def test_summary_and_plot_show_progress_on_stderr(runner, two_logs, tmp_path, command, label):
    pytest.importorskip("matplotlib")
    a, b, _, _ = two_logs
    args = [c.replace("{tmp}", str(tmp_path)) for c in command]
    result = runner.invoke(cli.main, ["log", *args, str(a), str(b), "--progress"])
    assert result.exit_code == 0, result.output
    # click hides the bar itself when stderr is not a terminal, but still names it there.
    assert label in result.stderr and label not in result.stdout
    if "--json" in args:
        json.loads(result.stdout)
    quiet = runner.invoke(cli.main, ["log", *args, str(a), "--no-progress"])
    assert quiet.exit_code == 0 and label not in quiet.stderr


def test_compare_with_nothing_served_shows_no_ratio_rather_than_nan(runner, tmp_path):
    p = tmp_path / "never.csv"
    size = (1 << 64) - 1  # what a size_t holds: no resource serves it
    p.write_text(
        "Thread,Time,Action,Pointer,Size,Stream\n"
        f"1,01:00:00.000000,allocate,0x1000,{size},0x0\n1,01:00:00.100000,free,0x1000,{size},0x0\n"
    )
    result = runner.invoke(cli.main, ["log", "replay", str(p), "--compare", "pool,cuda"])
    assert result.exit_code == cli.EXIT_NEW_FAILURES, result.output
    rows = _footprints(result.stdout)
    assert "nan" not in result.stdout and rows["pool"].split()[3] == "-"


@pytest.mark.parametrize("names", [",", " ", " , "])
def test_compare_naming_no_resource_is_a_usage_error(runner, two_logs, names):
    a, _, _, _ = two_logs
    result = runner.invoke(cli.main, ["log", "replay", "--compare", names, str(a)])
    assert result.exit_code == 2 and "unknown resource(s)" in result.output, result.output
    assert result.exception is None or isinstance(result.exception, SystemExit)


def test_advise_shows_control_characters_in_a_name_escaped(runner, tmp_path):
    # A worker's (here a log's) name with a newline forged an "allocator" line; an escape
    # sequence reached the terminal.
    log = tmp_path / "w\n  allocator          FAKE\x1b]0;title\x07.csv"
    write_synthetic(log, 400, seed=5, failure_rate=0.0)
    # a second, smaller log: the combined advice names the first as the largest device
    write_synthetic(tmp_path / "plain.csv", 100, seed=6, failure_rate=0.0)
    args = ["advise", "--logs", "--host-memory", str(log), str(tmp_path / "plain.csv")]
    result = runner.invoke(cli.main, args)
    assert result.exit_code == 0, result.output
    assert "\x1b" not in result.stdout and "\x07" not in result.stdout
    forged = [line for line in result.stdout.splitlines() if "allocator          FAKE" in line]
    assert len(forged) == 2, forged
    assert forged[0].startswith("w\\n  allocator          FAKE\\x1b]0;title\\x07"), forged
    assert "the largest device's advice (w\\n  allocator          FAKE" in forged[1], forged
