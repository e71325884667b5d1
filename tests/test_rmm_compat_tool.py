"""tools/rmm_compat: the ``rmm`` -> ``dask_rmm`` import shim and the per-file runner's counts."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
TOOL = REPO / "tools" / "rmm_compat"

# Loaded from its file: tools/ is not a package and must not go on sys.path for the session.
_spec = importlib.util.spec_from_file_location("rmm_compat_run", TOOL / "run.py")
compat_run = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(compat_run)


def _python(code: str, cwd: Path | None = None) -> subprocess.CompletedProcess:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(TOOL), str(REPO), env.get("PYTHONPATH", "")])
    return subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code)],
        capture_output=True,
        text=True,
        env=env,
        cwd=cwd,
        timeout=120,
    )


def test_shim_serves_rmm_names_from_dask_rmm():
    proc = _python(
        """
        import json
        import rmm_shim  # noqa: F401
        import rmm, rmm.mr, rmm.statistics
        import dask_rmm, dask_rmm.mr, dask_rmm.stream, dask_rmm._cuda
        from rmm.pylibrmm.stream import CudaStreamFlags, Stream
        from rmm.pylibrmm.memory_resource._memory_resource import _flush_logs
        from rmm.allocators.torch import rmm_torch_allocator
        checks = {
            "mr": rmm.mr is dask_rmm.mr,
            "pool": rmm.mr.PoolMemoryResource is dask_rmm.mr.PoolMemoryResource,
            "experimental": rmm.mr.experimental.CudaAsyncManagedMemoryResource
                is dask_rmm.mr.experimental.CudaAsyncManagedMemoryResource,
            "stream": Stream is dask_rmm.stream.Stream,
            "flags": CudaStreamFlags is dask_rmm.stream.CudaStreamFlags,
            "pylibrmm attr": rmm.pylibrmm.stream.Stream is Stream,
            "pool attr": rmm.pylibrmm.cuda_stream_pool.CudaStreamPool
                is dask_rmm.stream.CudaStreamPool,
            "gpu": rmm._cuda.gpu.getDevice is dask_rmm._cuda.get_device,
            "version": rmm.__version__ == dask_rmm.__version__,
            "commit": isinstance(rmm.__git_commit__, str),
            "DeviceBuffer": rmm.DeviceBuffer is dask_rmm.DeviceBuffer,
            "spec kept": dask_rmm.stream.__spec__.name == "dask_rmm.stream",
        }
        try:
            import rmm.librmm  # noqa: F401
            checks["unknown refused"] = False
        except ModuleNotFoundError as e:
            checks["unknown refused"] = "no dask-rmm counterpart" in str(e)
        print(json.dumps(checks))
        """
    )
    assert proc.returncode == 0, proc.stderr
    checks = json.loads(proc.stdout.strip().splitlines()[-1])
    assert all(checks.values()), checks


def _junit(tmp_path: Path, body: str) -> Path:
    path = tmp_path / "r.xml"
    path.write_text(f'<testsuites><testsuite name="pytest">{body}</testsuite></testsuites>')
    return path


def test_counts_one_outcome_per_test(tmp_path):
    path = _junit(
        tmp_path,
        '<testcase classname="t" name="ok"/>'
        '<testcase classname="t" name="skip"><skipped message="no"/></testcase>'
        '<testcase classname="t" name="bad"><failure message="assert 1 == 2"/></testcase>'
        # a call failure then a teardown error of the same test: one failed test
        '<testcase classname="t" name="bad"><error message="teardown"/></testcase>'
        '<testcase classname="t" name="err"><error message="setup"/></testcase>',
    )
    assert compat_run.counts_from_junit(path) == {
        "passed": 1,
        "failed": 1,
        "errors": 1,
        "skipped": 1,
    }
    problems = compat_run.failures_from_junit(path)
    assert "bad [failure]: assert 1 == 2" in problems


def test_runner_runs_each_file_in_its_own_process(tmp_path):
    tests = tmp_path / "tests"
    tests.mkdir()
    (tests / "test_pass.py").write_text(
        "import rmm\n\ndef test_a():\n    assert rmm.mr.CudaMemoryResource\n"
    )
    (tests / "test_crash.py").write_text("import os\n\ndef test_b():\n    os.abort()\n")
    out = tmp_path / "out"
    proc = subprocess.run(
        [
            sys.executable,
            str(TOOL / "run.py"),
            str(tests),
            str(out),
            "--jobs",
            "2",
            "--timeout",
            "100",
        ],
        capture_output=True,
        text=True,
        timeout=200,
        # The repository first, then what the caller's path had (on the GPU host, the wheels'
        # folder that holds distributed): replacing it made the child unable to import dask_rmm.
        env={
            **os.environ,
            "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")])),
        },
    )
    assert proc.returncode == 0, proc.stderr
    summary = json.loads((out / "summary.json").read_text())
    files = {f["file"]: f for f in summary["files"]}
    assert files["test_pass.py"]["passed"] == 1 and not files["test_pass.py"]["crashed"]
    assert files["test_crash.py"]["crashed"]
    assert summary["totals"]["crashed_files"] == ["test_crash.py"]
    assert "TOTAL passed=1" in proc.stdout
