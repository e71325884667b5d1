#!/usr/bin/env bash
# One batch on a GPU host: the whole test suite, the quickstart, then the benchmarks. Logs go to
# $OUT when set (the device tool's folder), else to bench/out/ (ignored by git: run logs stay out
# of the repository; the current figures are in bench/README.md).
# Usage, from the repository root:   bash bench/gpu_run.sh [tests|bench|tiers|torch|all]
set -uo pipefail
what=${1:-all}
out=${OUT:-bench/out}
mkdir -p "$out"
{
  nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
  python3 -c "import sys, cuda.bindings, cupy, numba; print('python', sys.version.split()[0], 'cuda-bindings', cuda.bindings.__version__, 'cupy', cupy.__version__, 'numba', numba.__version__)"
  lscpu | grep -E "Model name"; date -u; git log --oneline -1 2>/dev/null || true
} 2>&1 | tee "$out/env.txt"
if [ "$what" = tests ] || [ "$what" = all ]; then
  # One xdist worker: tests run one at a time, and a test that crashes the interpreter is
  # reported as failed while the rest of the suite goes on in a fresh worker.
  timeout 330 python3 -m pytest -q -ra -n 1 --max-worker-restart 10 -p no:cacheprovider \
    --timeout 240 tests 2>&1 | tee "$out/gpu-tests.log" | tail -30
  echo "== quickstart" | tee -a "$out/env.txt"
  timeout 60 python3 examples/quickstart.py 2>&1 | tee -a "$out/env.txt" | tail -25
fi
if [ "$what" = tiers ]; then
  # Library caches against the per-allocation path and the peers (on a host with cuDF
  # installed, add it: TIERS_WORKLOADS=cupy,torch,cudf).
  timeout 200 python3 bench/gil_profile.py --threads 4 2>&1 | tee "$out/gil_profile.txt"
  timeout 520 python3 bench/tiers.py --workloads "${TIERS_WORKLOADS:-cupy,torch}" \
    --json "$out/tiers.json" 2>&1 | tee "$out/tiers.txt"
fi
if [ "$what" = torch ]; then
  # PyTorch's own cache under the worker's budget (issue 35): speed, 60 s stress, fill, Dask.
  timeout 280 python3 bench/torch_budget.py --mlp --stress 60 --fill --rounds 3 --steps 60 \
    --json "$out/torch_budget.json" 2>&1 | tee "$out/torch_budget.txt"
  timeout 120 python3 bench/torch_budget.py --dask --rounds 3 --steps 60 --tasks 8 \
    --json "$out/torch_dask.json" 2>&1 | tee "$out/torch_dask.txt"
fi
if [ "$what" = bench ] || [ "$what" = all ]; then
  timeout 110 python3 bench/alloc.py --out "$out/alloc.json" 2>&1 | tee "$out/alloc.txt"
  { timeout 70 python3 bench/stats_overhead.py 100000; timeout 30 python3 bench/attribution_overhead.py;
    timeout 30 python3 bench/plugin_metrics.py --base cuda; } 2>&1 | tee "$out/overheads.txt"
  timeout 40 python3 bench/cupy_churn.py 2>&1 | tee "$out/cupy_churn.txt"
  timeout 120 python3 bench/pool_mechanisms.py --steps 50000 --rounds 5 \
    --json "$out/pool_mechanisms.json" 2>&1 | tee "$out/pool_mechanisms.txt"
  timeout 150 python3 bench/dask_workload.py --json "$out/dask_workload.json" 2>&1 | tee "$out/dask_workload.txt"
fi
