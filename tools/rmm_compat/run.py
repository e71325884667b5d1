"""Run RMM's own Python tests against dask-rmm, one pytest process per test file.

Usage::

    python tools/rmm_compat/run.py RMM_TESTS_DIR OUT_DIR [--timeout 120] [--total-timeout 200]
                                   [--jobs 4] [-k NAME] [pytest args...]

``RMM_TESTS_DIR`` holds RMM's ``python/rmm/rmm/tests/*.py`` (not part of this repository: copy
them from RMM's sources at the tag the API follows, e.g.
``git -C rmm archive v26.06.00 python/rmm/rmm/tests | tar -x --strip-components=4 -C DIR``). Every file runs in its own process with
``-p rmm_shim`` (see ``rmm_shim.py``), so a crash costs one file, and under a timeout. Writes
``OUT_DIR/<file>.log``, ``OUT_DIR/<file>.xml`` (JUnit) and ``OUT_DIR/summary.json``, and prints
a table: passed / failed / errors / skipped per file, and whether the process crashed.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
import xml.etree.ElementTree as ET
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

HERE = Path(__file__).resolve().parent
REPO = HERE.parent.parent


def counts_from_junit(path: Path) -> dict[str, int]:
    """passed/failed/errors/skipped from a JUnit file pytest wrote, one outcome per test (a
    test whose teardown errored after its call failed appears twice there: counted failed)."""
    outcome: dict[tuple[str, str], str] = {}
    rank = {"passed": 0, "skipped": 1, "errors": 2, "failed": 3}
    root = ET.parse(path).getroot()
    for case in root.iter("testcase"):
        kinds = {child.tag for child in case}
        if "failure" in kinds:
            kind = "failed"
        elif "error" in kinds:
            kind = "errors"
        elif "skipped" in kinds:
            kind = "skipped"
        else:
            kind = "passed"
        key = (case.get("classname", ""), case.get("name", ""))
        if rank[kind] >= rank[outcome.get(key, "passed")]:
            outcome[key] = kind
    out = {"passed": 0, "failed": 0, "errors": 0, "skipped": 0}
    for kind in outcome.values():
        out[kind] += 1
    return out


def failures_from_junit(path: Path) -> list[str]:
    """``test id: first line of the message`` for each failed or erroring test."""
    lines = []
    root = ET.parse(path).getroot()
    for case in root.iter("testcase"):
        for child in case:
            if child.tag in ("failure", "error"):
                msg = (child.get("message") or "").splitlines()
                lines.append(f"{case.get('name')} [{child.tag}]: {msg[0][:200] if msg else ''}")
    return lines


def run_file(test: Path, out_dir: Path, timeout: float, extra: list[str]) -> dict:
    xml = out_dir / f"{test.stem}.xml"
    log = out_dir / f"{test.stem}.log"
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(
        [str(HERE), str(REPO), str(test.parent)] + [p for p in [env.get("PYTHONPATH")] if p]
    )
    cmd = [
        sys.executable,
        "-m",
        "pytest",
        "-p",
        "rmm_shim",
        "-p",
        "no:cacheprovider",
        "-q",
        "-rfE",
        f"--junitxml={xml}",
        str(test.name),
        *extra,
    ]
    start = time.monotonic()
    try:
        with open(log, "wb") as f:
            proc = subprocess.run(
                cmd, cwd=test.parent, env=env, stdout=f, stderr=subprocess.STDOUT, timeout=timeout
            )
        rc = proc.returncode
    except subprocess.TimeoutExpired:
        rc = "timeout"
    result = {"file": test.name, "rc": rc, "seconds": round(time.monotonic() - start, 1)}
    if xml.exists():
        try:
            result.update(counts_from_junit(xml))
            result["problems"] = failures_from_junit(xml)
        except ET.ParseError:
            result["problems"] = ["junit xml unreadable"]
    # pytest's own codes are 0..5; a negative code is a signal (SIGSEGV is -11).
    result["crashed"] = rc == "timeout" or (isinstance(rc, int) and (rc < 0 or rc > 5))
    if (
        isinstance(rc, int)
        and rc in (2, 3, 4)
        and not any(result.get(k) for k in ("passed", "failed", "skipped"))
    ):
        result["problems"] = result.get("problems", []) + [
            "collection or plugin error: see the .log"
        ]
    return result


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("tests", type=Path)
    parser.add_argument("out", type=Path)
    parser.add_argument("--timeout", type=float, default=120.0, help="seconds per file")
    parser.add_argument(
        "--total-timeout",
        type=float,
        default=None,
        help="stop starting files after this many seconds",
    )
    parser.add_argument("-k", default=None, help="only files whose name contains this")
    parser.add_argument("--jobs", type=int, default=1, help="files run at the same time")
    args, extra = parser.parse_known_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    files = sorted(
        p
        for p in args.tests.glob("test_*.py")
        if p.name != "test_helpers.py" and (not args.k or args.k in p.name)
    )
    start = time.monotonic()

    def one(test: Path) -> dict:
        remaining = None
        if args.total_timeout:
            remaining = args.total_timeout - (time.monotonic() - start)
            if remaining <= 5:
                return {"file": test.name, "rc": "not run (total timeout)", "crashed": False}
        timeout = args.timeout if remaining is None else min(args.timeout, remaining)
        r = run_file(test, args.out, timeout, extra)
        print(
            f"{r['file']:<48} passed={r.get('passed', 0):<4} failed={r.get('failed', 0):<3} "
            f"errors={r.get('errors', 0):<3} skipped={r.get('skipped', 0):<3} rc={r['rc']}"
            f"{'  CRASH' if r['crashed'] else ''}",
            flush=True,
        )
        return r

    # Longest files first, so that parallel runs end together.
    files.sort(key=lambda p: -p.stat().st_size)
    with ThreadPoolExecutor(max_workers=max(1, args.jobs)) as pool:
        results = sorted(pool.map(one, files), key=lambda r: r["file"])
    totals = {
        k: sum(r.get(k, 0) for r in results) for k in ("passed", "failed", "errors", "skipped")
    }
    ran = totals["passed"] + totals["failed"] + totals["errors"]
    totals["crashed_files"] = [r["file"] for r in results if r["crashed"]]
    totals["pass_rate"] = round(totals["passed"] / ran, 4) if ran else None
    print(
        f"TOTAL passed={totals['passed']} failed={totals['failed']} errors={totals['errors']} "
        f"skipped={totals['skipped']} pass_rate={totals['pass_rate']} "
        f"crashed={totals['crashed_files']}"
    )
    for r in results:
        for problem in r.get("problems", []):
            print(f"  {r['file']}: {problem}")
    (args.out / "summary.json").write_text(
        json.dumps({"totals": totals, "files": results}, indent=1)
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
