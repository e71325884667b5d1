"""The examples a new user runs first: each finishes without a traceback on any host, on the
GPU when there is one, and on host memory without one (saying so, as the quickstart does)."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import HAS_GPU

ROOT = Path(__file__).resolve().parents[1]

EXAMPLES = {
    "cluster_report.py": lambda out: ["--plot", str(out / "report.png"), "--workers", "2"],
    "gpu_memory_tools.py": lambda out: ["--out", str(out)],
}
NO_GPU_LINE = "No GPU on this host: using base_resource='system' (host memory)"


#: What distributed itself logs, with a traceback, when a cluster shuts down under load: a
#: worker's last heartbeat meets the scheduler already closed. Not the example's.
_DISTRIBUTED_SHUTDOWN_NOISE = ("Failed to communicate with scheduler during heartbeat",)
_LOG_RECORD = re.compile(r"^\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d{3} - ", re.M)


def _stderr_without_shutdown_noise(stderr: str) -> str:
    """``stderr`` less distributed's log records (each up to the next record) that are its known
    shutdown noise."""
    starts = [m.start() for m in _LOG_RECORD.finditer(stderr)]
    if not starts:
        return stderr
    pieces = [stderr[: starts[0]]]
    for begin, end in zip(starts, [*starts[1:], len(stderr)], strict=True):
        record = stderr[begin:end]
        if not any(noise in record.splitlines()[0] for noise in _DISTRIBUTED_SHUTDOWN_NOISE):
            pieces.append(record)
    return "".join(pieces)


def test_shutdown_noise_is_dropped_and_nothing_else():
    own = "Traceback (most recent call last):\n  ValueError: ours\n"
    noise = (
        "2026-12-02 07:28:44,197 - distributed.worker - ERROR - Failed to communicate with "
        "scheduler during heartbeat.\nTraceback (most recent call last):\n  CommClosedError\n"
    )
    other = "2026-12-02 07:28:45,000 - distributed.worker - ERROR - boom\nTraceback (x)\n"
    assert _stderr_without_shutdown_noise(noise) == ""
    assert _stderr_without_shutdown_noise(own + noise) == own
    assert _stderr_without_shutdown_noise(noise + other) == other


def _run(script: str, args: list[str]) -> subprocess.CompletedProcess:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH")]))
    return subprocess.run(
        [sys.executable, str(ROOT / "examples" / script), *args],
        capture_output=True,
        text=True,
        env=env,
        timeout=300,
        cwd=ROOT,
    )


@pytest.mark.slow
@pytest.mark.parametrize("host_memory", [False, True], ids=["default", "host-memory"])
@pytest.mark.parametrize("script", sorted(EXAMPLES))
def test_an_example_runs_on_this_host_without_a_traceback(script, host_memory, tmp_path):
    if host_memory and not HAS_GPU:
        pytest.skip("without a GPU the default run is the host-memory run")
    out = _run(script, EXAMPLES[script](tmp_path) + (["--host-memory"] if host_memory else []))
    assert out.returncode == 0, out.stderr[-3000:]
    assert "Traceback" not in _stderr_without_shutdown_noise(out.stderr), out.stderr[-3000:]
    # without a GPU, and without being asked, it says it runs on host memory
    assert (NO_GPU_LINE in out.stdout) == (not HAS_GPU and not host_memory)
    assert any(p.suffix == ".png" for p in tmp_path.iterdir())


@pytest.mark.slow
def test_the_pytorch_breakdown_example_draws_the_libraries_or_says_what_it_needs(tmp_path):
    """With a GPU, PyTorch and CuPy: the picture of docs/pytorch.md, each library's bytes in use
    and held free. Elsewhere: one line naming what is missing, no traceback, status 0."""
    import importlib.util

    svg = tmp_path / "breakdown.svg"
    out = _run("pytorch_breakdown.py", ["--svg", str(svg)])
    assert out.returncode == 0, out.stderr[-3000:]
    assert "Traceback" not in _stderr_without_shutdown_noise(out.stderr), out.stderr[-3000:]
    complete = HAS_GPU and all(importlib.util.find_spec(m) for m in ("torch", "cupy"))
    if not complete:
        assert "it needs" in out.stdout and not svg.exists()
        return
    text = svg.read_text()
    for part in ("torch in use", "torch cache free", "cupy in use", "outside dask-rmm"):
        assert part in text, (part, out.stdout)
